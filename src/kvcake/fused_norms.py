"""CriticalKV's projected value norms on CUDA in one Triton kernel.

``|| v_n W_O^(h) ||_1`` averaged over each GQA group (``selectors.value_norms.projected_value_norms``,
the reference) multiplies every position's value by its query heads' slices of the output
projection: at 32k tokens of a Llama-3.1-8B layer that is 32 x 32768 x 4096 products. The
reference writes them in float32 chunk by chunk and reads them back for the absolute sums; on an
H100 that traffic, not the arithmetic, was 0.41 s of DefensiveKV's prefill (219 ms of ``baddbmm``
and 193 ms of ``linalg_vector_norm`` over 32 layers, docs/benchmarks-gpu.md). Here each program
takes a tile of positions of one KV head, multiplies it by its group's slices tile by tile
(float32 accumulation, as the reference's ``matmul_f32``) and adds the absolute products up as it
goes: the products never leave the chip, and each position's sum is one program's, in a fixed
order (deterministic, as the cascade's bit-equality needs). The same norms up to summation order.

Used where ``selectors.value_norms.fused_norms_apply`` says so (CUDA, triton installed, a
power-of-two head size of at least 16, values and weight of one dtype: bf16, fp16 or fp32),
which alone imports this module: triton is optional (torch's CUDA builds ship it).
``FUSED_NORMS = False`` there turns it off (the tests compare the two routes). Triton's interpreter runs the kernel on
CPU tensors where ``TRITON_INTERPRET=1`` is set before this module is imported (the CPU test,
where triton is installed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_POSITIONS = 64  # positions per program
BLOCK_HIDDEN = 128  # output-projection columns per step of a program


def value_norms(values: torch.Tensor, o_weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, H_kv, S) float32, as ``projected_value_norms(values, o_weight, num_heads)``.

    values: (B, H_kv, S, d), any strides; o_weight: (hidden, H * d) of the values' dtype."""
    b, hkv, s, d = values.shape
    hidden = o_weight.shape[0]
    # (H, d, hidden): query head h's slice transposed, each row contiguous for the tile loads
    w = o_weight.to(values.device).reshape(hidden, num_heads, d).permute(1, 2, 0).contiguous()
    out = torch.empty(b, hkv, s, dtype=torch.float32, device=values.device)
    if not out.numel():
        return out
    grid = (triton.cdiv(s, BLOCK_POSITIONS), b * hkv)
    _l1_norms[grid](
        values, w, out, s, hidden, *values.stride(), *out.stride(),
        HKV=hkv, G=num_heads // hkv, D=d, BM=BLOCK_POSITIONS, BN=BLOCK_HIDDEN,
        IEEE=values.dtype == torch.float32,
    )  # fmt: skip
    return out


# the positions and the strides that follow them change from call to call (CriticalKV packs its
# candidates): not specialised on, so one compiled kernel per model shape and dtype serves them
@triton.jit(do_not_specialize=["S", "sv_b", "sv_k", "so_b", "so_k"])
def _l1_norms(
    v_ptr, w_ptr, out_ptr, S, HIDDEN, sv_b, sv_k, sv_s, sv_d, so_b, so_k, so_s,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    bk = tl.program_id(1)
    b = bk // HKV
    k = bk % HKV
    rows = pid * BM + tl.arange(0, BM)
    dims = tl.arange(0, D)
    x = tl.load(
        v_ptr + b * sv_b + k * sv_k + rows[:, None] * sv_s + dims[None, :] * sv_d,
        mask=rows[:, None] < S, other=0.0,
    )  # fmt: skip
    total = tl.zeros((BM,), dtype=tl.float32)
    for g in range(G):
        head = w_ptr + (k * G + g) * D * HIDDEN
        for n0 in range(0, HIDDEN, BN):
            cols = n0 + tl.arange(0, BN)
            w = tl.load(head + dims[:, None] * HIDDEN + cols[None, :], mask=cols[None, :] < HIDDEN, other=0.0)
            if IEEE:  # float32 inputs multiplied in float32, not TF32
                acc = tl.dot(x, w, input_precision="ieee")
            else:
                acc = tl.dot(x, w)  # half inputs: float32 products and sums
            total += tl.sum(tl.abs(acc), axis=1)
    tl.store(out_ptr + b * so_b + k * so_k + rows * so_s, total / G, mask=rows < S)
