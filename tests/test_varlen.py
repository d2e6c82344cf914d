"""The variable-length kernel route (``kvcake.varlen``), checked on the CPU with the kernels replaced.

A fake kernel implements the documented semantics of ``varlen_attn`` / ``flash_attn_varlen_func``
(per-sequence attention, causal aligned bottom-right, GQA) with a plain loop, so these tests
check what kvcake hands the kernel (packing, cumulative lengths, reshapes, the causal flag) and
which route each device and dtype takes. The real kernels are compared with the reference in
``tests/cuda/test_cuda_varlen.py``.
"""

from __future__ import annotations

import pytest
import torch

from kvcake import ragged, varlen
from kvcake.ragged import RaggedMeta, ragged_attention, ragged_attention_reference
from kvcake.varlen import choose_route, varlen_attention, varlen_reference

CUDA = torch.device("cuda")


def fake_kernel(calls: list, *, torch_api: bool, release: str = "2.13"):
    """A loop over sequences with one KV head (what kvcake passes), recording each call. ``release``:
    the signature of that torch's ``varlen_attn`` (2.11: no ``enable_gqa``, no ``seqused_k``, GQA
    done by its flash kernel unasked; 2.13: both, and differing head counts refused without
    ``enable_gqa=True``), so a keyword a release lacks fails here as it fails there."""

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, causal_flag, scale, seqused=None):
        assert q.dtype == k.dtype and cu_q.dtype == cu_k.dtype == torch.int32 and k.shape[1] == 1
        out = torch.zeros_like(q)
        for s in range(cu_q.numel() - 1):
            qs = q[cu_q[s] : cu_q[s + 1]].double()  # (q, G, d)
            used = int(cu_k[s + 1] - cu_k[s]) if seqused is None else int(seqused[s])
            ks, vs = k[cu_k[s] : cu_k[s] + used, 0].double(), v[cu_k[s] : cu_k[s] + used, 0].double()
            logits = torch.einsum("qgd,nd->gqn", qs, ks) * scale
            if causal_flag:  # bottom-right: row i sees entries < used - nq + i + 1
                nq = qs.shape[0]
                seen = torch.arange(used)[None, :] < (used - nq + torch.arange(nq)[:, None] + 1)
                logits = logits.masked_fill(~seen[None], float("-inf"))
            out[cu_q[s] : cu_q[s + 1]] = torch.einsum("gqn,nd->qgd", torch.softmax(logits, -1), vs).to(
                q.dtype
            )
        calls.append(dict(max_q=max_q, max_k=max_k, causal=causal_flag, seqused=seqused is not None))
        return out

    if torch_api and release == "2.11":

        def varlen_attn(
            q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
        ):
            assert window_size in ((-1, 0), (-1, -1))
            return kernel(q, k, v, cu_q, cu_k, max_q, max_k, causal_flag=window_size == (-1, 0), scale=scale)

        return varlen_attn

    if torch_api:

        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                        enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):  # fmt: skip
            if not enable_gqa and q.shape[1] != k.shape[1]:
                raise ValueError("Expect query and key/value to have the same number of heads")
            assert window_size in ((-1, 0), (-1, -1))
            return kernel(q, k, v, cu_q, cu_k, max_q, max_k, causal_flag=window_size == (-1, 0), scale=scale,
                          seqused=seqused_k)  # fmt: skip

        return varlen_attn

    def flash_attn_varlen_func(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                               causal):  # fmt: skip
        return kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal_flag=causal,
                      scale=softmax_scale)  # fmt: skip

    return flash_attn_varlen_func


@pytest.fixture
def installed(monkeypatch):
    """``installed(torch_varlen=bool, flash=bool)``: which kernels this process has, faked; returns the calls."""
    calls: list = []

    def set_(torch_varlen: bool, flash: bool, release: str = "2.13") -> list:
        monkeypatch.setattr(
            varlen,
            "_torch_varlen",
            lambda: fake_kernel(calls, torch_api=True, release=release) if torch_varlen else None,
        )
        monkeypatch.setattr(
            varlen, "_flash_varlen", lambda: fake_kernel(calls, torch_api=False) if flash else None
        )
        return calls

    return set_


@pytest.mark.parametrize(
    "torch_varlen,flash,device,dtype,route",
    [
        (True, True, CUDA, torch.bfloat16, "torch-varlen"),  # torch's own kernel first
        (False, True, CUDA, torch.float16, "flash-attn"),
        (False, False, CUDA, torch.bfloat16, "reference"),
        (True, True, CUDA, torch.float32, "reference"),  # the kernels take half precision only
        (True, True, torch.device("cpu"), torch.bfloat16, "reference"),
    ],
)
def test_route_by_device_dtype_and_install(installed, torch_varlen, flash, device, dtype, route):
    installed(torch_varlen, flash)
    assert choose_route(device, dtype) == route


def test_flash_cannot_skip_unused_slots(installed):
    installed(False, True)
    assert choose_route(CUDA, torch.bfloat16, seqused=True) == "reference"
    installed(True, True)
    assert choose_route(CUDA, torch.bfloat16, seqused=True) == "torch-varlen"
    installed(True, True, release="2.11")  # torch 2.11's varlen_attn has no seqused_k
    assert choose_route(CUDA, torch.bfloat16, seqused=True) == "reference"
    assert choose_route(CUDA, torch.bfloat16) == "torch-varlen"
    query, keys, values, meta = _case(lengths=(12, 12, 12, 12), q=1)
    with pytest.raises(ValueError, match="cannot skip unused slots"):
        varlen_attention(query, keys, values, meta.offsets, 12, 0.25, seqused=torch.tensor([5, 12, 7, 3]),
                         route="torch-varlen")  # fmt: skip


def _case(b=2, h=6, hkv=2, lengths=(9, 40, 5, 33), q=1, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    t = int(lengths.sum())
    query = torch.randn(b, h, q, d, generator=g).to(dtype)
    keys, values = torch.randn(t, d, generator=g).to(dtype), torch.randn(t, d, generator=g).to(dtype)
    return query, keys, values, RaggedMeta.from_lengths(lengths)


@pytest.mark.parametrize("route", ["torch-varlen", "torch-varlen 2.11", "flash-attn"])
@pytest.mark.parametrize("q", [1, 4])
def test_kernel_routes_equal_the_reference(installed, route, q):
    """What kvcake hands each kernel gives the reference's answer (GQA 3, skewed segments, q rows),
    with the keywords each torch release's ``varlen_attn`` takes (2.11's: no ``enable_gqa``)."""
    route, _, release = route.partition(" ")
    calls = installed(True, True, release=release or "2.13")
    query, keys, values, meta = _case(q=q, lengths=(9, 40, 5, 33))
    out = varlen_attention(query, keys, values, meta.offsets, meta.max_len, 0.25, route=route)
    ref = varlen_reference(query, keys, values, meta.offsets, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert calls == [dict(max_q=q, max_k=40, causal=q > 1, seqused=False)]


def test_seqused_skips_the_unused_tail(installed):
    installed(True, False)
    query, keys, values, meta = _case(lengths=(12, 12, 12, 12), q=2)
    used = torch.tensor([5, 12, 7, 3])
    out = varlen_attention(query, keys, values, meta.offsets, 12, 0.25, seqused=used, route="torch-varlen")
    torch.testing.assert_close(out, varlen_reference(query, keys, values, meta.offsets, 0.25, seqused=used))
    # the reference with the tails cut off: the same as compact segments of the used lengths
    keep = torch.cat([torch.arange(12 * s, 12 * s + int(n)) for s, n in enumerate(used)])
    compact = RaggedMeta.from_lengths(used)
    torch.testing.assert_close(out, varlen_reference(query, keys[keep], values[keep], compact.offsets, 0.25))


def test_ragged_attention_calls_the_kernel_route(installed, monkeypatch):
    """The ragged cache's call site: one varlen call when a kernel route is chosen, and the result
    of its own segment-softmax reference; probabilities stay on the reference."""
    calls = installed(True, False)
    monkeypatch.setattr(ragged, "choose_route", lambda device, dtype: "torch-varlen")
    query, keys, values, meta = _case(q=3, lengths=(9, 40, 5, 33))
    # compact segments, positions increasing, the 3 new tokens (97, 98, 99) last in every segment
    qpos = (torch.full((2, 3), 97) + torch.arange(3)[None]).contiguous()
    positions = torch.cat([torch.arange(100 - int(n), 100) for n in meta.lengths])
    out, probs = ragged_attention(query, keys, values, positions, meta, qpos, 0.25)
    assert probs is None and len(calls) == 1
    ref, _ = ragged_attention_reference(query, keys, values, positions, meta, qpos, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    ragged_attention(query, keys, values, positions, meta, qpos, 0.25, return_probs=True)
    assert len(calls) == 1


def test_reference_on_the_cpu_is_the_segment_softmax():
    """On the CPU no kernel is called: the ragged cache's result is its reference's, bit for bit."""
    query, keys, values, meta = _case(q=1)
    positions = torch.cat([torch.arange(int(n)) for n in meta.lengths])
    qpos = torch.full((2, 1), 1000)
    out, _ = ragged_attention(query, keys, values, positions, meta, qpos, 0.25)
    ref, _ = ragged_attention_reference(query, keys, values, positions, meta, qpos, 0.25)
    assert torch.equal(out, ref)
    torch.testing.assert_close(out, varlen_reference(query, keys, values, meta.offsets, 0.25).float())


def test_bad_route_and_layout():
    query, keys, values, meta = _case()
    with pytest.raises(ValueError, match="unknown varlen route 'cudnn'"):
        varlen_attention(query, keys, values, meta.offsets, meta.max_len, 0.25, route="cudnn")
    with pytest.raises(ValueError, match="segments do not split"):
        varlen_attention(query, keys, values, meta.offsets[:-1], meta.max_len, 0.25)


@pytest.mark.parametrize("release", ["2.11", "2.13"])
@pytest.mark.filterwarnings("error:Dynamo detected a call to a `functools.lru_cache`")
def test_the_kernel_call_traces_whole(monkeypatch, release):
    """The compiled decode step calls the kernel route inside its graph: choosing the keywords a
    release's ``varlen_attn`` takes (``inspect.signature``) must not break it (fullgraph=True),
    nor be traced (dynamo's frozenset failed on torch 2.4; torch 2.14 warns that it traces through
    the lookup's cache): the step bakes the answer in."""

    def v211(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        return q * scale + 0 * k.sum()

    def v213(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
             enable_gqa=False, seqused_k=None):  # fmt: skip
        assert enable_gqa
        return q * scale + 0 * k.sum() + 0 * (0 if seqused_k is None else seqused_k.sum())

    monkeypatch.setattr(varlen, "_torch_varlen", lambda: v211 if release == "2.11" else v213)
    query, keys, values, meta = _case(lengths=(12, 12, 12, 12), q=1)
    used = None if release == "2.11" else torch.tensor([5, 12, 7, 3])

    def call(q, k, v):
        return varlen_attention(q, k, v, meta.offsets, 12, 0.25, seqused=used, route="torch-varlen")

    torch._dynamo.reset()
    out = torch.compile(call, fullgraph=True, backend="eager")(query, keys, values)
    torch.testing.assert_close(out, call(query, keys, values))
