"""The decoding side of ``KVCakeCache``: the ``fixed`` policy evicts each head back to its
budget after every step, by the scorer's per-step scores; the newest ``window`` positions are
protected. Static layers do it in place, one victim per head by argmin (``layer.step.evict``:
``kvcake/step/dense.py``, ``kvcake/step/ragged.py``).
``cache`` is always a ``KVCakeCache`` (typed by its base: this module sits below ``cache.py``)."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
from transformers.cache_utils import Cache

from .devices import fix_batch
from .fp8 import hold_recent
from .ragged import to_device
from .selectors import SelectionInputs, TopK

PAST_BUDGET = (
    "a compiled decode step reached the decoding budget of a layer that evicted nothing from the prompt "
    "(its budget was above it): its first eviction lays it out anew, which a compiled step cannot. Pass "
    "KVCakeCache(max_cache_len=prompt + every token to generate), which lays it out before the first "
    "step, or run the steps past it eagerly"
)


def wants_probs(cache: Cache, layer_idx: int) -> bool:
    """Whether this step's attention must return probabilities (decoding-time eviction)."""
    if not cache.prefilled or cache.method.decode != "fixed":
        return False
    layer = cache.layers[layer_idx]
    if layer.static is not None:  # decided once for static storage, never from the data
        return layer.static == "fixed" and cache.method.scorer.needs_probs
    return layer.scores is not None or _over_budget(cache, layer, layer_idx)


def _over_budget(cache: Cache, layer, layer_idx: int) -> bool:
    """Whether a dynamic layer holds more than its decoding budget on some head. A plain layer
    holds at most ``length`` entries a head: within its smallest budget (``evicts_past``, a host
    int of its static plan) it is over none, which a compiled step reads as it is (the count check
    traces as data-dependent); past it, a compiled step cannot evict from it (``PAST_BUDGET``)."""
    if layer.plain and layer.evicts_past is not None:
        if layer.length <= layer.evicts_past:
            return False
        if torch.compiler.is_compiling():
            raise ValueError(PAST_BUDGET)
    return bool((layer.counts > cache.decode_budget[:, cache._slot[layer_idx]]).any())


def plan(cache: Cache, layer_idx: int) -> None:
    """Give compressed layer ``layer_idx`` its static plan (``KVCakeCache.plan_static``):
    ``((B, H_kv) decode budgets, max_cache_len)`` for ``decode=fixed``, ``(None, max_cache_len)``
    for ``decode=none``. A *plain* layer (it evicted nothing, and the model's own kernel reads it
    as a full cache's) stays as it is, unless ``decode=fixed`` will evict from it before the
    capacity is reached (``evicts_ahead``): its first eviction, left to the dynamic path, would
    run inside a decode step, which a compiled step cannot (its check is data-dependent), so it
    moves into static storage with the others and evicts in place, read by the kvcake attention.
    Where its budget covers the capacity, or the capacity is unknown, it stays plain; a compiled
    step reads its length instead of its counts (``_over_budget``) and stops where it would evict."""
    layer, capacity = cache.layers[layer_idx], cache.max_cache_len
    budget = cache.decode_budget[:, cache._slot[layer_idx]]  # (B, H_kv)
    fixed = cache.method.decode == "fixed"
    layer.static_plan = (budget if fixed else None, capacity)
    bounded = fixed and capacity is not None and layer.plain
    layer.evicts_ahead = bounded and not bool((budget >= capacity).all())
    layer.evicts_past = int(budget.min()) if fixed else None
    layer.oldest = cache.method.scorer.oldest_victim(cache.method.budget.window) if fixed else None


def lay_out_after_append(cache: Cache, layer_idx: int) -> None:
    """After a multi-token append's attention and its eviction back to the decoding budget, a
    compressed layer with a static plan moves into its buffers at once, so that the next
    single-token step (the first of a compiled decode after a compressed context's question)
    finds it laid out: converting inside a compiled step breaks its graph, and a CUDA-graph
    capture of it crashed (H100, 2026-11-26). The entries kept are the same either way."""
    layer = cache.layers[layer_idx]
    if layer.static is None and layer.wants_static:
        layer.to_static()
        cache._track_bytes(layer_idx)


def outgrow_capacity(cache: Cache, layer_idx: int, tokens: int) -> None:
    """Before an eager single-token step past ``max_cache_len`` (read at the first compressed layer):
    plan and lay out every layer as without one. A ``decode=fixed`` layer whose budget is above its
    entries holds only the entries plus the tokens that were left (``KVCakeLayer.to_static``), so
    past them it would evict below its budget; ``decode=none`` storage and sliding rings grow anyway.
    A compiled step cannot lay anything out: where the storage does not serve past the capacity it
    stops with an error (``step.common.PAST_CAPACITY``, sliding rings too)."""
    cap, first = cache.max_cache_len, cache.layers[layer_idx]
    if cap is None or torch.compiler.is_compiling() or not cache.prefilled or tokens != 1:
        return
    if layer_idx != cache.compressed[0] or first.length < cap:  # (a count on the host, read eagerly)
        return
    cache._max_cache_len = None  # the capacity no longer holds (planned below)
    for layer in (cache.layers[lid] for lid in cache.compressed if cache.layers[lid].static is not None):
        layer.step.to_dynamic(layer)
    cache.plan_static(lay_out=True)


def fit_torch_mode(cache: Cache, layer_idx: int, key_states: torch.Tensor) -> None:
    """Before a step of a prefilled cache, what torch's modes ask of its storage (and of a
    compiled CPU step's batch: ``devices.fix_batch``).

    A step autograd records (gradients enabled, keys that require them): static storage is written
    in place, which autograd cannot go back through (transformers' ``StaticCache`` fails there too),
    so the cache moves to the dynamic layout for good; its kept entries carry their gradients.
    Prefilled inside ``torch.inference_mode``, decoded outside: inference tensors may not be written
    in place out there (``StaticCache`` stops there), so static storage and rings move to the dynamic
    layout (``KVCakeCache.compact``), whose next single-token step lays them out again in normal
    tensors, and float8 storage's rings are copied. The same entries, read the same either way.
    (Recurrent states stay as they are: ``DynamicCache`` cannot update them outside inference mode.)"""
    recording = cache.static and torch.is_grad_enabled() and key_states.requires_grad
    if recording and torch.compiler.is_compiling():  # (a compiled step cannot change the layout)
        raise ValueError(
            "a compiled step of a KVCakeCache with gradients enabled: its static storage is written in place, "
            "which autograd cannot go back through; decode under torch.no_grad() (generate does), or make "
            "the cache with static=False to backpropagate"
        )
    fix_batch(key_states)  # a compiled CPU step: a graph per batch size, its products fused
    if torch.compiler.is_compiling() or not cache.prefilled:
        return
    if recording:
        cache.compact()
        cache.serve(False)
    held = getattr(cache.layers[layer_idx], "keys", None)
    if torch.is_inference_mode_enabled() or not (isinstance(held, torch.Tensor) and held.is_inference()):
        return
    cache.compact()
    for layer in (cache.layers[lid] for lid in cache.compressed):
        if getattr(layer, "recent_keys", None) is not None:  # float8 storage's rings (fp8.py)
            rings = layer.recent_keys, layer.recent_values, layer.recent_positions
            hold_recent(layer, *(ring.clone() for ring in rings))


def evict_step(cache: Cache, layer_idx: int, probs: torch.Tensor | None) -> None:
    """Bring layer ``layer_idx`` back to its decoding budget after one step's attention."""
    layer = cache.layers[layer_idx]
    window = cache.method.budget.window
    if layer.static == "fixed":
        layer.step.evict(layer, cache.method.scorer, probs, window, _across(cache))
        return
    if probs is None:
        return
    budget = cache.decode_budget[:, cache._slot[layer_idx]]  # (B, H_kv)
    over = _over_budget(cache, layer, layer_idx)
    positions = layer.padded_positions()  # (B, H_kv, N)
    scores = cache.method.scorer.decode(probs, positions, layer.padded(layer.scores, float("-inf")))
    if (across := _across(cache)) is not None:
        scores = across(scores)
    if layer.scores is not None:  # stateful (H2O): keep the accumulated sums
        layer.scores = layer.unpad(scores.masked_fill(positions < 0, 0.0))
    if not over:
        return
    newest = positions.amax(-1, keepdim=True)
    protected = positions > newest - window
    scores = scores.masked_fill(protected, float("inf")).masked_fill(positions < 0, float("-inf"))
    counts = np.minimum(layer.counts, budget)
    if layer.layout == "dense" and bool((counts == counts.flat[0]).all()):
        layer.keep_positions(TopK().select_indices(scores, int(counts.flat[0])), counts)
    else:
        keep = TopK().select(SelectionInputs(scores, to_device(counts, scores.device)))
        layer.evict(keep, counts, ragged=layer.layout == "ragged")
    cache._track_bytes(layer_idx)


def with_window_sums(layer, sums: torch.Tensor | None) -> torch.Tensor | None:
    """A stateful scorer's kept prompt scores with the window's +inf replaced by its own sums
    (``sums`` (B, H_kv, w): the prompt's last ``w`` columns as scored), at the end of prefill: H2O
    accumulates every query's attention, and a window entry's count starts with the prompt's
    rows after it, as every other entry's does (from 0 it would lose them as it leaves the
    window; ``tests/test_h2o.py``)."""
    if sums is None or layer.scores is None:
        return layer.scores
    scores, positions = layer.padded(layer.scores, float("-inf")), layer.padded_positions()  # (B, H_kv, N)
    first = layer.length - sums.shape[-1]  # the column of the window's first entry
    in_window = torch.isposinf(scores) & (positions >= first)
    found = sums.gather(-1, (positions - first).clamp(0, sums.shape[-1] - 1))
    return layer.unpad(torch.where(in_window, found, scores))


def _across(cache: Cache):
    """What each step's (B, H_kv, N) scores take from the other ranks of a tensor-parallel model:
    a layer-wide scorer's (TOVA) mean over ranks (every head holds the same positions in the same
    slots, since they share scores); on a latent model whose query group the ranks share, the
    scores pooled over the ranks as over the group (``HeadSplit.pool``); ``None`` otherwise. Costs
    one all-gather of the scores per layer and step."""
    scorer = cache.method.scorer
    if cache.group_split is not None and scorer.needs_probs:
        return partial(cache.group_split.pool, how=scorer.reduce)
    if cache.split is None or not scorer.layer_wide:
        return None
    return cache.split.head_mean


def check_compiled_room(method, compile, room: int | None) -> None:
    """Refuse a step compiled whole (``compile=True``, or a ``CompileConfig`` with ``fullgraph``) where a
    head-wise method that keeps every new token (``decode=none``) would outgrow its segments: only an
    eager step lays them out anew (``step.ragged.grow``), so their room must cover the generation."""
    whole = compile is True or bool(getattr(compile, "fullgraph", False))
    if whole and room is None and method.heads.ragged and method.decode == "none":
        raise ValueError(
            f"compile=True with {method.name or 'a head-wise method'} (per-head budgets, every new token kept) "
            "needs the generation's length up front, and none was given (the model's own max_length is not "
            "read: transformers releases count it differently): pass max_new_tokens="
        )
