"""Float8 storage of the kept entries (``kv_dtype="fp8"``, ``kvcake.fp8``) on the device, bf16:
static storage (dense in place; ragged through the variable-length kernel's route) decodes as the
dynamic reference does, within bfloat16 rounding of float8's rounding of the model-dtype cache,
and a static step reads nothing back to the host; with a ring of recent entries covering every
token it decodes bit for bit as bfloat16."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import DEVICE, ids
from test_cuda_sync_free import _sync_errors

import kvcake
from kvcake import KVCakeCache, fp8, make_method, varlen
from kvcake.adapters import with_cache

STEPS = 10


def _decode(model, name, static, kv_dtype):
    prompt = ids(160, seed=4).to(DEVICE)
    fed = ids(STEPS, seed=5).to(DEVICE)  # the same tokens whatever the logits: runs compare step by step
    cache = KVCakeCache(model, make_method(name, budget=40, window=8), static=static, kv_dtype=kv_dtype,
                        max_cache_len=160 + STEPS)  # fmt: skip
    logits = []
    with kvcake.enable(model), torch.no_grad():
        model(prompt, **with_cache(model, cache))
        for i in range(STEPS):
            logits.append(model(fed[:, i : i + 1], **with_cache(model, cache)).logits[:, -1].float())
    return torch.cat(logits), cache


@pytest.mark.parametrize("name", ["snapkv", "adakv", "critical-adakv"])
def test_float8_static_decoding_equals_the_reference(on_device, name):
    model = on_device(torch.bfloat16)
    static, cache = _decode(model, name, True, "fp8")
    dynamic, _ = _decode(model, name, False, "fp8")
    bf16, _ = _decode(model, name, True, None)
    layers = [cache.layers[lid] for lid in cache.compressed]
    assert all(layer.keys.dtype == torch.uint8 and layer.static is not None for layer in layers)
    if layers[0].layout == "ragged":
        assert {layer.varlen_route for layer in layers} == {
            varlen.choose_route(DEVICE, torch.bfloat16, seqused=True)
        }
    torch.testing.assert_close(static, dynamic, atol=5e-2, rtol=5e-2)
    assert float((static - bf16).abs().amax() / bf16.abs().amax()) < 0.1


@pytest.mark.parametrize("name", ["snapkv", "cake", "adakv", "cake-adakv"])
def test_float8_static_steps_do_not_synchronise(on_device, name):
    model = on_device(torch.bfloat16)
    prompt = ids(200, seed=3).to(DEVICE)
    cache = KVCakeCache(model, make_method(name, budget=40, window=8), kv_dtype="fp8")
    with kvcake.enable(model), torch.no_grad():
        tok = model(prompt, **with_cache(model, cache)).logits[:, -1:].argmax(-1)
        tok = model(tok, **with_cache(model, cache)).logits[:, -1:].argmax(-1)  # into the buffers
        with _sync_errors():
            for _ in range(4):
                tok = model(tok, **with_cache(model, cache)).logits[:, -1:].argmax(-1)
    assert cache.get_seq_length() == 205


@pytest.mark.parametrize("name", ["snapkv", "adakv", "critical-adakv"])
def test_float8_with_every_token_in_its_ring_decodes_as_bfloat16(on_device, name, monkeypatch):
    """A ring of recent entries as long as the sequence: every entry is read exactly, and the
    power-of-two scales folded onto the query and the output round nothing, so float8 storage
    decodes bit for bit as bfloat16 storage through the same kernels (the ragged ones through the
    variable-length kernel where the device has one)."""
    monkeypatch.setattr(fp8, "RECENT", 256)
    model = on_device(torch.bfloat16)
    got, cache = _decode(model, name, True, "fp8")
    ref, _ = _decode(model, name, True, None)
    assert all(cache.layers[lid].keys.dtype == torch.uint8 for lid in cache.compressed)
    assert torch.equal(got, ref)
