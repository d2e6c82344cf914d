"""The decode bench's ``floor``: what a step costs on the device with next to no cache to read.

The ``floor`` row is the model's own step with only :data:`FLOOR_TOKENS` tokens cached (a
``StaticCache``), decoded in the same rounds as every cache and compiled whenever the run compiles.
No cache makes a step cheaper, so its ratio to its read bound says how far this device's step,
eager and compiled, is from reading bytes at all; :func:`matmul_probe` times the weights' matrix
products alone, the part of that step no cache touches. :func:`reading` says what the floor means
for the read-bound target, for the page.
"""

from __future__ import annotations

import torch
from transformers import StaticCache
from transformers.pytorch_utils import Conv1D

from ..adapters import with_cache
from .caches import FullCache, static_copy
from .common import Clock, median

FLOOR = "floor"
FLOOR_TOKENS = 16


def floor_cache(model, ids: torch.Tensor, steps: int) -> StaticCache:
    """The :data:`FLOOR` row's cache: the prompt's first :data:`FLOOR_TOKENS` tokens in a
    ``StaticCache`` with room for ``steps`` more (compileable, as the full cache's ``full-static``)."""
    short = FullCache(model.config)
    with torch.no_grad():
        model(ids[:, :FLOOR_TOKENS], **with_cache(model, short), logits_to_keep=1)
    return static_copy(short, model.config, FLOOR_TOKENS + steps)


def projections(model) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """(weight, a (1, in) row of ones, whether it is transformers' ``Conv1D``'s (in, out)) for every
    ``nn.Linear`` and ``Conv1D`` weight of ``model`` (GPT-2's projections), in its dtype and device;
    a tied weight once (the output head included)."""
    products = {}  # id(weight) -> (weight, its (1, in) row, whether it is Conv1D's (in, out))
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, Conv1D)):
            conv = isinstance(m, Conv1D)
            n_in = m.weight.shape[0 if conv else 1]
            row = torch.ones(1, n_in, dtype=m.weight.dtype, device=m.weight.device)
            products[id(m.weight)] = (m.weight, row, conv)
    return list(products.values())


def run_projections(products: list[tuple[torch.Tensor, torch.Tensor, bool]]) -> list[torch.Tensor]:
    """One token's products with each of :func:`projections`' weights."""
    return [torch.mm(row, w) if conv else torch.nn.functional.linear(row, w) for w, row, conv in products]


def matmul_probe(model, clock: Clock, repeats: int = 7, compiled: dict | None = None) -> tuple[float, int]:
    """(seconds, bytes): one token's products with every projection weight of ``model``
    (:func:`projections`, eagerly, or compiled with ``torch.compile(**compiled)``, the compiled
    steps' backend and options: ``decoder.step_compile``), the matrix work of a decode step and
    nothing else, median of ``repeats`` after one warm-up (the compile); and those weights' bytes.
    Seconds over bytes / read bandwidth is how close this device's matmul kernels come to reading
    the weights at the measured rate; no cache takes a step below it."""
    products = projections(model)
    fn = run_projections if compiled is None else torch.compile(run_projections, **compiled)

    def run() -> None:
        with torch.no_grad():
            fn(products)

    times = [clock.time(run)[0] for _ in range(repeats + 1)]
    return median(times[1:]), sum(w.numel() * w.element_size() for w, _, _ in products)


def best_s(r: dict) -> float:
    """A row's step at its best: eager, or compiled where that was measured and is faster."""
    compiled = r.get("compiled_s")
    return min(r["s"], compiled) if isinstance(compiled, float) else r["s"]


def mode(r: dict) -> str:
    """Which of a row's steps :func:`best_s` picked: ``"compiled"`` or ``"eager"``."""
    return "compiled" if best_s(r) < r["s"] else "eager"


def floor_row(rows: list[dict], length: int) -> dict | None:
    """The :data:`FLOOR` row at ``length``, if the run measured one."""
    return next((r for r in rows if r["length"] == length and r["method"] == FLOOR), None)


def floor_words(floor: dict) -> str:
    """The :data:`FLOOR` row in words: its step at its best against its read bound, and the
    weights' matmuls alone against theirs, where the run measured them (:func:`matmul_probe`)."""
    f = best_s(floor)
    text = f"the model's own step with {FLOOR_TOKENS} tokens cached: {f * 1e3:.1f} ms ({mode(floor)}), {f / floor['bound_s']:.2f} x"
    if floor.get("matmul_s") is not None:
        text += f"; its weight matmuls alone {matmul_words(floor)} x theirs"
    return text


def matmul_ratio(r: dict, key: str = "matmul_s") -> float:
    """The weights' matmuls alone (:func:`matmul_probe`: ``key`` ``matmul_s`` eager,
    ``compiled_matmul_s`` compiled) over their bytes' read bound, from a row (its bound is its
    weights and KV bytes over the bandwidth of the run)."""
    return r[key] / (r["bound_s"] * r["matmul_bytes"] / (r["weight_bytes"] + r["kv_bytes"]))


def fastest_matmul_ratio(r: dict) -> float:
    """:func:`matmul_ratio` of the faster of a row's eager and compiled matmuls (where measured)."""
    return min(matmul_ratio(r, k) for k in ("matmul_s", "compiled_matmul_s") if r.get(k) is not None)


def matmul_words(r: dict) -> str:
    """A row's matmuls alone in words: eager, and compiled where measured, each in ms and then
    against their read bound (the caller names it)."""
    text = f"{r['matmul_s'] * 1e3:.1f} ms eager, {matmul_ratio(r):.2f}"
    compiled = r.get("compiled_matmul_s")
    if compiled is not None:
        text += f" x, and {compiled * 1e3:.1f} ms compiled, {matmul_ratio(r, 'compiled_matmul_s'):.2f}"
    return text


def reading(floor: dict, bound: list[dict], presets: list[dict], target: float) -> str:
    """What the floor says of the read-bound target (``target`` x each preset's bound; ``bound``:
    those checks, ``presets``: their rows): the model's own step (eager, and compiled where
    measured) and its weight matmuls alone against their bounds, and whether the target is within
    any cache's reach in the floor's best mode."""
    f, met = best_s(floor), sum(c["ok"] for c in bound)
    steps = [f"{floor['s'] * 1e3:.1f} ms eager ({floor['s'] / floor['bound_s']:.2f} x its bound)"]
    if isinstance(floor.get("compiled_s"), float):
        steps.append(
            f"{floor['compiled_s'] * 1e3:.1f} ms compiled ({floor['compiled_s'] / floor['bound_s']:.2f} x)"
        )
    text = f"The model's own step with {FLOOR_TOKENS} tokens cached (`{FLOOR}`) takes {' and '.join(steps)}"
    if floor.get("matmul_s") is not None:
        text += f"; its weight matmuls alone take {matmul_words(floor)} x their read bound"
    if f <= target * floor["bound_s"]:
        return text + ". "
    if isinstance(floor.get("compiled_s"), float):  # compiled, the floor is still over the target
        lo, hi = min(best_s(r) for r in presets) / f, max(best_s(r) for r in presets) / f
        return (text + f": the model's own step at its best ({mode(floor)}) is {f / floor['bound_s'] / target - 1:.0%} "
                f"above {target} x its bound on this device, so the target is out of any cache's reach here; the presets' best steps "
                f"are {lo:.2f}-{hi:.2f} x that floor step ({met} of {len(bound)} within the target). ")  # fmt: skip
    if met:  # some steps, compiled, beat the floor's eager mode
        return (text + f"; {met} of {len(bound)} presets' best steps are within the target, below that floor where "
                "compiled: a compiled step leaves out the dispatch of the forward's ops, which the eager floor includes. ")  # fmt: skip
    return (text + f": on this device the forward itself, not the cache, sets a step's floor, so {target} x the "
            "bound is out of any cache's reach in that mode. ")  # fmt: skip
