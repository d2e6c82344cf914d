"""Memory: KV bytes during and after prefill, next to their theoretical values, and process peak.

For every prompt length, one forward pass fills the full cache (a transformers ``DynamicCache``)
and every method's ``KVCakeCache`` (``common.shared_prefill``); each cache's bytes are read off
its own tensors. Theory, per sequence, with ``E = H_kv * d * 2 * bytes_per_element`` the bytes of
one entry over the KV heads (keys and values):

- full cache: ``S * L * E``;
- compressed, end of prefill: ``sum_l budget_l * E``; for a ragged (Ada-KV) cache the per-head
  counts: ``sum_{l,h} count_{l,h} * d * 2 * bytes``, which must equal the budget sum;
- peak during prefill: a method that evicts each layer right after its attention (SnapKV,
  PyramidKV, Ada-KV) peaks at ``max_m (sum_{l<m} budget_l + S) * E``; CAKE with cascading never
  holds more than the total budget plus one layer's full prompt, ``(B_total + S) * E``; CAKE
  without cascading holds all ``L`` full layers until the last one: ``S * L * E``.

Hybrid models (Gemma 3): ``L`` counts the compressed (full-attention) layers only, and every
kvcake theory adds the sliding-window layers at ``min(S, W - 1) * E`` each (kvcake's sliding layers
hold their window from the start). The full cache (a ``DynamicCache`` built from the model's
config) counts ``min(S, W - 1)`` entries per sliding layer too, but keeps them as a slice of the
whole prompt until the layer's next update: from the prompt until the first decode step it holds
``S * E`` per sliding layer, which is what its row measures (``cache_kv_bytes`` counts storage)
and its theory says; ``full_cache_bytes`` is what it holds once decoding.

The process's peak memory is measured in separate runs, one per method (``common.PeakMemory``).

The caches are built with ``static=False``: the bytes are what compression keeps, as a compressed
context (``kvcake.compress``) holds them. A cache that goes on decoding in static storage (the
default) adds the capacity it reserves at the end of the prompt (README, "Memory"), which is
what the decode benchmark's bytes include.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..adapters import with_cache
from ..attention import enable
from .common import (
    PREFILL_METHODS,
    BenchModels,
    FullCache,
    MiB,
    PeakMemory,
    build_cache,
    fmt,
    log_axes,
    markdown_table,
    new_figure,
    prompt_ids,
    save_figure,
    shared_prefill,
    verdict,
)
from .output import emit

logger = logging.getLogger(__name__)

TOLERANCE = 0.05  # targets: cascade peak <= 1.05 x bound; no-cascade peak within 5% of every layer full


@dataclass(frozen=True)
class KVShape:
    """Shape of a model's KV cache: ``L`` layers, ``H_kv`` KV heads, head dim ``d``, element bytes."""

    layers: int
    kv_heads: int
    head_dim: int
    elem_bytes: int

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "elem_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def entry_bytes(self) -> int:
        """Bytes of one kept position in one layer over all KV heads: ``H_kv * d * 2 * bytes``."""
        return self.kv_heads * self.head_dim * 2 * self.elem_bytes

    @classmethod
    def of(cls, model: torch.nn.Module) -> KVShape:
        from ..adapters import describe_model

        info = describe_model(model)
        elem = next(model.parameters()).element_size()
        return cls(len(info.compressed_layers), info.num_kv_heads, info.head_dim, elem)


def sliding_kv_bytes(model: torch.nn.Module, length: int, shape: KVShape) -> int:
    """Bytes the sliding-window layers of a hybrid hold after ``length`` tokens (0 otherwise):
    ``min(S, W - 1)`` entries per layer, as transformers' sliding layer keeps."""
    from ..adapters import describe_model

    windows = describe_model(model).windows
    return sum(min(length, w - 1) for w in windows if w is not None) * shape.entry_bytes


def stock_sliding_bytes(model: torch.nn.Module, length: int, shape: KVShape) -> int:
    """Bytes transformers' ``DynamicCache`` holds for a hybrid's sliding layers right after a prompt
    of ``length`` tokens (0 without them): the whole prompt each, of which it keeps the last
    ``W - 1`` entries as a slice until the layer's next update (:func:`sliding_kv_bytes` after it)."""
    from ..adapters import describe_model

    return sum(w is not None for w in describe_model(model).windows) * length * shape.entry_bytes


def full_kv_bytes(length: int, shape: KVShape, batch: int = 1) -> int:
    """``S * L * H_kv * d * 2 * bytes`` (times the batch)."""
    return batch * length * shape.layers * shape.entry_bytes


def compressed_kv_bytes(budgets, shape: KVShape) -> int:
    """Bytes of a cache holding ``budgets`` entries per (sequence, layer) and per KV head.

    budgets: (L,) or (B, L) integers."""
    return int(np.asarray(budgets, dtype=np.int64).sum()) * shape.entry_bytes


def ragged_kv_bytes(counts, shape: KVShape) -> int:
    """Bytes of a cache holding ``counts`` (B, L, H_kv) entries per head: ``sum * d * 2 * bytes``."""
    return int(np.asarray(counts, dtype=np.int64).sum()) * shape.head_dim * 2 * shape.elem_bytes


def cascade_peak_bound(total_budget: int, length: int, shape: KVShape) -> int:
    """CAKE's cascading bound: the total budget plus one layer's full prompt, ``(B_total + S) * E``,
    never more than the full cache."""
    return min(total_budget + length, length * shape.layers) * shape.entry_bytes


def layerwise_peak(budgets, length: int, shape: KVShape) -> int:
    """Peak of a method that evicts each layer right after its own attention, ``(L,)`` budgets:
    the evicted layers before ``m`` plus layer ``m``'s full prompt, at the worst ``m``."""
    b = np.minimum(np.asarray(budgets, dtype=np.int64).reshape(-1), length)
    before = np.concatenate([[0], np.cumsum(b)[:-1]])  # sum_{l<m} b_l
    return int((before + length).max()) * shape.entry_bytes


def peak_theory(method, budgets, length: int, shape: KVShape) -> tuple[int, str]:
    """(theoretical prefill peak, which rule) for a ``kvcake.Method`` with final (L,) budgets."""
    layers = method.layers
    if getattr(layers, "needs_preferences", False) or getattr(layers, "needs_scores", False):
        if getattr(layers, "cascading", False):
            return cascade_peak_bound(int(np.sum(budgets)), length, shape), "B_total + S (bound)"
        return full_kv_bytes(length, shape), "S*L (all layers full)"
    return layerwise_peak(budgets, length, shape), "layer-wise"


def _kv_rows(models: BenchModels, length: int, methods, budget: int, window: int) -> list[dict]:
    model, label = models.for_length(length)
    shape = KVShape.of(model)
    ids, source = prompt_ids(models.tokenizer if model is models.model else None, length,
                             model.config.vocab_size, models.device)  # fmt: skip
    caches = [build_cache(model, spec, budget, window, static=False) for spec in methods]
    full = FullCache(model.config)
    logger.info("memory: prefill %d tokens once into the full cache and %s", length, ", ".join(methods))
    shared_prefill(model, ids, caches, full)
    sliding = sliding_kv_bytes(model, length, shape)  # hybrids: every kvcake theory below holds them too
    stock = stock_sliding_bytes(model, length, shape)  # the full cache's sliding layers, until it decodes
    full_theory = full_kv_bytes(length, shape) + stock
    # index 0: a DynamicCache holds keys and values alone, none of kvcake's bookkeeping
    rows = [dict(method="full", length=length, model=label, prompt=source, peak=full.peak_kv_bytes,
                 end=full.kv_bytes(), peak_theory=full_theory, end_theory=full_theory,
                 peak_rule="S*L" + (" + sliding layers whole (slices of the prompt)" if stock else ""),
                 decode_theory=full_kv_bytes(length, shape) + sliding, sliding_bytes=stock,
                 index=0)]  # fmt: skip
    for spec, cache in zip(methods, caches, strict=True):
        budgets = cache.budgets[0].tolist()
        parts = cache.kv_bytes_parts()
        counts = cache.layer_counts()
        peak_t, rule = peak_theory(cache.method, budgets, length, shape)
        rows.append(dict(
            method=spec, length=length, model=label, prompt=source, peak=cache.prefill_peak_kv_bytes,
            end=cache.kv_bytes(), peak_theory=peak_t + sliding, peak_rule=rule + (" + sliding" if sliding else ""),
            end_theory=compressed_kv_bytes(budgets, shape) + sliding,
            counts_bytes=ragged_kv_bytes(counts, shape) + sliding,
            budgets=budgets, total_budget=int(np.sum(budgets)),
            layout=sorted({getattr(layer, "layout", "sliding") for layer in cache.layers}),
            cascade_bound=cascade_peak_bound(int(cache.seq.total[0]), length, shape) + sliding,
            entry_bytes=shape.entry_bytes, index=parts.index,
            **_hybrid_parts(cache, parts),
        ))  # fmt: skip
    return rows


def _hybrid_parts(cache, p) -> dict:
    """Hybrid models (Gemma 3): bytes of the sliding and the global layers, and transformers' own
    full cache (sliding layers at their window), as the cache itself counts them (``p``, its
    ``kv_bytes_parts()``)."""
    if not cache.info.hybrid:
        return {}
    return dict(sliding_bytes=p.sliding, global_bytes=p.compressed, full_cache_bytes=p.full)


def _rss_row(models: BenchModels, length: int, spec: str, budget: int, window: int) -> dict:
    model, label = models.for_length(length)
    ids, _ = prompt_ids(models.tokenizer if model is models.model else None, length,
                        model.config.vocab_size, models.device)  # fmt: skip
    with PeakMemory(models.device) as mem:
        cache = (
            FullCache(model.config)
            if spec == "full"
            else build_cache(model, spec, budget, window, static=False)
        )
        ctx = contextlib.nullcontext() if spec == "full" else enable(model)
        with ctx, torch.no_grad():
            model(ids, **with_cache(model, cache), logits_to_keep=1)
        kv_peak = cache.peak_kv_bytes if spec == "full" else cache.prefill_peak_kv_bytes
    del cache
    return dict(method=spec, length=length, model=label, base=mem.base, peak=mem.peak,
                delta=mem.peak - mem.base, kv_peak=kv_peak, how=mem.how)  # fmt: skip


def targets(rows: list[dict]) -> list[dict]:
    """The three memory targets, one entry per (target, length) found in ``rows``."""
    out = []
    by = {(r["method"], r["length"]): r for r in rows}
    for (method, length), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if method in ("cake", "layer-defensivekv"):
            ratio = r["peak"] / r["cascade_bound"]
            who = "CAKE" if method == "cake" else "Layer-DefensiveKV"
            out.append(dict(target=f"{who} cascade peak <= 1.05 x (B_total + one full layer)", length=length,
                            value=ratio, ok=ratio <= 1 + TOLERANCE))  # fmt: skip
        elif method == "cake-oneshot":
            ratio = r["peak"] / r["peak_theory"]
            out.append(dict(target="CAKE without cascade: peak within 5% of S*L (every layer whole)",
                            length=length, value=ratio, ok=abs(ratio - 1) <= TOLERANCE))  # fmt: skip
        elif method == "adakv":
            ok = r["end"] == r["counts_bytes"] == r["end_theory"] and "ragged" in r["layout"]
            out.append(dict(target="Ada-KV ragged bytes == sum of budgets", length=length,
                            value=r["end"] / r["end_theory"], ok=ok))  # fmt: skip
    return out


def tables(result: dict) -> str:
    kv = result["kv"]
    rows = [
        (r["length"], r["method"], fmt(r["peak"] / MiB), fmt(r["peak_theory"] / MiB), fmt(r["peak"] / r["peak_theory"], 3),
         r["peak_rule"], fmt(r["end"] / MiB, 2), fmt(r["end_theory"] / MiB, 2), fmt(r["end"] / r["end_theory"], 3),
         "-" if r.get("index") is None else fmt(r["index"] / MiB, 3), r["model"])
        for r in kv
    ]  # fmt: skip
    text = [f"KV cache bytes, budget {result['budget']} per layer (MiB = 2^20 bytes; measured / theory; "
            "*index*: what kvcake holds beside the kept keys and values at the end, positions and index tensors, "
            "`KVBytes.index`, not in the other columns; - where not recorded):", "",
            markdown_table(("S", "method", "peak MiB", "theory", "ratio", "peak rule", "end MiB", "theory",
                            "ratio", "index MiB", "model"), rows)]  # fmt: skip
    if result["rss"]:
        rss = [(r["length"], r["method"], fmt(r["base"] / MiB, 0), fmt(r["peak"] / MiB, 0), fmt(r["delta"] / MiB, 0),
                fmt(r["kv_peak"] / MiB, 1), fmt((r["delta"] - r["kv_peak"]) / MiB, 0)) for r in result["rss"]]  # fmt: skip
        kind = "device memory (allocated)" if result["rss"][0]["how"].startswith("cuda") else "process RSS"
        text += ["", f"Peak {kind} during one prefill, one run per method ({result['rss'][0]['how']}):", "",
                 markdown_table(("S", "method", "before MiB", "peak MiB", "peak - before", "KV peak MiB",
                                 "rest (activations, allocator)"), rss)]  # fmt: skip
    checks = [(c["target"], c["length"], fmt(c["value"], 3), verdict(c["ok"])) for c in result["targets"]]
    text += ["", "Targets:", "", markdown_table(("target", "S", "measured ratio", "verdict"), checks)]
    return "\n".join(text)


def plot(result: dict, path: Path) -> Path:
    fig, (ax, ax2) = new_figure(2)
    kv = result["kv"]
    methods = list(dict.fromkeys(r["method"] for r in kv))
    for i, m in enumerate(methods):
        rs = sorted((r for r in kv if r["method"] == m), key=lambda r: r["length"])
        xs = [r["length"] for r in rs]
        color = "k" if m == "full" else f"C{i}"
        width, z = (3.5, 1) if m == "full" else (1.5, 2)  # cake-oneshot's peak lies on the full cache's
        ax.plot(xs, [r["peak"] / MiB for r in rs], "o-", color=color, lw=width, zorder=z, label=f"{m} peak")
        if m != "full":
            ax.plot(xs, [r["end"] / MiB for r in rs], "s--", color=color, alpha=0.7, label=f"{m} end")
        if m == "cake":
            ax.plot(xs, [r["cascade_bound"] / MiB for r in rs], ":", color="k", label="cascade bound")
    ax.set(yscale="log", xlabel="prompt tokens", ylabel="KV cache MiB",
           title=f"KV bytes in prefill (budget {result['budget']}/layer)")  # fmt: skip
    log_axes(ax, sorted({r["length"] for r in kv}))
    ax.legend(fontsize=7, ncol=2)
    if result["rss"]:
        rs = result["rss"]
        labels = [f"{r['method']}\n{r['length']}" for r in rs]
        ax2.bar(range(len(rs)), [r["kv_peak"] / MiB for r in rs], label="KV peak")
        ax2.bar(range(len(rs)), [(r["delta"] - r["kv_peak"]) / MiB for r in rs],
                bottom=[r["kv_peak"] / MiB for r in rs], label="rest of the growth")  # fmt: skip
        ax2.set_xticks(range(len(rs)), labels, fontsize=7, rotation=45)
        ax2.set(ylabel="MiB over the memory before the prefill", title="Peak memory growth during prefill")
        ax2.legend(fontsize=8)
    else:
        ax2.set_axis_off()
    return save_figure(fig, path)


def run(
    models: BenchModels,
    *,
    lengths=(1024, 2048, 4096, 8192),
    methods=PREFILL_METHODS,
    budget: int = 128,
    rss_lengths=(4096,),
    window: int = 32,
    out: str | Path | None = None,
    machine: dict | None = None,
    echo: bool = True,
) -> dict:
    """Measure KV bytes at every length and process peak memory at ``rss_lengths``.

    Writes ``out/memory.json`` and ``out/memory.png`` when ``out`` is given, prints the tables when
    ``echo``; returns the result dict (keys ``kv``, ``rss``, ``targets``, ``machine``, ...)."""
    methods = tuple(m for m in methods if m != "full")
    kv = [row for s in lengths for row in _kv_rows(models, s, methods, budget, window)]
    rss = []
    for s in rss_lengths:
        for spec in ("full", *methods):
            logger.info("memory: peak process memory, %s at %d tokens", spec, s)
            rss.append(_rss_row(models, s, spec, budget, window))
    result = dict(bench="memory", machine=machine, budget=budget, window=window, lengths=list(lengths),
                  methods=list(methods), kv=kv, rss=rss)  # fmt: skip
    result["targets"] = targets(kv)
    return emit(result, "memory", tables(result) if echo else "", plot, out, echo)
