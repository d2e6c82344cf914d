"""Layer-DefensiveKV's global allocation: the layers' budgets from one ranking of every layer's
scores. Feng et al., "DefensiveKV: Taming the Fragility of KV Cache Eviction in LLM
Inference", ICLR 2026; the authors' code is https://github.com/FFY0/DefensiveKV
(``kvpress/presses/efficient_ada_global_scorer_press.py``, used by
``efficient_layer_defensivekv_press.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .adakv import top_ranked
from .base import AllocationRequest, LayerAllocator, round_exact, round_up


@dataclass(frozen=True)
class GlobalAllocator(LayerAllocator):
    """Ada-KV's top-B taken over all heads of all layers at once.

    The prefix pool ``H_kv * (B_total - n * Sw)`` (every layer keeps its window) goes to the
    highest prefix scores of the ``n`` layers seen so far, compared across layers as they are
    (the scorer's scale is shared: attention probabilities). Layer ``l`` gets
    ``Sw + c_l / H_kv`` entries per KV head, where ``c_l`` is how many of its entries won,
    rounded to integers that sum exactly to the total (Ada-KV then splits the layer's budget
    among its heads). The authors' code ranks once after the last layer, holding every
    layer's full cache; with ``cascading=True`` (default) the cache re-ranks after each layer
    and evicts at once (CAKE's cascade), which gives the same budgets at the end because a
    layer's winners only shrink as layers and competitors arrive and the pool shrinks.
    The authors also rank other scores (``efficient_layer_defensivekv_press.py``): each
    entry's defensive score times its value norm's share among the layer's heads, with the
    first stage's entries and the window at their layer's highest such score, and the window
    in the ranking (a layer whose highest score is low can lose window entries). Here the
    ranking is of the scorer's scores (DefensiveKV's plus ``MARK`` on the first stage's, above
    every unmarked entry of every layer), each layer's window kept outside it; value norms
    weigh the entries within each head afterwards (CriticalKV's selector).

    Reads ``req.layer_scores``: the full prompt's (B, H_kv, S) scores of each layer seen so
    far, window +inf, padding -inf, on the model's device(s).

    Parameters
    ----------
    cascading:
        Re-rank after every layer's prefill (bounded memory: the total budget plus one layer);
        ``False`` ranks once after the last layer (the authors' code).
    """

    cascading: bool = True
    name = "global"
    needs_scores = True

    def __post_init__(self) -> None:
        if not isinstance(self.cascading, bool):
            raise ValueError(f"global allocation cascading must be true or false, got {self.cascading!r}")

    def allocate(self, req: AllocationRequest) -> torch.Tensor:
        won = req.winners if req.winners is not None else self.count_winners(req).cpu()  # host: (B, n)
        x = req.window.double()[:, None] + won
        x = torch.minimum(x, req.cap.double()[:, None])
        return round_exact(x, req.cap, req.total) if req.final else round_up(x, req.cap)

    def count_winners(self, req: AllocationRequest) -> torch.Tensor:
        """(B, n) float64 on the scores' device: the prefix entries per KV head each layer seen so
        far wins in the ranking (its count over every rank's ``H_kv``), the device's part of
        :meth:`allocate`, which the cache may run ahead of the stage and read without a drain
        (``AllocationRequest.winners``). Updates ``req.carry`` (once per stage)."""
        if not req.layer_scores:
            raise ValueError("the global allocator needs the layers' scores (AllocationRequest.layer_scores)")
        dev = req.layer_scores[0].device
        b, h, s = req.layer_scores[0].shape
        n = len(req.layer_scores)
        world = 1 if req.split is None else req.split.world
        hkv = h * world  # every rank's KV heads
        pool_host = (hkv * (req.total - n * req.window)).clamp(min=0)  # (B,) prefix entries to keep
        pool, kmax = pool_host.to(dev), int(pool_host.numpy().max())  # the host's: no read of the device
        carry = req.carry if req.split is None else None
        if carry and carry["layers"] == n - 1:  # the last stage's winners and this layer's entries
            new = req.layer_scores[-1].to(dev).reshape(b, h * s)
            flat = torch.cat([carry["scores"], new], dim=1)  # (B, K + h*S), in the order of all
            layer = torch.cat([carry["layer"], torch.full_like(new, n - 1, dtype=torch.long)], dim=1)
        else:
            flat = torch.cat([t.to(dev).reshape(b, -1) for t in req.layer_scores], dim=1)  # (B, n*h*S)
            layer = torch.arange(n, device=dev).repeat_interleave(h * s).expand(b, -1)
        finite = torch.isfinite(flat)
        prefix = torch.where(finite, flat, torch.full_like(flat, float("-inf")))
        if req.split is None:  # ranks_desc(prefix) < pool, without the sort
            won = top_ranked(prefix, pool, kmax) & finite
        else:
            won = _won_over_ranks(prefix, pool, req.split, h, s) & finite
        counts = torch.zeros(b, n, dtype=torch.long, device=dev).scatter_add_(1, layer, won.long())
        if req.split is not None:
            counts = req.split.sum(counts)  # every rank's winners per layer
        if carry is not None:  # at most every entry wins (a budget past the prompt: all of them)
            _keep_winners(carry, n, prefix, layer, won, min(kmax, flat.shape[1]))
        return counts.double() / hkv


def _keep_winners(carry: dict, n: int, prefix, layer, won, k: int) -> None:
    """A cascade's next stage ranks this stage's winners and its new layer's entries only: the
    pool shrinks as layers arrive, so an entry that loses now never wins again (ties break by
    the order of all entries, which the winners keep). Stored as (B, k) scores (-inf past a
    sequence's winners) and layer indices, ``k`` the largest pool."""
    slot = torch.where(won, won.long().cumsum(1) - 1, torch.full_like(layer, k))  # losers: a spare slot
    b = prefix.shape[0]
    scores = torch.full((b, k + 1), float("-inf"), device=prefix.device).scatter_(1, slot, prefix)
    owner = torch.zeros((b, k + 1), dtype=torch.long, device=prefix.device).scatter_(1, slot, layer)
    carry.update(layers=n, scores=scores[:, :k], layer=owner[:, :k])


def _won_over_ranks(prefix: torch.Tensor, pool: torch.Tensor, split, h: int, s: int) -> torch.Tensor:
    """This rank's part of ``ranks_desc(all ranks' prefix scores) < pool``, one process's order.

    prefix: (B, n*h*S) this rank's scores, layer-major then head then slot, as one process
    flattens (B, n*H*S) with ``H = h * world``; every rank sends its best ``min(max pool, n*h*S)``
    candidates with their index in that flattening, and the ``pool``-th of the merged candidates
    (value descending, index ascending) is the threshold."""
    from kvcake.tensor_parallel import kth_over_ranks

    b, m = prefix.shape
    k = min(int(pool.max()), m)  # the same on every rank: pool and m are
    if k <= 0:
        return torch.zeros_like(prefix, dtype=torch.bool)

    def global_index(local: torch.Tensor) -> torch.Tensor:  # local flat index -> one process's
        layer, rest = local // (h * s), local % (h * s)
        return (layer * (h * split.world) + split.rank * h) * s + rest

    order = torch.argsort(prefix, dim=1, descending=True, stable=True)[:, :k]  # (B, k)
    vals, idx = prefix.gather(1, order), global_index(order)
    all_vals = split.gather(vals).permute(1, 0, 2).reshape(b, split.world * k)
    all_idx = split.gather(idx).permute(1, 0, 2).reshape(b, split.world * k)
    tv, ti = kth_over_ranks(all_vals, all_idx, pool)  # (B, 1) each
    mine = global_index(torch.arange(m, device=prefix.device))[None, :]
    return ((prefix > tv) | ((prefix == tv) & (mine <= ti))) & (pool[:, None] > 0)
