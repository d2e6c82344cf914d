"""Prefill time over the full cache's (the decode bench is ``decode.py``).

Each method's prompt forward is timed against the full cache's, alternately in one run
(``full, m1, full, m2, ...``, repeated), so slow drifts of a shared machine hit both sides of a
pair alike. Two ratios per method: the median of its ``method / preceding full`` pairs, and the
ratio of minima, its fastest run over the fastest of its paired full runs (as many of each).
The target is checked on the ratio of minima: on a shared CPU the noise is other work, which only
ever adds time (the full prefill alone spread by 22-31% between rounds on the machine of
``docs/benchmarks.md``), so each side's fastest run is its least disturbed one (``timeit``'s
advice), where a median of three pairs keeps a third of the disturbance. The time spent inside
the cache (scoring, budget allocation, eviction: ``BenchCache.prefill_hook_s``) is broken out
from the model's own forward; it is timed within one run, so it is steadier than either ratio.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import DynamicCache

from ..adapters import with_cache
from ..attention import enable
from ..method import PRESETS
from .common import (
    BenchModels,
    Clock,
    build_cache,
    fmt,
    markdown_table,
    median,
    new_figure,
    prompt_ids,
    save_figure,
    verdict,
)
from .output import emit

logger = logging.getLogger(__name__)

PREFILL_TARGET = 1.10  # every preset within 10% of the full cache's prefill time at 4k and 8k tokens
PREFILL_TARGET_LENGTHS = (4096, 8192)
PREFILL_TIME_METHODS = tuple(PRESETS)  # the prefill-time bench's default: every preset


# -- prefill -------------------------------------------------------------------------------------
def _prefill_once(model, ids, spec: str, budget: int, window: int, clock: Clock) -> dict:
    with torch.no_grad():
        if spec == "full":
            t, _ = clock.time(lambda: model(ids, **with_cache(model, DynamicCache()), logits_to_keep=1))
            return dict(s=t, hook_s=0.0, evict_s=0.0)
        cache = build_cache(model, spec, budget, window)
        with enable(model):
            t, _ = clock.time(lambda: model(ids, **with_cache(model, cache), logits_to_keep=1))
    return dict(s=t, hook_s=cache.prefill_hook_s, evict_s=cache.prefill_evict_s)


def run_prefill(
    models: BenchModels,
    *,
    lengths=PREFILL_TARGET_LENGTHS,
    methods=PREFILL_TIME_METHODS,
    budget: int = 128,
    repeats: int = 3,
    window: int = 32,
    out: str | Path | None = None,
    machine: dict | None = None,
    echo: bool = True,
) -> dict:
    """Prefill time of each method over the full cache's, measured alternately.

    Writes ``out/prefill.json`` and ``out/prefill.png``; returns the result dict (``rows``,
    ``runs``, ``targets``)."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    methods = tuple(m for m in methods if m != "full")
    clock = Clock(models.device)
    runs, rows = [], []
    measured_on = machine_label(machine)
    for length in lengths:
        model, label = models.for_length(length)
        ids, source = prompt_ids(models.tokenizer if model is models.model else None, length,
                                 model.config.vocab_size, models.device)  # fmt: skip
        warm_ids = ids[:, : min(length, 256)]
        for spec in ("full", *methods):  # warm-up: first-call costs out of the way
            _prefill_once(model, warm_ids, spec, min(budget, warm_ids.shape[1]), min(window, budget), clock)
        for r in range(repeats):
            for spec in methods:
                logger.info("prefill %d tokens, round %d/%d: full vs %s", length, r + 1, repeats, spec)
                full = _prefill_once(model, ids, "full", budget, window, clock)
                mine = _prefill_once(model, ids, spec, budget, window, clock)
                runs.append(dict(length=length, round=r, method=spec, full_s=full["s"], **mine))
        fulls = [x["full_s"] for x in runs if x["length"] == length]
        for spec in methods:
            mine = [x for x in runs if x["length"] == length and x["method"] == spec]
            rows.append(prefill_row(mine, fulls, length=length, model=label, prompt=source, method=spec,
                                    machine=measured_on))  # fmt: skip
    result = dict(bench="prefill", machine=machine, budget=budget, window=window, repeats=repeats,
                  lengths=list(lengths), methods=list(methods), rows=rows, runs=runs)  # fmt: skip
    result["targets"] = prefill_targets(rows)
    return emit(result, "prefill", prefill_tables(result) if echo else "", plot_prefill, out, echo)


def machine_label(machine: dict | None) -> str | None:
    """What a prefill row says of the machine it was measured on (its CPU or device name): rows
    merged from runs on different machines (``--add``) keep their own (``bench.merge``)."""
    if not machine:
        return None
    return machine.get("cpu") if machine.get("device", "cpu") == "cpu" else machine.get("device_name")


def row_machines(rows: list[dict]) -> list[str]:
    """The machines prefill ``rows`` were measured on, in order of first appearance ("?" for rows
    that do not say): more than one where ``--add`` merged runs of different machines."""
    return list(dict.fromkeys(r.get("machine") or "?" for r in rows))


def prefill_row(mine: list[dict], fulls: list[float], **labels) -> dict:
    """One method's row from its runs at one length (``mine``: its pairs, each with the preceding
    full run's ``full_s``) and every full run at that length (``fulls``, for the median and spread)."""
    t = median([x["s"] for x in mine])
    return dict(
        **labels, full_s=median(fulls), s=t,
        ratio=median([x["s"] / x["full_s"] for x in mine]),
        ratio_of_medians=t / median(fulls),
        ratio_min=min(x["s"] for x in mine) / min(x["full_s"] for x in mine),
        hook_s=median([x["hook_s"] for x in mine]), evict_s=median([x["evict_s"] for x in mine]),
        full_spread=(max(fulls) - min(fulls)) / median(fulls), n=len(mine),
    )  # fmt: skip


def target_ratio(row: dict) -> tuple[float, str]:
    """The ratio the target is checked on and its name: the ratio of minima (module doc); rows
    written before it was recorded (no ``ratio_min``) keep their paired median, named as such."""
    if "ratio_min" in row:
        return row["ratio_min"], "ratio of minima"
    return row["ratio"], "paired median"


def target_lengths(lengths) -> list[int]:
    """The lengths the prefill target is checked at: those of ``PREFILL_TARGET_LENGTHS`` measured,
    else the longest measured."""
    lengths = sorted(set(lengths))
    return [n for n in lengths if n in PREFILL_TARGET_LENGTHS] or lengths[-1:]


def prefill_targets(rows: list[dict]) -> list[dict]:
    """The prefill target, one entry per method and target length measured."""
    ats = target_lengths(r["length"] for r in rows)
    checks = []
    for r in rows:
        if r["length"] in ats:
            value, statistic = target_ratio(r)
            checks.append(dict(target=f"prefill time within {PREFILL_TARGET - 1:.0%} of the full cache's",
                               length=r["length"], method=r["method"], value=value, statistic=statistic,
                               in_cache=r["hook_s"] / r["full_s"], ok=value <= PREFILL_TARGET))  # fmt: skip
    return checks


def prefill_tables(result: dict) -> str:
    mixed = len(row_machines(result["rows"])) > 1  # a machine column only then
    rows = [
        (r["length"], r["method"], *([r.get("machine") or "?"] if mixed else []), fmt(r["full_s"], 2),
         fmt(r["s"], 2), fmt(r.get("ratio_min"), 3), fmt(r["ratio"], 3), fmt(r["ratio_of_medians"], 3),
         fmt(r["hook_s"] * 1e3, 0), fmt(r["evict_s"] * 1e3, 0), fmt(100 * r["hook_s"] / r["full_s"], 1),
         fmt(100 * r["full_spread"], 0), r["n"])
        for r in result["rows"]
    ]  # fmt: skip
    head = (f"Prefill time, budget {result['budget']} per layer, alternating full/method runs "
            f"({_rounds(result)}; times are medians; the ratio of minima is a method's fastest run over "
            "the fastest of its paired full runs):")  # fmt: skip
    table = markdown_table(("S", "method", *(["machine"] if mixed else []), "full s", "method s",
                            "ratio of minima", "ratio (paired median)", "ratio of medians", "in-cache ms",
                            "of which eviction ms", "in-cache % of full", "full-run spread %", "pairs"),
                           rows)  # fmt: skip
    checks = [(c["method"], c["length"], fmt(c["value"], 3), c.get("statistic", "paired median"),
               fmt(100 * c["in_cache"], 1), verdict(c["ok"]))
              for c in result["targets"]]  # fmt: skip
    ats = " and ".join(str(n) for n in target_lengths(r["length"] for r in result["rows"]))
    return "\n".join([head, "", table, "", f"Target: prefill <= {PREFILL_TARGET:.2f} x full at {ats} tokens:",
                      "", markdown_table(("method", "S", "ratio", "statistic", "in-cache % of full", "verdict"),
                                         checks)])  # fmt: skip


def _rounds(result: dict) -> str:
    """The rounds behind the rows: one number, or the pairs column where merged runs differ."""
    counts = {r["n"] for r in result["rows"]}
    if len(counts) == 1:
        return f"{counts.pop()} rounds"
    return f"{min(counts)}-{max(counts)} rounds: the pairs column"


def plot_prefill(result: dict, path: Path) -> Path:
    fig, (ax, ax2) = new_figure(2)
    rows = result["rows"]
    labels = [f"{r['method']}\n{r['length']}" for r in rows]
    xs = range(len(rows))
    ratios = [target_ratio(r)[0] for r in rows]
    ax.bar(xs, ratios, color="C0")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(PREFILL_TARGET, color="C3", ls="--", label=f"target {PREFILL_TARGET:.2f}")
    ax.set_xticks(list(xs), labels, fontsize=7, rotation=45)
    ax.set(ylabel="method / full prefill time (ratio of minima)", title="Prefill time over the full cache")
    ax.set_ylim(min(0.8, min(ratios, default=1) - 0.05), max(1.2, max(ratios, default=1) + 0.05))
    ax.legend(fontsize=8)
    model_s = [r["s"] - r["hook_s"] for r in rows]
    ax2.bar(xs, model_s, label="model forward", color="C2")
    ax2.bar(
        xs,
        [r["hook_s"] - r["evict_s"] for r in rows],
        bottom=model_s,
        label="scoring + allocation",
        color="C1",
    )
    ax2.bar(xs, [r["evict_s"] for r in rows], bottom=[m + r["hook_s"] - r["evict_s"] for m, r in zip(model_s, rows, strict=True)],
            label="eviction", color="C3")  # fmt: skip
    ax2.scatter(
        list(xs), [r["full_s"] for r in rows], color="k", marker="_", s=300, label="full cache", zorder=3
    )
    ax2.set_xticks(list(xs), labels, fontsize=7, rotation=45)
    ax2.set(ylabel="seconds (median)", title="Where the prefill time goes")
    ax2.legend(fontsize=8)
    return save_figure(fig, path)
