"""CriticalKV's value norms of a layer's first eviction, with their host read a layer later.

``Critical.value_norm_steps`` computes the norms on the entries its selection can keep; the size
of each candidate set is a device value the host must read to gather it (one read a layer for
``criticalkv``, up to three for DefensiveKV's head-normalised norms). On a GPU each read made at
once drains the queue: the host waits for the device, then the device waits for the host to
queue the next work. :func:`begin` instead copies the first size behind the layer's work
(``devices.HostRead``) and leaves the layer's eviction pending (:class:`PendingNorms`);
:func:`resume` runs it at the start of the next layer's update or stage, when the device has got
there and has the next layer's work queued. The same norms, the same eviction, one layer later.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .devices import HostRead, cpu_route, read_through
from .selectors import projected_value_norms
from .tensor_parallel import group_mean

# False reads every size at once (the reference; tests compare). The last stage always does.
DEFERRED = True
# False computes every entry's value norm (the reference path; tests compare the two).
PRUNED = True


@dataclass
class PendingNorms:
    """Layer ``layer_idx``'s first eviction at stage ``stage``, waiting for the size its norms'
    generator ``steps`` asked for (``read``); ``counts``: the stage's head counts of the layer
    (``cache.stage_counts``' entry) for a head-wise allocator, else None."""

    layer_idx: int
    stage: int
    budget: torch.Tensor
    steps: Generator
    read: HostRead
    counts: tuple | None


@torch.no_grad()  # scores: the kept entries alone carry gradients (tests/test_torch_modes.py)
def norm_steps(
    selector, values, o_weight, num_heads, scores, counts, split=None, count_bound=None, group_split=None
) -> Generator[torch.Tensor, int, torch.Tensor]:
    """CriticalKV's value norms (B, H_kv, S) of a layer's whole prompt, for its first eviction, as
    a generator of the reads it needs (``Critical.value_norm_steps``): only on the entries the
    selector can keep with ``counts`` when it says which, else on all (the reference, no read).

    ``group_split``: a latent layer whose query heads (``num_heads`` of them in all) the ranks
    share; ``o_weight`` holds this rank's. Every norm (and the pruned path's bounds) is taken over
    this rank's heads and the ranks' means are averaged (``HeadSplit.pool``)."""
    if group_split is not None:
        num_heads //= group_split.world
    if o_weight.shape[-1] != num_heads * values.shape[-1]:  # (hidden, H * d_v)
        raise ValueError(
            f"the attention's output projection takes {o_weight.shape[-1]} features, not the "
            f"{num_heads} query heads x {values.shape[-1]} dims this KVCakeCache expects of its model: "
            "a cache serves the model it was made for, so make it with the model that runs it, KVCakeCache(model, ...)"
        )
    if PRUNED and hasattr(selector, "value_norm_steps"):
        return (
            yield from selector.value_norm_steps(
                values, o_weight, num_heads, scores, counts, split, count_bound, group_split
            )
        )
    norms = projected_value_norms(values, o_weight, num_heads)
    return group_mean(group_split, norms)


def begin(
    cache: Cache, layer_idx: int, budget: torch.Tensor, steps: Generator, counts
) -> torch.Tensor | None:
    """The norms of ``steps`` if they need no read, or are read now; else None, the layer's
    eviction left pending in ``cache.pending_norms`` with the first size on its way to the host.

    Left pending only on a device that runs ahead of the host (not a CPU: ``devices.cpu_route``),
    for the stage's own layer, in a stage run as that layer is scored (``PendingStage.now``), not
    the last. The next layer's update then evicts it before it appends, as a stage left for that
    update would: the layer's whole prompt is held while the next layer's keys and values are
    computed (the prefill peak counts both: ``cascade.run_stage``). A stage that waits for that
    update itself (CAKE's, Ada-KV's on the host, the global allocator's) reads at once: pending
    further, two full layers would be held."""
    stage = cache._stage
    later = cache._slot[stage] < len(cache.compressed) - 1
    ahead = not cpu_route(cache.layers[layer_idx].keys.device)
    if not (
        DEFERRED
        and ahead
        and cache.stage_at_scoring
        and later
        and layer_idx == stage
        and cache.pending_norms is None
    ):
        return read_through(steps)
    try:
        ask = next(steps)
    except StopIteration as done:
        return done.value
    cache.pending_norms = PendingNorms(layer_idx, stage, budget, steps, HostRead(ask), counts)
    return None


def resume(cache: Cache) -> None:
    """The pending eviction, if any (:func:`begin`): the sizes read (the first waited for, any
    later one at once), the norms kept with the layer, the layer evicted as at its stage."""
    pending, cache.pending_norms = cache.pending_norms, None
    if pending is None:
        return
    norms = read_through(pending.steps, int(pending.read.wait().numpy()))  # the host copy
    cache.layers[pending.layer_idx].norms = cache.method.selector.prepare_norms(norms, cache.split)
    if pending.counts is not None:
        cache.stage_counts[pending.layer_idx] = pending.counts
    stage, cache._stage = cache._stage, pending.stage
    try:
        cache._evict_layer(pending.layer_idx, pending.budget)
    finally:
        cache._stage = stage
