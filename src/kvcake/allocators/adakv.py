"""Head allocators: how a layer's budget is split among its KV heads.

Ada-KV: Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for
Efficient LLM Inference", NeurIPS 2025, https://arxiv.org/abs/2407.11550 (Algorithm 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..budget import check_real
from ..tensor_parallel import HeadSplit, top_over_ranks

# AdaKV.safeguard: the paper's pins counted on the prefix budget, or kvpress's on the whole budget
SAFEGUARDS = ("prefix", "kvpress")


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
class HostPlaces:
    """One layer's prompt scores as the host counts Ada-KV's heads on them (``AdaKV.host_places``):
    ``flat`` (B, H_kv * S) int64, head ``h``'s block ``[h * S, (h + 1) * S)`` the places of its
    entries in the stable descending order of the layer's flat prefix scores, in the head's own
    order (so ascending), plus ``h * span``, so each row is one sorted array; ``prefix`` and
    ``windows`` (B, H_kv) each head's prefix and window entries."""

    flat: np.ndarray
    prefix: np.ndarray
    windows: np.ndarray
    span: int
    length: int


class HeadAllocator:
    """Base class: ``counts(scores, budget, window) -> (B, H_kv)`` int64 per-head budgets.

    ``split`` (tensor-parallel models): ``scores`` hold this rank's heads only; an allocator that
    compares heads must decide over every rank's heads (``kvcake.tensor_parallel``).
    A ragged allocator may also count on the host (``places`` on the device once a layer, then
    ``host_places`` and ``counts_on_host`` at every stage of a cascade), which reads nothing back."""

    name = "uniform"
    ragged = False
    host_counts = False  # counts on the host: places, host_places, counts_on_host

    def counts(
        self, scores: torch.Tensor, budget: torch.Tensor, window: torch.Tensor, split: HeadSplit | None = None
    ) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def select(
        self, scores: torch.Tensor, budget: torch.Tensor, window: torch.Tensor, split: HeadSplit | None = None
    ) -> torch.Tensor:  # pragma: no cover - interface
        """(B, H_kv, S) bool: the entries the allocator's counts are made of, each head's
        ``counts`` highest scores (ties to the earlier position; window included, padding
        never), so that ``select(...).sum(-1)`` equals ``counts(...)``. Ragged allocators only."""
        raise NotImplementedError

    def pinned(self, budget, window):
        """(B,) int64: how many of each head's highest prefix scores every head keeps whatever the
        others score (Ada-KV's safeguard), at ``budget`` and ``window`` (B,) entries per head (int
        tensors, or arrays: the result alike); None where the allocator pins nothing."""
        return None


@dataclass(frozen=True)
class UniformHeads(HeadAllocator):
    """Every KV head keeps the layer's budget (capped by the sequence's length)."""

    name = "uniform"

    def counts(
        self, scores: torch.Tensor, budget: torch.Tensor, window: torch.Tensor, split: HeadSplit | None = None
    ) -> torch.Tensor:
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

    ``safeguard``: ``"prefix"`` (the paper, as above) or ``"kvpress"`` (kvpress's ``AdaKVPress``):
    ``max(1, floor(alpha * B))`` entries of the whole budget pinned, the ``Sw`` window entries
    among them, so ``floor(alpha * B) - Sw`` prefix entries (at least 0): 70 instead of 96 of a
    512-entry budget with a 32-entry window.

    Scores: (B, H_kv, S) with the window at ``+inf`` and padding at ``-inf``. Under tensor
    parallelism (``split``) they are this rank's heads; the layer's ``H_kv * B'`` and the ranking
    span every rank's heads, and the result is this rank's slice of the one-process selection.
    """

    alpha: float = 0.2
    safeguard: str = "prefix"
    name = "adakv"
    ragged = True
    host_counts = True

    def __post_init__(self) -> None:
        check_real("Ada-KV safeguard alpha", self.alpha, "heads.alpha=0.2", high=1.0)
        if self.safeguard not in SAFEGUARDS:
            raise ValueError(
                f"Ada-KV safeguard must be one of {', '.join(map(repr, SAFEGUARDS))}, got {self.safeguard!r}"
            )

    def pinned(self, budget, window):
        """The prefix entries pinned in each head (``HeadAllocator.pinned``): ``safeguard``'s count."""
        host = isinstance(budget, np.ndarray)
        budget = torch.as_tensor(budget).long()  # host for an array; a tensor stays where it is
        window = torch.as_tensor(window, device=budget.device).long()
        if self.safeguard == "prefix":
            pin = torch.floor((budget - window).clamp(min=0).double() * self.alpha).long()
        else:  # kvpress: of the whole budget, at least 1 of a nonzero one, the window among them
            whole = torch.floor(budget.double() * self.alpha).long()
            if self.alpha > 0:
                whole = torch.where(budget > 0, whole.clamp(min=1), whole)
            pin = (whole - window).clamp(min=0)
        return pin.numpy() if host else pin

    def counts(
        self, scores: torch.Tensor, budget: torch.Tensor, window: torch.Tensor, split: HeadSplit | None = None
    ) -> torch.Tensor:
        return self.select(scores, budget, window, split).sum(-1)

    def places(self, scores: torch.Tensor) -> torch.Tensor:
        """What the host needs to count this layer's heads at any budget, from its prompt's scores
        (B, H_kv, S): (B, H_kv, S + 2) int32 on their device, row ``h`` the places of head ``h``'s
        entries in the stable descending order of the flat prefix scores, in the head's own order
        (a stable order restricted to one head is that head's, so the row ascends), then the
        head's prefix and window entries. 4 bytes an entry, read to the host once
        (``devices.HostRead``) where a cascade re-counts a layer at every stage."""
        b, h, s = scores.shape
        finite = torch.isfinite(scores)
        prefix = torch.where(finite, scores, torch.full_like(scores, float("-inf")))
        order = torch.argsort(prefix.reshape(b, h * s), dim=-1, descending=True, stable=True)
        every = torch.arange(h * s, device=scores.device).expand(b, -1).contiguous()
        place = torch.empty_like(order).scatter_(1, order, every).view(b, h, s)
        windows = (scores == float("inf")).sum(-1, keepdim=True)
        return torch.cat([place.sort(dim=-1).values, finite.sum(-1, keepdim=True), windows], -1).int()

    def host_places(self, table: np.ndarray) -> HostPlaces:
        """:class:`HostPlaces` of what :meth:`places` returned, on the host."""
        b, h, s = table.shape[0], table.shape[1], table.shape[2] - 2
        span = h * s + 1  # above every place
        flat = table[..., :s].astype(np.int64) + np.arange(h)[:, None] * span
        prefix, windows = table[..., s].astype(np.int64), table[..., s + 1].astype(np.int64)
        return HostPlaces(flat.reshape(b, h * s), prefix, windows, span, s)

    def counts_on_host(self, p: HostPlaces, budget: np.ndarray, window: np.ndarray) -> np.ndarray:
        """:meth:`counts` of the scores :meth:`places` read, on the host: budget and window (B,)
        int, (B, H_kv) int64. The fill's winners are the first ``fill`` unpinned prefix entries in
        the layer's order (a head's entries after its first ``pin``), so the fill ends at ``t``, one
        past the ``fill``-th smallest place among them (one ``partition``), and each head keeps
        its entries placed before ``t`` or its pinned ones, whichever are more."""
        b, h = p.prefix.shape
        prefix_budget = np.maximum(budget - window, 0)  # (B,) B'
        pin = self.pinned(np.asarray(budget), np.asarray(window))  # as select's
        rows = p.flat.reshape(b, h, p.length) - (np.arange(h) * p.span)[:, None]  # a head's places, ascending
        out = np.empty((b, h), dtype=np.int64)
        for i in range(b):
            pinned = np.minimum(p.prefix[i], pin[i])  # (H_kv,)
            fill = int(h * prefix_budget[i] - pinned.sum())
            # the prefix entries hold the layer's first places: a head's first p.prefix places are theirs
            unpinned = np.concatenate([rows[i, k, pin[i] : p.prefix[i, k]] for k in range(h)])
            if unpinned.size > fill:
                t = int(np.partition(unpinned, fill - 1)[fill - 1]) + 1 if fill > 0 else 0
            else:  # every unpinned entry wins
                t = int(p.prefix[i].sum())
            out[i] = p.windows[i] + np.maximum((rows[i] < t).sum(-1), pinned)
        return out

    def select(
        self, scores: torch.Tensor, budget: torch.Tensor, window: torch.Tensor, split: HeadSplit | None = None
    ) -> torch.Tensor:
        """The kept set itself: (B, H_kv, S) bool (window included, padding never)."""
        b, h, s = scores.shape
        finite = torch.isfinite(scores)  # prefix entries that may be chosen
        is_window = scores == float("inf")
        prefix_budget = (budget - window).clamp(min=0)  # (B,) B'
        pin = self.pinned(budget, window)  # (B,)
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
