"""How fast a decode step's products read the weights on this CPU, beside the memory's rate: the
measurements behind ``kvcake.row_products`` and its ``compile_kwargs`` (issue 22).

    PYTHONPATH=src python3 scripts/gemv_read.py --threads 1,2 --rows 1,2,4,8

For each thread count: the read bandwidth (``kvcake.bench.bandwidth.measure``: ``x.sum()``), then
for each ``--rows`` M (a batch of M sequences decoding, one token each) the products of an (M, K)
block with every projection weight of the default model (``floor.projections``, the output head
included) eagerly (``F.linear``: MKL), compiled with inductor's defaults (which call the same
kernel, but for one row and weights up to 2048 wide) and compiled with ``compile_kwargs``'s
options (``kvcake.row_products``: each product of at most ``MOST_ROWS`` rows a fused multiply and
sum, the output head included), in GB/s of weights read (median of ``--repeats``). Then, unless
``--no-step``, the
decode bench's compiled ``floor`` step (the model's own ``StaticCache`` with 16 tokens cached),
for each of ``--batches`` (sequences decoding together), compiled both ways, alternated in
``--rounds`` rounds of 10 steps (median ms); ``--inlined`` adds the step compiled with the pass's
rows left for inductor to inline into the reductions (as before ``row_products._stored``).
"""

from __future__ import annotations

import argparse
import contextlib
from unittest import mock

import torch

from kvcake import row_products
from kvcake.bench.bandwidth import measure
from kvcake.bench.caches import greedy_step
from kvcake.bench.common import load_models, median, prompt_ids
from kvcake.bench.decoder import Decoder
from kvcake.bench.floor import FLOOR_TOKENS, floor_cache, projections, run_projections
from kvcake.bench.probes import Clock
from kvcake.row_products import compile_kwargs


@contextlib.contextmanager
def inlined_rows():
    """The pass as it was before its rows were stored (``row_products._stored`` a no-op), inductor's
    graph cache off meanwhile (the pass's uuid, its cache key, does not see the change)."""
    with mock.patch.object(row_products, "_stored", lambda graph, rows: rows):
        with torch._inductor.config.patch(fx_graph_cache=False):
            yield


def median_s(fn, clock: Clock, repeats: int) -> float:
    """``fn``'s median seconds over ``repeats`` calls after one (the warm-up, and the compile)."""
    return median([clock.time(fn)[0] for _ in range(repeats + 1)][1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    p.add_argument("--rows", default="1", help="rows of the products (the batch), comma-separated")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--rounds", type=int, default=4, help="alternated rounds of the floor's step")
    p.add_argument("--no-step", action="store_true", help="the products only")
    p.add_argument("--batches", default="1", help="batch sizes of the floor's step, comma-separated")
    p.add_argument(
        "--inlined", action="store_true",
        help="the step also compiled with the products' rows left to inductor to inline (row_products._stored)",
    )  # fmt: skip
    args = p.parse_args()
    models = load_models(device=torch.device("cpu"), dtype=torch.float32)
    model = models.model
    pairs = projections(model)
    nbytes = sum(w.numel() * w.element_size() for w, _, _ in pairs)
    clock = Clock(torch.device("cpu"))
    # one code object compiled twice per (threads, rows): past dynamo's default limit of 8 graphs
    torch._dynamo.config.recompile_limit = 64
    plain = torch.compile(run_projections, dynamic=False)
    fused = torch.compile(run_projections, dynamic=False, **compile_kwargs(model))
    print(f"{models.name}: {len(pairs)} projection weights, {nbytes / 1e6:.0f} MB")
    print("| threads | rows | x.sum() GB/s | eager (MKL) GB/s | compiled GB/s | compiled, fused GB/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    with torch.no_grad():
        for n in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(n)
            read = measure("cpu")["read_gbps"]
            for m in [int(r) for r in args.rows.split(",")]:
                block = [(w, row.expand(m, -1).contiguous(), conv) for w, row, conv in pairs]
                fns = (run_projections, plain, fused)
                rates = [nbytes / median_s(lambda f=f, b=block: f(b), clock, args.repeats) / 1e9 for f in fns]
                print(f"| {n} | {m} | {read:.1f} | " + " | ".join(f"{r:.1f}" for r in rates) + " |")
    if args.no_step:
        return
    ids, _ = prompt_ids(models.tokenizer, 64, model.config.vocab_size, torch.device("cpu"))
    room = 8 + 10 * args.rounds
    steps = {}
    with torch.no_grad():
        for batch in [int(b) for b in args.batches.split(",")]:
            rows = ids.expand(batch, -1).contiguous()  # the same prompt in each row of the batch
            options = compile_kwargs(model)
            variants = [("inductor's defaults", {}, False), ("compile_kwargs", options, False)]
            variants += [("compile_kwargs, rows inlined", options, True)] if args.inlined else []
            for label, extra, inlined in variants:
                dec = Decoder(
                    model, floor_cache(model, rows, room), rows[:, -1:].clone(), FLOOR_TOKENS, clock
                )
                # dynamic=False: the batch sizes' steps share one code location, and dynamo's automatic
                # dynamic shapes would make the batch symbolic from the second, which the pass leaves alone
                step = greedy_step(model, own_code=True)
                dec.fast = torch.compile(step, fullgraph=True, dynamic=False, **extra)
                with inlined_rows() if inlined else contextlib.nullcontext():
                    for _ in range(4):  # the compile happens in the first
                        dec.step(dec.fast, compiled=True)
                steps[batch, label] = dec
        for _ in range(args.rounds):
            for dec in steps.values():
                dec.timed_compiled(10)
    print(f"\nthe compiled floor step, {torch.get_num_threads()} thread(s), median of {10 * args.rounds}:")
    for (batch, label), dec in steps.items():
        print(f"- batch {batch}, {label}: {median(dec.compiled_times) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
