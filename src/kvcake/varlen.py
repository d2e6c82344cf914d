"""Variable-length attention kernels for ragged caches, behind one function and one route choice.

Layout (the ragged layer's): ``S = B * H_kv`` segments, one per (sequence, KV head), packed
segment-major into keys/values ``(T, d)``; ``cu_seqlens`` (S + 1,) int are the cumulative segment
lengths. The ``q`` newest entries of every segment are the query rows' own tokens, so causal
masking is aligned bottom-right: row ``i`` of ``q`` sees a segment's first ``len - q + i + 1``
entries. The ``G`` query heads of a GQA group read their KV head's segment.

Routes, chosen by device, dtype and what is installed (detected once per process):

- ``"torch-varlen"``: ``torch.nn.attention.varlen.varlen_attn`` (flash-attention inside torch),
  on CUDA in fp16/bf16 where this torch has it;
- ``"flash-attn"``: the ``flash_attn`` package's ``flash_attn_varlen_func``, when installed;
- ``"reference"``: :func:`varlen_reference`, obviously right (padded, masked, float32), the
  oracle of the kernels' tests. The ragged cache's CPU path is its own segment softmax
  (``kvcake.ragged.ragged_attention_reference``), which also returns probabilities.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch

logger = logging.getLogger(__name__)

ROUTES = ("torch-varlen", "flash-attn", "reference")
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
    except ImportError:
        return None
    return flash_attn_varlen_func


@functools.cache
def _keywords(kernel) -> frozenset[str]:
    """The parameter names of a kernel function, read once per function (a ragged layer calls the
    kernel at every decode step)."""
    return frozenset(inspect.signature(kernel).parameters)


@torch.compiler.assume_constant_result  # a compiled step bakes the answer in, never traces the lookup
def _torch_varlen_takes(name: str) -> bool:
    """Whether this torch's ``varlen_attn`` takes the keyword ``name``: torch 2.11's takes neither
    ``enable_gqa`` nor ``seqused_k`` (its flash kernel does GQA without being asked), later ones
    take both and refuse differing head counts without ``enable_gqa=True``."""
    kernel = _torch_varlen()
    return kernel is not None and name in _keywords(kernel)


def _torch_varlen_seqused() -> bool:
    """Whether this torch's ``varlen_attn`` takes ``seqused_k`` (not every release with the kernel does)."""
    return _torch_varlen_takes("seqused_k")


def choose_route(device: torch.device, dtype: torch.dtype, *, seqused: bool = False) -> str:
    """The kernel that serves a ragged attention call on ``device`` in ``dtype``.

    ``seqused``: segments hold unused slots after their last entry (static storage), which only
    torch's kernel can skip (``seqused_k``, where this torch's ``varlen_attn`` takes it)."""
    if device.type != "cuda" or dtype not in KERNEL_DTYPES:
        return "reference"
    if _torch_varlen() is not None and (not seqused or _torch_varlen_seqused()):
        return "torch-varlen"
    if _flash_varlen() is not None and not seqused:
        return "flash-attn"
    return "reference"


def describe_route(device: torch.device, dtype: torch.dtype) -> str:
    """The route and, for the reference, why (benchmark pages)."""
    route = choose_route(device, dtype)
    if route != "reference":
        return route
    why = ("no CUDA" if device.type != "cuda" else f"{dtype} (kernels take fp16/bf16)" if dtype not in KERNEL_DTYPES
           else "neither torch varlen_attn nor flash_attn")  # fmt: skip
    return f"PyTorch reference ({why})"


def varlen_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
    scaling: float, *, seqused: torch.Tensor | None = None, route: str | None = None,
) -> torch.Tensor:  # fmt: skip
    """Attention of ``q`` query rows per segment over that segment's entries.

    query: (B, H, q, d); keys, values: (T, d); cu_seqlens: (S + 1,) int, ``S = B * H_kv``;
    max_len: longest segment (host int); seqused: (S,) entries in use at the start of each
    segment (the rest of it is ignored), or None. Returns (B, q, H, d) in the query's dtype.
    ``route`` None: :func:`choose_route`.
    """
    route = route or choose_route(query.device, query.dtype, seqused=seqused is not None)
    if route not in ROUTES:
        raise ValueError(f"unknown varlen route {route!r}: use one of {', '.join(ROUTES)}")
    b, h, q, d = query.shape
    n_seg = cu_seqlens.numel() - 1
    if n_seg % b or h % (n_seg // b):
        raise ValueError(f"{n_seg} segments do not split into batch {b} x KV heads dividing {h} query heads")
    if route == "reference":
        return varlen_reference(query, keys, values, cu_seqlens, scaling, seqused=seqused).to(query.dtype)
    g = h // (n_seg // b)
    qs = query.reshape(b, n_seg // b, g, q, d).permute(0, 1, 3, 2, 4).reshape(n_seg * q, g, d)  # (S*q, G, d)
    cu_q = torch.arange(0, (n_seg + 1) * q, q, dtype=torch.int32, device=query.device)
    cu_k = cu_seqlens.to(device=query.device, dtype=torch.int32)
    if route == "torch-varlen":
        extra = {}  # only the keywords this release takes (torch 2.11's takes neither)
        if _torch_varlen_takes("enable_gqa"):
            extra["enable_gqa"] = True
        if seqused is not None:
            if not _torch_varlen_seqused():
                raise ValueError(
                    f"this torch's ({torch.__version__}) varlen_attn cannot skip unused slots (no seqused_k): "
                    "use the reference route (varlen.choose_route(..., seqused=True) picks it)"
                )
            extra["seqused_k"] = seqused.to(device=query.device, dtype=torch.int32)
        out = _torch_varlen()(
            qs, keys[:, None, :], values[:, None, :], cu_q, cu_k, q, max_len, scale=scaling,
            window_size=(-1, 0) if q > 1 else (-1, -1), **extra,
        )  # fmt: skip
    else:
        if seqused is not None:
            raise ValueError(
                "flash-attn's varlen kernel cannot skip unused slots (seqused): use torch-varlen"
            )
        out = _flash_varlen()(
            qs, keys[:, None, :], values[:, None, :], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=q,
            max_seqlen_k=max_len, softmax_scale=scaling, causal=q > 1,
        )  # fmt: skip
    # (S*q, G, d) -> (B, q, H, d)
    return out.reshape(b, n_seg // b, q, g, d).permute(0, 2, 1, 3, 4).reshape(b, q, h, d)


def varlen_reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_seqlens: torch.Tensor, scaling: float,
    *, seqused: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The oracle: segments padded to the longest, a boolean mask, softmax in float32 (float64 in,
    float64 out). Same arguments and result as :func:`varlen_attention` (in the accumulation dtype)."""
    b, h, q, d = query.shape
    n_seg = cu_seqlens.numel() - 1
    g = h // (n_seg // b)
    acc = torch.promote_types(query.dtype, torch.float32)
    cu = cu_seqlens.to(device=keys.device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]  # (S,)
    used = lengths if seqused is None else seqused.to(device=keys.device, dtype=torch.long)
    n = int(lengths.max()) if n_seg else 0  # host: the reference is not on a hot path
    local = torch.arange(n, device=keys.device)  # (N,)
    slot = (cu[:-1, None] + local[None, :]).clamp(max=max(keys.shape[0] - 1, 0))  # (S, N)
    k, v = keys.to(acc)[slot], values.to(acc)[slot]  # (S, N, d)
    rows = torch.arange(q, device=keys.device)  # (q,)
    visible = local[None, None, :] < (used[:, None, None] - q + rows[None, :, None] + 1)  # (S, q, N)
    visible = visible & (local[None, None, :] < used[:, None, None])
    qs = query.to(acc).reshape(b, n_seg // b, g, q, d).reshape(n_seg, g, q, d)  # (S, G, q, d)
    logits = torch.einsum("sgqd,snd->sgqn", qs, k) * scaling
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row that sees nothing outputs 0
    out = torch.einsum("sgqn,snd->sgqd", probs, v)  # (S, G, q, d)
    return out.reshape(b, n_seg // b * g, q, d).transpose(1, 2)  # (B, q, H, d)
