"""Attention over a dense layer: every KV head of a sequence holds the same number of entries,
empty slots (position -1) on the left, each entry with its logical position (``layer.py``).

The dynamic layout's path and the reference of the static decode step (``step/dense.py``); the
ragged layout's counterpart is ``ragged.py``.
"""

from __future__ import annotations

import torch

from .sinks import grouped_rows, sink_softmax


def dense_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    query_positions: torch.Tensor,
    scaling: float,
    return_probs: bool = False,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention over a dense layer with per-head empty slots and logical positions.

    query: (B, H, q, d); keys/values: (B, H_kv, N, d); positions: (B, H_kv, N) (-1 = empty);
    query_positions: (B, q). The GQA group is folded into the query rows, so keys are never
    repeated. Returns (B, q, H, d) and optionally the probabilities (B, H, q, N) in float32.
    sinks: (H,) each query head's sink logit (``kvcake.sinks``), or None; with them the softmax is
    the explicit one (the fused kernel has no sink term).
    """
    b, h, q, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    g = h // hkv
    qs = query.reshape(b, hkv, g * q, d)  # rows ordered (g, i)
    allowed = (positions[:, :, None, :] >= 0) & (
        positions[:, :, None, :] <= query_positions[:, None, :, None]
    )
    allowed = allowed | ~allowed.any(-1, keepdim=True)  # a row with nothing visible (padding) stays finite
    allowed = allowed[:, :, None].expand(b, hkv, g, q, n).reshape(b, hkv, g * q, n)
    if return_probs or sinks is not None:
        acc = torch.promote_types(query.dtype, torch.float32)
        logits = torch.matmul(qs.to(acc), keys.to(acc).transpose(-1, -2)) * scaling
        logits = logits.masked_fill(~allowed, float("-inf"))
        if sinks is None:
            probs = torch.softmax(logits, dim=-1)  # (B, H_kv, G*q, N)
        else:
            probs = sink_softmax(logits, grouped_rows(sinks, b, hkv, q))
        out = torch.matmul(probs, values.to(acc)).to(query.dtype)
        probs = probs.reshape(b, h, q, n) if return_probs else None
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            qs, keys, values, attn_mask=allowed, scale=scaling
        )
        probs = None
    return out.reshape(b, h, q, d).transpose(1, 2), probs
