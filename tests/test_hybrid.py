"""Hybrid sliding/global models (Gemma 3) on a tiny random config: sliding layers are
transformers' own, untouched; every guarantee of the compressed cache holds on the global layers."""

import pytest
import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

import kvcake
from kvcake import KVCakeCache, make_method
from kvcake.adapters import describe_model, with_cache
from kvcake.layer_types import chunked_layers, layer_windows
from kvcake.replay.compress import cache_bytes
from kvcake.sliding import SlidingLayer
from shared_checks import KWARGS_HANDOFF, assert_batch_matches_each_alone, prefill, prompt, single_step_logits
from tiny_hybrid import TINY_GEMMA3_WINDOW, _tiny_gemma3

GLOBAL = (2, 5)  # the full-attention layers of the tiny hybrid
SLIDING = (0, 1, 3, 4)
ENTRY = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head_dim 16, float32


def test_describe_model_reports_windows(tiny_gemma3):
    info = describe_model(tiny_gemma3)
    assert info.compressed_layers == GLOBAL and info.hybrid
    assert info.windows == (12, 12, None, 12, 12, None)
    cache = KVCakeCache(tiny_gemma3, "cake", budget=32)
    assert [isinstance(layer, SlidingLayer) for layer in cache.layers] == [i in SLIDING for i in range(6)]
    assert cache.is_sliding == [i in SLIDING for i in range(6)]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["cake", "snapkv", "adakv", "h2o", "criticalkv", "streamingllm"])
def test_budget_covering_prompt_is_bit_identical(impl, name):
    model = _tiny_gemma3(impl)
    ids = prompt(60)
    with torch.no_grad():
        full_logits = model(ids).logits
        full_out = model.generate(ids, max_new_tokens=10, do_sample=False)
    _, logits = prefill(model, ids, make_method(name, budget=64, window=8))
    assert torch.equal(logits, full_logits)
    out, cache = kvcake.generate(model, ids, name, budget=200, window=8, max_new_tokens=10, do_sample=False)
    assert torch.equal(out, full_out)
    assert all(cache.layers[lid].plain for lid in GLOBAL)


@pytest.mark.parametrize("name", ["cake", "snapkv", "adakv", "h2o", "tova"])
def test_sliding_layers_are_never_evicted(tiny_gemma3, name):
    """Every sliding layer holds exactly the last window-1 tokens, step after step (in its ring,
    the static default: ``window()`` reads them in position order); the first layer's entries are
    bit-identical to transformers' DynamicCache's, the second's equal up to the ring's float
    rounding (no global layer before them); eviction only ever records global layers."""
    ids = prompt(80, seed=1)
    ctx = kvcake.compress(tiny_gemma3, ids, name, budget=24, window=4)
    cache = ctx.fork()
    cache.record = True
    full = DynamicCache(config=tiny_gemma3.config)
    tok = ctx.logits.argmax(-1, keepdim=True)
    with torch.no_grad():
        tiny_gemma3(ids, **with_cache(tiny_gemma3, full))
        with kvcake.enable(tiny_gemma3):
            for step in range(20):
                tiny_gemma3(tok, **with_cache(tiny_gemma3, cache))
                tiny_gemma3(tok, **with_cache(tiny_gemma3, full))
                seen = 80 + step + 1
                for lid in SLIDING:
                    layer = cache.layers[lid]
                    assert layer.cumulative_length == seen
                    assert (layer.static == "ring") == KWARGS_HANDOFF  # decoded in place (static storage)
                    assert layer.window()[0].shape[2] == TINY_GEMMA3_WINDOW - 1
                for lid, atol in ((0, 0.0), (1, 1e-5)):  # layer 1 reads layer 0's attention: the ring
                    keys, values = cache.layers[lid].window()  # sums in another order (sliding.py)
                    torch.testing.assert_close(keys, full.layers[lid].keys, rtol=0, atol=atol)
                    torch.testing.assert_close(values, full.layers[lid].values, rtol=0, atol=atol)
                tok = (tok + 1) % 128
    assert {lid for _, lid, _ in ctx.cache.history} <= set(GLOBAL)
    assert {lid for _, lid, _ in cache.history} <= set(GLOBAL)


def test_budgets_sum_exactly_over_global_layers_and_kv_bytes_parts(tiny_gemma3):
    s = 150
    cache, _ = prefill(tiny_gemma3, prompt(s, seed=2), make_method("cake", budget=30, window=8))
    counts = cache.layer_counts()  # (B, L_g, H_kv)
    assert counts.shape == (1, 2, 2) and cache.budgets.shape == (1, 2)
    assert int(counts[0, :, 0].sum()) == 30 * 2
    assert torch.equal(cache.budgets[0], torch.as_tensor(counts[0, :, 0]))
    parts = cache.kv_bytes_parts()
    # sliding layers in their ring (static storage): window slots and a flag each (5.0: no ring, window - 1)
    ring = TINY_GEMMA3_WINDOW * (ENTRY + 1) if KWARGS_HANDOFF else (TINY_GEMMA3_WINDOW - 1) * ENTRY
    assert parts.sliding == len(SLIDING) * ring
    assert parts.compressed == (30 + 1) * 2 * ENTRY  # + the spare slot of static decode=fixed storage
    assert parts.total == cache.kv_bytes()
    assert parts.full == len(SLIDING) * (TINY_GEMMA3_WINDOW - 1) * ENTRY + s * len(GLOBAL) * ENTRY
    full = DynamicCache(config=tiny_gemma3.config)
    with torch.no_grad():
        tiny_gemma3(prompt(s, seed=2), **with_cache(tiny_gemma3, full))
    counted = sum(t.numel() * t.element_size() for layer in full.layers for t in (layer.keys, layer.values))
    # the full cache as it decodes: its windows, every global token (the eval's records' reference)
    assert parts.full == counted == kvcake.cache.cache_kv_bytes(full, storage=False) == cache_bytes(full)
    # until its first decode step its windows are slices of the whole prompt: it holds the prompt's bytes
    assert kvcake.cache.cache_kv_bytes(full) == s * (len(SLIDING) + len(GLOBAL)) * ENTRY
    # ratio is the kept fraction of the global layers' prompt entries (the dynamic layout: static
    # storage would add the GROWTH slots snapkv's decode=none reserves without a max_cache_len)
    cache, _ = prefill(
        tiny_gemma3, prompt(s, seed=2), make_method("snapkv", ratio=0.2, window=8), static=False
    )
    assert cache.kv_bytes_parts().compressed == round(0.2 * s) * len(GLOBAL) * ENTRY


def test_cascade_equals_one_shot_over_global_layers(tiny_gemma3):
    ids = prompt(200, seed=3)
    for heads in ("uniform", "adakv"):
        spec = f"layers=cake,heads={heads},score=cake"
        casc, _ = prefill(tiny_gemma3, ids, make_method(spec, budget=40, window=8), record=True)
        once, _ = prefill(
            tiny_gemma3, ids, make_method(spec + ",layers.cascading=false", budget=40, window=8)
        )
        assert torch.equal(casc.budgets, once.budgets)
        assert len(casc.stage_budgets) == len(GLOBAL)  # one stage per global layer
        for lid in GLOBAL:
            assert torch.equal(casc.layers[lid].padded_positions(), once.layers[lid].padded_positions())
            assert torch.equal(casc.layers[lid].keys, once.layers[lid].keys)
        assert [lid for _, lid, _ in casc.history].count(GLOBAL[0]) == 2, "the cascade re-evicted layer 2"


@pytest.mark.parametrize("name", ["snapkv", "cake,decode=none", "adakv"])
def test_chunk_equals_one_token_at_a_time(tiny_gemma3, name):
    ids, follow = prompt(100, seed=5), prompt(20, seed=6)  # 20 > window: the sliding layers roll
    ctx = kvcake.compress(tiny_gemma3, ids, name, budget=32, window=8)
    chunk_logits = ctx.forward(follow)[0]
    steps = single_step_logits(tiny_gemma3, ctx.fork(), follow)
    torch.testing.assert_close(steps, chunk_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["cake", "snapkv", "adakv"])
def test_batch_with_left_padding_matches_each_alone(tiny_gemma3, name):
    a, b = prompt(120, seed=8)[0], prompt(90, seed=9)[0]
    kw = dict(ratio=0.3, window=8, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert_batch_matches_each_alone(tiny_gemma3, name, a, b, 30, **kw)


def test_saved_context_round_trips_sliding_layers(tiny_gemma3, tmp_path):
    ids, follow = prompt(90, seed=10), prompt(6, seed=11)
    ctx = kvcake.compress(tiny_gemma3, ids, "cake", budget=24, window=4)
    path = kvcake.storage.save_context(ctx, tmp_path / "ctx.kvcake")
    back = kvcake.storage.load_context(tiny_gemma3, path)
    for lid in SLIDING:
        layer = back.cache.layers[lid]
        assert isinstance(layer, SlidingLayer) and layer.cumulative_length == 90
        assert torch.equal(layer.keys, ctx.cache.layers[lid].keys)
    assert torch.equal(back.forward(follow), ctx.forward(follow))


def _gemma3(**overrides):
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, sliding_window=8)  # fmt: skip
    kw.update(overrides)
    return Gemma3ForCausalLM(Gemma3TextConfig(**kw))


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="every layer uses sliding-window"):
        KVCakeCache(_gemma3(layer_types=["sliding_attention"] * 2), "cake", budget=32)
    mistral = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=2, num_key_value_heads=1, sliding_window=16))  # fmt: skip
    with pytest.raises(ValueError, match="nothing to compress|no full-attention layer"):
        KVCakeCache(mistral, "cake", budget=32)
    chunked = Gemma3TextConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    # set after construction: 5.17's Gemma 3 config keys its RoPE parameters by layer type and
    # raises a KeyError for a type it does not know, before kvcake could read it
    chunked.layer_types = ["chunked_attention", "full_attention"]
    chunked.attention_chunk_size = 8  # as Llama 4 names it: a chunked layer is kept (tests/test_chunked.py)
    assert layer_windows(chunked, "gemma3_text") == (8, None) and chunked_layers(chunked) == (0,)
    chunked.layer_types = ["chunked_attention", "mystery_attention"]
    with pytest.raises(ValueError, match="layer 1 is of type 'mystery_attention'"):
        layer_windows(chunked, "gemma3_text")


def test_a_qwen2_hybrid_compresses_its_full_layers_only():
    """Qwen2 with max_window_layers=1: layer 0 full attention, layer 1 sliding (formerly refused)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=16,
                         max_window_layers=1)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    ids = prompt(60, seed=12)
    with torch.no_grad():
        full = model(ids).logits
    _, same = prefill(model, ids, make_method("snapkv", budget=64, window=8))
    assert torch.equal(same, full)
    cache, _ = prefill(model, ids, make_method("snapkv", budget=20, window=8))
    assert cache.compressed == (0,) and cache.layer_counts().shape == (1, 1, 2)
    assert int(cache.layer_counts().max()) == 20 and cache.layers[1].window()[0].shape[2] == 15


def test_layer_windows_reads_the_one_dict_of_older_transformers(monkeypatch):
    """transformers before the per-layer form (5.17 was seen on a GPU machine) returns one kwargs
    dict for every layer; each layer's window is read from it as from the per-layer list."""
    import kvcake.layer_types as layer_types

    config = Gemma3TextConfig(num_hidden_layers=3, sliding_window=8, max_position_embeddings=1024,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"])  # fmt: skip
    per_layer = layer_windows(config, "gemma3_text")
    monkeypatch.setattr(
        layer_types,
        "get_layer_types_and_kwargs",
        lambda text: (list(text.layer_types), {"sliding_window": 8}),
    )
    assert layer_windows(config, "gemma3_text") == per_layer == (8, None, 8)
    monkeypatch.setattr(layer_types, "get_layer_types_and_kwargs", lambda text: (["full_attention"] * 3, {}))
    assert layer_windows(config, "gemma3_text") == ()
