"""Host time a compiled decode step spends checking its guards, per preset, beside the model's own
``StaticCache`` step (the decode page's ``floor``).

    PYTHONPATH=src python3 scripts/guard_cost.py --methods snapkv,cake,cake-adakv
    PYTHONPATH=src python3 scripts/guard_cost.py --methods snapkv --dump /tmp/guards

Before a compiled step runs, dynamo checks every guard of the graph it picked (the types, shapes
and values the trace depended on: the model's modules and weights, the cache's layers and their
tensors) on the host. CUDA graphs (``mode="reduce-overhead"``) replay the kernels, not the guards:
on a GPU whose step is a few milliseconds this check is host time per token that compiling does
not remove. Each step here is ``torch.compile(greedy_step(model), fullgraph=True)`` after a
prefill (``--length`` tokens, budget ``--budget``, ``max_cache_len`` reserved as the decode
benchmark does); the figure is the median of ``--repeats`` calls of the graph's own guard check
(``check`` of its guard manager) on the arguments of the next step, the rows' calls interleaved,
and the number of guards. ``--split`` also compiles each step with the guards on the cache and on
kvcake's modules left out (``guard_filter_fn``; the cache is the step's argument ``cache``, a
``StaticCache`` for the floor) and times that check beside the whole one, the two alternated in a
loop of their own (the CPU's caches warm: a lower bound of a step's check). Their difference is
what checking the cache costs, kvcake's layers against transformers' own. That compile is for
measuring only: a step without those guards would not notice its cache change.
``--dump DIR`` writes each guard tree (``DIR/<method>.txt``) to see what is guarded.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch._dynamo.eval_frame as eval_frame

import kvcake
from kvcake.bench.caches import build_cache, greedy_step, shared_prefill
from kvcake.bench.floor import FLOOR_TOKENS, floor_cache
from kvcake.models import load_model


def not_the_cache(entries) -> list[bool]:
    """A ``guard_filter_fn``: every guard but those on the step's cache and on kvcake's modules."""
    return [not (e.name.startswith("cache") or "__import_kvcake" in e.name) for e in entries]


def compiled_guards(model, ids: torch.Tensor, spec: str, budget: int, dump: Path | None, keep=None) -> dict:
    """The guards of one preset's compiled step (``floor``: the model's own StaticCache), with the
    next step's arguments they pass on; ``keep``: a ``guard_filter_fn`` (None: every guard)."""
    room = 8
    if spec == "floor":
        cache, start = floor_cache(model, ids, room), FLOOR_TOKENS
    else:
        cache = build_cache(model, spec, budget, max_cache_len=ids.shape[1] + room)
        cache.timing = False  # as the decode benchmark's compiled steps
        shared_prefill(model, ids, [cache])
        start = ids.shape[1]
    step = greedy_step(model, own_code=True)  # a code object, so graphs and guards, of its own
    compiled = torch.compile(
        step, fullgraph=True, options=None if keep is None else {"guard_filter_fn": keep}
    )
    tok = ids[:, -1:].clone()  # (1, 1) contiguous, as every later step's token
    with kvcake.enable(model), torch.no_grad():
        for i in range(3):
            tok = compiled(tok, torch.tensor([[start + i]]), cache)
        entries = eval_frame._debug_get_cache_entry_list(step.__code__)
        manager = entries[0].guard_manager  # the newest graph (the first step may have had its own)
        frame = dict(zip(step.__code__.co_varnames, (tok, torch.tensor([[start + 3]]), cache), strict=False))
        frame.update(zip(step.__code__.co_freevars, (c.cell_contents for c in step.__closure__), strict=True))
        if not manager.check(frame):
            raise RuntimeError(
                f"{spec}: the guards fail on the next step's arguments:\n{manager.check_verbose(frame)}"
            )
    tree = str(manager)
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{spec}.txt").write_text(tree)
    return dict(method=spec, manager=manager, frame=frame, guards=tree.count("+- ") - tree.count("GuardManager"),
                tensors=tree.count("TENSOR_MATCH"))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="snapkv,cake,adakv,cake-adakv", help="presets, comma-separated")
    p.add_argument("--length", type=int, default=512, help="prompt tokens")
    p.add_argument("--budget", type=int, default=128, help="entries per layer")
    p.add_argument("--repeats", type=int, default=200, help="guard checks timed per preset")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--dump", type=Path, default=None, help="folder for each guard tree")
    p.add_argument("--split", action="store_true", help="also time the check without the cache's guards")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model()[0]  # the default model (guards depend on its structure, not its weights)
    ids = torch.randint(
        100, model.config.vocab_size - 1, (1, args.length), generator=torch.Generator().manual_seed(0)
    )
    specs = ["floor", *[m for m in args.methods.split(",") if m]]
    whole = [compiled_guards(model, ids, spec, args.budget, args.dump) for spec in specs]
    split_specs = specs if args.split else []
    without = [
        compiled_guards(model, ids, spec, args.budget, None, keep=not_the_cache)
        | dict(method=f"{spec} (filtered)")
        for spec in split_specs
    ]  # the label names a failing check
    times = {r["method"]: [] for r in whole}
    with kvcake.enable(model), torch.no_grad():  # the state the guards were made in
        for _ in range(args.repeats):  # interleaved: the host's drift spreads over every row
            for r in whole:
                times[r["method"]].append(check_time(r))
        # --split: each row's two checks alternated in a loop of their own, the CPU's caches warm (the
        # interleaved checks above are cold, and their spread hides a difference of this size)
        warm = {}
        for a, b in zip(whole, without, strict=False):  # without: empty unless --split
            warm[a["method"]] = [[], []]
            for _ in range(args.repeats):
                warm[a["method"]][0].append(check_time(a))
                warm[a["method"]][1].append(check_time(b))
    split = " | warm: all, us | warm: without the cache's, us | warm: the cache's, us" if without else ""
    print(
        f"| cache | guard check us (median of {args.repeats}, interleaved) | guards | tensor guards{split} |"
    )
    print("| --- " * (4 + 3 * bool(without)) + "|")
    for r in whole:
        cells = [r["method"], f"{statistics.median(times[r['method']]) * 1e6:.0f}", r["guards"], r["tensors"]]
        if without:
            full, rest = (statistics.median(t) * 1e6 for t in warm[r["method"]])
            cells += [f"{full:.0f}", f"{rest:.0f}", f"{full - rest:.0f}"]
        print("| " + " | ".join(str(c) for c in cells) + " |")


def check_time(row: dict) -> float:
    """Seconds of one check of ``row``'s guards on the next step's arguments."""
    t = time.perf_counter()
    passed = row["manager"].check(row["frame"])
    t = time.perf_counter() - t
    if not passed:  # a failing check stops early: its time would mean nothing
        raise RuntimeError(
            f"{row['method']}: the guards no longer pass: {row['manager'].check_verbose(row['frame'])}"
        )
    return t


if __name__ == "__main__":
    main()
