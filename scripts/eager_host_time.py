"""Host time of an eager decode step per preset, beside transformers' DynamicCache and StaticCache:
the CPU proxy of issue 22's GPU eager target (a step <= 25 ms on the Llama-3.1-8B shape).

    PYTHONPATH=src python3 scripts/eager_host_time.py
    PYTHONPATH=src python3 scripts/eager_host_time.py --layers 32 --methods snapkv,cake --steps 200

On a GPU an eager step of an 8B model is mostly host time: Python and one dispatch and kernel
launch per ATen op (the GPU page's DynamicCache step, 22.4 ms at 32k tokens on an H100, reads
~20 GB in ~7 ms). Here the model is a tiny random Llama with the 8B's 32 layers (4 query / 2 KV
heads of 16 dims, so the arithmetic is negligible): a step's wall clock is its host time. Each
cache holds a ``--prompt``-token prompt (budget ``--budget``, the default static storage with
``max_cache_len`` reserved), then after 3 untimed steps ``--steps`` eager single-token steps are
timed, the caches taking one step each in turn; the figure is the fastest (on a shared host noise
only adds time: the medians of one run moved with it by up to 15% against the others). Printed
per cache: ms a step and its ratio to DynamicCache's (the steadier figure: the host's speed moves
every cache's time alike, DynamicCache's median from 11.5 to 20.9 ms between runs here), the host
time per layer above DynamicCache's, and the ATen ops per layer above DynamicCache's
(``kvcake.bench.step_counts.CountOps`` on one step), whose ratio is the host cost of one more op.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from transformers import DynamicCache, StaticCache

from kvcake import PRESETS, KVCakeCache, enable, make_method
from kvcake.adapters import with_cache
from kvcake.bench.caches import greedy_step
from kvcake.bench.step_counts import CountOps, tiny_llama


class Decoding:
    """One cache's eager decode from the end of a prompt, through the benches' greedy step
    (``kvcake.bench.caches.greedy_step``); ``step()`` times one token."""

    def __init__(self, model, cache, ids: torch.Tensor, compressed: bool) -> None:
        self.cache, self.pos, self.times = cache, ids.shape[1], []
        self.greedy = greedy_step(model)
        self.context = (lambda: enable(model)) if compressed else contextlib.nullcontext
        with self.context(), torch.no_grad():
            self.tok = model(ids, **with_cache(model, cache)).logits[:, -1:].argmax(-1)

    def step(self, timed: bool = True) -> None:
        position = torch.full((1, 1), self.pos)
        with self.context(), torch.no_grad():
            start = time.perf_counter()
            self.tok = self.greedy(self.tok, position, self.cache)
            if timed:
                self.times.append(time.perf_counter() - start)
        self.pos += 1

    def ops(self) -> int:
        """ATen ops of one more step."""
        with self.context(), torch.no_grad(), CountOps() as counter:
            self.greedy(self.tok, torch.full((1, 1), self.pos), self.cache)
        return sum(counter.ops.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default=",".join(PRESETS), help="presets, comma-separated")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--budget", type=int, default=64, help="entries per layer")
    p.add_argument("--steps", type=int, default=100, help="timed steps per cache")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = tiny_llama(args.layers)
    ids = torch.randint(
        3, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0)
    )
    capacity = args.prompt + args.steps + 8

    def kvcake_cache(spec: str):
        return lambda: KVCakeCache(model, make_method(spec, budget=args.budget), max_cache_len=capacity)

    caches = {
        "DynamicCache": (DynamicCache, False),
        "StaticCache": (lambda: StaticCache(model.config, max_cache_len=capacity), False),
    }
    caches |= {spec: (kvcake_cache(spec), True) for spec in args.methods.split(",") if spec}
    runs = {name: Decoding(model, make(), ids, compressed) for name, (make, compressed) in caches.items()}
    for i in range(3 + args.steps):  # round robin, one step each: a slow moment falls on every cache alike
        for run in runs.values():
            run.step(timed=i >= 3)
    step = {name: min(run.times) for name, run in runs.items()}  # noise on a shared host only adds
    ops = {name: run.ops() for name, run in runs.items()}
    base, base_ops, n = step["DynamicCache"], ops["DynamicCache"], args.layers
    print(f"tiny random Llama, {n} layers, {args.prompt}-token prompt, budget {args.budget}, "
          f"{torch.get_num_threads()} thread(s), fastest of {args.steps} eager steps")  # fmt: skip
    print(
        "| cache | ms a step | x DynamicCache | host us per layer above DynamicCache | ATen ops per layer above DynamicCache | us per extra op |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, t in step.items():
        extra_us, extra_ops = (t - base) / n * 1e6, (ops[name] - base_ops) / n
        per_op = f"{extra_us / extra_ops:.1f}" if extra_ops > 0 else "-"
        print(f"| {name} | {t * 1e3:.2f} | {t / base:.2f} | {extra_us:+.0f} | {extra_ops:+.0f} | {per_op} |")


if __name__ == "__main__":
    main()
