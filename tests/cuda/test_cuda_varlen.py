"""Each variable-length kernel this GPU has (``kvcake.varlen``) against the float32 reference:
torch's ``varlen_attn`` and flash-attention's, bf16 and fp16, one or several query rows,
segments of 5 to 2000 entries, GQA groups of 4, compact and with unused tails (``seqused``)."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import DEVICE, HALF, ids

import kvcake
from kvcake import KVCakeCache, make_method, varlen
from kvcake.adapters import with_cache
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
    if not varlen._torch_varlen_seqused():  # torch 2.11's varlen_attn has no seqused_k
        assert varlen.choose_route(DEVICE, dtype, seqused=True) == "reference"
        with pytest.raises(ValueError, match="no seqused_k.*reference route"):
            varlen_attention(
                query, keys, values, meta.offsets, 256, 128**-0.5, seqused=used, route="torch-varlen"
            )
        return
    out = varlen_attention(
        query, keys, values, meta.offsets, 256, 128**-0.5, seqused=used, route="torch-varlen"
    )
    ref = varlen_reference(query.float(), keys.float(), values.float(), meta.offsets, 128**-0.5, seqused=used)
    assert float((out.float() - ref).abs().max()) < 1e-2


@pytest.mark.parametrize(
    "name", ["adakv", "critical-adakv", "layers=uniform,heads=adakv,score=streamingllm,decode=fixed"]
)
def test_static_ragged_decoding_through_the_kernel(on_device, name):
    """Static ragged layers (the default storage) attend through the kernel with ``seqused``
    where this torch has it, and decode as the dynamic layout (compact segments) does, bf16."""
    model = on_device(torch.bfloat16)
    prompt = ids(160, seed=4).to(DEVICE)
    runs = {}
    for static in (True, False):
        cache = KVCakeCache(model, make_method(name, budget=40, window=8), static=static)
        with kvcake.enable(model), torch.no_grad():
            out = model(prompt, **with_cache(model, cache))
            tok, logits = out.logits[:, -1:].argmax(-1), []
            for _ in range(12):
                out = model(tok, **with_cache(model, cache))
                tok = out.logits[:, -1:].argmax(-1)
                logits.append(out.logits[:, -1].float())
        runs[static] = (torch.cat(logits), cache)
    layers = [layer for layer in runs[True][1].layers if getattr(layer, "static", None) is not None]
    assert layers and all(layer.layout == "ragged" for layer in layers)
    expected = varlen.choose_route(DEVICE, torch.bfloat16, seqused=True)
    assert {layer.varlen_route for layer in layers} == {expected}
    if DEVICE.type == "cuda" and varlen._torch_varlen_seqused():
        assert expected == "torch-varlen"
    torch.testing.assert_close(runs[True][0], runs[False][0], atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("name", ["adakv", "cake-adakv"])
def test_beams_reorder_the_kernels_segments_in_place(on_device, name):
    """Beam search over static ragged layers on the kernel's route: three beams of one prompt fed
    different tokens, reordered (1, 2, 1), then a step: each beam's segments and the kernel's
    per-segment counts (``seq_used``) follow its row in place (``step.ragged.permute``), so the step
    equals a cache fed the reordered beams' tokens from the start, bf16."""
    model = on_device(torch.bfloat16)
    prompt = ids(160, seed=5).to(DEVICE).expand(3, -1)
    fed = torch.tensor([[5, 6], [7, 8], [9, 10]], device=DEVICE)
    rows = torch.tensor([1, 2, 1], device=DEVICE)

    def decode(tokens, reorder):
        cache = KVCakeCache(model, make_method(name, budget=40, window=8))
        with kvcake.enable(model), torch.no_grad():
            model(prompt, **with_cache(model, cache))
            for i in range(tokens.shape[1]):
                model(tokens[:, i : i + 1], **with_cache(model, cache))
            if reorder:
                cache.reorder_cache(rows)
            out = model(torch.full((3, 1), 11, device=DEVICE), **with_cache(model, cache))
        return out.logits[:, -1].float(), cache

    reordered, cache = decode(fed, True)
    expected, _ = decode(fed[rows], False)
    layers = [layer for layer in cache.layers if getattr(layer, "static", None) is not None]
    assert layers and {layer.varlen_route for layer in layers} == {
        varlen.choose_route(DEVICE, torch.bfloat16, seqused=True)
    }
    torch.testing.assert_close(reordered, expected, atol=1e-2, rtol=1e-2)
