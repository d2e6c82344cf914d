"""Named model shapes for random-weight benchmarks: a model's speed and memory without its weights.

A random model of a published shape runs every kernel the real one runs (same layers, heads,
widths, GQA groups; a Llama unless the shape names its config class, as the latent-attention
shapes do); its outputs mean nothing, so it measures time and memory only. Nothing is downloaded.
``tiny`` and ``tiny-mla`` are the CPU smoke-test shapes.
"""

from __future__ import annotations

import logging

import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig

logger = logging.getLogger(__name__)

SHAPES: dict[str, dict] = {
    # meta-llama/Llama-3.1-8B's config.json (widths, layers, heads, vocabulary)
    "llama-3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),  # fmt: skip
    # meta-llama/Llama-3.2-1B's
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),  # fmt: skip
    # HuggingFaceTB/SmolLM2-135M-Instruct's, kvcake's default model (a CPU-sized run of every row)
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),  # fmt: skip
    # deepseek-ai/DeepSeek-V2-Lite's config.json (15.7B parameters, 2.4B active: latent attention, MoE),
    # without its YaRN RoPE scaling (positions up to the run's length; the same kernels)
    "deepseek-v2-lite": dict(
        config="DeepseekV2Config",
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        vocab_size=102400,
    ),  # fmt: skip
    # the CPU smoke tests: every code path, in milliseconds (``tiny-mla``: latent attention, kvcake.latent)
    "tiny-mla": dict(
        config="DeepseekV3Config",
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        vocab_size=512,
    ),  # fmt: skip
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),  # fmt: skip
}


def shape_config(shape: str, max_positions: int, attn_implementation: str = "sdpa") -> PretrainedConfig:
    """The config of ``shape`` (a ``LlamaConfig`` unless it names its class) with ``max_positions`` positions."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: use one of {', '.join(SHAPES)}")
    if max_positions < 1:
        raise ValueError(f"max_positions must be positive, got {max_positions}")
    fields = dict(SHAPES[shape])
    name = fields.pop("config", "LlamaConfig")
    config_class = getattr(transformers, name, None)
    if config_class is None:
        raise ValueError(
            f"shape {shape!r} needs transformers' {name}, which {transformers.__version__} lacks"
        )
    config = config_class(**fields, max_position_embeddings=max_positions)
    config._attn_implementation = attn_implementation
    return config


def random_model(
    shape: str,
    max_positions: int,
    *,
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    """A random-weight model of ``shape`` (seed 0), built directly on ``device`` in ``dtype``."""
    config = shape_config(shape, max_positions, attn_implementation)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    logger.info("built a random %s (%s) with %d positions on %s", shape, dtype, max_positions, device)
    return model.eval()
