"""Deterministic per-step counts of a static decode step (issue 22's CPU proxies for a GPU step):
host-synchronising ATen ops (zero, every preset, batch 1 and a left-padded batch of 2) and ATen
ops per layer above transformers' DynamicCache (at most 30, every preset, batch 1 and 2)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcake import PRESETS, KVCakeCache, make_method
from kvcake.bench.step_counts import BOOLEAN_INDEX, SYNCING, CountOps, step_ops
from shared_checks import KWARGS_HANDOFF

MAX_EXTRA_OPS_PER_LAYER = 30


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("spec", list(PRESETS))
def test_a_static_decode_step_has_no_host_synchronising_op(tiny_llama, spec, batch):
    """Zero, where DynamicCache's step has one: transformers reads the 2-D padding mask back to
    decide whether it may skip the mask, which it does not try for a compileable cache."""
    cache = KVCakeCache(tiny_llama, make_method(spec, budget=24, window=4), static=True)
    ops = step_ops(tiny_llama, cache, batch)
    expected = {}
    if not KWARGS_HANDOFF:  # 5.0: the cache is not compileable, so transformers' own mask check runs
        expected = {k: v for k, v in step_ops(tiny_llama, DynamicCache(), batch).items() if k in SYNCING}
    assert {k: v for k, v in ops.items() if k in SYNCING} == expected


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("spec", list(PRESETS))
def test_a_static_decode_step_adds_at_most_30_ops_per_layer(tiny_llama, spec, batch):
    base = sum(step_ops(tiny_llama, DynamicCache(), batch).values())
    cache = KVCakeCache(tiny_llama, make_method(spec, budget=24, window=4), static=True)
    extra = (sum(step_ops(tiny_llama, cache, batch).values()) - base) / tiny_llama.config.num_hidden_layers
    assert extra <= MAX_EXTRA_OPS_PER_LAYER


def test_the_sync_counter_sees_a_sync():
    with CountOps() as counter:
        bool(torch.ones(2).sum() > 0)
    assert "aten._local_scalar_dense.default" in counter.ops


def test_the_sync_counter_sees_indexing_with_a_boolean_mask():
    """``t[mask]`` and ``t[mask] = v`` dispatch one indexing op, which on a GPU runs ``nonzero``
    inside: counted as synchronising (the prefill's evictions hid 1600 of them from the count).
    ``v`` a tensor: torch 2.15 dispatches ``t[mask] = 0.0`` as ``masked_fill_``, which reads nothing."""
    t, mask = torch.arange(6.0), torch.arange(6) % 2 == 0
    with CountOps() as counter:
        t[mask]
        t[mask] = torch.zeros(3)
        t[torch.tensor([0, 2])]  # integer indices: no read back
    assert counter.ops[BOOLEAN_INDEX] == 2
    assert sum(v for k, v in counter.ops.items() if k in SYNCING) == 2


@pytest.mark.parametrize("spec", ["snapkv", "cake", "adakv", "cake-adakv"])
def test_float8_storage_adds_its_conversions_and_ring_and_no_sync(tiny_llama, spec):
    """``kv_dtype="fp8"`` (``kvcake.fp8``), per layer and step: the new entry's key and value
    divided by their scales, clamped to float8's range and converted (6), the two buffers converted
    back (2), the query and the output scaled (2, ``fp8.folded``); the recent entries' ring: the new
    token's slot (2), its key and value divided by their scales (2) and written with its position
    (3), each entry's slot (2), the slot's position read and compared (2), the ring's keys and
    values read (2, 3 on a ragged layer's gathered view) and put in place of the converted ones (2);
    and 15-16 views (no kernel): at most 42 more ops than the same cache in the model's dtype
    (float32 here), and no sync."""
    plain = step_ops(
        tiny_llama, KVCakeCache(tiny_llama, make_method(spec, budget=24, window=4), static=True), 2
    )
    fp8 = step_ops(
        tiny_llama,
        KVCakeCache(tiny_llama, make_method(spec, budget=24, window=4), static=True, kv_dtype="fp8"),
        2,
    )
    assert {k: v for k, v in fp8.items() if k in SYNCING} == {k: v for k, v in plain.items() if k in SYNCING}
    extra = (sum(fp8.values()) - sum(plain.values())) / tiny_llama.config.num_hidden_layers
    assert 0 < extra <= 42


@pytest.mark.parametrize("spec", ["h2o", "tova", "cake"])
def test_a_cpu_float32_step_that_reads_probabilities_takes_its_output_from_them(
    tiny_llama, make_tiny_llama, spec
):
    """``step.dense.attend``: on the CPU in float32, a policy that reads the new token's
    probabilities gets its output from them (a product with the values), not from a second read
    of the keys and values by the fused kernel; a policy that reads none (SnapKV) keeps the
    fused kernel, and so does a bfloat16 layer (the output rounded as a full cache's is)."""

    def fused(model, preset):
        cache = KVCakeCache(model, make_method(preset, budget=24, window=4), static=True)
        return sum(n for op, n in step_ops(model, cache).items() if "scaled_dot_product" in op)

    assert fused(tiny_llama, spec) == 0
    assert fused(tiny_llama, "snapkv") == tiny_llama.config.num_hidden_layers
    assert fused(make_tiny_llama().to(torch.bfloat16), spec) == tiny_llama.config.num_hidden_layers
