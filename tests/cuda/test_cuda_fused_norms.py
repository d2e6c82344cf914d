"""CriticalKV's value norms in one Triton kernel (``kvcake.fused_norms``) on the GPU: taken for
CUDA inputs where triton is installed, equal to the matmul route's (``FUSED_NORMS = False``) up to
summation order, over head sizes, GQA groups, ragged tile edges and strided values, and the same
bits whichever other positions share a tile (CriticalKV's pruned norms pack the candidates, so a
position's tile changes with them; one-shot and cascade evictions then see the same norms)."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import DEVICE

from kvcake.selectors import value_norms
from kvcake.selectors.value_norms import fused_norms_apply, projected_value_norms

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.fixture(autouse=True)
def _cuda_with_triton():
    if DEVICE.type != "cuda":
        pytest.skip("a CUDA test")
    pytest.importorskip("triton")


def _inputs(dtype, b, h, hkv, s, d, hidden, seed=0):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(b, hkv, s + 5, d, generator=gen)[:, :, 5:]  # strided: not contiguous
    o_weight = torch.randn(hidden, h * d, generator=gen) / d**0.5
    return values.to(DEVICE, dtype), o_weight.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape", [(2, 8, 2, 300, 64, 512), (1, 32, 8, 200, 128, 4096), (1, 4, 4, 67, 16, 200)],
    ids=["gqa4-d64", "llama8b-heads", "mha-d16-ragged-hidden"],
)  # fmt: skip
def test_fused_norms_equal_the_matmul_route(dtype, shape, monkeypatch):
    values, o_weight = _inputs(dtype, *shape)
    h = shape[1]
    assert fused_norms_apply(values, o_weight)
    got = projected_value_norms(values, o_weight, h)
    monkeypatch.setattr(value_norms, "FUSED_NORMS", False)
    ref = projected_value_norms(values, o_weight, h)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=1e-5)


def test_a_positions_norm_does_not_depend_on_its_tile():
    values, o_weight = _inputs(torch.bfloat16, 1, 8, 2, 500, 64, 512, seed=1)
    whole = projected_value_norms(values, o_weight, 8)
    part = projected_value_norms(values[:, :, 37:301], o_weight, 8)  # other tile boundaries
    assert torch.equal(part, whole[:, :, 37:301])


def test_other_inputs_keep_the_matmuls():
    values, o_weight = _inputs(torch.bfloat16, 1, 4, 2, 10, 64, 128)
    assert not fused_norms_apply(values, o_weight.float())  # mixed dtypes
    assert not fused_norms_apply(values[..., :48], o_weight)  # head size not a power of two
    assert not fused_norms_apply(values.cpu(), o_weight.cpu())
