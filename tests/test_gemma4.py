"""Gemma 4: a hybrid (sliding layers kept as transformers keeps them) whose global layers have a head
dim and KV heads of their own (a heterogeneous config: ``layer_types.attention_shape`` reads the
compressed layers' shape) and values projected from the keys (``attention_k_eq_v``). A tiny random
model of the installed transformers (5.24; earlier releases have no Gemma 4 and skip).

Oracle: the stock model over a ``DynamicCache`` whose global layers hold exactly the kept entries."""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version

import kvcake
from kvcake.adapters import describe_model
from shared_checks import (
    assert_a_saved_context_answers_as_before,
    kept_as_dynamic_cache,
    step_and_oracle_logits,
    tiny_model,
)

CONFIG = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
          "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": 8,
          "layer_types": ["sliding_attention", "full_attention"] * 2, "hidden_size_per_layer_input": 8,
          "vocab_size_per_layer_input": 128, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip


def _model() -> torch.nn.Module:
    return tiny_model("Gemma4TextConfig", CONFIG)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def test_the_compressed_layers_shape_is_the_global_layers():
    info = describe_model(_model())
    assert info.compressed_layers == (1, 3) and info.windows == (8, None, 8, None)
    assert (info.num_heads, info.num_kv_heads, info.head_dim) == (4, 1, 32)  # the sliding layers': 2 x 16


@pytest.mark.parametrize("new", [1, 3])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("spec", ["snapkv", "criticalkv", "h2o"])
def test_a_compressed_step_is_the_models_attention_over_the_kept_entries(spec, static, new):
    """16 of 40 entries kept in each global layer (one KV head of 32): the next token's logits (or a
    three-token question's) through the KVCakeCache equal the stock model's over them."""
    if new > 1 and Version(transformers.__version__) < Version("5.24"):
        pytest.skip(
            "before 5.24 the stock mask of a multi-token append spans the positions, not a shorter cache"
        )
    got, want, oracle = step_and_oracle_logits(
        _model(), _ids(40, seed=1), spec, static, kept_as_dynamic_cache, torch.arange(5, 5 + new)[None]
    )
    assert [oracle.layers[i].keys.shape[2:] for i in (1, 3)] == [(16 + new, 32)] * 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_every_preset_keeps_its_budgets_in_the_global_layers(kv_dtype):
    model, x = _model(), _ids(40, seed=2)
    for preset in kvcake.method.PRESETS:
        if preset == "full":
            continue
        out, cache = kvcake.generate(model, x, preset, budget=12, window=4, kv_dtype=kv_dtype, max_new_tokens=3,
                                     min_new_tokens=3, do_sample=False, pad_token_id=0)  # fmt: skip
        assert out.shape == (1, 43), preset
        assert cache.budgets.shape == (1, 2) and int(cache.budgets.sum()) == 24, preset
        assert all(cache.layers[i].keys.shape[-1] == 32 for i in (1, 3)), preset


def test_a_saved_context_answers_as_before(tmp_path):
    assert_a_saved_context_answers_as_before(_model(), _ids(48, seed=3), _ids(5, seed=4), tmp_path, 12)
