"""The matmuls of bf16/fp16 inputs with float32 results (``kvcake.matmul``) on the GPU: taken for
half inputs, and CriticalKV's projected value norms through them equal the float32 copies' (the
products are exact in float32; only the summation order differs)."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import DEVICE, HALF

from kvcake import matmul
from kvcake.selectors import value_norms
from kvcake.selectors.value_norms import _NORM_CHUNK, projected_value_norms


@pytest.fixture(autouse=True)
def _cuda_only():
    if DEVICE.type != "cuda":
        pytest.skip("a CUDA test")


def test_half_inputs_take_the_route_and_float32_does_not():
    for dtype in HALF:
        assert matmul.half_matmuls(torch.zeros(1, device=DEVICE, dtype=dtype)), dtype
    assert not matmul.half_matmuls(torch.zeros(1, device=DEVICE))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_projected_value_norms_equal_the_float32_route(dtype, monkeypatch):
    monkeypatch.setattr(value_norms, "FUSED_NORMS", False)  # the matmuls (the fused kernel: its own file)
    gen = torch.Generator().manual_seed(0)
    b, h, hkv, s, d, hidden = 2, 8, 2, _NORM_CHUNK + 300, 64, 512
    values = torch.randn(b, hkv, s, d, generator=gen).to(DEVICE, dtype)
    o_weight = (torch.randn(hidden, h * d, generator=gen) / d**0.5).to(DEVICE, dtype)
    got = projected_value_norms(values, o_weight, h)
    # the float32 route on the same (half-precision) numbers
    ref = projected_value_norms(values.float(), o_weight.float(), h)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
