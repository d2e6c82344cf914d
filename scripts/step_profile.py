"""Where one compiled decode step spends its time, per preset, beside the model's own ``StaticCache``
step (the decode page's ``floor``): the CPU profile behind the page's "what the compiled steps
still add" (issue 22).

    PYTHONPATH=src python3 scripts/step_profile.py --methods snapkv,cake,critical-adakv --threads 2

Each step is the decode benchmark's (``torch.compile(greedy_step(model), fullgraph=True)``, inductor),
after one prefill of ``--length`` tokens shared by every preset (of the default model, or past its
positions of a random model of its shape, as the benchmark's), budget ``--budget``. Every cache's
step is compiled side by side and warmed (4 steps); then, in ``--rounds`` interleaved rounds over
the caches (as the benchmark's compiled column), each takes ``--steps`` timed steps (the median
wall clock over the rounds) and ``--steps`` more under ``torch.profiler``; its self CPU time per
step is split into the weights' matrix products (``aten::mm``/``addmm``, what no cache changes),
the attention kernel (``scaled_dot_product``), the rest of inductor's generated code and its
wrapper (``CompiledFxGraph``, self time), dynamo's guard check (``TorchDynamo Cache Lookup``) and
every other ATen call outside the generated code (the three largest named), averaged over the
rounds. The profiler adds its own time, and the host's speed drifts within a round too: read the
split, not the last digit.
"""

from __future__ import annotations

import argparse
import collections
import statistics

import torch

from kvcake.bench.caches import build_cache, shared_prefill
from kvcake.bench.common import load_models, prompt_ids
from kvcake.bench.decoder import Decoder
from kvcake.bench.floor import FLOOR_TOKENS, floor_cache
from kvcake.bench.probes import Clock

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


def split_of(prof, steps: int) -> tuple[collections.Counter, collections.Counter]:
    """The profile's self CPU time per step (ms) by part, and the other ATen calls' by name."""
    split, other = collections.Counter(), collections.Counter()
    for event in prof.key_averages():
        part = _part(event.key)
        if part is not None:
            split[part] += event.self_cpu_time_total / steps / 1e3  # ms a step
        if part == "other ATen":
            other[event.key.removeprefix("aten::")] += event.self_cpu_time_total / steps / 1e3
    return split, other


def profile_steps(decoders: dict[str, Decoder], steps: int, rounds: int) -> list[dict]:
    """Each cache's compiled step (the decode benchmark's own: ``kvcake.bench.decoder.Decoder``,
    its compiled step, attention and timing) compiled side by side and warmed (4 steps), then in
    ``rounds`` interleaved rounds ``steps`` timed and ``steps`` profiled per cache, so a slow
    moment of the host falls on every row alike: the median wall clock and the mean split."""
    torch._dynamo.reset()
    with torch.no_grad():
        for label, dec in decoders.items():
            dec.compile("inductor", warmup=4)
            if dec.fast is None:
                raise RuntimeError(f"the step of {label} did not compile: {dec.compiled}")
        splits = {label: (collections.Counter(), collections.Counter()) for label in decoders}
        for _ in range(rounds):
            for label, dec in decoders.items():
                dec.timed_compiled(steps)
                with torch.profiler.profile() as prof:
                    for _ in range(steps):
                        dec.step(dec.fast, compiled=True)
                split, other = split_of(prof, steps * rounds)
                splits[label][0].update(split)
                splits[label][1].update(other)
    return [
        dict(method=label, wall=statistics.median(dec.compiled_times) * 1e3, split=splits[label][0],
             other=splits[label][1].most_common(3))
        for label, dec in decoders.items()
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="snapkv,cake,adakv", help="presets, comma-separated")
    p.add_argument(
        "--length", type=int, default=1024, help="prompt tokens (past the model's positions: a random model)"
    )
    p.add_argument("--budget", type=int, default=128, help="entries per layer")
    p.add_argument("--steps", type=int, default=10, help="steps timed, and as many profiled, per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over every cache")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    models = load_models(device=torch.device("cpu"), dtype=torch.float32)
    model, label = models.for_length(args.length)  # as the decode benchmark's rows
    tokenizer = models.tokenizer if model is models.model else None
    ids, _ = prompt_ids(tokenizer, args.length, model.config.vocab_size, torch.device("cpu"))
    print(f"{label}, {args.length} tokens, budget {args.budget}, {torch.get_num_threads()} thread(s)")
    specs = [m for m in args.methods.split(",") if m]
    room = 8 + 2 * args.steps * args.rounds  # the warm-up, timed and profiled steps of every round
    caches = [build_cache(model, m, args.budget, max_cache_len=args.length + room) for m in specs]
    if caches:  # one prefill for every preset (the benchmark's shared prefill)
        shared_prefill(model, ids, caches)
    tok = ids[:, -1:].clone()
    clock = Clock(torch.device("cpu"))
    decoders = {"floor": Decoder(model, floor_cache(model, ids, room), tok, FLOOR_TOKENS, clock)}
    decoders |= {m: Decoder(model, c, tok, args.length, clock) for m, c in zip(specs, caches, strict=True)}
    rows = profile_steps(decoders, args.steps, args.rounds)
    cols = ["weights' matmuls", "attention kernel", "generated code", "guards", "other ATen"]
    print(
        f"| cache | step ms (median of {args.steps * args.rounds}) | "
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
