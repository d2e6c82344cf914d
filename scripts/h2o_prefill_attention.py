"""Where H2O's prefill spends its extra time: the prompt attention inside whole prefills, H2O's own
loop (``kvcake.scorers.h2o.attention_with_column_sums``) against SDPA in the full cache's, timed
per call and summed over the layers (issue 23's prefill target; ``scripts/h2o_block_rows.py``
times one layer alone).

    PYTHONPATH=src taskset -c 1 python3 scripts/h2o_prefill_attention.py --length 8192 --rounds 2

Default model, the benchmark's prompt (``kvcake.bench.common.prompt_ids``), budget 128, one
thread; full and ``h2o`` prefills alternate. Also counts the blocks whose exponentials had to be
computed again, shifted (``kvcake.scorers.h2o.UNSHIFTED_SUMS``).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import kvcake
from kvcake.bench.common import prompt_ids
from kvcake.scorers import h2o


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spent = {"attention": 0.0, "blocks": 0, "shifted": 0}

    def timed(fn):
        def call(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            spent["attention"] += time.perf_counter() - start
            return out

        return call

    def counted(logits, sees, shape):
        scale = unshifted(logits, sees, shape)
        spent["blocks"] += 1
        spent["shifted"] += scale is None
        return scale

    unshifted = h2o._unshifted_exp
    h2o._unshifted_exp = counted
    h2o.attention_with_column_sums = timed(h2o.attention_with_column_sums)
    F.scaled_dot_product_attention = timed(
        F.scaled_dot_product_attention
    )  # looked up at call time by transformers
    model, tokenizer = kvcake.load_model(kvcake.DEFAULT_MODEL)
    ids, source = prompt_ids(tokenizer, args.length, model.config.vocab_size, torch.device("cpu"))
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.length} tokens of {source}")
    for round_ in range(args.rounds):
        for method in ("full", "h2o"):
            spent.update(attention=0.0, blocks=0, shifted=0)
            start = time.perf_counter()
            kvcake.compress(model, ids, method, budget=128 if method != "full" else None)
            total = time.perf_counter() - start
            print(f"round {round_ + 1} {method}: prefill {total:.2f} s, attention {spent['attention']:.2f} s, "
                  f"blocks {spent['blocks']} ({spent['shifted']} shifted)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
