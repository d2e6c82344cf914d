"""Can H2O's prompt column sums come from FlexAttention at the cost of about one attention pass?

    PYTHONPATH=src python3 scripts/h2o_flex_probe.py --length 32k       # on a GPU (issue 23)
    PYTHONPATH=src python3 scripts/h2o_flex_probe.py --device cpu --length 512 --heads 4,2

One layer of a model's shape (Llama-3.1-8B: 32 query / 8 KV heads, head dim 128), causal, bf16 on
CUDA. Times, each the median of 3 after a warm-up: the full cache's attention (SDPA, GQA), kvcake's
``attention_with_column_sums`` (the shipped route), and a two-pass route: (1) the output and each
query row's log-sum-exp from ``flex_attention(return_lse=True)``, (2) the column sums as the
log-sum-exp of a transposed flex call (the keys as queries, the queries as keys, the first pass's
log-sum-exp subtracted in ``score_mod``: the softmax normaliser of key j is then exactly
sum_i exp(s q_i.k_j - lse_i), its attention column sum). Checks both against the shipped route.
A probe for a GPU session, not a library path.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from kvcake.scorers.h2o import attention_with_column_sums
from kvcake.standalone import comma_ints


def timed(fn, device, reps=3):
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", default="32k")
    p.add_argument("--heads", default="32,8")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    (s,) = comma_ints(a.length)
    h, hkv = (int(x) for x in a.heads.split(","))
    g, d = h // hkv, a.dim
    scaling = d**-0.5
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, h, s, d, device=device, dtype=dtype, generator=gen)
    k = torch.randn(1, hkv, s, d, device=device, dtype=dtype, generator=gen)
    v = torch.randn(1, hkv, s, d, device=device, dtype=dtype, generator=gen)
    valid = torch.ones(1, s, dtype=torch.bool, device=device)
    print(
        f"device {device} {torch.cuda.get_device_name(0) if device.type == 'cuda' else ''} torch {torch.__version__}"
    )
    print(f"S={s} H={h} H_kv={hkv} d={d} {dtype}", flush=True)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)

    t_sdpa = timed(sdpa, device)
    print(f"full cache's attention (SDPA, GQA): {t_sdpa * 1e3:.1f} ms", flush=True)
    t_ship = timed(lambda: attention_with_column_sums(q, k, v, None, valid, scaling), device, reps=1)
    print(f"shipped attention_with_column_sums: {t_ship * 1e3:.1f} ms ({t_ship / t_sdpa:.2f} x)", flush=True)
    ref_out, ref_sums = attention_with_column_sums(q, k, v, None, valid, scaling)

    # compiled on CUDA (Triton); eager on the CPU, where the compiled kernel has no return_lse (torch 2.13)
    flex = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention
    causal = create_block_mask(lambda b, hh, i, j: j <= i, None, None, s, s, device=str(device))
    later = create_block_mask(lambda b, hh, i, j: j >= i, None, None, s, s, device=str(device))
    dummy = torch.zeros(1, h, s, 16, device=device, dtype=dtype)

    def two_pass():
        out, lse = flex(q, k, v, block_mask=causal, scale=scaling, enable_gqa=True, return_lse=True)
        lse = lse.float()

        def minus_lse(score, b, hh, i, j):
            return score - lse[b, hh, j]

        kq = k.repeat_interleave(g, dim=1)  # (1, H, S, d): every query head's keys as queries
        _, col = flex(kq, q, dummy, block_mask=later, scale=scaling, score_mod=minus_lse, return_lse=True)
        return out, col.float().exp()

    t0 = time.perf_counter()
    out, sums = two_pass()
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"two-pass flex: first call (compiles) {time.perf_counter() - t0:.1f} s", flush=True)
    t_two = timed(two_pass, device)
    print(
        f"two-pass flex: {t_two * 1e3:.1f} ms ({t_two / t_sdpa:.2f} x the full cache's attention)", flush=True
    )
    out_err = (out.float() - ref_out.transpose(1, 2).float()).abs().max().item()
    rel = ((sums - ref_sums).abs() / ref_sums.abs().clamp_min(1e-6)).max().item()
    print(f"max |out - shipped| {out_err:.2e}; column sums max relative error {rel:.2e}; "
          f"sum of sums {sums.sum().item():.1f} (rows: {h * s})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
