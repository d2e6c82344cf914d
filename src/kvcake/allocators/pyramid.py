"""PyramidKV allocation (Cai et al., 2024, https://arxiv.org/abs/2406.02069)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..budget import check_int
from .base import AllocationRequest, LayerAllocator, round_exact, waterfill


@dataclass(frozen=True)
class Pyramid(LayerAllocator):
    """Budgets fall linearly from ``max`` at layer 0 to ``min`` at layer ``L-1``.

    With the per-layer average ``B`` and ``beta`` (default 20, PyramidKV's code):
    ``min = B' // beta``, ``max = 2 B' - min``, applied to the prefix part ``B' = B - Sw`` so that
    every layer still keeps its window (as the authors' code and kvpress do); the sum is exactly
    ``L * B``. A layer capped at the prompt length gives its excess to the others.
    """

    beta: int = 20
    name = "pyramid"

    def __post_init__(self) -> None:
        check_int("pyramid beta", self.beta, 1, "layers.beta=20")

    def allocate(self, req: AllocationRequest) -> torch.Tensor:
        n = req.num_layers
        avg_prefix = (req.total.double() / n - req.window.double()).clamp(min=0)  # (B,)
        lo = torch.floor(avg_prefix / self.beta)
        hi = 2 * avg_prefix - lo
        dev = req.total.device  # the host (allocation is host bookkeeping)
        if n > 1:
            frac = torch.linspace(1.0, 0.0, n, dtype=torch.float64, device=dev)
        else:
            frac = torch.ones(1, dtype=torch.float64, device=dev)
        x = lo[:, None] + (hi - lo)[:, None] * frac[None, :]  # (B, L) prefix budgets
        # Linear profile as weights over the pool: identical to the formula when nothing is capped.
        return round_exact(waterfill(x, req.window, req.cap, req.total), req.cap, req.total)
