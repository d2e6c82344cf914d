"""Per-architecture facts, in one place: which models the integration supports, where the
output projection is, and which CAKE temperatures fit the family.

Supported: decoder-only models whose attention modules call transformers' attention interface
after RoPE and after ``past_key_values.update`` with full (non-sliding) causal attention over
plain per-head keys and values: Llama, Mistral (without sliding window), Qwen2/Qwen3, Phi-3,
Gemma (1), Granite, OLMo and similar.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Families whose attention layout we know; others pass the structural checks or are refused.
KNOWN_FAMILIES = {
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "granite", "olmo", "olmo2", "stablelm",
    "starcoder2", "cohere", "internlm2", "smollm3",
}  # fmt: skip
_OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "c_proj", "wo")


@dataclass(frozen=True)
class ModelInfo:
    """Shapes the cache needs: ``L`` layers, ``H`` query heads, ``H_kv`` KV heads, head dim."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def describe_model(model: torch.nn.Module) -> ModelInfo:
    """Check that kvcake can compress this model and return its shapes.

    Raises ``ValueError`` up front for what would otherwise give wrong answers: sliding-window or
    chunked layers (their cache already drops entries), encoder-decoders (cross-attention),
    latent attention (MLA: no per-head keys to evict), linear-attention hybrids.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    mtype = getattr(text, "model_type", "unknown")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{mtype}: encoder-decoder models (cross-attention) are not supported by kvcake")
    for attr in ("kv_lora_rank", "q_lora_rank"):
        if getattr(text, attr, None):
            raise ValueError(f"{mtype}: latent attention (MLA) is not supported by kvcake: it has no per-head keys")
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        kinds = sorted({t for t in layer_types if t != "full_attention"})
        raise ValueError(
            f"{mtype}: layers of type {kinds} are not supported by kvcake (only full causal attention); "
            "a sliding-window layer already evicts by position and would be compressed twice"
        )
    sliding = getattr(text, "sliding_window", None)
    use_sliding = getattr(text, "use_sliding_window", True)
    if sliding is not None and use_sliding and sliding < getattr(text, "max_position_embeddings", 1 << 30):
        raise ValueError(
            f"{mtype}: sliding-window attention (window {sliding}) is not supported by kvcake; "
            "set config.sliding_window=None if the model was trained without it"
        )
    num_heads = getattr(text, "num_attention_heads", None)
    if num_heads is None:
        raise ValueError(f"{mtype}: cannot find num_attention_heads in the config")
    num_kv = getattr(text, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    return ModelInfo(mtype, text.num_hidden_layers, num_heads, num_kv, head_dim)


def output_projection(module: torch.nn.Module) -> torch.Tensor:
    """The attention output projection's weight (hidden, H * d), for CriticalKV's value norms."""
    for name in _OUTPUT_PROJECTIONS:
        proj = getattr(module, name, None)
        if isinstance(proj, torch.nn.Linear):
            return proj.weight
    raise ValueError(
        f"cannot find the output projection of {type(module).__name__} (looked for {_OUTPUT_PROJECTIONS}); "
        "CriticalKV selection needs it"
    )
