"""CriticalKV: Feng et al., "Identify Critical KV Cache in LLM Inference from an Output
Perturbation Perspective", 2025, https://arxiv.org/abs/2502.03805 (Algorithm 1)."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from functools import partial

import torch

from ..allocators.adakv import ranks_desc
from ..budget import check_real
from ..devices import read_through
from ..scorers.defensive import MARK
from ..tensor_parallel import group_mean
from .topk import SelectionInputs, Selector, order_by
from .value_norms import projected_value_norm_bounds, projected_value_norms

# Sign vectors per KV head for the L1 lower bound of ``projected_value_norm_bounds`` (DefensiveKV's
# head-normalised norms): 16 and 64 prune about as well on SmolLM2 at 4k tokens.
_SIGN_SOURCES = 32
# ``value_norm="heads"``: where the positions of every head's top ``2b`` (the first set) cover this
# share of the prompt, every norm is computed at once instead. The bounds cost about a third of the
# norms, and with a first set that wide the second mostly covered half the prompt or more (SmolLM2,
# 4096 tokens, Layer-DefensiveKV's early budgets: first sets of 25-31%, then >= 50%; 14%, then none).
_ALL_NORMS_SHARE = 0.25
# Critical.first: the paper's share of the prefix budget, kvpress's share of the whole, DefensiveKV's marks
FIRST_STAGES = ("ratio", "kvpress", "marked")


def _on_masked(values: torch.Tensor, mask: torch.Tensor, fn, m: int):
    """``fn`` (a function of (B, H_kv, m, d) values returning (B, H_kv, m) tensors, or a tuple of
    them) where ``mask`` (B, H_kv, S) is True, 0 elsewhere, computed on the masked entries only
    (gathered to ``m`` entries a head). ``m``: at least the widest head's count (the read
    :func:`_widest`, or a bound known on the host: the extra entries gathered give 0)."""
    m = min(m, mask.shape[-1])
    if 2 * m >= mask.shape[-1]:
        out = fn(values)
        return tuple(t * mask for t in out) if isinstance(out, tuple) else out * mask
    idx = mask.float().topk(m, dim=-1).indices  # (B, H_kv, m): every masked entry of each head
    sub = values.gather(2, idx[..., None].expand(-1, -1, -1, values.shape[-1]))  # (B, H_kv, m, d)
    kept = mask.gather(-1, idx)

    def scatter(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(mask.shape, dtype=torch.float32, device=values.device)
        return out.scatter_(-1, idx, t * kept)

    out = fn(sub)
    return tuple(scatter(t) for t in out) if isinstance(out, tuple) else scatter(out)


def _norms_where(
    values: torch.Tensor, o_weight: torch.Tensor, num_heads: int, mask: torch.Tensor, m: int
) -> torch.Tensor:
    """:func:`projected_value_norms` where ``mask`` (B, H_kv, S) is True, 0 elsewhere (``m``: as
    :func:`_on_masked`'s)."""
    return _on_masked(values, mask, lambda v: projected_value_norms(v, o_weight, num_heads), m)


def _prefix_bound(b_pref: torch.Tensor, count_bound: int | None) -> int:
    """At least the largest of ``b_pref`` (B, H_kv): ``count_bound`` where the caller knows one on
    the host (``b_pref`` never exceeds the counts), else read (one host read)."""
    if not b_pref.numel():
        return 0
    return int(b_pref.max()) if count_bound is None else max(int(count_bound), 0)


def _threshold(exact: torch.Tensor, b_pref: torch.Tensor, kmax: int) -> torch.Tensor:
    """(B, H_kv, 1): each head's ``b_pref``-th largest of ``exact`` (B, H_kv, S), at least 0
    (inf where ``b_pref`` is 0); ``kmax``: at least the largest of ``b_pref``."""
    top = exact.topk(kmax, dim=-1).values  # (B, H_kv, kmax)
    threshold = top.gather(-1, (b_pref - 1).clamp(min=0)[..., None])
    return torch.where(
        b_pref[..., None] > 0, threshold.clamp(min=0), torch.full_like(threshold, float("inf"))
    )


def _widest(mask: torch.Tensor):
    """The most entries ``mask`` (B, H_kv, S) holds in one head (0: none at all), in a generator
    of reads (``devices.read_through``): yields the device count, returns the int sent back."""
    if not mask.numel():
        return 0
    return (yield mask.sum(-1).max())


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
        First-stage share of the prefix budget (``first="ratio"``; of the whole budget with
        ``first="kvpress"``).
    eps:
        Added to the score before weighting by the value norm.
    first:
        ``"ratio"`` (CriticalKV): stage 1 is the top ``floor(alpha * b)``. ``"kvpress"`` (kvpress's
        ``CriticalKVPress``): stage 1 is ``floor(alpha * (b + w))`` of the whole budget with the
        ``w`` window entries counted among them, so ``floor(alpha * (b + w)) - w`` prefix entries
        (at least 0): 224 instead of 240 of a 512-entry budget with a 32-entry window; and at
        least the entries Ada-KV's safeguard pinned in the head (``SelectionInputs.pinned``), which
        kvpress's ``CriticalAdaKVPress`` keeps through both stages. ``"marked"``
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
        check_real("CriticalKV first-stage ratio alpha", self.alpha, "select.alpha=0.5", high=1.0)
        check_real("CriticalKV eps", self.eps, "select.eps=0.0001")
        if self.first not in FIRST_STAGES:
            raise ValueError(
                f"CriticalKV first stage must be one of {', '.join(map(repr, FIRST_STAGES))}, got {self.first!r}"
            )
        if self.value_norm not in ("raw", "heads"):
            raise ValueError(f"CriticalKV value_norm must be 'raw' or 'heads', got {self.value_norm!r}")

    @property
    def needs_marks(self) -> bool:
        return self.first == "marked"

    @property
    def keeps_pinned(self) -> bool:
        return self.first == "kvpress"

    def prepare_norms(self, norms: torch.Tensor, split=None) -> torch.Tensor:
        """The value weights kept with the layer, from the full prompt's norms (B, H_kv, S), at
        the layer's first eviction (positions still aligned across heads). ``value_norm="heads"``
        divides by the sum over every KV head of the layer: under tensor parallelism (``split``, a
        ``HeadSplit``) over every rank's heads, gathered and summed in head order as one process would."""
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
        counts: torch.Tensor, split=None, count_bound: int | None = None, group_split=None,
    ) -> torch.Tensor:  # fmt: skip
        """:meth:`value_norm_steps` run to its end, each size read as it asks."""
        steps = self.value_norm_steps(
            values, o_weight, num_heads, scores, counts, split, count_bound, group_split
        )
        return read_through(steps)

    def value_norm_steps(
        self, values: torch.Tensor, o_weight: torch.Tensor, num_heads: int, scores: torch.Tensor,
        counts: torch.Tensor, split=None, count_bound: int | None = None, group_split=None,
    ) -> Generator[torch.Tensor, int, torch.Tensor]:  # fmt: skip
        """:func:`projected_value_norms` (B, H_kv, S) on every entry ``select`` with at most ``counts``
        (B, H_kv) per head can keep, and 0 on the others, which it then never keeps: the same kept
        set at a fraction of the cost.

        values: (B, H_kv, S, d), the layer's whole prompt; scores: (B, H_kv, S) as ``select`` reads
        them. With ``b`` prefix entries to keep in a head: exact norms first for the entries that
        can be in stage 1 (the top ``b`` by score) and the ``2b`` most promising by a cheap estimate
        of the stage-2 weight ``(score + eps) * norm``; ``T``, the ``b``-th largest exact weight
        among them, is at most the ``b``-th largest of all. An entry whose upper bound
        (:func:`projected_value_norm_bounds`) is below ``T`` loses to at least ``b - b1`` others in
        stage 2 (``b1 <= b`` are in stage 1, with any ``first``), so it is never kept; the others
        get their exact norm too. A cascade's later stages keep fewer of the entries kept here, whose
        norms are exact. ``value_norm="heads"``: :meth:`_shared_value_norm_steps`; one KV head (multi-query,
        latent) makes every share 1, nothing to compute; under tensor parallelism (``split``) a
        position's total spans every rank's heads, whose candidates differ: every norm computed. A
        latent layer's query group split (``group_split``): this rank's query heads, averaged over ranks.

        ``count_bound``: at least the largest of ``counts``, known on the host (the cascade's
        counts are), so the candidates' sizes need no read of the device; None reads it. On a GPU
        each read drains the queue: with the bound, the reads left are the candidate sets' sizes
        (one here, up to three for ``"heads"``), which this generator yields as device tensors to
        be read at once (:meth:`value_norms`) or a layer later (``kvcake.pending_norms``)."""
        if self.value_norm == "heads" and split is None and values.shape[1] == 1:
            return (values != 0).any(-1).float()  # one KV head: n / n, a share of 1 (0 where v is 0)
        pool = partial(group_mean, group_split)  # the same candidates on every rank
        if self.value_norm == "heads" and (split is not None or group_split is not None):
            return pool(projected_value_norms(values, o_weight, num_heads))
        prefix_ok = torch.isfinite(scores)
        b_pref = (counts - (scores == float("inf")).sum(-1)).clamp(min=0)  # (B, H_kv)
        kmax = _prefix_bound(b_pref, count_bound)
        if kmax == 0:
            return torch.zeros(scores.shape, dtype=torch.float32, device=scores.device)
        if 4 * kmax >= scores.shape[-1]:  # most entries are candidates anyway: compute them all
            return pool(projected_value_norms(values, o_weight, num_heads))
        if self.value_norm == "heads":
            return (
                yield from self._shared_value_norm_steps(values, o_weight, num_heads, scores, b_pref, kmax)
            )
        low, high = (pool(t) for t in projected_value_norm_bounds(values, o_weight, num_heads))
        weight = torch.where(prefix_ok, scores.clamp(min=0) + self.eps, torch.zeros_like(scores))
        ninf = torch.full_like(weight, float("-inf"))
        by_score = ranks_desc(torch.where(prefix_ok, scores, ninf))
        by_estimate = ranks_desc(torch.where(prefix_ok, weight * low, ninf))
        first = prefix_ok & ((by_score < b_pref[..., None]) | (by_estimate < 2 * b_pref[..., None]))
        norms = pool(_norms_where(values, o_weight, num_heads, first, m=3 * kmax))  # b + 2b at most a head
        threshold = _threshold(torch.where(first, weight * norms, ninf), b_pref, kmax)
        second = prefix_ok & ~first & (weight * high * (1 + 1e-4) >= threshold)
        if m := (yield from _widest(second)):
            norms = norms + pool(_norms_where(values, o_weight, num_heads, second, m))
        return norms

    def _shared_value_norm_steps(
        self, values: torch.Tensor, o_weight: torch.Tensor, num_heads: int, scores: torch.Tensor,
        b_pref: torch.Tensor, kmax: int,
    ) -> Generator[torch.Tensor, int, torch.Tensor]:  # fmt: skip
        """``value_norm_steps`` for ``value_norm="heads"``: the stage-2 weight is ``(score + eps) * n_h /
        sum_h' n_h'``, the sum over the layer's KV heads at the same position, so every norm at a
        position is computed at once (its sum is then exact) and the share is at most 1.

        With ``b`` prefix entries to keep in a head: exact norms at the positions of every head's
        top ``2b`` by score (every norm at once where they cover ``_ALL_NORMS_SHARE`` of the prompt
        or more); ``T``, the ``b``-th largest exact weight of each head among them, is
        at most the ``b``-th largest of all. An entry with ``score + eps < T`` is never kept (its
        share is at most 1); at the positions of the others, bounds of the share,
        ``n_h / sum <= high_h / (high_h + sum_{h' != h} low_h')``
        (:func:`projected_value_norm_bounds`, its sign vectors from each head's top entries), rule
        out most, and the rest get their exact norms. Entries left at 0 lose to at least ``b - b1``
        others in stage 2 (``b1 <= b`` in stage 1), as in ``value_norm_steps``."""
        prefix_ok, n = torch.isfinite(scores), scores.shape[-1]
        ninf = torch.full_like(scores, float("-inf"))
        prefix = torch.where(prefix_ok, scores, ninf)
        weight = torch.where(prefix_ok, scores.clamp(min=0) + self.eps, torch.zeros_like(scores))
        near_top = (ranks_desc(prefix) < 2 * b_pref[..., None]).any(1, keepdim=True)  # (B, 1, S)
        first = prefix_ok & near_top
        m_first = yield from _widest(first)  # the heads' union is often far below 2b x heads
        if m_first >= _ALL_NORMS_SHARE * n:
            return projected_value_norms(values, o_weight, num_heads)
        norms = _norms_where(values, o_weight, num_heads, first, m_first)
        threshold = _threshold(torch.where(first, weight * self.prepare_norms(norms), ninf), b_pref, kmax)
        maybe = prefix_ok & ~first & (weight * (1 + 1e-4) >= threshold)  # a share is at most 1
        maybe = prefix_ok & ~first & maybe.any(1, keepdim=True)  # every head at those positions
        if not (m_maybe := (yield from _widest(maybe))):
            return norms
        best = prefix.topk(min(_SIGN_SOURCES, n), dim=-1).indices  # (B, H_kv, K): each head's top entries
        sign_values = values.gather(
            2, best[..., None].expand(*best.shape, values.shape[-1])
        )  # (B, H_kv, K, d)
        low, high = _on_masked(
            values, maybe, lambda v: projected_value_norm_bounds(v, o_weight, num_heads, sign_values), m_maybe
        )
        others = (low.sum(1, keepdim=True) - low).clamp(min=0) * (1 - 1e-3)  # float slack: 0.1% off
        share = (high / (high + others).clamp(min=1e-30)).clamp(max=1.0)  # (B, H_kv, S) upper bound
        second = maybe & (weight * share * (1 + 1e-4) >= threshold)
        second = maybe & second.any(1, keepdim=True)
        if m := (yield from _widest(second)):
            norms = norms + _norms_where(values, o_weight, num_heads, second, m)
        return norms

    def _weight(self, scores: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """Stage 2's weight of each prefix entry, ``(score + eps) * norm`` (what ``select`` and
        ``rank_order`` both rank by)."""
        return (scores.clamp(min=0) + self.eps) * norms

    def rank_order(self, inp: SelectionInputs, keep: torch.Tensor) -> torch.Tensor | None:
        """``first="marked"``: the window, then the marked entries by score, then the others by
        ``(score + eps) * norm``, each descending with ties to the earlier position. With ``c``
        per head ``select`` keeps the window, the top ``c - window`` marked ones by score if there
        are more, else all marked ones and the best others by weight: the first ``c`` of this
        order. ``first="ratio"`` or ``"kvpress"`` (None): stage 1's size changes with ``c``, so
        the kept sets at smaller counts are not nested."""
        if self.first != "marked" or inp.value_norms is None:
            return None
        scores = inp.scores
        window, prefix_ok = scores == float("inf"), torch.isfinite(scores)
        marked = prefix_ok & (scores >= MARK)
        order = order_by(torch.where(window | marked, scores, self._weight(scores, inp.value_norms)), keep)
        rank = (keep.long() * 4 + window.long() * 2 + marked.long()).gather(-1, order)  # kept, window, marked
        return order.gather(-1, torch.argsort(rank, dim=-1, descending=True, stable=True))

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
        elif self.first == "kvpress":  # the window's entries count in stage 1's share of the whole
            first = (torch.floor(inp.counts.double() * self.alpha).long() - window.sum(-1)).clamp(min=0)
            if inp.pinned is not None:  # and the allocator's pinned entries, each head's top by score
                first = torch.maximum(first, torch.minimum(inp.pinned[:, None], prefix_counts))
        else:
            first = torch.floor(prefix_counts.double() * self.alpha).long()
        stage1 = (ranks_desc(prefix) < first[..., None]) & prefix_ok
        weighted = self._weight(prefix, inp.value_norms)
        weighted = torch.where(prefix_ok & ~stage1, weighted, torch.full_like(weighted, float("-inf")))
        stage2 = (ranks_desc(weighted) < (prefix_counts - first)[..., None]) & prefix_ok & ~stage1
        return window | stage1 | stage2
