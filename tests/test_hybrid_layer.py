"""Attention beside a recurrent block in one cache layer (transformers' layer type "hybrid": Falcon-H1
runs a Mamba block beside the attention in every decoder layer): kvcake compresses the keys and
keeps the states whole (``kvcake.hybrid_layer``). A tiny random Falcon-H1 of the installed
transformers, three layers.

Oracles: the stock model with transformers' ``DynamicCache`` (a covering budget decodes its tokens
and logits; a prefill leaves its states bit for bit; a compressed step equals the stock model over a
``DynamicCache`` holding exactly the kept entries beside the same states), and kvcake's own paths
against each other (beams, a saved context, a replayed prefill, a compiled step)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers import PretrainedConfig

import kvcake
from kvcake.adapters import describe_model, with_cache
from kvcake.hybrid_layer import HybridLayer
from kvcake.layer_types import layer_windows
from kvcake.recurrent import check_supported, held_states
from kvcake.replay import Captured, capture_queries
from shared_checks import (
    GREEDY,
    assert_a_covering_budget_decodes_the_stock_models,
    assert_a_saved_context_answers_as_before,
    assert_the_replay_equals_compress,
    beams_as_the_stock_models,
    cache_states,
    compiled_and_eager_decoding,
    full_and_compressed,
    kept_as_dynamic_cache,
    step_and_oracle_logits,
    tiny_model,
)

BASE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
# family -> (config class, keyword arguments): Falcon-H1 a hybrid layer each (attention beside Mamba),
# Zamba and Zamba2 Mamba layers with a hybrid one every third / second (one attention block shared),
# ZAYA a hybrid layer each (its attention convolves queries and keys over time: states of its own)
FAMILIES = {
    "falcon_h1": ("FalconH1Config", {**BASE, "num_hidden_layers": 3, "head_dim": 16, "mamba_n_heads": 4,
                                     "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_d_conv": 4,
                                     "mamba_expand": 1, "mamba_d_ssm": 64}),
    "zamba": ("ZambaConfig", {**BASE, "num_hidden_layers": 6, "attn_layer_period": 3, "attn_layer_offset": 2,
                              "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 1, "mamba_dt_rank": 4,
                              "attention_head_dim": 16}),
    "zamba2": ("Zamba2Config", {**BASE, "num_hidden_layers": 4, "mamba_d_state": 8, "n_mamba_heads": 4,
                                "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"]}),
    "zaya": ("ZayaConfig", {**BASE, "num_hidden_layers": 3, "head_dim": 16, "moe_intermediate_size": 32,
                            "num_experts": 2, "router_hidden_size": 16}),
}  # fmt: skip
BUDGET = 12


def _model(family: str = "falcon_h1") -> torch.nn.Module:
    try:
        check_supported(family)
    except ValueError:  # transformers before the per-state LinearAttentionLayer: refused with the fix
        try:
            model = tiny_model(*FAMILIES[family])
        except Exception as e:  # (5.0 cannot build a tiny Zamba2: its tied-weight keys find nothing)
            pytest.skip(f"transformers {tf.__version__} cannot build a tiny {family}: {str(e)[:80]}")
        with pytest.raises(ValueError, match="upgrade transformers"):
            describe_model(model)
        pytest.skip(f"refused on transformers {tf.__version__}")
    return tiny_model(*FAMILIES[family])


def _ids(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _state_bytes(layers) -> int:
    return sum(t.numel() * t.element_size() for layer in layers for t in held_states(layer))


FAMILY = pytest.mark.parametrize("family", list(FAMILIES))


@FAMILY
def test_a_covering_budget_decodes_the_stock_models_tokens(family):
    cache = assert_a_covering_budget_decodes_the_stock_models(_model(family))
    hybrid = [i for i, layer in enumerate(cache.layers) if type(layer) is HybridLayer]
    assert (
        hybrid
        == list(cache.compressed)
        == {"falcon_h1": [0, 1, 2], "zamba": [2, 5], "zamba2": [1, 3], "zaya": [0, 1, 2]}[family]
    )
    assert cache.budgets.shape == (1, len(hybrid)) and (cache.budgets == 40).all()


@FAMILY
@pytest.mark.parametrize("preset", ["cake-adakv", "h2o", "criticalkv"])
def test_a_prefill_leaves_the_full_caches_states_and_counts_their_bytes_apart(family, preset):
    """Whatever the budget, each Mamba block sees the stock forward's inputs (an attention attends
    every prompt token before its layer evicts; after H2O's own prompt attention, to float rounding)
    and holds its states; budgets sum over the hybrid layers; the states' bytes are ``recurrent``, the
    kept entries' ``compressed``, and a full cache holds both."""
    model = _model(family)
    full, cache = full_and_compressed(model, _ids(40, seed=1), preset, budget=BUDGET, window=4)
    first = cache.compressed[0]
    for lid, (ours, stock) in enumerate(zip(cache.layers, full.layers, strict=True)):
        pairs = list(zip(held_states(ours), held_states(stock), strict=True))
        assert len(pairs) == 2  # the conv and the SSM state
        for a, b in pairs:
            torch.testing.assert_close(a, b, rtol=0, atol=0 if preset != "h2o" or lid < first else 1e-5)
    n = len(cache.compressed)
    assert int(cache.budgets.sum()) == n * BUDGET and cache.layer_counts().sum() <= n * BUDGET * 2
    parts, states = cache.kv_bytes_parts(), _state_bytes(full.layers)
    kept = sum(
        cache.layers[i].keys.numel() * 4 + cache.layers[i].values.numel() * 4 for i in cache.compressed
    )
    assert parts.recurrent == states > 0 and parts.compressed == kept and parts.total == cache.kv_bytes()
    width = cache.info.head_dim
    assert parts.full == states + n * 40 * 2 * 2 * width * 4 and parts.full_entries == n * 40 * 2  # fp32


@FAMILY
@pytest.mark.parametrize("new", [1, 3])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("spec", ["snapkv", "criticalkv", "h2o"])
def test_a_compressed_step_is_the_models_over_the_kept_entries_and_the_same_states(family, spec, static, new):
    """16 of 40 entries kept per layer and head: the next token's logits (or three tokens', a question
    appended) through the KVCakeCache equal the stock model's over a DynamicCache holding exactly
    them beside the prompt's states (the Mamba blocks read and advance the same states)."""
    model = _model(family)
    got, want, oracle = step_and_oracle_logits(
        model, _ids(40, seed=2), spec, static, kept_as_dynamic_cache, torch.arange(5, 5 + new)[None]
    )
    hybrid = describe_model(model).compressed_layers
    assert [oracle.layers[i].keys.shape[2] for i in hybrid] == [16 + new] * len(hybrid)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@FAMILY
def test_every_preset_keeps_its_budgets(family):
    model, x = _model(family), _ids(40, seed=3)
    n = len(describe_model(model).compressed_layers)
    for preset in kvcake.method.PRESETS:
        if preset == "full":
            continue
        out, cache = kvcake.generate(
            model, x, preset, budget=BUDGET, window=4, max_new_tokens=3, min_new_tokens=3, **GREEDY
        )
        assert out.sequences.shape == (1, 43), preset
        assert int(cache.budgets.sum()) == n * BUDGET, preset


@FAMILY
def test_beam_search_with_a_covering_budget_is_the_stock_models(family):
    cache = beams_as_the_stock_models(_model(family), _ids(30, seed=4), BUDGET)
    assert all(t.shape[0] == 3 for t in cache_states(cache))


@FAMILY
def test_a_reorder_takes_the_states_along(family):
    """Beam search's reorder (and a batch cut) moves each sequence's states with its entries."""
    model, x = _model(family), _ids(40, seed=10, batch=2)
    cache = kvcake.KVCakeCache(model, "snapkv", budget=BUDGET, window=4)
    with kvcake.enable(model), torch.no_grad():
        model(x, **with_cache(model, cache))
    hybrid = [layer for layer in cache.layers if isinstance(layer, HybridLayer)]
    before = [(t.clone(), layer.keys.clone()) for layer in hybrid for t in held_states(layer)]
    cache.reorder_cache(torch.tensor([1, 0]))
    after = [(t, layer.keys) for layer in hybrid for t in held_states(layer)]
    for (state, keys), (moved, moved_keys) in zip(before, after, strict=True):
        assert torch.equal(moved, state.flip(0)) and torch.equal(moved_keys, keys.flip(0))
    cache.batch_select_indices(torch.tensor([1]))
    cut = [t for layer in hybrid for t in held_states(layer)]
    assert all(torch.equal(t, state[:1]) for (state, _), t in zip(before, cut, strict=True))


@FAMILY
def test_a_context_saved_and_read_back_answers_as_before(family, tmp_path):
    model = _model(family)
    ctx = assert_a_saved_context_answers_as_before(model, _ids(48, seed=5), _ids(5, seed=6), tmp_path, BUDGET)
    assert len(cache_states(ctx.cache)) == 2 * len(model.config.layer_types)  # a conv and an SSM state each


def test_a_replayed_prefill_equals_compress():
    """The eval's replay copies the full cache's states beside each layer's replayed entries."""
    assert_the_replay_equals_compress(_model(), _ids(40, seed=7), _ids(4, seed=8), BUDGET)


@pytest.mark.parametrize("family", ["zamba", "zamba2"])
def test_the_replay_refuses_a_shared_attention_block(family):
    """Zamba's one attention module serves several layers (its layer_idx -1): the eval's replay, which
    records per module, says so instead of mixing the layers' queries."""
    model = _model(family)
    with pytest.raises(
        ValueError, match="is not one decoder layer.s attention .* kvcake.generate / kvcake.compress"
    ):
        with capture_queries(model, Captured()), torch.no_grad():
            model(_ids(8))


@pytest.mark.slow
@FAMILY
def test_a_decode_step_compiles_whole_and_equals_eager(family):
    """``torch.compile(fullgraph=True)`` over 16 steps of a left-padded batch: at most 2 graphs, logits
    as eager's (transformers marks these models not fullgraph-compileable because its StaticCache has
    no hybrid layer; kvcake's static storage is one)."""
    ids = _ids(40, seed=9, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    graphs, compiled, eager = compiled_and_eager_decoding(
        _model(family), "cake-adakv", ids, mask, 16, budget=BUDGET, window=4
    )
    assert 1 <= graphs <= 2
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_sliding_attention_beside_a_recurrent_block_is_refused():
    """A "hybrid_sliding" layer would need a sliding ring holding states."""
    try:
        text = PretrainedConfig(
            num_hidden_layers=2, sliding_window=8, layer_types=["hybrid_sliding", "hybrid"]
        )
    except Exception:  # a release that knows no such layer type (5.12: its strict-dataclass validation error)
        pytest.skip(f"transformers {tf.__version__} has no hybrid_sliding layers")
    with pytest.raises(ValueError, match="layer 0 runs sliding-window attention and a recurrent block"):
        layer_windows(text, "probe")
