"""One layer of H2O's prompt attention on the CPU (``kvcake.scorers.h2o.attention_with_column_sums``)
beside SDPA's causal attention of the same shape, for block sizes of the fused loop: where the
``BLOCK_BYTES`` figure in that module comes from.

    PYTHONPATH=src taskset -c 1 python3 scripts/h2o_block_rows.py --lengths 4096,8192 --rows 16,32,64,128

Shape: SmolLM2-135M's attention (9 query heads, 3 KV heads, head dim 64), batch 1, float32,
random inputs scaled as that model's are (logits within about +-50); one thread unless told.
Best of ``--repeats`` after one warm-up call. ``default`` is the rows ``block_rows`` picks.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kvcake.scorers.h2o import attention_with_column_sums, block_rows


def best_of(repeats: int, fn, *args, **kwargs) -> float:
    fn(*args, **kwargs)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--rows", default="16,32,64,128")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s); seconds per layer, best of {args.repeats}")
    for length in (int(x) for x in args.lengths.split(",")):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 9, length, 64, generator=g) * 0.4  # |q| ~ 3, |k| ~ 24: SmolLM2's norms
        k, v = torch.randn(1, 3, length, 64, generator=g) * 3, torch.randn(1, 3, length, 64, generator=g)
        valid = torch.ones(1, length, dtype=torch.bool)
        sdpa = best_of(
            args.repeats,
            F.scaled_dot_product_attention,
            q,
            k,
            v,
            is_causal=True,
            scale=0.125,
            enable_gqa=True,
        )
        line = [f"S={length}: sdpa {sdpa:.3f}"]
        default = block_rows(1, 9, length, q.device)
        for rows in sorted({int(x) for x in args.rows.split(",")} | {default}):
            fused = best_of(args.repeats, attention_with_column_sums, q, k, v, None, valid, 0.125, rows)
            mark = " (default)" if rows == default else ""
            line.append(f"rows {rows}{mark} {fused:.3f} ({fused / sdpa:.2f} x)")
        print("; ".join(line), flush=True)


if __name__ == "__main__":
    main()
