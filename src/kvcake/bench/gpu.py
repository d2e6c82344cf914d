"""``kvcake bench gpu``: every preset and the full cache at its best on a random model of a named shape.

One process, one length at a time (``--lengths``, default 8k, 32k and 128k tokens): a random
model of ``--shape`` (``llama-3.1-8b`` by default; nothing is downloaded), random prompt ids,
and for every cache, in alternating rounds (the order rotates each round so slow drifts hit every
cache alike):

- prefill time (one forward of the prompt with ``logits_to_keep=1``) and its ratio to the
  DynamicCache's prefill in the same round (the ratio is the median of those pairs);
- peak memory during that prefill, over what was allocated before it (CUDA: tensors; CPU: RSS);
- the eager decode step (greedy, one token) and the compiled one (``torch.compile(fullgraph=True)``,
  ``reduce-overhead`` on CUDA): ``n/a (not compileable)`` when the cache says it cannot be
  traced (``is_compileable``), ``n/a (compile failed: ...)`` when tracing fails.

The full cache runs at its best: a ``DynamicCache`` with the fastest SDPA backend measured on
this machine at this length (``kvcake.sdpa.fastest``), and a compiled ``StaticCache``. Times are
medians over rounds. The page (``--doc``, ``docs/benchmarks-gpu.md`` by default) carries the
device, driver, torch, transformers and CUDA versions and the command that wrote it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import subprocess
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, StaticCache

from ..adapters import with_cache
from ..attention import enable
from ..cache import KVCakeCache, cache_kv_bytes
from ..fp8 import storage_spec
from ..method import PRESETS, make_method
from ..sdpa import fastest, sdpa_policy
from .caches import greedy_step
from .kvpress_rows import check_presets, describe, is_press_row, press_context, row_name
from .output import fmt, markdown_table, median
from .probes import Clock, PeakMemory
from .shapes import random_model

logger = logging.getLogger(__name__)

FULL_DYNAMIC = "full (DynamicCache)"
FULL_STATIC = "full (StaticCache)"
MiB = 2**20
WARMUP_STEPS = 2
PAGE_MACHINE = ("device_name", "driver", "cuda", "torch", "transformers", "kvcake", "dtype", "attention",
                "ragged_attention", "cpu", "torch_threads")  # fmt: skip
CPU_TARGETS = ("The targets are stated for a GPU (issue 23: an H100-class device, the `llama-3.1-8b` shape, "
               "budget 1024); on the CPU they are checked on these rows as a reading, not as the issue's verdict.")  # fmt: skip


@dataclass(frozen=True)
class GpuSettings:
    """What one ``bench gpu`` run measures."""

    shape: str = "llama-3.1-8b"
    lengths: tuple[int, ...] = (8192, 32768, 131072)
    budget: int = 1024
    methods: tuple[str, ...] = tuple(PRESETS)
    rounds: int = 3
    steps: int = 8
    window: int = 32
    compile: bool = True
    kvpress: tuple[str, ...] = ()  # presets whose kvpress press also runs (kvcake.bench.kvpress_rows)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kvpress", check_presets(self.kvpress))
        if not self.lengths or min(self.lengths) < 2:
            raise ValueError(f"lengths must be at least 2 tokens, got {self.lengths}")
        if self.budget < 1 or any(self.budget >= n for n in self.lengths):
            raise ValueError(f"budget ({self.budget}) must be positive and below every length {self.lengths}")
        if self.rounds < 1 or self.steps < 1:
            raise ValueError(f"rounds and steps must be at least 1, got {self.rounds} and {self.steps}")
        for spec in self.methods:  # a bad spec fails before any model is built
            make_method(storage_spec(spec)[0], budget=self.budget, window=self.window)


@dataclass
class _Runner:
    """The caches of one length and how to prefill and step each."""

    model: torch.nn.Module
    ids: torch.Tensor  # (1, S)
    settings: GpuSettings
    clock: Clock
    backend: str = "default"  # the DynamicCache's SDPA backend
    compiled: dict[str, object] = field(default_factory=dict)  # cache name -> compiled step or "n/a (...)"
    warm: set = field(default_factory=set)  # caches whose prefill has run once at this length

    @property
    def device(self) -> torch.device:
        return self.ids.device

    def new_cache(self, name: str):
        s, n = self.settings, self.ids.shape[1]
        if name == FULL_DYNAMIC or is_press_row(name):
            return DynamicCache(config=self.model.config)
        capacity = n + WARMUP_STEPS * 2 + 2 * s.steps  # the prompt, then the eager and the compiled steps
        if name == FULL_STATIC:
            return StaticCache(config=self.model.config, max_cache_len=capacity)
        spec, kv_dtype = storage_spec(name)  # (``snapkv+fp8``: float8 storage)
        return KVCakeCache(self.model, make_method(spec, budget=s.budget, window=s.window),
                           max_cache_len=capacity, kv_dtype=kv_dtype)  # fmt: skip

    def context(self, name: str):
        stack, s = contextlib.ExitStack(), self.settings
        if is_press_row(name):  # kvpress's hooks compress the prompt; the full cache's SDPA backend
            n = self.ids.shape[1]
            stack.enter_context(press_context(self.model, name, budget=s.budget, length=n, window=s.window))
        elif name not in (FULL_DYNAMIC, FULL_STATIC):
            stack.enter_context(enable(self.model))
        own = name == FULL_DYNAMIC or is_press_row(name)
        stack.enter_context(sdpa_policy(self.backend if own else "auto", self.device))
        stack.enter_context(torch.no_grad())
        return stack

    def prefill(self, cache) -> float:
        kwargs = with_cache(self.model, cache)
        return self.clock.time(lambda: self.model(self.ids, logits_to_keep=1, **kwargs))[0]

    def step_fn(self):
        """A step of its own for each cache: dynamo keeps compiled graphs per code object."""
        return greedy_step(self.model, own_code=True)

    def decode(self, step, cache, start: int, compiled: bool = False) -> tuple[float, int]:
        """(median seconds per step, next position) of warm-up + timed greedy steps from ``start``."""
        tok = self.ids[:, -1:]
        times = []
        graphs = compiled and self.device.type == "cuda"  # "reduce-overhead": CUDA graphs
        for i in range(WARMUP_STEPS + self.settings.steps):
            pos = torch.full((1, 1), start + i, dtype=torch.long, device=self.device)
            if graphs:  # a new step: the graphs may overwrite the outputs of the last one
                torch.compiler.cudagraph_mark_step_begin()
            # the token is cloned: a CUDA graph's output lives in memory its next replay overwrites,
            # and it is the next step's input (the H200 run of 2026-11-26 failed on exactly that)
            t, tok = self.clock.time(lambda p=pos, x=tok: step(x, p, cache).clone())
            if i >= WARMUP_STEPS:
                times.append(t)
        return median(times), start + WARMUP_STEPS + self.settings.steps

    def compiled_step(self, name: str, cache):
        """The compiled step for ``name``'s caches, or the reason there is none (a str)."""
        if name not in self.compiled:
            if not self.settings.compile:
                self.compiled[name] = "n/a (--no-compile)"
            elif not getattr(cache, "is_compileable", False):
                self.compiled[name] = "n/a (not compileable)"
            else:
                mode = "reduce-overhead" if self.device.type == "cuda" else None
                # static shapes: dynamo's automatic dynamic shapes are shared by the steps' code
                # copies (decoder.step_compile), so a cache after the first would get symbolic sizes
                self.compiled[name] = torch.compile(self.step_fn(), fullgraph=True, mode=mode, dynamic=False)
        return self.compiled[name]

    def measure(self, name: str) -> dict:
        gc.collect()
        if name not in self.warm:  # one untimed prefill first: kernels compiled (H2O's FlexAttention
            with self.context(name):  # route on CUDA), plans built and memory pooled outside the timing
                self.prefill(self.new_cache(name))
            self.warm.add(name)
            gc.collect()
        cache = self.new_cache(name)
        with self.context(name):
            with PeakMemory(self.device) as mem:
                prefill_s = self.prefill(cache)
            kv = cache_kv_bytes(cache)
            eager_s, pos = self.decode(self.step_fn(), cache, self.ids.shape[1])
            compiled_s: float | str = self.compiled_step(name, cache)
            if not isinstance(compiled_s, str):
                try:
                    compiled_s, _ = self.decode(compiled_s, cache, pos, compiled=True)
                except Exception as err:  # noqa: BLE001 - any tracing/compile failure is a row entry, not a crash
                    # the whole traceback: a GPU run is rare, and a bare "AssertionError" says nothing
                    logger.warning("compiled decode of %s failed: %s", name, " ".join(str(err).split())[:300],
                                   exc_info=True)  # fmt: skip
                    compiled_s = self.compiled[name] = f"n/a (compile failed: {type(err).__name__})"
        return dict(prefill_s=prefill_s, peak_bytes=max(mem.peak - mem.base, 0), kv_bytes=kv,
                    eager_s=eager_s, compiled_s=compiled_s)  # fmt: skip


def _pick_backend(runner: _Runner) -> tuple[str, dict]:
    """The fastest SDPA backend for the DynamicCache's decode step at this length."""
    cache = runner.new_cache(FULL_DYNAMIC)
    with runner.context(FULL_DYNAMIC):
        runner.prefill(cache)
    tok, pos = runner.ids[:, -1:], runner.ids.shape[1]
    step = runner.step_fn()

    def work() -> None:  # the same position each time: the cache grows by one per call
        with torch.no_grad():
            step(tok, torch.full((1, 1), pos, dtype=torch.long, device=runner.device), cache)

    return fastest(work, runner.device, sync=runner.clock.sync)


def run_gpu(settings: GpuSettings, *, device: torch.device, dtype: torch.dtype) -> dict:
    """Measure every cache of ``settings`` at every length; returns ``{"rows": [...], ...}``."""
    names = (FULL_DYNAMIC, FULL_STATIC, *settings.methods, *map(row_name, settings.kvpress))
    rows, backends = [], {}
    clock = Clock(device)
    for length in settings.lengths:
        extra = 4 * (WARMUP_STEPS + settings.steps) + 8
        model = random_model(settings.shape, length + extra, device=device, dtype=dtype)
        gen = torch.Generator().manual_seed(0)  # host: the same ids on every machine
        ids = torch.randint(0, model.config.vocab_size, (1, length), generator=gen).to(device)
        runner = _Runner(model, ids, settings, clock)
        runner.backend, times = _pick_backend(runner)
        backends[length] = dict(chosen=runner.backend, seconds=times)
        logger.info(
            "%d tokens: DynamicCache decodes fastest with SDPA %s (%s)", length, runner.backend, times
        )
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(settings.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                logger.info("%d tokens, round %d/%d: %s", length, r + 1, settings.rounds, name)
                try:
                    runs[name].append(runner.measure(name))
                except torch.OutOfMemoryError:  # one cache too big at this length: a row entry, not a crash
                    logger.warning("%s ran out of memory at %d tokens", name, length)
                    runs[name].append(None)
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        full = runs[FULL_DYNAMIC]
        for name in names:
            mine = runs[name]
            if any(x is None for x in mine + full):
                rows.append(dict(length=length, cache=name, prefill_s="OOM", prefill_ratio="OOM", eager_ms="OOM",
                                 compiled_ms="OOM", peak_mib="OOM", kv_mib="OOM"))  # fmt: skip
                continue
            compiled = [x["compiled_s"] for x in mine]
            rows.append(dict(
                length=length, cache=name, prefill_s=median([x["prefill_s"] for x in mine]),
                prefill_ratio=median([x["prefill_s"] / f["prefill_s"] for x, f in zip(mine, full, strict=True)]),
                eager_ms=1e3 * median([x["eager_s"] for x in mine]),
                compiled_ms=next((c for c in compiled if isinstance(c, str)), None)
                or 1e3 * median([c for c in compiled if not isinstance(c, str)]),
                peak_mib=median([x["peak_bytes"] for x in mine]) / MiB, kv_mib=median([x["kv_bytes"] for x in mine]) / MiB,
            ))  # fmt: skip
        del runner, model
        gc.collect()
    return dict(bench="gpu", settings=settings.__dict__ | {"lengths": list(settings.lengths), "methods": list(settings.methods),
                "kvpress": list(settings.kvpress)}, rows=rows,
                sdpa_backends=backends)  # fmt: skip


def _cell(value: float | str, digits: int) -> str:
    return value if isinstance(value, str) else fmt(value, digits)  # "OOM", "n/a (...)": as they are


def gpu_table(result: dict) -> str:
    rows = []
    for r in result["rows"]:
        name = r["cache"]
        if name == FULL_DYNAMIC:
            name += f", SDPA {result['sdpa_backends'][r['length']]['chosen']}"

        cells = [_cell(r[k], digits) for k, digits in (("prefill_s", 3), ("prefill_ratio", 2), ("eager_ms", 2),
                                                       ("compiled_ms", 2), ("peak_mib", 0), ("kv_mib", 1))]  # fmt: skip
        rows.append((r["length"], name, *cells))
    return markdown_table(("S", "cache", "prefill s", "prefill / full", "eager decode ms", "compiled decode ms",
                           "prefill peak MiB", "KV MiB"), rows)  # fmt: skip


def driver_version() -> str | None:
    """The NVIDIA driver's version (``nvidia-smi``), or None where there is none."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True)  # fmt: skip
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    return None


# -- targets (issue 23, on an H100-class GPU) ------------------------------------------------------
PREFILL_RATIO = 1.10  # every preset's prefill within 10% of the full cache's
ADA_RATIO = 1.20  # an Ada-KV preset decodes within 20% of the dense preset of the same bytes
MEMORY_RATIO = 0.55  # peak prefill memory at 32k, for the methods that evict as the layers go
MEMORY_LENGTH = 32768
PREFILL_LENGTHS = (32768, 131072)  # the prefill target's lengths (8k is in the table, not a target)
ADA_PAIRS = {
    "adakv": "snapkv",
    "ada-pyramidkv": "pyramidkv",
    "critical-adakv": "criticalkv",
    "cake-adakv": "cake",
}
HOLDS_WHOLE_PROMPT = (
    "cake-oneshot",
)  # allocates after the last layer: holds every layer's prompt until then


def _decode_pair(a: dict, b: dict) -> tuple[str, float, float]:
    """The decode times two rows are compared by: the compiled step where both have one (what a
    server runs; an eager step of an 8B model is mostly kernel launches), else the eager step."""
    if not isinstance(a["compiled_ms"], str) and not isinstance(b["compiled_ms"], str):
        return "compiled", a["compiled_ms"], b["compiled_ms"]
    return "eager", a["eager_ms"], b["eager_ms"]


def targets(result: dict) -> list[dict]:
    """Each GPU target checked on the rows measured (a target whose lengths or methods are absent is skipped)."""
    # an "OOM" row has nothing to check
    measured = [r for r in result["rows"] if not isinstance(r["prefill_ratio"], str)]
    at = {(r["length"], r["cache"]): r for r in measured}
    lengths = sorted({r["length"] for r in result["rows"]})
    methods = list(result["settings"]["methods"])
    out = []
    for n in lengths:
        for m in methods:
            if n not in PREFILL_LENGTHS or (n, m) not in at or (n, FULL_DYNAMIC) not in at:
                continue
            v = at[n, m]["prefill_ratio"]
            out.append(dict(target=f"prefill <= {PREFILL_RATIO:.2f} x full", length=n, cache=m, value=v,
                            ok=v <= PREFILL_RATIO))  # fmt: skip
        for ada, dense in ADA_PAIRS.items():
            if (n, ada) in at and (n, dense) in at:
                kind, a, b = _decode_pair(at[n, ada], at[n, dense])
                out.append(dict(target=f"{kind} decode <= {ADA_RATIO:.1f} x {dense}'s", length=n, cache=ada,
                                value=a / b, ok=a / b <= ADA_RATIO))  # fmt: skip
    if 8192 in lengths and 32768 in lengths:
        for m in (FULL_DYNAMIC, FULL_STATIC, *methods):
            if (8192, m) not in at or (32768, m) not in at:
                continue
            kind, a, b = _decode_pair(at[8192, m], at[32768, m])
            out.append(dict(target=f"{kind} decode at 8k <= at 32k", length=8192, cache=m, value=a / b,
                            ok=a / b <= 1.0))  # fmt: skip
    if (MEMORY_LENGTH, FULL_DYNAMIC) in at:
        full = at[MEMORY_LENGTH, FULL_DYNAMIC]["peak_mib"]
        for m in methods:
            if m not in HOLDS_WHOLE_PROMPT and (MEMORY_LENGTH, m) in at:
                v = at[MEMORY_LENGTH, m]["peak_mib"] / full if full > 0 else float("nan")
                out.append(dict(target=f"prefill peak <= {MEMORY_RATIO:.2f} x full's", length=MEMORY_LENGTH, cache=m,
                                value=v, ok=v <= MEMORY_RATIO))  # fmt: skip
    return out


def merge(previous: dict, result: dict) -> dict:
    """``result`` with the rows of ``previous`` at the lengths it did not measure (``--merge``: a
    long run split into one command per length). The settings other than the lengths must match."""
    keys = [k for k in result["settings"] if k != "lengths"]
    before = {"kvpress": []} | previous.get("settings", {})  # (pages before --kvpress)
    differ = [k for k in keys if before.get(k) != result["settings"][k]]
    if differ:
        raise ValueError(f"--merge: the earlier run differs in {', '.join(differ)}; rerun it or drop --merge")
    new = set(result["settings"]["lengths"])
    rows = [r for r in previous["rows"] if r["length"] not in new] + result["rows"]
    rows.sort(key=lambda r: r["length"])  # stable: the cache order within a length is kept
    lengths = sorted({r["length"] for r in rows})
    backends = {int(k): v for k, v in previous["sdpa_backends"].items() if int(k) not in new}
    return result | dict(
        rows=rows, settings=result["settings"] | {"lengths": lengths}, runs=previous.get("runs", []) + result["runs"],
        sdpa_backends=dict(sorted((backends | {int(k): v for k, v in result["sdpa_backends"].items()}).items())),
    )  # fmt: skip


def render_page(result: dict, machine: dict) -> str:
    """``docs/benchmarks-gpu.md``: how it was made, the table, the targets."""
    s = result["settings"]
    checks = targets(result)
    missed = [c for c in checks if not c["ok"]]
    backends = ", ".join(f"{n}: {b['chosen']}" for n, b in result["sdpa_backends"].items())
    lines = [
        f"# kvcake on {'the CPU' if machine.get('device') == 'cpu' else 'a GPU'}: prefill, decode step and memory of every preset",
        "",
        "Written by (`make bench-gpu` runs the default command):",
        "",
        *(f"- `{r['command']}` on {r['date']} in {r['total_s'] / 60:.1f} min" for r in result["runs"]),
        "",
        *(f"- {k}: {machine.get(k)}" for k in PAGE_MACHINE),
        "",
        f"A random-weight model of the `{s['shape']}` shape (nothing downloaded; times and memory only), random "
        f"prompt ids, budget {s['budget']} entries per layer (window {s['window']}), {s['rounds']} alternating "
        f"rounds of every cache (medians) after one untimed prefill of each, {s['steps']} timed greedy decode "
        f"steps after {WARMUP_STEPS} warm-up steps. `prefill / full` is the median ratio to the DynamicCache's prefill of the same round; "
        "`prefill peak` is the peak memory during the prefill over what was allocated before it (CUDA: "
        "tensors; CPU: resident set); `KV` what the cache holds after it (a StaticCache: its whole buffer). "
        "The DynamicCache runs with the SDPA backend that decoded fastest at each length "
        f"({backends}); the others use "
        "kvcake's `auto` policy (`kvcake.sdpa`).",  # fmt: skip
        *(["", describe(s["kvpress"], machine.get("kvpress"))] if s.get("kvpress") else []),
        "",
        gpu_table(result),
        "",
        f"## Targets ({len(checks) - len(missed)} of {len(checks)} met)",
        "",
        *([CPU_TARGETS, ""] if machine.get("device") == "cpu" else []),
        markdown_table(
            ("target", "S", "cache", "value", "verdict"),
            [
                (c["target"], c["length"], c["cache"], fmt(c["value"], 2), "met" if c["ok"] else "**missed**")
                for c in checks
            ],
        ),  # fmt: skip
        "",
    ]
    return "\n".join(lines)
