"""The memory benchmark on a hybrid model (tiny Gemma 3: sliding layers of window 12 and two
global layers): the full cache's sliding layers hold the whole prompt until they decode (their
window a slice of it), kvcake's their window from the start, and every kvcake theory column counts
them at ``min(S, W - 1)`` entries plus the global layers at their budgets."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcake import bench
from kvcake.adapters import with_cache
from kvcake.bench.common import BenchModels
from kvcake.bench.memory import sliding_kv_bytes, stock_sliding_bytes
from kvcake.cache import cache_kv_bytes
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
        counted = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in reference.layers)
        window = bench.full_kv_bytes(s, shape) + sliding_kv_bytes(tiny_gemma3, s, shape)
        whole = bench.full_kv_bytes(s, shape) + stock_sliding_bytes(tiny_gemma3, s, shape)
        assert counted == window < whole == cache_kv_bytes(reference)  # its windows: slices of the prompt
        full = rows[("full", s)]
        assert full["peak"] == full["end"] == full["peak_theory"] == whole
        assert full["decode_theory"] == window
        for m in ("snapkv", "pyramidkv", "cake", "cake-oneshot", "adakv"):
            r = rows[(m, s)]
            assert r["end"] == r["end_theory"] == r["counts_bytes"], m
            assert r["full_cache_bytes"] == window, m  # kv_bytes_parts().full: the full cache decoding
            assert r["sliding_bytes"] + r["global_bytes"] == r["end"], m
            # later sliding layers are not filled yet when a global layer peaks: at most the theory
            assert 0 < r["peak"] <= r["peak_theory"] < full["peak"], m
        assert rows[("cake", s)]["peak"] <= rows[("cake", s)]["cascade_bound"] + shape.entry_bytes * (
            shape.layers - 1
        )
    # every sliding layer comes before the last global one: cake-oneshot peaks at S*L + the windows
    oneshot = [t for t in result["targets"] if t["target"].startswith("CAKE without")]
    assert [t["value"] for t in oneshot] == [1.0, 1.0] and all(t["ok"] for t in oneshot)


def test_memory_page_says_what_the_full_cache_holds_on_a_hybrid(models, tmp_path):
    from kvcake.bench import report

    result = bench.bench_memory(models, lengths=(96,), budget=BUDGET, window=WINDOW, rss_lengths=())
    page = report._memory(result, tmp_path, tmp_path / "page.md")
    full = next(r for r in result["kv"] if r["method"] == "full")
    held, decoding = f"{full['end'] / 2**20:.3g} MiB", f"{full['decode_theory'] / 2**20:.3g} MiB"
    assert held != decoding
    assert f"holds every layer's whole prompt ({held} at 96 tokens), and {decoding} once it decodes" in page
    assert "CAKE without cascading: peak close to every layer whole: met" in page
