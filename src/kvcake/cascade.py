"""The prefill side of ``KVCakeCache``: one cascade stage per compressed layer.

After the kvcake attention function has run layer ``l``'s attention on its full prompt, the
cache calls :func:`prefill_stage`, which

1. scores the layer's tokens with the method's scorer (and, for CriticalKV selection, the
   norms of its values through the output projection);
2. for allocators that need them (CAKE), measures the layer's dispersion and shift and turns
   them into a preference with the temperatures in force;
3. re-allocates the budgets of the layers seen so far (cascade) or, for fixed allocators, takes
   this layer's column of budgets fixed once, and evicts each touched layer to its budget
   (:func:`run_stage`: at once, or CAKE's and Ada-KV's at the next layer's update, see
   ``PendingStage``);
4. after the last compressed layer, fixes the decoding budgets (:func:`finish_prefill`).

The functions read and write the cache's own state (``seq``, ``budgets``, ``preferences``, ...);
the cache calls them and keeps ``_evict_layer`` as its method, so a subclass can time it.
``cache`` is always a ``KVCakeCache`` (typed by its base: this module sits below ``cache.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import Cache

from . import pending_norms
from .adapters import output_projection
from .allocators import AllocationRequest, preference
from .cake_tau import choose_temperatures, temperatures
from .decoding import with_window_sums
from .devices import HostRead, cpu_route
from .fp8 import encode_layer
from .head_counts import dense_counts, hold_prompt_scores, pinned_on, stage_head_counts
from .latent import output_weight, query_over
from .logit_terms import PLAIN, LogitTerms
from .ragged import position_rows, to_device
from .scorers import PrefillInputs
from .selectors import SelectionInputs
from .tensor_parallel import local_weight

logger = logging.getLogger(__name__)


@dataclass
class SequenceBudgets:
    """Per-sequence budget facts fixed at the start of prefill. All (B,) int64 on the host
    side of the device (small)."""

    lengths: torch.Tensor  # valid prompt tokens
    per_layer: torch.Tensor  # average budget per layer
    total: torch.Tensor  # B_total = per_layer * L_g (compressed layers)
    window: torch.Tensor  # protected window, min(Sw, length)
    tau1: torch.Tensor | None = None  # CAKE's temperatures, each row's own, float64 (cake_tau.py)
    tau2: torch.Tensor | None = None


def prefill_stage(
    cache: Cache,
    layer_idx: int,
    module: torch.nn.Module,
    query: torch.Tensor,
    key_valid: torch.Tensor,
    scaling: float,
    column_sums: torch.Tensor | None = None,
    terms: LogitTerms = PLAIN,
) -> None:
    """Score layer ``layer_idx``'s prompt and run this cascade stage's evictions.

    query: (B, H, S, d) post-RoPE; key_valid: (B, S) bool (False on left padding); column_sums:
    what :func:`prompt_attention` returned beside the attention's output, else None; terms: the
    soft cap and sinks the model's attention call was given (``kvcake.logit_terms``)."""
    cache._run_stage()  # the previous layer's, if no update ran it (a caller that skips update)
    layer = cache.layers[layer_idx]
    cache._stage = layer_idx
    g = cache._slot[layer_idx]  # budget column of this layer
    if g == 0:
        _begin(cache, key_valid)  # may set a calibrated indicator: read the method after it
    m = cache.method
    if g == 0 and cache.progress:
        from tqdm.auto import tqdm

        cache._bar = tqdm(total=len(cache.compressed), desc=f"prefill {query.shape[2]} tokens", unit="layer")
    with torch.no_grad():  # scores and statistics: only the kept entries carry gradients
        query = query_over(layer, module, query)  # latent attention (MLA): absorbed, over [c; k_rot]
        keys, values = layer.operands()
        inputs = PrefillInputs(
            query=query, keys=keys, values=values, key_valid=key_valid,
            window=m.budget.window, scaling=scaling, column_sums=column_sums, terms=terms, split=cache.split,
            group_split=cache.group_split,
        )  # fmt: skip
        memo = cache.score_memo  # a replay reuses scores across budgets (kvcake.replay.ScoreMemo)
        sums = m.scorer.prefill_sums(inputs) if memo is None else memo.scores(m.scorer, inputs)
        layer.scores, layer.window_sums = sums  # (B, H_kv, S), H2O's (B, H_kv, w)
        if m.scorer.layer_wide and cache.split is not None:  # TOVA: the mean over every rank's heads
            layer.scores = cache.split.head_mean(layer.scores)
        on_host = hold_prompt_scores(cache, layer_idx, layer.scores)  # head_counts.py
        if m.selector.needs_value_norms:  # computed at the layer's first eviction, where its counts are known
            whole = cache.split is None and cache.group_split is None  # every head here: W_O whole
            # tensor parallelism: the W_O columns of the heads this rank holds
            weight = local_weight(output_projection(module, values), whole)
            cache.o_weights[layer_idx] = output_weight(module, weight) if layer.latent else weight
        stats = HostRead(layer_statistics(cache, inputs)) if m.layers.needs_preferences else None
        last = g == len(cache.compressed) - 1
        winners = None
        if m.layers.needs_scores and (m.layers.cascading or last) and WINNERS_AHEAD:  # the global allocator's
            # ranking now, on the device, its (B, g + 1) counts read with the stage
            winners = HostRead(m.layers.count_winners(_request(cache, None, last, _seen(cache, g))))
        # a stage waiting for the next update holds this layer's whole prompt beside the next layer's
        # keys and values: worth it where the device runs ahead of the host (a GPU), not on a CPU
        now = (stats is None and winners is None and not on_host) or last or cpu_route(keys.device)
    cache.pending_stage = PendingStage(layer_idx, stats, winners, now)
    if now:
        cache._run_stage()  # else the next layer's update runs it (see PendingStage)


# False ranks the global allocator's layers when the stage runs (the reference; tests compare).
WINNERS_AHEAD = True


@dataclass
class PendingStage:
    """Layer ``layer_idx``'s stage, scored, waiting for what the host reads of it to allocate and
    evict: CAKE's statistics, Ada-KV's score places (``head_counts.hold_prompt_scores``), the
    global allocator's winners per layer.

    It runs at the start of the next layer's update, before that layer appends: on a GPU this
    layer's MLP and the next one's projections are queued by then, so the host allocates while the
    device works (not idle as after a read here). Same stages in the same order, same inputs."""

    layer_idx: int
    stats: HostRead | None  # CAKE's (2, B) entropy and variance on their way to the host
    winners: HostRead | None = None  # (B, n) float64: GlobalAllocator.count_winners
    now: bool = False  # run as the layer is scored (nothing to wait for): see pending_norms.begin


def run_stage(cache: Cache, *incoming: torch.Tensor) -> None:
    """The pending stage (``cache.pending_stage``), if any: steps 2-4 of the module's list
    (CAKE's preference from the statistics, the budgets, the evictions). ``incoming``: the keys and
    values of the update that runs it, alive beside the waiting layer's whole prompt: the prefill's
    peak counts them (a live peak, not only what the layers hold)."""
    if incoming and cache._waiting and not cache.prefilled:
        live = cache._held_bytes + sum(t.numel() * t.element_size() for t in incoming)
        cache.prefill_peak_kv_bytes = max(cache.prefill_peak_kv_bytes, live)
        cache.peak_kv_bytes = max(cache.peak_kv_bytes, live)
    pending_norms.resume(cache)  # the previous layer's eviction, if it waits for its norms
    pending, cache.pending_stage = cache.pending_stage, None
    if pending is None:
        return
    layer_idx = cache._stage = pending.layer_idx
    cache.stage_at_scoring = pending.now
    g = cache._slot[layer_idx]
    m = cache.method
    if pending.stats is not None:
        entropy, variance = pending.stats.wait().unbind()
        cache.entropy.append(entropy)
        cache.variance.append(variance)
        cache.preferences.append(preference(entropy, variance, *temperatures(cache, entropy.device)))
    last = g == len(cache.compressed) - 1
    if m.layers.needs_preferences or m.layers.needs_scores:
        if m.layers.cascading or last:
            prefs = torch.stack(cache.preferences, 1) if m.layers.needs_preferences else None
            won = pending.winners.wait() if pending.winners is not None else None
            seen = _seen(cache, g) if m.layers.needs_scores and won is None else None
            budgets = m.layers.allocate(_request(cache, prefs, last, seen, won))
            cache.stage_budgets.append(budgets)
            if m.heads.ragged:
                stage_head_counts(cache, cache.compressed[: g + 1], budgets)
            for j in range(g + 1):
                cache._evict_layer(cache.compressed[j], budgets[:, j])
            cache.stage_counts.clear()
    else:
        if cache.budgets is None:
            cache.budgets = m.layers.allocate(_request(cache, None, True))
        cache._evict_layer(layer_idx, cache.budgets[:, g])
    if cache._bar is not None:
        cache._bar.update(1)
        if last:
            cache._bar.close()
            cache._bar = None
    if last:
        finish_prefill(cache)


def prompt_attention(cache: Cache, layer_idx: int, query, key, value, mask, key_valid, scaling):
    """The scorer's own attention of layer ``layer_idx``'s prompt (:meth:`Scorer.prompt_attention`:
    its output and the scorer's inputs from one pass), or None for the stock kernel.

    Only where the prompt is evicted: a budget that covers every sequence's prompt keeps the stock
    kernel, so its output stays bit-identical to the full cache's. Arguments as the attention
    function has them; the first compressed layer fixes the sequences' budgets here
    (:func:`start`), before its attention instead of after it."""
    if not cache.method.scorer.scores_in_attention:
        return None
    if cache._slot[layer_idx] == 0:
        _begin(cache, key_valid)  # may set a calibrated indicator: read the method after it
    if cache.seq is None or bool((cache.seq.per_layer >= cache.seq.lengths).all()):  # host tensors
        return None
    return cache.method.scorer.prompt_attention(query, key, value, mask, key_valid, scaling)


def _begin(cache: Cache, key_valid: torch.Tensor) -> None:
    """:func:`start` once per prompt: :func:`prompt_attention` may have run it for this layer."""
    if cache.seq is None or cache.prefilled:
        start(cache, key_valid)


def layer_statistics(cache: Cache, inputs: PrefillInputs) -> torch.Tensor:
    """CAKE's dispersion (entropy of the window's attention over the prefix) and shift (its
    variance over the window's rows) of one layer: (2, B) float64 on the layer's device."""
    probs, row_valid = inputs.window_attention()
    w = probs.shape[2]
    p = probs.shape[-1] - w
    sub = probs[..., :p]  # window rows, prefix columns
    entropy = -(sub * torch.log(sub + 1e-10)).sum((1, 2, 3))  # (B,)
    variance = inputs.window_mean_var()[1][..., :p].contiguous().sum((1, 2))  # (B,): as CAKE scored
    stats = torch.stack([entropy.double(), variance.double()])
    if (split := cache.split or cache.group_split) is not None:  # over every rank's heads: 2 numbers
        stats = split.sum(stats)  # per sequence from each rank
    return stats


def start(cache: Cache, key_valid: torch.Tensor) -> None:
    """Check the batch and fix each sequence's budgets (``cache.seq``)."""
    if cache.prefilled:
        raise RuntimeError("this KVCakeCache already holds a prompt; make a new cache per prompt")
    if bool((key_valid[:, 1:].long() < key_valid[:, :-1].long()).any()):
        raise ValueError(
            "kvcake needs left padding (padding tokens before the prompt): set tokenizer.padding_side='left'"
        )
    lengths = key_valid.sum(-1).long().cpu()
    if bool((lengths == 0).any()):
        raise ValueError(
            "a sequence in the batch is empty (all padding): give every sequence at least one token"
        )
    budget = cache.method.budget
    per_layer = budget.per_layer(lengths)
    window = torch.clamp(lengths, max=budget.window)
    cache.seq = SequenceBudgets(lengths, per_layer, per_layer * len(cache.compressed), window)
    choose_temperatures(cache)
    if bool((per_layer >= lengths).all()) and not budget.keeps_all and cache.method.name != "full":
        logger.warning(
            "the budget (%s) covers the whole prompt (%d tokens): nothing is evicted during prefill%s",
            budget.describe(),
            int(lengths.max()),
            "; decode=fixed then holds each layer at that size while decoding (method 'full' keeps all)"
            if cache.method.decode == "fixed"
            else "",
        )


def _request(cache: Cache, preferences, final: bool, layer_scores=None, winners=None) -> AllocationRequest:
    """The allocator's request at a stage of the first ``m`` compressed layers (all of them
    unless cascading); it returns their (B, m) budgets."""
    s = cache.seq
    return AllocationRequest(
        total=s.total, cap=s.lengths, window=s.window, num_layers=len(cache.compressed),
        preferences=preferences, final=final, layer_scores=layer_scores, split=cache.split,
        carry=cache.allocation_carry if cache.method.layers.cascading else None, winners=winners,
    )  # fmt: skip


def _seen(cache: Cache, g: int) -> tuple:
    """The prompt scores of the first ``g + 1`` compressed layers (``cache.count_scores``)."""
    return tuple(cache.count_scores[lid] for lid in cache.compressed[: g + 1])


def evict_layer(cache: Cache, layer_idx: int, budget: torch.Tensor) -> None:
    """Evict layer ``layer_idx`` to ``budget`` (B,) host entries per KV head (window included).

    Uniform heads count on the host (:func:`dense_counts`): a cascade stage that changes nothing
    in a layer, most of them, touches no device tensor, and one that evicts sends its counts
    without waiting (on a GPU a read back or a blocking copy drains the queue, and the host's
    work after it runs with the device idle). Head-wise counts rank the scores on the device and
    are read back once."""
    layer = cache.layers[layer_idx]
    m = cache.method
    dev = layer.keys.device
    entry = None
    if m.heads.ragged:
        if layer_idx not in cache.stage_counts:  # outside a cascade stage: this layer's alone
            stage_head_counts(cache, [layer_idx], budget[:, None])
        # (B, H_kv, N), (B, H_kv) twice, and the allocator's kept set if it is the selection
        entry = cache.stage_counts.pop(layer_idx)
        scores, counts, counts_host, keep = entry
    else:
        counts_host, scores, counts, keep = dense_counts(layer, budget, cache.seq.lengths), None, None, None
    if bool((counts_host == layer.counts).all()):
        return  # nothing to evict in this layer at this stage
    later = m.layers.cascading and cache._slot[cache._stage] < len(cache.compressed) - 1  # stages follow
    if layer.ranked and layer.layout == "ragged":  # each head's top counts are its first ones
        layer.keep_first(counts_host)  # (a head's count never grows in a cascade: it refuses that)
        _evicted(cache, layer_idx, layer)
        return
    # every head of a dense layer keeping as many: the kept positions straight from the selector
    gather = (
        not m.heads.ragged and layer.layout == "dense" and bool((counts_host == counts_host.flat[0]).all())
    )
    if layer.ranked and not gather:  # heads keeping different counts: the mask path, in position order
        in_position_order(layer)
    first_norms = m.selector.needs_value_norms and layer.norms is None  # the whole prompt is here
    if scores is None:  # the scores (and counts, if read) on the device only when evicting
        scores = layer.padded(layer.scores, float("-inf"))  # (B, H_kv, N)
    if counts is None and not (gather and not first_norms):
        counts = to_device(counts_host, dev)
    if first_norms:
        values = layer.operands()[1]
        heads = cache.info.groups * values.shape[1]  # this rank's query heads under tensor parallelism
        steps = pending_norms.norm_steps(
            m.selector, values, cache.o_weights.pop(layer_idx), heads, scores, counts, cache.split,
            int(counts_host.max()), cache.group_split,
        )  # fmt: skip
        if (norms := pending_norms.begin(cache, layer_idx, budget, steps, entry)) is None:
            return  # evicted once the size its norms need is read (pending_norms.resume)
        layer.norms = m.selector.prepare_norms(norms, cache.split)
    norms = layer.padded(layer.norms, 0.0)
    if gather:
        n = int(counts_host.flat[0])
        if layer.ranked:  # in descending order since an earlier stage: its top n are its first n
            layer.keep_positions(n, counts_host)
        elif m.selector.top_counts and later:
            # later stages evict this layer again: kept in descending order, each of them a copy of
            # its first entries (no sort, no gather), back in position order at the end of prefill
            layer.keep_positions(m.selector.ranked_indices(scores, n), counts_host)
            layer.ranked = True
        else:
            layer.keep_positions(m.selector.select_indices(scores, n, norms), counts_host)
    else:
        inp = SelectionInputs(scores, counts, norms, pinned_on(cache, budget, dev))
        if keep is None:
            keep = m.selector.select(inp)
        # later stages evict a ragged layer again: kept in the selector's order, each of them keeps
        # every head's first entries (no selection, no mask), back in position order at the end
        ranks = m.heads.ragged and later and layer.layout == "dense" and RANKED_RAGGED
        order = m.selector.rank_order(inp, keep) if ranks else None
        layer.evict(keep, counts_host, ragged=m.heads.ragged, order=order)
    _evicted(cache, layer_idx, layer)


def _evicted(cache: Cache, layer_idx: int, layer) -> None:
    cache._track_bytes(layer_idx)
    if cache.record:  # the kept positions, in the layer's order (descending while it is ranked)
        cache.history.append((cache._stage, layer_idx, layer.padded_positions().cpu().clone()))


def in_position_order(layer) -> None:
    """A layer kept in the selector's order between cascade stages (``layer.ranked``) back in
    position order, as one-shot eviction leaves it (bit for bit: the same entries, copied)."""
    if layer.layout == "ragged":
        layer.keep_rows(position_rows(layer.meta, layer.positions, layer.length), layer.meta)
    else:
        layer.keep_positions(layer.positions.argsort(dim=-1), layer.counts)
    layer.ranked = False


# False selects a cascade's ragged layers again at every stage (the reference path; tests compare).
RANKED_RAGGED = True


def finish_prefill(cache: Cache) -> None:
    """Fix the decoding budgets (B, L_g, H_kv) and drop what prefill alone needed."""
    if cache.budgets is None:
        cache.budgets = cache.stage_budgets[-1]
    counts = cache.layer_counts()  # (B, L_g, H_kv)
    lengths = cache.seq.lengths.numpy()[:, None, None]
    avg = cache.seq.per_layer.numpy()[:, None, None]
    # A head that was compressed keeps its count while decoding; one that kept its whole
    # prompt may grow to the average budget before eviction starts.
    cache.decode_budget = np.where(counts < lengths, counts, np.maximum(counts, avg)).astype(np.int64)
    cache.count_scores.clear()
    cache.head_places.clear()
    cache.allocation_carry.clear()
    cache.o_weights.clear()
    m = cache.method
    keep_scores = m.scorer.stateful and m.decode == "fixed"
    for lid in cache.compressed:
        layer = cache.layers[lid]
        if layer.ranked:
            in_position_order(layer)
        layer.norms, sums, layer.window_sums = None, layer.window_sums, None
        layer.scores = with_window_sums(layer, sums) if keep_scores else None
        if cache.kv_dtype is not None:  # the kept entries in 8 bits from now on (fp8.py)
            encode_layer(layer, cache.split, cache.kv_recent)
            cache._track_bytes(lid)
    cache.plan_static(lay_out=True)  # now, so that no decode step (compiled or not) converts a layer
    cache.prefilled = True
