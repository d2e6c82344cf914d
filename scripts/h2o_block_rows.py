"""One layer of H2O's prompt attention on the CPU (``kvcake.scorers.h2o.attention_with_column_sums``)
beside SDPA's causal attention of the same shape, for block sizes of the fused loop: where the
``BLOCK_BYTES`` figure in that module comes from.

    PYTHONPATH=src taskset -c 1 python3 scripts/h2o_block_rows.py --lengths 4096,8192 --rows 16,32,64,128

Shape: SmolLM2-135M's attention (9 query heads, 3 KV heads, head dim 64), batch 1, float32,
random inputs scaled as that model's are (logits within about +-50); one thread unless told.
The median of ``--repeats`` rounds, each calling SDPA and every block size in turn, after one warm-up
call each. ``default`` is the rows ``block_rows`` picks.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from kvcake.scorers.h2o import attention_with_column_sums, block_rows


def interleaved(rounds: int, calls: dict) -> dict:
    """Each call's median time over ``rounds`` rounds, every round calling each once in turn after
    one warm-up call each: a host's drift (another process, the clock) falls on every call alike."""
    for fn in calls.values():
        fn()
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--rows", default="16,32,64,128")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s); seconds per layer, median of {args.repeats} interleaved rounds"
    )
    for length in (int(x) for x in args.lengths.split(",")):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 9, length, 64, generator=g) * 0.4  # |q| ~ 3, |k| ~ 24: SmolLM2's norms
        k, v = torch.randn(1, 3, length, 64, generator=g) * 3, torch.randn(1, 3, length, 64, generator=g)
        valid = torch.ones(1, length, dtype=torch.bool)
        default = block_rows(1, 9, length, q.device)
        sdpa = functools.partial(
            F.scaled_dot_product_attention, q, k, v, is_causal=True, scale=0.125, enable_gqa=True
        )
        calls = {"sdpa": sdpa}
        for rows in sorted({int(x) for x in args.rows.split(",")} | {default}):
            calls[rows] = functools.partial(attention_with_column_sums, q, k, v, None, valid, 0.125, rows)
        times = interleaved(args.repeats, calls)
        sdpa = times.pop("sdpa")
        line = [f"S={length}: sdpa {sdpa:.3f}"]
        for rows, fused in times.items():
            mark = " (default)" if rows == default else ""
            line.append(f"rows {rows}{mark} {fused:.3f} ({fused / sdpa:.2f} x)")
        print("; ".join(line), flush=True)


if __name__ == "__main__":
    main()
