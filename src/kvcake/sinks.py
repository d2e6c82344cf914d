"""Attention sinks (GPT-OSS): a learned logit per query head in every row's softmax.

The model's attention (transformers' ``eager_attention_forward`` of ``gpt_oss``, called with
``s_aux=module.sinks``) takes the softmax over a row's logits and one more, the head's sink,
and drops the sink's probability: each row's weights sum to less than 1 and the sink has no
value. kvcake's own attention over the kept entries does the same wherever a model hands it
sinks (the fused kernels have no such term, so those rows take the explicit softmax), and the
scorers read the probabilities the model gives its tokens, sink included in the denominator.
"""

from __future__ import annotations

import torch


def sink_softmax(logits: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of ``logits`` and each row's sink logit (``sinks``, broadcast to
    ``logits``' rows with a last dim of 1), the sink's column dropped. A row whose logits are all
    -inf gives zeros (the sink takes it whole), not NaN."""
    sink = sinks.to(logits.dtype).expand(*logits.shape[:-1], 1)
    return torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]


def grouped_rows(sinks: torch.Tensor, batch: int, kv_heads: int, q: int) -> torch.Tensor:
    """The sinks of query heads (H,) for a GQA group folded into the query rows: (B, H_kv, G*q, 1),
    rows ordered (g, i) as ``dense_attention`` folds them."""
    g = sinks.shape[0] // kv_heads
    return sinks.reshape(1, kv_heads, g, 1).expand(batch, kv_heads, g, q).reshape(batch, kv_heads, g * q, 1)


def model_sinks(module: torch.nn.Module) -> torch.Tensor | None:
    """The attention module's sink logits (H,) where it has them (``sinks``, GPT-OSS), else None."""
    sinks = getattr(module, "sinks", None)
    return sinks if isinstance(sinks, torch.Tensor) else None
