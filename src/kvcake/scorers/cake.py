"""CAKE's attention-shift tolerant eviction indicator (CAKE paper, Section 4.3, Eq. 10).

Qin et al., ICLR 2025, https://arxiv.org/abs/2503.12491.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..budget import check_real
from .base import PrefillInputs, Scorer, pool1d, pool_rows
from .snapkv import _check_pool, _pool_prefix


@dataclass(frozen=True)
class CakeScorer(Scorer):
    """``mean_rows(A[..., n]) + gamma * var_rows(A[..., n])`` over the window rows, avg-pooled.

    The variance term keeps tokens whose importance shifts over time (the mean alone favours
    steadily attended ones). ``gamma = 200`` and avg pooling with kernel 5 (padding 2) are the
    paper's and the authors' code's values; the variance is unbiased. While decoding, the score
    is the current query's attention, pooled as the prompt's scores are (the paper's avg over 5, or
    a calibrated indicator's, below), without a variance term (the authors' code).

    ``indicator_from="auto"``: where the pooling is the paper's (avg, 5) and the model's CAKE
    calibration chose another indicator with its temperatures (``kvcake calibrate --indicators``,
    ``TauPoint.indicator``), a CAKE cache uses that one; ``"paper"`` keeps the paper's always. A
    pooling or kernel given explicitly is used as given.
    """

    gamma: float = 200.0
    kernel: int = 5
    pooling: str = "avg"
    reduce: str = "mean"
    indicator_from: str = "auto"
    name = "cake"

    def __post_init__(self) -> None:
        _check_pool(self.kernel, self.pooling, self.reduce)
        check_real("CAKE gamma", self.gamma, "score.gamma=200")  # finite: inf * a variance of 0 is nan
        if self.indicator_from not in ("auto", "paper"):
            raise ValueError(
                f"CAKE indicator_from must be 'auto' (the calibration's choice) or 'paper', got {self.indicator_from!r}"
            )

    @property
    def takes_calibrated_indicator(self) -> bool:
        """Whether a calibration's indicator replaces this scorer's pooling (see the class doc)."""
        return self.indicator_from == "auto" and (self.pooling, self.kernel) == ("avg", 5)

    def score_heads(self, inp: PrefillInputs) -> torch.Tensor:
        mean, var = inp.window_mean_var()
        w = inp.window_attention()[0].shape[2]
        return _pool_prefix(mean + self.gamma * var, w, self.kernel, self.pooling)

    @property
    def order_sensitive(self) -> bool:
        return self.kernel > 1

    def decode_heads(self, probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return pool1d(probs.mean(2), self.kernel, self.pooling)

    def decode_step(self, probs, positions, previous):
        pooled = pool_rows(probs, self.kernel, self.pooling)  # (B, H_kv, G, N)
        return pooled.mean(2) if self.reduce == "mean" else pooled.amax(2)
