"""Static decode storage (``kvcake.step``) against the dynamic reference path (sort + masked copy).

For every preset, a left-padded batch decodes many steps twice, once with ``static=False``
(the reference) and once in place; the kept positions of every layer and head and the logits
must agree at every step. A second test counts host reads during static decode steps.
"""

from __future__ import annotations

import pytest
import torch

import kvcake
from kvcake import PRESETS, KVCakeCache, make_method, varlen
from kvcake.adapters import with_cache
from kvcake.bench.step_counts import host_reads
from kvcake.layer import dense_attention
from kvcake.step import ragged as ragged_step
from test_varlen import fake_kernel

STEPS = 30


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 120), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :25] = 0  # left padding on the second sequence
    return ids, mask


def _kept(cache: KVCakeCache) -> list[list[list[int]]]:
    out = []
    for lid in cache.compressed:
        layer = cache.layers[lid]
        pos = layer.padded(layer.positions, -1)  # (B, H_kv, N)
        out.append([sorted(p for p in row if p >= 0) for row in pos.reshape(-1, pos.shape[-1]).tolist()])
    return out


def _decode(model, spec: str, static: bool, batch=None, max_cache_len=None, budget=24, window=4):
    ids, mask = _batch() if batch is None else batch
    cache = KVCakeCache(
        model, make_method(spec, budget=budget, window=window), static=static, max_cache_len=max_cache_len
    )
    logits, kept = [], []
    with kvcake.enable(model), torch.no_grad():
        out = model(ids, attention_mask=mask, **with_cache(model, cache))
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(STEPS):
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            out = model(tok, attention_mask=mask, **with_cache(model, cache))
            tok = out.logits[:, -1:].argmax(-1)
            logits.append(out.logits[:, -1])
            kept.append(_kept(cache))
    return torch.stack(logits), kept, cache


@pytest.mark.parametrize("spec", list(PRESETS))
def test_static_decoding_equals_the_reference(tiny_llama, spec):
    ref_logits, ref_kept, ref = _decode(tiny_llama, spec, static=False)
    logits, kept, cache = _decode(tiny_llama, spec, static=True)
    assert all(
        cache.layers[lid].static is not None for lid in cache.compressed if not cache.layers[lid].plain
    )
    assert any(cache.layers[lid].static is not None for lid in cache.compressed), "static path never ran"
    assert all(ref.layers[lid].static is None for lid in ref.compressed)
    for step, (a, b) in enumerate(zip(ref_kept, kept, strict=True)):
        assert a == b, f"kept sets differ at decode step {step}"
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert (cache.layer_counts() == ref.layer_counts()).all()


@pytest.mark.parametrize("budget, window", [(24, 4), (10, 6), (9, 6)])
def test_streamingllm_victim_by_rank(tiny_llama, budget, window):
    """StreamingLLM's victim is a head's oldest entry after its 4 sinks: a full static layer takes it
    by ``kthvalue`` (``layer.kth``) where every head keeps more than sinks + window besides the new
    token (budget >= 4 + window, the boundary included), else by its scores; the reference's tokens
    and kept entries either way."""
    ref_logits, ref_kept, _ = _decode(tiny_llama, "streamingllm", False, budget=budget, window=window)
    logits, kept, cache = _decode(tiny_llama, "streamingllm", True, budget=budget, window=window)
    assert {cache.layers[lid].kth for lid in cache.compressed} == {5 if budget >= 4 + window else 0}
    assert kept == ref_kept
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def _short_batch():
    """A left-padded batch whose second sequence (18 tokens) is under the budget (24): its heads
    fill empty slots first, then evict (a static layer that is not ``full``)."""
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :12] = 0
    return ids, mask


# the decode=fixed presets, and ragged layers with a stateful and a probability-free scorer
FIXED = [name for name, parts in PRESETS.items() if parts[4] == "fixed"] + [
    "layers=uniform,heads=adakv,score=h2o,select=topk,decode=fixed",
    "layers=uniform,heads=adakv,score=streamingllm,select=topk,decode=fixed",
]


@pytest.mark.parametrize("case", ["batch1", "under_budget"])
@pytest.mark.parametrize("spec", FIXED)
def test_static_eviction_equals_the_reference_in_both_layouts(tiny_llama, spec, case):
    """The decode=fixed presets on the layouts the left-padded batch above may not reach: a
    single sequence (every head at its budget: a ``full`` layer, no mask) and a sequence under
    its budget (empty slots filled first, then one victim per step)."""
    batch = _batch() if case == "batch1" else _short_batch()
    if case == "batch1":
        batch = (batch[0][:1], batch[1][:1])
    ref_logits, ref_kept, ref = _decode(tiny_llama, spec, static=False, batch=batch)
    logits, kept, cache = _decode(tiny_llama, spec, static=True, batch=batch)
    layers = [cache.layers[lid] for lid in cache.compressed if cache.layers[lid].static is not None]
    assert layers, "static path never ran"
    if case == "under_budget":
        assert not any(getattr(layer, "full", False) for layer in layers)
    for step, (a, b) in enumerate(zip(ref_kept, kept, strict=True)):
        assert a == b, f"kept sets differ at decode step {step}"
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert (cache.layer_counts() == ref.layer_counts()).all()


@pytest.mark.parametrize("spec", ["snapkv", "adakv"])
def test_static_storage_grows_past_its_capacity_as_the_reference(tiny_llama, spec):
    """decode=none with room for 5 tokens (``max_cache_len``): the storage grows (dense: new
    columns; ragged: laid out anew) while decoding 30, and decodes as the reference."""
    ref_logits, ref_kept, ref = _decode(tiny_llama, spec, static=False)
    logits, kept, cache = _decode(tiny_llama, spec, static=True, max_cache_len=120 + 5)
    layers = [cache.layers[lid] for lid in cache.compressed if cache.layers[lid].static is not None]
    widths = [
        layer.keys.shape[2] if layer.layout == "dense" else int(layer.capacity.min()) for layer in layers
    ]
    assert layers and min(widths) > 24 + 5, "the storage never grew"
    for step, (a, b) in enumerate(zip(ref_kept, kept, strict=True)):
        assert a == b, f"kept sets differ at decode step {step}"
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", ["cake", "cake-oneshot", "streamingllm", "h2o", "tova", "cake-adakv"])
def test_decode_fixed_past_max_cache_len_keeps_its_budget(tiny_llama, spec):
    """A budget (140) above the prompt (120 tokens, 95 on the padded row) and room for 5 tokens
    (``max_cache_len``): static storage held the entries plus the tokens left, so the steps past
    it evicted below the budget (this test failed). An eager step past the capacity now lays the
    layers out as without one: the reference's kept sets and logits."""
    ref_logits, ref_kept, _ = _decode(tiny_llama, spec, static=False, budget=140)
    logits, kept, cache = _decode(tiny_llama, spec, static=True, max_cache_len=120 + 5, budget=140)
    assert cache.max_cache_len is None  # dropped at the step past it
    for step, (a, b) in enumerate(zip(ref_kept, kept, strict=True)):
        assert a == b, f"kept sets differ at decode step {step}"
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


# ragged presets whose decode steps attend without probabilities: on CUDA their static layers
# go to the variable-length kernel (decode=none, and decode=fixed with a probability-free scorer)
RAGGED_KERNEL = ["adakv", "critical-adakv", "defensivekv", "layer-defensivekv", FIXED[-1]]


@pytest.mark.parametrize("case", ["padded", "under_budget", "grows"])
@pytest.mark.parametrize("spec", RAGGED_KERNEL)
def test_static_ragged_layers_attend_through_the_varlen_kernel(tiny_llama, monkeypatch, spec, case):
    """Static ragged storage handed to the variable-length kernel (faked on the CPU: the
    documented semantics of torch's ``varlen_attn``, ``tests/test_varlen.py``): the segments in
    place, each read up to its used prefix (``seqused``), decodes as the dynamic reference, through
    evictions, heads under their budget and a storage that grows."""
    calls: list = []
    monkeypatch.setattr(varlen, "_torch_varlen", lambda: fake_kernel(calls, torch_api=True))

    def route(device, dtype, *, seqused=False):
        assert seqused, "static storage needs a kernel that skips unused slots"
        return "torch-varlen"

    monkeypatch.setattr(ragged_step, "choose_route", route)
    batch = _short_batch() if case == "under_budget" else None
    max_len = 120 + 5 if case == "grows" else None
    ref_logits, ref_kept, _ = _decode(tiny_llama, spec, static=False, batch=batch)
    logits, kept, cache = _decode(tiny_llama, spec, static=True, batch=batch, max_cache_len=max_len)
    layers = [cache.layers[lid] for lid in cache.compressed if cache.layers[lid].static is not None]
    assert layers and all(
        layer.layout == "ragged" and layer.varlen_route == "torch-varlen" for layer in layers
    )
    assert len(calls) >= STEPS * len(layers) and all(call["seqused"] for call in calls)
    for step, (a, b) in enumerate(zip(ref_kept, kept, strict=True)):
        assert a == b, f"kept sets differ at decode step {step}"
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_static_ragged_layers_stay_on_the_padded_view_without_a_kernel(tiny_llama):
    """On the CPU (no variable-length kernel) a static ragged layer reads its padded view."""
    _, _, cache = _decode(tiny_llama, "adakv", static=True)
    layers = [cache.layers[lid] for lid in cache.compressed if cache.layers[lid].static is not None]
    assert layers and {layer.varlen_route for layer in layers} == {"reference"}
    assert not any(hasattr(layer, "seq_used") for layer in layers)


@pytest.mark.parametrize("probs", [False, True])
@pytest.mark.parametrize("spec", ["snapkv", "h2o", "cake", "adakv", "cake-adakv"])
def test_a_static_append_and_attention_equal_dense_attention(tiny_llama, spec, probs):
    """A layer's ``step.append`` then ``step.attend`` (the fused kernel, or bmm/softmax/bmm for the
    probabilities; ragged layers through their padded gather) against the reference
    ``dense_attention`` over the layer's padded view, after a few steps of decoding. The same
    math through different kernels: float32 tolerances (assert_close's defaults)."""
    ids, mask = _batch()
    cache = KVCakeCache(tiny_llama, make_method(spec, budget=24, window=4), static=True)
    with kvcake.enable(tiny_llama), torch.no_grad():
        tok = tiny_llama(ids, attention_mask=mask, **with_cache(tiny_llama, cache)).logits[:, -1:].argmax(-1)
        for _ in range(3):
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            tok = (
                tiny_llama(tok, attention_mask=mask, **with_cache(tiny_llama, cache))
                .logits[:, -1:]
                .argmax(-1)
            )
    g = torch.Generator().manual_seed(5)
    for lid in cache.compressed:
        layer = cache.layers[lid]
        assert layer.static is not None
        k, v = (torch.randn(2, 2, 1, 16, generator=g) for _ in range(2))
        query = torch.randn(2, 4, 1, 16, generator=g)
        layer.step.append(layer, k, v)
        out, p = layer.step.attend(layer, query, 0.25, probs)
        keys, values = layer.padded(layer.keys, 0.0), layer.padded(layer.values, 0.0)
        positions = layer.padded(layer.positions, -1)
        assert bool((positions == layer.newest).any(-1).all()), "the new entry is stored in every head"
        ref, ref_p = dense_attention(query, keys, values, positions, layer.newest[:, 0], 0.25, probs)
        torch.testing.assert_close(out, ref)
        if probs:
            torch.testing.assert_close(p.reshape(ref_p.shape), ref_p)


@pytest.mark.parametrize("spec", list(PRESETS))
def test_static_decode_steps_read_nothing_back(tiny_llama, spec):
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(2))
    cache = KVCakeCache(tiny_llama, make_method(spec, budget=24, window=4), static=True)
    with kvcake.enable(tiny_llama), torch.no_grad():
        tok = tiny_llama(ids, **with_cache(tiny_llama, cache)).logits[:, -1:].argmax(-1)
        tiny_llama(tok, **with_cache(tiny_llama, cache))  # the first step moves the layers into their buffers
        assert all(cache.layers[lid].static is not None for lid in cache.compressed)
        with host_reads() as reads:
            for _ in range(5):
                tiny_llama(tok, **with_cache(tiny_llama, cache))
    assert reads == [], f"host reads during static decode steps: {sorted(set(reads))}"
    with host_reads() as reads:  # the counter itself sees a read
        bool(torch.ones(()) > 0)
    assert [name for name, _ in reads] == ["__bool__"]


def test_static_refuses_to_preallocate_a_huge_budget(tiny_llama):
    """A left-padded batch with a budget far beyond the prompt: the padded sequence's layers are
    compacted (not plain), and static storage would preallocate the whole decode budget; the
    storage is laid out at the end of the prompt, so the prompt's forward says so."""
    x = torch.randint(3, 128, (2, 60), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(x)
    mask[1, :25] = 0
    cache = KVCakeCache(tiny_llama, make_method("cake", budget=2**40, window=4), static=True)
    with (
        kvcake.enable(tiny_llama),
        torch.no_grad(),
        pytest.raises(ValueError, match="max_cache_len=.*static=False"),
    ):
        tiny_llama(x, attention_mask=mask, **with_cache(tiny_llama, cache))
