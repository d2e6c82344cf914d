"""What a cache holds is what it counts: the storages behind every layer's keys and values add up
to ``kv_bytes()``. Views were the leak: transformers' sliding layer keeps its window as a slice of
the whole prompt (a compressed context held 35x its count on a tiny Gemma 3), a fused projection
hands its keys and values as slices of one q/k/v output (Phi-3), and a padded batch's eviction
kept the rows of a buffer one slot longer."""

from __future__ import annotations

import pytest
import torch

import kvcake
from shared_checks import left_padded, prefill, tiny_model
from tiny_hybrid import _tiny_gemma3


def held(cache) -> int:
    """Bytes of the distinct storages behind the layers' keys and values."""
    seen: dict[tuple, int] = {}
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor) and t.numel():
                s = t.untyped_storage()
                seen[(s.data_ptr(), s.nbytes())] = s.nbytes()
    return sum(seen.values())


def ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 120, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("preset", ["snapkv", "adakv", "cake"])
def test_a_hybrid_context_holds_what_it_counts(preset):
    model = _tiny_gemma3()
    ctx = kvcake.compress(model, ids(300)[None], preset, budget=32, window=8)
    assert held(ctx.cache) == ctx.cache.kv_bytes()  # was 35x on 1500 tokens: the sliding layers' prompt
    fork = ctx.fork()
    assert held(fork) == fork.kv_bytes()
    batch, mask = left_padded(ids(300), ids(200, seed=1))
    ctx = kvcake.compress(model, batch, preset, budget=32, window=8, attention_mask=mask)
    assert held(ctx.cache) == ctx.cache.kv_bytes()
    ctx.generate(ids(5, seed=2)[None].expand(2, -1), max_new_tokens=3)
    assert held(ctx.cache) == ctx.cache.kv_bytes()  # answering works on a copy


@pytest.mark.parametrize("spec", ["full", "snapkv"])
def test_a_fused_projections_entries_are_held_alone(spec):
    """Phi-3's ``qkv_proj``: the keys and values are slices of one output. A layer that evicts
    nothing (``full``, a covering budget, a layer waiting for its stage) keeps them as given."""
    model = tiny_model("Phi3Config", {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
                                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                     "pad_token_id": 0})  # fmt: skip
    sizes = {} if spec == "full" else {"budget": 1000, "window": 8}
    ctx = kvcake.compress(model, ids(200)[None], spec, **sizes)
    assert held(ctx.cache) == ctx.cache.kv_bytes()


def test_a_padded_batchs_eviction_frees_the_overflow_slot(tiny_llama):
    batch, mask = left_padded(ids(120), ids(80, seed=1))
    ctx = kvcake.compress(tiny_llama, batch, "snapkv", keep_ratio=0.4, window=8, attention_mask=mask)
    assert held(ctx.cache) == ctx.cache.kv_bytes()


def test_storage_bytes_counts_each_storage_once():
    """``devices.storage_bytes``: views of one storage count once, at the storage's size; tensors
    inside tuples, dicts and dataclasses count too."""
    from dataclasses import dataclass

    from kvcake.devices import storage_bytes

    @dataclass
    class Meta:
        a: torch.Tensor
        b: torch.Tensor

    class Holder:
        pass

    base = torch.zeros(10, 4)  # 160 bytes
    h = Holder()
    h.x, h.view, h.pair = base, base[2:5], (torch.zeros(3, dtype=torch.int64), base.t())
    h.meta, h.named, h.none = Meta(torch.zeros(2), base[0]), {"k": torch.zeros(5, dtype=torch.int8)}, None
    assert storage_bytes(h) == 160 + 24 + 8 + 5


@pytest.mark.parametrize(("preset", "per_entry"), [("snapkv", 8), ("h2o", 8 + 4), ("adakv", 3 * 8)])
def test_the_bookkeeping_beside_the_keys_and_values_is_counted(tiny_mha, preset, per_entry):
    """``kv_bytes_parts().index`` is what a compressed context's layers hold beside their keys and
    values, which a full cache does without: an int64 position per kept entry and KV head, H2O's
    float32 score beside it, a ragged layout's position, segment and index-in-segment per entry plus
    its per-head lengths and offsets. ``held`` adds it to ``total``; ``held_fraction`` to the ratio."""
    ctx = kvcake.compress(tiny_mha, ids(300)[None], preset, budget=48, window=8)
    p = ctx.cache.kv_bytes_parts()
    heads = tiny_mha.config.num_key_value_heads
    per_layer = (heads + heads + 1) * 8 if preset == "adakv" else 0  # (H,) lengths and (H + 1,) offsets
    assert p.entries == 48 * heads * len(ctx.cache.layers)
    assert p.index == p.entries * per_entry + per_layer * len(ctx.cache.layers)
    assert p.held == p.total + p.index and p.held_fraction == pytest.approx(p.held / p.full)
    cache, _ = prefill(tiny_mha, ids(300)[None], preset, budget=48, window=8)  # static storage (the default)
    assert (
        cache.kv_bytes_parts().index > p.index
    )  # its decoding's biases (and a ragged layout's padding rows)
