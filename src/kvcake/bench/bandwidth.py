"""Memory bandwidth of the device, measured the way decoding uses memory: stream a large tensor.

Two numbers, medians of several runs after one warm-up: *read* (``x.sum()``, each byte read
once) and *copy* (``dst.copy_(src)`` into a preallocated tensor, each byte read once and written
once, so ``2 * size`` bytes move). Decoding mostly reads (weights and cached keys/values once per
token), so the decode bound uses the read figure. On CUDA the clock is CUDA events.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .common import Clock, MiB, markdown_table, median, new_figure, save_figure
from .output import emit

logger = logging.getLogger(__name__)


def measure(device: torch.device | str = "cpu", size_bytes: int = 2**30, repeats: int = 5) -> dict:
    """Read and copy bandwidth in GB/s (10^9 bytes per second) over a ``size_bytes`` float32 tensor.

    Returns ``{"read_gbps", "copy_gbps", "size_bytes", "repeats", "read_s", "copy_s", "device"}``."""
    if size_bytes < 4 * 1024 or repeats < 1:
        raise ValueError("size_bytes must be at least 4 KiB and repeats at least 1")
    device = torch.device(device)
    clock = Clock(device)
    n = size_bytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)  # written once: every page is resident
    dst = torch.empty_like(src)
    dst.fill_(0.0)
    read_s, copy_s = [], []
    for i in range(repeats + 1):  # the first run of each is a warm-up
        t, _ = clock.time(lambda: src.sum())
        c, _ = clock.time(lambda: dst.copy_(src))
        if i:
            read_s.append(t)
            copy_s.append(c)
    size = n * 4
    result = dict(
        device=str(device), size_bytes=size, repeats=repeats, read_s=read_s, copy_s=copy_s,
        read_gbps=size / median(read_s) / 1e9, copy_gbps=2 * size / median(copy_s) / 1e9,
    )  # fmt: skip
    logger.info("bandwidth: read %.1f GB/s, copy %.1f GB/s", result["read_gbps"], result["copy_gbps"])
    return result


def fastest(probes: list[dict]) -> dict:
    """Several :func:`measure` results of one run as one: the probe with the highest read
    bandwidth, with every probe's read figure in ``probes`` (GB/s, in the order taken). On a
    shared host a probe can catch a busy moment (the decode bench's read probe once measured
    12.9 GB/s where the run before measured 25.3, while the steps slowed by a quarter): the
    fastest is the nearest to what the device can read, so bounds drawn from it are the
    tightest."""
    if not probes:
        raise ValueError("fastest() needs at least one bandwidth probe")
    best = max(probes, key=lambda p: p["read_gbps"])
    return dict(best, probes=[p["read_gbps"] for p in probes])


def probes_words(result: dict) -> str:
    """How a run's read bandwidth was taken, in words: one probe, or the fastest of several and
    their range (:func:`fastest`)."""
    reads = result.get("probes") or [result["read_gbps"]]
    if len(reads) == 1:
        return "one read probe"
    return f"the fastest of {len(reads)} read probes taken through the run ({min(reads):.1f}-{max(reads):.1f} GB/s)"


def table(result: dict) -> str:
    rows = [("read (x.sum())", f"{result['read_gbps']:.1f}", f"{min(result['read_s']) * 1e3:.1f} - {max(result['read_s']) * 1e3:.1f}"),
            ("copy (dst.copy_(src), read + write)", f"{result['copy_gbps']:.1f}",
             f"{min(result['copy_s']) * 1e3:.1f} - {max(result['copy_s']) * 1e3:.1f}")]  # fmt: skip
    head = f"Memory bandwidth on {result['device']}, {result['size_bytes'] / MiB:.0f} MiB float32, median of {result['repeats']}:"
    return head + "\n\n" + markdown_table(("operation", "GB/s", "run times ms (min - max)"), rows)


def run(device: torch.device | str = "cpu", *, size_bytes: int = 2**30, repeats: int = 5,
        out: str | Path | None = None, machine: dict | None = None, echo: bool = True) -> dict:  # fmt: skip
    """Measure, print the table, write ``out/bandwidth.json`` and ``out/bandwidth.png``."""
    result = dict(bench="bandwidth", machine=machine, **measure(device, size_bytes, repeats))
    return emit(result, "bandwidth", table(result) if echo else "", plot, out, echo)


def plot(result: dict, path: Path) -> Path:
    fig, (ax,) = new_figure(1, width=5, height=3.2)
    ax.bar(["read", "copy"], [result["read_gbps"], result["copy_gbps"]], color=["C0", "C1"])
    ax.set(ylabel="GB/s", title=f"Memory bandwidth ({result['device']})")
    return save_figure(fig, path)
