"""CriticalKV's weight of each entry, ``|| v_n W_O^(h) ||_1`` averaged over each GQA group, and
cheap bounds of it (:class:`kvcake.selectors.critical.Critical` computes the exact norm only where
the bounds leave the selection open)."""

from __future__ import annotations

import importlib.util
import math

import torch

from ..devices import cpu_route
from ..matmul import half_matmuls, matmul_f32

# Positions per chunk when projecting values through o_proj: bounds the (B, H_kv, chunk, G * hidden)
# intermediate instead of materialising it for the whole prompt. On the CPU a smaller one stays in
# cache between the matmul's write and the absolute values' passes (128: 28 ms against 53 for
# SmolLM2's 4096 positions, one core; 64-128 the fastest of 64-1024).
_NORM_CHUNK = 1024
_NORM_CHUNK_CPU = 128
# CUDA inputs of a power-of-two head size take ``kvcake.fused_norms``' one Triton kernel where
# triton is installed (the products never written out); False keeps the matmuls (tests compare).
FUSED_NORMS = True
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def projected_value_norms(values: torch.Tensor, o_weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``|| v_n W_O^(h) ||_1`` averaged over each GQA group: (B, H_kv, S) float32.

    values: (B, H_kv, S, d); o_weight: (hidden, H * d), the output projection's weight, whose
    columns ``h*d:(h+1)*d`` are query head ``h``'s slice. A KV head's values times its group's
    slices side by side, one batched matmul per chunk of positions (see ``_NORM_CHUNK``). bf16/fp16
    values and weight on CUDA are multiplied as they are with float32 products
    (:mod:`kvcake.matmul`: the same norms up to summation order); elsewhere float32 copies are.
    Where :func:`fused_norms_apply` (CUDA, triton), one kernel instead (:mod:`kvcake.fused_norms`).
    """
    if fused_norms_apply(values, o_weight):
        from ..fused_norms import value_norms

        return value_norms(values, o_weight, num_heads)
    b, hkv, s, d = values.shape
    groups = num_heads // hkv
    hidden = o_weight.shape[0]
    w = o_weight.to(values.device)  # the values' device (one layer of a split model)
    half = half_matmuls(values) and w.dtype == values.dtype
    if not half:
        w = w.float()
    # (B * H_kv, d, G * hidden): column block g of KV head k is query head k * G + g's slice
    wg = w.reshape(hidden, hkv, groups, d).permute(1, 3, 2, 0).reshape(1, hkv, d, groups * hidden)
    wg = wg.expand(b, -1, -1, -1).reshape(b * hkv, d, groups * hidden)
    cpu = cpu_route(values.device) and not half  # (half: CUDA, or its emulation in the tests)
    chunk = _NORM_CHUNK_CPU if cpu else _NORM_CHUNK
    out = torch.empty(b, hkv, s, dtype=torch.float32, device=values.device)
    buf = torch.empty(b * hkv * min(s, chunk) * groups * hidden, dtype=torch.float32, device=w.device)
    for start in range(0, s, chunk):
        v = values[:, :, start : start + chunk]  # (B, H_kv, c, d)
        c = v.shape[2]
        into = buf[: b * hkv * c * groups * hidden].view(b * hkv, c, groups * hidden)
        if half:
            proj = matmul_f32(v.reshape(b * hkv, c, d), wg, into)
        else:
            proj = torch.bmm(v.float().reshape(b * hkv, c, d), wg, out=into)
        proj = proj.view(b, hkv, c, groups, hidden)
        if cpu:  # two passes over a cached chunk beat vector_norm's one there
            l1 = proj.abs_().sum(-1)
        else:
            l1 = torch.linalg.vector_norm(proj, ord=1, dim=-1)  # abs and sum in one pass
        out[:, :, start : start + c] = l1.mean(-1)
    return out


def fused_norms_apply(values: torch.Tensor, o_weight: torch.Tensor) -> bool:
    """Whether :func:`projected_value_norms` runs ``kvcake.fused_norms``' kernel for these inputs."""
    d = values.shape[-1]
    return (
        FUSED_NORMS and _HAS_TRITON and values.is_cuda and o_weight.dtype == values.dtype
        and values.dtype in (torch.bfloat16, torch.float16, torch.float32) and d >= 16 and d & (d - 1) == 0
    )  # fmt: skip


def projected_value_norm_bounds(
    values: torch.Tensor, o_weight: torch.Tensor, num_heads: int, sign_values: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower and upper bounds of :func:`projected_value_norms`, each (B, H_kv, S) float32.

    ``||x||_2 <= ||x||_1 <= sqrt(hidden) ||x||_2`` for ``x = v W_O^(h)`` (hidden entries), and the
    L2 norm is exact through the ``d x d`` Gram matrix ``W_O^(h) W_O^(h)T``: ``d^2`` multiply-adds per
    position and head instead of ``d * hidden`` (a ``hidden / d`` saving: 9x on SmolLM2, 32x on
    Llama-3.1-8B).

    The L2 lower bound is ~``0.8 sqrt(hidden)`` x below the L1 norm of a spread-out ``x``.
    ``sign_values`` (B, H_kv, K, d), values like the bounded ones (e.g. a head's highest-scoring),
    tighten it: ``||x||_1 >= |x . s|`` for every sign vector ``s``, here the signs of their
    projections, and ``x . s = v (W_O^(h) s)`` costs ``d`` multiply-adds per position and ``s``;
    on SmolLM2 the bound is then within ~2x of the norm. The float error of that dot, at most
    ``1e-5 ||v|| ||W_O^(h) s||`` (``W_O^(h) s`` summed in float64), is taken off."""
    b, hkv, s, d = values.shape
    groups = num_heads // hkv
    hidden = o_weight.shape[0]
    w = o_weight.to(values.device).float().reshape(hidden, num_heads, d).permute(1, 2, 0)  # (H, d, hidden)
    gram = (w @ w.transpose(1, 2)).reshape(hkv, groups, d, d)  # (H_kv, G, d, d)
    if sign_values is not None:
        w = w.reshape(hkv, groups, d, hidden)
        signs = torch.einsum("bkjd,kgdo->bkgjo", sign_values.float(), w).sign()  # (B, H_kv, G, K, hidden)
        u = torch.einsum("kgdo,bkgjo->bkgdj", w.double(), signs.double())  # (B, H_kv, G, d, K)
        u_norm = u.norm(dim=3).amax(-1)[:, :, :, None].float()  # (B, H_kv, G, 1): the largest ||W s||
        u = u.float()
    low = torch.empty(b, hkv, s, dtype=torch.float32, device=values.device)
    high = torch.empty(b, hkv, s, dtype=torch.float32, device=values.device)
    for start in range(0, s, _NORM_CHUNK):
        v = values[:, :, start : start + _NORM_CHUNK].float()  # (B, H_kv, c, d)
        vg = torch.einsum("bkcd,kgde->bkgce", v, gram)  # (B, H_kv, G, c, d)
        l2 = (vg * v[:, :, None]).sum(-1).clamp(min=0).sqrt()  # (B, H_kv, G, c)
        high[:, :, start : start + v.shape[2]] = l2.mean(2) * math.sqrt(hidden)
        if sign_values is not None:
            dots = torch.einsum("bkcd,bkgdj->bkgcj", v, u).abs().amax(-1)  # (B, H_kv, G, c)
            l2 = torch.maximum(l2, dots - 1e-5 * v.norm(dim=-1)[:, :, None] * u_norm)
        low[:, :, start : start + v.shape[2]] = l2.mean(2)
    return low, high
