"""``kvcake.fused_norms``' Triton kernel under triton's interpreter, on CPU tensors, against the
reference matmul route: runs where triton is installed (a CUDA build of torch ships it; CPU CI
skips it, and tests/cuda/test_cuda_fused_norms.py runs the compiled kernel on a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvcake.selectors.value_norms import fused_norms_apply

# In a process of its own: TRITON_INTERPRET is read when triton (and its library of jitted
# functions) is first imported. Shapes (B, H, H_kv, S, d, hidden): GQA groups of 4 with tiles cut
# by S and hidden, and d = 16 without groups; values strided; float32 and float16 (numpy, which the
# interpreter computes with, has no bfloat16).
SCRIPT = """
import torch
from kvcake.fused_norms import value_norms
from kvcake.selectors.value_norms import projected_value_norms

gen = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.float16):
    for b, h, hkv, s, d, hidden in [(2, 8, 2, 130, 32, 200), (1, 4, 4, 70, 16, 96)]:
        values = torch.randn(b, hkv, s + 3, d, generator=gen).to(dtype)[:, :, 3:]
        o_weight = (torch.randn(hidden, h * d, generator=gen) / d**0.5).to(dtype)
        got = value_norms(values, o_weight, h)
        ref = projected_value_norms(values.float(), o_weight.float(), h)  # CPU: the matmul route
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        print("equal", dtype, (b, h, hkv, s, d, hidden))
"""


def test_interpreted_kernel_equals_the_matmul_route():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.abspath("src"), *sys.path] if p)
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    if run.returncode and "only 0-dimensional arrays can be converted to Python scalars" in run.stderr:
        import numpy
        import triton

        pytest.skip(
            f"triton {triton.__version__}'s interpreter reads a scalar argument as int() of a one-element "
            f"array, which numpy {numpy.__version__} refuses (seen with triton 3.2-3.3 and numpy 2.4; numpy "
            "2.3 passes): an interpreter bug, not the kernel's"
        )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("equal") == 4, run.stdout


def test_cpu_tensors_keep_the_matmuls():
    assert not fused_norms_apply(torch.zeros(1, 2, 3, 64), torch.zeros(8, 256))
