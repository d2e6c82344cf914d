"""Which presets keep entries decided by float rounding on ``make test-tp``'s tiny models: the
command behind the README's note on ``layer-defensivekv`` and Gemma 4 under tensor parallelism.

    PYTHONPATH=src python3 scripts/near_ties.py
    PYTHONPATH=src python3 -m torch.distributed.run --standalone --nproc-per-node 2 scripts/near_ties.py

For each of ``--batches`` batches (``tests/tp/check_tp.py``'s: two ``--length``-token random prompts,
the second left-padded; seeds 1, 2, ...) and preset, check_tp's run (budget 64, static storage, 8
greedy tokens) on the model in float32 and on a float64 copy of it, in one process; the positions
every compressed layer and KV head holds at the end are compared, row by row. Under
``torch.distributed.run`` (gloo) the split model (``tp_plan="auto"``) is compared with the whole one
in float32 as well, each rank's heads gathered. A line per row and preset: whether the kept entries
equal, and where not, the (compressed layer's index, head, position) each side keeps alone (four at most) and how far
the new tokens' logits moved. A set that changes with float64 as it does under the split is a
near-tie the selection breaks by rounding; one that changed under the split alone would be a bug of
the split. On 2026-12-01 (torch 2.13, transformers 5.24): only ``layer-defensivekv``'s, on row 1 of
batches 1 and 2, the split keeping what float64 keeps.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "tp"))
import check_tp  # noqa: E402  (the test-tp models and run, not a package)

from kvcake.inspect import kept_mask  # noqa: E402

PRESETS = check_tp.GEMMA4_PRESETS + ("layer-defensivekv",)


def kept(model, ids: torch.Tensor, mask: torch.Tensor, preset: str) -> tuple[np.ndarray, list[torch.Tensor]]:
    """The kept positions (B, L_g, H_kv, S + new tokens) after ``check_tp.run`` (static storage), and
    the new tokens' logits."""
    out, cache = check_tp.run(model, ids, mask, preset, static=True)
    length = out.sequences.shape[1]
    held = np.stack([kept_mask(cache, length, row) for row in range(ids.shape[0])])
    return held, [s.double() for s in out.scores]


def gathered(mask: np.ndarray, world: int) -> np.ndarray:
    """Every rank's heads (dim 2) of a kept mask, in rank order."""
    every = [None] * world
    dist.all_gather_object(every, mask)
    return np.concatenate(every, axis=2)


def describe(a: np.ndarray, b: np.ndarray, logits_a, logits_b, row: int) -> str:
    """'equal', or the (compressed layer's index, head, position) of sequence ``row`` kept by one side only and its
    logits' largest gap."""
    a, b = a[row], b[row]
    if np.array_equal(a, b):
        return "equal"
    only_a = [tuple(int(i) for i in ix) for ix in np.argwhere(a & ~b)]
    only_b = [tuple(int(i) for i in ix) for ix in np.argwhere(b & ~a)]
    gap = max(float((x[row] - y[row]).abs().max()) for x, y in zip(logits_a, logits_b, strict=True))
    return f"differ: only the first {only_a[:4]}, only the second {only_b[:4]}, logits up to {gap:.2g} apart"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma4", help="a check_tp.py model kind (gemma4, gemma3, llama, ...)")
    p.add_argument("--batches", type=int, default=3, help="check_tp.py's batch of two, seeds 1, 2, ...")
    p.add_argument("--length", type=int, default=check_tp.PROMPT)
    p.add_argument("--presets", default=",".join(PRESETS))
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    logging.getLogger("kvcake").setLevel(logging.ERROR)  # the tiny model's tau fallback warning
    torch.set_num_threads(1)
    split = "WORLD_SIZE" in os.environ
    rank, world = 0, 1
    if split:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        whole, tp = check_tp.load_both(rank, args.model)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            check_tp.save_tiny(tmp, args.model)
            whole, tp = AutoModelForCausalLM.from_pretrained(tmp), None
    double = copy.deepcopy(whole).to(torch.float64)
    logger = logging.getLogger("near_ties")
    if rank == 0:
        logger.info("%s, %d-token prompts; float64: one process in float64 against float32%s",
                    args.model, args.length, f"; split: {world} ranks against one process" if split else "")  # fmt: skip
    for seed in range(1, args.batches + 1):
        ids, mask = check_tp.batch(seed, args.length)
        for preset in args.presets.split(","):
            ref, ref_logits = kept(whole, ids, mask, preset)
            wide, wide_logits = kept(double, ids, mask, preset)
            if split:
                held, logits = kept(tp, ids, mask, preset)
                held = gathered(held, world)
            for row in range(ids.shape[0]):
                line = f"batch {seed} row {row} {preset:<17} float64: {describe(ref, wide, ref_logits, wide_logits, row)}"
                if split:
                    line += f" | split: {describe(ref, held, ref_logits, logits, row)}"
                if rank == 0:
                    logger.info(line)
    if split:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
