"""H2O's fused prompt attention (``kvcake.scorers.h2o.attention_with_column_sums``) on the GPU:
against SDPA and the reference column sums, float32 and bf16/fp16 inputs, a left-padded batch
and an unpadded one (causal, no mask) with GQA groups of 4. On CUDA it runs the two compiled
FlexAttention passes (``kvcake.flex``); the test fails if that route failed and fell back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cuda_helpers import DEVICE, HALF

from kvcake import flex
from kvcake.scorers import h2o
from kvcake.scorers.base import PrefillInputs


def _case(dtype, b=2, h=8, hkv=2, s=1500, d=64, pad=300):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=gen).to(DEVICE, dtype) for n in (h, hkv, hkv))
    valid = torch.ones(b, s, dtype=torch.bool, device=DEVICE)
    valid[-1, :pad] = False
    mask = torch.ones(s, s, dtype=torch.bool, device=DEVICE).tril()[None, None] & valid[:, None, None, :]
    return q, k, v, valid, mask


@pytest.mark.parametrize("masked", [True, False], ids=["padded", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_fused_matches_sdpa_and_the_reference(dtype, masked):
    if DEVICE.type != "cuda":
        pytest.skip("a CUDA test")
    q, k, v, valid, mask = _case(dtype)
    if not masked:
        valid, mask = torch.ones_like(valid), None
    assert flex.uses_flex(q) or not flex.flex_available()
    out, sums = h2o.attention_with_column_sums(q, k, v, mask, valid, 0.125)
    assert flex.route_open() or not flex.flex_available(), f"the FlexAttention route failed: {flex._broken}"
    qf, kf, vf = (x.float() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(
        qf, kf, vf, attn_mask=mask, is_causal=mask is None, scale=0.125, enable_gqa=True
    )
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.transpose(1, 2), rtol=tol, atol=tol)
    ref_sums = h2o.accumulated_attention(PrefillInputs(qf, kf, vf, valid, 8, 0.125), chunk=512)
    torch.testing.assert_close(sums, ref_sums, rtol=1e-4, atol=1e-4)


def test_flex_route_across_prompt_lengths():
    """New prompt lengths recompile the FlexAttention passes (the second makes the length dynamic):
    the route stays open and each length's sums equal the reference's."""
    if DEVICE.type != "cuda":
        pytest.skip("a CUDA test")
    for s in (700, 1500, 2300, 129):
        q, k, v, valid, _ = _case(torch.bfloat16, b=1, s=s, pad=0)
        out, sums = h2o.attention_with_column_sums(q, k, v, None, valid, 0.125)
        assert flex.route_open() or not flex.flex_available(), (
            f"the FlexAttention route failed: {flex._broken}"
        )
        qf, kf, vf = (x.float() for x in (q, k, v))
        ref_sums = h2o.accumulated_attention(PrefillInputs(qf, kf, vf, valid, 4, 0.125), chunk=512)
        torch.testing.assert_close(sums, ref_sums, rtol=1e-4, atol=1e-4)
        assert out.shape == (1, s, 8, 64)
