"""Attention over a dense layer: every KV head of a sequence holds the same number of entries,
empty slots (position -1) on the left, each entry with its logical position (``layer.py``).

The dynamic layout's path and the reference of the static decode step (``step/dense.py``); the
ragged layout's counterpart is ``ragged.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .logit_terms import PLAIN, LogitTerms


def dense_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    query_positions: torch.Tensor,
    scaling: float,
    return_probs: bool = False,
    terms: LogitTerms = PLAIN,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention over a dense layer with per-head empty slots and logical positions.

    query: (B, H, q, d); keys/values: (B, H_kv, N, d); positions: (B, H_kv, N) (-1 = empty);
    query_positions: (B, q). The GQA group is folded into the query rows, so keys are never
    repeated. Returns (B, q, H, d) and optionally the probabilities (B, H, q, N) in float32.
    terms: the model's soft cap and sinks (``kvcake.logit_terms``); with either the softmax is the
    explicit one (the fused kernel has neither).
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
    out, probs = folded_attention(qs, keys, values, allowed, scaling, q, return_probs, terms)
    out = out.reshape(b, h, q, values.shape[-1]).transpose(1, 2)  # (B, q, H, d_v)
    return out, None if probs is None else probs.reshape(b, h, q, n)


def folded_attention(
    qs: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    scaling: float,
    q: int,
    return_probs: bool = False,
    terms: LogitTerms = PLAIN,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention with the GQA group folded into the query rows: qs (B, H_kv, G*q, d), rows ordered
    (g, i); keys/values (B, H_kv, N, d); allowed: bool, broadcastable to (B, H_kv, G*q, N).

    Returns the output (B, H_kv, G*q, d) in the query's dtype and, if asked, the probabilities
    (B, H_kv, G*q, N) in float32. SDPA computes it, unless probabilities are asked for or the model
    caps its logits or has sinks (``terms``): then the explicit softmax (the fused kernel has neither)."""
    if not return_probs and terms.fused:
        return F.scaled_dot_product_attention(qs, keys, values, attn_mask=allowed, scale=scaling), None
    b, hkv = keys.shape[:2]
    acc = torch.promote_types(qs.dtype, torch.float32)
    logits = terms.cap(torch.matmul(qs.to(acc), keys.to(acc).transpose(-1, -2)) * scaling)
    logits = logits.masked_fill(~allowed, float("-inf"))
    probs = terms.softmax(logits, terms.grouped(b, hkv, q))  # (B, H_kv, G*q, N)
    out = torch.matmul(probs, values.to(acc)).to(qs.dtype)
    return out, probs if return_probs else None
