"""StreamingLLM: Xiao et al., "Efficient Streaming Language Models with Attention Sinks",
ICLR 2024, https://arxiv.org/abs/2309.17453."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..budget import check_int
from .base import PrefillInputs, Scorer


@dataclass(frozen=True)
class StreamingScorer(Scorer):
    """Keep the first ``n_sink`` tokens (the attention sinks, 4 in the paper) and the most
    recent ones: the score is the position itself, the sinks +inf. Needs no attention."""

    n_sink: int = 4
    name = "streamingllm"
    needs_probs = False

    def __post_init__(self) -> None:
        check_int("StreamingLLM n_sink", self.n_sink, 0, "score.n_sink=4")

    def score_heads(self, inp: PrefillInputs) -> torch.Tensor:
        b, h, s, _ = inp.query.shape
        rank = inp.key_valid.long().cumsum(-1) - 1  # index among the valid tokens (B, S)
        score = torch.where(rank < self.n_sink, torch.full_like(rank, 1 << 40), rank).float()
        return score[:, None, :].expand(b, h, s)

    def decode_heads(self, probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        groups = probs.shape[1] // positions.shape[1]
        pos = positions.float()  # (B, H_kv, N)
        valid = positions >= 0
        k = min(self.n_sink, pos.shape[-1])
        if k > 0:  # the first n_sink kept positions are the sinks
            first = torch.sort(torch.where(valid, pos, torch.full_like(pos, float("inf"))), dim=-1).values
            sink = valid & (pos <= first[..., k - 1 : k])
            pos = torch.where(sink, torch.full_like(pos, float(1 << 40)), pos)
        return pos.repeat_interleave(groups, dim=1)

    def oldest_victim(self, window: int) -> tuple[int, int]:
        # the oldest entry after the sinks, where one is left outside the window
        return self.n_sink + 1, self.n_sink + window

    def decode_step(self, probs, positions, previous):
        pos = positions.float()  # (B, H_kv, N)
        k = min(self.n_sink, positions.shape[-1])
        if k == 0:
            return pos
        kept = positions.masked_fill(positions < 0, 1 << 62)  # empty slots after every position
        last_sink = kept.kthvalue(k, -1, keepdim=True).values  # (B, H_kv, 1) the k-th kept position
        return pos.masked_fill(kept <= last_sink, float(1 << 40))
