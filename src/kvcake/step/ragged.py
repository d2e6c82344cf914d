"""The static decode step of a ragged layer, top to bottom: lay out, append, attend, evict.

Layout ``(T_cap + 1, d)``, segment-major as in ``kvcake/ragged.py`` (segment ``s = b * H_kv +
h``): every segment owns ``cap_s`` slots, its ``len_s`` entries first (position -1 = empty
slot); the last slot is a *dummy*, always empty.

* ``decode=none``: ``cap_s = len_s + room``; each segment appends at its ``next`` slot (a
  device index, (B, H_kv, 1)), and the layer is laid out anew, ``GROWTH`` more slots per
  segment, once the smallest room is gone.
* ``decode=fixed``: ``cap_s = max(len_s, budget_s) + 1``, never grows, so every segment has one
  *free* slot (``free``, (B, H_kv, 1) flat indices): the new entry is written there and
  attended; then the victim (argmin of the scores, window protected) is marked empty and its
  slot becomes the segment's next free slot (nothing moves), or, for a head still under its
  budget, its next empty slot does.

A step reads the layer through ``pad_index`` (B * H_kv, M), each segment's slots padded with the
dummy to the longest capacity ``M``: one gather per tensor gives the (B, H_kv, M) view the
dense kernels and the eviction read, while the layer holds only the sum of its capacities.
Where the device has a variable-length kernel that skips unused slots (``varlen.choose_route``,
``seqused``), the attention without probabilities reads the segments in place instead, each up
to its stored prefix: the bytes a step reads are the entries held, not the padded view's.

The reference is the dynamic ragged layer of ``layer.py`` (compact segments, the segment
softmax of ``kvcake.ragged``), which ``to_dynamic`` restores.
"""

from __future__ import annotations

import numpy as np
import torch

from ..fp8 import folded, ring_base, scaled
from ..logit_terms import PLAIN, LogitTerms
from ..ragged import RaggedMeta, kept_indices, row_segments, to_device
from ..varlen import choose_route, varlen_attention
from .common import (
    FILLS,
    GROWTH,
    advance,
    attention_with_probs,
    bias,
    check_room,
    choose_victim,
    finish,
    fused_attention,
    in_held_order,
    in_position_order,
    prepare,
    rank,
)


def to_static(layer, budget: np.ndarray | None, room: int = GROWTH) -> None:
    """Move a ragged ``layer`` into segments with capacity.

    budget: (B, H_kv) decode budgets for ``decode=fixed``, None for ``decode=none``; room:
    ``decode=none`` steps preallocated before the storage grows (the cache's ``max_cache_len``
    minus the prompt when known, else ``GROWTH``). See ``common.prepare``."""
    room = max(int(room), 1)
    padded = prepare(layer, budget)  # (B, H_kv, N, ...) over the compact segments
    counts = layer.counts
    cap = counts + room if budget is None else np.maximum(counts, budget) + 1  # (B, H_kv) host
    dev = layer.keys.device
    meta = RaggedMeta.from_counts(cap, dev)
    src_valid = padded["positions"] >= 0  # (B, H_kv, N): entries are first in each segment
    nth = src_valid.long().cumsum(-1) - 1  # each entry's index in its segment
    b, h, _ = src_valid.shape
    dest = meta.offsets[:-1].reshape(b, h, 1) + nth  # (B, H_kv, N)
    total = int(cap.sum())  # host; the dummy slot is ``total``
    held = kept_indices(src_valid.reshape(-1), int(counts.sum()))  # the entries, without a read back
    dest = dest.reshape(-1).index_select(0, held)
    for name, t in padded.items():
        if t is not None:
            out = torch.full((total + 1, *t.shape[3:]), FILLS[name], dtype=t.dtype, device=dev)
            out.index_copy_(0, dest, t.flatten(0, 2).index_select(0, held))  # (latent values: 0 wide)
            setattr(layer, name, out)
    m = int(cap.max())
    local = torch.arange(m, device=dev)
    inside = local < meta.lengths[:, None]  # (B*H_kv, M)
    pad_index = torch.where(inside, meta.offsets[:-1, None] + local, total)  # (B*H_kv, M)
    # the same indices shaped for each gather (views of one constant tensor, never written)
    layer.pad_index, layer.pad_rows = pad_index, pad_index[:, None]  # (B*H_kv, M), (B*H_kv, 1, M)
    layer.pad_heads, layer.pad_rows4 = pad_index.reshape(b, h, m), pad_index.reshape(b, h, 1, m)
    layer.meta = meta
    layer.capacity = cap
    # where each slot's ring of recent entries starts (its segment's; the dummy's: the first), float8: fp8.py
    layer.slot_base = None
    if layer.recent_base is not None:
        layer.slot_base = ring_base(layer, torch.cat([meta.seg, meta.seg.new_zeros(1)]))
    if layer.full:  # no slot inside a segment is empty when the layer attends: only the padding
        layer.bias = None
        layer.pad_bias = bias(torch.where(inside, 0, -1), layer.dtype)  # (B*H_kv, 1, M)
    else:
        layer.bias = bias(layer.positions, layer.dtype).reshape(-1)  # (T_cap + 1,)
    layer.zero = torch.zeros((), dtype=layer.dtype, device=dev)  # what index_put_ writes in the mask
    layer.empty = torch.full((), -1, device=dev)
    # The attention without probabilities goes to a variable-length kernel where this device
    # has one that skips each segment's unused tail (``seqused``), decided once per layout.
    # The stored entries of a segment are a prefix of its slots whenever the layer attends (a
    # victim's slot is the next token's), so ``seq_used`` (S,) counts them: +1 per append,
    # at most ``cap - 1`` after an eviction (the free slot). Kept only on that route.
    # (keys and values of one width only, as ``ragged_attention``'s route: a latent layer's differ)
    keys, values = layer.operands()
    one_width = keys.shape[-1] == values.shape[-1]
    layer.varlen_route = choose_route(dev, layer.dtype, seqused=True) if one_width else "reference"
    if layer.varlen_route != "reference":
        layer.cu_k = meta.offsets.to(torch.int32)  # (S + 1,)
        layer.seq_used = to_device(counts.reshape(-1), dev, torch.int32)  # (S,)
        layer.seq_room = (meta.lengths - 1).to(torch.int32)  # (S,) what a segment holds after an eviction
    if budget is None:  # each segment's first slot after its entries
        layer.next = meta.offsets[:-1].reshape(b, h, 1) + to_device(counts, dev)[..., None]
        layer.next_end = meta.offsets[1:].reshape(b, h, 1)  # each segment's end (check_room)
        layer.room = int((cap - counts).min())
    finish(layer, budget)
    if budget is not None:  # each segment's first empty slot
        layer.free = layer.pad_heads.gather(-1, layer.positions[layer.pad_heads].argmin(-1, keepdim=True))


def append(layer, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write the new token's entry in place: one write per stored tensor, and the mask's slot
    opened. k, v: (B, H_kv, 1, d), written at (B, H_kv, 1) flat slots."""
    advance(layer, grow)
    at = layer.next if layer.static == "none" else layer.free
    if layer.static == "none":
        check_room(layer, at, layer.next_end)
    if layer.varlen_route != "reference":
        layer.seq_used.add_(1)
    if layer.bias is not None:
        layer.bias.index_put_((at,), layer.zero)
    layer.keys.index_put_((at,), k)
    layer.values.index_put_((at,), v)
    layer.positions.index_put_((at,), layer.newest)
    if layer.static == "none":  # in place, after the writes that read it (common.mark_static)
        layer.next.add_(1)


def slots(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[index]``: the slots ``index`` (any shape) of a per-slot tensor ``t``, (T_cap + 1,) or
    (T_cap + 1, d), as (*index.shape) or (*index.shape, d). One ATen call (``take``, or
    ``embedding`` for rows) without Python's indexing, which took twice the host time of an
    eager step's gather (rows: 8.7 against 4.1 us for a (2, 150) index, one value a slot: 6.5
    against 4.1 us; one CPU core); compiled, the same gather."""
    return t.take(index) if t.dim() == 1 else torch.embedding(t, index)


def attend(layer, query: torch.Tensor, scaling: float, return_probs: bool, terms: LogitTerms = PLAIN):
    """Attention of the new token over the layer (every stored entry is in its past and its own
    entry is stored, so ``bias`` is the whole mask). query: (B, H, 1, d).

    Returns the output (B, 1, H, d) and, if asked, the probabilities (B, H_kv, G, M) in float32
    over the padded view's columns (0 on the padding). The reference is
    ``kvcake.ragged.ragged_attention_reference``. With a soft cap or sinks (``terms``,
    ``kvcake.logit_terms``) the output comes from the explicit softmax beside the probabilities."""
    explicit = return_probs or not terms.fused
    if not explicit and layer.varlen_route != "reference":
        # each segment's stored prefix, read in place: no gather, no padding, no mask
        query, keys, values, value_scale = folded(
            layer, query, *layer.operands(), layer.positions, layer.slot_base
        )  # (float8: fp8.py)
        out = varlen_attention(query, keys, values, layer.cu_k, layer.pad_index.shape[1], scaling,
                               seqused=layer.seq_used, route=layer.varlen_route)  # fmt: skip
        return scaled(out, value_scale), None  # (B, 1, H, d)
    rows = layer.pad_index if explicit else layer.pad_heads  # gathered (B*H_kv, M, d) / (B, H_kv, M, d)
    pos = base = None  # float8: the gathered entries' positions and rings (fp8.py)
    if layer.recent_base is not None:
        pos, base = slots(layer.positions, rows), layer.recent_base.reshape(*rows.shape[:-1], 1)
    keys, values = layer.operands()
    query, keys, values, value_scale = folded(layer, query, slots(keys, rows), slots(values, rows), pos, base)
    if not explicit:  # mask (B, H_kv, 1, M)
        b, hkv = layer.batch, layer.kv_heads
        if layer.bias is None:  # a full layer: only the padding is masked
            mask = layer.pad_bias.reshape(b, hkv, 1, -1)
        else:
            mask = slots(layer.bias, layer.pad_rows4)
        out, probs = fused_attention(query, keys, values, mask, scaling)
    else:
        mask = layer.pad_bias if layer.bias is None else slots(layer.bias, layer.pad_rows)  # (B*H_kv, 1, M)
        out, probs = attention_with_probs(query, keys, values, mask, scaling, terms)
    return scaled(out, value_scale), probs if return_probs else None


def evict(layer, scorer, probs: torch.Tensor | None, window: int, across=None) -> None:
    """decode=fixed: score the entries, evict one victim per head over its budget.

    probs: (B, H_kv, G, M) from ``attend``; ``across``: see ``common.rank``. The scores are read
    through the padded view; the victim's slot (``common.choose_victim``) becomes the
    segment's ``free`` slot, where the next token is written: nothing is moved."""
    pos = slots(layer.positions, layer.pad_heads)  # (B, H_kv, M), -1 on the padding
    previous = slots(layer.scores, layer.pad_heads) if scorer.stateful else None
    ranked = rank(scorer, probs, pos, previous, across)
    if scorer.stateful:  # keep the new sums (the padding's duplicates all land on the dummy slot)
        layer.scores.index_put_((layer.pad_heads,), in_held_order(ranked))
    victim = choose_victim(layer, ranked, pos, window, empty_slots=True)  # (B, H_kv, 1) columns
    free = layer.free.copy_(layer.pad_heads.gather(-1, victim))  # (B, H_kv, 1) flat slots, in place
    layer.positions.index_put_((free,), layer.empty)
    if scorer.stateful:  # the next token's sum starts at 0
        layer.scores.index_put_((free,), layer.zero.to(layer.scores.dtype))
    if layer.varlen_route != "reference":  # an evicting head's victim slot is free again
        layer.seq_used.copy_(torch.minimum(layer.seq_used, layer.seq_room))


# What ``permute`` moves: per slot (T_cap + 1,), per segment (S,), per head (B, H_kv, 1), and flat
# slot indices per head (B, H_kv, 1). The rest (``pad_*``, ``cu_k``, ``next_end``, ``zero``, ``empty``,
# ``pos_zero``, ``steps``) depends on the capacities only, which a permutation in place keeps.
PER_SLOT = ("keys", "values", "positions", "scores", "bias")
PER_SEGMENT = ("seq_used", "seq_room")
PER_HEAD = ("newest", "under")
SLOT_INDICES = ("next", "free")


def permute(layer, rows: torch.Tensor, host: np.ndarray) -> bool:
    """Beam search's reorder (``kvcake.sequences``; as many ``rows`` (B,) as the batch holds), in
    place where each row takes one of the same capacities and counts (beams of one prompt do): a
    new segment's slots are its source segment's, every buffer written into itself, so the
    addresses a compiled step holds stay (``common.mark_static``). False (nothing done) where the
    rows differ: the layer is laid out anew instead."""
    counts = layer.counts
    if not (np.array_equal(layer.capacity[host], layer.capacity) and np.array_equal(counts[host], counts)):
        return False
    meta, dev = layer.meta, layer.keys.device
    start = meta.offsets[:-1]  # (S,) each segment's first slot
    source = row_segments(rows, layer.kv_heads, dev)  # (S,) each new segment's source
    moved = start.index_select(0, source)  # (S,) the source's first slot
    slots = torch.arange(layer.keys.shape[0], device=dev)  # (T_cap + 1,): the dummy slot stays
    slots[: meta.seg.numel()] = moved.index_select(0, meta.seg) + meta.local
    shift = (moved - start).reshape(*counts.shape, 1)  # (B, H_kv, 1)
    for names, index in ((PER_SLOT, slots), (PER_SEGMENT, source), (PER_HEAD, rows), (SLOT_INDICES, rows)):
        for name in names:  # what this layout holds (``free``/``under``: decode=fixed; ``next``: none)
            t = getattr(layer, name, None)
            if t is not None:
                t.copy_(t.index_select(0, index.to(t.device)) - (shift if names is SLOT_INDICES else 0))
    return True


OUTGROWN = (
    "a compiled decode step ran out of the room kvcake reserved for a head-wise method's segments, which "
    "only an eager step can lay out anew: give the generation's length up front (max_new_tokens=, or "
    "KVCakeCache(..., max_cache_len=prompt + new tokens)), so the storage holds every token to come"
)


def to_dynamic(layer) -> None:
    """Back to the reference layout: compact segments, entries in position order."""
    entries = in_position_order(layer)
    keep = (entries["positions"] >= 0).reshape(-1)  # (B * H_kv * N,)
    idx = kept_indices(keep, int(layer.counts.sum()))  # no read back: the count is the host's
    for name, t in entries.items():
        setattr(layer, name, t.reshape(keep.shape[0], *t.shape[3:]).index_select(0, idx))
    layer.meta = RaggedMeta.from_counts(layer.counts, keep.device)
    layer.static = None


def grow(layer) -> None:
    """decode=none: once the host-known room is gone, lay the layer out anew with ``GROWTH``
    more slots per segment (amortised). Eagerly only: the new layout is computed on the host from
    the counts, which a compiled step holds on the device (``common.count_step``)."""
    if torch.compiler.is_compiling():
        raise ValueError(OUTGROWN)
    layer.static = None
    to_static(layer, None)
