"""Tables from the records :func:`kvcake.eval.runner.run_eval` writes, and the grouping they share.

Every number is a mean over the records of a (method, budget) cell group: tasks, lengths and
samples are averaged with equal weight per record. Scores are reported x 100; the fidelity
measures (``kvcake.eval.fidelity``) in their own units (KL and NLL in nats per token, the
perturbations as relative L1 norms).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["METRICS", "SCENARIO_TITLES", "metric_table", "summary_markdown"]

FULL = "full"
SCENARIO_TITLES = {"question": "question-aware", "context": "context-only"}
Record = dict[str, Any]

# --------------------------------------------------------------------------------------------
# Grouping
# --------------------------------------------------------------------------------------------


def setting_of(r: Record) -> tuple[int, float]:
    """Sort key of a budget setting: budgets (kind 0) before ratios (kind 1), then by value."""
    if r.get("budget") is not None:
        return (0, float(r["budget"]))
    if r.get("ratio") is not None:
        return (1, float(r["ratio"]))
    return (2, math.inf)  # the full cache


def setting_label(setting: tuple[int, float]) -> str:
    kind, value = setting
    if kind == 0:
        return f"budget {int(value)}"
    if kind == 1:
        return f"ratio {value:g}"
    return "full"


def method_order(records: Iterable[Record], methods: Sequence[str] | None) -> list[str]:
    seen = list(dict.fromkeys(r["method"] for r in records))
    order = [m for m in (methods or []) if m in seen] + [m for m in seen if m not in (methods or [])]
    return sorted(order, key=lambda m: m != FULL)  # the full cache first, stable otherwise


def mean_of(values: Iterable[float | None]) -> tuple[float | None, int]:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return (sum(vals) / len(vals), len(vals)) if vals else (None, 0)


def group_by(records: Iterable[Record], *fields: str | Callable[[Record], Any]) -> dict[tuple, list[Record]]:
    groups: dict[tuple, list[Record]] = defaultdict(list)
    for r in records:
        groups[tuple(f(r) if callable(f) else r.get(f) for f in fields)].append(r)
    return groups


def fmt_value(value: float | None, metric: str) -> str:
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
    settings = sorted({setting_of(r) for r in records if r["method"] != FULL})
    order = method_order(records, methods)
    cells = group_by(records, "method", setting_of)
    head = ["method", *(setting_label(s) for s in settings)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in order:
        if m == FULL:
            full = [r for k, rs in cells.items() if k[0] == FULL for r in rs]
            v, _ = mean_of(r.get(metric) for r in full)
            row = ["full cache", *([fmt_value(v, metric)] * len(settings))]
        else:
            row = [f"`{m}`"]
            for s in settings:
                v, _ = mean_of(r.get(metric) for r in cells.get((m, s), []))
                row.append(fmt_value(v, metric))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def scenarios_in(records: Sequence[Record]) -> list[str]:
    present = {r["scenario"] for r in records}
    return [s for s in ("question", "context") if s in present]


def summary_markdown(records: Sequence[Record], methods: Sequence[str] | None = None) -> str:
    """The end-of-run summary: per scenario, the score and the KL by method x budget."""
    if not records:
        return "(no results)"
    parts = []
    for sc in scenarios_in(records):
        rs = [r for r in records if r["scenario"] == sc]
        n = len({(r["task"], r["length"], r["seed"]) for r in rs})
        parts.append(f"### {SCENARIO_TITLES[sc]} ({n} prompts: tasks x lengths x samples)\n")
        parts.append(f"Score (x100):\n\n{metric_table(rs, 'score', methods)}\n")
        if any(r.get("kl") is not None for r in rs):
            parts.append(f"KL(full || compressed), nats/token:\n\n{metric_table(rs, 'kl', methods)}\n")
    return "\n".join(parts)
