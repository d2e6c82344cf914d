"""Named model shapes for random-weight benchmarks: a model's speed and memory without its weights.

A random Llama of a published shape runs every kernel the real one runs (same layers, heads,
widths, GQA groups); its outputs mean nothing, so it measures time and memory only. Nothing is
downloaded. ``tiny`` is the CPU smoke-test shape.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

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
    # the CPU smoke test: every code path, in milliseconds
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),  # fmt: skip
}


def shape_config(shape: str, max_positions: int, attn_implementation: str = "sdpa") -> LlamaConfig:
    """The ``LlamaConfig`` of ``shape`` with ``max_positions`` positions."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: use one of {', '.join(SHAPES)}")
    if max_positions < 1:
        raise ValueError(f"max_positions must be positive, got {max_positions}")
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=max_positions)
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
