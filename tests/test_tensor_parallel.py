"""The decisions taken over all heads under tensor parallelism, in one process.

Ranks are simulated by threads that exchange tensors through a barrier (the semantics of
``torch.distributed.all_gather``); each holds a contiguous block of heads, as transformers'
tensor parallelism does. The real multi-process run is ``make test-tp`` (tests/tp/check_tp.py).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from kvcake.allocators import AdaKV, preference
from kvcake.allocators.adakv import ranks_desc
from kvcake.cascade import layer_statistics
from kvcake.decoding import _across
from kvcake.head_shards import _keys_split, find_splits
from kvcake.pending_norms import norm_steps
from kvcake.scorers import CakeScorer, H2OScorer, PrefillInputs, SnapKVScorer
from kvcake.scorers.defensive import MARK, DefensiveScorer
from kvcake.scorers.tova import TOVAScorer
from kvcake.selectors import SelectionInputs, projected_value_norms
from kvcake.selectors.critical import Critical
from kvcake.tensor_parallel import HeadSplit, local_weight, top_over_ranks


class Exchange:
    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * world


@dataclass(frozen=True)
class ThreadSplit(HeadSplit):
    """A rank of a simulated group: ``gather`` stacks every thread's tensor in rank order."""

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        ex = self.group
        ex.slots[self.rank] = t.clone()
        ex.barrier.wait()
        out = torch.stack(ex.slots)
        ex.barrier.wait()  # nobody overwrites a slot before every rank has read it
        return out


def on_ranks(world: int, fn):
    """``[fn(split_r) for every rank r]``, the ranks running at once."""
    ex, out, errors = Exchange(world), [None] * world, []

    def body(r):
        try:
            out[r] = fn(ThreadSplit(ex, r, world))
        except BaseException as e:  # surfaced below; a stuck peer times out on the barrier
            errors.append(e)
            ex.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def layer_scores(b: int, h: int, s: int, window: int, levels: int, seed: int) -> torch.Tensor:
    """(B, H, S) scores with few distinct values (many ties), the window at +inf and the first
    sequence's first 7 positions as left padding (-inf)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (b, h, s), generator=g).float() / levels
    scores[..., s - window :] = float("inf")
    scores[0, :, :7] = float("-inf")
    return scores


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("alpha", [0.0, 0.2, 1.0])
@pytest.mark.parametrize("seed", range(4))
def test_adakv_over_ranks_is_the_slice_of_the_one_process_selection(world, alpha, seed):
    b, h, s, window = 2, 2 * world, 40, 4
    scores = layer_scores(b, h, s, window, levels=5 + 20 * seed, seed=seed)
    budget = torch.tensor([9 + 3 * seed, 60])  # the second covers the whole prompt
    win = torch.tensor([window, window])
    ada = AdaKV(alpha=alpha)
    whole = ada.select(scores, budget, win)
    block = h // world
    parts = on_ranks(
        world, lambda sp: ada.select(scores[:, sp.rank * block : (sp.rank + 1) * block], budget, win, sp)
    )
    assert torch.equal(torch.cat(parts, 1), whole)
    # the layer's total is exact over all ranks: H_kv * budget per sequence (capped by the prompt)
    valid = torch.isfinite(scores) | (scores == float("inf"))
    assert whole.sum((1, 2)).tolist() == torch.minimum(budget * h, valid.sum((1, 2))).tolist()


@pytest.mark.parametrize("world", [2, 4])
def test_top_over_ranks_breaks_ties_like_one_sort(world):
    scores = torch.randint(0, 3, (3, 2 * world, 10)).float()  # mostly ties
    scores[1, :, :5] = float("-inf")
    fill = torch.tensor([0, 7, 1000])  # nothing, a few, more than there are
    whole = (ranks_desc(scores.reshape(3, -1)) < fill[:, None]).reshape(scores.shape)
    parts = on_ranks(world, lambda sp: top_over_ranks(scores[:, 2 * sp.rank : 2 * sp.rank + 2], fill, sp))
    assert torch.equal(torch.cat(parts, 1), whole)


def test_ranks_may_hold_views_of_different_widths():
    """An evicted layer's padded view is as wide as the rank's fullest head: rank 1's is wider
    here (empty slots on the left, -inf), and the ties still break like one sort."""
    b, h, s, window = 2, 4, 30, 4
    scores = layer_scores(b, h, s, window, levels=4, seed=7)
    budget, win = torch.tensor([10, 12]), torch.tensor([window, window])
    ada = AdaKV()
    whole = ada.select(scores, budget, win)
    extra = 9

    def rank(sp):
        mine = scores[:, 2 * sp.rank : 2 * sp.rank + 2]
        if sp.rank == 1:
            mine = torch.cat([mine.new_full((b, 2, extra), float("-inf")), mine], -1)
        kept = ada.select(mine, budget, win, sp)
        return kept[..., extra:] if sp.rank == 1 else kept

    assert torch.equal(torch.cat(on_ranks(2, rank), 1), whole)


def prefill_inputs(heads: slice, kv_heads: slice, seed: int = 0) -> PrefillInputs:
    g = torch.Generator().manual_seed(seed)
    b, h, hkv, s, d = 2, 8, 4, 48, 8
    query, keys = torch.randn(b, h, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, :5] = False  # left padding
    return PrefillInputs(
        query=query[:, heads], keys=keys[:, kv_heads], values=keys[:, kv_heads], key_valid=valid,
        window=8, scaling=d**-0.5,
    )  # fmt: skip


def fake_cache(split, group_split=None):
    return SimpleNamespace(split=split, group_split=group_split)


def layer_preference(cache, inputs):
    """(preference, entropy, variance) of one layer, as the cascade's stage takes them"""
    entropy, variance = layer_statistics(cache, inputs).unbind()
    return preference(entropy, variance, 1.0, 2.0), entropy, variance


@pytest.mark.parametrize("world", [2, 4])
def test_cake_preference_over_ranks_equals_one_process(world):
    ref, ref_entropy, ref_variance = layer_preference(
        fake_cache(None), prefill_inputs(slice(None), slice(None))
    )
    qb, kb = 8 // world, 4 // world

    def rank(sp):
        r = sp.rank
        return layer_preference(
            fake_cache(sp), prefill_inputs(slice(r * qb, (r + 1) * qb), slice(r * kb, (r + 1) * kb))
        )

    out = on_ranks(world, rank)
    for pref, entropy, variance in out:  # bit-identical on every rank
        assert (
            torch.equal(pref, out[0][0])
            and torch.equal(entropy, out[0][1])
            and torch.equal(variance, out[0][2])
        )
    torch.testing.assert_close(out[0][1], ref_entropy, rtol=1e-6, atol=0)
    torch.testing.assert_close(out[0][2], ref_variance, rtol=1e-6, atol=0)
    torch.testing.assert_close(out[0][0], ref, rtol=1e-5, atol=0)
    # a rank alone sees other statistics: the exchange is what makes them equal
    alone, _, _ = layer_preference(fake_cache(None), prefill_inputs(slice(0, qb), slice(0, kb)))
    assert not torch.allclose(alone, ref, rtol=1e-3)


def test_tova_mean_over_ranks_equals_the_mean_over_all_heads():
    tova = TOVAScorer()
    ref = tova.prefill(prefill_inputs(slice(None), slice(None)))

    def rank(sp):
        r = sp.rank
        return sp.head_mean(
            tova.prefill(prefill_inputs(slice(r * 4, (r + 1) * 4), slice(r * 2, (r + 1) * 2)))
        )

    parts = on_ranks(2, rank)
    torch.testing.assert_close(torch.cat(parts, 1), ref, rtol=1e-6, atol=1e-7)


def test_a_model_held_by_one_process_has_no_split(tiny_llama):
    assert find_splits(tiny_llama) == (None, None)


@pytest.mark.parametrize(
    ("styles", "heads", "split"),
    [
        ({"k_proj": "colwise", "o_proj": "rowwise"}, 4, True),  # Llama's plan: blocks of KV heads
        ({"k_proj": "colwise_gather_output", "o_proj": "rowwise_split_input"}, 4, False),  # OLMo 2's
        ({"qkv_proj": "packed_colwise", "o_proj": "rowwise"}, 4, True),  # fused projections
        ({"k_proj": "unit_colwise", "o_proj": "unit_rowwise"}, 4, True),  # as many heads per rank
        ({"o_proj": "rowwise"}, 4, True),  # no key projection named: the sharded W_O's word
    ],
)
def test_the_plan_of_the_keys_says_whether_each_rank_holds_a_block_of_heads(styles, heads, split):
    """A plan that gathers the keys on every rank (OLMo 2's: its norms span every head) and shards
    only the output projection leaves every rank all heads: no split, or each rank would take its
    copies of every head for a block of them (logits 0.04 off under adakv, measured)."""
    plan = {f"model.layers.*.self_attn.{name}": style for name, style in styles.items()}
    model = SimpleNamespace(tp_plan=plan, config=LlamaConfig(num_key_value_heads=heads))
    assert _keys_split(model, 2) is split


def test_a_plan_repeating_kv_heads_over_ranks_is_refused():
    """``unit_colwise`` keys with fewer KV heads than ranks (MiniCPM5's plan) put a copy of a head on
    several ranks, each of which would keep its own entries of it."""
    plan = {"model.layers.*.self_attn.k_proj": "unit_colwise"}
    model = SimpleNamespace(tp_plan=plan, config=LlamaConfig(num_key_value_heads=1))
    with pytest.raises(
        ValueError, match="repeats KV heads over the ranks .'unit_colwise' keys, 1 KV heads on 2"
    ):
        _keys_split(model, 2)


def test_a_weight_read_whole_is_the_weight_itself_outside_tensor_parallelism():
    weight = torch.randn(4, 6)
    assert local_weight(weight, whole=True) is weight and local_weight(weight) is weight


def test_head_split_checks_its_rank():
    with pytest.raises(ValueError, match="world > 1"):
        HeadSplit(None, 0, 1)
    with pytest.raises(ValueError, match="rank < world"):
        HeadSplit(None, 2, 2)
    with pytest.raises(ValueError, match="'mean' or 'max', got 'sum'"):
        HeadSplit(None, 0, 2).pool(torch.ones(3), "sum")


@pytest.mark.parametrize("world", [2, 4])
def test_defensive_marks_over_ranks_use_the_whole_layers_window_share(world):
    """CriticalKV's first stage, as DefensiveKV's scorer marks it, cuts each head's attention at the
    critical mass less the window's own share, a mean over every head of the layer: each rank's
    marked scores are the slice of one process's, bit for bit (a rank's own heads' mean moved the
    cut: one entry of one layer changed heads on a split Qwen3.5, 2026-11-30)."""
    scorer = DefensiveScorer()
    ref = scorer.prefill(prefill_inputs(slice(None), slice(None), seed=3))
    qb, kb = 8 // world, 4 // world

    def rank(sp):
        r = sp.rank
        inputs = prefill_inputs(slice(r * qb, (r + 1) * qb), slice(r * kb, (r + 1) * kb), seed=3)
        return scorer.prefill(dataclasses.replace(inputs, split=sp))

    parts = on_ranks(world, rank)
    assert torch.equal(torch.cat(parts, 1), ref)
    assert (ref >= MARK).any()  # marks were set
    alone = [scorer.prefill(prefill_inputs(slice(r * qb, (r + 1) * qb), slice(r * kb, (r + 1) * kb), seed=3))
             for r in range(world)]  # fmt: skip
    assert not torch.equal(torch.cat(alone, 1), ref)  # each rank's own share alone marks otherwise


LATENT_SCORERS = {
    "snapkv": SnapKVScorer(),
    "snapkv-max": SnapKVScorer(reduce="max"),
    "cake": CakeScorer(),
    "tova": TOVAScorer(),
    "h2o": H2OScorer(fused=False),
    "defensive": DefensiveScorer(),
    "defensive-mean": DefensiveScorer(aggregate="mean"),
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", sorted(LATENT_SCORERS))
def test_a_latent_heads_query_group_split_over_ranks_scores_as_one_process(world, name):
    """A latent layer (MLA) under a plan that splits its query heads: every rank holds the one KV
    head whole and ``8 / world`` of its query heads (``group_split``). Each rank's prefill scores,
    CAKE statistics, decoding scores and CriticalKV norms, pooled over the ranks, are one process's
    over the whole group, the same bits on every rank; a rank's own heads alone score otherwise."""
    scorer, qb = LATENT_SCORERS[name], 8 // world
    ref = scorer.prefill(prefill_inputs(slice(None), slice(0, 1), seed=5))
    ref_stats = layer_statistics(fake_cache(None), prefill_inputs(slice(None), slice(0, 1), seed=5))
    g = torch.Generator().manual_seed(6)
    probs = torch.rand(2, 1, 8, 30, generator=g).softmax(-1)  # a decode step's (B, H_kv, G, N)
    positions = torch.arange(30).expand(2, 1, 30)
    previous = torch.rand(2, 1, 30, generator=g) if scorer.stateful else None
    ref_step = scorer.decode_step(probs, positions, previous)
    values, o_weight = torch.randn(2, 1, 30, 4, generator=g), torch.randn(16, 8 * 4, generator=g)
    ref_norms = _value(norm_steps(None, values, o_weight, 8, None, None))
    cache = SimpleNamespace(method=SimpleNamespace(scorer=scorer), split=None)

    def rank(sp):
        heads = slice(sp.rank * qb, (sp.rank + 1) * qb)
        inputs = dataclasses.replace(prefill_inputs(heads, slice(0, 1), seed=5), group_split=sp)
        across = _across(SimpleNamespace(**vars(cache), group_split=sp))
        step = across(scorer.decode_step(probs[:, :, heads], positions, previous).expand(2, 1, 30))
        mine = o_weight.view(16, 8, 4)[:, heads].reshape(16, qb * 4)
        norms = _value(norm_steps(None, values, mine, 8, None, None, group_split=sp))
        return scorer.prefill(inputs), layer_statistics(fake_cache(None, sp), inputs), step, norms

    out = on_ranks(world, rank)
    for part in out:
        assert all(torch.equal(a, b) for a, b in zip(part, out[0], strict=True))
    scores, stats, step, norms = out[0]
    torch.testing.assert_close(scores, ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(stats, ref_stats, rtol=1e-6, atol=0)
    torch.testing.assert_close(step, ref_step.expand(2, 1, 30), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=1e-6)
    alone = scorer.prefill(prefill_inputs(slice(0, qb), slice(0, 1), seed=5))
    assert not torch.allclose(alone, ref, rtol=1e-3)  # the pooling is what makes them equal


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("value_norm", ["raw", "heads"])
def test_a_latent_heads_query_group_split_prunes_criticalkv_norms_as_one_process(world, value_norm):
    """CriticalKV's norms where only the entries it can keep need them (``value_norm_steps``), on a
    latent layer whose query heads the ranks share: each rank's bounds and norms over its heads,
    pooled, pick the same candidates on every rank, and the selection keeps what one process keeps
    with every norm over the whole group."""
    g, qb, s = torch.Generator().manual_seed(7), 8 // world, 600
    values, o_weight = torch.randn(2, 1, s, 4, generator=g), torch.randn(16, 8 * 4, generator=g) / 2
    scores = torch.exp(3 * torch.randn(2, 1, s, generator=g))  # heavy-tailed, like attention
    scores[..., -8:], scores[1, :, :5] = float("inf"), float("-inf")  # the window; left padding
    counts, sel = torch.tensor([[40], [64]]), Critical(value_norm=value_norm)
    full = projected_value_norms(values, o_weight, 8)
    keep = sel.select(SelectionInputs(scores, counts, sel.prepare_norms(full)))  # as the layer keeps them

    def rank(sp):
        mine = o_weight.view(16, 8, 4)[:, sp.rank * qb : (sp.rank + 1) * qb].reshape(16, qb * 4)
        return sel.value_norms(values, mine, qb, scores, counts, group_split=sp)

    out = on_ranks(world, rank)
    assert all(torch.equal(norms, out[0]) for norms in out)
    assert torch.equal(sel.select(SelectionInputs(scores, counts, sel.prepare_norms(out[0]))), keep)
    if value_norm == "heads":  # one KV head: every share is 1 on every rank, no norm computed
        assert torch.equal(sel.prepare_norms(out[0]), sel.prepare_norms(full))
        return
    computed = out[0] > 0
    assert not bool(computed.all())
    torch.testing.assert_close(out[0][computed], full[computed], rtol=1e-5, atol=1e-6)


def _value(steps) -> torch.Tensor:
    """What a generator of norms returns (these need no host read)."""
    try:
        next(steps)
    except StopIteration as done:
        return done.value
    raise AssertionError("the norms asked for a host read")
