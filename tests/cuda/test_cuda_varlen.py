"""Each variable-length kernel this GPU has (``kvcake.varlen``) against the float32 reference:
torch's ``varlen_attn`` and flash-attention's, bf16 and fp16, one or several query rows,
segments of 5 to 2000 entries, GQA groups of 4, compact and with unused tails (``seqused``)."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import DEVICE, HALF

from kvcake import varlen
from kvcake.ragged import RaggedMeta
from kvcake.varlen import varlen_attention, varlen_reference

ROUTES = {"torch-varlen": varlen._torch_varlen, "flash-attn": varlen._flash_varlen}


def _case(dtype, q, lengths, b=2, hkv=4, g=4, d=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    t = int(lengths.sum())
    query = torch.randn(b, hkv * g, q, d, generator=gen)
    keys, values = torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen)
    meta = RaggedMeta.from_lengths(lengths.to(DEVICE))
    return [x.to(DEVICE, dtype) for x in (query, keys, values)], meta


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("q", [1, 4])
def test_kernel_matches_reference(route, dtype, q):
    if DEVICE.type != "cuda":
        pytest.skip("the kernels run on CUDA only")
    if ROUTES[route]() is None:
        pytest.skip(f"{route} is not available in this environment")
    (query, keys, values), meta = _case(dtype, q, [5, 2000, 17, 1024, 300, 64, 999, 8])
    out = varlen_attention(query, keys, values, meta.offsets, meta.max_len, 128**-0.5, route=route)
    ref = varlen_reference(query.float(), keys.float(), values.float(), meta.offsets, 128**-0.5)
    err = float((out.float() - ref).abs().max())
    assert out.dtype == dtype and err < (1e-2 if dtype == torch.bfloat16 else 2e-3), f"{route} {dtype}: {err}"


@pytest.mark.parametrize("dtype", HALF)
def test_torch_varlen_skips_unused_tails(dtype):
    if DEVICE.type != "cuda" or varlen._torch_varlen() is None:
        pytest.skip("torch's varlen_attn on CUDA only")
    (query, keys, values), meta = _case(dtype, 2, [256] * 8)
    used = torch.tensor([5, 256, 17, 100, 3, 64, 200, 8], device=DEVICE)
    out = varlen_attention(
        query, keys, values, meta.offsets, 256, 128**-0.5, seqused=used, route="torch-varlen"
    )
    ref = varlen_reference(query.float(), keys.float(), values.float(), meta.offsets, 128**-0.5, seqused=used)
    assert float((out.float() - ref).abs().max()) < 1e-2
