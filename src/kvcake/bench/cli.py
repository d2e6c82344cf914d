"""``kvcake bench {memory,prefill,decode,bandwidth,all,gpu}``: the benchmarks from the command line.

``kvcake.cli`` adds the subcommand with ``configure_parser(subparsers)`` and calls ``run(args)``;
``python -m kvcake.bench ...`` runs the same parser on its own (``main``). Every bench prints its
markdown tables, writes ``OUT/<bench>.json`` and ``OUT/<bench>.png``; ``--doc PATH`` also renders
the results into a markdown page (``docs/benchmarks.md`` is made this way by
``scripts/bench_all.sh``). ``gpu`` is its own run (``kvcake.bench.gpu``): every preset and the
full cache at its best on a random model of ``--shape``, written to ``docs/benchmarks-gpu.md``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import shlex
import sys
import time
from pathlib import Path

from ..standalone import add_subcommand, log_progress, standalone_main, threads
from ..standalone import comma_ints as _ints

HELP = "memory / prefill / decode benchmarks (JSON, PNG, markdown)"
EXAMPLES = (
    "kvcake bench memory --lengths 1024,2048,4096 --out bench-results",
    "kvcake bench decode --lengths 4k,16k --budgets 128,512 --methods snapkv,cake,adakv",
    "kvcake bench all --quick --out bench-results",
    "kvcake bench gpu --device cuda   # docs/benchmarks-gpu.md: llama-3.1-8b shape, 8k/32k/128k, budget 1024",
    "kvcake bench gpu --device cpu --shape tiny --lengths 256 --budget 64 --doc /tmp/gpu.md   # smoke run",
)

BENCHES = ("bandwidth", "memory", "prefill", "decode", "all", "report", "gpu")  # "all": the first four

# Defaults sized so that `bench all` takes about a quarter of an hour on two CPU cores (see
# docs/benchmarks.md for the measured time); --quick is a minute-scale smoke run.
DEFAULTS = {
    "memory_lengths": (1024, 2048, 4096, 8192, 16384),
    "rss_lengths": (4096,),
    "prefill_lengths": (4096, 8192),
    "decode_lengths": (1024, 4096, 8192, 16384),
    "budget": 128,
    "budgets": (128, 512),
    "repeats": 3,
    "steps": 12,
    "rounds": 3,
    "bandwidth_mib": 1024,
}
QUICK = {
    "memory_lengths": (512, 1024),
    "rss_lengths": (1024,),
    "prefill_lengths": (1024,),
    "decode_lengths": (512, 1024, 2048),
    "budget": 128,
    "budgets": (128,),
    "repeats": 2,
    "steps": 6,
    "rounds": 2,
    "bandwidth_mib": 256,
}


def _names(text: str) -> tuple[str, ...]:
    # Method specs may contain commas ("snapkv,decode=fixed"): separate several with ';'.
    sep = ";" if ";" in text else ","
    names = tuple(x.strip() for x in text.split(sep) if x.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected at least one method")
    return names


def _rss_lengths(text: str) -> tuple[int, ...]:
    return () if text.strip().lower() == "none" else _ints(text)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("which", choices=BENCHES,
                   help="which benchmark to run ('all': every one; 'report': redraw the figures and rewrite "
                        "--doc from the JSON already in --out, measuring nothing)")  # fmt: skip
    p.add_argument("--model", default=None, help="model name or folder (default: kvcake's default model)")
    p.add_argument("--lengths", type=_ints, default=None,
                   help="prompt/context lengths of the memory, prefill, decode and gpu benches, e.g. 1024,2048,4096 "
                        "(4k works too; not the process-memory runs: --rss-lengths); longer than the "
                        "model's positions runs a random model of its shape")  # fmt: skip
    p.add_argument(
        "--memory-lengths", type=_ints, default=None, help="lengths of the memory bench (default: --lengths)"
    )
    p.add_argument("--rss-lengths", type=_rss_lengths, default=None,
                   help="lengths of the per-method process-memory runs, a fresh process each (default: 4096, "
                        "--quick 1024; not --lengths; 'none': no such runs)")  # fmt: skip
    p.add_argument(
        "--prefill-lengths",
        type=_ints,
        default=None,
        help="lengths of the prefill bench (default: --lengths)",
    )
    p.add_argument(
        "--decode-lengths", type=_ints, default=None, help="lengths of the decode bench (default: --lengths)"
    )
    p.add_argument("--methods", type=_names, default=None,
                   help="method presets or composed specs, comma-separated (';' if a spec has commas); "
                        "a name ending in +fp8 stores its kept entries in float8 (snapkv+fp8: kvcake.fp8); "
                        "the full cache is always included")  # fmt: skip
    p.add_argument("--budget", type=int, default=None, help="average KV entries per layer (memory, prefill)")
    p.add_argument("--budgets", type=_ints, default=None, help="budgets for the decode bench, e.g. 128,512")
    p.add_argument(
        "--policies", type=_names, default=("fixed", "none"),
        help="decoding policies (decode bench): fixed, none, or preset (each method's own)",
    )  # fmt: skip
    p.add_argument("--window", type=int, default=32, help="observation window")
    p.add_argument("--repeats", type=int, default=None, help="rounds of alternating prefill runs")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per cache")
    p.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds the decode steps are spread over"
    )
    p.add_argument("--bandwidth-mib", type=int, default=None, help="size of the bandwidth probe tensor")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda[:N]")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="auto: float32 on CPU, bfloat16 on CUDA")  # fmt: skip
    p.add_argument(
        "--threads", type=threads, default=None, help="torch.set_num_threads (default: torch's own)"
    )
    p.add_argument("--out", default="bench-results", help="folder for <bench>.json and <bench>.png")
    p.add_argument("--doc", default=None, help="also write a markdown page with every table and figure")
    p.add_argument("--add", action="store_true",
                   help="memory/prefill/decode: merge this run's rows into the results already in --out (rows of "
                        "the same method and length replaced, decode: every row at this run's lengths; targets "
                        "recomputed) instead of replacing them; "
                        "with --doc, rewrite the page from every result in --out")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="small lengths and few repeats: a smoke run")
    p.add_argument("--compile-only", type=_names, default=None,
                   help="decode bench: time the compiled step of these caches only (full-static and presets, "
                        "comma-separated); implies --compile")  # fmt: skip
    p.add_argument("--counts", action="store_true",
                   help="decode bench: also the per-step counts of every preset (ATen ops, host syncs, compiled "
                        "graphs; kvcake.bench.step_counts), on the page")  # fmt: skip
    g = p.add_argument_group("gpu", "the 'gpu' bench (its defaults: --lengths 8k,32k,128k --budget 1024, every preset, "
                             "--rounds 3 --steps 8 --doc docs/benchmarks-gpu.md)")  # fmt: skip
    g.add_argument(
        "--shape", default="llama-3.1-8b", help="random-weight model shape (kvcake.bench.shapes.SHAPES)"
    )
    g.add_argument("--merge", action="store_true",
                   help="keep the rows of OUT/gpu.json at other lengths (one command per length, e.g. under a "
                        "10-minute limit); the page shows them all")  # fmt: skip
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="also time the compiled decode step (torch.compile, fullgraph; default: on for the gpu "
                        "bench, off for the decode bench)")  # fmt: skip
    g.add_argument("--kvpress", type=_names, default=(),
                   help="also kvpress's presses for these presets, e.g. snapkv,adakv or 'all' (rows kvpress:<preset>; "
                        "needs kvpress installed: kvcake.bench.kvpress_rows)")  # fmt: skip
    return p


def configure_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``kvcake``'s ``argparse`` subparsers."""
    return add_subcommand(subparsers, "bench", HELP, __doc__, add_arguments)


def _setting(args, name: str):
    given = getattr(args, name, None)
    if given is not None:
        return given
    if name.endswith("_lengths") and name != "rss_lengths" and args.lengths is not None:
        return args.lengths
    return (QUICK if args.quick else DEFAULTS)[name]


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad ``--methods``, ``--budget(s)``, ``--policies`` or ``--steps``/``--rounds`` before any
    model is loaded (a typo cost the model's load, then an error from inside the bench): each spec
    is parsed as the bench will build it, at each budget."""
    from ..budget import check_sizes
    from ..fp8 import storage_spec
    from ..method import FULL, make_method
    from .decode import POLICIES

    specs = [storage_spec(name)[0] for name in args.methods or ()]
    compressed = [spec for spec in specs if spec.strip().lower() != FULL]
    if specs and not compressed:
        raise ValueError(f"--methods {','.join(args.methods)}: the full cache is always measured; name the "
                         "compressed methods to compare with it, e.g. --methods snapkv,cake")  # fmt: skip
    budgets = [("--budget", _setting(args, "budget"))] + [("--budgets", b) for b in _setting(args, "budgets")]
    for flag, budget in budgets:  # (a budget counts the window's entries too)
        check_sizes(budget, None, args.window, names={"budget": flag, "window": "--window"})
    for spec, budget in itertools.product(compressed, sorted({b for _, b in budgets})):
        make_method(spec, budget=budget, window=args.window)
    if bad := [p for p in args.policies if p not in POLICIES]:
        raise ValueError(
            f"--policies: unknown decoding policies {bad}; use fixed, none or preset (the method's own)"
        )
    steps, rounds = _setting(args, "steps"), _setting(args, "rounds")
    if args.which in ("decode", "all") and (rounds < 1 or steps < rounds):
        raise ValueError(f"--steps {steps} --rounds {rounds}: the timed steps are spread over the rounds, so "
                         "--rounds must be at least 1 and --steps at least --rounds")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Run the bench(es) named by ``args.which``; returns the exit status (0; 2 on bad input)."""
    import torch

    from . import bandwidth, decode, memory, speed
    from .common import (
        DTYPES,
        PREFILL_METHODS,
        describe_machine,
        load_models,
        machine_lines,
        pick_device,
        write_json,
    )

    log_progress(args)
    if args.which == "report":
        return _report(args)
    try:
        check_arguments(args)
        device = pick_device(args.device)
    except (ValueError, RuntimeError) as err:
        print(f"kvcake bench: {err}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    auto = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else auto
    out = Path(args.out)
    if args.which == "gpu":
        return _run_gpu(args, device, dtype, out)
    started = time.perf_counter()
    which = BENCHES[:4] if args.which == "all" else (args.which,)
    if args.add and any(b not in ("memory", "prefill", "decode") for b in which):
        print(
            f"kvcake bench: --add merges the memory, prefill and decode benches, not {args.which}",
            file=sys.stderr,
        )
        return 2
    models = None if which == ("bandwidth",) else load_models(args.model, device=device, dtype=dtype)
    attn = models.model.config._attn_implementation if models else "-"
    machine = describe_machine(device, dtype, attn)
    print(
        "\n".join(
            ["# kvcake bench " + args.which, "", *(f"- {line}" for line in machine_lines(machine)), ""]
        ),
        flush=True,
    )
    budget = _setting(args, "budget")
    methods = args.methods
    results: dict[str, dict] = {}
    bw_bytes = _setting(args, "bandwidth_mib") * 2**20
    for bench in which:
        print(f"\n## {bench}\n", flush=True)
        t0 = time.perf_counter()
        path = out / f"{bench}.json"
        previous = (
            json.loads(path.read_text()) if args.add and path.exists() else None
        )  # before the run rewrites it
        if bench == "bandwidth":
            results[bench] = bandwidth.run(device, size_bytes=bw_bytes, out=out, machine=machine)
        elif bench == "memory":
            results[bench] = memory.run(
                models, lengths=_setting(args, "memory_lengths"), methods=methods or PREFILL_METHODS,
                budget=budget, rss_lengths=_setting(args, "rss_lengths"), window=args.window, out=out,
                machine=machine,
            )  # fmt: skip
        elif bench == "prefill":
            results[bench] = speed.run_prefill(
                models, lengths=_setting(args, "prefill_lengths"), methods=methods or speed.PREFILL_TIME_METHODS,
                budget=budget, repeats=_setting(args, "repeats"), window=args.window, out=out, machine=machine,
            )  # fmt: skip
        else:
            results[bench] = decode.run_decode(
                models, lengths=_setting(args, "decode_lengths"), methods=methods or decode.DECODE_METHODS,
                budgets=_setting(args, "budgets"), policies=args.policies, steps=_setting(args, "steps"),
                rounds=_setting(args, "rounds"), window=args.window, bandwidth_bytes=bw_bytes, out=out,
                compile=bool(args.compile or args.compile_only), compile_only=args.compile_only, counts=args.counts,
                machine=machine,
            )  # fmt: skip
        results[bench]["seconds"] = time.perf_counter() - t0
        if previous is not None:
            from .merge import merge

            results[bench] = merge(bench, previous, results[bench])
            write_json(path, results[bench])
            plots = {"memory": memory.plot, "prefill": speed.plot_prefill, "decode": decode.plot_decode}
            plots[bench](results[bench], out / f"{bench}.png")
            print(f"merged into {path}", flush=True)
    total = time.perf_counter() - started
    print(
        f"\nwrote {', '.join(str(out / f'{b}.json') for b in results)} (+ .png) in {total / 60:.1f} min",
        flush=True,
    )
    if args.add and (out / "run.json").exists():  # the page lists the runs merged since its own
        argv = getattr(args, "argv", None)
        prefix, argv = ("python -m kvcake.bench", argv) if argv is not None else ("kvcake", sys.argv[1:])
        run_info = json.loads((out / "run.json").read_text())
        added = dict(command=" ".join([prefix, *(shlex.quote(a) for a in argv)]), total_s=total,
                     date=datetime.date.today().isoformat())  # fmt: skip
        run_info["added"] = [*run_info.get("added", []), added]
        # a bench the page's own run did not have joins it (the page reads the benches listed here)
        run_info["benches"] = [*run_info["benches"], *(b for b in results if b not in run_info["benches"])]
        write_json(out / "run.json", run_info)
    if args.doc and args.add:  # the page from every result in --out, as `report` writes it
        return _report(args)
    if args.doc:
        from .output import kept_preamble
        from .report import render

        doc = Path(args.doc)
        run_info = dict(command=_command(args), total_s=total, date=datetime.date.today().isoformat(), machine=machine,
                        benches=list(results), doc=str(doc))  # fmt: skip
        write_json(out / "run.json", run_info)
        doc.parent.mkdir(parents=True, exist_ok=True)
        page = render(results, figures=out, doc=doc, preamble=kept_preamble(doc), **_render_args(run_info))
        doc.write_text(page)
        print(f"wrote {doc}", flush=True)
    return 0


def _command(args: argparse.Namespace) -> str:
    argv = getattr(args, "argv", None)
    prefix, argv = ("python -m kvcake.bench", argv) if argv is not None else ("kvcake", sys.argv[1:])
    return " ".join([prefix, *(shlex.quote(a) for a in argv)])


def _run_gpu(args: argparse.Namespace, device, dtype, out: Path) -> int:
    """``bench gpu``: measure, print the table, write ``OUT/gpu.json`` and the page."""
    import torch

    from ..method import PRESETS
    from .common import describe_machine, machine_lines, write_json
    from .gpu import GpuSettings, driver_version, gpu_table, merge, render_page, run_gpu
    from .kvpress_rows import PRESSES, release

    settings = GpuSettings(
        shape=args.shape, lengths=tuple(args.lengths or GpuSettings.lengths), budget=args.budget or GpuSettings.budget,
        methods=tuple(m for m in (args.methods or PRESETS) if m != "full"), rounds=args.rounds or GpuSettings.rounds,
        steps=args.steps or GpuSettings.steps, window=args.window, compile=args.compile is not False,
        kvpress=tuple(PRESSES) if args.kvpress == ("all",) else args.kvpress,
    )  # fmt: skip
    machine = describe_machine(device, dtype, "sdpa") | {
        "driver": driver_version(),
        "cuda": torch.version.cuda,
    }
    if settings.kvpress:
        machine["kvpress"] = release()
    print(
        "\n".join(["# kvcake bench gpu", "", *(f"- {line}" for line in machine_lines(machine)), ""]),
        flush=True,
    )
    started = time.perf_counter()
    result = run_gpu(settings, device=device, dtype=dtype)
    total = time.perf_counter() - started
    result["machine"] = machine
    result["runs"] = [dict(command=_command(args), date=datetime.date.today().isoformat(), total_s=total)]
    print(gpu_table(result), flush=True)
    if args.merge and (out / "gpu.json").is_file():
        result = merge(json.loads((out / "gpu.json").read_text()), result)
    write_json(out / "gpu.json", result)
    doc = Path(args.doc or "docs/benchmarks-gpu.md")
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(render_page(result, machine))
    print(f"wrote {out / 'gpu.json'} and {doc} in {total / 60:.1f} min", flush=True)
    return 0


def _render_args(run_info: dict) -> dict:
    keys = ("machine", "command", "total_s", "date")
    return {**{k: run_info[k] for k in keys}, "added": run_info.get("added")}


def _report(args: argparse.Namespace) -> int:
    """Redraw the figures and rewrite the page from ``OUT/*.json`` (after a change to the report)."""
    from . import bandwidth, decode, memory, speed
    from .output import kept_preamble
    from .report import render

    out = Path(args.out)
    try:
        run_info = json.loads((out / "run.json").read_text())
        results = {b: json.loads((out / f"{b}.json").read_text()) for b in run_info["benches"]}
    except (OSError, ValueError, KeyError) as err:
        print(f"kvcake bench report: no complete results in {out} ({err}); run 'all' with --doc first",
              file=sys.stderr)  # fmt: skip
        return 2
    plots = {"memory": memory.plot, "prefill": speed.plot_prefill, "decode": decode.plot_decode}
    for bench, result in results.items():
        if bench in plots:
            plots[bench](result, out / f"{bench}.png")
        elif bench == "bandwidth":
            bandwidth.plot(result, out / "bandwidth.png")
    doc = Path(args.doc or run_info["doc"])
    page = render(results, figures=out, doc=doc, preamble=kept_preamble(doc), **_render_args(run_info))
    doc.write_text(page)
    print(f"wrote {doc} from {out}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvcake.bench``."""
    return standalone_main("python -m kvcake.bench", __doc__, add_arguments, run, argv)
