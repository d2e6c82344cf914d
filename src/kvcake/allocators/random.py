"""Random allocation: the CAKE paper's ablation (Table 5), a random split with the same total."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import AllocationRequest, LayerAllocator, round_exact, waterfill


@dataclass(frozen=True)
class RandomSplit(LayerAllocator):
    """Random weights (seeded, the same for every sequence of a batch) share the pool beyond the
    windows; used to check that an adaptive allocation beats chance."""

    seed: int = 0
    name = "random"

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"random allocation seed must be an int, got {self.seed!r}")

    def allocate(self, req: AllocationRequest) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)  # host: the same weights on every machine
        w = torch.rand(req.num_layers, generator=g, dtype=torch.float64).to(req.total.device)  # host
        w = w[None, :].expand(req.total.shape[0], -1)
        return round_exact(waterfill(w, req.window, req.cap, req.total), req.cap, req.total)
