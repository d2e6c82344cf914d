"""Clocks and process memory for the benchmarks: wall time (CUDA events on a GPU) and peak RSS."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


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
