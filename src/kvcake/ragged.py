"""Attention over a ragged cache: every (sequence, KV head) holds its own number of entries.

Layout: a layer's kept entries are one flattened ``(T, d)`` tensor per keys and values,
segment-major (segment ``s = b * H_kv + h``), positions increasing inside a segment; ``seg``
(T,) names each entry's segment, ``lengths`` (B * H_kv,) and ``offsets`` (B * H_kv + 1,) are
the cumulative layout. The query heads of a GQA group read their KV head's segment.

Two implementations behind ``ragged_attention``: a vectorised PyTorch segment softmax
(segments padded to the longest, no Python loop over heads or tokens, no atomic adds: the same
bits on every run), which is the reference and the CPU path, and a variable-length kernel on
CUDA (``kvcake.varlen``: torch's ``varlen_attn``, else flash-attention's, each segment its own
"sequence" with one KV head and ``G`` query heads).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from .logit_terms import PLAIN, LogitTerms
from .varlen import choose_route, varlen_attention

logger = logging.getLogger(__name__)


@dataclass
class RaggedMeta:
    """Per-step layout metadata, built once per layer and step, read by the attention.

    seg: (T,) int64 segment of each entry; local: (T,) index inside its segment;
    lengths: (S,) int64; offsets: (S + 1,) int64; max_len: longest segment (host int).
    """

    seg: torch.Tensor
    local: torch.Tensor
    lengths: torch.Tensor
    offsets: torch.Tensor
    max_len: int

    @classmethod
    def from_lengths(
        cls, lengths: torch.Tensor, max_len: int | None = None, total: int | None = None
    ) -> RaggedMeta:
        """The segments of ``lengths`` (T,) entries. ``max_len`` (the longest) and ``total`` (their
        sum), where the caller knows them on the host, spare two reads of the device (on a GPU
        each drains the queue); None reads them."""
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long, device=lengths.device)
        offsets[1:] = lengths.cumsum(0)
        seg = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=total
        )
        local = torch.arange(seg.numel(), device=lengths.device) - offsets[seg]
        if max_len is None:
            max_len = int(lengths.max()) if lengths.numel() else 0
        return cls(seg=seg, local=local, lengths=lengths, offsets=offsets, max_len=max_len)

    @classmethod
    def from_counts(cls, counts: np.ndarray, device: torch.device) -> RaggedMeta:
        """:meth:`from_lengths` of host counts (any shape, flattened into segments): sent to
        ``device`` without waiting, their longest and their sum known here, so no read of the
        device."""
        counts = counts.reshape(-1)
        lengths = to_device(counts, device)
        return cls.from_lengths(lengths, int(counts.max()) if counts.size else 0, int(counts.sum()))


def ragged_attention_reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
    meta: RaggedMeta, query_positions: torch.Tensor, scaling: float, return_probs: bool = False,
    terms: LogitTerms = PLAIN,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Segment-softmax attention, the reference and CPU path.

    query: (B, H, q, d); keys, values: (T, d); positions: (T,) logical positions;
    query_positions: (B, q) logical positions of the query rows (an entry is visible to a row
    when its position is not after the row's). Returns the output (B, q, H, d) and, if asked,
    the attention probabilities per entry (T, G, q) in float32 (float64 for float64 inputs).
    terms: the model's soft cap on the logits and sinks in every row's denominator (``kvcake.logit_terms``).
    """
    b, h, q, d = query.shape
    n_seg = meta.lengths.numel()
    hkv = n_seg // b
    g = h // hkv
    qs = query.reshape(b, hkv, g, q, d).reshape(n_seg, g * q, d)  # (S, G*q, d), rows (g, i)
    seg, local, n = meta.seg, meta.local, meta.max_len
    acc = torch.promote_types(query.dtype, torch.float32)  # float32, or float64 for references
    logits = terms.cap(torch.einsum("td,trd->tr", keys.to(acc), qs[seg].to(acc)) * scaling)  # (T, G*q)
    qpos = query_positions.repeat_interleave(hkv, dim=0)  # (S, q)
    visible = (positions[:, None] >= 0) & (positions[:, None] <= qpos[seg])  # (T, q); -1 = empty slot
    visible = visible[:, None, :].expand(-1, g, -1).reshape(-1, g * q)  # (T, G*q)
    # segments padded to the longest (S, n, ...): each entry written once (index_put without
    # accumulation), every sum a plain reduction, so the result does not depend on the order
    # atomic adds land in (index_add_ on CUDA): the same inputs give the same bits on every run
    padded = torch.full((n_seg, n, g * q), float("-inf"), dtype=acc, device=keys.device)
    hidden = logits.masked_fill(~visible, float("-inf")).to(acc)  # (under autocast the einsum gives bf16)
    padded = padded.index_put((seg, local), hidden)
    seg_max = padded.amax(1, keepdim=True)  # (S, 1, G*q)
    sink = terms.grouped(b, hkv, q)  # (B, H_kv, G*q, 1), or None
    if sink is not None:  # the sink's logit in each row's maximum and sum
        sink = sink.to(acc).reshape(n_seg, 1, g * q)
        seg_max = torch.maximum(seg_max, sink)
    seg_max = torch.where(torch.isfinite(seg_max), seg_max, torch.zeros_like(seg_max))
    weights = torch.exp(padded - seg_max)  # 0 on the padding and on hidden entries
    total = weights.sum(1, keepdim=True)
    if sink is not None:
        total = total + torch.exp(sink - seg_max)
    probs = weights / total.clamp(min=1e-30)  # (S, n, G*q)
    dv = values.shape[-1]  # d, or a latent layer's narrower values (kvcake.latent)
    vals = torch.zeros(n_seg, n, dv, dtype=acc, device=keys.device).index_put((seg, local), values.to(acc))
    out = torch.einsum("snr,snd->srd", probs, vals)  # (S, G*q, d_v)
    out = out.reshape(b, hkv, g, q, dv).reshape(b, h, q, dv).transpose(1, 2).to(query.dtype)
    return out, (probs[seg, local].reshape(-1, g, q) if return_probs else None)  # (T, G, q)


def ragged_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
    meta: RaggedMeta, query_positions: torch.Tensor, scaling: float, return_probs: bool = False,
    terms: LogitTerms = PLAIN,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Dispatch for the dynamic (compact) layout: a variable-length kernel on CUDA
    (``kvcake.varlen.choose_route``) when neither probabilities nor logit terms are needed (the
    kernels have no soft cap or sink, and want keys and values of one width: a latent layer's
    differ, ``kvcake.latent``), else the PyTorch reference. Same arguments and result as
    ``ragged_attention_reference``. Static storage calls the kernel itself, with each segment's
    used prefix (``kvcake.step.ragged.attend``)."""
    fits = not return_probs and terms.fused and keys.shape[-1] == values.shape[-1]
    route = choose_route(query.device, query.dtype) if fits else "reference"
    if route != "reference":
        return varlen_attention(query, keys, values, meta.offsets, meta.max_len, scaling, route=route), None
    return ragged_attention_reference(
        query, keys, values, positions, meta, query_positions, scaling, return_probs, terms
    )


def to_device(host: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host values (a numpy array) as a tensor on ``device``, sent without waiting: a blocking copy
    to a GPU waits for everything queued before it. Safe for a temporary array: the copy takes
    the values before it returns."""
    return torch.from_numpy(np.ascontiguousarray(host)).to(device, dtype, non_blocking=True)


def kept_indices(keep: torch.Tensor, size: int) -> torch.Tensor:
    """The indices along the last dim of ``keep``'s True entries, in order, where every row holds
    exactly ``size`` of them (a count the host knows): what ``nonzero`` or ``t[keep]`` find, without
    their read back (on a GPU those wait for the device to learn how many there are). Each kept
    entry's rank is its slot; the dropped ones all go to a spare slot past the end. The count is
    the caller's to get right (the selectors keep exactly their counts): a row with fewer leaves
    -1 (an index error where it is used), one with more loses the entries past ``size``."""
    rank = keep.cumsum(-1) - 1
    slot = torch.where(keep, rank, torch.full_like(rank, size))
    ramp = torch.arange(keep.shape[-1], device=keep.device).expand_as(slot)
    out = torch.full((*keep.shape[:-1], size + 1), -1, dtype=torch.long, device=keep.device)
    return out.scatter_(-1, slot, ramp)[..., :size]


def ranked_rows(order: torch.Tensor, meta: RaggedMeta) -> torch.Tensor:
    """(T,) rows of the flattened (B * H_kv * N) entries: each head's first ``meta.lengths`` in
    ``order`` (B, H_kv, N), a permutation of each head's entries (its kept ones first)."""
    n = order.shape[-1]
    return order.reshape(-1)[meta.seg * n + meta.local] + meta.seg * n


def first_rows(held: RaggedMeta, meta: RaggedMeta) -> torch.Tensor:
    """(T,) rows of a ragged layout ``held``: each segment's first ``meta.lengths`` entries."""
    return held.offsets[meta.seg] + meta.local


def position_rows(meta: RaggedMeta, positions: torch.Tensor, length: int) -> torch.Tensor:
    """(T,) rows of a ragged layout that put each segment's entries in position order (positions
    (T,), each at most ``length``, distinct within a segment): one sort of segment-major keys."""
    return torch.argsort(meta.seg * (length + 1) + positions)


def row_segments(rows: torch.Tensor, kv_heads: int, device: torch.device) -> torch.Tensor:
    """The segments (``b * H_kv + h``) of each sequence in ``rows`` (B',), in order: (B' * H_kv,)."""
    return (rows.to(device)[:, None] * kv_heads + torch.arange(kv_heads, device=device)).reshape(-1)


def pad_probs(probs: torch.Tensor, meta: RaggedMeta, batch: int, kv_heads: int) -> torch.Tensor:
    """Ragged attention probabilities (T, G, q) as (B, H_kv * G, q, N) over the padded view
    (``N = meta.max_len``), 0 on the padding."""
    g, q = probs.shape[1], probs.shape[2]
    padded = torch.zeros(batch * kv_heads, meta.max_len, g, q, device=probs.device)
    padded[meta.seg, meta.local] = probs
    padded = padded.reshape(batch, kv_heads, meta.max_len, g, q).permute(0, 1, 3, 4, 2)
    return padded.reshape(batch, kv_heads * g, q, meta.max_len)


def append_segments(layer, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
    """A ragged ``layer``'s append (``KVCakeLayer.update``): every segment gets the ``q`` new
    entries (k, v: (B, H_kv, q, d), pos: (B, H_kv, q)) at its end, one scatter into a new buffer."""
    b, hkv, q, d = k.shape
    m = layer.meta
    n_seg = b * hkv
    new_len = m.lengths + q
    new_meta = RaggedMeta.from_lengths(new_len, m.max_len + q, m.seg.numel() + n_seg * q)
    old_dest = new_meta.offsets[m.seg] + m.local  # (T,)
    seg_new = torch.arange(n_seg, device=k.device).repeat_interleave(q)
    new_dest = new_meta.offsets[seg_new] + m.lengths[seg_new] + torch.arange(q, device=k.device).repeat(n_seg)
    total = int(new_meta.offsets[-1]) if n_seg else 0

    def put(old, new, fill):
        if old is None:
            return None
        out = torch.full((total, *old.shape[1:]), fill, dtype=old.dtype, device=old.device)
        out[old_dest] = old
        out[new_dest] = new
        return out

    layer.keys = put(layer.keys, k.reshape(n_seg * q, d), 0.0)
    layer.values = put(layer.values, v.reshape(n_seg * q, v.shape[-1]), 0.0)  # (latent: narrower, latent.py)
    layer.positions = put(layer.positions, pos.reshape(n_seg * q), -1)
    layer.scores = put(layer.scores, torch.zeros(n_seg * q, device=k.device), 0.0)
    layer.norms = None
    layer.meta = new_meta
