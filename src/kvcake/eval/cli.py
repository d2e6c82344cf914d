"""``kvcake eval``: score compression methods on long-context tasks, both scenarios, resumably.

``kvcake.cli`` adds the subcommand with ``configure_parser(subparsers)`` and calls ``run(args)``;
``python -m kvcake.eval ...`` runs the same parser on its own (``main``).

Every (method, budget/ratio, task, length, scenario, sample) cell is appended as one JSON line
to ``--out``; rerunning the same command skips the cells already there. At the end the command
prints a markdown summary (score and KL per method x budget, per scenario) and writes plots next
to the results file (``<stem>_score.png``, ``<stem>_kl.png``, ``<stem>_attn.png``); ``--doc PATH``
also writes a results page. ``--suite results`` is the configuration of ``docs/results.md``
(``scripts/eval_results.sh``); options given explicitly override a suite's. A run that changes what
a suite measures or where its cells go (``--methods``, ``--model``, ``--budgets``, ``--ratios``,
``--tasks``, ``--lengths``, ``--samples``, ``--scenario``, ``--out``) is a part of it: it measures
those cells only, without the suite's CAKE ablation, and leaves the suite's page alone unless
``--doc`` names one (``--report-only`` with the suite alone renders the page from its file).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading
from pathlib import Path

from ..standalone import add_subcommand, log_progress, model_placement, standalone_main, threads
from ..standalone import comma_ints as _ints
from .suites import SUITES, resolve

HELP = "score methods on long-context tasks (JSONL, table, plots)"
EXAMPLES = (
    "kvcake eval --methods full,snapkv,cake --ratios 0.1,0.25 --tasks niah_single --lengths 2k --samples 2",
    "kvcake eval --suite results   # regenerates docs/results.md (about an hour on 2 CPU cores)",
    "kvcake eval --suite kvpress   # docs/kvpress.md, from an environment with kvpress (README: kvcake beside kvpress)",
)


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"ratios must be in (0, 1], got {text!r}")
    return values


def _names(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected at least one name")
    return names


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from kvcake.eval.tasks import TASKS

    p.add_argument("--suite", choices=sorted(SUITES), default=None,
                   help="a named configuration: 'results' is the one of docs/results.md")  # fmt: skip
    p.add_argument("--model", default=None, help="model name or folder (default: kvcake's default model)")
    model_placement(p)
    p.add_argument("--methods", default=None,
                   help="presets or composed specs, comma-separated ('full' = uncompressed baseline); a part "
                        "with '=' continues the previous spec (cake,select=critical); ';' separates "
                        "explicitly; a name ending in +fp8 keeps its entries in float8 (cake+fp8: kvcake.fp8); "
                        "kvpress:<preset> is kvpress's press for it, where kvpress is installed "
                        "(kvpress:snapkv: kvcake.eval.press_cells) (default: full,snapkv,cake)")  # fmt: skip
    p.add_argument("--budgets", type=_ints, default=None, help="average KV entries per layer, e.g. 128,512")
    p.add_argument(
        "--ratios", type=_floats, default=None, help="kept fractions of the prompt, e.g. 0.1,0.25,0.5"
    )
    p.add_argument("--tasks", type=_names, default=None,
                   help=f"synthetic tasks ({', '.join(TASKS)}) or longbench:<dataset> (default: niah_single)")  # fmt: skip
    p.add_argument("--longbench-dir", default=None, help="folder with LongBench's <dataset>.jsonl files")
    p.add_argument("--lengths", type=_ints, default=None,
                   help="prompt lengths in tokens, e.g. 2k,4k (LongBench: truncation lengths)")  # fmt: skip
    p.add_argument("--samples", type=int, default=None, help="samples per task and length (default: 2)")
    p.add_argument("--scenario", choices=("question", "context", "both"), default=None,
                   help="question-aware, context-only or both (default: both)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="base seed of the synthetic samples")
    p.add_argument("--haystack", default="paul_graham", help="paul_graham, noise, or a text file/folder")
    p.add_argument("--needle-style", choices=("restated", "ruler"), default="restated",
                   help="wording of the niah_* needles: 'restated' (default; the 135M default model fails "
                        "RULER's wording on most prompts even with the full cache) or 'ruler'")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=None, help="answer length (default: per task)")
    p.add_argument("--fidelity", action=argparse.BooleanOptionalAction, default=True,
                   help="KL / NLL / perturbation against the full cache (default: on)")  # fmt: skip
    p.add_argument("--fidelity-tokens", type=int, default=16, help="continuation length for --fidelity")
    p.add_argument("--fidelity-feed", choices=("chunk", "steps"), default="chunk",
                   help="how --fidelity feeds a compressed cache the question and continuation: in one forward "
                        "(chunk, default: a decode=fixed preset evicts after it) or as generate does, a token a "
                        "step after the question (steps; its cells are kept apart: 'feed' in each line)")  # fmt: skip
    p.add_argument("--window", type=int, default=32, help="observation window of every method")
    p.add_argument("--prefill", choices=("shared", "direct"), default="shared",
                   help="shared: one full forward per sample replayed into every method's cache (default); "
                        "direct: kvcake.generate/compress per cell")  # fmt: skip
    p.add_argument(
        "--out", default=None, help="results JSONL, appended to and resumed (default: eval-results.jsonl)"
    )
    p.add_argument("--doc", default=None, help="also write a markdown results page here")
    p.add_argument("--threads", type=threads, default=None, help="torch.set_num_threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--tau-sweep", action="store_true",
                   help="also measure CAKE at a grid of fixed temperatures on the same prompts, next to snapkv and "
                        "pyramidkv (kvcake.eval.tau_sweep: an oracle bound on what calibration can reach; about 25 "
                        "minutes per prompt length of the results suite on one core), into <out stem>_tau_sweep.jsonl")  # fmt: skip
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: table, plots and --doc from the cells already in --out")  # fmt: skip
    return p


def configure_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand to ``kvcake``'s ``argparse`` subparsers."""
    return add_subcommand(subparsers, "eval", HELP, __doc__, add_arguments)


def run(args: argparse.Namespace) -> int:
    """Run the evaluation; returns the exit status (0; 2 on bad input)."""
    if threading.current_thread() is not threading.main_thread():
        return _run(args)
    # `kill` ends the run like Ctrl-C: the results file is complete line by line, and the run is
    # logged in <stem>.runs.jsonl (its time counts on the results page)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    import torch

    from kvcake.budget import check_sizes, check_window
    from kvcake.eval.runner import load_records, run_eval, runs_log_path

    log_progress(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    s = resolve(args)
    flags = {"budget": "--budgets", "window": "--window"}
    check_window(args.window, flags)
    for budget in s["budgets"] or ():
        check_sizes(budget, None, args.window, flags)
    if args.tau_sweep and (s["budgets"] or any(str(t).startswith("longbench:") for t in s["tasks"])):
        raise ValueError(
            "--tau-sweep measures synthetic tasks at --ratios: drop --budgets and longbench: tasks"
        )
    argv = getattr(args, "argv", None)
    prefix, argv = ("python -m kvcake.eval", argv) if argv is not None else ("kvcake", sys.argv[1:])
    command = " ".join([prefix, *(shlex.quote(a) for a in argv)]).strip()
    import kvcake
    from kvcake.devices import check_device

    device = check_device(args.device)  # an absent device fails before any work
    model = tokenizer = None
    model_name = args.model
    if args.model is not None or device.type != "cpu" or args.dtype != "float32":
        model_name = args.model or kvcake.DEFAULT_MODEL
        model, tokenizer = kvcake.load_model(model_name, device=device, dtype=getattr(torch, args.dtype))
    if s["more_samples"] and model is None:  # two runs: load the model once
        model_name = kvcake.DEFAULT_MODEL
        model, tokenizer = kvcake.load_model(model_name)
    common = dict(
        budgets=s["budgets"], ratios=s["ratios"], tasks=s["tasks"], lengths=s["lengths"], scenario=s["scenario"],
        seed=args.seed, haystack=args.haystack, needle_style=args.needle_style, max_new_tokens=args.max_new_tokens,
        fidelity=args.fidelity, fidelity_tokens=args.fidelity_tokens, feed=args.fidelity_feed, window=args.window,
        out=s["out"], longbench_dir=args.longbench_dir, prefill=args.prefill, progress=not args.no_progress, command=command,
        compute=not args.report_only,
    )  # fmt: skip
    result = run_eval(
        model, tokenizer, model_name=model_name, methods=s["methods"], samples=s["samples"], **common
    )
    if s["more_samples"]:  # the suite's further samples of some methods (suites.py: more_samples)
        result = _more_samples(result, model, tokenizer, model_name, s, common)
    print(result.table, flush=True)
    print(
        f"{result.new} new cells, {result.skipped} resumed, in {result.seconds / 60:.1f} min -> {result.path}; "
        f"plots: {', '.join(str(p) for p in result.plots) or 'none'}",
        flush=True,
    )
    if result.missing:
        print(f"{result.missing} requested cells are not in {result.path} yet (rerun without --report-only)")
    if s["narrowed"]:
        print(
            f"{' '.join(s['narrowed'])}: a part of --suite {args.suite}, so its CAKE ablation was not run"
            + ("" if s["doc"] else " and its page was left alone (--doc PATH writes a page of these cells)"),
            flush=True,
        )
    if args.tau_sweep:
        _run_sweep(args, s, result.path)
    from kvcake.eval.fp8_section import fp8_section

    stored = fp8_section(result.records)  # "" without +fp8 methods
    if s["ablation"]:
        from kvcake.eval.ablation import run_section

        sections = run_section(
            s, args, command, Path(str(s["doc"])) if s["doc"] else None, args.report_only, result.records
        )
        s["notes"] = "\n\n".join(part for part in (sections, stored, s["notes"]) if part)
    elif s["targets"] and s["doc"]:  # a part of the results suite: the targets on its own cells
        from kvcake.eval.ablation import targets_section

        s["notes"] = "\n\n".join(part for part in (targets_section(result.records), stored) if part)
    elif stored:
        s["notes"] = "\n\n".join(part for part in (stored, s["notes"]) if part)
    if s["doc"]:
        from kvcake.eval.report import render_page
        from kvcake.eval.section import keep_sections, write_section

        doc = Path(str(s["doc"]))
        doc.parent.mkdir(parents=True, exist_ok=True)
        runs = load_records(runs_log_path(result.path))
        if args.report_only and runs and runs[-1].get("command"):
            command = page_command(runs, bool(args.suite))
        page = render_page(
            result.records,
            figures=result.plots,
            doc=doc,
            methods=list(s["methods"]),
            command=command,
            runs=runs,
            intro=str(s.get("intro") or ""),
            notes=str(s.get("notes") or ""),
            missing=result.missing,
        )
        if s["section"]:  # a further model of the same page (eval/section.py)
            write_section(doc, str(s["section"]), str(s["title"]), page)
        else:
            doc.write_text(keep_sections(doc, page))
        print(f"wrote {doc}", flush=True)
    return 0


def page_command(runs: list[dict], suite: bool) -> str:
    """The command a ``--report-only`` page shows: the last run's (the one that computed the cells),
    or for a suite its own last command, where later runs computed parts of it (not its ablation's)."""
    from kvcake.eval.ablation import RUN_TAG
    from kvcake.eval.suites import NARROWING

    last = str(runs[-1]["command"])
    if not suite:
        return last
    narrowing = tuple(f"--{name}" for name in NARROWING)  # a part of the suite, not the suite
    commands = (str(r.get("command")) for r in reversed(runs))
    return next(
        (c for c in commands if "--suite" in c and not c.endswith(RUN_TAG) and not any(
            word.split("=")[0] in narrowing for word in c.split())),
        last,
    )  # fmt: skip


def _more_samples(result, model, tokenizer, model_name, s: dict[str, object], common: dict):
    """The first run's result with the cells of the suite's ``more_samples`` run added: its
    methods at more samples per task and length, into the same results file."""
    from kvcake.eval.records import cell_key
    from kvcake.eval.report import summary_markdown, write_plots
    from kvcake.eval.runner import run_eval

    methods, samples = s["more_samples"]
    more = run_eval(
        model, tokenizer, model_name=model_name, methods=methods, samples=samples, report=False, **common
    )
    seen = {cell_key(r) for r in result.records}
    result.records += [r for r in more.records if cell_key(r) not in seen]
    result.new, result.skipped = result.new + more.new, result.skipped + more.skipped
    result.missing += more.missing
    result.seconds += more.seconds
    result.table = summary_markdown(result.records, methods=list(s["methods"]))
    result.plots = write_plots(result.records, result.path.with_suffix(""), methods=list(s["methods"]))
    return result


def _run_sweep(args: argparse.Namespace, s: dict[str, object], results: Path) -> None:
    """``--tau-sweep``: the oracle temperature sweep on the run's prompts (synthetic tasks, ratios)."""
    import torch

    import kvcake
    from kvcake.eval.records import load_records
    from kvcake.eval.tau_sweep import run_sweep, sweep_markdown, sweep_path, with_shipped

    model, tokenizer = kvcake.load_model(args.model or kvcake.DEFAULT_MODEL, device=args.device,
                                         dtype=getattr(torch, args.dtype))  # fmt: skip
    records = run_sweep(
        model, tokenizer, tasks=tuple(s["tasks"]), lengths=tuple(s["lengths"]), samples=int(s["samples"]),
        ratios=tuple(s["ratios"]), out=sweep_path(results), seed=args.seed, haystack=args.haystack,
        needle_style=args.needle_style, window=args.window, fidelity_tokens=args.fidelity_tokens,
        compute=not args.report_only, progress=not args.no_progress,
    )  # fmt: skip
    print(sweep_markdown(with_shipped(model, records, load_records(results))), flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvcake.eval``."""
    return standalone_main("python -m kvcake.eval", __doc__, add_arguments, run, argv)
