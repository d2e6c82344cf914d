"""DefensiveKV's defensive aggregation: Feng et al., "DefensiveKV: Taming the Fragility of KV
Cache Eviction in LLM Inference", ICLR 2026; the authors' code is
https://github.com/FFY0/DefensiveKV (``kvpress/presses/efficient_defensivekv_press.py``).

SnapKV scores a token by the *mean* attention of the window's queries; a future question may
need exactly the token the window's average neglected. DefensiveKV scores by the worst case:
the *maximum* over the window's queries and the GQA group, with every score raised to at
least the head's mean over keys, so no head's tail falls to zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import PrefillInputs, Scorer, pool1d, protect

MARK = 2.0
"""Offset added to the entries of CriticalKV's first stage (``critical_mass``). Defensive
scores are attention probabilities, so at most 1: a marked entry (>= ``MARK``) ranks above
every unmarked one in each head, across heads (Ada-KV) and across layers (global allocation),
as the authors' code does by setting them to the layer's maximum."""


@dataclass(frozen=True)
class DefensiveScorer(Scorer):
    """Worst-case window attention, average-pooled and floored at each head's mean.

    For the window's queries ``A`` (B, H, w, S) (SnapKV's window attention), on the prefix
    columns (the ``P = S - w`` tokens before the window):

    1. each query row is average-pooled over positions (``kernel``, default 5) and rescaled to
       its unpooled mass, so pooling moves attention between neighbours without adding any;
    2. ``aggregate="max"`` (DefensiveKV) takes the maximum over the window's rows and the GQA
       group; ``"mean"`` the mean over both (SnapKV's aggregation, kept for comparison);
    3. every score is raised to at least the mean over the head's prefix keys.

    With ``critical_mass`` (default 0.9, the authors' code) the scorer also marks CriticalKV's
    first stage for ``select=critical,select.first=marked``: per KV head, the fewest
    highest-attention prefix entries whose share of the head's mean (unpooled) window
    attention reaches ``critical_mass`` minus the window's own share (the attention the
    window's queries pay to the window, averaged over heads and rows). Marked entries get
    ``+MARK``. ``critical_mass=0`` marks nothing. Differences from the authors' code: the
    share is per sequence (theirs one scalar for the batch, read off the last ``w`` prefix
    columns), and the set includes the entry that crosses the threshold (theirs stops before
    it); the cap at the head's budget is applied by the selector. In our parts Ada-KV splits a
    layer's budget among heads by these scores (marks included) and the selector then weighs
    the rest by value norms within each head, where the authors rank the value-weighted scores
    across heads at once; and the selector's ``eps`` (1e-4) is added before weighting.

    Output (B, H_kv, S) float32, window at +inf, padding at -inf.
    """

    kernel: int = 5
    aggregate: str = "max"
    critical_mass: float = 0.9
    name = "defensive"
    reduce = "max"

    def __post_init__(self) -> None:
        if isinstance(self.kernel, bool) or not isinstance(self.kernel, int) or self.kernel < 1:
            raise ValueError(f"defensive pooling kernel must be a positive odd int, got {self.kernel!r}")
        if self.kernel % 2 == 0:
            raise ValueError(f"defensive pooling kernel must be odd, got {self.kernel}")
        if self.aggregate not in ("max", "mean"):
            raise ValueError(f"defensive aggregate must be 'max' or 'mean', got {self.aggregate!r}")
        if not 0.0 <= self.critical_mass <= 1.0:
            raise ValueError(f"defensive critical_mass must be in [0, 1], got {self.critical_mass}")

    @property
    def marks_critical(self) -> bool:
        return self.critical_mass > 0

    def prefill(self, inp: PrefillInputs) -> torch.Tensor:
        probs, row_valid = inp.window_attention()  # (B, H, w, S)
        b, h, w, s = probs.shape
        hkv, g = inp.keys.shape[1], inp.num_groups
        p = s - w
        if p <= 0:  # everything is window
            return protect(torch.zeros(b, hkv, s, device=probs.device), inp.key_valid, inp.window)
        prefix = probs[..., :p]  # (B, H, w, P)
        mass = prefix.sum(-1, keepdim=True)  # (B, H, w, 1)
        key_ok = inp.key_valid[:, :p]  # (B, P)
        pooled = pool1d(prefix.reshape(b, h * w, p), self.kernel, "avg").reshape(b, h, w, p)
        pooled = pooled * key_ok[:, None, None, :]  # what leaks into left padding is dropped, as past the edge
        pooled = pooled * (mass / pooled.sum(-1, keepdim=True).clamp(min=1e-30))
        pooled = pooled.reshape(b, hkv, g * w, p)  # (B, H_kv, G*w, P): group and rows together
        n_rows = (row_valid.sum(-1).clamp(min=1) * g).float()[:, None, None]  # (B, 1, 1)
        agg = pooled.amax(2) if self.aggregate == "max" else pooled.sum(2) / n_rows  # (B, H_kv, P)
        n_keys = key_ok.sum(-1).clamp(min=1).float()[:, None, None]
        floor = (agg * key_ok[:, None, :]).sum(-1, keepdim=True) / n_keys  # (B, H_kv, 1)
        scores = torch.maximum(agg, floor)
        if self.marks_critical:
            scores = scores + MARK * self._critical(prefix, probs, row_valid, key_ok, hkv, g)
        full = torch.cat([scores, torch.zeros(b, hkv, w, device=scores.device)], dim=-1)  # (B, H_kv, S)
        return protect(full, inp.key_valid, inp.window)

    def _critical(self, prefix, probs, row_valid, key_ok, hkv: int, g: int) -> torch.Tensor:
        """(B, H_kv, P) bool: CriticalKV's first stage (see the class docstring)."""
        b, h, w, p = prefix.shape
        n_rows = (row_valid.sum(-1).clamp(min=1) * g).float()[:, None, None]
        mean = prefix.reshape(b, hkv, g * w, p).sum(2) / n_rows  # (B, H_kv, P) unpooled
        mean = mean * key_ok[:, None, :]
        share = mean / mean.sum(-1, keepdim=True).clamp(min=1e-30)
        window_mass = probs[..., p:].sum(-1)  # (B, H, w) attention of the window on itself
        window_share = window_mass.sum((1, 2)) / (row_valid.sum(-1).clamp(min=1) * h)  # (B,)
        threshold = (self.critical_mass - window_share).clamp(min=0.0)[:, None, None]  # (B, 1, 1)
        ordered, order = torch.sort(share, dim=-1, descending=True, stable=True)
        before = ordered.cumsum(-1) - ordered  # mass of the entries ranked above each one
        take = (before < threshold) & (ordered > 0)
        return torch.zeros_like(take).scatter(-1, order, take)

    def describe(self) -> str:
        return f"{self.name}({self.aggregate})"
