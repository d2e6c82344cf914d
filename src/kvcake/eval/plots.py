"""Plots of the records :func:`kvcake.eval.runner.run_eval` writes: one metric against the budget per
scenario, and the per-layer attention perturbation."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from kvcake.eval.tables import (
    FULL,
    SCENARIO_TITLES,
    Record,
    group_by,
    mean_of,
    method_order,
    scenarios_in,
    setting_label,
    setting_of,
)

__all__ = ["write_plots"]

LINESTYLES = ("-", "--", "-.", ":")

# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


def _x_axis(records: Sequence[Record]) -> tuple[Callable[[Record], float], str, bool]:
    kinds = {setting_of(r)[0] for r in records if r["method"] != FULL}
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

    scenarios = scenarios_in(records)
    if not scenarios or not any(r.get(metric) is not None for r in records):
        return None
    order = [m for m in method_order(records, methods) if m != FULL]
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
                for (_, x), group in group_by([r for r in rs if r["method"] == m], "method", xval).items()
                if (v := mean_of(r.get(metric) for r in group)[0]) is not None
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker=markers[i % len(markers)], color=cmap(i % 20),
                        linestyle=LINESTYLES[i % len(LINESTYLES)], label=m, linewidth=1.4, markersize=5)  # fmt: skip
        full, _ = mean_of(r.get(metric) for r in rs if r["method"] == FULL)
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
    settings = sorted({setting_of(r) for r in rs})
    if not rs:
        return None
    middle = settings[len(settings) // 2]
    scenarios = scenarios_in(rs)
    order = [m for m in method_order(rs, methods) if m != FULL]
    cmap = plt.get_cmap("tab20")
    fig, axes = plt.subplots(
        1, len(scenarios), figsize=(6.2 * len(scenarios), 4.6), squeeze=False, sharey=True
    )
    for ax, sc in zip(axes[0], scenarios, strict=True):
        for i, m in enumerate(order):
            group = [r["attn_rel_l1_layers"] for r in rs if r["scenario"] == sc and r["method"] == m
                     and setting_of(r) == middle]  # fmt: skip
            if group:
                n = min(len(g) for g in group)
                mean = [sum(g[j] for g in group) / len(group) for j in range(n)]
                ax.plot(range(n), mean, color=cmap(i % 20), linestyle=LINESTYLES[i % len(LINESTYLES)], label=m,
                        linewidth=1.3)  # fmt: skip
        ax.set_title(f"{SCENARIO_TITLES[sc]}, {setting_label(middle)}")
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
