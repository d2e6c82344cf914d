"""DefensiveKV and Layer-DefensiveKV (issue 26): the defensive scorer, CriticalKV's marked first
stage, the global layer allocator, and Layer-DefensiveKV through CAKE's cascade.

Invariants: the max aggregation is >= the mean one everywhere; the marked first stage holds the
90% mass (minus the window's share) and is minimal, and the selector keeps it; global budgets
sum exactly, keep the windows, only shrink through the cascade; the cascade keeps the same
entries as one ranking after the last layer, with a prefill peak of the total budget plus one
layer; what prefill alone needed is freed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcake import cascade, head_counts, make_method
from kvcake.allocators import AdaKV, AllocationRequest, GlobalAllocator
from kvcake.scorers import DefensiveScorer, PrefillInputs, SnapKVScorer
from kvcake.scorers.defensive import MARK
from kvcake.selectors import Critical, SelectionInputs
from shared_checks import prefill, prompt

INF = float("inf")
SETTINGS = settings(
    max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


def _inputs(
    seed: int, b: int, hkv: int, groups: int, s: int, window: int, lengths: list[int]
) -> PrefillInputs:
    g = torch.Generator().manual_seed(seed)
    h, d = hkv * groups, 8
    q = torch.randn(b, h, s, d, generator=g) * 2
    k = torch.randn(b, hkv, s, d, generator=g) * 2
    v = torch.randn(b, hkv, s, d, generator=g)
    valid = torch.arange(s)[None, :] >= (s - torch.tensor(lengths))[:, None]
    return PrefillInputs(q, k, v, valid, window, d**-0.5)


@st.composite
def cases(draw):
    b, hkv, groups = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    s = draw(st.integers(2, 60))
    window = draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(1, s), min_size=b, max_size=b))
    return _inputs(draw(st.integers(0, 2**31 - 1)), b, hkv, groups, s, window, lengths), lengths


@SETTINGS
@given(case=cases())
def test_max_aggregation_is_at_least_mean_everywhere(case):
    inp, _ = case
    top = DefensiveScorer(critical_mass=0.0).prefill(inp)
    mean = DefensiveScorer(aggregate="mean", critical_mass=0.0).prefill(inp)
    finite = torch.isfinite(mean)
    assert torch.equal(finite, torch.isfinite(top)), "window and padding the same"
    assert bool((top[finite] >= mean[finite] - 1e-7).all())
    # the floor: no prefix score below its head's mean over the valid prefix keys
    assert bool((top[finite] >= 0).all()) and bool((top[finite] <= 1 + 1e-6).all()), "probabilities"


def test_defensive_scores_by_hand():
    """One head, one query row, kernel 1: the score is the window query's attention, floored at
    its mean over the prefix; kernel 3 keeps each row's mass."""
    inp = _inputs(0, 1, 1, 1, 10, 1, [10])
    probs, _ = inp.window_attention()
    raw = probs[0, 0, 0, :9]  # the single window query's attention on the 9 prefix keys
    got = DefensiveScorer(kernel=1, critical_mass=0.0).prefill(inp)[0, 0, :9]
    torch.testing.assert_close(got, torch.maximum(raw, raw.mean()))
    pooled = DefensiveScorer(kernel=3, aggregate="mean", critical_mass=0.0).prefill(inp)[0, 0, :9]
    assert float(pooled.sum()) >= float(raw.sum()) - 1e-6  # the floor only adds
    snap = SnapKVScorer(kernel=1).prefill(inp)[0, 0, :9]
    torch.testing.assert_close(DefensiveScorer(kernel=1, aggregate="mean", critical_mass=0.0).prefill(inp)[0, 0, :9],
                               torch.maximum(snap, snap.mean()))  # fmt: skip


@SETTINGS
@given(case=cases(), mass=st.sampled_from([0.5, 0.9, 1.0]))
def test_first_stage_marks_the_mass_entries_minimally(case, mass):
    inp, lengths = case
    scorer = DefensiveScorer(critical_mass=mass)
    marked_scores = scorer.prefill(inp)
    plain = DefensiveScorer(critical_mass=0.0).prefill(inp)
    marked = marked_scores >= MARK
    fin = torch.isfinite(plain)
    torch.testing.assert_close(marked_scores[fin], (plain + MARK * marked)[fin])
    # the share each prefix entry holds of its head's mean (unpooled) window attention
    probs, row_valid = inp.window_attention()
    b, h, w, s = probs.shape
    hkv = inp.keys.shape[1]
    p = s - w
    if p <= 0:
        return
    n_rows = row_valid.sum(-1).clamp(min=1).float()[:, None, None] * (h // hkv)
    share = probs[..., :p].reshape(b, hkv, -1, p).sum(2) / n_rows
    share = share * inp.key_valid[:, None, :p]
    share = share / share.sum(-1, keepdim=True).clamp(min=1e-30)
    win = probs[..., p:].sum(-1).sum((1, 2)) / (row_valid.sum(-1).clamp(min=1) * h)
    for i in range(b):
        t = max(mass - float(win[i]), 0.0)
        for j in range(hkv):
            m = marked[i, j, :p]
            held = float(share[i, j][m].sum())
            total = float(share[i, j].sum())
            if total == 0:
                assert not bool(m.any())
                continue
            assert held >= min(t, total) - 1e-5, "the first stage holds the mass"
            if m.any():  # minimal: without its smallest entry it falls short
                assert held - float(share[i, j][m].min()) < t + 1e-6
                rest = share[i, j][~m]
                if rest.numel():
                    assert float(share[i, j][m].min()) >= float(rest.max()) - 1e-7, "the highest shares"


@SETTINGS
@given(case=cases(), extra=st.integers(0, 30))
def test_marked_selection_keeps_the_first_stage(case, extra):
    inp, _ = case
    scores = DefensiveScorer().prefill(inp)
    marked = scores >= MARK
    window = scores == INF
    n_valid = (scores > -INF).sum(-1)
    counts = torch.minimum(window.sum(-1) + marked.sum(-1) + extra, n_valid)
    norms = torch.rand(scores.shape, generator=torch.Generator().manual_seed(1)) + 0.1
    keep = Critical(first="marked").select(SelectionInputs(scores, counts, norms))
    assert bool((keep[marked]).all()), "every marked entry is kept when the budget holds them"
    assert bool(keep[window].all())
    assert torch.equal(keep.sum(-1), counts)
    # a budget smaller than the marks keeps the best-scored marks only
    small = torch.minimum(window.sum(-1) + 1, n_valid)
    keep = Critical(first="marked").select(SelectionInputs(scores, small, norms))
    assert not bool((keep & ~marked & ~window & marked.any(-1, keepdim=True)).any())


def test_value_norms_normalised_over_heads():
    norms = torch.rand(2, 3, 7) + 0.1
    out = Critical(value_norm="heads").prepare_norms(norms)
    torch.testing.assert_close(out.sum(1), torch.ones(2, 7))
    assert Critical().prepare_norms(norms) is norms


def test_marked_first_stage_needs_a_marking_scorer():
    with pytest.raises(ValueError, match="needs a scorer that marks"):
        make_method("critical-adakv,select.first=marked", budget=64)
    with pytest.raises(ValueError, match="needs a scorer that marks"):
        make_method("defensivekv,score.critical_mass=0", budget=64)
    for bad in ("score.kernel=4", "score.aggregate=min", "score.critical_mass=1.5", "select.first=top",
                "select.value_norm=l2", "layers.cascading=1"):  # fmt: skip
        with pytest.raises(ValueError):
            make_method(f"layer-defensivekv,{bad}", budget=64)


# -- the global allocator --------------------------------------------------------------------------
@st.composite
def global_cases(draw):
    b, hkv, n = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 6))
    s = draw(st.integers(1, 40))
    lengths = torch.tensor(draw(st.lists(st.integers(1, s), min_size=b, max_size=b)))
    sw = draw(st.integers(1, 10))
    window = torch.clamp(lengths, max=sw)
    per_layer = torch.tensor([draw(st.integers(int(w), int(w) + 40)) for w in window])
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ties = draw(st.booleans())
    valid = torch.arange(s)[None, :] >= (s - lengths)[:, None]
    in_window = torch.arange(s)[None, :] >= (s - window)[:, None]
    layers = []
    for _ in range(n):
        raw = (
            torch.randint(0, 3, (b, hkv, s), generator=g).float()
            if ties
            else torch.rand(b, hkv, s, generator=g)
        )
        layers.append(raw.masked_fill(in_window[:, None], INF).masked_fill(~valid[:, None], -INF))
    return layers, lengths, window, per_layer * n


@SETTINGS
@given(case=global_cases())
def test_global_budgets_exact_capped_windows_and_only_shrink(case):
    layers, lengths, window, total = case
    n, hkv = len(layers), layers[0].shape[1]
    alloc = GlobalAllocator()
    previous = None
    carry: dict = {}  # a cascade's: each stage ranks the last one's winners and its new layer only
    for m in range(n):
        final = m == n - 1
        req = AllocationRequest(total, lengths, window, n, final=final, layer_scores=tuple(layers[: m + 1]))
        got = alloc.allocate(req)
        assert torch.equal(alloc.allocate(dataclasses.replace(req, carry=carry)), got), (
            "carried = ranked anew"
        )
        assert carry["layers"] == m + 1
        assert got.shape == (len(lengths), m + 1) and got.dtype == torch.int64
        assert bool((got <= lengths[:, None]).all()) and bool((got >= window[:, None]).all())
        if previous is not None:
            assert bool((got[:, :m] <= previous).all()), "a budget never grows in the cascade"
        previous = got
    assert torch.equal(got.sum(1), torch.minimum(total, n * lengths)), "budgets sum exactly"
    # the budgets follow the global ranking: a layer's share is its entries among the top pool
    flat = torch.cat([s.reshape(len(lengths), -1) for s in layers], 1)
    prefix = torch.where(torch.isfinite(flat), flat, torch.full_like(flat, -INF))
    pool = hkv * (total - n * window)
    for i in range(len(lengths)):
        order = torch.argsort(prefix[i], descending=True, stable=True)[: int(pool[i])]
        won = torch.zeros_like(prefix[i], dtype=torch.bool)
        won[order] = torch.isfinite(prefix[i][order])
        c = won.reshape(n, -1).sum(-1).double()
        assert bool(((got[i].double() - (window[i] + c / hkv)).abs() < 1 + 1e-9).all())


def test_global_allocator_needs_scores():
    req = AllocationRequest(torch.tensor([40]), torch.tensor([30]), torch.tensor([4]), 2)
    with pytest.raises(ValueError, match="needs the layers' scores"):
        GlobalAllocator().allocate(req)


# -- Layer-DefensiveKV in the cache ----------------------------------------------------------------
@pytest.mark.parametrize(
    "spec", ["layer-defensivekv", "layer-defensivekv,heads=uniform,select=topk,score.critical_mass=0"]
)
def test_layer_defensivekv_cascade_equals_one_shot(tiny_llama, spec):
    ids = prompt(300, seed=1)
    casc, _ = prefill(tiny_llama, ids, make_method(spec, budget=64, window=8), record=True)
    once, _ = prefill(tiny_llama, ids, make_method(spec + ",layers.cascading=false", budget=64, window=8))
    assert torch.equal(casc.budgets, once.budgets)
    assert int(casc.budgets.sum()) == 64 * 4, "budgets sum exactly"
    assert len(set(casc.budgets[0].tolist())) > 1, "the global ranking gives layers different budgets"
    for a, b in zip(casc.layers, once.layers, strict=True):
        assert torch.equal(a.padded_positions(), b.padded_positions())
        assert torch.equal(a.keys, b.keys)
    by_layer: dict[int, list[torch.Tensor]] = {}
    for _, lid, pos in casc.history:
        by_layer.setdefault(lid, []).append(pos)
    assert max(len(v) for v in by_layer.values()) > 1, "the cascade re-evicted some layer"
    for seq in by_layer.values():
        for before, after in zip(seq, seq[1:], strict=False):
            for h in range(before.shape[1]):
                assert set(after[0, h][after[0, h] >= 0].tolist()) <= set(
                    before[0, h][before[0, h] >= 0].tolist()
                )


@pytest.mark.parametrize(
    "spec", ["layer-defensivekv", "layers=cake,heads=adakv,score=cake,select=critical", "cake-adakv", "adakv"]
)
def test_head_counts_on_the_host_equal_the_device(tiny_llama, monkeypatch, spec):
    """Ada-KV's counts on the host (``head_counts.HOST_COUNTS``: each layer's score places laid
    out once, ``AdaKV.places``) keep the very entries, stage by stage, of counting on the device
    at every stage (the reference), and the places are dropped after prefill."""
    ids = prompt(300, seed=2)
    method = make_method(spec, budget=48, window=8)
    monkeypatch.setattr(head_counts, "HOST_COUNTS", False)
    ref, ref_logits = prefill(tiny_llama, ids, method, record=True)
    monkeypatch.setattr(head_counts, "HOST_COUNTS", True)
    laid_out = []
    places = AdaKV.places
    monkeypatch.setattr(AdaKV, "places", lambda self, scores: laid_out.append(1) or places(self, scores))
    got, logits = prefill(tiny_llama, ids, method, record=True)
    assert len(laid_out) == len(got.compressed), "each layer laid out once"
    assert torch.equal(logits, ref_logits)
    assert len(got.history) == len(ref.history) >= len(got.compressed)
    if method.layers.cascading:
        assert len(got.history) > len(got.compressed), "the cascade re-evicted layers"
    for (sa, la, pa), (sb, lb, pb) in zip(got.history, ref.history, strict=True):
        assert (sa, la) == (sb, lb) and torch.equal(pa, pb)
    for a, b in zip(got.layers, ref.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert not got.head_places, "the places are dropped after prefill"


@pytest.mark.parametrize("cascading", [True, False])
def test_global_winners_counted_ahead_equal_the_stage(tiny_llama, monkeypatch, cascading):
    """The global allocator's ranking run on the device when a layer is scored
    (``cascade.WINNERS_AHEAD``: ``GlobalAllocator.count_winners``, read with the stage a layer
    later) gives the budgets, stage by stage, and the entries of ranking when the stage runs."""
    ids = prompt(300, seed=4)
    method = make_method(f"layer-defensivekv,layers.cascading={str(cascading).lower()}", budget=48, window=8)
    monkeypatch.setattr(cascade, "WINNERS_AHEAD", False)
    ref, ref_logits = prefill(tiny_llama, ids, method, record=True)
    monkeypatch.setattr(cascade, "WINNERS_AHEAD", True)
    counted = []
    count = GlobalAllocator.count_winners
    monkeypatch.setattr(
        GlobalAllocator, "count_winners", lambda self, req: counted.append(1) or count(self, req)
    )
    got, logits = prefill(tiny_llama, ids, method, record=True)
    assert len(counted) == (len(got.compressed) if cascading else 1)
    assert torch.equal(logits, ref_logits)
    assert len(got.stage_budgets) == len(ref.stage_budgets)
    for a, b in zip(got.stage_budgets, ref.stage_budgets, strict=True):
        assert torch.equal(a, b)
    for (sa, la, pa), (sb, lb, pb) in zip(got.history, ref.history, strict=True):
        assert (sa, la) == (sb, lb) and torch.equal(pa, pb)


@pytest.mark.parametrize("name", ["defensivekv", "layer-defensivekv"])
def test_prefill_peak_within_the_cascade_bound_and_memory_freed(tiny_llama, name):
    s, budget, window, layers = 400, 48, 8, 4
    ids = prompt(s, seed=3)
    # the dynamic layout: its bytes are the kept entries (static storage adds its capacity: test_cache)
    cache, _ = prefill(tiny_llama, ids, make_method(name, budget=budget, window=window), static=False)
    once, _ = prefill(tiny_llama, ids, make_method(f"{name},layers.cascading=false", budget=budget, window=window)) \
        if name == "layer-defensivekv" else (None, None)  # fmt: skip
    entry = 2 * 16 * 4  # K and V per KV head, head_dim 16, float32
    hkv = 2
    bound = (budget * layers + s + layers) * hkv * entry  # total budget + one full layer (+ ceil slack)
    assert cache.prefill_peak_kv_bytes <= bound
    counts = cache.layer_counts()
    assert int(counts.sum()) == budget * layers * hkv
    assert cache.kv_bytes() == int(counts.sum()) * entry, "the evicted entries are freed (ragged)"
    assert not cache.count_scores, "the full prompt's scores are dropped after prefill"
    assert all(
        cache.layers[lid].norms is None and cache.layers[lid].scores is None for lid in cache.compressed
    )
    if once is not None:
        assert once.prefill_peak_kv_bytes == s * layers * hkv * entry > bound


def test_memory_bench_theory_and_target(tiny_llama, tmp_path):
    """The memory bench's theory for the new presets: layer-wise eviction for DefensiveKV,
    the cascade bound for Layer-DefensiveKV (and its target row)."""
    from kvcake.bench import memory
    from kvcake.bench.common import BenchModels

    models = BenchModels(tiny_llama, None, "tiny", torch.device("cpu"), torch.float32)
    result = memory.run(
        models, lengths=(96,), methods=("defensivekv", "layer-defensivekv"), budget=24, rss_lengths=(),
        window=8, out=None, echo=False,
    )  # fmt: skip
    rows = {r["method"]: r for r in result["kv"]}
    assert rows["defensivekv"]["peak_rule"] == "layer-wise"
    assert rows["defensivekv"]["peak"] == rows["defensivekv"]["peak_theory"]
    lay = rows["layer-defensivekv"]
    assert lay["peak_rule"] == "B_total + S (bound)"
    assert lay["peak"] <= lay["cascade_bound"] + 3 * lay["entry_bytes"]
    for r in (rows["defensivekv"], lay):
        assert r["end"] == r["end_theory"] == r["counts_bytes"]
    (target,) = [t for t in result["targets"] if "Layer-DefensiveKV" in t["target"]]
    assert target["ok"]
