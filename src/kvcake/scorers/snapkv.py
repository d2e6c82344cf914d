"""SnapKV: Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation",
NeurIPS 2024, https://arxiv.org/abs/2404.14469."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..budget import check_int
from .base import PrefillInputs, Scorer, pool1d, window_rows_mean


@dataclass(frozen=True)
class SnapKVScorer(Scorer):
    """Mean attention of the observation window's queries on each prefix token, pooled.

    Defaults from the paper and its code: window 32 (set on the budget), max pooling with kernel
    7 over positions (``pooling="avg"`` as an option); pooling clusters neighbouring tokens so a
    kept token keeps its context.
    """

    kernel: int = 7
    pooling: str = "max"
    reduce: str = "mean"
    name = "snapkv"

    def __post_init__(self) -> None:
        _check_pool(self.kernel, self.pooling, self.reduce)

    def score_heads(self, inp: PrefillInputs) -> torch.Tensor:
        probs, row_valid = inp.window_attention()
        mean = window_rows_mean(probs, row_valid)
        return _pool_prefix(mean, probs.shape[2], self.kernel, self.pooling)


def _pool_prefix(x: torch.Tensor, w: int, kernel: int, kind: str) -> torch.Tensor:
    """Pool only the prefix columns (before the window), as the authors' code does."""
    prefix = x.shape[-1] - w
    if prefix <= 0:
        return x
    return torch.cat([pool1d(x[..., :prefix], kernel, kind), x[..., prefix:]], dim=-1)


def _check_pool(kernel: int, pooling: str, reduce: str) -> None:
    check_int("pooling kernel", kernel, 1, "score.kernel=7")
    if kernel % 2 == 0:
        raise ValueError(f"pooling kernel must be a positive odd int, got {kernel}: pass e.g. score.kernel=7")
    if pooling not in ("max", "avg"):
        raise ValueError(f"pooling must be 'max' or 'avg', got {pooling!r}")
    if reduce not in ("mean", "max"):
        raise ValueError(f"GQA reduction must be 'mean' or 'max', got {reduce!r}")
