"""CAKE's attention-shift tolerant eviction indicator (CAKE paper, Section 4.3, Eq. 10).

Qin et al., ICLR 2025, https://arxiv.org/abs/2503.12491.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

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
    pooling or kernel given explicitly is used as given. ``row_indicators`` (set by the cache, as
    ``"max7/avg5"``: one per row of its batch, ``cake_tau.py``): where the prompts of a batch
    take different calibrated indicators, each row is pooled with its own, as alone.
    """

    gamma: float = 200.0
    kernel: int = 5
    pooling: str = "avg"
    reduce: str = "mean"
    indicator_from: str = "auto"
    row_indicators: str = ""
    rows: tuple[tuple[str, int], ...] = field(init=False, repr=False, compare=False)  # row_indicators parsed
    name = "cake"

    def __post_init__(self) -> None:
        _check_pool(self.kernel, self.pooling, self.reduce)
        object.__setattr__(self, "rows", _parse_rows(self.row_indicators))  # once: a decode step reads it
        for pooling, kernel in self.rows:
            _check_pool(kernel, pooling, self.reduce)
        check_real("CAKE gamma", self.gamma, "score.gamma=200")  # finite: inf * a variance of 0 is nan
        if self.indicator_from not in ("auto", "paper"):
            raise ValueError(
                f"CAKE indicator_from must be 'auto' (the calibration's choice) or 'paper', got {self.indicator_from!r}"
            )

    @property
    def takes_calibrated_indicator(self) -> bool:
        """Whether a calibration's indicator replaces this scorer's pooling (see the class doc)."""
        return self.indicator_from == "auto" and (self.pooling, self.kernel) == ("avg", 5)

    def _by_row(self, x: torch.Tensor, pool) -> torch.Tensor:
        """``pool(x, pooling, kernel)``, each batch row (dim 0) with its own indicator where they differ."""
        rows = self.rows
        if not rows:
            return pool(x, self.pooling, self.kernel)
        if len(rows) != x.shape[0]:
            raise RuntimeError(
                f"CAKE scorer holds indicators for {len(rows)} rows, the batch has {x.shape[0]}: the cache's "
                "rows were changed without it (report this with the calls that changed them)"
            )
        pooled = {ind: pool(x, *ind) for ind in dict.fromkeys(rows)}
        return torch.stack([pooled[ind][i] for i, ind in enumerate(rows)])

    def score_heads(self, inp: PrefillInputs) -> torch.Tensor:
        mean, var = inp.window_mean_var()
        w = inp.window_attention()[0].shape[2]
        return self._by_row(mean + self.gamma * var, lambda x, kind, k: _pool_prefix(x, w, k, kind))

    @property
    def order_sensitive(self) -> bool:
        return self.kernel > 1 or any(k > 1 for _, k in self.rows)

    def decode_heads(self, probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._by_row(probs.mean(2), lambda x, kind, k: pool1d(x, k, kind))

    def decode_step(self, probs, positions, previous):
        pooled = self._by_row(probs, lambda x, kind, k: pool_rows(x, k, kind))  # (B, H_kv, G, N)
        return pooled.mean(2) if self.reduce == "mean" else pooled.amax(2)


def _parse_rows(text: str) -> tuple[tuple[str, int], ...]:
    """``"max7/avg5"`` -> ``(("max", 7), ("avg", 5))``; ``""`` -> ``()`` (every row the scorer's own)."""
    if not text:
        return ()
    out = []
    for part in text.split("/"):
        match = re.fullmatch(r"(avg|max)(\d+)", part.strip())
        if match is None:
            raise ValueError(f"CAKE row_indicators is e.g. 'max7/avg5', one per batch row; got {text!r}")
        out.append((match[1], int(match[2])))
    return tuple(out)
