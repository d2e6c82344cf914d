"""Static, preallocated decode storage: appends and decode-time eviction written in place.

After the prompt, a compressed layer's first decode step moves it into buffers with capacity
(``to_static``); from then on a single-token step allocates nothing whose size depends on how
many tokens were generated, and reads nothing back from the device: host counts advance
deterministically (``min(count + 1, budget)``), device indices alongside them.

One step, top to bottom: ``append`` writes the new token's entry (one in-place write per
stored tensor), ``attend`` runs the new token's attention over what the layer holds (the fused
kernel, or two batched matmuls around a softmax where the policy scores the entries), and
``evict`` (``decode=fixed``) scores the entries and frees one victim slot per head.

Layouts (the same per-entry convention as ``layer.py``: position -1 = empty slot):

* dense ``(B, H_kv, C, d)``. ``decode=none``: entries are appended at column ``used_dev`` (a
  device index), the capacity grows in fixed chunks of ``GROWTH`` columns. ``decode=fixed``:
  capacity ``C = max(kept, budget) + 1`` never grows, so every head has one *free* slot: the
  new entry is written there and attended; then the victim (argmin of the scores, window
  protected) is marked empty and its slot becomes the head's next free slot (nothing moves),
  or, for a head still under its budget, its next empty slot does.
* ragged ``(T_cap + 1, d)``: every segment ``s`` owns ``cap_s`` slots, its ``len_s`` entries
  first (``decode=none``: ``cap_s = len_s + room``; ``decode=fixed``: ``max(len_s, budget_s) +
  1``, the free slot as in the dense layout); the last slot is a *dummy*, always empty. A step
  reads the layer through ``pad_index`` (B * H_kv, M), each segment's slots padded with the
  dummy to the longest capacity ``M``: one gather per tensor gives the dense view the dense
  kernels and the eviction read, while the layer holds only the sum of its capacities. Where
  the device has a variable-length kernel that skips unused slots (``varlen.choose_route``,
  ``seqused``), the attention without probabilities reads the segments in place instead, each up
  to its stored prefix: the bytes a step reads are the entries held, not the padded view's.

The attention's visibility mask (``bias``, additive: 0 on a stored entry, -inf on an empty
slot) is kept alongside the writes, so no layer rebuilds it from the positions; a ``full``
fixed layer (every head at its budget, every slot but the free one used: decided once here)
has no empty slot when it attends, and needs none (ragged: a constant one for the padding).

The slow reference is the dynamic path of ``layer.py`` (sort + masked copy, ``dense_attention``,
the segment softmax, ``Scorer.decode``); ``to_dynamic`` turns a static layer back into it
(multi-token appends, batch reordering). ``tests/test_static.py`` decodes against it.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .ragged import RaggedMeta
from .varlen import choose_route, varlen_attention

GROWTH = 64  # columns (dense) or slots per segment (ragged) added when decode=none runs out
# decode=fixed preallocates up to its budget: refuse more than this beyond what a head holds
MAX_PREALLOCATED = 1 << 20


def to_static(layer, budget: np.ndarray | None, room: int = GROWTH) -> None:
    """Move ``layer`` (dense or ragged, not plain) into buffers with capacity.

    budget: (B, H_kv) decode budgets for ``decode=fixed``, None for ``decode=none``; room:
    ``decode=none`` steps preallocated before the storage grows (the cache's ``max_cache_len``
    minus the prompt when known, else ``GROWTH``).

    Everything a step reads that changes per step is a device tensor (``newest``, the position
    of the token being appended; ``used_dev``/``next``, where ``decode=none`` appends;
    ``free``, the slot the next token takes); the only host int, ``room``, is compared against
    0 and so is seen by the compiler as a guard that holds until the storage must grow, not as
    a constant baked into every step."""
    room = max(int(room), 1)
    counts = layer.counts
    if budget is not None and int(budget.max()) > int(counts.max()) + MAX_PREALLOCATED:
        raise ValueError(
            f"static decode storage would preallocate {int(budget.max())} entries per head (the decode "
            f"budget) for {int(counts.max())} kept: pass KVCakeCache(..., max_cache_len=prompt + new tokens) "
            "to bound it, use a budget closer to the prompt, or KVCakeCache(..., static=False), which grows "
            "one entry per step"
        )
    padded = {name: layer.padded(getattr(layer, name), fill) for name, fill in _FILLS.items()}
    if padded["scores"] is not None:  # kept sums, finite (0 where the prompt protected or
        padded["scores"] = torch.where(padded["scores"].isfinite(), padded["scores"], 0.0)  # padded)
    b, h = counts.shape
    dev = layer.keys.device
    # full: every head holds exactly its budget and the budget fills every slot but the free
    # one (dense: the width is the largest budget), so every head is over its budget at every
    # step and, once the new token is written, no slot is empty: no mask to keep, no budget test.
    layer.full = budget is not None and bool((counts == budget).all())
    if layer.layout == "dense" and budget is not None:
        layer.full = layer.full and bool((budget == max(layer.keys.shape[2], int(budget.max()))).all())
    layer.newest = torch.full((b, h, 1), layer.length - 1, device=dev)  # (B, H_kv, 1) int64
    layer.pos_zero = torch.zeros((), dtype=torch.long, device=dev)  # clamp's lower bound
    if layer.layout == "dense":
        _dense_to_static(layer, padded, budget, room)
    else:
        _ragged_to_static(layer, padded, budget, room)
    layer.static = "none" if budget is None else "fixed"
    if budget is None:
        return
    layer.static_budget_host = budget
    layer.under = torch.tensor(budget - counts, device=dev).reshape(b, h, 1)  # entries still to gain
    first_empty = _view(layer, layer.positions).argmin(-1, keepdim=True)  # (B, H_kv, 1)
    layer.free = _slot(layer, first_empty)


# what an empty slot holds; H2O's kept sums start at 0
_FILLS = {"keys": 0.0, "values": 0.0, "positions": -1, "scores": 0.0}


def _dense_to_static(layer, padded: dict, budget: np.ndarray | None, room: int) -> None:
    n = layer.keys.shape[2]
    width = n + room if budget is None else max(n, int(budget.max())) + 1  # host ints
    for name, t in padded.items():
        if t is not None:
            out = _full(t, width, _FILLS[name])
            out[:, :, :n] = t
            setattr(layer, name, out)
    layer.bias = None if layer.full else _bias(layer.positions, layer.keys.dtype)  # (B, H_kv, 1, C)
    if budget is None:
        layer.used_dev = torch.tensor([n], device=layer.keys.device)  # (1,) next free column
        layer.room = width - n


def _ragged_to_static(layer, padded: dict, budget: np.ndarray | None, room: int) -> None:
    counts = layer.counts
    cap = counts + room if budget is None else np.maximum(counts, budget) + 1  # (B, H_kv) host
    dev = layer.keys.device
    lengths = torch.as_tensor(cap.reshape(-1), device=dev)
    meta = RaggedMeta.from_lengths(lengths)
    src_valid = padded["positions"] >= 0  # (B, H_kv, N): entries are first in each segment
    rank = src_valid.long().cumsum(-1) - 1
    b, h, _ = src_valid.shape
    dest = meta.offsets[:-1].reshape(b, h, 1) + rank  # (B, H_kv, N)
    total = int(cap.sum())  # host; the dummy slot is ``total``
    for name, t in padded.items():
        if t is not None:
            out = torch.full((total + 1, *t.shape[3:]), _FILLS[name], dtype=t.dtype, device=dev)
            out[dest[src_valid]] = t[src_valid]
            setattr(layer, name, out)
    m = int(cap.max())
    local = torch.arange(m, device=dev)
    inside = local < lengths[:, None]  # (B*H_kv, M)
    pad_index = torch.where(inside, meta.offsets[:-1, None] + local, total)  # (B*H_kv, M)
    # the same indices shaped for each gather (views of one constant tensor, never written)
    layer.pad_index, layer.pad_rows = pad_index, pad_index[:, None]  # (B*H_kv, M), (B*H_kv, 1, M)
    layer.pad_heads, layer.pad_rows4 = pad_index.reshape(b, h, m), pad_index.reshape(b, h, 1, m)
    layer.meta = meta
    layer.capacity = cap
    if layer.full:  # no slot inside a segment is empty when the layer attends: only the padding
        layer.bias = None
        layer.pad_bias = _bias(torch.where(inside, 0, -1), layer.keys.dtype)  # (B*H_kv, 1, M)
    else:
        layer.bias = _bias(layer.positions, layer.keys.dtype).reshape(-1)  # (T_cap + 1,)
    layer.zero = torch.zeros((), dtype=layer.keys.dtype, device=dev)  # what index_put_ writes
    layer.empty = torch.full((), -1, device=dev)
    # The attention without probabilities goes to a variable-length kernel where this device
    # has one that skips each segment's unused tail (``seqused``), decided once per layout.
    # The stored entries of a segment are a prefix of its slots whenever the layer attends (a
    # victim's slot is the next token's), so ``seq_used`` (S,) counts them: +1 per append,
    # at most ``cap - 1`` after an eviction (the free slot). Kept only on that route.
    layer.varlen_route = choose_route(dev, layer.keys.dtype, seqused=True)
    if layer.varlen_route != "reference":
        layer.cu_k = meta.offsets.to(torch.int32)  # (S + 1,)
        layer.seq_used = torch.as_tensor(counts.reshape(-1), dtype=torch.int32, device=dev)  # (S,)
        layer.seq_room = (lengths - 1).to(torch.int32)  # (S,) what a segment holds after an eviction
    if budget is None:
        layer.next = meta.offsets[:-1].reshape(b, h, 1) + torch.as_tensor(counts, device=dev)[..., None]
        layer.room = int((cap - counts).min())


def _bias(positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Positions (..., N) -> additive mask (..., 1, N): 0 on a stored entry, -inf on an empty slot."""
    zero = torch.zeros((), dtype=dtype, device=positions.device)
    return torch.where(positions >= 0, zero, float("-inf")).unsqueeze(-2)


def _full(t: torch.Tensor, width: int, fill, dim: int = 2) -> torch.Tensor:
    """A tensor like ``t`` with ``width`` along ``dim``, filled with ``fill``."""
    shape = list(t.shape)
    shape[dim] = width
    return torch.full(shape, fill, dtype=t.dtype, device=t.device)


def _view(layer, t: torch.Tensor) -> torch.Tensor:
    """A per-entry tensor as (B, H_kv, N): dense as stored, ragged through ``pad_index``."""
    return t if layer.layout == "dense" else t[layer.pad_heads]


def _slot(layer, local: torch.Tensor) -> torch.Tensor:
    """(B, H_kv, 1) columns of ``_view`` -> the slots ``write`` takes (ragged: flat indices)."""
    return local if layer.layout == "dense" else layer.pad_heads.gather(-1, local)


def append(layer, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write the new token's entry in place: one write per stored tensor, and the mask's slot
    opened. k, v: (B, H_kv, 1, d)."""
    if layer.static == "none":
        _grow_if_full(layer)  # (first: a ragged layer is laid out anew, ``newest`` with it)
    layer.newest.add_(1)  # (B, H_kv, 1) the new token's position
    if layer.static == "none":
        layer.room -= 1
        layer.counts = layer.counts + 1
        if layer.layout == "dense":
            col = layer.used_dev  # (1,): the same column for every head
            layer.keys.index_copy_(2, col, k)
            layer.values.index_copy_(2, col, v)
            layer.positions.index_copy_(2, col, layer.newest)
            layer.bias.index_fill_(3, col, 0.0)
            layer.used_dev.add_(1)
            return
        at = layer.next
        layer.next = at + 1
    else:
        at = layer.free
    if layer.layout == "dense":  # fixed: one column per head
        at_d = at.unsqueeze(-1)  # (B, H_kv, 1, 1)
        if layer.bias is not None:
            layer.bias.scatter_(3, at_d, 0.0)
        at_d = at_d.expand_as(k)  # (B, H_kv, 1, d)
        layer.keys.scatter_(2, at_d, k)
        layer.values.scatter_(2, at_d, v)
        layer.positions.scatter_(2, at, layer.newest)
        return
    if layer.varlen_route != "reference":
        layer.seq_used.add_(1)
    if layer.bias is not None:  # ragged: flat slots, (B, H_kv, 1) indices
        layer.bias.index_put_((at,), layer.zero)
    layer.keys.index_put_((at,), k)
    layer.values.index_put_((at,), v)
    layer.positions.index_put_((at,), layer.newest)


def _grow_if_full(layer) -> None:
    """decode=none: add ``GROWTH`` slots when the host-known room is gone (amortised)."""
    if layer.room > 0:
        return
    if layer.layout == "dense":
        layer.room = GROWTH
        grown = [(name, fill, 2) for name, fill in _FILLS.items()] + [("bias", float("-inf"), 3)]
        for name, fill, dim in grown:
            t = getattr(layer, name)
            if t is not None:
                out = _full(t, t.shape[dim] + GROWTH, fill, dim)
                out.narrow(dim, 0, t.shape[dim]).copy_(t)
                setattr(layer, name, out)
        return
    layer.static = None
    to_static(layer, None)


def attend(layer, query: torch.Tensor, scaling: float, return_probs: bool):
    """Attention of the new token over a static layer (every stored entry is in its past and
    its own entry is stored, so ``bias`` is the whole mask). query: (B, H, 1, d).

    Returns the output (B, 1, H, d) and, if asked, the probabilities (B, H_kv, G, N) in float32
    (the GQA group on dim 2, as ``Scorer.decode_step`` reads them; ragged: over ``_view``'s
    columns, 0 on the padding): the fused kernel when no probabilities are needed, else two
    batched matmuls around a softmax. The references are ``layer.dense_attention`` and
    ``ragged.ragged_attention_reference``."""
    b, h, _, d = query.shape
    hkv = layer.counts.shape[1]
    g = h // hkv
    if not return_probs and layer.layout == "ragged" and layer.varlen_route != "reference":
        # each segment's stored prefix, read in place: no gather, no padding, no mask
        out = varlen_attention(
            query, layer.keys, layer.values, layer.cu_k, layer.pad_index.shape[1], scaling,
            seqused=layer.seq_used, route=layer.varlen_route,
        )  # fmt: skip
        return out, None  # (B, 1, H, d)
    if not return_probs:  # 4-D: (B, H_kv, G, d) queries, the GQA group folded into the rows
        if layer.layout == "dense":  # (B, H_kv, N, d) as stored, mask (B, H_kv, 1, N)
            keys, values, bias = layer.keys, layer.values, layer.bias
        else:  # (B, H_kv, M, d) gathered, mask (B, H_kv, 1, M)
            keys, values = layer.keys[layer.pad_heads], layer.values[layer.pad_heads]
            bias = (
                layer.pad_bias.reshape(b, hkv, 1, -1) if layer.bias is None else layer.bias[layer.pad_rows4]
            )
        qs = query.reshape(b, hkv, g, d)
        out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=bias, scale=scaling)
        return out.reshape(b, 1, h, d), None  # (B, H_kv, G, d) -> (B, 1, H, d)
    acc = torch.promote_types(query.dtype, torch.float32)  # float32, or float64 for references
    if layer.layout == "dense":  # 3-D for bmm: (B*H_kv, N, d), mask (B*H_kv, 1, N)
        n = layer.keys.shape[2]
        keys, values = layer.keys.reshape(b * hkv, n, d), layer.values.reshape(b * hkv, n, d)
        bias = None if layer.bias is None else layer.bias.reshape(b * hkv, 1, n)
    else:  # gathered (B*H_kv, M, d), mask (B*H_kv, 1, M)
        keys, values = layer.keys[layer.pad_index], layer.values[layer.pad_index]
        bias = layer.pad_bias if layer.bias is None else layer.bias[layer.pad_rows]
        n = keys.shape[1]
    qs = query.reshape(b * hkv, g, d).to(acc)
    keys_t = keys.to(acc).transpose(1, 2)  # (B*H_kv, d, N)
    if bias is None:
        logits = torch.bmm(qs, keys_t).mul_(scaling)
    else:  # scaling * (q k^T) + mask, in one op
        logits = torch.baddbmm(bias.to(acc), qs, keys_t, alpha=scaling)
    probs = torch.softmax(logits, dim=-1)  # (B*H_kv, G, N)
    out = torch.bmm(probs, values.to(acc)).to(query.dtype)
    return out.reshape(b, 1, h, d), probs.reshape(b, hkv, g, n)


def evict(layer, scorer, probs: torch.Tensor | None, window: int, across=None) -> None:
    """decode=fixed: score the entries, evict one victim per head over its budget.

    probs: (B, H_kv, G, N) from ``attend`` (None for scorers that read no attention). The
    newest ``window`` positions are protected; the victim is the lowest score, the latest
    position among ties (the reference's rule: ties keep the earlier position). The victim's
    slot becomes the head's ``free`` slot, where the next token is written: nothing is moved.
    A head still under its budget evicts nothing and its next token takes its first empty slot.
    ``across``: a function applied to the scores before they are used (a tensor-parallel
    cache's mean over ranks, TOVA)."""
    pos = _view(layer, layer.positions)  # (B, H_kv, N)
    previous = _view(layer, layer.scores) if scorer.stateful else None
    if scorer.order_sensitive:  # pooling neighbours: entries sorted by position, newest first
        pos_s, order = pos.sort(-1, descending=True)  # (B, H_kv, N) twice
        if probs is not None:
            probs = probs.gather(-1, order.unsqueeze(2).expand_as(probs))
        if previous is not None:
            previous = previous.gather(-1, order)
        scores = scorer.decode_step(probs, pos_s, previous)
    else:
        pos_s, order = pos, None
        scores = scorer.decode_step(probs, pos, previous)
    if across is not None:
        scores = across(scores.expand_as(pos_s))
    if scorer.stateful:  # keep the new sums, in slot order
        kept = scores if order is None else torch.empty_like(scores).scatter_(-1, order, scores)
        if layer.layout == "dense":
            layer.scores = kept
        else:  # (the padding's duplicates all land on the dummy slot)
            layer.scores.index_put_((layer.pad_heads,), kept)
    floor = layer.newest - window  # (B, H_kv, 1): later positions are the window
    if layer.layout == "dense" and layer.full:
        protected = pos_s > floor
    else:  # the window, and empty slots (-1): outside [0, floor]
        protected = pos_s != pos_s.clamp(min=layer.pos_zero, max=floor)
    scores = scores.masked_fill(protected, float("inf"))
    if order is not None:  # newest first: the first minimum is the latest of the ties
        victim = order.gather(-1, scores.argmin(-1, keepdim=True))
    else:
        low = scores.amin(-1, keepdim=True)
        victim = pos.masked_fill(scores != low, -1).argmax(-1, keepdim=True)  # latest of the ties
    if not layer.full:  # a head under its budget takes its first empty slot instead
        victim = torch.where(layer.under > 0, pos.argmin(-1, keepdim=True), victim)
        layer.under.sub_(1)
    free = _slot(layer, victim)  # (B, H_kv, 1)
    if layer.layout == "dense":
        layer.positions.scatter_(2, free, -1)  # an under-budget head's empty slot stays empty
        if scorer.stateful:
            layer.scores.scatter_(2, free, 0.0)  # the next token's sum starts at 0
    else:
        layer.positions.index_put_((free,), layer.empty)
        if scorer.stateful:
            layer.scores.index_put_((free,), layer.zero.to(layer.scores.dtype))
        if layer.varlen_route != "reference":  # an evicting head's victim slot is free again
            torch.minimum(layer.seq_used, layer.seq_room, out=layer.seq_used)
    layer.free = free
    layer.counts = np.minimum(layer.counts + 1, layer.static_budget_host)


def to_dynamic(layer) -> None:
    """Back to the reference layout (position order, empties on the left / compact segments)."""
    pos = layer.padded(layer.positions, -1)  # (B, H_kv, N)
    order = pos.argsort(dim=-1, stable=True)  # empties (-1) first, then position order
    sorted_ = {}
    for name, fill in _FILLS.items():
        t = layer.padded(getattr(layer, name), fill)
        if t is not None:
            idx = order.reshape(*order.shape, *([1] * (t.dim() - 3))).expand_as(t)
            sorted_[name] = t.gather(2, idx)
    counts = layer.counts
    if layer.layout == "dense":
        new_n = int(counts.max())  # host
        for name, t in sorted_.items():
            setattr(layer, name, t[:, :, t.shape[2] - new_n :].contiguous())
    else:
        keep = sorted_["positions"] >= 0
        for name, t in sorted_.items():
            setattr(layer, name, t[keep])
        layer.meta = RaggedMeta.from_lengths(torch.as_tensor(counts.reshape(-1), device=pos.device))
    layer.static = None
