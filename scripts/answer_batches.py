"""What batching questions saves in ``kvcake.answer``: context-only (the default), one document
compressed once and N questions of different lengths (``--lengths same``: of one token length),
left-padded after it; question-aware (``--scenario question``), N questions of different lengths,
each compressed with the document as a row of one left-padded batch. Answered one at a time
(``batch_size=1``) and in one batch (``batch_size=N``), alternating, on the default model (or
``--model``); every answer forced to ``--tokens`` tokens so both sides decode the same work. Prints the median times and their ratio side by side, and whether the answers agree (they
should, up to the rounding of batched matrix products).

    PYTHONPATH=src python3 scripts/answer_batches.py --questions 4,8 --threads 2
    PYTHONPATH=src python3 scripts/answer_batches.py --scenario question --questions 4 --threads 2
    PYTHONPATH=src python3 scripts/answer_batches.py --model gemma3-270m --questions 8 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import kvcake
from kvcake.standalone import comma_ints

README = Path(__file__).resolve().parents[1] / "README.md"


def questions(tok, n: int) -> list[str]:
    """``n`` distinct questions of one token length under ``tok``: the key in each is a number."""

    def length(text: str) -> int:
        return len(tok(text, add_special_tokens=False).input_ids)

    texts = [f"What is the value of key {k}? Answer with the value only." for k in range(100, 1000)]
    return [t for t in texts if length(t) == length(texts[0])][:n]


def mixed_questions(n: int) -> list[str]:
    """``n`` distinct questions of different lengths (a batch pads them)."""
    return [
        f"What is the value of key {100 + k}?" + " Answer with the value only." * (k % 3) for k in range(n)
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", type=comma_ints, default=(1, 4, 8), help="numbers of questions")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per answer")
    p.add_argument("--chars", type=int, default=6000, help="characters of the README used as the document")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (medians)")
    p.add_argument("--method", default="snapkv")
    p.add_argument("--model", default=kvcake.DEFAULT_MODEL, help="e.g. gemma3-270m (sliding-window layers)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--scenario", choices=("context", "question"), default="context")
    p.add_argument(
        "--lengths", choices=("mixed", "same"), default="mixed", help="the questions' token lengths"
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = kvcake.load_model(args.model)
    document = README.read_text()[: args.chars]
    kw = dict(method=args.method, keep_ratio=0.5, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
              scenario=args.scenario)  # fmt: skip
    print(f"{args.model}, {torch.get_num_threads()} threads, {args.scenario} scenario, {args.method} "
          f"keeping 0.5 of {len(tok(document).input_ids)} tokens, questions of {args.lengths} lengths, "
          f"{args.tokens} tokens per answer, medians of {args.rounds}")  # fmt: skip
    print("| questions | one at a time s | one batch s | ratio | answers agree |")
    print("| --- | --- | --- | --- | --- |")
    for n in args.questions:
        qs = questions(tok, n) if args.lengths == "same" else mixed_questions(n)
        times: dict[int, list[float]] = {1: [], n: []}
        answers = {}
        for _ in range(args.rounds):
            for size in (1, n):
                t0 = time.perf_counter()
                answers[size] = kvcake.answer(
                    model, tok, context=document, question=qs, batch_size=size, **kw
                )
                times[size].append(time.perf_counter() - t0)
        one, batch = statistics.median(times[1]), statistics.median(times[n])
        print(
            f"| {n} | {one:.2f} | {batch:.2f} | {one / batch:.2f} | {answers[1] == answers[n]} |", flush=True
        )


if __name__ == "__main__":
    main()
