"""Top-k selection: keep each head's highest-scoring entries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..allocators.adakv import ranks_desc
from ..ragged import kept_indices


@dataclass
class SelectionInputs:
    """scores: (B, H_kv, N) with window +inf and empty/padding -inf; counts: (B, H_kv) int64
    entries to keep per head (window included); value_norms: (B, H_kv, N) or None (CriticalKV);
    pinned: (B,) int64 or None, the prefix entries the head allocator pinned in each head (its top
    by score: Ada-KV's safeguard, ``HeadAllocator.pinned``), given where the selector keeps them."""

    scores: torch.Tensor
    counts: torch.Tensor
    value_norms: torch.Tensor | None = None
    pinned: torch.Tensor | None = None


class Selector:
    name = "topk"
    needs_value_norms = False
    # Whether the kept entries always include each head's highest-scoring ones. When they do not
    # (CriticalKV), score-based head counts (Ada-KV) read off the kept entries differ from those
    # of all entries, so a cascade must count on the prompt's full scores (head_counts.py).
    keeps_top_scores = True
    needs_marks = False  # whether the scorer must mark a first stage (DefensiveScorer)
    keeps_pinned = False  # whether select takes the head allocator's pinned entries (SelectionInputs.pinned)
    # Whether the kept set is each head's ``counts`` highest scores, ties to the earlier position:
    # then a head allocator's own kept set (Ada-KV's) is the selection, and a cascade counting on
    # the device takes it instead of selecting again (head_counts._kept_together).
    top_counts = False

    def prepare_norms(self, norms: torch.Tensor, split=None) -> torch.Tensor:
        """The value weights to keep with a layer, from its full prompt's norms (B, H_kv, S);
        ``split``: the tensor-parallel head split, if any."""
        return norms

    def select(self, inp: SelectionInputs) -> torch.Tensor:  # pragma: no cover - interface
        """(B, H_kv, N) bool: the kept entries, exactly ``counts`` per head (fewer if a head
        has fewer valid entries)."""
        raise NotImplementedError

    def select_indices(
        self, scores: torch.Tensor, size: int, value_norms: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, H_kv, size) int64: the positions of the kept entries in order when every head
        keeps ``size`` (each holding at least that many valid entries): the indices a dense layer
        gathers by. What :meth:`select`'s mask holds; a selector may find them without it."""
        counts = torch.full(scores.shape[:2], size, dtype=torch.long, device=scores.device)
        return kept_indices(self.select(SelectionInputs(scores, counts, value_norms)), size)

    def rank_order(self, inp: SelectionInputs, keep: torch.Tensor) -> torch.Tensor | None:
        """(B, H_kv, N) int64: each head's entries in an order whose first ``c`` are what
        :meth:`select` keeps of the ``keep`` (B, H_kv, N) entries with ``c`` per head, for every
        ``c`` up to ``keep``'s count (the kept ones first, the rest after them); None where no
        order does (the kept sets at smaller counts are not nested). A cascade keeps a ragged
        layer so between its stages and evicts it by keeping each head's first entries."""
        return None

    def describe(self) -> str:
        return self.name


def order_by(key: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(B, H_kv, N) each head's kept entries by ``key`` descending, ties to the earlier position,
    then the others: a stable sort (``ranks_desc``'s rule) with the dropped entries last."""
    return torch.argsort(torch.where(keep, key, float("-inf")), dim=-1, descending=True, stable=True)


@dataclass(frozen=True)
class TopK(Selector):
    """The ``count`` highest scores of each head; ties go to the earlier position."""

    name = "topk"
    top_counts = True

    def select(self, inp: SelectionInputs) -> torch.Tensor:
        return (ranks_desc(inp.scores) < inp.counts[..., None]) & (inp.scores > float("-inf"))

    def select_indices(
        self, scores: torch.Tensor, size: int, value_norms: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The first ``size`` of each head's descending order (stable: ties to the earlier
        position, as :func:`ranks_desc`), in position order: three ops where the mask and its
        indices take about twenty (a cascade re-evicts every layer seen at every stage, and on
        a GPU each op is a launch)."""
        return self.ranked_indices(scores, size).sort(dim=-1).values

    def rank_order(self, inp: SelectionInputs, keep: torch.Tensor) -> torch.Tensor:
        """Descending scores: the top ``c`` of the top ``n`` are their first ``c``. ``keep`` holds
        each head's highest scores, ties to the earlier position (this selector's or Ada-KV's)."""
        return order_by(inp.scores, keep)

    def ranked_indices(self, scores: torch.Tensor, size: int) -> torch.Tensor:
        """The first ``size`` of each head's descending order, in that order: a layer stored so
        keeps its top ``n <= size`` as its first ``n`` (a cascade's later stages, ``KVCakeLayer.ranked``)."""
        return torch.argsort(scores, dim=-1, descending=True, stable=True)[..., :size]
