"""What a compiled CPU decode costs when one process decodes batches of several sizes: a document
compressed once (``kvcake.compress``), then follow-ups of ``--sizes`` questions in that order,
each batch decoded by ``generate(compile=True)``. Per call: the first call's seconds (its compile
included, where the size is new), the median time per generated token of ``--repeats`` more calls
(the follow-ups' eager prefill included), and the graphs compiled so far. A step compiled for a
size of up to ``devices.MOST_ROWS`` keeps that size static (``devices.fix_batch``): before it,
dynamo's automatic dynamic shapes made the batch symbolic at the second size, and the products of
that graph, which then served every batch of two or more, went to MKL (``kvcake.row_products``).

    PYTHONPATH=src python3 scripts/compiled_batches.py --sizes 2,3,2 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

import kvcake
from kvcake.standalone import comma_ints

README = Path(__file__).resolve().parents[1] / "README.md"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=comma_ints, default=(2, 3, 2), help="batch sizes, in the order decoded")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per call")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per size after the first")
    p.add_argument("--chars", type=int, default=6000, help="characters of the README used as the document")
    p.add_argument("--method", default="snapkv")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = kvcake.load_model()
    ids = tok(README.read_text()[: args.chars], return_tensors="pt").input_ids
    ctx = kvcake.compress(model, ids, args.method, keep_ratio=0.5)
    print(f"{kvcake.DEFAULT_MODEL}, {torch.get_num_threads()} threads, {args.method} keeping 0.5 of "
          f"{ids.shape[1]} tokens, 8-token questions, {args.tokens} tokens per call")  # fmt: skip
    print("| batch | first call s | ms per token | graphs so far |")
    print("| --- | --- | --- | --- |")
    for size in args.sizes:
        questions = torch.randint(100, 1000, (size, 8), generator=torch.Generator().manual_seed(size))
        kw = dict(attention_mask=torch.ones_like(questions), max_new_tokens=args.tokens,
                  min_new_tokens=args.tokens, do_sample=False, pad_token_id=tok.pad_token_id)  # fmt: skip
        times = []
        for _ in range(args.repeats + 1):
            t0 = time.perf_counter()
            ctx.generate(questions, compile=True, **kw)
            times.append(time.perf_counter() - t0)
        per_token = statistics.median(times[1:]) * 1000 / args.tokens
        graphs = counters["stats"]["unique_graphs"]
        print(f"| {size} | {times[0]:.1f} | {per_token:.1f} | {graphs} |", flush=True)


if __name__ == "__main__":
    main()
