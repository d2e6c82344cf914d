"""The sequences of a compressed cache chosen by row: beam search's reorder, a batch repeated or cut.

transformers' beam search runs the prompt once per beam (each prompt's row repeated), then after
every step hands the cache ``beam_idx``, for each row the row whose sequence it continues
(``Cache.reorder_cache``); ``batch_repeat_interleave`` and ``batch_select_indices`` repeat and
cut rows the same way (a compressed context asked with several beams or samples repeats its
rows). A compressed cache holds more per sequence than its keys and values, and all of it
follows the rows (:func:`select_sequences`, ``rows`` (B',) int64):

* the cache's budgets: ``decode_budget`` (B, L_g, H_kv), which ``decode=fixed`` evicts back to,
  and what prefill decided them from (layer budgets, preferences and their statistics, the
  sequence budgets ``seq``, a recorded history);
* a compressed layer's entries (keys, values, positions, scores, norms), its host counts and its
  static plan's budgets (``KVCakeLayer.select_rows``). The dynamic reference layout gathers a
  dense layer's tensors by row (:func:`select_dense`) and a ragged layer's segments as wholes,
  each row's ``H_kv`` segments in order (:func:`select_ragged`). Static dense storage is permuted
  in place where the batch keeps its size (``step.dense.permute``: the buffers a compiled step
  or a CUDA graph holds keep their addresses); otherwise, and for static ragged storage, whose
  rows may own different capacities, the layer goes back to the reference layout, is selected
  there and is laid out again at once;
* a sliding layer's window, in place in its ring (``SlidingLayer.select_rows``).

Follow-ups of different lengths share a batch left-padded (``CompressedContext.generate``): the
pads land after each sequence's earlier entries, and :func:`settle_padding` moves them before it,
so that every row holds what it holds alone, shifted as a left-padded prompt is.

Beams of one prompt hold the same budgets (the same prompt, compressed alike) and diverge only in
what decoding keeps (``decode=fixed``) and generates.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .fp8 import settle_recent
from .ragged import RaggedMeta, kept_indices, row_segments

# per entry, as the dynamic layout holds them: (B, H_kv, N, ...) dense, (T, ...) ragged
ENTRY_TENSORS = ("keys", "values", "positions", "scores", "norms")


def host_rows(rows, batch: int) -> tuple[torch.Tensor, np.ndarray]:
    """``rows`` checked against a batch of ``batch`` sequences: (the indices as an int64 tensor, on the
    host as numpy). One read of the device where they live there (beam search's indices do)."""
    if not isinstance(rows, torch.Tensor):
        rows = torch.as_tensor(rows)  # host: moved to each tensor's device where it is used
    if rows.dim() != 1 or rows.is_floating_point() or rows.dtype == torch.bool:
        raise ValueError(
            f"rows must be a 1-D tensor of integer row indices (beam search's beam_idx), got "
            f"{tuple(rows.shape)} {rows.dtype}"
        )
    host = rows.detach().cpu().numpy().astype(np.int64)
    if host.size == 0 or host.min() < 0 or host.max() >= batch:
        raise ValueError(
            f"row indices must lie in [0, {batch}) for a cache holding {batch} sequences, and be at least "
            f"one: got {host.tolist()}"
        )
    return rows.long(), host


def repeated_rows(batch: int, repeats: int) -> torch.Tensor:
    """The rows that repeat each of ``batch`` sequences ``repeats`` times in place of it
    (``torch.repeat_interleave``'s order), on the host: (batch * repeats,)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    return torch.arange(batch).repeat_interleave(repeats)  # host: moved where used


def repeat_sequences(cache, repeats: int) -> None:
    """Repeat each sequence of ``cache`` ``repeats`` times: :func:`select_sequences` of
    :func:`repeated_rows`."""
    batch = _held_batch(cache)
    rows = repeated_rows(batch or 0, repeats)  # checked even for an empty cache
    if batch is not None:
        select_sequences(cache, rows)


def _held_batch(cache) -> int | None:
    """The batch the cache's layers hold, or None while they hold nothing."""
    counted = (layer.counts for layer in cache.layers if layer.keys is not None)
    return next((c.shape[0] for c in counted if c is not None), None)


def select_sequences(cache, rows) -> None:
    """Keep the sequences ``rows`` (B',) of ``cache``'s batch, in that order, repeats allowed:
    beam search's ``beam_idx``, :func:`repeated_rows` to repeat each. Every layer and every
    per-sequence budget follows (module docstring). An empty cache has nothing to choose; a cache
    whose prefill has not finished is refused (its stage state is per row)."""
    batch = _held_batch(cache)
    if batch is None:
        return
    if not cache.prefilled:
        raise RuntimeError(
            "this KVCakeCache's prefill did not finish, so its sequences cannot be reordered or "
            "repeated: make a new KVCakeCache"
        )
    rows, host = host_rows(rows, batch)
    _select_budgets(cache, rows, host)
    for layer in cache.layers:
        layer.select_rows(rows, host)
    cache._layer_bytes = None  # the running total is counted again (a repeat adds bytes)
    for lid in range(len(cache.layers)):
        cache._track_bytes(lid)


def _select_budgets(cache, rows: torch.Tensor, host: np.ndarray) -> None:
    """The cache's per-sequence state (``KVCakeCache.__init__``) by row; prefill-only state is gone
    once prefill ends."""
    if cache.decode_budget is not None:
        cache.decode_budget = cache.decode_budget[host]

    def take(t):
        return None if t is None else t.index_select(0, rows.to(t.device))

    cache.budgets = take(cache.budgets)
    for name in ("stage_budgets", "preferences", "entropy", "variance"):
        setattr(cache, name, [take(t) for t in getattr(cache, name)])
    if cache.seq is not None:
        cache.seq = dataclasses.replace(
            cache.seq, **{f.name: take(getattr(cache.seq, f.name)) for f in dataclasses.fields(cache.seq)}
        )
    cache.history = [(stage, lid, take(kept)) for stage, lid, kept in cache.history]
    per_row = getattr(cache.method.scorer, "row_indicators", "")  # CAKE's, one per row where they differ
    if per_row:
        each = per_row.split("/")
        scorer = dataclasses.replace(
            cache.method.scorer, row_indicators="/".join(each[i] for i in host.tolist())
        )
        cache.method = dataclasses.replace(cache.method, scorer=scorer)


def select_dense(layer, rows: torch.Tensor) -> None:
    """A dense layer of the dynamic layout: every per-entry tensor (B, H_kv, N, ...) by row."""
    for name in ENTRY_TENSORS:
        t = getattr(layer, name)
        if t is not None:
            setattr(layer, name, t.index_select(0, rows.to(t.device)))


def select_ragged(layer, rows: torch.Tensor, host: np.ndarray) -> None:
    """A ragged layer of the dynamic layout: the segments of each row in ``rows`` (its ``H_kv``
    segments ``b * H_kv + h``), whole and in order, into a new flattened layout."""
    meta = RaggedMeta.from_counts(layer.counts[host], layer.keys.device)  # (B', H_kv) host counts
    source = row_segments(rows, layer.kv_heads, layer.keys.device)  # (B' * H_kv,)
    start = layer.meta.offsets.index_select(0, source)  # each new segment's first row, where it was
    layer.keep_rows(start.index_select(0, meta.seg) + meta.local, meta)  # (T',) rows of the old layout


def settle_padding(layer, valid: torch.Tensor, before=None) -> None:
    """The ``q`` entries a dynamic layer just appended hold padding (``valid`` (B, q): False at a
    pad; follow-ups of different lengths, left-padded in one batch): each pad becomes an empty
    slot and each sequence's earlier entries move as many positions later as it has pads, so that
    every row holds what it holds alone, shifted by its padding as a left-padded prompt's row is
    (the positions only order and window the entries: RoPE was applied with the model's position
    ids, which skip the padding). Dense rows keep their empty slots on the left (one stable sort of
    each head's entries); ragged segments drop the pads. Float8 storage's rings of recent entries
    are settled alike from ``before``, the rings before the append (``kvcake.fp8.settle_recent``)."""
    b, q = valid.shape
    pos = layer.positions
    valid = valid.to(pos.device)
    pads = (~valid).sum(-1)  # (B,)
    counts = layer.counts - pads.cpu().numpy()[:, None]  # (B, H_kv): every head of a row alike
    if layer.layout == "dense":  # the appended entries are each head's last q
        row = torch.arange(b, device=pos.device).view(b, 1, 1).expand_as(pos)
        new = torch.arange(pos.shape[-1], device=pos.device) - (pos.shape[-1] - q)  # index among the appended
        pad = (new >= 0) & ~valid[row, new.clamp(min=0).expand_as(pos)]
        pos = torch.where((new < 0) & (pos >= 0), pos + pads[row], pos).masked_fill(pad, -1)
        order = (pos >= 0).to(torch.int8).argsort(dim=-1, stable=True)  # empty slots first, then in order
        layer.positions = pos.gather(-1, order)
        for name in (n for n in ENTRY_TENSORS if n != "positions"):
            t = getattr(layer, name)
            if t is not None:
                setattr(
                    layer, name, t.gather(2, order.view(*order.shape, *([1] * (t.dim() - 3))).expand_as(t))
                )
        if layer.scores is not None:  # an empty slot's score, as eviction leaves it
            layer.scores = layer.scores.masked_fill(layer.positions < 0, float("-inf"))
    else:  # the appended entries are each segment's last q
        m = layer.meta
        row = m.seg // layer.kv_heads
        new = m.local - (m.lengths[m.seg] - q)
        keep = (new < 0) | valid[row, new.clamp(min=0)]
        layer.positions = torch.where((new < 0) & (pos >= 0), pos + pads[row], pos)
        layer.keep_rows(kept_indices(keep, int(counts.sum())), RaggedMeta.from_counts(counts, pos.device))
    settle_recent(layer, before, valid, pads)
    layer.counts, layer.plain = counts, False


def real_rows(probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A padded append's attention probabilities (B, H, q, N) as the decoding rules read them: each
    pad's row replaced by the mean of its sequence's real rows, so that a mean over the rows (H2O's,
    CAKE's) is the mean over the real ones and the last row (TOVA's) is unchanged."""
    real = valid.to(probs.device)[:, None, :, None]  # (B, 1, q, 1)
    mean = (probs * real).sum(2, keepdim=True) / real.sum(2, keepdim=True)
    return torch.where(real, probs, mean)
