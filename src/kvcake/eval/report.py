"""The results page, from the records :func:`kvcake.eval.runner.run_eval` writes.

Every number is a mean over the records of a (method, budget) cell group: tasks, lengths and
samples are averaged with equal weight per record. Scores are reported x 100; the fidelity
measures (``kvcake.eval.fidelity``) in their own units (KL and NLL in nats per token, the
perturbations as relative L1 norms).

Tables are in :mod:`kvcake.eval.tables`, plots in :mod:`kvcake.eval.plots`; their public names are
re-exported here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcake.eval.plots import write_plots
from kvcake.eval.tables import (
    FULL,
    METRICS,
    SCENARIO_TITLES,
    Record,
    fmt_value,
    group_by,
    mean_of,
    method_order,
    metric_table,
    scenarios_in,
    setting_label,
    setting_of,
    summary_markdown,
)

__all__ = ["METRICS", "SCENARIO_TITLES", "metric_table", "render_page", "summary_markdown", "write_plots"]

# --------------------------------------------------------------------------------------------
# The results page
# --------------------------------------------------------------------------------------------


def _task_table(records: Sequence[Record], methods: Sequence[str] | None, metric: str = "score") -> str:
    """Rows: methods; columns: task x length; ``metric`` averaged over budgets and samples."""
    cols = sorted({(r["task"], r["length"]) for r in records})
    order = method_order(records, methods)
    cells = group_by(records, "method", "task", "length")
    head = [
        "method",
        *(f"{t} {n // 1024 if n % 1024 == 0 else n}{'k' if n % 1024 == 0 else ''}" for t, n in cols),
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in order:
        row = ["full cache" if m == FULL else f"`{m}`"]
        for t, n in cols:
            v, _ = mean_of(r.get(metric) for r in cells.get((m, t, n), []))
            row.append(fmt_value(v, metric))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _prompt(r: Record) -> tuple:
    """A prompt's identity within a results file: its task, length and sample."""
    return r["task"], r["length"], r.get("seed"), r.get("sample")


def _findings(records: Sequence[Record], methods: Sequence[str] | None) -> list[str]:
    """Facts read off the numbers (no interpretation): where the full cache fails, rankings."""
    out: list[str] = []
    full = [r for r in records if r["method"] == FULL]
    for (task, length), rs in sorted(group_by(full, "task", "length").items()):
        v, _ = mean_of(r["score"] for r in rs)
        if v is not None and v < 0.75:
            prompts, scenarios = len({_prompt(r) for r in rs}), len({r["scenario"] for r in rs})
            out.append(
                f"The full cache itself scores {100 * v:.0f} on `{task}` at {length} tokens ({prompts} prompts, "
                f"{scenarios} scenario{'s' if scenarios > 1 else ''}): task scores there cannot separate methods; "
                "the fidelity measures still do."
            )
    for sc in scenarios_in(records):
        rs = [r for r in records if r["scenario"] == sc and r["method"] != FULL and r.get("kl") is not None]
        for setting, group in sorted(group_by(rs, setting_of).items()):
            by_method = group_by(group, "method")
            common = set.intersection(*({_prompt(r) for r in g} for g in by_method.values()))
            means = {
                m: mean_of(r["kl"] for r in g if _prompt(r) in common)[0] for (m,), g in by_method.items()
            }
            ranked = sorted((v, m) for m, v in means.items() if v is not None)
            if len(ranked) >= 2:
                best, worst = ranked[0], ranked[-1]
                out.append(
                    f"{SCENARIO_TITLES[sc]}, {setting_label(setting[0])}: lowest KL `{best[1]}` ({best[0]:.3f}), "
                    f"highest `{worst[1]}` ({worst[0]:.3f}), on the {len(common)} prompts every method has."
                )
    pairs = group_by([r for r in records if r["method"] != FULL], "method", setting_of)
    gaps = []
    for rs in pairs.values():
        q, _ = mean_of(r["score"] for r in rs if r["scenario"] == "question")
        c, _ = mean_of(r["score"] for r in rs if r["scenario"] == "context")
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
    order = method_order(records, methods)
    settings = sorted({setting_of(r) for r in records if r["method"] != FULL})
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
        f"- Methods: {', '.join(f'`{m}`' for m in order)}; budgets: {', '.join(setting_label(s) for s in settings)} "
        f"(observation window {', '.join(str(w) for w in sorted({r['window'] for r in records}))}).",
        "- Tasks: "
        + ", ".join(f"`{t}`" + (f" ({o})" if o else "") for t, o in tasks)
        + f"; lengths {', '.join(str(n) for n in lengths)} tokens (before the chat template); "
        f"{len(seeds)} sample(s) each (seeds {', '.join(str(s) for s in seeds)}); haystack "
        f"{', '.join(sorted({str(r.get('haystack')) for r in records}))}.",
        f"- Scenarios: {', '.join(SCENARIO_TITLES[s] for s in scenarios_in(records))}; {len(records)} cells; "
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
    for sc in scenarios_in(records):
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
