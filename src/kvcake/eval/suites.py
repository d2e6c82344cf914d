"""The eval's named configurations (``--suite``): the results pages' settings and hand-written
text, and how explicit command-line options combine with a suite's (:func:`resolve`).

``results`` is ``docs/results.md`` (the default model); ``results-gemma3`` is that page's Gemma-3
section; ``kvpress`` is ``docs/kvpress.md``, kvcake's presets beside kvpress's presses (run from an
environment with kvpress). Each suite's ``notes`` (:mod:`.notes`) are written by hand from a run and printed under its tables.
"""

from __future__ import annotations

import argparse

from .feed_notes import FEED_NOTE
from .kvpress_notes import KVPRESS_INTRO, KVPRESS_NOTES
from .notes import GEMMA3_INTRO, GEMMA3_NOTES, NOTES_RESULTS, WHICH_METHOD
from .rerun_notes import RERUN_NOTE

SYNTHETIC_SUITE_TASKS = ("niah_single", "niah_multikey", "variable_tracking")

# the methods in issue 24's targets (the full cache is every KL's reference)
TARGET_METHODS = ("full", "snapkv", "pyramidkv", "cake", "adakv", "cake-adakv")
# on the default model's page, these also with their kept entries in float8 (kvcake.fp8)
FP8_METHODS = ("snapkv+fp8", "cake+fp8", "adakv+fp8", "layer-defensivekv+fp8")

SUITES: dict[str, dict[str, object]] = {
    "results": {
        "methods": None,  # filled below: the full cache and every preset, and FP8_METHODS
        "ratios": (0.1, 0.25, 0.5),
        "tasks": SYNTHETIC_SUITE_TASKS,
        "lengths": (2048, 4096),
        "samples": 2,
        "scenario": "both",
        "out": "docs/figures/eval_results.jsonl",
        "doc": "docs/results.md",
        "intro": WHICH_METHOD
        + "\n"
        + (
            "Every kvcake preset at three kept ratios (0.1, 0.25, 0.5 of each prompt), and the full cache (four "
            "presets also with their kept entries in float8, `+fp8`: section *Kept entries in float8*), on the "
            "synthetic suite of `kvcake.eval.tasks` with the default model (SmolLM2-135M-Instruct: 30 layers, "
            "9 query and 3 KV heads), in both scenarios. Three tasks that the full cache mostly solves on this "
            "model: `niah_single` and `niah_multikey` with the needles in the *restated* wording (with RULER's "
            "own wording this 135M model misses the one-word needle in most prompts even with the full cache, "
            "which would leave nothing to compare), and `variable_tracking` (one chain of 4 hops; the full cache "
            "scores 30 at 2k tokens and 0 at 4k). 2k and 4k tokens of Paul Graham essays, 2 samples each, "
            "so a cell of the summary tables averages 12 prompts (3 tasks x 2 lengths x 2 samples) and a "
            "score difference of 10 points or less is noise; the methods of issue 24's targets (the full "
            "cache, `snapkv`, `pyramidkv`, `cake`, `adakv`, `cake-adakv`) have 6 samples each, so their cells "
            "average 36 prompts and the targets compare them on those 36. The other synthetic tasks (`niah_multivalue`, "
            "`niah_multiquery`, `common_words`, `multi_needle_reasoning`) were left out to keep the run near an "
            "hour on two CPU cores: the full cache scored 0 on `niah_multivalue`, `common_words` and "
            "`multi_needle_reasoning` in a one-sample check at 2k tokens (`niah_multiquery` was not checked), "
            "so they would add fidelity numbers but little task signal. `scripts/eval_results.sh --threads 1` "
            "runs the command below; one thread because other jobs shared the two cores during the run (two "
            "threads were then 2.5-6x slower)."
        ),
        "notes": NOTES_RESULTS.rstrip("\n") + RERUN_NOTE.rstrip("\n") + FEED_NOTE,
        "ablation": True,  # kvcake.eval.ablation: CAKE's parts and temperatures
        # issue 24's targets compare these on 36 prompts: 6 samples per task and length
        "more_samples": (TARGET_METHODS, 6),
    },
}

SUITES["results-gemma3"] = {
    **SUITES["results"],
    "model": "gemma3-270m",
    "tasks": ("niah_single", "niah_multikey"),
    "lengths": (4096,),
    "samples": 1,
    "out": "docs/figures/eval_results_gemma3.jsonl",
    "section": "gemma3-270m",
    "title": "Gemma-3-270M (hybrid: 15 sliding-window layers, 3 global layers)",
    "intro": GEMMA3_INTRO,
    "notes": GEMMA3_NOTES,
    "ablation": False,  # the CAKE ablation and issue 14's targets are the default model's
    "more_samples": None,
}

# kvcake's presets beside kvpress's presses for them (kvcake.eval.press_cells), and CAKE
KVPRESS_POOLING = "snapkv,score.pooling=avg,score.kernel=5"
KVPRESS_CRITICAL = "criticalkv,score.pooling=avg,score.kernel=5,select.first=kvpress"
KVPRESS_ADAKV = "adakv,score.pooling=avg,score.kernel=5,heads.safeguard=kvpress"
KVPRESS_CRITICAL_ADAKV = (
    "critical-adakv,score.pooling=avg,score.kernel=5,heads.safeguard=kvpress,select.first=kvpress"
)
KVPRESS_PAIRS = ("streamingllm", "snapkv", "pyramidkv", "tova", "criticalkv", "adakv", "critical-adakv")
SUITES["kvpress"] = {
    # and kvcake's presets configured as kvpress's presses are: SnapKV's pooling (average over 5
    # positions; kvcake's default: max over 7), Ada-KV's safeguard (the window counted among its
    # pinned entries), CriticalKV's first stage (the window counted in its half of the budget, and
    # Ada-KV's pinned entries kept in it)
    "methods": (
        "full",
        *(m for preset in KVPRESS_PAIRS for m in (preset, f"kvpress:{preset}")),
        KVPRESS_POOLING,
        KVPRESS_CRITICAL,
        KVPRESS_ADAKV,
        KVPRESS_CRITICAL_ADAKV,
        "cake",
    ),
    "ratios": (0.25,),
    "tasks": SYNTHETIC_SUITE_TASKS,
    "lengths": (2048,),
    "samples": 6,
    "scenario": "both",
    "out": "docs/figures/eval_kvpress.jsonl",
    "doc": "docs/kvpress.md",
    "intro": KVPRESS_INTRO,
    "notes": KVPRESS_NOTES,
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
# the options of DEFAULTS that narrow a suite (see resolve)
NARROWING = ("methods", "budgets", "ratios", "tasks", "lengths", "samples", "scenario", "out")


def resolve(args: argparse.Namespace) -> dict[str, object]:
    """The settings: explicit options, then the suite's, then the defaults."""
    from kvcake.method import PRESETS

    suite = dict(SUITES[args.suite]) if args.suite else {}
    if args.suite in ("results", "results-gemma3"):
        suite["methods"] = ("full", *PRESETS, *(FP8_METHODS if args.suite == "results" else ()))
    # Options that change what a suite measures or where it goes: with any of them the run is a
    # part of the suite (one variant on its prompts, a subset of its cells), so it writes neither
    # the suite's page nor its CAKE ablation cells; an explicit --doc writes a page of its cells
    # (with issue 14's targets table where the suite has one, without the suite's text).
    narrowed = [f"--{n}" for n in (*NARROWING, "model") if args.suite and getattr(args, n, None) is not None]
    if args.model is None and suite.get("model"):
        args.model = suite["model"]
    out: dict[str, object] = {}
    for name, default in DEFAULTS.items():
        given = getattr(args, name, None)
        out[name] = given if given is not None else suite.get(name, default)
    if isinstance(out["methods"], str):
        from kvcake.eval.runner import parse_methods

        out["methods"] = tuple(parse_methods(out["methods"]))
    out["intro"] = suite.get("intro", "")
    out["notes"] = suite.get("notes", "")
    out["section"], out["title"] = suite.get("section"), suite.get("title", "")
    out["ablation"] = bool(suite.get("ablation", False)) and not narrowed
    out["targets"] = bool(suite.get("ablation", False))  # the suite that tracks issue 14's targets
    out["narrowed"] = narrowed
    out["more_samples"] = None if narrowed else suite.get("more_samples")
    if narrowed:  # the suite's hand-written text describes the whole suite, not this part of it
        out["intro"] = out["notes"] = ""
        if args.doc is None:
            out["doc"] = None
    if out["ratios"] is None:
        out["ratios"] = () if out["budgets"] else (0.25,)
    return out
