"""Batches with left padding and the ragged attention, on the test device."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import DEVICE, HALF, ids

from kvcake.ragged import RaggedMeta, ragged_attention, ragged_attention_reference
from shared_checks import assert_batch_matches_each_alone
from test_ragged import assert_rel, dense_reference, make_case


@pytest.mark.parametrize("name", ["cake", "snapkv", "adakv", "cake-adakv", "h2o", "critical-adakv"])
def test_left_padded_batch_equals_each_alone(on_device, name):
    """float32: the batch and the single prompt run kernels of different shapes, so exact score
    ties could flip in half precision; the kept sets and greedy tokens must agree in float32."""
    model = on_device(torch.float32)
    a, b = ids(180, seed=8)[0], ids(130, seed=9)[0]
    kw = dict(ratio=0.3, window=8, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert_batch_matches_each_alone(model, name, a, b, 50, **kw)


def _case_on_device(q: int, dtype: torch.dtype):
    query, ks, vs, ps, qpos, meta = make_case(2, 6, 2, [9, 40, 17, 33], q, seed=5 + q)
    ref = dense_reference(query, ks, vs, ps, qpos, 16**-0.5)  # float64 on the host
    args = (
        query.to(DEVICE, dtype), torch.cat(ks).to(DEVICE, dtype), torch.cat(vs).to(DEVICE, dtype),
        torch.cat(ps).to(DEVICE), RaggedMeta.from_lengths(meta.lengths.to(DEVICE)), qpos.to(DEVICE),
    )  # fmt: skip
    return args, ref


@pytest.mark.parametrize("q", [1, 5])
def test_ragged_reference_on_device_equals_dense_reference(q):
    (query, k, v, pos, meta, qpos), ref = _case_on_device(q, torch.float64)
    out, probs = ragged_attention_reference(query, k, v, pos, meta, qpos, 16**-0.5, return_probs=True)
    assert out.device.type == DEVICE.type and probs.device.type == DEVICE.type
    assert_rel(out.cpu(), ref)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("q", [1, 5])
def test_ragged_dispatch_in_half_precision(q, dtype):
    """Whatever kernel serves the device (flash varlen on CUDA when installed, else the PyTorch
    reference) against the float64 dense reference of the same half-rounded inputs: the output is
    rounded to ``dtype`` once (relative error eps/2) after float32 accumulation, so 2 * eps bounds
    the norm-relative error."""
    (query, k, v, pos, meta, qpos), _ = _case_on_device(q, dtype)
    back = lambda t: t.double().cpu()  # noqa: E731
    n = meta.lengths.cpu()
    split = lambda t: list(back(t).split(n.tolist()))  # noqa: E731
    ref = dense_reference(
        back(query), split(k), split(v), list(pos.cpu().split(n.tolist())), qpos.cpu(), 16**-0.5
    )
    out, _ = ragged_attention(query, k, v, pos, meta, qpos, 16**-0.5)
    assert out.dtype == dtype and out.device.type == DEVICE.type
    assert_rel(out.cpu(), ref, tol=2 * torch.finfo(dtype).eps)
