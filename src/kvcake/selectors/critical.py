"""CriticalKV: Feng et al., "Identify Critical KV Cache in LLM Inference from an Output
Perturbation Perspective", 2025, https://arxiv.org/abs/2502.03805 (Algorithm 1)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..allocators.adakv import ranks_desc
from ..scorers.defensive import MARK
from .topk import SelectionInputs, Selector

# Positions per chunk when projecting values through o_proj: bounds the (B, H, chunk, hidden)
# intermediate to a few MB instead of materialising it for the whole prompt.
_NORM_CHUNK = 1024


def projected_value_norms(values: torch.Tensor, o_weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``|| v_n W_O^(h) ||_1`` averaged over each GQA group: (B, H_kv, S) float32.

    values: (B, H_kv, S, d); o_weight: (hidden, H * d), the output projection's weight, whose
    columns ``h*d:(h+1)*d`` are query head ``h``'s slice. Vectorised over heads, chunked over
    positions (see ``_NORM_CHUNK``).
    """
    b, hkv, s, d = values.shape
    groups = num_heads // hkv
    w = o_weight.to(values.device).float()  # the values' device (one layer of a split model)
    w = w.reshape(o_weight.shape[0], num_heads, d).permute(1, 2, 0)  # (H, d, hidden)
    w = w.reshape(hkv, groups, d, -1)  # (H_kv, G, d, hidden)
    out = torch.empty(b, hkv, s, dtype=torch.float32, device=values.device)
    for start in range(0, s, _NORM_CHUNK):
        v = values[:, :, start : start + _NORM_CHUNK].float()  # (B, H_kv, c, d)
        proj = torch.einsum("bkcd,kgdo->bkgco", v, w)  # (B, H_kv, G, c, hidden)
        out[:, :, start : start + v.shape[2]] = proj.abs().sum(-1).mean(2)
    return out


def projected_value_norm_bounds(
    values: torch.Tensor, o_weight: torch.Tensor, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower and upper bounds of :func:`projected_value_norms`, each (B, H_kv, S) float32.

    ``||x||_2 <= ||x||_1 <= sqrt(hidden) ||x||_2`` for ``x = v W_O^(h)`` (hidden entries), and the
    L2 norm is exact through the ``d x d`` Gram matrix ``W_O^(h) W_O^(h)T``: ``d^2`` multiply-adds per
    position and head instead of ``d * hidden`` (a ``hidden / d`` saving: 9x on SmolLM2, 32x on
    Llama-3.1-8B)."""
    b, hkv, s, d = values.shape
    groups = num_heads // hkv
    hidden = o_weight.shape[0]
    w = o_weight.to(values.device).float().reshape(hidden, num_heads, d).permute(1, 2, 0)  # (H, d, hidden)
    gram = (w @ w.transpose(1, 2)).reshape(hkv, groups, d, d)  # (H_kv, G, d, d)
    low = torch.empty(b, hkv, s, dtype=torch.float32, device=values.device)
    for start in range(0, s, _NORM_CHUNK):
        v = values[:, :, start : start + _NORM_CHUNK].float()  # (B, H_kv, c, d)
        vg = torch.einsum("bkcd,kgde->bkgce", v, gram)  # (B, H_kv, G, c, d)
        l2 = (vg * v[:, :, None]).sum(-1).clamp(min=0).sqrt()  # (B, H_kv, G, c)
        low[:, :, start : start + v.shape[2]] = l2.mean(2)
    return low, low * math.sqrt(hidden)


def _norms_where(
    values: torch.Tensor, o_weight: torch.Tensor, num_heads: int, mask: torch.Tensor
) -> torch.Tensor:
    """:func:`projected_value_norms` where ``mask`` (B, H_kv, S) is True, 0 elsewhere, computed on
    the masked entries only (gathered to the widest head's count)."""
    m = int(mask.sum(-1).max())  # host: prefill only
    if 2 * m >= mask.shape[-1]:
        return projected_value_norms(values, o_weight, num_heads) * mask
    idx = mask.float().topk(m, dim=-1).indices  # (B, H_kv, m): every masked entry of each head
    sub = values.gather(2, idx[..., None].expand(-1, -1, -1, values.shape[-1]))  # (B, H_kv, m, d)
    exact = projected_value_norms(sub, o_weight, num_heads) * mask.gather(-1, idx)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=values.device)
    return out.scatter_(-1, idx, exact)


@dataclass(frozen=True)
class Critical(Selector):
    """Two-stage, perturbation-constrained selection within each head's prefix budget ``b``.

    Stage 1 keeps the top ``floor(alpha * b)`` entries by score (``alpha = 0.5``, the paper's
    experiments and the authors' code); stage 2 fills the remaining ``b - b1`` from the rest by
    ``(score + eps) * ||v_n W_O^(h)||_1`` (``eps = 1e-4``), which bounds the output
    perturbation rather than the attention mass alone. The window is always kept.

    Parameters
    ----------
    alpha:
        First-stage share of the prefix budget (``first="ratio"``).
    eps:
        Added to the score before weighting by the value norm.
    first:
        ``"ratio"`` (CriticalKV): stage 1 is the top ``floor(alpha * b)``. ``"marked"``
        (DefensiveKV's code): stage 1 is the entries the scorer marked as holding 90% of the
        attention mass (``score >= MARK``, ``DefensiveScorer.critical_mass``), at most ``b``.
    value_norm:
        ``"raw"`` (CriticalKV): ``||v_n W_O^(h)||_1``. ``"heads"`` (DefensiveKV's code): each
        entry's norm divided by its sum over the layer's KV heads at the same position.
    """

    alpha: float = 0.5
    eps: float = 1e-4
    first: str = "ratio"
    value_norm: str = "raw"
    name = "critical"
    needs_value_norms = True
    keeps_top_scores = False  # stage 2 may drop a higher score for a larger value norm

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"CriticalKV first-stage ratio alpha must be in [0, 1], got {self.alpha}")
        if not self.eps >= 0:
            raise ValueError(f"CriticalKV eps must be >= 0, got {self.eps}")
        if self.first not in ("ratio", "marked"):
            raise ValueError(f"CriticalKV first stage must be 'ratio' or 'marked', got {self.first!r}")
        if self.value_norm not in ("raw", "heads"):
            raise ValueError(f"CriticalKV value_norm must be 'raw' or 'heads', got {self.value_norm!r}")

    @property
    def needs_marks(self) -> bool:
        return self.first == "marked"

    def prepare_norms(self, norms: torch.Tensor, split=None) -> torch.Tensor:
        """The value weights kept with the layer, from the full prompt's norms (B, H_kv, S), at
        the layer's first eviction (positions still aligned across heads). ``value_norm="heads"``
        divides by the sum over every KV head of the layer: under tensor parallelism
        (``split``, a :class:`kvcake.tensor_parallel.HeadSplit`) over every rank's heads,
        gathered and summed in head order as one process would."""
        if self.value_norm != "heads":
            return norms
        if split is None:
            total = norms.sum(1, keepdim=True)
        else:
            every = split.gather(norms)  # (world, B, h, S), rank order = head order
            total = every.permute(1, 0, 2, 3).flatten(1, 2).sum(1, keepdim=True)
        return norms / total.clamp(min=1e-30)

    def value_norms(
        self, values: torch.Tensor, o_weight: torch.Tensor, num_heads: int, scores: torch.Tensor,
        counts: torch.Tensor, split=None,
    ) -> torch.Tensor:  # fmt: skip
        """:func:`projected_value_norms` (B, H_kv, S) on every entry ``select`` with at most ``counts``
        (B, H_kv) per head can keep, and 0 on the others, which it then never keeps: the same kept
        set at a fraction of the cost.

        values: (B, H_kv, S, d), the layer's whole prompt; scores: (B, H_kv, S) as ``select`` reads
        them. With ``b`` prefix entries to keep in a head: exact norms first for the entries that
        can be in stage 1 (the top ``b`` by score) and the ``2b`` most promising by a cheap estimate
        of the stage-2 weight ``(score + eps) * norm``; ``T``, the ``b``-th largest exact weight
        among them, is at most the ``b``-th largest of all. An entry whose upper bound
        (:func:`projected_value_norm_bounds`) is below ``T`` loses to at least ``b - b1`` others in
        stage 2 (``b1 <= b`` are in stage 1), so it is never kept; the others get their exact norm
        too. A cascade's later stages keep fewer of the entries kept here, whose norms are exact.

        ``value_norm="heads"`` weighs by ``n_h / sum_h' n_h'`` over the layer's KV heads at the same
        position (``prepare_norms``), so a position is computed for every head at once (its total
        is then exact), and the bounds are those of the ratio: ``n_h`` between ``low_h`` and
        ``high_h``, so ``n_h / sum <= high_h / (high_h + sum_{h' != h} low_h')``. Under tensor
        parallelism (``split``) the total spans every rank's heads, whose candidates differ: every
        norm is computed there."""
        heads = self.value_norm == "heads"
        if heads and split is not None:
            return projected_value_norms(values, o_weight, num_heads)
        prefix_ok = torch.isfinite(scores)
        b_pref = (counts - (scores == float("inf")).sum(-1)).clamp(min=0)  # (B, H_kv)
        kmax = int(b_pref.max()) if b_pref.numel() else 0  # host: once per layer, in prefill
        n = scores.shape[-1]
        if kmax == 0:
            return torch.zeros(scores.shape, dtype=torch.float32, device=scores.device)
        if 4 * kmax >= n:  # most entries are candidates anyway: compute them all
            return projected_value_norms(values, o_weight, num_heads)
        low, high = projected_value_norm_bounds(values, o_weight, num_heads)
        if heads:  # bounds of the share n_h / sum_h' n_h' (float slack: the others' lows shaved 0.1%)
            others = (low.sum(1, keepdim=True) - low).clamp(min=0) * (1 - 1e-3)  # (B, H_kv, S)
            estimate = low / low.sum(1, keepdim=True).clamp(min=1e-30)
            high = (high / (high + others).clamp(min=1e-30)).clamp(max=1.0)
        else:
            estimate = low
        weight = torch.where(prefix_ok, scores.clamp(min=0) + self.eps, torch.zeros_like(scores))
        ninf = torch.full_like(weight, float("-inf"))
        by_score = ranks_desc(torch.where(prefix_ok, scores, ninf))
        by_estimate = ranks_desc(torch.where(prefix_ok, weight * estimate, ninf))
        first = prefix_ok & ((by_score < b_pref[..., None]) | (by_estimate < 2 * b_pref[..., None]))
        if heads:  # a position for every head: (B, 1, S) broadcast
            first = prefix_ok & first.any(1, keepdim=True)
        norms = _norms_where(values, o_weight, num_heads, first)
        exact = torch.where(first, weight * self.prepare_norms(norms), ninf)
        top = exact.topk(kmax, dim=-1).values  # (B, H_kv, kmax)
        threshold = top.gather(-1, (b_pref - 1).clamp(min=0)[..., None])  # (B, H_kv, 1)
        threshold = torch.where(
            b_pref[..., None] > 0, threshold.clamp(min=0), torch.full_like(threshold, float("inf"))
        )
        second = prefix_ok & ~first & (weight * high * (1 + 1e-4) >= threshold)
        if heads:
            second = prefix_ok & ~first & second.any(1, keepdim=True)
        if bool(second.any()):
            norms = norms + _norms_where(values, o_weight, num_heads, second)
        return norms

    def select(self, inp: SelectionInputs) -> torch.Tensor:
        if inp.value_norms is None:
            raise ValueError("CriticalKV selection needs value norms")
        scores = inp.scores
        window = scores == float("inf")
        prefix_ok = torch.isfinite(scores)
        prefix_counts = (inp.counts - window.sum(-1)).clamp(min=0)  # (B, H_kv)
        prefix = torch.where(prefix_ok, scores, torch.full_like(scores, float("-inf")))
        if self.first == "marked":  # marked entries rank first in their head
            first = torch.minimum((prefix >= MARK).sum(-1), prefix_counts)
        else:
            first = torch.floor(prefix_counts.double() * self.alpha).long()
        stage1 = (ranks_desc(prefix) < first[..., None]) & prefix_ok
        weighted = (prefix.clamp(min=0) + self.eps) * inp.value_norms
        weighted = torch.where(prefix_ok & ~stage1, weighted, torch.full_like(weighted, float("-inf")))
        stage2 = (ranks_desc(weighted) < (prefix_counts - first)[..., None]) & prefix_ok & ~stage1
        return window | stage1 | stage2
