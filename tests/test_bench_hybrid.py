"""The memory benchmark on a hybrid model (tiny Gemma 3: sliding layers of window 12 and two
global layers): the full cache keeps the sliding layers at their window, and every theory column
counts them at ``min(S, W - 1)`` entries plus the global layers at their budgets."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcake import bench
from kvcake.adapters import with_cache
from kvcake.bench.common import BenchModels
from kvcake.bench.memory import sliding_kv_bytes
from tiny_hybrid import TINY_GEMMA3_LAYER_TYPES, TINY_GEMMA3_WINDOW

BUDGET, WINDOW = 16, 4


@pytest.fixture(scope="module")
def models(tiny_gemma3):
    torch.set_num_threads(1)
    return BenchModels(tiny_gemma3, None, "tiny hybrid", torch.device("cpu"), torch.float32)


def test_shape_counts_global_layers_and_sliding_bytes(tiny_gemma3):
    shape = bench.KVShape.of(tiny_gemma3)
    assert shape.layers == TINY_GEMMA3_LAYER_TYPES.count("full_attention")
    n_sliding = TINY_GEMMA3_LAYER_TYPES.count("sliding_attention")
    assert sliding_kv_bytes(tiny_gemma3, 5, shape) == n_sliding * 5 * shape.entry_bytes
    assert (
        sliding_kv_bytes(tiny_gemma3, 100, shape) == n_sliding * (TINY_GEMMA3_WINDOW - 1) * shape.entry_bytes
    )


def test_memory_bench_on_a_hybrid(models, tiny_gemma3):
    lengths = (48, 96)
    result = bench.bench_memory(models, lengths=lengths, budget=BUDGET, window=WINDOW, rss_lengths=())
    rows = {(r["method"], r["length"]): r for r in result["kv"]}
    shape = bench.KVShape.of(tiny_gemma3)
    for s in lengths:
        ids = torch.randint(0, tiny_gemma3.config.vocab_size, (1, s))
        reference = DynamicCache(config=tiny_gemma3.config)  # what transformers itself holds
        with torch.no_grad():
            tiny_gemma3(ids, **with_cache(tiny_gemma3, reference))
        held = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in reference.layers)
        full = rows[("full", s)]
        expected = bench.full_kv_bytes(s, shape) + sliding_kv_bytes(tiny_gemma3, s, shape)
        assert full["peak"] == full["end"] == full["peak_theory"] == expected == held
        for m in ("snapkv", "pyramidkv", "cake", "cake-oneshot", "adakv"):
            r = rows[(m, s)]
            assert r["end"] == r["end_theory"] == r["counts_bytes"], m
            assert r["full_cache_bytes"] == held, m
            assert r["sliding_bytes"] + r["global_bytes"] == r["end"], m
            # later sliding layers are not filled yet when a global layer peaks: at most the theory
            assert 0 < r["peak"] <= r["peak_theory"], m
        assert rows[("cake-oneshot", s)]["peak"] == full["peak"]
        assert rows[("cake", s)]["peak"] <= rows[("cake", s)]["cascade_bound"] + shape.entry_bytes * (
            shape.layers - 1
        )
