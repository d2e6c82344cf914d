"""Static storage is ready for CUDA graphs (``torch.compile(mode="reduce-overhead")``).

A CUDA graph replays fixed memory addresses: a tensor of the cache that a step replaces
(``layer.x = new``) is, inside the graph, an output that the next replay overwrites while the next
step reads it as an input, and a tensor it mutates in place without being marked static is copied
into the graph's own memory at every replay (the whole KV cache) or makes the graphs skipped.
So, checked on the CPU for every preset: once the layers are in static storage, decode steps
replace none of their tensors, and each of those tensors is marked a static address
(``torch._dynamo.mark_static_address``, as transformers' StaticCache marks its buffers), also
after the storage grows.
"""

from __future__ import annotations

import pytest
import torch

import kvcake
from kvcake import PRESETS, KVCakeCache, make_method
from kvcake.adapters import with_cache
from kvcake.step import GROWTH


def _tensors(cache) -> dict[str, torch.Tensor]:
    """Every tensor attribute of the cache's compressed layers, by name."""
    out = {}
    for lid in cache.compressed:
        for name, value in vars(cache.layers[lid]).items():
            if isinstance(value, torch.Tensor):
                out[f"layer {lid}.{name}"] = value
    return out


def _steps(model, cache, tok, n):
    for _ in range(n):
        tok = model(tok, **with_cache(model, cache)).logits[:, -1:].argmax(-1)
    return tok


@pytest.mark.parametrize("name", list(PRESETS))
def test_static_steps_replace_no_tensor_and_every_one_is_marked(tiny_llama, name):
    model = tiny_llama
    prompt = torch.randint(3, 128, (2, 150), generator=torch.Generator().manual_seed(1))
    cache = KVCakeCache(model, make_method(name, budget=40, window=8), static=True, max_cache_len=170)
    with kvcake.enable(model), torch.no_grad():
        tok = model(prompt, **with_cache(model, cache)).logits[:, -1:].argmax(-1)
        tok = _steps(model, cache, tok, 1)  # every evicted layer is in its buffers now
        assert all(cache.layers[lid].static is not None for lid in cache.compressed)
        before = {k: (t, t.data_ptr()) for k, t in _tensors(cache).items()}
        unmarked = [
            k for k, (t, _) in before.items() if getattr(t, "_dynamo_static_input_type", None) is None
        ]
        assert not unmarked, f"tensors of static storage not marked static: {unmarked}"
        _steps(model, cache, tok, 4)
    after = _tensors(cache)
    assert after.keys() == before.keys()
    replaced = [k for k, (t, ptr) in before.items() if after[k] is not t or after[k].data_ptr() != ptr]
    assert not replaced, f"decode steps replaced these tensors instead of writing them in place: {replaced}"


@pytest.mark.parametrize("name", ["snapkv", "adakv"])  # decode=none, dense and ragged
def test_storage_that_grows_is_marked_again(tiny_llama, name):
    model = tiny_llama
    prompt = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(2))
    cache = KVCakeCache(
        model, make_method(name, budget=40, window=8), static=True
    )  # no max_cache_len: GROWTH
    with kvcake.enable(model), torch.no_grad():
        tok = model(prompt, **with_cache(model, cache)).logits[:, -1:].argmax(-1)
        tok = _steps(model, cache, tok, 1)
        first = {k: t.data_ptr() for k, t in _tensors(cache).items()}
        _steps(model, cache, tok, GROWTH + 1)  # past the room laid out: the storage grows once
    grown = _tensors(cache)
    assert cache.layers[cache.compressed[0]].keys.data_ptr() != first[f"layer {cache.compressed[0]}.keys"]
    unmarked = [k for k, t in grown.items() if getattr(t, "_dynamo_static_input_type", None) is None]
    assert not unmarked, f"tensors of grown storage not marked static: {unmarked}"
