"""Static, preallocated decode storage: appends and decode-time eviction written in place.

After the prompt, a compressed layer's first decode step moves it into buffers with capacity
(``to_static``); from then on a single-token step allocates nothing whose size depends on how
many tokens were generated, and reads nothing back from the device: host counts advance
deterministically (``min(count + 1, budget)``), device counts alongside them.

Layouts (the same per-entry convention as ``layer.py``: position -1 = empty slot):

* dense ``(B, H_kv, C, d)``. ``decode=none``: entries are appended at column ``used`` (a host
  int), the capacity grows in fixed chunks of ``GROWTH`` columns. ``decode=fixed``: capacity
  ``C = max(kept, budget) + 1`` never grows; the last column is the *spare*: the new entry is
  written there, attended, then moved into the slot of the victim (argmin of the scores, window
  protected) or, for a head still under its budget, into its first empty slot.
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

    Everything a step reads that changes per step is a device tensor (``length_dev``, the
    logical length; ``used_dev``, the next dense column; ``lengths_dev``); the only host int,
    ``room``, is compared against 0 and so is seen by the compiler as a guard that holds until the
    storage must grow, not as a constant baked into every step."""
    room = max(int(room), 1)
    counts = layer.counts
    dev = layer.keys.device
    if budget is not None and int(budget.max()) > int(counts.max()) + MAX_PREALLOCATED:
        raise ValueError(
            f"static decode storage would preallocate {int(budget.max())} entries per head (the decode "
            f"budget) for {int(counts.max())} kept: pass KVCakeCache(..., max_cache_len=prompt + new tokens) "
            "to bound it, use a budget closer to the prompt, or KVCakeCache(..., static=False), which grows "
            "one entry per step"
        )
    if budget is None:
        cap = counts + room
    else:
        cap = np.maximum(counts, budget) + 1  # + the spare slot
        layer.static_budget = torch.tensor(budget, device=dev)
        layer.static_budget_host = budget
    padded = {name: layer.padded(getattr(layer, name), fill) for name, fill in _fills(layer).items()}
    if layer.layout == "dense":
        n = layer.keys.shape[2]
        width = n + room if budget is None else max(n, int(budget.max())) + 1  # host ints
        for name, t in padded.items():
            if t is None:
                continue
            out = _full(t, width, _fills(layer)[name])
            out[:, :, :n] = t
            setattr(layer, name, out)
        layer.used_dev = torch.tensor([n], device=dev)  # (1,) next free column (decode=none)
        layer.room = width - n
        layer.spare = width - 1
    else:
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


def _fills(layer) -> dict[str, float]:
    return {"keys": 0.0, "values": 0.0, "positions": -1, "scores": float("-inf")}


def _full(t: torch.Tensor, width: int, fill) -> torch.Tensor:
    return torch.full((*t.shape[:2], width, *t.shape[3:]), fill, dtype=t.dtype, device=t.device)


def append(layer, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
    """Write one new entry per (sequence, KV head) in place. k, v: (B, H_kv, 1, d); pos (B, H_kv, 1)."""
    if layer.static == "none":
        _grow_if_full(layer)
        layer.room -= 1
    new = {"keys": k[:, :, 0], "values": v[:, :, 0], "positions": pos[:, :, 0]}
    if layer.scores is not None:
        new["scores"] = torch.zeros_like(pos[:, :, 0], dtype=layer.scores.dtype)
    if layer.layout == "dense":
        col = layer.spare if layer.static == "fixed" else layer.used_dev  # host int / (1,) device
        for name, t in new.items():
            if layer.static == "fixed":
                getattr(layer, name)[:, :, col] = t
            else:
                getattr(layer, name).index_copy_(2, col, t.unsqueeze(2))
        if layer.static == "none":
            layer.used_dev += 1
            layer.lengths_dev += 1
            layer.counts = layer.counts + 1
        return
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
        for name, fill in _fills(layer).items():
            t = getattr(layer, name)
            if t is not None:
                out = _full(t, t.shape[2] + GROWTH, fill)
                out[:, :, : t.shape[2]] = t
                setattr(layer, name, out)
        return
    layer.static = None
    to_static(layer, None)


def decode_scores(layer, scorer, probs: torch.Tensor, across=None) -> torch.Tensor:
    """``scorer.decode`` over a static layer (B, H_kv, N), whose slots are not in position
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
    """decode=fixed: move the spare entry into its slot and free the spare, on the device.

    scores: (B, H_kv, N) decoding scores over the padded view; window_floor: () positions above
    it are protected. No branch on the data: every head picks a victim (argmin of its scores) and
    a first empty slot, and keeps the victim only if it is over its budget."""
    pos = layer.padded(layer.positions, -1)  # (B, H_kv, N)
    n = pos.shape[-1]
    cols = torch.arange(n, device=pos.device)
    if layer.layout == "dense":
        spare_local = torch.full_like(pos[..., 0], layer.spare)
    else:
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
    if layer.layout == "dense":
        b, h = target.shape
        idx = target.reshape(b, h, 1)
        for name in _ENTRY:
            t = getattr(layer, name)
            if t is None:
                continue
            src = t[:, :, layer.spare : layer.spare + 1].clone()
            t.scatter_(2, idx.reshape(b, h, 1, *([1] * (t.dim() - 3))).expand_as(src), src)
        layer.positions[:, :, layer.spare] = -1
        return
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
