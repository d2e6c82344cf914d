"""Head allocators: how a layer's budget is split among its KV heads.

Ada-KV: Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for
Efficient LLM Inference", NeurIPS 2025, https://arxiv.org/abs/2407.11550 (Algorithm 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tensor_parallel import HeadSplit, top_over_ranks


def ranks_desc(scores: torch.Tensor) -> torch.Tensor:
    """Rank of every entry along the last dim in descending score order (0 = best).

    Ties break by position (stable sort), the same rule everywhere in the library, so that a
    selection made in stages equals the one made at once."""
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(
        -1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order).contiguous()
    )
    return ranks


def top_ranked(scores: torch.Tensor, k: torch.Tensor, kmax: int | None = None) -> torch.Tensor:
    """``ranks_desc(scores) < k[..., None]`` without sorting: scores (..., N), k (...) int64.

    The ``k``-th largest value ``t`` (one ``topk``) splits the row: every entry above ``t`` ranks
    below ``k``, every entry below ``t`` at or past it, and of the entries equal to ``t`` the first
    ``k - #above`` by position do (ties break by position, as in ``ranks_desc``). ``kmax``: the
    largest of ``k``, where the caller knows it on the host (else read: one number per call)."""
    n = scores.shape[-1]
    k = k.clamp(min=0, max=n)
    if kmax is None:
        kmax = int(k.max()) if k.numel() else 0  # host: one number per call
    kmax = min(kmax, n)
    if kmax == 0:
        return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    top = scores.topk(kmax, dim=-1).values  # (..., kmax) descending
    kth = top.gather(-1, (k - 1).clamp(min=0)[..., None])  # (..., 1)
    above = scores > kth
    tie = scores == kth
    room = k[..., None] - above.sum(-1, keepdim=True)
    return (above | (tie & (tie.long().cumsum(-1) <= room))) & (k[..., None] > 0)


@dataclass(frozen=True)
class AdaRanking:
    """One layer's prompt scores sorted for Ada-KV (``AdaKV.rank``), every tensor (B, H_kv*S) in
    the stable descending order of the flat prefix scores: ``head_rank`` each entry's rank in its
    head (``ranks_desc``) and ``head`` its KV head, int32; ``finite`` whether it is a prefix
    entry; and ``windows`` (B, H_kv) window entries per head. 9 bytes an entry, held with the
    scores during prefill."""

    head_rank: torch.Tensor
    head: torch.Tensor
    finite: torch.Tensor
    windows: torch.Tensor


class HeadAllocator:
    """Base class: ``counts(scores, budget, window) -> (B, H_kv)`` int64 per-head budgets.

    ``split`` (tensor-parallel models): ``scores`` hold this rank's heads only; an allocator that
    compares heads must decide over every rank's heads (``kvcake.tensor_parallel``).
    ``ranking``: what ``rank(scores)`` returned for the same scores, so that a cascade, which
    counts on one layer's prompt scores at every stage, sorts them once (None: nothing to reuse)."""

    name = "uniform"
    ragged = False

    def rank(self, scores: torch.Tensor) -> object | None:
        return None

    def counts(
        self, scores: torch.Tensor, budget: torch.Tensor, window: torch.Tensor, split: HeadSplit | None = None,
        ranking: object | None = None,
    ) -> torch.Tensor:  # fmt: skip
        raise NotImplementedError  # pragma: no cover - interface

    def select(
        self, scores: torch.Tensor, budget: torch.Tensor, window: torch.Tensor, split: HeadSplit | None = None
    ) -> torch.Tensor:  # pragma: no cover - interface
        """(B, H_kv, S) bool: the entries the allocator's counts are made of, each head's
        ``counts`` highest scores (ties to the earlier position; window included, padding
        never), so that ``select(...).sum(-1)`` equals ``counts(...)``. Ragged allocators only."""
        raise NotImplementedError


@dataclass(frozen=True)
class UniformHeads(HeadAllocator):
    """Every KV head keeps the layer's budget (capped by the sequence's length)."""

    name = "uniform"

    def counts(
        self, scores: torch.Tensor, budget: torch.Tensor, window: torch.Tensor, split: HeadSplit | None = None,
        ranking: object | None = None,
    ) -> torch.Tensor:  # fmt: skip
        n_valid = (scores > float("-inf")).sum(-1)  # (B, H_kv)
        return torch.minimum(budget[:, None].expand_as(n_valid), n_valid)


@dataclass(frozen=True)
class AdaKV(HeadAllocator):
    """Adaptive per-head budgets: the top ``H_kv * B'`` prefix scores of the whole layer win.

    ``B' = B - Sw`` is the prefix budget per head. The safeguard ``alpha`` (default 0.2, the
    paper's and the authors' code's value) first pins each head's own top ``floor(alpha * B')``
    entries so no head is starved, then the rest of the layer's ``H_kv * B'`` go to the highest
    remaining scores of any head. The layer total is exact; heads hold different numbers of
    entries, which the ragged cache stores without padding.

    Scores: (B, H_kv, S) with the window at ``+inf`` and padding at ``-inf``. Under tensor
    parallelism (``split``) they are this rank's heads; the layer's ``H_kv * B'`` and the ranking
    span every rank's heads, and the result is this rank's slice of the one-process selection.
    """

    alpha: float = 0.2
    name = "adakv"
    ragged = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"Ada-KV safeguard alpha must be in [0, 1], got {self.alpha}")

    def rank(self, scores: torch.Tensor) -> AdaRanking:
        """Sort a layer's scores (B, H_kv, S) once for every stage's ``counts``."""
        b, h, s = scores.shape
        finite = torch.isfinite(scores)
        prefix = torch.where(finite, scores, torch.full_like(scores, float("-inf")))
        order = torch.argsort(prefix.reshape(b, h * s), dim=-1, descending=True, stable=True)  # (B, H_kv*S)
        windows = (scores == float("inf")).sum(-1)
        head_rank = ranks_desc(prefix).reshape(b, h * s).gather(1, order).int()  # int32: 9 bytes an entry
        head = torch.div(order, s, rounding_mode="floor").int()
        return AdaRanking(head_rank, head, finite.reshape(b, h * s).gather(1, order), windows)

    def counts(
        self, scores: torch.Tensor, budget: torch.Tensor, window: torch.Tensor, split: HeadSplit | None = None,
        ranking: AdaRanking | None = None,
    ) -> torch.Tensor:  # fmt: skip
        if ranking is None or split is not None:
            return self.select(scores, budget, window, split).sum(-1)
        return self._ranked_counts(ranking, budget, window)

    def _ranked_counts(self, r: AdaRanking, budget: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """``select(...).sum(-1)`` from a ranking: the winners of the fill are the first ``fill``
        unpinned prefix entries in the order of all prefix scores (a stable order restricted to
        a subset is that subset's stable order), a cumulative count instead of a sort."""
        b, h = r.windows.shape
        prefix_budget = (budget - window).clamp(min=0)  # (B,) B'
        pin = torch.floor(prefix_budget.double() * self.alpha).long()  # (B,)
        pinned = (r.head_rank < pin[:, None]) & r.finite  # (B, H_kv*S) in score order
        free = r.finite & ~pinned
        fill = h * prefix_budget - pinned.sum(1)  # (B,)
        kept = pinned | (free & (free.long().cumsum(1) <= fill[:, None]))
        per_head = torch.zeros(b, h, dtype=torch.long, device=kept.device)
        return r.windows + per_head.scatter_add_(1, r.head.long(), kept.long())

    def select(
        self, scores: torch.Tensor, budget: torch.Tensor, window: torch.Tensor, split: HeadSplit | None = None
    ) -> torch.Tensor:
        """The kept set itself: (B, H_kv, S) bool (window included, padding never)."""
        b, h, s = scores.shape
        finite = torch.isfinite(scores)  # prefix entries that may be chosen
        is_window = scores == float("inf")
        prefix_budget = (budget - window).clamp(min=0)  # (B,) B'
        pin = torch.floor(prefix_budget.double() * self.alpha).long()  # (B,)
        prefix = torch.where(finite, scores, torch.full_like(scores, float("-inf")))
        pinned = (ranks_desc(prefix) < pin[:, None, None]) & finite
        rest = torch.where(pinned, torch.full_like(prefix, float("-inf")), prefix)
        if split is None:
            fill = h * prefix_budget - pinned.sum((1, 2))  # (B,)
            won = ranks_desc(rest.reshape(b, h * s)) < fill[:, None]  # (B, H_kv * S)
        else:  # every rank's heads: the layer's H_kv is h * world, its pinned entries summed over ranks
            fill = h * split.world * prefix_budget - split.sum(pinned.sum((1, 2)))  # (B,)
            won = top_over_ranks(rest, fill, split)  # (B, H_local, S)
        won = won.reshape(b, h, s) & finite & ~pinned
        return is_window | pinned | won
