"""H2O's prompt attention and column sums in two FlexAttention passes (``kvcake.flex``, the CUDA
route), run here uncompiled against the blockwise route (its reference) and SDPA, and the route's
choice and its way out when the kernel fails. Tolerance as tests/test_h2o_fused.py: float32 sums
of the same terms in another order (1e-5)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from kvcake import flex
from kvcake.scorers import h2o

pytestmark = [
    pytest.mark.skipif(not flex.flex_available(), reason="this torch has no FlexAttention"),
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),  # uncompiled on purpose
]


def _inputs(batch=2, heads=6, kv_heads=2, s=300, d=16, pad=150, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, n, s, d, generator=g) for n in (heads, kv_heads, kv_heads))
    valid = torch.ones(batch, s, dtype=torch.bool)
    valid[-1, :pad] = False  # the last sequence left-padded past the first block
    mask = torch.ones(s, s, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]  # (B, 1, S, S)
    return q, k, v, valid, mask


@pytest.mark.parametrize("s", [100, 256, 300])  # within one block, two whole blocks, a partial third
@pytest.mark.parametrize("kv_heads", [1, 2, 6])
@pytest.mark.parametrize("masked", [False, True])
def test_two_passes_equal_the_blockwise_route_and_sdpa(s, kv_heads, masked):
    q, k, v, valid, mask = _inputs(kv_heads=kv_heads, s=s, pad=min(150, s // 2))
    if not masked:
        valid, mask = torch.ones_like(valid), None
    out, sums = flex.flex_attention_with_column_sums(q, k, v, mask, valid, 0.3, compiled=False)
    ref_out, ref_sums = h2o.attention_with_column_sums(q, k, v, mask, valid, 0.3)
    torch.testing.assert_close(sums, ref_sums, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    sdpa = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=0.3, enable_gqa=True
    )
    torch.testing.assert_close(out, sdpa.transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert out.shape == (2, s, 6, 16) and sums.shape == (2, 6, s) and sums.dtype == torch.float32
    if masked:  # padding rows: 0 out, and nothing added to any key's sum (their keys get nothing)
        pad = min(150, s // 2)
        assert bool((out[-1, :pad] == 0).all()) and bool((sums[-1, :, :pad] == 0).all())
    # every valid query row's attention sums to 1, so the sums add up to the number of valid rows
    torch.testing.assert_close(sums.sum((1, 2)), 6 * valid.sum(1).float(), rtol=1e-5, atol=1e-3)


def test_a_torch_without_aux_requests_is_asked_for_return_lse(monkeypatch):
    """``AuxRequest`` (``return_lse`` warns from torch 2.14 on) is used where torch has it; a
    release without it (torch 2.5-2.8) is asked ``return_lse=True``, and the two passes give the
    same output and sums (a stand-in kernel taking only ``return_lse``, as those releases' does)."""
    import torch.nn.attention.flex_attention as fa

    if not hasattr(fa, "AuxRequest"):
        pytest.skip("this torch has no AuxRequest: every other test here runs the return_lse route")
    q, k, v, valid, mask = _inputs(s=100, pad=50)
    want = flex.flex_attention_with_column_sums(q, k, v, mask, valid, 0.3, compiled=False)
    kernel, aux, asked = fa.flex_attention, fa.AuxRequest, []

    def old_kernel(*args, return_lse=False, **kwargs):
        asked.append(return_lse)
        out, got = kernel(*args, return_aux=aux(lse=True), **kwargs)
        return out, got.lse

    monkeypatch.delattr(fa, "AuxRequest")
    monkeypatch.setattr(fa, "flex_attention", old_kernel)
    got = flex.flex_attention_with_column_sums(q, k, v, mask, valid, 0.3, compiled=False)
    assert asked == [True, True]  # both passes
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_causal_blocks_cover_the_triangle_once():
    """The block masks' dense form: causal (full + diagonal blocks) and transposed (partial)."""
    s = 300
    plain = flex.causal_blocks(s, torch.device("cpu"), later=False)
    later = flex.causal_blocks(s, torch.device("cpu"), later=True, mask_mod=lambda b, h, i, j: j >= i)
    assert torch.equal(plain.to_dense()[0, 0].bool(), torch.ones(3, 3, dtype=torch.bool).tril())
    assert torch.equal(later.to_dense()[0, 0].bool(), torch.ones(3, 3, dtype=torch.bool).triu())
    assert int(plain.full_kv_num_blocks.sum()) == 3  # blocks (1, 0), (2, 0), (2, 1)
    with pytest.raises(ValueError, match="mask_mod"):
        flex.causal_blocks(s, torch.device("cpu"), later=True)


def test_route_is_cuda_only_and_taken_there(monkeypatch):
    q, k, v, valid, mask = _inputs(s=64, pad=10)
    assert not flex.uses_flex(q), "the CPU keeps the blockwise route"
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return flex.flex_attention_with_column_sums(*args, **kwargs, compiled=False)

    monkeypatch.setattr(h2o, "uses_flex", lambda query: True)  # as on CUDA
    monkeypatch.setattr(h2o, "flex_attention_with_column_sums", spy)
    out, sums = h2o.attention_with_column_sums(q, k, v, mask, valid, 0.3)
    assert calls == [q.shape]
    monkeypatch.undo()
    ref_out, ref_sums = h2o.attention_with_column_sums(q, k, v, mask, valid, 0.3)
    torch.testing.assert_close(sums, ref_sums, rtol=1e-5, atol=1e-5)


def test_a_failing_kernel_turns_the_route_off_with_a_warning(monkeypatch, caplog):
    q, k, v, valid, mask = _inputs(s=64, pad=10)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this build")

    monkeypatch.setattr(flex, "_flex", lambda: broken)
    monkeypatch.setattr(flex, "_broken", [])
    assert flex.route_open()
    with caplog.at_level(logging.WARNING, logger="kvcake.flex"):
        assert flex.flex_attention_with_column_sums(q, k, v, mask, valid, 0.3) is None
    assert "no kernel for this build" in caplog.text and flex._broken
    assert not flex.route_open(), "off for the process once it failed"
    with pytest.raises(RuntimeError, match="no kernel"):  # uncompiled (the tests' own calls): raised
        monkeypatch.setattr("torch.nn.attention.flex_attention.flex_attention", broken)
        flex.flex_attention_with_column_sums(q, k, v, mask, valid, 0.3, compiled=False)
