"""Where one compiled decode step spends its time, per preset, beside the model's own ``StaticCache``
step (the decode page's ``floor``): the CPU profile behind the page's "what the compiled steps
still add" (issue 22).

    PYTHONPATH=src python3 scripts/step_profile.py --methods snapkv,cake,critical-adakv --threads 2

Each step is the decode benchmark's (``torch.compile(greedy_step(model), fullgraph=True)``, inductor,
after a prefill of ``--length`` tokens of the default model, budget ``--budget``). After 4 warm-up
steps, ``--steps`` steps are timed (the median wall clock) and ``--steps`` more run under
``torch.profiler``; its self CPU time per step is split into the weights' matrix products
(``aten::mm``/``addmm``, what no cache changes), the attention kernel (``scaled_dot_product``), the
rest of inductor's generated code and its wrapper (``CompiledFxGraph``, self time), dynamo's guard
check (``TorchDynamo Cache Lookup``) and every other ATen call outside the generated code (the three
largest named). The profiler adds its own time, and this host's speed drifts between rows (they run
one after another, not interleaved): read the split, not the last digit.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

import kvcake
from kvcake.bench.caches import build_cache, greedy_step, shared_prefill
from kvcake.bench.common import load_models, prompt_ids
from kvcake.bench.floor import FLOOR_TOKENS, floor_cache

PARTS = {  # profiler event name -> column (self CPU time); everything else: "other ATen"
    "aten::mm": "weights' matmuls",
    "aten::addmm": "weights' matmuls",
    "TorchDynamo Cache Lookup": "guards",
}


def _part(name: str) -> str | None:
    if name in PARTS:
        return PARTS[name]
    if "scaled_dot_product" in name and name.startswith("aten::"):
        return "attention kernel"
    if name.startswith("## Call CompiledFxGraph"):
        return "generated code"
    return "other ATen" if name.startswith("aten::") else None


def profile_step(models, ids: torch.Tensor, spec: str, budget: int, steps: int) -> dict:
    """The wall clock and the profile split of ``spec``'s compiled step (``floor``: the model's own)."""
    model, room = models.model, 8 + 2 * steps
    if spec == "floor":
        cache, pos = floor_cache(model, ids, room), FLOOR_TOKENS
    else:
        cache = build_cache(model, spec, budget, max_cache_len=ids.shape[1] + room)
        shared_prefill(model, ids, [cache])
        cache.timing, pos = False, ids.shape[1]  # as the decode benchmark's compiled steps
    torch._dynamo.reset()
    step = torch.compile(greedy_step(model), fullgraph=True)
    tok = ids[:, -1:].clone()
    walls = []

    def run() -> None:
        nonlocal tok, pos
        t = time.perf_counter()
        tok = step(tok, torch.tensor([[pos]]), cache)
        walls.append(time.perf_counter() - t)
        pos += 1

    with kvcake.enable(model), torch.no_grad():
        for _ in range(4):
            run()
        walls.clear()
        for _ in range(steps):
            run()
        with torch.profiler.profile() as prof:
            for _ in range(steps):
                run()
    split, other = collections.Counter(), collections.Counter()
    for event in prof.key_averages():
        part = _part(event.key)
        if part is not None:
            split[part] += event.self_cpu_time_total / steps / 1e3  # ms a step
        if part == "other ATen":
            other[event.key.removeprefix("aten::")] += event.self_cpu_time_total / steps / 1e3
    wall = statistics.median(walls[:steps]) * 1e3
    return dict(method=spec, wall=wall, split=split, other=other.most_common(3))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="snapkv,cake,adakv", help="presets, comma-separated")
    p.add_argument(
        "--length", type=int, default=1024, help="prompt tokens (the default model's positions at most)"
    )
    p.add_argument("--budget", type=int, default=128, help="entries per layer")
    p.add_argument("--steps", type=int, default=10, help="steps timed, and as many profiled")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    models = load_models(device=torch.device("cpu"), dtype=torch.float32)
    if args.length > models.max_positions:
        raise ValueError(
            f"--length {args.length} is longer than the model's {models.max_positions} positions"
        )
    ids, _ = prompt_ids(models.tokenizer, args.length, models.model.config.vocab_size, torch.device("cpu"))
    rows = [profile_step(models, ids, spec, args.budget, args.steps)
            for spec in ["floor", *[m for m in args.methods.split(",") if m]]]  # fmt: skip
    cols = ["weights' matmuls", "attention kernel", "generated code", "guards", "other ATen"]
    print(
        f"| cache | step ms (median of {args.steps}) | "
        + " | ".join(f"{c} ms" for c in cols)
        + " | largest other ATen (ms) |"
    )
    print("| --- " * (len(cols) + 3) + "|")
    for r in rows:
        named = ", ".join(f"{name} {ms:.2f}" for name, ms in r["other"])
        cells = " | ".join(f"{r['split'][c]:.2f}" for c in cols)
        print(f"| {r['method']} | {r['wall']:.1f} | {cells} | {named} |")


if __name__ == "__main__":
    main()
