"""Linear-attention hybrids (Qwen3.5, Qwen3-Next, LFM2, OLMo hybrid, Nemotron-H, Jamba, Bamba,
Granite 4): their recurrent layers keep transformers' own states (``kvcake.recurrent``), only the
full-attention layers are compressed. Each family is a tiny random model of the installed
transformers, two of its layers full attention.

Oracles: the stock model with transformers' ``DynamicCache`` (a budget covering the prompt decodes
its tokens and logits; the states a prefill leaves are its states bit for bit, whatever the budget,
since a prefill attends every token before evicting), and kvcake's own paths against each other
(a saved context read back, a replayed prefill, a compiled step)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import kvcake
from kvcake import recurrent
from kvcake.adapters import describe_model
from kvcake.recurrent import EmptyLayer, RecurrentLayer, held_states
from kvcake.storage import load_context
from shared_checks import (
    assert_a_covering_budget_decodes_the_stock_models,
    assert_a_saved_context_answers_as_before,
    assert_the_replay_equals_compress,
    beams_as_the_stock_models,
    compiled_and_eager_decoding,
    full_and_compressed,
    tiny_model,
)

BASE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
LINEAR = {"layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
          "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
          "linear_value_head_dim": 16}  # fmt: skip
MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_d_conv": 4,
         "mamba_expand": 1}  # fmt: skip
# family -> (config class, keyword arguments): 4 layers (Nemotron-H 5: an MLP block holding nothing)
FAMILIES = {
    "qwen3_5": ("Qwen3_5TextConfig", {**BASE, **LINEAR, "num_hidden_layers": 4}),
    "qwen3_next": (
        "Qwen3NextConfig",
        {
            **BASE,
            **LINEAR,
            "num_hidden_layers": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
    ),  # fmt: skip
    "lfm2": ("Lfm2Config", {**BASE, "num_hidden_layers": 4, "full_attn_idxs": [1, 3]}),  # short convolutions
    "olmo_hybrid": ("OlmoHybridConfig", {**BASE, **LINEAR, "num_hidden_layers": 4}),
    "nemotron_h": (
        "NemotronHConfig",
        {
            **BASE,
            **MAMBA,
            "num_hidden_layers": 5,
            "n_groups": 1,
            "ssm_state_size": 8,
            "conv_kernel": 4,
            "expand": 1,
            "layers_block_type": ["mamba", "attention", "mlp", "mamba", "attention"],
        },
    ),  # fmt: skip
    "jamba": (
        "JambaConfig",
        {
            **BASE,
            "num_hidden_layers": 4,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "num_experts": 2,
            "mamba_d_state": 8,
            "mamba_d_conv": 4,
            "mamba_expand": 1,
            "mamba_dt_rank": 4,
        },
    ),  # fmt: skip
    "bamba": ("BambaConfig", {**BASE, **MAMBA, "num_hidden_layers": 4, "attn_layer_indices": [1, 3]}),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        {
            **BASE,
            **MAMBA,
            "num_hidden_layers": 4,
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "shared_intermediate_size": 32,
            "layer_types": ["mamba", "attention", "mamba", "attention"],
        },
    ),  # fmt: skip
}
BUDGET = 12


def _model(family: str) -> torch.nn.Module:
    model = tiny_model(*FAMILIES[family])
    try:
        describe_model(model)
    except ValueError as e:  # transformers before the per-state LinearAttentionLayer: refused with the fix
        if "upgrade transformers" not in str(e):
            raise
        pytest.skip(f"refused on transformers {tf.__version__}: {e}")
    return model


def _per_state_layers() -> bool:
    """Whether the installed transformers has the per-state LinearAttentionLayer kvcake builds on."""
    try:
        recurrent.check_supported("probe")
    except ValueError:
        return False
    return True


def _ids(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_covering_budget_decodes_the_stock_models_tokens(family):
    cache = assert_a_covering_budget_decodes_the_stock_models(_model(family))
    types = [type(layer) for layer in cache.layers]
    assert types.count(RecurrentLayer) == 2 and (EmptyLayer in types) == (family == "nemotron_h")
    assert (
        cache.budgets.shape == (1, 2) and (cache.budgets == 40).all()
    )  # (the recurrent layers: padding masked)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("preset", ["cake-adakv", "h2o", "criticalkv"])
def test_a_prefill_leaves_the_full_caches_states_and_budgets_sum_over_attention_layers(family, preset):
    """Whatever the budget, a prefill attends every token before it evicts: the recurrent layers see
    the stock forward's inputs and hold its states, bit for bit (to float rounding after H2O's layers,
    which compute the prompt's attention themselves to sum its columns). Budgets cover the two
    attention layers."""
    model = _model(family)
    full, cache = full_and_compressed(model, _ids(40, seed=1), preset, budget=BUDGET, window=4)
    held = 0
    for ours, stock in zip(cache.layers, full.layers, strict=True):
        if isinstance(ours, RecurrentLayer):
            pairs = list(zip(held_states(ours), held_states(stock), strict=True))
            assert pairs
            for a, b in pairs:
                torch.testing.assert_close(
                    a, b, rtol=0, atol=0 if preset != "h2o" or ours is cache.layers[0] else 1e-5
                )
            held += sum(t.numel() * t.element_size() for t in held_states(stock))
    assert int(cache.budgets.sum()) == 2 * BUDGET and cache.budgets.shape == (1, 2)
    assert cache.layer_counts().sum() <= 2 * BUDGET * model.config.num_key_value_heads
    parts = cache.kv_bytes_parts()
    assert parts.recurrent == held > 0 and parts.total == cache.kv_bytes()
    entries = 2 * 40 * model.config.num_key_value_heads  # a full cache's, in its two attention layers
    assert (
        parts.full_entries == entries and parts.full == held + entries * 2 * 16 * 4
    )  # keys and values, fp32
    # the peak counts every state with the last attention layer's whole prompt (before its eviction)
    assert cache.prefill_peak_kv_bytes >= held + entries // 2 * 2 * 16 * 4


def test_every_preset_runs_on_a_linear_attention_hybrid():
    model = _model("qwen3_5")
    x = _ids(40, seed=2)
    for preset in kvcake.method.PRESETS:
        if preset == "full":
            continue
        out, cache = kvcake.generate(model, x, preset, budget=BUDGET, window=4, max_new_tokens=4,
                                     min_new_tokens=4, do_sample=False, pad_token_id=0)  # fmt: skip
        assert out.shape == (1, 44), preset
        assert int(cache.budgets.sum()) == 2 * BUDGET, preset


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_beam_search_with_a_covering_budget_is_the_stock_models(family):
    """Beam search reorders the recurrent states with the compressed layers' entries."""
    cache = beams_as_the_stock_models(_model(family), _ids(30, seed=3), BUDGET)
    assert cache.layers[0].batch == 3


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "lfm2"])
def test_a_context_saved_and_read_back_answers_as_before(family, tmp_path):
    assert_a_saved_context_answers_as_before(
        _model(family), _ids(48, seed=4), _ids(5, seed=5), tmp_path, BUDGET
    )


def test_a_context_file_of_another_layout_is_refused(tmp_path):
    """A file whose recurrent layer lost a state, or a Llama's file read into a hybrid, is refused."""
    model = _model("qwen3_5")
    ctx = kvcake.compress(model, _ids(48, seed=4), "snapkv", budget=BUDGET, window=4)
    ctx.save(tmp_path / "ctx.kvc")
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(**{**BASE, "num_hidden_layers": 4})).eval()
    with pytest.raises(ValueError):
        load_context(llama, tmp_path / "ctx.kvc")
    layer = ctx.cache.layers[0]
    entry = recurrent.recurrent_entry(layer)
    assert (
        recurrent.restore_recurrent(RecurrentLayer(), {}, "layers.0.", entry, "cpu", 48)
        == "state 0's tensors are missing"
    )
    assert "recurrent layer where" in recurrent.restore_recurrent(
        ctx.cache.layers[1], {}, "x.", entry, "cpu", 48
    )


def test_a_replayed_prefill_equals_compress():
    """The eval's replay copies the full cache's states to the recurrent layers."""
    assert_the_replay_equals_compress(_model("qwen3_5"), _ids(40, seed=6), _ids(4, seed=7), BUDGET)


def test_a_model_without_attention_is_refused():
    """Mamba: every layer recurrent, nothing kvcake compresses (older releases: refused for the states)."""
    model = tf.MambaForCausalLM(
        tf.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=4)
    )
    with pytest.raises(
        ValueError, match="mamba: no layer of this model attends" if _per_state_layers() else "mamba"
    ):
        describe_model(model)


def test_a_transformers_without_the_per_state_layer_is_refused_with_the_fix(monkeypatch):
    model = _model("qwen3_5")
    monkeypatch.setattr(recurrent, "LinearAttentionLayer", None)
    with pytest.raises(ValueError, match=r"qwen3_5_text: .*LinearAttentionLayer.*upgrade transformers"):
        describe_model(model)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_a_decode_step_compiles_whole_and_equals_eager(family):
    """``torch.compile(fullgraph=True)`` over 24 steps: at most 2 graphs (the second, the growing mask's
    length made symbolic), logits as eager's, for a cache holding recurrent states beside static layers."""
    model = _model(family)
    ids = _ids(40, seed=8, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    graphs, compiled, eager = compiled_and_eager_decoding(
        model, "cake-adakv", ids, mask, 24, budget=BUDGET, window=4
    )
    assert 1 <= graphs <= 2
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
