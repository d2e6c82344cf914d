"""The host-side cost of each preset's prefill, deterministic on any device: ATen ops dispatched and
host-synchronising ops over one prefill of a tiny random Llama, per preset, beside the same model
with transformers' DynamicCache.

    PYTHONPATH=src python3 scripts/prefill_counts.py --layers 4,16,32 --length 600 --budget 64
    PYTHONPATH=src python3 scripts/prefill_counts.py --layers 16 --methods cake --diff cake-oneshot
    PYTHONPATH=src python3 scripts/prefill_counts.py --layers 32 --methods cake,criticalkv --reads

On a GPU every ATen op is a launch (or host work between launches) and every synchronising op
(``_local_scalar_dense``, ``nonzero``, ``masked_select``, indexing with a boolean mask, which
runs ``nonzero`` inside; a device-to-host copy shows as ``_to_copy``) drains the queue; so does a read of a value into Python (``.cpu()``, ``int(t)``,
``bool(t)``, ``.tolist()``, ``.numpy()``), which on the CPU dispatches nothing: ``--reads`` lists
those by call site in kvcake (every tensor's: the host tensors', budgets and lengths, cost nothing
on a GPU, the others one drain each; CAKE's per-layer statistics go through ``devices.HostRead``,
a copy started behind the layer's work and waited for at the next layer's update, not a drain). A prefill whose count grows with the square of the layer count
(a cascade re-evicting the layers seen so far at every stage) pays for it where the full prefill
is short (issue 23: ``cake`` 1.22 x and ``cake-adakv`` 1.43 x the full cache at 32k on an H200, within
target at 128k). ``--diff B`` prints the ops the first method dispatches beyond ``B``'s, by name.
The CPU-only fast paths (``kvcake.devices.CPU_ROUTES``: blocked loops and host checks) are off
unless ``--cpu-routes``: the counts are the route a GPU takes.
"""

from __future__ import annotations

import argparse
import contextlib
from collections import Counter

import torch
from transformers import DynamicCache

import kvcake
from kvcake import devices
from kvcake.adapters import with_cache
from kvcake.bench.step_counts import SYNCING, CountOps, host_reads, tiny_llama
from kvcake.cache import KVCakeCache
from kvcake.method import PRESETS, make_method
from kvcake.standalone import comma_ints

DEFAULT_METHODS = "snapkv,pyramidkv,cake,cake-oneshot,criticalkv,adakv,cake-adakv,h2o,defensivekv"


def prefill_reads(model, ids: torch.Tensor, method: str, budget: int, window: int) -> Counter[str]:
    """Reads of tensor values by kvcake call site over one prefill (``.cpu().numpy()`` counts twice)."""
    cache = KVCakeCache(model, make_method(method, budget=budget, window=window))
    with kvcake.enable(model), torch.no_grad(), host_reads() as reads:
        model(ids, **with_cache(model, cache), logits_to_keep=1)
    return Counter(f"{site} {name}" for name, site in reads)


def prefill_ops(model, ids: torch.Tensor, method: str | None, budget: int, window: int) -> Counter[str]:
    """ATen ops by name over one prefill of ``ids`` (``method`` None: a DynamicCache)."""
    if method is None:
        cache, ctx = DynamicCache(config=model.config), contextlib.nullcontext()
    else:
        cache, ctx = (
            KVCakeCache(model, make_method(method, budget=budget, window=window)),
            kvcake.enable(model),
        )
    counter = CountOps()
    with ctx, torch.no_grad(), counter:
        model(ids, **with_cache(model, cache), logits_to_keep=1)
    return counter.ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=comma_ints, default=(4, 16, 32), help="layer counts, e.g. 4,16,32")
    p.add_argument("--length", type=int, default=600, help="prompt tokens")
    p.add_argument("--budget", type=int, default=64, help="entries per layer")
    p.add_argument("--window", type=int, default=8, help="observation window")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="presets, comma-separated")
    p.add_argument("--diff", default=None, help="a preset: print the first method's ops beyond its, by name")
    p.add_argument("--reads", action="store_true", help="also list reads of tensor values by call site")
    p.add_argument("--cpu-routes", action="store_true",
                   help="count the CPU-only fast paths (kvcake.devices.CPU_ROUTES) instead of a GPU's route")  # fmt: skip
    args = p.parse_args()
    devices.CPU_ROUTES = args.cpu_routes  # by default the ops a GPU would launch, not the CPU's loops
    methods = [m for m in args.methods.split(",") if m]
    if bad := [m for m in [*methods, *([args.diff] if args.diff else [])] if m not in PRESETS]:
        raise SystemExit(f"unknown presets {bad}: choose from {', '.join(PRESETS)}")
    if args.length <= args.budget:
        raise SystemExit(
            f"--length ({args.length}) must exceed --budget ({args.budget}), or nothing is evicted"
        )
    ids = torch.randint(3, 128, (1, args.length), generator=torch.Generator().manual_seed(2))
    print(f"one prefill of {args.length} tokens, budget {args.budget}, window {args.window}: "
          "host-synchronising ops / ATen ops")  # fmt: skip
    for n in args.layers:
        model = tiny_llama(n)
        counted = {m: prefill_ops(model, ids, m, args.budget, args.window) for m in [None, *methods]}
        cells = [f"{m or 'DynamicCache'} {sum(v for k, v in ops.items() if k in SYNCING)}/{sum(ops.values())}"
                 for m, ops in counted.items()]  # fmt: skip
        print(f"{n} layers: " + ", ".join(cells))
        if args.reads:
            for m in methods:
                sites = prefill_reads(model, ids, m, args.budget, args.window)
                top = ", ".join(f"{site} x{v}" for site, v in sites.most_common(6))
                print(f"  {m}: {sum(sites.values())} reads; {top}")
        if args.diff:
            mine = counted[methods[0]]
            base = counted.get(args.diff) or prefill_ops(model, ids, args.diff, args.budget, args.window)
            extra = sorted(((v - base.get(k, 0), k) for k, v in mine.items()), reverse=True)
            print(
                f"  {methods[0]} beyond {args.diff}: " + ", ".join(f"{k} {v}" for v, k in extra[:12] if v > 0)
            )


if __name__ == "__main__":
    main()
