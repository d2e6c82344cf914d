"""Matmuls of bf16/fp16 inputs with float32 results on CUDA (tensor cores), for the prompt-time
scoring that needs float32 products: H2O's prompt attention (``kvcake.scorers.h2o``) and
CriticalKV's projected value norms (``kvcake.selectors.value_norms``).

A product of two bf16 (or fp16) numbers is exact in float32, and these matmuls accumulate in
float32, so their results are the float32 matmul's of the upcast inputs up to summation order, at
tensor-core speed instead of float32 copies through the float32 units (many times slower on an
H100/H200). Where they are missing (the CPU, another dtype, a torch without ``out_dtype``
matmuls, or a build whose kernel fails the one-time probe) the callers keep their float32 route.
"""

from __future__ import annotations

import torch

HALF = (torch.bfloat16, torch.float16)
_half_matmuls_work: dict[tuple[str, torch.dtype], bool] = {}


def half_matmuls(x: torch.Tensor) -> bool:
    """Whether :func:`matmul_f32` runs for inputs like ``x``: on CUDA, bf16/fp16, where torch has
    the matmuls with an ``out_dtype`` and they run (probed once per device and dtype)."""
    if x.device.type != "cuda" or x.dtype not in HALF:
        return False
    key = (str(x.device), x.dtype)
    if key not in _half_matmuls_work:
        _half_matmuls_work[key] = _probe_half_matmuls(x.device, x.dtype)
    return _half_matmuls_work[key]


def _probe_half_matmuls(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch.ops.aten.baddbmm, "dtype_out"):  # the overload matmul_f32 calls
        return False
    a = torch.randn(2, 8, 16, device=device).to(dtype)
    b = torch.randn(2, 16, 8, device=device).to(dtype)
    try:
        got = matmul_f32(a, b, torch.empty(2, 8, 8, device=device), 0.5)
    except (RuntimeError, NotImplementedError):  # an op this build has not for this device/dtype
        return False
    return bool(torch.allclose(got, 0.5 * (a.float() @ b.float()), rtol=1e-5, atol=1e-5))


def matmul_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``out`` (float32) = ``alpha * a @ b`` for half-precision batched ``a`` (N, m, k), ``b`` (N, k, n),
    accumulated and written in float32 (``alpha`` applied to the float32 products)."""
    return torch.ops.aten.baddbmm.dtype_out(out, a, b, torch.float32, beta=0, alpha=alpha, out=out)
