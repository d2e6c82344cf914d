"""What the dense and the ragged decode steps share: nothing here knows the layout.

The per-entry tensors these functions read are (B, H_kv, N) views a layout hands in (dense: as
stored; ragged: gathered through its padded view), and the attention takes the keys, values and
mask a layout has already shaped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ..logit_terms import PLAIN, LogitTerms
from ..ragged import to_device

GROWTH = 64  # columns (dense) or slots per segment (ragged) added when decode=none runs out
# decode=fixed preallocates up to its budget: refuse more than this beyond what a head holds
MAX_PREALLOCATED = 1 << 20
# what an empty slot holds; H2O's kept sums start at 0
FILLS = {"keys": 0.0, "values": 0.0, "positions": -1, "scores": 0.0}


# -- laying a layer out ------------------------------------------------------------------------
def prepare(layer, budget: np.ndarray | None) -> dict[str, torch.Tensor | None]:
    """The start of ``to_static``: check the budget, decide ``full``, start the device position.

    Returns the per-entry tensors as (B, H_kv, N, ...) (``layer.padded``, empty slots filled
    with ``FILLS``), for the layout to copy into its buffers. ``layer.full``: every head holds
    exactly its budget (the dense layout adds that the budget fills every column but the free
    one), so every head is over its budget at every step and, once the new token is written, no
    slot is empty: no mask to keep, no budget test.

    Everything a step reads that changes per step is a device tensor (``newest``, the position
    of the token being appended; ``used_dev``/``next``, where ``decode=none`` appends;
    ``free``, the slot the next token takes); the only host int, ``room``, counts ``decode=none``'s
    free slots where ``max_cache_len`` is unknown (a compiled step guards on it, symbolic after
    one recompile; a dense layer grows inside it, a ragged one only eagerly: ``ragged.grow``);
    with it known, the room covers every token to come (``layer.full_at``, the length that fills
    it) and the step counts nothing (past it an eager step grows the storage; a compiled one stops
    at ``check_room``)."""
    counts = layer.counts
    if budget is not None and int(budget.max()) > int(counts.max()) + MAX_PREALLOCATED:
        raise ValueError(
            f"static decode storage would preallocate {int(budget.max())} entries per head (the decode "
            f"budget) for {int(counts.max())} kept: pass KVCakeCache(..., max_cache_len=prompt + new tokens) "
            "to bound it, use a budget closer to the prompt, or KVCakeCache(..., static=False), which grows "
            "one entry per step"
        )
    padded = {name: layer.padded(getattr(layer, name), fill) for name, fill in FILLS.items()}
    if padded["scores"] is not None:  # kept sums, finite (0 where the prompt protected or
        padded["scores"] = torch.where(padded["scores"].isfinite(), padded["scores"], 0.0)  # padded)
    b, h = counts.shape
    dev = layer.keys.device
    layer.full = budget is not None and bool((counts == budget).all())
    layer.newest = torch.full((b, h, 1), layer.length - 1, device=dev)  # (B, H_kv, 1) int64
    layer.pos_zero = torch.zeros((), dtype=torch.long, device=dev)  # clamp's lower bound
    layer.steps = torch.zeros((), dtype=torch.long, device=dev)  # compiled steps not yet in counts
    return padded


def finish(layer, budget: np.ndarray | None) -> None:
    """The end of ``to_static``: the policy served, and for ``decode=fixed`` the entries each
    head may still gain before it evicts (``under``, (B, H_kv, 1))."""
    layer.static = "none" if budget is None else "fixed"
    if budget is None:
        return
    layer.static_budget_host = budget
    layer.under = to_device(budget - layer.counts, layer.keys.device).reshape(*budget.shape, 1)


def mark_static(layer) -> None:
    """Mark every tensor of a layer in static storage as a static address
    (``torch._dynamo.mark_static_address``), as transformers' StaticCache marks its buffers: a
    compiled step under CUDA graphs (``mode="reduce-overhead"``) then reads and writes them where
    they are, instead of copying each one into the graph's own input memory at every replay or
    skipping the graphs for inputs it mutates. The steps update these tensors in place (never
    ``layer.x = new``), so the addresses hold from one step to the next. Not while tracing
    (dynamo refuses it there); a layer laid out inside a compiled step is marked at its next
    eager lay-out."""
    if torch.compiler.is_compiling():
        return
    for value in vars(layer).values():
        if isinstance(value, torch.Tensor):
            torch._dynamo.mark_static_address(value)


def bias(positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Positions (..., N) -> additive mask (..., 1, N): 0 on a stored entry, -inf on an empty slot."""
    zero = torch.zeros((), dtype=dtype, device=positions.device)
    return torch.where(positions >= 0, zero, float("-inf")).unsqueeze(-2)


def filled(t: torch.Tensor, width: int, fill, dim: int = 2) -> torch.Tensor:
    """A tensor like ``t`` with ``width`` along ``dim``, filled with ``fill``."""
    shape = list(t.shape)
    shape[dim] = width
    return torch.full(shape, fill, dtype=t.dtype, device=t.device)


# -- append --------------------------------------------------------------------------------------
def advance(layer, grow: Callable) -> None:
    """Before an append: ``decode=none`` takes one slot of the room, after the layout's ``grow``
    where none is left, and every head counts one more entry; ``newest`` (B, H_kv, 1) steps to
    the new token's position (after ``grow``, which may lay the layer out anew). A compiled
    ``decode=fixed`` step where some head holds less than its budget (its storage sized to
    ``max_cache_len``: ``full_at``) stops at a device-side check past it, as ``check_room``."""
    if layer.static == "none":
        if layer.room is None and not torch.compiler.is_compiling() and layer.length >= layer.full_at:
            layer.room = 0  # past max_cache_len, eagerly: grow and count as without one
        if layer.room is not None:  # capacity unknown: a host count, which a compiled step guards on
            if layer.room <= 0:
                grow(layer)
                mark_static(layer)  # the new buffers (a compiled step recompiles on them: amortised)
            layer.room -= 1
        count_step(layer)
    layer.newest.add_(1)
    if layer.static == "fixed" and layer.full_at is not None and torch.compiler.is_compiling():
        # some head's budget is above what its storage holds (the tokens up to max_cache_len)
        torch._assert_async((layer.newest < layer.full_at).all(), PAST_CAPACITY)


PAST_CAPACITY = (
    "a compiled decode step went past KVCakeCache(max_cache_len=...), the tokens its static storage was "
    "laid out for: pass max_cache_len=prompt + every token to generate (an eager step lays the storage out anew)"
)


def check_room(layer, slot: torch.Tensor, end: torch.Tensor | int) -> None:
    """In a compiled step whose room was reserved up to ``max_cache_len`` (``layer.room`` None,
    nothing counted on the host): stop with a clear error where the new token's ``slot`` would be
    at or past ``end`` (a ragged segment's next slot is its neighbour's first: the write would land
    there). Nothing orders it before the write, so inductor's own bounds check of a dense write
    past the buffer may stop the step first, with its message."""
    if layer.room is None and torch.compiler.is_compiling():
        torch._assert_async((slot < end).all(), PAST_CAPACITY)


# -- attend --------------------------------------------------------------------------------------
def fused_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, None]:
    """The new token's attention without probabilities, in the fused kernel.

    query: (B, H, 1, d); keys, values: (B, H_kv, N, d); mask: (B, H_kv, 1, N) additive, or None.
    The GQA group is folded into the query rows. Returns (B, 1, H, d) and None."""
    b, h, _, d = query.shape
    qs = query.reshape(b, keys.shape[1], h // keys.shape[1], d)  # (B, H_kv, G, d)
    out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, scale=scaling)
    return out.reshape(b, 1, h, values.shape[-1]), None  # (B, H_kv, G, d_v) -> (B, 1, H, d_v)


def attention_with_probs(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scaling: float,
    terms: LogitTerms = PLAIN,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The new token's attention and its probabilities: :func:`attention_probs`'s, then one
    batched matmul with the values in their dtype.

    query: (B, H, 1, d); keys, values: (B * H_kv, N, d); mask: (B * H_kv, 1, N) additive, or
    None. Returns the output (B, 1, H, d) and the probabilities (B, H_kv, G, N) in float32 (the
    GQA group on dim 2, as ``Scorer.decode_step`` reads them). terms: the model's soft cap and
    sinks (``kvcake.logit_terms``): this is the route of a model with either, output included."""
    b, h, _, d = query.shape
    hkv = keys.shape[0] // b
    probs = _probs(query, keys, mask, scaling, terms)  # (B*H_kv, G, N)
    out = torch.bmm(probs, values.to(probs.dtype)).to(query.dtype)
    return out.reshape(b, 1, h, values.shape[-1]), probs.reshape(b, hkv, h // hkv, keys.shape[1])


def attention_probs(
    query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """The new token's attention probabilities alone, for a scorer beside an output computed by
    the fused kernel (:func:`fused_attention`, the call a full cache of the same layout makes, so
    half-precision outputs round exactly as its do).

    query: (B, H, 1, d); keys: (B * H_kv, N, d); mask: (B * H_kv, 1, N) additive, or None.
    Returns (B, H_kv, G, N) in float32 (float64 for float64 inputs)."""
    b, h = query.shape[:2]
    hkv = keys.shape[0] // b
    return _probs(query, keys, mask, scaling).reshape(b, hkv, h // hkv, keys.shape[1])


def _probs(query, keys, mask, scaling, terms: LogitTerms = PLAIN) -> torch.Tensor:
    """(B*H_kv, G, N) probabilities of :func:`attention_probs`: a batched matmul (with the
    additive mask, in one op where no soft cap comes between) and a softmax (``terms``' sinks)."""
    b, h, _, d = query.shape
    hkv = keys.shape[0] // b
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32  # a dtype rule, not an ATen op
    qs = query.reshape(b * hkv, h // hkv, d).to(acc)  # (B*H_kv, G, d)
    keys_t = keys.to(acc).transpose(1, 2)  # (B*H_kv, d, N)
    if mask is None or terms.softcap is not None:
        logits = terms.cap(torch.bmm(qs, keys_t).mul_(scaling))
        logits = logits if mask is None else logits + mask.to(acc)
    else:  # scaling * (q k^T) + mask, in one op
        logits = torch.baddbmm(mask.to(acc), qs, keys_t, alpha=scaling)
    sinks = terms.grouped(b, hkv, 1)  # (B, H_kv, G, 1)
    return terms.softmax(logits, None if sinks is None else sinks.reshape(b * hkv, h // hkv, 1))


# -- evict ---------------------------------------------------------------------------------------
class Ranked(NamedTuple):
    """One step's scores (B, H_kv, N) and the positions they belong to: sorted newest first for
    a scorer that pools neighbours (``order``: the columns they came from), else as held
    (``order`` None)."""

    scores: torch.Tensor
    positions: torch.Tensor
    order: torch.Tensor | None


def rank(
    scorer, probs: torch.Tensor | None, pos: torch.Tensor, previous: torch.Tensor | None, across
) -> Ranked:
    """Score the entries of one step. probs: (B, H_kv, G, N) from ``attend`` (None for scorers
    that read no attention); pos: (B, H_kv, N) positions; previous: the kept sums of a stateful
    scorer (H2O), else None. ``across``: a function applied to the scores before they are used (a
    tensor-parallel cache's mean over ranks, TOVA)."""
    if scorer.order_sensitive:  # pooling neighbours: entries sorted by position, newest first
        pos_s, order = pos.sort(-1, descending=True)  # (B, H_kv, N) twice
        if probs is not None:
            probs = probs.gather(-1, order.unsqueeze(2).expand_as(probs))
        if previous is not None:
            previous = previous.gather(-1, order)
    else:
        pos_s, order = pos, None
    scores = scorer.decode_step(probs, pos_s, previous)
    if across is not None:
        scores = across(scores.expand_as(pos_s))
    return Ranked(scores, pos_s, order)


def in_held_order(ranked: Ranked, out: torch.Tensor | None = None) -> torch.Tensor:
    """The scores (B, H_kv, N) in the columns the entries are held in (a stateful scorer's new
    sums), written into ``out`` where given (the layer's own tensor: ``mark_static``)."""
    if ranked.order is None:
        return ranked.scores if out is None else out.copy_(ranked.scores)
    out = torch.empty_like(ranked.scores) if out is None else out
    return out.scatter_(-1, ranked.order, ranked.scores)


def choose_victim(
    layer, ranked: Ranked, pos: torch.Tensor, window: int, empty_slots: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The column (B, H_kv, 1) of ``pos`` (B, H_kv, N) each head frees this step, written into
    ``out`` where given (the layer's own ``free``: ``mark_static``).

    The newest ``window`` positions are protected, and so are empty slots where the view may
    hold some (``empty_slots``); the victim is the lowest score, the latest position among ties
    (the reference's rule: ties keep the earlier position). A head still under its budget evicts
    nothing: it frees its first empty column, where its next token goes. The host counts step
    with it: every head one more entry, up to its budget."""
    pos_s = ranked.positions
    floor = layer.newest - window  # (B, H_kv, 1): later positions are the window
    if empty_slots:  # the window, and empty slots (-1): outside [0, floor]
        protected = pos_s != pos_s.clamp(min=layer.pos_zero, max=floor)
    else:
        protected = pos_s > floor
    scores = ranked.scores.masked_fill(protected, float("inf"))
    last = out if layer.full else None  # the last op writes into out
    if ranked.order is not None:  # newest first: the first minimum is the latest of the ties
        # copied, not gathered with out=: fake tensors refuse gather's out= where an input has a
        # symbolic size (a recompile with dynamic shapes; seen on an H200 with transformers' compile)
        victim = ranked.order.gather(-1, scores.argmin(-1, keepdim=True))
        victim = victim if last is None else last.copy_(victim)
    else:
        low = scores.amin(-1, keepdim=True)
        # the latest of the ties
        victim = torch.argmax(pos.masked_fill(scores != low, -1), -1, keepdim=True, out=last)
    if not layer.full:  # a head under its budget takes its first empty slot instead
        victim = torch.where(layer.under > 0, pos.argmin(-1, keepdim=True), victim, out=out)
        layer.under.sub_(1)
    count_step(layer)
    return victim


def count_step(layer) -> None:
    """The host counts after one appended token: every head one more entry, up to its budget
    (decode=fixed), folded in when the counts are next read (:func:`catch_up_counts`). Eagerly a
    host int (``layer.host_steps``): numpy's two ops on the counts at every layer and step took
    ~20 us of host time, three ATen ops' worth. In a compiled step on the device (``layer.steps``):
    numpy in a traced step would be tensors built from host data at every call and CPU ops in the
    step's graph."""
    if torch.compiler.is_compiling():
        layer.steps.add_(1)
        layer.counts_lag = True
    else:
        layer.host_steps += 1


def catch_up_counts(layer) -> np.ndarray:
    """The host counts (B, H_kv) with the steps since they were last read folded in: the eager
    ones counted on the host, the compiled ones read off the device (one read, as
    ``layer.length``'s)."""
    k = layer.host_steps
    if layer.counts_lag:
        k += int(layer.steps)
        layer.steps.zero_()
    layer._counts, layer.counts_lag, layer.host_steps = _capped(layer, layer._counts + k), False, 0
    return layer._counts


def _capped(layer, counts: np.ndarray) -> np.ndarray:
    """decode=fixed: no head above its decode budget."""
    return np.minimum(counts, layer.static_budget_host) if layer.static == "fixed" else counts


# -- back to the reference -----------------------------------------------------------------------
def in_position_order(layer) -> dict[str, torch.Tensor]:
    """The start of ``to_dynamic``: every per-entry tensor as (B, H_kv, N, ...), each head's
    empty slots first, then its entries in position order (what the layout then compacts)."""
    pos = layer.padded(layer.positions, -1)  # (B, H_kv, N)
    order = pos.argsort(dim=-1, stable=True)  # empties (-1) first, then position order
    out = {}
    for name, fill in FILLS.items():
        t = layer.padded(getattr(layer, name), fill)
        if t is not None:
            idx = order.reshape(*order.shape, *([1] * (t.dim() - 3))).expand_as(t)
            out[name] = t.gather(2, idx)
    return out
