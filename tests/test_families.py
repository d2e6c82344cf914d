"""Decoder families beyond Llama, each a tiny random model of the installed transformers: a budget
covering the prompt decodes the stock model's tokens, and every part of a method (CAKE's layer
budgets, Ada-KV's head budgets, the scorers, CriticalKV's projected value norms, decoding
evictions, a compressed context) runs on it with the budgets summing exactly. Families whose config
class the installed release lacks are skipped (transformers 5.0, the floor, has most of them).
Vision-language models are in ``test_vision_language.py``, models refused outright in
``test_hostile.py``."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import transformers as tf
from transformers import AttentionInterface

import kvcake
from kvcake.adapters import output_projection, projection_weight
from kvcake.replay import attention_modules
from shared_checks import (
    GREEDY,
    assert_a_covering_budget_decodes_the_stock_models,
    assert_same_decoding,
    tiny_model,
)

SMALL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2}  # fmt: skip
HEAD16 = {**SMALL, "head_dim": 16}
HYBRID = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
SHARED_EXPERT = {
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
}
GPT = {"vocab_size": 128, "n_embd": 64, "n_layer": 2, "n_head": 4, "bos_token_id": 1, "eos_token_id": 2}
OPT = {"vocab_size": 128, "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
       "word_embed_proj_dim": 64, "pad_token_id": 0}  # fmt: skip
FALCON = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "new_decoder_architecture": True, "num_kv_heads": 2}  # fmt: skip
DBRX = {"vocab_size": 128, "d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 512, "pad_token_id": 0,
        "bos_token_id": 1, "eos_token_id": 2, "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 1e4},
        "ffn_config": {"hidden_size": 64, "ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}}  # fmt: skip
# (ffn_hidden_size = d_model: up to 5.12 DBRX's router takes ffn_hidden_size as its input width)

# family -> (config class name, keyword arguments); all 2 layers, 4 query heads
FAMILIES = {
    "qwen2": ("Qwen2Config", SMALL),
    "qwen3": ("Qwen3Config", HEAD16),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {**SMALL, **MOE, "num_experts": 4, "shared_expert_intermediate_size": 32},
    ),
    "qwen3_moe": ("Qwen3MoeConfig", {**HEAD16, **MOE, "num_experts": 4}),
    "mixtral": (
        "MixtralConfig",
        {**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    "phi3": ("Phi3Config", SMALL),
    "phi": ("PhiConfig", SMALL),
    "gemma": ("GemmaConfig", HEAD16),
    "gemma2-hybrid": (
        "Gemma2Config",
        {**HEAD16, **HYBRID, "attn_logit_softcapping": None, "final_logit_softcapping": None},
    ),
    "gemma2-softcap-hybrid": (  # logit soft-capping (test_logit_terms.py)
        "Gemma2Config",
        {
            **HEAD16,
            **HYBRID,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 30.0,
            "attn_implementation": "eager",
        },  # (SDPA drops the cap: refused)
    ),
    "vaultgemma-hybrid": (
        "VaultGemmaConfig",
        {**HEAD16, **HYBRID, "attn_implementation": "eager"},
    ),  # capped 50
    "cohere": ("CohereConfig", SMALL),
    "cohere2-hybrid": ("Cohere2Config", {**SMALL, **HYBRID}),
    "olmo2": ("Olmo2Config", SMALL),
    "olmo3-hybrid": ("Olmo3Config", {**SMALL, **HYBRID}),
    "ministral-hybrid": ("MinistralConfig", {**HEAD16, **HYBRID}),
    "exaone4-hybrid": ("Exaone4Config", {**SMALL, **HYBRID}),
    "granite": ("GraniteConfig", SMALL),
    "stablelm": ("StableLmConfig", SMALL),
    "starcoder2": ("Starcoder2Config", {**SMALL, "sliding_window": None}),
    "smollm3": ("SmolLM3Config", SMALL),
    "glm4": ("Glm4Config", HEAD16),
    "nemotron": ("NemotronConfig", SMALL),
    "glm4_moe": ("Glm4MoeConfig", {**HEAD16, **MOE, **SHARED_EXPERT}),
    "ernie4_5": ("Ernie4_5Config", HEAD16),
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        {
            **SMALL,
            "moe_intermediate_size": 32,
            "moe_k": 2,
            "moe_num_experts": 4,
            "moe_num_shared_experts": 1,
            "moe_layer_start_index": 1,
        },
    ),  # fmt: skip
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", HEAD16),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", {**HEAD16, "num_experts": 4, "moe_topk": 2}),
    "seed_oss": ("SeedOssConfig", HEAD16),
    "arcee": ("ArceeConfig", HEAD16),
    "apertus": ("ApertusConfig", SMALL),
    "dots1": ("Dots1Config", {**SMALL, **MOE, **SHARED_EXPERT}),
    "dots1-hybrid": ("Dots1Config", {**SMALL, **MOE, **SHARED_EXPERT, **HYBRID}),
    "helium": ("HeliumConfig", HEAD16),
    "granitemoe": ("GraniteMoeConfig", {**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "granitemoeshared": (
        "GraniteMoeSharedConfig",
        {**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 32},
    ),  # fmt: skip
    "olmoe": ("OlmoeConfig", {**SMALL, "num_experts": 4, "num_experts_per_tok": 2}),
    "phimoe": (
        "PhimoeConfig",
        {**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    "bitnet": ("BitNetConfig", SMALL),
    "gpt2": ("GPT2Config", GPT),  # Conv1D projections: CriticalKV reads the transposed weight
    "gptj": ("GPTJConfig", {**GPT, "rotary_dim": 8}),
    "opt": ("OPTConfig", OPT),
    "gpt_neox": ("GPTNeoXConfig", {k: v for k, v in SMALL.items() if k != "num_key_value_heads"}),
    "dbrx": ("DbrxConfig", DBRX),  # fused QKV clipped, experts in its FFN config
    "gemma4-hybrid": (  # its global layers have their own head dim and KV heads (a heterogeneous config),
        "Gemma4TextConfig",  # and values that are the keys' projection normed again (attention_k_eq_v)
        {
            **HEAD16,
            **HYBRID,
            "global_head_dim": 32,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": True,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": 128,
        },
    ),  # fmt: skip
    "gemma4-moe-hybrid": (
        "Gemma4TextConfig",
        {
            **HEAD16,
            **HYBRID,
            "global_head_dim": 32,
            "enable_moe_block": True,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": 128,
        },
    ),  # fmt: skip
    "gpt_oss-hybrid": (  # attention sinks: a learned logit per head in the softmax (test_sinks.py)
        "GptOssConfig",
        {**HEAD16, **HYBRID, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    # its own attention code in every release so far: refused when the cache sees it was bypassed
    "falcon": ("FalconConfig", FALCON),
}
# CAKE's layer budgets, Ada-KV's head budgets and its score; CriticalKV's selection over Ada-KV;
# H2O's prompt attention and its evictions while decoding
PRESETS = ("cake-adakv", "critical-adakv", "h2o")
BUDGET = 12


def _model(family: str) -> torch.nn.Module:
    return tiny_model(*FAMILIES[family])


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _calls_the_attention_interface(model: torch.nn.Module) -> bool:
    """Whether the model's attention runs through transformers' attention interface in the installed
    release (a probe registered there is called), the extension point kvcake plugs into. Some
    families moved onto it late (Nemotron after 5.12, GPT-J after 5.22); before, kvcake refuses them."""
    calls = []

    def probe(module, query, key, value, attention_mask, **kwargs):
        calls.append(module)
        return torch.zeros_like(query).transpose(1, 2), None  # (B, q, H, d): the call is what counts

    AttentionInterface.register("kvcake_family_probe", probe)
    configs = [
        sub.config for sub in model.modules() if hasattr(getattr(sub, "config", None), "_attn_implementation")
    ]
    before = [config._attn_implementation for config in configs]
    try:
        for config in configs:
            config._attn_implementation = "kvcake_family_probe"
        with torch.no_grad(), contextlib.suppress(Exception):  # code of its own may choke on the name
            model(_ids(8))
    finally:
        for config, impl in zip(configs, before, strict=True):
            config._attn_implementation = impl
    return bool(calls)


def _supported(family: str) -> torch.nn.Module:
    """The family's model, or the test ends after checking that kvcake refuses it by name."""
    model = _model(family)
    if not _calls_the_attention_interface(model):
        with pytest.raises(
            ValueError, match=rf"{model.config.model_type}: its attention is computed in the model's own code"
        ):
            kvcake.generate(model, _ids(40), "cake-adakv", budget=12, window=4, max_new_tokens=2)
        pytest.skip(
            f"{family}'s attention does not call the interface in transformers {tf.__version__}: refused"
        )
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_covering_budget_decodes_the_stock_models_tokens(family):
    cache = assert_a_covering_budget_decodes_the_stock_models(_supported(family))
    assert (cache.budgets == 40).all()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_part_of_a_method_runs_and_budgets_sum_exactly(family):
    model = _supported(family)
    x = _ids(40, seed=1)
    for preset in PRESETS:
        out, cache = kvcake.generate(model, x, preset, budget=BUDGET, window=4, max_new_tokens=4, min_new_tokens=4,
                                     do_sample=False, pad_token_id=0)  # fmt: skip
        assert out.shape == (1, 44), preset
        global_layers = 1 if family.endswith("-hybrid") else 2  # a hybrid's sliding layer is not compressed
        assert cache.budgets.shape == (1, global_layers), preset
        assert int(cache.budgets.sum()) == BUDGET * global_layers, preset
    ctx = kvcake.compress(model, x[:, :32], "layer-defensivekv", budget=BUDGET, window=4)
    assert ctx.generate(x[:, 32:], max_new_tokens=3, min_new_tokens=3).shape == (1, 3)


def test_gpt2s_conv1d_projection_is_read_in_linears_layout():
    """GPT-2's ``c_proj`` is a ``Conv1D`` (``x @ W + b``, W stored as (in, out)); CriticalKV's norms
    need ``nn.Linear``'s (out, in). Before, GPT-2 was refused ("cannot find the output projection"),
    and the evaluation's replay found no attention modules in it."""
    model = _model("gpt2")
    module = next(m for m in model.modules() if type(m).__name__ == "GPT2Attention")
    assert [m.layer_idx for m in attention_modules(model)] == [0, 1]
    x = torch.randn(3, 64)
    expected = module.c_proj(x) - module.c_proj.bias
    torch.testing.assert_close(x @ output_projection(module).T, expected)


def _decodes_as(model: torch.nn.Module, ref: torch.nn.Module) -> list:
    """``model`` decodes as ``ref`` with the presets that read the output projection during the
    attention (CriticalKV's value norms: ``critical-adakv``, ``layer-defensivekv``); ``model``'s caches."""
    x, kw, caches = _ids(40, seed=3), {"max_new_tokens": 4, **GREEDY}, []
    for preset in ("critical-adakv", "layer-defensivekv"):
        out, cache = kvcake.generate(model, x, preset, budget=12, window=4, **kw)
        ref_out, _ = kvcake.generate(ref, x, preset, budget=12, window=4, **kw)
        assert_same_decoding(out, ref_out, preset)
        caches.append(cache)
    return caches


class _Int8Linear(torch.nn.Linear):
    """A weight-only int8 linear as quantization libraries store one (bitsandbytes' ``Linear8bitLt``,
    torchao, quanto): integer codes and a scale per output row, dequantized in its own forward."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        scale = linear.weight.detach().abs().amax(1, keepdim=True) / 127
        self.weight = torch.nn.Parameter(
            (linear.weight.detach() / scale).round().to(torch.int8), requires_grad=False
        )
        self.register_buffer("scale", scale)
        if linear.bias is not None:
            self.bias = linear.bias

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight.to(x.dtype) * self.scale, self.bias)

    def plain(self) -> torch.nn.Linear:
        return _linear(self.weight.float() * self.scale, self.bias)


class _LoRA(torch.nn.Module):
    """PEFT's LoRA layer in miniature: not an ``nn.Linear``; its base layer plus ``B A``."""

    def __init__(self, base: torch.nn.Linear, rank: int = 4):
        super().__init__()
        self.base_layer, self.in_features, self.out_features = base, base.in_features, base.out_features
        self.lora_a = torch.nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = torch.nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x):
        return self.base_layer(x) + self.lora_b(self.lora_a(x))

    def plain(self) -> torch.nn.Linear:
        return _linear(self.base_layer.weight + self.lora_b.weight @ self.lora_a.weight, self.base_layer.bias)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


@pytest.mark.parametrize("kind", [_Int8Linear, _LoRA], ids=["int8", "lora"])
def test_an_output_projection_that_is_not_a_plain_matrix(kind):
    """CriticalKV's value norms read the output projection's weight. A quantized one holds codes (read
    as they were, int8 codes gave norms off by each row's scale, silently: bitsandbytes' 8-bit models); a
    LoRA layer is no ``nn.Linear`` (refused: "cannot find the output projection"). The weight the
    module applies is read off the module: the model decodes as one whose projections are plain
    ``nn.Linear`` holding the dequantized (or merged) matrices."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _model("qwen2")
        for layer in model.model.layers:
            layer.self_attn.o_proj = kind(layer.self_attn.o_proj)
        plain = _model("qwen2")
        for layer, ours in zip(plain.model.layers, model.model.layers, strict=True):
            layer.self_attn.o_proj = ours.self_attn.o_proj.plain()
    for cache in _decodes_as(model, plain):
        assert int(cache.budgets.sum()) == 24
    module = model.model.layers[0].self_attn
    torch.testing.assert_close(output_projection(module), plain.model.layers[0].self_attn.o_proj.weight)


def test_weights_offloaded_by_accelerate(tmp_path):
    """A model loaded with ``device_map`` offloading a layer to disk (accelerate's hooks load its
    weights when each module runs): CriticalKV's value norms read the output projection during the
    attention, before ``o_proj`` runs, where its weight was still on the meta device ("Cannot copy
    out of meta tensor" for criticalkv, critical-adakv, defensivekv and layer-defensivekv). Its hook
    now loads it for them: the offloaded model decodes as the one in memory, and the weight goes back
    to disk."""
    model = _model("qwen2")
    model.save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        offloaded = tf.AutoModelForCausalLM.from_pretrained(
            tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "offload"
        ).eval()
    o_proj = offloaded.model.layers[1].self_attn.o_proj
    assert o_proj.weight.is_meta
    _decodes_as(offloaded, model)
    assert o_proj.weight.is_meta
    torch.testing.assert_close(
        projection_weight(offloaded.model.layers[1].self_attn), model.model.layers[1].self_attn.o_proj.weight
    )


def test_a_model_loaded_with_flex_attention():
    """``attn_implementation="flex_attention"``: its mask is a BlockMask, which kvcake read as a
    tensor (AttributeError: 'BlockMask' object has no attribute 'dim'). Inside ``kvcake.enable`` the
    model now runs SDPA (flex's CPU kernel with a tensor score mask crashed the process, torch 2.13),
    so the oracle is the same weights under SDPA; flex is back on exit."""
    name, kwargs = FAMILIES["qwen2"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        flex = tf.AutoModelForCausalLM.from_config(
            getattr(tf, name)(**kwargs), attn_implementation="flex_attention"
        )
    sdpa = tf.AutoModelForCausalLM.from_config(getattr(tf, name)(**kwargs), attn_implementation="sdpa")
    sdpa.load_state_dict(flex.state_dict())
    flex.eval()
    sdpa.eval()
    x = _ids(40, seed=4)
    kw = {"max_new_tokens": 4, **GREEDY}
    with torch.no_grad():
        stock = sdpa.generate(x, **kw)
    out, _ = kvcake.generate(flex, x, "cake-adakv", budget=64, window=4, **kw)
    assert_same_decoding(out, stock)
    for preset in ("layer-defensivekv", "h2o"):
        out, cache = kvcake.generate(flex, x, preset, budget=12, window=4, **kw)
        ref, _ = kvcake.generate(sdpa, x, preset, budget=12, window=4, **kw)
        assert torch.equal(out.sequences, ref.sequences) and int(cache.budgets.sum()) == 24, preset
    assert flex.config._attn_implementation == "flex_attention"
