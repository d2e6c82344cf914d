"""The tiny random hybrid Gemma 3 used by the hybrid-model tests (a plain module, not
``conftest``: test files import from it by name, and ``tests/cuda`` has a conftest of its own,
so ``from conftest import ...`` would depend on collection order)."""

from __future__ import annotations

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

# Tiny hybrid: layers 0, 1, 3, 4 slide (window 12), layers 2 and 5 are global (compressed).
TINY_GEMMA3_LAYER_TYPES = ("sliding_attention", "sliding_attention", "full_attention") * 2
TINY_GEMMA3_WINDOW = 12


def _tiny_gemma3(attn_implementation: str = "sdpa") -> Gemma3ForCausalLM:
    """A 6-layer random Gemma 3 text model: 4 sliding layers (window 12) and 2 global ones,
    4 query heads, 2 KV heads, head_dim 16, q/k norms and ``query_pre_attn_scalar`` scaling,
    float32, eval mode, seed 0."""
    config = Gemma3TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,  # scaling 24**-0.5, not head_dim**-0.5
        sliding_window=TINY_GEMMA3_WINDOW,
        layer_types=list(TINY_GEMMA3_LAYER_TYPES),
        max_position_embeddings=4096,
        attn_implementation=attn_implementation,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Gemma3ForCausalLM(config)
    return model.to(torch.float32).eval()
