"""Static, preallocated decode storage: appends and decode-time eviction written in place.

After the prompt, a compressed layer's first decode step moves it into buffers with capacity
(``to_static``); from then on a single-token step allocates nothing whose size depends on how
many tokens were generated, and reads nothing back from the device: host counts advance
deterministically (``min(count + 1, budget)``), device counts alongside them.

Layouts (the same per-entry convention as ``layer.py``: position -1 = empty slot):

* dense ``(B, H_kv, C, d)``. ``decode=none``: entries are appended at column ``used_dev`` (a
  device index), the capacity grows in fixed chunks of ``GROWTH`` columns. ``decode=fixed``:
  capacity ``C = max(kept, budget) + 1`` never grows, so every head has one *free* slot: the
  new entry is written there and attended; then the victim (argmin of the scores, window
  protected) is marked empty and its slot becomes the head's next free slot (nothing moves),
  or, for a head still under its budget, its next empty slot does. The attention's visibility
  mask (``bias``) is kept alongside, one write a step, or absent where no slot can be empty.
* ragged ``(T_cap, d)``: every segment ``s`` owns ``cap_s`` slots, its ``len_s`` entries first;
  ``decode=none`` appends at ``offset_s + len_s`` (segments share one growth chunk, since all
  grow by one a step); ``decode=fixed`` gives ``cap_s = max(len_s, budget_s) + 1`` with the spare
  last, exactly as the dense layout.

The slow reference is the dynamic path of ``layer.py`` (sort + masked copy); ``to_dynamic``
turns a static layer back into it (multi-token appends, batch reordering).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .ragged import RaggedMeta

GROWTH = 64  # columns (dense) or slots per segment (ragged) added when decode=none runs out
# decode=fixed preallocates up to its budget: refuse more than this beyond what a head holds
MAX_PREALLOCATED = 1 << 20
_ENTRY = ("keys", "values", "positions", "scores")


def to_static(layer, budget: np.ndarray | None, room: int = GROWTH) -> None:
    """Move ``layer`` (dense or ragged, not plain) into buffers with capacity.

    budget: (B, H_kv) decode budgets for ``decode=fixed``, None for ``decode=none``; room:
    ``decode=none`` steps preallocated before the storage grows (the cache's ``max_cache_len``
    minus the prompt when known, else ``GROWTH``).

    Everything a step reads that changes per step is a device tensor (``newest``, the position
    of the token being appended; ``used_dev``, the next dense column; ``free``, the slot the
    next token takes); the only host int, ``room``, is compared against 0 and so is seen by the
    compiler as a guard that holds until the storage must grow, not as a constant baked into
    every step."""
    room = max(int(room), 1)
    counts = layer.counts
    dev = layer.keys.device
    if budget is not None and int(budget.max()) > int(counts.max()) + MAX_PREALLOCATED:
        raise ValueError(
            f"static decode storage would preallocate {int(budget.max())} entries per head (the decode "
            f"budget) for {int(counts.max())} kept: use a budget closer to the prompt, or "
            "KVCakeCache(..., static=False), which grows one entry per step"
        )
    if budget is None:
        cap = counts + room
    else:
        cap = np.maximum(counts, budget) + 1  # + the free slot
        layer.static_budget = torch.tensor(budget, device=dev)
        layer.static_budget_host = budget
    padded = {name: layer.padded(getattr(layer, name), fill) for name, fill in _fills(layer).items()}
    if layer.layout == "dense":
        _dense_to_static(layer, padded, budget, room)
        return
    lengths = torch.as_tensor(cap.reshape(-1), device=dev)
    meta = RaggedMeta.from_lengths(lengths)
    src_valid = padded["positions"] >= 0  # (B, H_kv, N): entries are first in each segment
    rank = src_valid.long().cumsum(-1) - 1
    b, h, n = src_valid.shape
    dest = meta.offsets[:-1].reshape(b, h, 1) + rank  # (B, H_kv, N)
    total = int(cap.sum())  # host
    for name, t in padded.items():
        if t is None:
            continue
        out = torch.full((total, *t.shape[3:]), _fills(layer)[name], dtype=t.dtype, device=dev)
        out[dest[src_valid]] = t[src_valid]
        setattr(layer, name, out)
    layer.meta = meta
    layer.seg_start = meta.offsets[:-1].reshape(b, h)  # (B, H_kv) first slot of each segment
    layer.spare = (meta.offsets[1:] - 1).reshape(b, h)  # (B, H_kv) flat spare slot (fixed)
    layer.capacity = cap
    layer.room = int((cap - counts).min())
    layer.lengths_dev = torch.tensor(
        counts, device=dev
    )  # a copy: never shares the host array  # (B, H_kv) kept entries, on device
    layer.length_dev = torch.tensor(layer.length, device=dev)  # () logical length, on device
    layer.static = "fixed" if budget is not None else "none"


def _dense_to_static(layer, padded: dict, budget: np.ndarray | None, room: int) -> None:
    """Dense storage ``(B, H_kv, C, d)``; ``bias`` (B, H_kv, 1, C) is the additive visibility
    mask the attention reads (0 on a stored entry, -inf on an empty slot), kept in step with
    the writes, so no layer rebuilds it; a ``full`` fixed layer has none (see ``evict``)."""
    n = layer.keys.shape[2]
    b, h = layer.counts.shape
    dev = layer.keys.device
    width = n + room if budget is None else max(n, int(budget.max())) + 1  # host ints
    for name, t in padded.items():
        if t is None:
            continue
        fill = _fills(layer)[name]
        if name == "scores":  # kept sums, finite (0 where the prompt protected or padded), as
            fill, t = 0.0, torch.where(t.isfinite(), t, 0.0)  # the reference's decode reads them
        out = _full(t, width, fill)
        out[:, :, :n] = t
        setattr(layer, name, out)
    layer.newest = torch.full((b, h, 1), layer.length - 1, device=dev)  # (B, H_kv, 1) int64
    layer.bias = _bias(layer.positions, layer.keys.dtype)
    if budget is None:
        layer.used_dev = torch.tensor([n], device=dev)  # (1,) next free column
        layer.room = width - n
        layer.static = "none"
        return
    # full: every head holds exactly its budget and the budget fills every slot but one, so
    # every head is over its budget at every step and, once the new token is written, no slot
    # is empty: no mask, no budget test (decided here, once, on the host).
    layer.full = bool((layer.counts == budget).all() and (budget == width - 1).all())
    if layer.full:
        layer.bias = None
    layer.under = torch.tensor(budget - layer.counts, device=dev).reshape(b, h, 1)  # entries to gain
    layer.free = layer.positions.argmin(-1, keepdim=True)  # (B, H_kv, 1) first empty slot
    layer.static_budget_host = budget
    layer.static = "fixed"


def _bias(positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, H_kv, N) positions -> (B, H_kv, 1, N) additive mask: 0 stored, -inf empty."""
    zero = torch.zeros((), dtype=dtype, device=positions.device)
    return torch.where(positions >= 0, zero, float("-inf")).unsqueeze(2)


def _fills(layer) -> dict[str, float]:
    return {"keys": 0.0, "values": 0.0, "positions": -1, "scores": float("-inf")}


def _full(t: torch.Tensor, width: int, fill, dim: int = 2) -> torch.Tensor:
    """A tensor like ``t`` with ``width`` along ``dim``, filled with ``fill``."""
    shape = list(t.shape)
    shape[dim] = width
    return torch.full(shape, fill, dtype=t.dtype, device=t.device)


def append(layer, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write the new token's entry per (sequence, KV head) in place. k, v: (B, H_kv, 1, d).

    Dense: one in-place write per stored tensor, at column ``used_dev`` (``decode=none``) or at
    each head's ``free`` slot (``decode=fixed``), and the mask's column opened."""
    if layer.layout == "ragged":
        pos = layer.length_dev.reshape(1, 1, 1).expand(k.shape[0], k.shape[1], 1)
        _append_ragged(layer, k, v, pos)
        layer.length_dev += 1  # after the write: ``pos`` is a view of it
        return
    layer.newest.add_(1)  # (B, H_kv, 1) the new token's position
    if layer.static == "none":
        _grow_if_full(layer)
        layer.room -= 1
        col = layer.used_dev  # (1,)
        layer.keys.index_copy_(2, col, k)
        layer.values.index_copy_(2, col, v)
        layer.positions.index_copy_(2, col, layer.newest)
        layer.bias.index_fill_(3, col, 0.0)
        layer.used_dev.add_(1)
        layer.counts = layer.counts + 1
        return
    free = layer.free.unsqueeze(-1)  # (B, H_kv, 1, 1)
    at = free.expand_as(k)  # (B, H_kv, 1, d)
    layer.keys.scatter_(2, at, k)
    layer.values.scatter_(2, at, v)
    layer.positions.scatter_(2, layer.free, layer.newest)
    if layer.bias is not None:
        layer.bias.scatter_(3, free, 0.0)


def _append_ragged(layer, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
    if layer.static == "none":
        _grow_if_full(layer)
        layer.room -= 1
    new = {"keys": k[:, :, 0], "values": v[:, :, 0], "positions": pos[:, :, 0]}
    if layer.scores is not None:
        new["scores"] = torch.zeros_like(pos[:, :, 0], dtype=layer.scores.dtype)
    slot = layer.spare if layer.static == "fixed" else layer.seg_start + layer.lengths_dev  # (B, H_kv)
    for name, t in new.items():
        getattr(layer, name)[slot.reshape(-1)] = t.reshape(-1, *t.shape[2:])
    if layer.static == "none":
        layer.lengths_dev += 1
        layer.counts = layer.counts + 1


def _grow_if_full(layer) -> None:
    """decode=none: add ``GROWTH`` slots when the host-known room is gone (amortised)."""
    if layer.room > 0:
        return
    if layer.layout == "dense":
        layer.room = GROWTH
        grown = [(name, fill, 2) for name, fill in _fills(layer).items()] + [("bias", float("-inf"), 3)]
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
    """Attention of the new token over a dense static layer (every stored entry is in its past
    and its own entry is stored, so ``bias`` is the whole mask). query: (B, H, 1, d).

    Returns the output (B, 1, H, d) and, if asked, the probabilities (B, H_kv, G, N) in float32
    (the GQA group on dim 2, as ``Scorer.decode_step`` reads them): the fused kernel when no
    probabilities are needed, else two batched matmuls around a softmax. The reference is
    ``layer.dense_attention`` (tests/test_static.py decodes against it)."""
    b, h, q, d = query.shape
    hkv, n = layer.keys.shape[1], layer.keys.shape[2]
    g = h // hkv
    if not return_probs:
        qs = query.reshape(b, hkv, g, d)  # GQA group folded into the query rows
        out = F.scaled_dot_product_attention(
            qs, layer.keys, layer.values, attn_mask=layer.bias, scale=scaling
        )
        return out.reshape(b, 1, h, d), None  # (B, H_kv, G, d) -> (B, 1, H, d)
    acc = _accumulate(query.dtype)
    qs = query.reshape(b * hkv, g, d).to(acc)  # (B*H_kv, G, d)
    keys = layer.keys.reshape(b * hkv, n, d).to(acc).transpose(1, 2)  # (B*H_kv, d, N)
    if layer.bias is None:
        logits = torch.bmm(qs, keys).mul_(scaling)
    else:  # scaling * (q k^T) + mask, in one op
        logits = torch.baddbmm(layer.bias.reshape(b * hkv, 1, n).to(acc), qs, keys, alpha=scaling)
    probs = torch.softmax(logits, dim=-1)  # (B*H_kv, G, N)
    out = torch.bmm(probs, layer.values.reshape(b * hkv, n, d).to(acc)).to(query.dtype)
    return out.reshape(b, 1, h, d), probs.reshape(b, hkv, g, n)


def _accumulate(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, else the dtype itself (float64 for references): no ATen op."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def evict(layer, scorer, probs: torch.Tensor | None, window: int, across=None) -> None:
    """decode=fixed, dense: score the entries, evict one victim per head over its budget.

    probs: (B, H_kv, G, N) from ``attend`` (None for scorers that read no attention). The
    newest ``window`` positions are protected; the victim is the lowest score, the latest
    position among ties (the reference's rule: ties keep the earlier position). The victim's
    slot becomes the head's ``free`` slot, where the next token is written: nothing is moved.
    A head still under its budget evicts nothing and its next token takes its first empty slot.
    ``across``: a function applied to the scores before they are used (a tensor-parallel
    cache's mean over ranks, TOVA)."""
    if layer.layout == "ragged":
        scores = decode_scores(layer, scorer, probs, across)
        place_newest(layer, scores, layer.length_dev - 1 - window)
        return
    pos = layer.positions  # (B, H_kv, N)
    previous = layer.scores if scorer.stateful else None
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
        layer.scores = scores if order is None else torch.empty_like(scores).scatter_(-1, order, scores)
    protected = pos_s > layer.newest - window  # the window (the new token included)
    if not layer.full:
        protected = protected | (pos_s < 0)  # and empty slots
    scores = scores.masked_fill(protected, float("inf"))
    if order is not None:  # newest first: the first minimum is the latest of the ties
        victim = order.gather(-1, scores.argmin(-1, keepdim=True))
    else:
        low = scores.amin(-1, keepdim=True)
        victim = pos.masked_fill(scores != low, -1).argmax(-1, keepdim=True)  # latest of the ties
    if layer.full:
        free = victim  # (B, H_kv, 1)
    else:
        free = torch.where(layer.under > 0, pos.argmin(-1, keepdim=True), victim)  # first empty slot
        layer.under.sub_(1)
    layer.positions.scatter_(2, free, -1)  # an under-budget head's empty slot stays empty
    if scorer.stateful:
        layer.scores.scatter_(2, free, 0.0)  # the next token's sum starts at 0
    layer.free = free
    layer.counts = np.minimum(layer.counts + 1, layer.static_budget_host)


def decode_scores(layer, scorer, probs: torch.Tensor, across=None) -> torch.Tensor:
    """``scorer.decode`` over a static ragged layer (B, H_kv, N), whose slots are not in position
    order: scorers that pool over neighbours (``order_sensitive``) see the entries sorted by
    position (one argsort of the positions, empties first like the reference's left padding).
    Stateful scorers (H2O) keep the new sums in ``layer.scores``. ``across``: a function applied
    to the scores before they are kept (a tensor-parallel cache's mean over ranks, TOVA)."""
    positions = layer.padded(layer.positions, -1)  # (B, H_kv, N)
    previous = layer.padded(layer.scores, float("-inf"))
    if not scorer.order_sensitive:
        scores = scorer.decode(probs, positions, previous)
    else:
        order = positions.argsort(dim=-1, stable=True)  # (B, H_kv, N)
        groups, q = probs.shape[1] // positions.shape[1], probs.shape[2]
        head_order = order.repeat_interleave(groups, dim=1)[:, :, None].expand(-1, -1, q, -1)  # (B, H, q, N)
        prev = None if previous is None else previous.gather(-1, order)
        sorted_scores = scorer.decode(probs.gather(-1, head_order), positions.gather(-1, order), prev)
        scores = torch.empty_like(sorted_scores).scatter_(-1, order, sorted_scores)
    if across is not None:
        scores = across(scores)
    if layer.scores is not None:
        layer.scores = layer.unpad(scores.masked_fill(positions < 0, 0.0))
    return scores


def place_newest(layer, scores: torch.Tensor, window_floor: torch.Tensor) -> None:
    """decode=fixed, ragged: move the spare entry into its slot and free the spare, on the device.

    scores: (B, H_kv, N) decoding scores over the padded view; window_floor: () positions above
    it are protected. No branch on the data: every head picks a victim (argmin of its scores) and
    a first empty slot, and keeps the victim only if it is over its budget."""
    pos = layer.padded(layer.positions, -1)  # (B, H_kv, N)
    n = pos.shape[-1]
    cols = torch.arange(n, device=pos.device)
    spare_local = layer.spare - layer.seg_start  # (B, H_kv)
    real = pos >= 0
    empty = ~real & (cols < spare_local[..., None])
    target = empty.int().argmax(-1)  # first empty slot (documented tie rule: first maximum)
    budget = layer.static_budget
    is_over = layer.lengths_dev + 1 > budget  # (B, H_kv)
    s = scores.masked_fill(pos > window_floor, float("inf")).masked_fill(~real, float("inf"))
    low = s.amin(-1, keepdim=True)
    victim = torch.where(s == low, pos, torch.full_like(pos, -1)).argmax(-1)  # latest of the ties
    target = torch.where(is_over, victim, target)
    layer.lengths_dev = torch.minimum(layer.lengths_dev + 1, budget)
    layer.counts = np.minimum(layer.counts + 1, layer.static_budget_host)
    flat_target = (layer.seg_start + target).reshape(-1)
    flat_spare = layer.spare.reshape(-1)
    for name in _ENTRY:
        t = getattr(layer, name)
        if t is not None:
            t[flat_target] = t[flat_spare]
    layer.positions[flat_spare] = -1


def to_dynamic(layer) -> None:
    """Back to the reference layout (position order, empties on the left / compact segments)."""
    pos = layer.padded(layer.positions, -1)  # (B, H_kv, N)
    order = pos.argsort(dim=-1, stable=True)  # empties (-1) first, then position order
    sorted_ = {}
    for name, fill in _fills(layer).items():
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
