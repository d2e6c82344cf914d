"""Latent attention (MLA: DeepSeek-V2/V3, MiniCPM3, GLM-4 MoE lite, Youtu, Sarvam-MLA, Mistral 4,
LongCat-Flash, and the linear-attention hybrids Kimi Linear and Bailing): kvcake compresses the
latents the model caches, scoring and attending in the absorbed form (``kvcake.latent``). Tiny random
models of the installed transformers; releases that cache the expanded keys (before 5.24) are
refused with the fix."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from transformers.cache_utils import DynamicCache

import kvcake
from kvcake import KVCakeCache, with_cache
from kvcake import fp8 as fp8_module
from kvcake.fp8 import RECENT, decode, encode, recent_bytes
from kvcake.latent import LatentLayer, absorb, expand_output, output_weight
from kvcake.replay import Captured, capture_queries, replay_compress
from shared_checks import (
    GREEDY,
    assert_a_covering_budget_decodes_the_stock_models,
    compiled_and_eager_decoding,
    kept_as_dynamic_cache,
    step_and_oracle_logits,
    tiny_model,
)
from test_fp8 import STEPS, _decode, _prefilled
from test_padded_follow_ups import assert_rows_as_alone, follow_ups, left_padded

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=12, max_position_embeddings=256, moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)  # fmt: skip
HYBRID = dict(num_hidden_layers=4, pad_token_id=0, eos_token_id=2,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])  # fmt: skip
FAMILIES = {
    "DeepseekV3Config": {},
    "DeepseekV2Config": {},
    "MiniCPM3Config": {},
    "Glm4MoeLiteConfig": {},
    "YoutuConfig": {},
    "SarvamMLAConfig": {},
    "Mistral4Config": {"pad_token_id": 0},
    "LongcatFlashConfig": {
        "q_lora_rank": 16,
        "head_dim": 8,
        "ffn_hidden_size": 64,
        "expert_ffn_hidden_size": 32,
        "moe_topk": 2,
        "zero_expert_num": 0,
        "num_layers": 2,
    },  # fmt: skip
    "KimiLinearConfig": {
        **HYBRID,
        "bos_token_id": 1,
        "linear_attn_config": {"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4},
    },  # fmt: skip
    "BailingHybridConfig": HYBRID,
}


def _model(name: str = "DeepseekV3Config", dtype=torch.float32) -> torch.nn.Module:
    model = tiny_model(name, {**BASE, **FAMILIES[name]}).to(dtype)
    attention = next(m for m in model.modules() if hasattr(m, "kv_b_proj"))
    if not callable(getattr(attention, "expand_kv", None)):
        with pytest.raises(ValueError, match="upgrade transformers"):
            KVCakeCache(model, "snapkv", budget=16)
        pytest.skip(f"transformers {transformers.__version__} caches MLA's expanded keys (refused, checked)")
    return model


def _prompt(n: int = 40, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_covering_budget_decodes_the_stock_models(name):
    """The model's own attention over every latent alone; kvcake's absorbed attention over the stored
    latents in the left-padded batch; the same greedy tokens and logits as the stock model's."""
    cache = assert_a_covering_budget_decodes_the_stock_models(_model(name))
    assert all(isinstance(cache.layers[i], LatentLayer) for i in cache.compressed)


def test_the_absorbed_form_is_the_models_attention():
    """float64: ``absorb``'s logits over ``[c; k_rot]`` are the expanded query's over the expanded keys,
    ``expand_output`` of an output over ``c`` is the one over the expanded values, and the composite
    projection's value norms (CriticalKV) are ``||W_O^h v_h||`` of the expanded values."""
    model = _model(dtype=torch.float64)
    attention = next(m for m in model.modules() if hasattr(m, "kv_b_proj"))
    gen = torch.Generator().manual_seed(1)
    c, rot = (
        torch.randn(2, 1, 7, 16, generator=gen, dtype=torch.float64),
        torch.randn(2, 1, 7, 8, generator=gen, dtype=torch.float64),
    )
    query = torch.randn(2, 4, 3, 16, generator=gen, dtype=torch.float64)  # (B, H, q, d_nope + d_rot)
    keys, values = attention.expand_kv(c, rot)  # (B, H, 7, 16), (B, H, 7, 12)
    logits = query @ keys.transpose(-1, -2)
    absorbed = absorb(attention, query) @ torch.cat([c, rot], -1).transpose(-1, -2)
    torch.testing.assert_close(absorbed, logits, rtol=1e-12, atol=1e-12)
    probs = logits.softmax(-1)
    out = (probs @ c).transpose(1, 2)  # (B, q, H, r)
    torch.testing.assert_close(
        expand_output(attention, out), (probs @ values).transpose(1, 2), rtol=1e-12, atol=1e-12
    )
    w_o = attention.o_proj.weight  # (hidden, H * d_v)
    per_head = torch.einsum("ohv,bhnv->bhno", w_o.view(64, 4, 12), values).norm(dim=-1)  # (B, H, 7)
    composite = output_weight(attention, w_o).view(64, 4, 16)
    torch.testing.assert_close(torch.einsum("ohr,bnr->bhno", composite, c[:, 0]).norm(dim=-1), per_head)


@pytest.mark.parametrize("new", [1, 3])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("spec", ["snapkv", "criticalkv", "h2o"])
def test_a_compressed_step_is_the_models_attention_over_the_kept_latents(spec, static, new):
    """16 of 40 latents kept: the next token's logits (or three tokens', a question appended) through
    the KVCakeCache (absorbed attention, the dynamic layout or static storage) equal the stock model's
    over a DynamicCache holding exactly them."""
    new_ids = torch.arange(5, 5 + new)[None]
    got, want, oracle = step_and_oracle_logits(
        _model(), _prompt(), spec, static, functools.partial(kept_as_dynamic_cache, split=16), new_ids
    )
    assert [oracle.layers[i].keys.shape[2] for i in range(3)] == [16 + new] * 3  # the kept, then the new
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["snapkv", "cake", "adakv", "cake-adakv", "criticalkv", "critical-adakv",
                                  "h2o", "tova", "streamingllm", "pyramidkv", "defensivekv", "layer-defensivekv"])  # fmt: skip
def test_every_preset_keeps_its_budgets_and_the_latents_bytes(spec):
    """Budgets sum exactly over the latent layers; each kept token holds its latent and rotated key
    alone (kv_lora_rank + qk_rope_head_dim elements, as one key), which is what the memory counts."""
    model = _model("KimiLinearConfig")
    out, cache = kvcake.generate(model, _prompt(48, 2), spec, budget=12, window=4, max_new_tokens=3, **GREEDY)
    assert out.sequences.shape == (2, 51)
    assert int(cache.budgets.sum()) == 12 * 2 * len(cache.compressed)
    for lid in cache.compressed:
        layer = cache.layers[lid]
        assert layer.keys.shape[-1] == 16 + 8 and layer.values.shape[-1] == 0
        assert layer.kv_heads == 1 and layer.counts.shape == (2, 1)
        assert layer.kv_bytes() == layer.keys.numel() * 4  # float32
    parts = cache.kv_bytes_parts()
    assert parts.compressed == sum(cache.layers[i].kv_bytes() for i in cache.compressed)


@pytest.mark.parametrize("heads", ["uniform", "adakv"])
def test_the_cascade_ends_at_one_shot_eviction_holding_less(heads):
    """CAKE's cascade over the latent layers keeps what one eviction at the end keeps, and holds less
    during the prefill."""
    model, ids = _model(), _prompt(48, 2)
    spec = f"layers=cake,heads={heads},score=cake"
    cascade = KVCakeCache(model, kvcake.make_method(spec, budget=12, window=4), static=False)
    once = KVCakeCache(
        model, kvcake.make_method(spec + ",layers.cascading=false", budget=12, window=4), static=False
    )
    with kvcake.enable(model), torch.no_grad():
        for cache in (cascade, once):
            model(ids, **with_cache(model, cache))
    assert torch.equal(cascade.budgets, once.budgets) and int(cascade.budgets.sum()) == 12 * 2 * 3
    for lid in cascade.compressed:
        assert torch.equal(cascade.layers[lid].padded_positions(), once.layers[lid].padded_positions())
    assert cascade.prefill_peak_kv_bytes < once.prefill_peak_kv_bytes


@pytest.mark.parametrize("spec", ["snapkv", "h2o", "adakv", "cake"])
def test_compiled_steps_are_one_graph_and_equal_eager(spec):
    """A left-padded batch decoding 12 steps in static storage: ``fullgraph=True`` captures the step in
    at most 2 graphs (the second, the growing mask's length made symbolic), logits as eager's."""
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :6] = 0
    graphs, compiled, eager = compiled_and_eager_decoding(
        _model(), spec, _prompt(40, 2), mask, 12, budget=16, window=4
    )
    assert 1 <= graphs <= 2
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


@pytest.mark.parametrize("spec", ["snapkv", "adakv"])
def test_a_compressed_context_answers_saved_and_read_back(spec, tmp_path):
    """A document compressed alone (dense, or ragged for Ada-KV) answers a question, and the same after
    ``save`` and ``load``."""
    model = _model()
    ctx = kvcake.compress(model, _prompt(40), spec, budget=12, window=4)
    question = torch.tensor([[7, 8, 9]])
    first = ctx.generate(question, max_new_tokens=4, **GREEDY)
    ctx.save(tmp_path / "doc.kvc")
    again = kvcake.load_context(model, tmp_path / "doc.kvc").generate(question, max_new_tokens=4, **GREEDY)
    assert torch.equal(first.sequences, again.sequences)


@pytest.mark.parametrize("spec", ["snapkv", "adakv"])
def test_beam_search_reorders_the_latents(spec):
    """Beam search (the cache's rows reordered every step): a covering budget gives the stock model's
    beams; a compressing one runs its beams over the kept latents."""
    model, ids = _model(), _prompt(40)
    beams = {"num_beams": 3, "max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        stock = model.generate(ids, **beams)
    covered, _ = kvcake.generate(model, ids, spec, budget=64, window=4, **beams)
    assert torch.equal(covered, stock)
    out, cache = kvcake.generate(model, ids, spec, budget=12, window=4, **beams)
    assert out.shape == (1, 44) and cache.layers[0].batch == 3


@pytest.mark.parametrize("spec", ["cake", "criticalkv"])
def test_the_evals_replayed_prefill_equals_compress(spec):
    """The eval's replay (``kvcake.replay``) hands the recorded, unabsorbed queries to the prefill hook,
    which absorbs them as the kvcake attention's would: the same kept latents as ``kvcake.compress``."""
    model, ids = _model("KimiLinearConfig"), _prompt(40)
    captured, full = Captured(), DynamicCache(config=model.config)
    with capture_queries(model, captured), torch.no_grad():
        logits = model(ids, **with_cache(model, full), logits_to_keep=1).logits[:, -1]
    method = kvcake.make_method(spec, budget=12, window=4)
    got, ref = (
        replay_compress(model, method, captured, full, ids, logits),
        kvcake.compress(model, ids, method),
    )
    assert (got.cache.layer_counts() == ref.cache.layer_counts()).all()
    for lid in ref.cache.compressed:
        assert torch.equal(got.cache.layers[lid].positions, ref.cache.layers[lid].positions)
    question = torch.tensor([[7, 8, 9]])
    torch.testing.assert_close(got.forward(question), ref.forward(question), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("spec", ["snapkv", "h2o", "cake", "adakv", "critical-adakv", "tova", "full"])
def test_padded_follow_ups_answer_as_alone(spec, static, kv_dtype):
    """Follow-ups of 3, 7 and 5 tokens in one left-padded batch after a latent document (its latents
    in the model's dtype or in float8): each row's answer is its follow-up's alone (the pads settled
    like per-head entries: one head of latents). Kimi Linear's recurrent layers would read the pads
    as text: refused, said before any work."""
    sizes = {} if spec == "full" else {"budget": 24, "window": 4}
    ctx = kvcake.compress(_model(), _prompt(90), spec, static=static, kv_dtype=kv_dtype, **sizes)
    assert ctx.padding_refused() is None
    assert_rows_as_alone(ctx, follow_ups())
    hybrid = kvcake.compress(_model("KimiLinearConfig"), _prompt(60), spec, kv_dtype=kv_dtype, **sizes)
    with pytest.raises(ValueError, match=r"follow-ups with padding are not supported here \(the cache holds"):
        hybrid.generate(*left_padded(follow_ups()), max_new_tokens=2)


@pytest.mark.parametrize("spec", ["snapkv", "adakv", "cake", "h2o"])
def test_float8_storage_holds_each_kept_latent_in_one_byte_an_element(spec):
    """``kv_dtype="fp8"``: the prompt compresses alike, each kept ``[c; k_rot]`` is stored as its float8
    bits under one power-of-two scale (the values are c, a view of the keys: read with the keys' scale,
    their own zero-width), the last tokens' latents exactly in the rings, one byte an element."""
    model = _model()
    ref, got = _prefilled(model, spec, None), _prefilled(model, spec, "fp8")
    for lid in ref.compressed:
        a, b = ref.layers[lid], got.layers[lid]
        assert (
            torch.equal(a.positions, b.positions) and b.keys.dtype == torch.uint8 and b.values.shape[-1] == 0
        )
        scale = b.kv_scales[0]
        assert float(torch.log2(scale)).is_integer() and torch.equal(b.keys, encode(a.keys, scale))
        rel = (decode(b.keys, scale) - a.keys).abs() / a.keys.abs().clamp_min(scale * 2**-6)
        assert float(rel.max()) <= 1 / 16 + 1e-6
        pos = a.padded_positions()  # (B, 1, N)
        latest = pos >= a.length - RECENT
        slot = (pos % RECENT).unsqueeze(-1).expand(*pos.shape, b.recent_keys.shape[-1])
        assert torch.equal(b.recent_keys.gather(2, slot)[latest] * scale, a.padded(a.keys, 0)[latest])
        assert (b.kv_bytes() - recent_bytes(b)) * 4 == a.kv_bytes()  # float32's four bytes, one


@pytest.mark.parametrize("spec", ["snapkv", "adakv", "cake", "h2o", "critical-adakv"])
@pytest.mark.parametrize("static", [True, False])
def test_float8_latents_decode_as_the_model_dtype_where_every_token_is_exact(spec, static, monkeypatch):
    """With a ring as long as the prompt and the steps the absorbed attention reads every latent's
    exact copy, and the key scale folded onto the query and the output rounds nothing: the logits of
    the model's dtype, bit for bit. With the default ring, within float8's rounding: relative to the
    largest logit, below 0.005 at every step but CAKE's first (0.077, in its first row)."""
    model = _model()
    ref, _ = _decode(model, spec, None, static=static, batch=2)
    got, cache = _decode(model, spec, "fp8", static=static, batch=2)
    assert all(cache.layers[lid].keys.dtype == torch.uint8 for lid in cache.compressed)
    steps = STEPS + 1 if cache.method.decode == "none" else 2
    assert float((got - ref)[:steps].abs().amax() / ref.abs().amax()) < 0.1
    monkeypatch.setattr(fp8_module, "RECENT", 128)
    exact, _ = _decode(model, spec, "fp8", static=static, batch=2)
    assert torch.equal(exact, ref)


@pytest.mark.parametrize("spec", ["snapkv", "cake"])
def test_a_float8_latent_decode_step_compiles_whole(spec):
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :6] = 0
    graphs, compiled, eager = compiled_and_eager_decoding(
        _model(), spec, _prompt(40, 2), mask, 12, budget=16, window=4, kv_dtype="fp8"
    )
    assert 1 <= graphs <= 2
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_what_is_not_supported_is_refused_with_the_reason():
    model = _model()
    attention = next(m for m in model.modules() if hasattr(m, "kv_b_proj"))
    proj = attention.kv_b_proj
    attention.kv_b_proj = torch.nn.Linear(proj.in_features, proj.out_features, bias=True)
    with pytest.raises(ValueError, match="kv_b_proj has a bias"):
        KVCakeCache(model, "snapkv", budget=16)
    attention.kv_b_proj = proj
    indexed = tiny_model(
        "DeepseekV32Config", {**BASE, "q_lora_rank": 16, "index_head_dim": 8, "index_n_heads": 2}
    )
    with pytest.raises(ValueError, match="indexer's keys"):
        KVCakeCache(indexed, "snapkv", budget=16)


def test_output_attentions_by_position():
    """``output_attentions`` after the prompt (``kvcake.position_weights``) over the absorbed
    query: with nothing evicted the full cache's weights; compressed, rows summing to 1."""
    model = _model()
    for sub in model.modules():
        if getattr(sub, "config", None) is not None:
            sub.config._attn_implementation = "eager"

    def weights(cache):
        with kvcake.enable(model), torch.no_grad():
            out = model.generate(_prompt(), **with_cache(model, cache), max_new_tokens=3, min_new_tokens=3,
                                 do_sample=False, return_dict_in_generate=True, output_attentions=True)  # fmt: skip
        return [a for step in out.attentions[1:] for a in step]

    full = weights(DynamicCache(config=model.config))
    for a, b in zip(full, weights(KVCakeCache(model, "snapkv", budget=64)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    kept = weights(KVCakeCache(model, "snapkv", budget=16, window=4))
    assert [a.shape for a in kept] == [a.shape for a in full]
    for a in kept:
        torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]), rtol=0, atol=1e-5)
        assert 0 < int((a[0, 0, 0] > 0).sum()) < a.shape[-1]  # evicted positions read 0
