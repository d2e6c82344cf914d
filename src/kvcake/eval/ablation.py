"""The CAKE ablation of the results page: allocation alone, indicator alone, both, with the
model family's default temperatures and with the calibrated ones; and the per-layer budget
charts of default vs calibrated CAKE.

The cells are ordinary eval cells (same tasks, scenarios, ratios and results file as the rest of
the page, at the lengths of ``ABLATION_LENGTHS``), so the ones the main tables already hold
(``cake``, ``snapkv``) are not run twice. CAKE cells carry the temperatures in force in their key
(``tau``: source and calibration hash), so a new calibration reruns them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcake.eval.report import SCENARIO_TITLES, metric_table

ABLATION: dict[str, str] = {
    "snapkv": "baseline: uniform layers, SnapKV indicator",
    "layers=uniform,score=cake": "CAKE indicator alone (uniform layers)",
    "layers=cake,score=snapkv,layers.tau_from=family": "CAKE allocation alone, family-default tau",
    "layers=cake,score=snapkv": "CAKE allocation alone, calibrated tau",
    "cake,layers.tau_from=family": "both (CAKE), family-default tau",
    "cake": "both (CAKE), calibrated tau, and the indicator the calibration chose at each point",
    "cake,score.pooling=max,score.kernel=7": "both, calibrated tau, CAKE's indicator max-pooled (SnapKV's, kernel 7) at every budget",
}
"""Method spec -> what it isolates."""

# The prompts of issue 24's targets (every task at 2k and 4k tokens, 6 samples each: 36 a cell),
# so the rows share their prompts with the main tables' six methods (``cake``, ``snapkv``)
ABLATION_LENGTHS = (2048, 4096)
ABLATION_SAMPLES = 6
BUDGET_FIGURE = "eval_results_cake_budgets.png"
RUN_TAG = "  # CAKE ablation cells"  # ends the command logged for the ablation's cells (its runs log line)


def ablation_markdown(
    records: Sequence[dict[str, Any]], figure: str | os.PathLike[str] | None, doc: Path
) -> str:
    """The page section: what each row isolates, KL / attention perturbation / score tables per
    scenario (the rows' ``ABLATION_LENGTHS`` cells only), and the budget chart."""
    lengths = set(ABLATION_LENGTHS)
    first = min((r.get("seed", 0) for r in records), default=0)  # the suite's base seed
    rs = [
        r
        for r in records
        if r["length"] in lengths
        and r.get("seed", 0) - first < ABLATION_SAMPLES
        and (r["method"] in ABLATION or r["method"] == "full")
    ]
    if not rs:
        return ""
    lines = [
        "## CAKE ablation: allocation, indicator, temperatures",
        "",
        f"Prompts of {' and '.join(str(n) for n in ABLATION_LENGTHS)} tokens, {ABLATION_SAMPLES} samples of each "
        "task (the prompts of issue 24's targets; the same cells as above where a method is in both). "
        "*Family-default tau* is what CAKE used before calibration: the authors' "
        "Llama-3.1-8B temperatures for every `llama`-type model (1.6/0.6, 1.6/0.4 from 512 entries per layer); "
        "*calibrated* is the shipped calibration of this model (`kvcake calibrate`). A mean KL over prompts whose "
        "KL spans orders of magnitude can be one prompt's, so each scenario also counts the prompts where a row's "
        "KL is at or below `snapkv`'s.",
        "",
        *(f"- `{m}`: {what}" for m, what in ABLATION.items()),
        "",
    ]
    for sc in ("question", "context"):
        sub = [r for r in rs if r["scenario"] == sc]
        if not sub:
            continue
        lines += [f"### {SCENARIO_TITLES[sc]}", ""]
        for metric, title in (("kl", "KL(full || compressed), nats/token"),
                              ("attn_rel_l1", "attention-output perturbation"), ("score", "score (x100)")):  # fmt: skip
            if any(r.get(metric) is not None for r in sub):
                lines += [f"**{title}**", "", metric_table(sub, metric, ["full", *ABLATION]), ""]
        lines += ["**prompts with KL at or below `snapkv`'s**", "", _below_table(sub, sc, "snapkv"), ""]
    if figure is not None:
        lines += [f"![{Path(figure).stem}]({os.path.relpath(Path(figure), doc.parent)})", ""]
    return "\n".join(lines)


def budget_chart(
    model, tokenizer, path: Path, ratios: Sequence[float] = (0.1, 0.25, 0.5), length: int = 2048
) -> Path:
    """Per-layer budgets of CAKE with the family-default and the calibrated temperatures, on the
    first ``niah_single`` prompt of ``length`` tokens (seed 0), one panel per ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import torch

    import kvcake
    from kvcake.eval.tasks import make_samples
    from kvcake.prompts import build_prompt

    s = make_samples(
        "niah_single", tokenizer, 1, length, seed=0, haystack="paul_graham", needle_style="restated"
    )[0]
    p = build_prompt(tokenizer, s.context_prompt(), s.question_prompt(answer_prefix=False), s.answer_prefix)
    ids = torch.cat([p.context, p.question], dim=1)  # the question-aware prompt (1, S)
    fig, axes = plt.subplots(1, len(ratios), figsize=(5 * len(ratios), 3.6), sharey=True)
    for ax, ratio in zip(np.atleast_1d(axes), ratios, strict=True):
        for k, (spec, colour) in enumerate(
            (("cake,layers.tau_from=family", "tab:red"), ("cake", "tab:green"))
        ):
            cache = kvcake.compress(model, ids, spec, ratio=ratio, scenario="question").cache
            b = cache.budgets[0].numpy()
            ax.bar(np.arange(len(b)) + (k - 0.5) * 0.4, b, width=0.4, color=colour,
                   label=f"{'family default' if k == 0 else cache.tau.source} {cache.tau.tau1:.2g}/{cache.tau.tau2:.2g}")  # fmt: skip
        ax.axhline(ratio * ids.shape[1], color="grey", linestyle="--", linewidth=1, label="uniform")
        ax.set_title(f"ratio {ratio} ({ids.shape[1]} tokens)")
        ax.set_xlabel("layer")
        ax.legend(fontsize=7)
    np.atleast_1d(axes)[0].set_ylabel("KV entries kept per KV head")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_section(
    settings: dict[str, Any],
    args: Any,
    command: str,
    doc: Path | None,
    report_only: bool,
    main_records: Sequence[dict[str, Any]] = (),
) -> str:
    """Run the ablation's cells into the page's results file (resumable, like the rest), draw the
    budget chart, and return the page sections: the targets (from ``main_records``, the main
    tables' cells) and the ablation (``kvcake eval --suite results`` calls this)."""
    import kvcake
    from kvcake.eval.runner import run_eval

    model, tokenizer = kvcake.load_model(args.model or kvcake.DEFAULT_MODEL)
    result = run_eval(
        model, tokenizer, model_name=args.model, methods=("full", *ABLATION), ratios=settings["ratios"],
        tasks=settings["tasks"], lengths=ABLATION_LENGTHS, samples=ABLATION_SAMPLES,
        scenario=settings["scenario"], seed=args.seed, haystack=args.haystack, needle_style=args.needle_style,
        max_new_tokens=args.max_new_tokens, fidelity=args.fidelity, fidelity_tokens=args.fidelity_tokens,
        window=args.window, out=settings["out"], prefill=args.prefill, progress=not args.no_progress,
        command=command + RUN_TAG, compute=not report_only, report=False,
    )  # fmt: skip
    out = Path(str(settings["out"]))
    figure = budget_chart(model, tokenizer, out.parent / BUDGET_FIGURE, tuple(settings["ratios"]))
    section = ablation_markdown(result.records, figure, doc or out)
    targets = targets_section(main_records)
    sweep = _sweep_section(model, tokenizer, settings, args.seed, main_records)
    body = f"{targets}\n\n{section}" if targets else section
    return f"{body}\n\n{sweep}" if sweep else body


def targets_section(records: Sequence[dict[str, Any]]) -> str:
    """The page section of issue 24's targets (:func:`targets_markdown`) for the main tables'
    cells, or ``""`` when they hold no ``cake`` or ``cake-adakv`` cell (e.g. a run of other methods)."""
    if not any(r["method"] in ("cake", "cake-adakv") for r in records):
        return ""
    return (
        "## Targets of issue 24 (CAKE with its calibrated temperatures: output KL and task score)\n\nMeans "
        "over the prompts of the tables above that both sides of a row have (every task, length and sample "
        "when the run is complete), computed from the results file. *Prompts where it holds* makes the same "
        "comparison prompt by prompt: a mean can be decided by one prompt with a large KL. *Margin* is the mean "
        "by which the target holds per prompt (reference x factor less the value for KL, value less the "
        "reference's score less the slack for scores; negative: missed), with its standard error over the "
        "prompts; *holds without its worst prompt* leaves out the prompt it misses most by. Context-only at "
        "ratio 0.5 has no target (no fixed temperatures reached SnapKV there in the oracle sweep): its rows "
        "show the gap. Attention-output perturbation is a diagnostic (tables above), not a target.\n\n"
        + targets_markdown(records)
    )


def _sweep_section(
    model, tokenizer, settings: dict[str, Any], seed: int, main_records: Sequence[dict[str, Any]] = ()
) -> str:
    """The oracle sweep's section (:mod:`kvcake.eval.tau_sweep`) from its records next to the
    results file, if ``--tau-sweep`` made them (computed by the command line before this runs), with
    the shipped ``cake`` taken from ``main_records`` where the sweep has no row of the temperatures
    in force (a calibration newer than the sweep)."""
    from kvcake.eval.tau_sweep import run_sweep, sweep_markdown, sweep_path, with_shipped

    path = sweep_path(str(settings["out"]))
    if not path.exists():
        return ""
    records = run_sweep(model, tokenizer, tasks=settings["tasks"], lengths=settings["lengths"],
                        samples=int(settings["samples"]), ratios=settings["ratios"], out=path, seed=seed,
                        compute=False)  # fmt: skip
    records = with_shipped(model, records, main_records)
    return sweep_markdown(records)


# Issue 24's targets: (method, reference, scenario, ratios, factor) on mean KL, the method's mean
# at or below factor x the reference's; ratios None = every ratio of the records. Context-only at
# 0.5 is shown without a target (SHOWN_ONLY).
KL_TARGETS = (
    ("cake", "snapkv", "question", None, 1.10),
    ("cake", "pyramidkv", "question", None, 1.0),
    ("cake-adakv", "adakv", "question", None, 1.10),
    ("cake", "snapkv", "context", (0.1, 0.25), 1.0),
    ("cake", "pyramidkv", "context", (0.1, 0.25), 1.0),
    ("cake-adakv", "adakv", "context", (0.1, 0.25), 1.0),
)
SHOWN_ONLY = (("cake", "snapkv", "context", 0.5), ("cake-adakv", "adakv", "context", 0.5))
SCORE_SLACK = 0.10
"""``cake``'s task score may be this much (10 points x 100, the page's noise level) below ``snapkv``'s."""


def targets_markdown(records: Sequence[dict[str, Any]]) -> str:
    """Issue 24's targets for the default presets, checked on the main tables' cells (all tasks,
    lengths and samples): mean KL of ``cake`` and ``cake-adakv`` against ``snapkv``, ``pyramidkv``
    and ``adakv`` (:data:`KL_TARGETS`), and ``cake``'s task score no more than
    :data:`SCORE_SLACK` below ``snapkv``'s in every cell."""

    def verdict(value: float | None, ref: float | None, holds: bool) -> str:
        return "-" if value is None or ref is None else "yes" if holds else "**no**"

    ratios = sorted({r["ratio"] for r in records if r.get("ratio") is not None})
    lines = ["| target | scenario | ratio | value | reference | holds | prompts where it holds | margin (se) | "
             "holds without its worst prompt |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for method, ref, sc, only, factor in KL_TARGETS:
        for ratio in ratios if only is None else [r for r in ratios if r in only]:
            value, reference, prompts, margin, without = paired(records, method, ref, sc, ratio, "kl", factor)
            times = "" if factor == 1.0 else f"{factor:g} x "
            ok = verdict(
                value, reference, value is not None and reference is not None and value <= factor * reference
            )
            lines.append(f"| `{method}` kl <= {times}`{ref}` | {SCENARIO_TITLES[sc]} | {ratio:g} | {number(value)} | "
                         f"{number(reference)} | {ok} | {prompts} | {margin} | {without} |")  # fmt: skip
    for method, ref, sc, ratio in SHOWN_ONLY:
        if ratio in ratios:
            value, reference, prompts, margin, without = paired(records, method, ref, sc, ratio, "kl")
            gap = "-" if value is None or reference is None else f"no target: {value / reference:.2f} x"
            lines.append(f"| `{method}` kl vs `{ref}` | {SCENARIO_TITLES[sc]} | {ratio:g} | {number(value)} | "
                         f"{number(reference)} | {gap} | {prompts} | {margin} | {without} |")  # fmt: skip
    for sc in ("question", "context"):
        for ratio in ratios:
            value, reference, prompts, margin, without = paired(
                records, "cake", "snapkv", sc, ratio, "score", slack=SCORE_SLACK
            )
            holds = value is not None and reference is not None and value >= reference - SCORE_SLACK
            lines.append(f"| `cake` score >= `snapkv` - {SCORE_SLACK * 100:g} | {SCENARIO_TITLES[sc]} | {ratio:g} | "
                         f"{number(value, 100)} | {number(reference, 100)} | {verdict(value, reference, holds)} | "
                         f"{prompts} | {margin} | {without} |")  # fmt: skip
    return "\n".join(lines)


def paired(
    records: Sequence[dict[str, Any]],
    method: str,
    ref: str,
    scenario: str,
    ratio: float,
    metric: str,
    factor: float = 1.0,
    slack: float = 0.0,
    ref_ratio: float | None = None,
) -> tuple[float | None, float | None, str, str, str]:
    """Means of ``method`` and ``ref`` over the prompts both have (a partial run compares like
    with like); on how many of those prompts the target holds, e.g. ``"11/12"`` (for KL the
    method at or below ``factor`` x the reference, for scores at least the reference less
    ``slack``); the mean margin by which it holds (negative: missed) with its standard error
    over the prompts; and whether the mean still holds without the prompt it misses most by.
    ``ref_ratio``: the reference's cells at another ratio (None: ``ratio``)."""
    a, b = (
        by_prompt(records, method, scenario, ratio, metric),
        by_prompt(records, ref, scenario, ratio if ref_ratio is None else ref_ratio, metric),
    )
    common = sorted(set(a) & set(b))
    if not common:
        return None, None, "-", "-", "-"
    margins = [a[k] - (b[k] - slack) if metric == "score" else factor * b[k] - a[k] for k in common]
    n = len(margins)
    mean = sum(margins) / n
    se = (sum((m - mean) ** 2 for m in margins) / (n - 1) / n) ** 0.5 if n > 1 else 0.0
    se = round(se, 12)  # equal margins (equal scores) give 0, not rounding noise of 1e-16
    scale = 100 if metric == "score" else 1
    rest = sorted(margins)[1:]
    without = "one prompt" if not rest else "yes" if sum(rest) >= 0 else "no"
    return (
        sum(a[k] for k in common) / len(common),
        sum(b[k] for k in common) / len(common),
        f"{sum(m >= 0 for m in margins)}/{n}",
        f"{mean * scale:+.3g} ({se * scale:.2g})",
        without,
    )


def by_prompt(
    records: Sequence[dict[str, Any]], method: str, scenario: str, ratio: float, metric: str
) -> dict:
    """``metric`` of ``method``'s cells in ``scenario`` at ``ratio``, by prompt (task, length, seed)."""
    return {(r["task"], r["length"], r["seed"]): r[metric] for r in records
            if r["method"] == method and r["scenario"] == scenario and r.get("ratio") == ratio
            and r.get(metric) is not None}  # fmt: skip


def _below_table(records: Sequence[dict[str, Any]], scenario: str, ref: str) -> str:
    """Per ablation row (but ``ref``) and ratio: on how many of the prompts both have in ``scenario``
    its KL is at or below ``ref``'s, e.g. ``"20/36"`` (``-`` where they share none)."""
    ratios = sorted({r["ratio"] for r in records if r.get("ratio") is not None})
    lines = [
        "| method | " + " | ".join(f"ratio {x:g}" for x in ratios) + " |",
        "|---" * (len(ratios) + 1) + "|",
    ]
    for method in (m for m in ABLATION if m != ref):  # paired's count of prompts where KL <= ref's
        row = [paired(records, method, ref, scenario, ratio, "kl")[2] for ratio in ratios]
        lines.append(f"| `{method}` | " + " | ".join(row) + " |")
    return "\n".join(lines)


def number(value: float | None, scale: float = 1.0, digits: int | None = None) -> str:
    """``value * scale`` for a page's table: 4 significant digits, or ``digits`` decimals; ``-`` for None."""
    if value is None:
        return "-"
    return f"{value * scale:.{digits}f}" if digits is not None else f"{value * scale:.4g}"
