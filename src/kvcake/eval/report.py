"""Tables, plots and the results page, from the records :func:`kvcake.eval.runner.run_eval` writes.

Every number is a mean over the records of a (method, budget) cell group: tasks, lengths and
samples are averaged with equal weight per record. Scores are reported x 100; the fidelity
measures (``kvcake.eval.fidelity``) in their own units (KL and NLL in nats per token, the
perturbations as relative L1 norms).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["render_page", "summary_markdown", "write_plots"]

FULL = "full"
LINESTYLES = ("-", "--", "-.", ":")
SCENARIO_TITLES = {"question": "question-aware", "context": "context-only"}
Record = dict[str, Any]


# --------------------------------------------------------------------------------------------
# Grouping
# --------------------------------------------------------------------------------------------


def _setting(r: Record) -> tuple[int, float]:
    """Sort key of a budget setting: budgets (kind 0) before ratios (kind 1), then by value."""
    if r.get("budget") is not None:
        return (0, float(r["budget"]))
    if r.get("ratio") is not None:
        return (1, float(r["ratio"]))
    return (2, math.inf)  # the full cache


def _label(setting: tuple[int, float]) -> str:
    kind, value = setting
    if kind == 0:
        return f"budget {int(value)}"
    if kind == 1:
        return f"ratio {value:g}"
    return "full"


def _method_order(records: Iterable[Record], methods: Sequence[str] | None) -> list[str]:
    seen = list(dict.fromkeys(r["method"] for r in records))
    order = [m for m in (methods or []) if m in seen] + [m for m in seen if m not in (methods or [])]
    return sorted(order, key=lambda m: m != FULL)  # the full cache first, stable otherwise


def _mean(values: Iterable[float | None]) -> tuple[float | None, int]:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return (sum(vals) / len(vals), len(vals)) if vals else (None, 0)


def _by(records: Iterable[Record], *fields: str | Callable[[Record], Any]) -> dict[tuple, list[Record]]:
    groups: dict[tuple, list[Record]] = defaultdict(list)
    for r in records:
        groups[tuple(f(r) if callable(f) else r.get(f) for f in fields)].append(r)
    return groups


def _fmt(value: float | None, metric: str) -> str:
    if value is None:
        return "-"
    if metric == "score":
        return f"{100 * value:.0f}"
    if metric == "kl":
        return f"{value:.4f}" if value >= 1e-4 or value == 0 else f"{value:.1e}"
    return f"{value:.3f}" if value >= 1e-3 or value == 0 else f"{value:.1e}"


METRICS = {
    "score": "score (x100)",
    "kl": "KL(full || compressed), nats/token",
    "nll": "NLL of the full cache's continuation, nats/token",
    "attn_rel_l1": "attention-output perturbation (relative L1, mean over layers)",
    "hidden_rel_l1": "final hidden-state perturbation (relative L1)",
    "kv_fraction": "KV bytes kept / full cache",
}


def metric_table(records: Sequence[Record], metric: str, methods: Sequence[str] | None = None) -> str:
    """Markdown table: one row per method, one column per budget setting, ``metric`` averaged.

    The full cache has no budget: its value is repeated in every column (for reading across)."""
    settings = sorted({_setting(r) for r in records if r["method"] != FULL})
    order = _method_order(records, methods)
    cells = _by(records, "method", _setting)
    head = ["method", *(_label(s) for s in settings)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in order:
        if m == FULL:
            full = [r for k, rs in cells.items() if k[0] == FULL for r in rs]
            v, _ = _mean(r.get(metric) for r in full)
            row = ["full cache", *([_fmt(v, metric)] * len(settings))]
        else:
            row = [f"`{m}`"]
            for s in settings:
                v, _ = _mean(r.get(metric) for r in cells.get((m, s), []))
                row.append(_fmt(v, metric))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _scenarios(records: Sequence[Record]) -> list[str]:
    present = {r["scenario"] for r in records}
    return [s for s in ("question", "context") if s in present]


def summary_markdown(records: Sequence[Record], methods: Sequence[str] | None = None) -> str:
    """The end-of-run summary: per scenario, the score and the KL by method x budget."""
    if not records:
        return "(no results)"
    parts = []
    for sc in _scenarios(records):
        rs = [r for r in records if r["scenario"] == sc]
        n = len({(r["task"], r["length"], r["seed"]) for r in rs})
        parts.append(f"### {SCENARIO_TITLES[sc]} ({n} prompts: tasks x lengths x samples)\n")
        parts.append(f"Score (x100):\n\n{metric_table(rs, 'score', methods)}\n")
        if any(r.get("kl") is not None for r in rs):
            parts.append(f"KL(full || compressed), nats/token:\n\n{metric_table(rs, 'kl', methods)}\n")
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


def _x_axis(records: Sequence[Record]) -> tuple[Callable[[Record], float], str, bool]:
    kinds = {_setting(r)[0] for r in records if r["method"] != FULL}
    if kinds == {1}:
        return (lambda r: float(r["ratio"])), "kept ratio of the prompt", False
    if kinds == {0}:
        return (lambda r: float(r["budget"])), "budget (KV entries per layer and head)", True
    return (lambda r: float(r.get("kv_fraction") or 0.0)), "KV bytes kept / full cache", False


def _plot_metric(records: Sequence[Record], metric: str, path: Path, methods: Sequence[str] | None,
                 ylabel: str, log: bool = False) -> Path | None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = _scenarios(records)
    if not scenarios or not any(r.get(metric) is not None for r in records):
        return None
    order = [m for m in _method_order(records, methods) if m != FULL]
    xval, xlabel, xlog = _x_axis(records)
    cmap = plt.get_cmap("tab20")
    markers = "osD^vP*Xh<>p"
    fig, axes = plt.subplots(
        1, len(scenarios), figsize=(6.2 * len(scenarios), 4.6), squeeze=False, sharey=True
    )
    for ax, sc in zip(axes[0], scenarios, strict=True):
        rs = [r for r in records if r["scenario"] == sc]
        for i, m in enumerate(order):
            pts = sorted(
                (x, v)
                for (_, x), group in _by([r for r in rs if r["method"] == m], "method", xval).items()
                if (v := _mean(r.get(metric) for r in group)[0]) is not None
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker=markers[i % len(markers)], color=cmap(i % 20),
                        linestyle=LINESTYLES[i % len(LINESTYLES)], label=m, linewidth=1.4, markersize=5)  # fmt: skip
        full, _ = _mean(r.get(metric) for r in rs if r["method"] == FULL)
        if full is not None and not (log and full <= 0):
            ax.axhline(full, color="black", linestyle="--", linewidth=1.2, label="full cache")
        ax.set_title(SCENARIO_TITLES[sc])
        ax.set_xlabel(xlabel)
        if xlog:
            ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    return _save(fig, axes, ylabel, path)


def _save(fig, axes, ylabel: str, path: Path) -> Path:
    """Shared ending of the per-scenario figures: y label, one legend on the right, save, close."""
    import matplotlib.pyplot as plt

    axes[0][0].set_ylabel(ylabel)
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _plot_layers(records: Sequence[Record], path: Path, methods: Sequence[str] | None) -> Path | None:
    """Per-layer attention-output perturbation at the middle budget setting, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [r for r in records if r["method"] != FULL and r.get("attn_rel_l1_layers")]
    settings = sorted({_setting(r) for r in rs})
    if not rs:
        return None
    middle = settings[len(settings) // 2]
    scenarios = _scenarios(rs)
    order = [m for m in _method_order(rs, methods) if m != FULL]
    cmap = plt.get_cmap("tab20")
    fig, axes = plt.subplots(
        1, len(scenarios), figsize=(6.2 * len(scenarios), 4.6), squeeze=False, sharey=True
    )
    for ax, sc in zip(axes[0], scenarios, strict=True):
        for i, m in enumerate(order):
            group = [r["attn_rel_l1_layers"] for r in rs if r["scenario"] == sc and r["method"] == m
                     and _setting(r) == middle]  # fmt: skip
            if group:
                n = min(len(g) for g in group)
                mean = [sum(g[j] for g in group) / len(group) for j in range(n)]
                ax.plot(range(n), mean, color=cmap(i % 20), linestyle=LINESTYLES[i % len(LINESTYLES)], label=m,
                        linewidth=1.3)  # fmt: skip
        ax.set_title(f"{SCENARIO_TITLES[sc]}, {_label(middle)}")
        ax.set_xlabel("layer")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    return _save(fig, axes, "attention-output perturbation (rel. L1)", path)


def write_plots(records: Sequence[Record], prefix: str | os.PathLike[str],
                methods: Sequence[str] | None = None) -> list[Path]:  # fmt: skip
    """Write ``<prefix>_score.png`` (score vs budget, one line per method, one panel per scenario),
    ``<prefix>_kl.png`` (KL vs budget, log scale) and, when measured, ``<prefix>_attn.png``
    (attention-output perturbation vs budget) and ``<prefix>_layers.png`` (that perturbation per
    layer at the middle budget). Returns the paths written."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    scored = [dict(r, score=100 * r["score"]) if r.get("score") is not None else r for r in records]
    attn_label = "attention-output perturbation (rel. L1)"
    out = [
        _plot_metric(scored, "score", Path(f"{prefix}_score.png"), methods, "score (x100)"),
        _plot_metric(
            records, "kl", Path(f"{prefix}_kl.png"), methods, "KL(full || compressed), nats/token", log=True
        ),
        _plot_metric(records, "attn_rel_l1", Path(f"{prefix}_attn.png"), methods, attn_label, log=True),
        _plot_layers(records, Path(f"{prefix}_layers.png"), methods),
    ]
    return [p for p in out if p is not None]


# --------------------------------------------------------------------------------------------
# The results page
# --------------------------------------------------------------------------------------------


def _task_table(records: Sequence[Record], methods: Sequence[str] | None, metric: str = "score") -> str:
    """Rows: methods; columns: task x length; ``metric`` averaged over budgets and samples."""
    cols = sorted({(r["task"], r["length"]) for r in records})
    order = _method_order(records, methods)
    cells = _by(records, "method", "task", "length")
    head = [
        "method",
        *(f"{t} {n // 1024 if n % 1024 == 0 else n}{'k' if n % 1024 == 0 else ''}" for t, n in cols),
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in order:
        row = ["full cache" if m == FULL else f"`{m}`"]
        for t, n in cols:
            v, _ = _mean(r.get(metric) for r in cells.get((m, t, n), []))
            row.append(_fmt(v, metric))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _findings(records: Sequence[Record], methods: Sequence[str] | None) -> list[str]:
    """Facts read off the numbers (no interpretation): where the full cache fails, rankings."""
    out: list[str] = []
    full = [r for r in records if r["method"] == FULL]
    for (task, length), rs in sorted(_by(full, "task", "length").items()):
        v, n = _mean(r["score"] for r in rs)
        if v is not None and v < 0.75:
            out.append(
                f"The full cache itself scores {100 * v:.0f} on `{task}` at {length} tokens ({n} prompts x "
                "scenarios): task scores there cannot separate methods; the fidelity measures still do."
            )
    for sc in _scenarios(records):
        rs = [r for r in records if r["scenario"] == sc and r["method"] != FULL]
        for setting, group in sorted(_by(rs, _setting).items()):
            by_method = {m: _mean(r.get("kl") for r in g)[0] for (m,), g in _by(group, "method").items()}
            ranked = sorted((v, m) for m, v in by_method.items() if v is not None)
            if len(ranked) >= 2:
                best, worst = ranked[0], ranked[-1]
                out.append(
                    f"{SCENARIO_TITLES[sc]}, {_label(setting[0])}: lowest KL `{best[1]}` ({best[0]:.3f}), "
                    f"highest `{worst[1]}` ({worst[0]:.3f})."
                )
    pairs = _by([r for r in records if r["method"] != FULL], "method", _setting)
    gaps = []
    for rs in pairs.values():
        q, _ = _mean(r["score"] for r in rs if r["scenario"] == "question")
        c, _ = _mean(r["score"] for r in rs if r["scenario"] == "context")
        if q is not None and c is not None:
            gaps.append(q - c)
    if gaps:
        out.append(
            f"Context-only minus question-aware score, averaged over methods and budgets: "
            f"{-100 * sum(gaps) / len(gaps):+.1f} points."
        )
    return out


def render_page(
    records: Sequence[Record],
    *,
    figures: Sequence[str | os.PathLike[str]],
    doc: str | os.PathLike[str],
    methods: Sequence[str] | None = None,
    command: str = "",
    runs: Sequence[dict[str, Any]] = (),
    intro: str = "",
    notes: str = "",
    missing: int = 0,
) -> str:
    """The markdown results page: what was run and how long it took, summary and fidelity tables
    per scenario, per-task scores, findings read off the numbers, and the figures (linked relative
    to ``doc``). ``notes`` (markdown) is placed after the findings; ``missing`` is the number of
    requested cells not run yet (the page then says it is partial)."""
    doc_dir = Path(doc).parent
    total = sum(float(r.get("seconds") or 0) for r in runs)
    models = sorted({r["model"] for r in records})
    order = _method_order(records, methods)
    settings = sorted({_setting(r) for r in records if r["method"] != FULL})
    tasks = sorted({(r["task"], r.get("task_options") or "") for r in records})
    lengths = sorted({r["length"] for r in records})
    seeds = sorted({r["seed"] for r in records})
    lines = ["# Evaluation results", ""]
    if missing:
        lines += [
            f"**Partial results: {missing} of the {missing + len(records)} requested cells were not run** "
            "(the run was stopped early; rerun the command to complete it).",
            "",
        ]
    if intro:
        lines += [intro.strip(), ""]
    lines += [
        "Generated by the command below; do not edit by hand (rerun it: cells already in the results file "
        "are skipped, so it only adds what is missing).",
        "",
        "```",
        command or "(unknown command)",
        "```",
        "",
        f"- Model: {', '.join(models)} (fingerprint {', '.join(sorted({r['model_fp'] for r in records}))}).",
        f"- Methods: {', '.join(f'`{m}`' for m in order)}; budgets: {', '.join(_label(s) for s in settings)} "
        f"(observation window {', '.join(str(w) for w in sorted({r['window'] for r in records}))}).",
        "- Tasks: "
        + ", ".join(f"`{t}`" + (f" ({o})" if o else "") for t, o in tasks)
        + f"; lengths {', '.join(str(n) for n in lengths)} tokens (before the chat template); "
        f"{len(seeds)} sample(s) each (seeds {', '.join(str(s) for s in seeds)}); haystack "
        f"{', '.join(sorted({str(r.get('haystack')) for r in records}))}.",
        f"- Scenarios: {', '.join(SCENARIO_TITLES[s] for s in _scenarios(records))}; {len(records)} cells; "
        f"greedy answers of at most {', '.join(str(n) for n in sorted({r['max_new_tokens'] for r in records}))} "
        "tokens.",
    ]
    if runs:
        sessions = "; ".join(
            f"{float(r.get('seconds') or 0) / 60:.1f} min, {r.get('new_cells')} new cells, finished {r.get('finished')}"
            for r in runs
        )
        lines.append(
            f"- Compute: {total / 60:.1f} min of wall-clock time over {len(runs)} run(s) ({sessions}) "
            f"on {runs[-1].get('machine', 'an unknown machine')}."
        )
    prefills = sorted({r.get("prefill") for r in records})
    if "shared" in prefills:
        lines.append(
            "- Prefill: one full-cache forward per sample, replayed into every method's cache "
            "(`kvcake.eval.fidelity.replay_compress`: the same cache as `kvcake.compress`, checked by "
            "the tests). Compression timings here are therefore not prefill benchmarks: see "
            "`docs/benchmarks.md`."
        )
    lines += [
        "",
        "How to read: *score* is the task metric x 100 (RULER's `string_match_all`: the fraction of "
        "reference strings in the answer). The fidelity measures compare each compressed cache with the full "
        "cache on the full cache's own greedy continuation "
        f"({', '.join(str(n) for n in sorted({r['fidelity_tokens'] for r in records if r.get('fidelity_tokens')}))} "
        "tokens, not stopped at EOS), so they are informative even where "
        "the model fails the task: *KL* is the mean KL(full || compressed) of the next-token distributions "
        "(nats/token), *NLL* the continuation's negative log-likelihood under the compressed cache (the full "
        "cache's own is in the `full cache` row), *attention perturbation* the relative L1 change of each "
        "layer's attention output (CriticalKV's measure), averaged over layers, and *hidden perturbation* "
        "the same for the final hidden state. In the question-aware scenario the first continuation token "
        "is predicted by the (uncompressed) prefill, so its KL term is 0.",
        "",
    ]
    for sc in _scenarios(records):
        rs = [r for r in records if r["scenario"] == sc]
        lines += [f"## {SCENARIO_TITLES[sc]}", ""]
        for metric in ("score", "kl", "nll", "attn_rel_l1", "hidden_rel_l1", "kv_fraction"):
            if any(r.get(metric) is not None for r in rs):
                lines += [f"**{METRICS[metric]}**", "", metric_table(rs, metric, methods), ""]
        lines += [
            "**Score by task and length** (x100, averaged over budgets and samples)",
            "",
            _task_table(rs, methods),
            "",
            "**KL by task and length** (averaged over budgets and samples)",
            "",
            _task_table(rs, methods, "kl"),
            "",
        ]
    findings = _findings(records, methods)
    if findings:
        lines += ["## Findings read off the numbers", "", *(f"- {f}" for f in findings), ""]
    if notes:
        lines += [notes.strip(), ""]
    if figures:
        lines += ["## Figures", ""]
        for fig in figures:
            rel = os.path.relpath(Path(fig), doc_dir)
            lines += [f"![{Path(fig).stem}]({rel})", ""]
    return "\n".join(lines).rstrip() + "\n"
