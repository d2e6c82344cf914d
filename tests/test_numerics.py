"""Low precision and degenerate numbers: float16 and bfloat16 tiny models on CPU (sdpa and
eager) give finite scores, preferences, budgets and logits in the edge cases (entropy of exact
zeros, variance of constant rows, fully masked padding rows, a one-token prompt, a prompt
shorter than the window), and keep the same tokens as float32 except where the float32 scores
of the swapped entries tie within the precision's tolerance."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import kvcake
from kvcake import KVCakeCache, make_method
from kvcake.adapters import with_cache
from kvcake.allocators import AllocationRequest, CakeAllocator, preference
from kvcake.scorers import (
    CakeScorer,
    DefensiveScorer,
    H2OScorer,
    PrefillInputs,
    SnapKVScorer,
    StreamingScorer,
    TOVAScorer,
    defensive,
)
from kvcake.scorers.base import window_attention_reference, window_rows_mean_var

INF = float("inf")
DTYPES = [torch.bfloat16, torch.float16]
# Relative distance to the selection threshold within which float32 scores count as tied:
# measured worst cases on the peaky model below are ~1.4e-2 (bf16) and ~3e-3 (fp16).
TIE_RTOL = {torch.bfloat16: 5e-2, torch.float16: 1.5e-2}


def ids(n, seed=0, batch=1):
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


class ScoreRecordingCache(KVCakeCache):
    """Keeps each layer's full prefill scores (B, H_kv, S) as they were before its first eviction."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first_scores: dict[int, torch.Tensor] = {}

    def _evict_layer(self, layer_idx, budget):
        layer = self.layers[layer_idx]
        if layer_idx not in self.first_scores:
            self.first_scores[layer_idx] = layer.padded(layer.scores, -INF).clone()
        super()._evict_layer(layer_idx, budget)


@pytest.fixture(scope="module")
def peaky_models(make_tiny_llama):
    """float32 / bfloat16 / float16 copies of a tiny GQA Llama whose q/k projections are scaled
    up 8x, so attention is peaked and scores are far from uniform (a random init attends
    almost uniformly, where every score ties)."""
    m32 = make_tiny_llama(num_key_value_heads=2, attn_implementation="sdpa")
    with torch.no_grad():
        for layer in m32.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return {torch.float32: m32, **{dt: copy.deepcopy(m32).to(dt) for dt in DTYPES}}


def _prefill(model, input_ids, method, mask=None, cls=KVCakeCache):
    cache = cls(model, method)
    with kvcake.enable(model), torch.no_grad():
        logits = model(input_ids, attention_mask=mask, **with_cache(model, cache)).logits
    return cache, logits


def _check_cache(cache: KVCakeCache, lengths: list[int]) -> None:
    """Finite preferences, exact budget totals and valid kept positions after prefill."""
    for t in cache.entropy + cache.variance + cache.preferences:
        assert bool(torch.isfinite(t).all()) and bool((t >= 0).all())
    n_layers = len(cache.layers)
    per_layer = cache.method.budget.per_layer(torch.tensor(lengths))
    assert torch.equal(
        cache.budgets.sum(1), torch.minimum(per_layer * n_layers, torch.tensor(lengths) * n_layers)
    )
    counts = cache.layer_counts()
    for li, layer in enumerate(cache.layers):
        if layer.plain:  # nothing evicted: only when every budget covers its whole (unpadded) prompt
            assert bool((per_layer >= torch.tensor(lengths)).all()) and len(set(lengths)) == 1
            continue
        pos = layer.padded_positions()
        for b, n in enumerate(lengths):
            for h in range(pos.shape[1]):
                kept = pos[b, h][pos[b, h] >= 0]
                assert int(kept.numel()) == counts[b, li, h]
                assert bool((kept >= layer.length - n).all()), "padding kept"
                window = set(range(layer.length - min(n, cache.method.budget.window), layer.length))
                assert window <= set(kept.tolist()), "window dropped"


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_low_precision_end_to_end_is_finite(make_tiny_llama, impl, dtype):
    """A left-padded batch (one prompt shorter than the window: its padding rows are fully
    masked), every scorer, both head allocators, CriticalKV, both decoding policies."""
    model = make_tiny_llama(num_key_value_heads=2, attn_implementation=impl).to(dtype)
    lengths = [70, 6]
    input_ids = ids(70, seed=3, batch=2)
    mask = torch.ones_like(input_ids)
    mask[1, : 70 - lengths[1]] = 0
    for spec in ("cake", "critical-adakv", "h2o", "layers=pyramid,score=tova,decode=fixed", "streamingllm",
                 "layers=cake,heads=adakv,score=snapkv,select=critical"):  # fmt: skip
        cache, logits = _prefill(model, input_ids, make_method(spec, budget=24, window=8), mask)
        assert bool(torch.isfinite(logits[mask.bool()]).all()), spec
        _check_cache(cache, lengths)
        tok = logits[:, -1:].argmax(-1)
        step_mask = mask
        with kvcake.enable(model), torch.no_grad():
            for _ in range(3):
                step_mask = torch.cat([step_mask, torch.ones(2, 1, dtype=step_mask.dtype)], 1)
                out = model(tok, attention_mask=step_mask, **with_cache(model, cache)).logits
                assert bool(torch.isfinite(out).all()), spec
                tok = out[:, -1:].argmax(-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 5])
def test_one_token_and_shorter_than_window_prompts(make_tiny_llama, dtype, n):
    """A one-token prompt and one shorter than the window keep everything (it is all window),
    with finite preferences (empty prefix: entropy and variance of nothing are 0); decoding
    with a fixed budget keeps the newest tokens (the budget is never below the window)."""
    model = make_tiny_llama(num_key_value_heads=2).to(dtype)
    for spec in ("cake", "cake-adakv", "h2o", "tova", "critical-adakv", "streamingllm"):
        for kw in ({"budget": 8, "window": 8}, {"ratio": 0.3, "window": 8}):
            out, cache = kvcake.generate(model, ids(n, seed=n), spec, **kw, max_new_tokens=3, do_sample=False,
                                         output_logits=True, return_dict_in_generate=True)  # fmt: skip
            assert all(bool(torch.isfinite(x).all()) for x in out.logits)
            assert np.array_equal(cache.budgets.numpy(), np.full((1, 4), n)), (spec, kw)
            for t in cache.entropy + cache.variance + cache.preferences:
                assert bool(torch.isfinite(t).all()) and bool((t >= 0).all())
            for layer in cache.layers:  # n + 2 <= window tokens: all still held after decoding
                pos = layer.padded_positions()[0]
                assert all(sorted(p[p >= 0].tolist()) == list(range(n + 2)) for p in pos), (spec, kw, pos)


@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES], ids=str)
def test_scorers_on_degenerate_attention(dtype):
    """Exact zeros (saturated softmax: one-hot rows, whose entropy terms are 0 * log 0), constant
    rows (zero variance), and fully masked padding rows, in low precision."""
    b, h, hkv, s, d, w = 2, 4, 2, 24, 8, 6
    g = torch.Generator().manual_seed(0)
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, :10] = False
    cases = {
        "saturated": (
            torch.randn(b, h, s, d, generator=g) * 300,
            torch.randn(b, hkv, s, d, generator=g) * 300,
        ),
        "constant": (torch.zeros(b, h, s, d), torch.randn(b, hkv, s, d, generator=g)),
        "huge": (torch.full((b, h, s, d), 200.0), torch.full((b, hkv, s, d), 200.0)),
    }
    values = torch.randn(b, hkv, s, d, generator=g)
    for name, (q, k) in cases.items():
        q, k, v = (t.to(dtype) for t in (q, k, values))
        inp = PrefillInputs(q, k, v, valid, w, d**-0.5)
        probs, row_valid = inp.window_attention()
        assert bool(torch.isfinite(probs).all()), name
        sub = probs[..., : s - w]
        entropy = -(sub * torch.log(sub + 1e-10)).sum((1, 2, 3))
        _, var = window_rows_mean_var(sub, row_valid)
        p = preference(entropy, var.sum((1, 2)), 1.6, 0.6)
        assert bool(torch.isfinite(p).all()) and bool((p >= 0).all()), name
        if name == "constant":  # zero queries: every window row of a prefix column is 1 / (visible keys)
            assert bool((var >= 0).all())
        for scorer in (StreamingScorer(), H2OScorer(chunk=7), TOVAScorer(), SnapKVScorer(), CakeScorer()):
            sc = scorer.prefill(inp)
            assert not bool(sc.isnan().any()), (name, scorer.name)
            assert bool((sc[1, :, :10] == -INF).all()) and bool((sc[:, :, -w:] == INF).all())
            assert bool(torch.isfinite(sc[0, :, : s - w]).all()) and bool(
                torch.isfinite(sc[1, :, 10 : s - w]).all()
            )
        # zero preferences everywhere: budgets fall back to equal shares, exact and finite
        n = 5
        req = AllocationRequest(torch.full((b,), 12 * n), torch.tensor([s, s - 10]), torch.full((b,), w), n,
                                torch.zeros(b, n, dtype=torch.float64))  # fmt: skip
        budgets = CakeAllocator().allocate(req)
        assert torch.equal(budgets.sum(1), torch.full((b,), 12 * n)) and bool((budgets >= w).all())


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (9, 3)])
@pytest.mark.parametrize(("s", "window"), [(40, 8), (6, 8), (1, 8)])
def test_window_attention_equals_its_reference(heads, kv_heads, s, window):
    """The grouped, in-place window attention against the reference (keys expanded per query
    head, masks built whole): a left-padded row whose window holds padding queries (zero rows),
    prompts shorter than the window, one token."""
    g = torch.Generator().manual_seed(s + heads)
    q = torch.randn(2, heads, s, 16, generator=g)
    k, v = torch.randn(2, kv_heads, s, 16, generator=g), torch.randn(2, kv_heads, s, 16, generator=g)
    valid = torch.ones(2, s, dtype=torch.bool)
    valid[1, : s // 2] = False  # left padding
    inp = PrefillInputs(q, k, v, valid, window, 0.25)
    probs, row_valid = inp.window_attention()
    ref, ref_valid = window_attention_reference(PrefillInputs(q, k, v, valid, window, 0.25))
    assert torch.equal(row_valid, ref_valid)
    torch.testing.assert_close(probs, ref, rtol=1e-6, atol=1e-7)
    assert bool(torch.isfinite(probs).all())
    assert bool((probs[1, :, ~row_valid[1]] == 0).all())  # padding query rows


@pytest.mark.parametrize("routes", [True, False])
@pytest.mark.parametrize(("s", "pad"), [(300, 0), (300, 90), (40, 5)])
def test_cake_shift_reads_the_scores_variance_bit_for_bit(s, pad, routes, monkeypatch):
    """CAKE's preference shift (``cascade.layer_statistics``) reads the window rows' variance its
    score computed (``PrefillInputs.window_mean_var``, once a layer) instead of computing it again
    on the prefix columns: the same bits, padded or not, CPU route or not."""
    from kvcake import devices
    from kvcake.cascade import layer_statistics

    monkeypatch.setattr(devices, "CPU_ROUTES", routes)
    g = torch.Generator().manual_seed(s + pad)
    q, k = torch.randn(2, 9, s, 16, generator=g), torch.randn(2, 3, s, 16, generator=g) * 2
    valid = torch.ones(2, s, dtype=torch.bool)
    valid[1, :pad] = False
    inp = PrefillInputs(q, k, k, valid, 8, 0.25)
    CakeScorer().prefill(inp)
    got = layer_statistics(type("NoSplit", (), {"split": None, "group_split": None}), inp)
    probs, row_valid = PrefillInputs(q, k, k, valid, 8, 0.25).window_attention()
    sub = probs[..., : s - 8]
    _, var = window_rows_mean_var(sub, row_valid)
    entropy = -(sub * torch.log(sub + 1e-10)).sum((1, 2, 3))
    assert torch.equal(got, torch.stack([entropy.double(), var.sum((1, 2)).double()]))


@pytest.mark.parametrize("s", [40, 6])
def test_window_attention_without_padding_skips_its_masks_bit_for_bit(s, monkeypatch):
    """Without padding the CPU route leaves out the padding masks (two passes over the logits):
    the same bits as applying them (the route a GPU takes, ``CPU_ROUTES = False``)."""
    from kvcake import devices

    g = torch.Generator().manual_seed(s)
    q, k = torch.randn(2, 9, s, 16, generator=g), torch.randn(2, 3, s, 16, generator=g)
    valid = torch.ones(2, s, dtype=torch.bool)
    fast, fast_valid = PrefillInputs(q, k, k, valid, 8, 0.25).window_attention()
    monkeypatch.setattr(devices, "CPU_ROUTES", False)
    masked, masked_valid = PrefillInputs(q, k, k, valid, 8, 0.25).window_attention()
    assert torch.equal(fast, masked) and torch.equal(fast_valid, masked_valid)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3)])
@pytest.mark.parametrize(
    ("s", "window", "pad"), [(300, 8, 40), (40, 8, 35), (20, 8, 3), (6, 8, 3), (1, 8, 0)]
)
@pytest.mark.parametrize("block", [900, 6000, 1 << 19])
def test_defensive_cpu_blocks_equal_the_reference(heads, kv_heads, s, window, pad, block, monkeypatch):
    """DefensiveKV's prefill on the CPU (a block of rows at a time, ``_aggregate_cpu``) has the bits
    of the whole-tensor reference (``aggregate_reference``, the CUDA route): a left-padded row (its
    window partly padding queries at ``pad=35``), pooled prefixes shorter than two kernels,
    prompts shorter than the window, one token; blocks of one row, of uneven sizes (5 rows of
    24 at 300 tokens, ``block=6000``) and whole."""
    g = torch.Generator().manual_seed(s + heads + pad)
    q = torch.randn(2, heads, s, 16, generator=g) * 2
    k, v = torch.randn(2, kv_heads, s, 16, generator=g), torch.randn(2, kv_heads, s, 16, generator=g)
    valid = torch.ones(2, s, dtype=torch.bool)
    valid[1, :pad] = False  # left padding
    monkeypatch.setattr(defensive, "_BLOCK", block)
    for kernel, aggregate, mass in [(5, "max", 0.9), (3, "mean", 0.9), (7, "max", 0.0), (1, "max", 0.5)]:
        scorer = DefensiveScorer(kernel=kernel, aggregate=aggregate, critical_mass=mass)
        got = scorer.prefill(PrefillInputs(q, k, v, valid, window, 0.25))
        with monkeypatch.context() as m:
            m.setattr(defensive, "_aggregate_cpu", defensive.aggregate_reference)
            ref = scorer.prefill(PrefillInputs(q, k, v, valid, window, 0.25))
        assert torch.equal(got, ref), (kernel, aggregate)
        probs, _ = PrefillInputs(q, k, v, valid, window, 0.25).window_attention()
        p = s - probs.shape[2]
        if p > 0:
            fast = defensive._aggregate_cpu(probs, valid[:, :p], kv_heads, kernel, aggregate, True)
            slow = defensive.aggregate_reference(probs, valid[:, :p], kv_heads, kernel, aggregate, True)
            assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1]), (kernel, aggregate)


def _tolerant_same(kept_ref: set, kept_low: set, scores: torch.Tensor, rtol: float) -> None:
    """Kept sets may differ only where the reference scores are within ``rtol`` of the
    reference selection threshold (its lowest kept finite score)."""
    diff = kept_ref ^ kept_low
    if not diff:
        return
    finite_kept = [float(scores[i]) for i in kept_ref if torch.isfinite(scores[i])]
    thr = min(finite_kept)
    for i in diff:
        gap = abs(float(scores[i]) - thr)
        assert gap <= rtol * max(abs(thr), 1e-6), (
            f"position {i}: score {float(scores[i]):.4g} vs threshold {thr:.4g}"
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "spec", ["snapkv", "h2o", "tova", "layers=uniform,score=cake", "adakv", "streamingllm"]
)
def test_low_precision_keeps_the_float32_tokens_up_to_ties(peaky_models, dtype, spec):
    input_ids = ids(120, seed=1)
    method = make_method(spec, budget=24, window=8)
    ref, ref_logits = _prefill(peaky_models[torch.float32], input_ids, method, cls=ScoreRecordingCache)
    low, low_logits = _prefill(peaky_models[dtype], input_ids, method)
    assert bool(torch.isfinite(low_logits).all())
    assert torch.equal(ref.budgets, low.budgets)
    ragged = method.heads.ragged
    for lid, (lr, ll) in enumerate(zip(ref.layers, low.layers, strict=True)):
        pr, pl = lr.padded_positions()[0], ll.padded_positions()[0]
        scores = ref.first_scores[lid][0]  # (H_kv, S) float32 scores of the float32 run
        if ragged:  # Ada-KV: heads compete for one layer-wide threshold
            flat = scores.reshape(-1)
            s = scores.shape[-1]
            kr = {h * s + int(p) for h in range(pr.shape[0]) for p in pr[h][pr[h] >= 0]}
            kl = {h * s + int(p) for h in range(pl.shape[0]) for p in pl[h][pl[h] >= 0]}
            assert len(kr) == len(kl), "Ada-KV keeps the same layer total"
            _tolerant_same(kr, kl, flat, TIE_RTOL[dtype])
        else:
            for h in range(pr.shape[0]):
                kr, kl = set(pr[h][pr[h] >= 0].tolist()), set(pl[h][pl[h] >= 0].tolist())
                assert len(kr) == len(kl)
                _tolerant_same(kr, kl, scores[h], TIE_RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_low_precision_cake_budgets_close_to_float32(peaky_models, dtype):
    """CAKE's layer budgets from bf16/fp16 preferences: finite, exact totals, and within a few
    entries of the float32 ones (preferences are computed in float32/float64 from the
    low-precision queries and keys)."""
    input_ids = ids(120, seed=2)
    method = make_method("cake", budget=24, window=8)
    ref, _ = _prefill(peaky_models[torch.float32], input_ids, method)
    low, logits = _prefill(peaky_models[dtype], input_ids, method)
    assert bool(torch.isfinite(logits).all())
    _check_cache(low, [120])
    assert int((ref.budgets - low.budgets).abs().max()) <= 4, (ref.budgets, low.budgets)
