"""Tensor-parallel models: which KV heads this process holds, and the few collectives kvcake needs.

Under tensor parallelism (``from_pretrained(folder, tp_plan="auto")`` under ``torchrun``) each
rank holds ``H_kv / world`` KV heads of every layer, a contiguous block: rank ``r`` holds global
heads ``r * H_local .. (r + 1) * H_local - 1``. Everything kvcake does per head (scoring,
selection, decode-time eviction) needs nothing from the other ranks. Two decisions are made over
all heads of a layer and must see every rank's heads to equal the one-process method:

- CAKE's layer preference sums the dispersion and shift over heads: each rank sums its own heads
  and the ranks exchange the partial sums (2 numbers per sequence and layer);
- TOVA's score is the mean over all heads of a layer: the ranks average their means (``B x S``
  numbers per layer at prefill, ``B x N`` per layer and decoding step);
- Ada-KV ranks the prefix scores of all heads of a layer: each rank sends its own best ``k``
  scores (``k`` = the layer's contested budget, at most its entries) with their global indices,
  and every rank finds the same threshold (:func:`kth_over_ranks`).

A latent-attention layer (MLA, ``kvcake.latent``) has one KV head whose latents every rank holds
whole; a plan that splits its query heads (transformers 5.25's for DeepSeek-V3) splits the group
instead (``group_split``). Every score and statistic pooled over the group's query heads is then
pooled over the ranks as well (:meth:`HeadSplit.pool`), so every rank scores and evicts alike.

Every exchange is an all-gather, summed or merged in rank order on every rank, so every rank
derives bit-identical budgets. The split is read from the model (``kvcake.head_shards.find_splits``):
transformers shards the attention projections as ``DTensor``s on its device mesh, whose ``"tp"``
dimension is the group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadSplit:
    """This process's share of a tensor-parallel model's heads.

    group: the ``torch.distributed`` process group of the tensor-parallel ranks.
    rank: this process's rank in ``group``; world: the group's size (> 1).
    """

    group: object
    rank: int
    world: int

    def __post_init__(self) -> None:
        if not (self.world > 1 and 0 <= self.rank < self.world):
            raise ValueError(
                f"a head split needs world > 1 and 0 <= rank < world, got {self.rank}/{self.world}"
            )

    def __deepcopy__(self, memo) -> HeadSplit:  # a handle on the group: a forked cache shares it
        return self

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """All-gather: (world, *t.shape), rank order, the same tensor on every rank."""
        import torch.distributed as dist

        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.stack(parts)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, added in rank order on every rank (so bit-identical everywhere)."""
        return self.gather(t).sum(0)

    def pool(self, t: torch.Tensor, how: str) -> torch.Tensor:
        """The ranks' ``t`` pooled, the same on every rank: their mean (``how="mean"``) or maximum
        (``"max"``). A latent layer's query group split over ranks (``group_split``): each rank's
        scores pool its share of the group, and as every rank holds as many heads, the ranks' mean of
        means is the group's mean and their maximum of maxima its maximum."""
        if how not in ("mean", "max"):
            raise ValueError(f"pooling over ranks must be 'mean' or 'max', got {how!r}")
        every = self.gather(t)  # (world, *t.shape)
        return every.mean(0) if how == "mean" else every.amax(0)

    def head_mean(self, t: torch.Tensor) -> torch.Tensor:
        """Layer-wide scores (B, H_local, N), equal over this rank's heads (each its heads' mean):
        the mean over every rank's heads, bit-identical on every rank. Every rank holds as many
        heads, so the mean of the ranks' means is the mean over all heads; one head's row is sent."""
        return self.gather(t[:, :1]).mean(0).expand_as(t).clone()


def group_mean(group_split: HeadSplit | None, t: torch.Tensor) -> torch.Tensor:
    """``t`` averaged over the ranks that share a latent layer's query group (:meth:`HeadSplit.pool`),
    or ``t`` itself where no plan splits the group (``group_split`` None)."""
    return t if group_split is None else group_split.pool(t, "mean")


def local_weight(weight: torch.Tensor, whole: bool = False) -> torch.Tensor:
    """This rank's shard of a weight (a plain tensor stays as it is); ``whole``: the whole matrix,
    gathered from every rank's shard (``full_tensor``, a collective every rank runs at the same
    point), for a layer whose heads every rank holds while the plan shards the weight (OLMo 2's
    output projection, its keys gathered: ``head_shards.find_splits``)."""
    if not torch.distributed.is_available():  # a torch built without distributed has no shards
        return weight
    from torch.distributed.tensor import DTensor  # here: importing it costs most of a second

    # isinstance, not getattr(weight, "to_local"): torch.compile traces the former only
    if not isinstance(weight, DTensor):
        return weight
    return weight.full_tensor() if whole else weight.to_local()


SLOTS = 1 << 32
"""Global index of an entry: ``global_head * SLOTS + slot``, so entries order by head, then by
slot, like a sort over all heads of one process, whatever width each rank's padded view has."""


def local_top(scores: torch.Tensor, k: int, first_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best entries of each row, in rank order (score descending, index ascending).

    scores: (B, h, N) float, this rank's heads; first_head: the global index of its first head.
    Returns (B, k) values and (B, k) int64 global indices; rows with fewer than ``k`` entries
    are filled with ``-inf`` at indices past every real one."""
    b, h, n = scores.shape
    flat = scores.reshape(b, h * n)  # (B, h * N)
    order = torch.argsort(flat, dim=1, descending=True, stable=True)[:, :k]  # (B, min(k, h * N))
    heads, slots = order // n + first_head, order % n
    vals, idx = flat.gather(1, order), heads * SLOTS + slots
    short = k - order.shape[1]
    if short > 0:
        vals = torch.cat([vals, vals.new_full((b, short), float("-inf"))], 1)
        past = torch.arange(short, device=idx.device) + (1 << 62)  # after every real index
        idx = torch.cat([idx, past.expand(b, short)], 1)
    return vals, idx


def kth_over_ranks(
    values: torch.Tensor, index: torch.Tensor, n: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n``-th best entry (1-based) of the merged candidates, as (value, global index).

    values, index: (B, M) every rank's :func:`local_top`, concatenated; n: (B,) int64 >= 1
    (clamped to ``M``). Order: value descending, ties by global index ascending, the order
    of a stable descending sort over all heads at once. Returns two (B, 1) tensors."""
    by_index = torch.argsort(index, dim=1)  # indices are distinct
    v, i = values.gather(1, by_index), index.gather(1, by_index)
    by_value = torch.argsort(v, dim=1, descending=True, stable=True)
    v, i = v.gather(1, by_value), i.gather(1, by_value)
    pos = (n - 1).clamp(min=0, max=values.shape[1] - 1)[:, None]  # (B, 1)
    return v.gather(1, pos), i.gather(1, pos)


def top_over_ranks(scores: torch.Tensor, fill: torch.Tensor, split: HeadSplit) -> torch.Tensor:
    """This rank's entries among the ``fill`` best of every rank's heads.

    scores: (B, h, N) this rank's heads (``h`` equal on every rank, ``N`` may differ: padded
    views of evicted layers); fill: (B,) int64, the same on every rank. Returns (B, h, N) bool,
    equal to this rank's part of ``ranks_desc`` over all heads flattened (head-major) ``< fill``."""
    b, h, n = scores.shape
    # each rank sends k candidates, the same k everywhere: the top-fill holds at most fill
    # entries of one rank, and at most as many as the largest rank holds
    widest = int(split.gather(torch.tensor([h * n], device=scores.device)).max())
    k = min(int(fill.max()), widest)
    if k <= 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    first = split.rank * h
    vals, idx = local_top(scores, k, first)
    all_vals = split.gather(vals).permute(1, 0, 2).reshape(b, split.world * k)  # (B, world * k)
    all_idx = split.gather(idx).permute(1, 0, 2).reshape(b, split.world * k)
    tv, ti = kth_over_ranks(all_vals, all_idx, fill)  # (B, 1) each
    mine = (torch.arange(h, device=scores.device)[:, None] + first) * SLOTS + torch.arange(
        n, device=scores.device
    )
    won = (scores > tv[:, :, None]) | ((scores == tv[:, :, None]) & (mine[None] <= ti[:, :, None]))
    return won & (fill > 0)[:, None, None]
