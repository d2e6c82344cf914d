"""Uniform allocation (SnapKV, H2O, TOVA, StreamingLLM): every layer keeps the same budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import AllocationRequest, LayerAllocator, round_exact


@dataclass(frozen=True)
class Uniform(LayerAllocator):
    """Every layer gets ``B_total / L`` (largest-remainder rounding when it does not divide)."""

    name = "uniform"

    def allocate(self, req: AllocationRequest) -> torch.Tensor:
        n = req.num_layers
        x = (req.total.double() / n)[:, None].expand(-1, n)
        return round_exact(torch.minimum(x, req.cap.double()[:, None]), req.cap, req.total)
