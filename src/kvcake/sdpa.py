"""Which kernel ``scaled_dot_product_attention`` runs: an explicit policy instead of SDPA's own pick.

Measured on an H100 (issue 23): SDPA's default choice decoded the full cache at 83 ms per step
at 8k tokens, against 24 ms with the flash kernel forced; cuDNN rebuilt its plan for every new
key length (52 ms of CPU per call when each layer's length changes every step). So kvcake names
the backend rather than letting each call choose:

- ``"default"``: SDPA's own choice (nothing forced);
- ``"flash"``, ``"efficient"``, ``"cudnn"``, ``"math"``: that kernel only (``sdpa_kernel``);
- ``"auto"``: flash then memory-efficient then math on CUDA (cuDNN is left out: it plans per
  shape), SDPA's own choice elsewhere. This is the policy of kvcake's attention calls.

``fastest`` measures the candidates on a workload (the benchmarks give the full cache its
fastest backend this way). The policy lives in a context manager: nothing global is changed
outside a ``with`` block.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

logger = logging.getLogger(__name__)

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
POLICIES = ("default", "auto", *BACKENDS)
# "auto" on CUDA: an ordered preference list; SDPA takes the first that supports the call.
AUTO_CUDA = ("flash", "efficient", "math")


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown SDPA backend policy {policy!r}: use one of {', '.join(POLICIES)}")
    return policy


def backends_for(policy: str, device: torch.device) -> list[SDPBackend] | None:
    """The backends ``policy`` allows on ``device`` (in order of preference), or None for SDPA's own pick."""
    check_policy(policy)
    if policy == "default" or (policy == "auto" and device.type != "cuda"):
        return None
    names = AUTO_CUDA if policy == "auto" else (policy,)
    return [BACKENDS[n] for n in names]


@contextlib.contextmanager
def sdpa_policy(policy: str, device: torch.device | str) -> Iterator[None]:
    """Run the block's SDPA calls under ``policy`` on ``device`` (restored on exit)."""
    allowed = backends_for(policy, torch.device(device))
    if allowed is None:
        yield
        return
    with sdpa_kernel(allowed, set_priority=len(allowed) > 1):
        yield


def candidates(device: torch.device) -> tuple[str, ...]:
    """Backends worth measuring on ``device``: every CUDA kernel, or flash (a CPU kernel exists) and math."""
    if device.type == "cuda":
        return ("flash", "cudnn", "efficient", "math")
    return ("flash", "math")


def fastest(
    work: Callable[[], object],
    device: torch.device,
    names: Sequence[str] | None = None,
    repeats: int = 3,
    sync: Callable[[], None] = lambda: None,
    timer: Callable[[], float] = time.perf_counter,
) -> tuple[str, dict[str, float | None]]:
    """(name, {name: median seconds or None if it cannot run}) of the fastest backend for ``work``.

    ``work`` runs once per backend as a warm-up (plan building, autotuning), then ``repeats``
    times timed; a backend that raises (no kernel for this dtype/shape) is recorded as None."""
    names = tuple(names or candidates(device))
    for n in names:
        check_policy(n)
    times: dict[str, float | None] = {}
    for name in names:
        try:
            with sdpa_policy(name, device):
                work()
                sync()
                runs = []
                for _ in range(max(repeats, 1)):
                    t0 = timer()
                    work()
                    sync()
                    runs.append(timer() - t0)
        except RuntimeError as err:  # "No available kernel": this backend cannot serve the call
            logger.info("SDPA backend %s cannot run here: %s", name, " ".join(str(err).split())[:200])
            times[name] = None
            continue
        times[name] = sorted(runs)[len(runs) // 2]
    usable = {n: t for n, t in times.items() if t is not None}
    if not usable:
        raise RuntimeError(f"no SDPA backend of {names} could run the workload")
    return min(usable, key=usable.__getitem__), times
