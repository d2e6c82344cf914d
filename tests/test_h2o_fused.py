"""H2O's column sums from the prompt's own attention (issue 23, prefill work).

``attention_with_column_sums`` computes the prompt's attention once and H2O's accumulated
attention from the same probabilities, instead of SDPA followed by a second pass over the
``S x S`` matrix (``accumulated_attention``, the reference). Tolerance: both results are float32
sums of the same terms in another order (measured at most 2e-6 on these sizes; asserted at 1e-5).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kvcake
from kvcake import KVCakeCache, make_method
from kvcake.adapters import with_cache
from kvcake.scorers import h2o
from kvcake.scorers.base import PrefillInputs
from shared_checks import prompt


def _inputs(batch=2, heads=6, kv_heads=2, s=70, d=16, pad=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, n, s, d, generator=g) for n in (heads, kv_heads, kv_heads))
    valid = torch.ones(batch, s, dtype=torch.bool)
    valid[-1, :pad] = False  # the last sequence left-padded
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    mask = causal[None, None] & valid[:, None, None, :]  # transformers' SDPA mask: (B, 1, S, S)
    return q, k, v, valid, mask


@pytest.mark.parametrize("kv_heads", [1, 2, 6])
@pytest.mark.parametrize("rows", [None, 7, 16, 70, 200])
@pytest.mark.parametrize("masked", [False, True])
def test_equals_sdpa_and_the_reference_sums(kv_heads, rows, masked):
    q, k, v, valid, mask = _inputs(kv_heads=kv_heads)
    if not masked:  # no padding: transformers passes no mask and SDPA runs causal
        valid, mask = torch.ones_like(valid), None
    out, sums = h2o.attention_with_column_sums(q, k, v, mask, valid, 0.3, rows)
    ref = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=0.3, enable_gqa=True
    )
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)
    ref_sums = h2o.accumulated_attention(PrefillInputs(q, k, v, valid, 4, 0.3), chunk=512)
    torch.testing.assert_close(sums, ref_sums, rtol=1e-5, atol=1e-5)
    if masked:  # a padding query row sees no key: 0 out, as SDPA gives, and adds nothing to the sums
        assert bool((out[-1, :20] == 0).all())
        assert bool((sums[-1, :, :20] == 0).all())


def _far_logits(kind: str, s=70, d=16):
    """Inputs whose logits overflow float32's exponential ("large": up to ~±100) or sit near -96
    in every row ("small": every exponential a subnormal), where the CPU's unshifted exponentials
    must fall back to subtracting the maxima; "near": ordinary logits, where they must not."""
    q, k, v, valid, mask = _inputs(kv_heads=2, s=s, d=d)
    if kind == "large":
        q = q * 25
    elif kind == "small":  # every key near one direction, every query opposite it
        k = torch.ones_like(k) + 0.01 * k
        q = -20 * torch.ones_like(q) + 0.01 * q
    return q, k, v, valid, mask


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("kind", ["near", "large", "small"])
def test_unshifted_exponentials_fall_back_where_inexact(kind, masked):
    from kvcake.bench.step_counts import CountOps

    q, k, v, valid, mask = _far_logits(kind)
    if not masked:
        valid, mask = torch.ones_like(valid), None
    with CountOps() as counted:
        out, sums = h2o.attention_with_column_sums(q, k, v, mask, valid, 0.3, 16)
    ref = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=0.3, enable_gqa=True
    )
    # logits near ±100 carry their float32 rounding (~1e-5) into the probabilities: SDPA's own
    # flash and math kernels differ by 1.5e-5 on the "large" inputs
    tol = 1e-5 if kind == "near" else 1e-4
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=tol, atol=tol)
    ref_sums = h2o.accumulated_attention(PrefillInputs(q, k, v, valid, 3, 0.3), chunk=512)
    torch.testing.assert_close(sums, ref_sums, rtol=tol, atol=tol)
    shifted = counted.ops["aten.amax.default"]  # one per block computed with its maxima subtracted
    if kind == "near":
        assert shifted == 0
    elif kind == "small":
        assert shifted == 5  # every block of 16 of the 70 rows
    else:  # the blocks whose largest logit overflows the bound
        assert 0 < shifted <= 5


def test_block_rows_fit_the_block():
    low, high = h2o.CPU_ROWS
    for length in (1, 100, 2048, 4096, 8192, 16384, 1 << 20):
        rows = h2o.block_rows(1, 9, length, torch.device("cpu"))
        assert low <= rows <= high and rows & (rows - 1) == 0
        assert rows == low or 4 * 9 * rows * length <= h2o.BLOCK_BYTES  # the largest that fits
        assert rows == high or 4 * 9 * 2 * rows * length > h2o.BLOCK_BYTES
    # SmolLM2-135M's 9 heads: 64 rows up to 4096 tokens, 32 beyond (scripts/h2o_block_rows.py)
    assert [h2o.block_rows(1, 9, n, torch.device("cpu")) for n in (4096, 8192, 16384)] == [64, 32, 32]
    for length in (1, 4096, 1 << 20):
        rows = h2o.block_rows(1, 9, length, torch.device("cuda"))
        assert rows >= h2o.MIN_ROWS and (
            rows == h2o.MIN_ROWS or 4 * 9 * rows * length <= h2o.DEVICE_BLOCK_BYTES
        )
    assert h2o.block_rows(1, 9, 4096, torch.device("cuda")) > h2o.block_rows(1, 9, 4096, torch.device("cpu"))


def test_masks_it_does_not_read_as_sdpa_does_take_the_stock_kernel():
    q, k, v, valid, mask = _inputs()
    scorer = h2o.H2OScorer()
    assert scorer.prompt_attention(q, k, v, mask.float(), valid, 0.3) is None  # additive
    assert scorer.prompt_attention(q, k, v, mask.expand(-1, 6, -1, -1), valid, 0.3) is None  # per head
    assert scorer.prompt_attention(q, k, v, mask[..., :-1, :], valid, 0.3) is None  # not S x S
    assert h2o.H2OScorer(fused=False).prompt_attention(q, k, v, mask, valid, 0.3) is None


def _prefill(model, spec, ids, mask=None, budget=24):
    cache = KVCakeCache(model, make_method(spec, budget=budget, window=4), record=True)
    with kvcake.enable(model), torch.no_grad():
        out = model(ids, attention_mask=mask, **with_cache(model, cache))
    return cache, out.logits


def _fail(*args, **kwargs):
    raise AssertionError("the path this test rules out ran")


@pytest.mark.parametrize("padded", [False, True])
def test_fused_prefill_keeps_what_the_reference_keeps(tiny_llama, monkeypatch, padded):
    """Every compressed layer takes the fused kernel (the reference sums would fail here), and the
    kept sets and logits are the reference's (``score.fused=false``: SDPA, then the second pass)."""
    ids = prompt(90, seed=5, batch=2)
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[1, :25] = 0
    with monkeypatch.context() as patch:
        patch.setattr(h2o, "accumulated_attention", _fail)
        fused, logits = _prefill(tiny_llama, "h2o", ids, mask)
    calls = []
    real = h2o.attention_with_column_sums
    monkeypatch.setattr(h2o, "attention_with_column_sums", lambda *a, **k: calls.append(1) or real(*a, **k))
    ref, ref_logits = _prefill(tiny_llama, "h2o,score.fused=false", ids, mask)
    assert calls == [], "score.fused=false took the fused kernel"
    valid = slice(None) if mask is None else mask.bool()
    torch.testing.assert_close(logits[valid], ref_logits[valid], rtol=1e-5, atol=1e-5)
    assert np.array_equal(fused.layer_counts(), ref.layer_counts())
    assert len(fused.history) == len(ref.history) > 0
    for (_, lid, kept), (_, ref_lid, ref_kept) in zip(fused.history, ref.history, strict=True):
        assert lid == ref_lid and torch.equal(kept.sort(-1).values, ref_kept.sort(-1).values)


def test_a_budget_covering_the_prompt_keeps_the_stock_kernel(tiny_llama, monkeypatch):
    """Nothing is evicted: SDPA runs, so the output stays bit-identical to the full cache's."""
    ids = prompt(40, seed=2)
    monkeypatch.setattr(h2o, "attention_with_column_sums", _fail)
    _, logits = _prefill(tiny_llama, "h2o", ids, budget=64)
    with torch.no_grad():
        full = tiny_llama(ids).logits
    assert torch.equal(logits, full)


@pytest.mark.parametrize("tiny_llama", ["eager"], indirect=True)
def test_other_kernels_score_after_the_stock_kernel(tiny_llama, monkeypatch):
    """The fused kernel is SDPA's math: a model on another kernel keeps it and the reference sums."""
    monkeypatch.setattr(h2o, "attention_with_column_sums", _fail)
    cache, logits = _prefill(tiny_llama, "h2o", prompt(90, seed=5))
    assert bool(torch.isfinite(logits).all()) and cache.layer_counts().max() <= 24


def test_fused_must_be_a_bool():
    with pytest.raises(ValueError, match="H2O fused must be true or false"):
        make_method("h2o,score.fused=1", budget=64)


def test_the_half_precision_route_on_emulated_kernels(monkeypatch):
    """The CUDA route for bf16/fp16 inputs (``h2o.half_matmuls``: matmuls of the inputs with float32
    results) run here with its kernel emulated (float32 products of the half inputs, as the CUDA
    kernel accumulates them): the logits, so the column sums, equal the float32 route's up to
    rounding; the output up to the probabilities' rounding to bf16 before the product with the
    values, as flash attention rounds them. tests/cuda/test_cuda_h2o_fused.py runs the kernel."""
    assert not h2o.half_matmuls(torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16))  # the CPU: float32 copies
    calls = []

    def emulated(a, b, out, alpha=1.0):
        assert a.dtype == b.dtype == torch.bfloat16 and out.dtype == torch.float32
        calls.append(a.shape)
        return torch.mul(torch.bmm(a.float(), b.float()), alpha, out=out)

    q, k, v, valid, mask = _inputs(kv_heads=2)
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    ref_out, ref_sums = h2o.attention_with_column_sums(q, k, v, mask, valid, 0.3, 16)
    monkeypatch.setattr(h2o, "half_matmuls", lambda query: True)
    monkeypatch.setattr(h2o, "matmul_f32", emulated)
    out, sums = h2o.attention_with_column_sums(q, k, v, mask, valid, 0.3, 16)
    assert len(calls) == 2 * 5  # logits and values, per block of 16 rows of 70
    assert out.dtype == torch.bfloat16 and sums.dtype == torch.float32
    torch.testing.assert_close(sums, ref_sums, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
    assert bool((out[-1, :20] == 0).all())  # a padding row still sees nothing
