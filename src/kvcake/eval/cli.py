"""``kvcake eval``: score compression methods on long-context tasks, both scenarios, resumably.

``kvcake.cli`` adds the subcommand with ``configure_parser(subparsers)`` and calls ``run(args)``;
``python -m kvcake.eval ...`` runs the same parser on its own (``main``).

Every (method, budget/ratio, task, length, scenario, sample) cell is appended as one JSON line
to ``--out``; rerunning the same command skips the cells already there. At the end the command
prints a markdown summary (score and KL per method x budget, per scenario) and writes plots next
to the results file (``<stem>_score.png``, ``<stem>_kl.png``, ``<stem>_attn.png``); ``--doc PATH``
also writes a results page. ``--suite results`` is the configuration of ``docs/results.md``
(``scripts/eval_results.sh``); options given explicitly override a suite's.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import sys
import threading
from pathlib import Path

EXAMPLES = (
    "kvcake eval --methods full,snapkv,cake --ratios 0.1,0.25 --tasks niah_single --lengths 2k --samples 2",
    "kvcake eval --suite results   # regenerates docs/results.md (about an hour on 2 CPU cores)",
)

SYNTHETIC_SUITE_TASKS = ("niah_single", "niah_multikey", "variable_tracking")

SUITES: dict[str, dict[str, object]] = {
    "results": {
        "methods": None,  # filled below: the full cache and every preset
        "ratios": (0.1, 0.25, 0.5),
        "tasks": SYNTHETIC_SUITE_TASKS,
        "lengths": (2048, 4096),
        "samples": 2,
        "scenario": "both",
        "out": "docs/figures/eval_results.jsonl",
        "doc": "docs/results.md",
        "intro": (
            "Every kvcake preset at three kept ratios (0.1, 0.25, 0.5 of each prompt), and the full cache, on the "
            "synthetic suite of `kvcake.eval.tasks` with the default model (SmolLM2-135M-Instruct: 30 layers, "
            "9 query and 3 KV heads), in both scenarios. Three tasks that the full cache mostly solves on this "
            "model: `niah_single` and `niah_multikey` with the needles in the *restated* wording (with RULER's "
            "own wording this 135M model misses the one-word needle in most prompts even with the full cache, "
            "which would leave nothing to compare), and `variable_tracking` (one chain of 4 hops; the full cache "
            "names only some of the five variables). 2k and 4k tokens of Paul Graham essays, 2 samples each, "
            "so every cell of the summary tables averages 12 prompts (3 tasks x 2 lengths x 2 samples) and a "
            "score difference of 10 points or less is noise. The other synthetic tasks (`niah_multivalue`, "
            "`niah_multiquery`, `common_words`, `multi_needle_reasoning`) were left out to keep the run near an "
            "hour on two CPU cores: the full cache scored 0 on each of them in a one-sample check, so they "
            "would add fidelity numbers but no task signal."
        ),
    },
}

DEFAULTS: dict[str, object] = {
    "methods": ("full", "snapkv", "cake"),
    "budgets": (),
    "ratios": None,  # 0.25 when no --budgets either
    "tasks": ("niah_single",),
    "lengths": (2048,),
    "samples": 2,
    "scenario": "both",
    "out": "eval-results.jsonl",
    "doc": None,
}


def _ints(text: str) -> tuple[int, ...]:
    """``"1024,2k,4096"`` -> (1024, 2048, 4096): ``k`` means 1024."""
    values = []
    for part in (x.strip().lower() for x in text.split(",") if x.strip()):
        try:
            values.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return tuple(values)


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


def add_arguments(p: argparse.ArgumentParser, standalone: bool = False) -> argparse.ArgumentParser:
    from kvcake.eval.tasks import TASKS

    p.add_argument("--suite", choices=sorted(SUITES), default=None,
                   help="a named configuration: 'results' is the one of docs/results.md")  # fmt: skip
    p.add_argument("--model", default=None, help="model name or folder (default: kvcake's default model)")
    p.add_argument("--methods", default=None,
                   help="presets or composed specs, comma-separated ('full' = uncompressed baseline); a part "
                        "with '=' continues the previous spec (cake,select=critical); ';' separates "
                        "explicitly (default: full,snapkv,cake)")  # fmt: skip
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
    p.add_argument("--window", type=int, default=32, help="observation window of every method")
    p.add_argument("--prefill", choices=("shared", "direct"), default="shared",
                   help="shared: one full forward per sample replayed into every method's cache (default); "
                        "direct: kvcake.generate/compress per cell")  # fmt: skip
    p.add_argument(
        "--out", default=None, help="results JSONL, appended to and resumed (default: eval-results.jsonl)"
    )
    p.add_argument("--doc", default=None, help="also write a markdown results page here")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: table, plots and --doc from the cells already in --out")  # fmt: skip
    if standalone:  # under `kvcake`, the top-level parser owns -v
        p.add_argument("-v", "--verbose", action="count", default=0, help="log progress on stderr")
    return p


def configure_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand to ``kvcake``'s ``argparse`` subparsers."""
    p = subparsers.add_parser("eval", help="score methods on long-context tasks (JSONL, table, plots)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    return add_arguments(p)


def _resolve(args: argparse.Namespace) -> dict[str, object]:
    """The settings: explicit options, then the suite's, then the defaults."""
    from kvcake.method import PRESETS

    suite = dict(SUITES[args.suite]) if args.suite else {}
    if args.suite == "results":
        suite["methods"] = ("full", *PRESETS)
    out: dict[str, object] = {}
    for name, default in DEFAULTS.items():
        given = getattr(args, name, None)
        out[name] = given if given is not None else suite.get(name, default)
    if isinstance(out["methods"], str):
        from kvcake.eval.runner import parse_methods

        out["methods"] = tuple(parse_methods(out["methods"]))
    out["intro"] = suite.get("intro", "")
    out["notes"] = suite.get("notes", "")
    if out["ratios"] is None:
        out["ratios"] = () if out["budgets"] else (0.25,)
    return out


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

    from kvcake.eval.runner import load_records, run_eval, runs_log_path

    package_logger = logging.getLogger("kvcake")
    if getattr(args, "verbose", 0) and not package_logger.handlers:  # `kvcake` configures its own
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        package_logger.addHandler(handler)
        package_logger.setLevel(logging.INFO)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    s = _resolve(args)
    argv = getattr(args, "argv", None)
    prefix, argv = ("python -m kvcake.eval", argv) if argv is not None else ("kvcake", sys.argv[1:])
    command = " ".join([prefix, *(shlex.quote(a) for a in argv)]).strip()
    model = tokenizer = None
    if args.model is not None:
        import kvcake

        model, tokenizer = kvcake.load_model(args.model)
    result = run_eval(
        model, tokenizer, model_name=args.model, methods=s["methods"], budgets=s["budgets"], ratios=s["ratios"],
        tasks=s["tasks"], lengths=s["lengths"], samples=s["samples"], scenario=s["scenario"], seed=args.seed,
        haystack=args.haystack, needle_style=args.needle_style, max_new_tokens=args.max_new_tokens,
        fidelity=args.fidelity, fidelity_tokens=args.fidelity_tokens, window=args.window, out=s["out"],
        longbench_dir=args.longbench_dir, prefill=args.prefill, progress=not args.no_progress, command=command,
        compute=not args.report_only,
    )  # fmt: skip
    print(result.table, flush=True)
    print(
        f"{result.new} new cells, {result.skipped} resumed, in {result.seconds / 60:.1f} min -> {result.path}; "
        f"plots: {', '.join(str(p) for p in result.plots) or 'none'}",
        flush=True,
    )
    if result.missing:
        print(f"{result.missing} requested cells are not in {result.path} yet (rerun without --report-only)")
    if s["doc"]:
        from kvcake.eval.report import render_page

        doc = Path(str(s["doc"]))
        doc.parent.mkdir(parents=True, exist_ok=True)
        runs = load_records(runs_log_path(result.path))
        if args.report_only and runs and runs[-1].get("command"):
            command = runs[-1]["command"]  # the page shows the command that computed the cells
        doc.write_text(
            render_page(
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
        )
        print(f"wrote {doc}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvcake.eval``."""
    parser = argparse.ArgumentParser(
        prog="python -m kvcake.eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser, standalone=True)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.argv = argv
    return run(args)
