"""CriticalKV: Feng et al., "Identify Critical KV Cache in LLM Inference from an Output
Perturbation Perspective", 2025, https://arxiv.org/abs/2502.03805 (Algorithm 1)."""

from __future__ import annotations

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

    def prepare_norms(self, norms: torch.Tensor) -> torch.Tensor:
        """The value weights kept with the layer, from the full prompt's norms (B, H_kv, S)."""
        if self.value_norm == "heads":  # positions still aligned across heads: before any eviction
            return norms / norms.sum(1, keepdim=True).clamp(min=1e-30)
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
