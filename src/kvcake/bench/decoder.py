"""The decode bench's steps of one cache (:class:`Decoder`), eager and compiled, and the compiled
steps of many timed in interleaved rounds (:func:`time_compiled`)."""

from __future__ import annotations

import contextlib
import logging

import torch

from ..attention import enable
from ..cache import cache_kv_bytes
from .caches import BenchCache, greedy_step
from .common import Clock, median

logger = logging.getLogger(__name__)


def _attention_for(model, cache):
    """The kvcake attention for a compressed cache; the stock one, untouched, for the full caches."""
    return enable(model) if isinstance(cache, BenchCache) else contextlib.nullcontext()


def step_compile(model, backend: str) -> dict:
    """``torch.compile``'s ``backend`` and, with inductor, the options ``kvcake.generate(compile=True)``
    gives it (``row_products.compile_kwargs``): how the bench compiles a step, and the weights' products
    it times beside the steps (``floor.matmul_probe``). Static shapes (``dynamic=False``): every
    cache's step is compiled for its own sizes, as a process compiling that one cache would. Under
    dynamo's default (``dynamic=None``) its automatic dynamic shapes, which it records per source
    file and line and so shares between the steps' code copies (``greedy_step(own_code=True)``),
    would compile every cache after the first with symbolic sizes."""
    from ..row_products import compile_kwargs  # imports inductor: only when compiling

    options = compile_kwargs(model) if backend == "inductor" else {}
    return dict(backend=backend, dynamic=False, **options)


class Decoder:
    """One cache's decode steps: greedy, from the prompt's end, each step timed; the position is a
    host count passed as ``position_ids``. Eager steps first (in the interleaved rounds), then,
    with ``compiled``, the compiled ones: every cache's step compiled (``compile``:
    ``torch.compile(fullgraph=True)`` with :func:`step_compile`'s options, static shapes) and
    warmed, then timed in interleaved rounds as the eager steps are (:func:`time_compiled`), so
    a busy moment of the host falls on every cache alike."""

    def __init__(self, model, cache, tok: torch.Tensor, start: int, clock: Clock) -> None:
        self.model, self.cache, self.tok, self.pos, self.clock = model, cache, tok, start, clock
        self.eager = greedy_step(model)
        self.fast = None  # the compiled step, once compiled and warmed
        self.times, self.compiled_times, self.bytes = [], [], []
        self.compiled: float | str | None = None  # the compiled column: None when not asked

    def step(self, fn, compiled: bool = False) -> float:
        pos = torch.full((1, 1), self.pos, dtype=torch.long, device=self.tok.device)
        if isinstance(self.cache, BenchCache):
            self.cache.timing = not compiled
        with _attention_for(self.model, self.cache):
            t, self.tok = self.clock.time(lambda: fn(self.tok, pos, self.cache))
        self.pos += 1
        return t

    def warm(self, steps: int) -> None:
        for _ in range(steps):
            self.step(self.eager)
        if isinstance(self.cache, BenchCache):
            self.cache.decode_hook_s = 0.0

    def timed(self, steps: int) -> None:
        for _ in range(steps):
            self.times.append(self.step(self.eager))
            self.bytes.append(cache_kv_bytes(self.cache))

    def compile(self, backend: str, warmup: int) -> None:
        """Compile this cache's step and run ``warmup`` steps of it (the compiles happen there);
        where that fails, the compiled column says why (a row entry, not a crash)."""
        if not getattr(self.cache, "is_compileable", False):
            self.compiled = "n/a (not compileable)"
            return
        step = torch.compile(
            greedy_step(self.model, own_code=True), fullgraph=True, **step_compile(self.model, backend)
        )
        try:
            for _ in range(warmup):
                self.step(step, compiled=True)
        except Exception as err:  # noqa: BLE001 - any tracing/compile failure is reported in the row
            logger.warning("compiled decode failed: %s", " ".join(str(err).split())[:300])
            self.compiled = f"n/a (compile failed: {type(err).__name__})"
            return
        self.fast = step

    def timed_compiled(self, steps: int) -> None:
        if self.fast is not None:
            self.compiled_times += [self.step(self.fast, compiled=True) for _ in range(steps)]


def time_compiled(decoders: dict[str, Decoder], backend: str, warmup: int, steps: int, rounds: int) -> None:
    """The compiled column of ``decoders``: each compiled and warmed in turn, then ``steps`` timed
    compiled steps each in ``rounds`` interleaved rounds. Every cache's graphs stay compiled side
    by side, each cache's step a code object of its own (``greedy_step(own_code=True)``), so
    dynamo keeps their graphs and recompile counts apart as separate compiles would (its automatic
    dynamic shapes are not kept apart, hence :func:`step_compile`'s static shapes); median
    seconds, or why there is none."""
    torch._dynamo.reset()
    for label, dec in decoders.items():
        logger.info("decode: compiling the step of %s", label)
        dec.compile(backend, warmup)
    for r in range(rounds):
        logger.info("decode: compiled round %d/%d over %d caches", r + 1, rounds, len(decoders))
        for dec in decoders.values():
            dec.timed_compiled(steps // rounds)
    for dec in decoders.values():
        if dec.fast is not None:
            dec.compiled = median(dec.compiled_times)
    torch._dynamo.reset()
