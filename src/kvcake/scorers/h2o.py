"""H2O: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", NeurIPS 2023, https://arxiv.org/abs/2306.14048."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import PrefillInputs, Scorer, _expand_kv


@dataclass(frozen=True)
class H2OScorer(Scorer):
    """Accumulated attention: the sum over all prompt queries of each key's causal attention.

    Computed in chunks of ``chunk`` query rows so no ``S x S`` matrix is held; while decoding,
    each new query's attention is added to the kept entries' sums (``stateful``).
    """

    chunk: int = 512
    reduce: str = "mean"
    name = "h2o"
    stateful = True

    def __post_init__(self) -> None:
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"H2O chunk must be a positive int, got {self.chunk!r}")

    def score_heads(self, inp: PrefillInputs) -> torch.Tensor:
        return accumulated_attention(inp, self.chunk)

    def decode_step(self, probs, positions, previous):
        scores = probs.mean(2) if self.reduce == "mean" else probs.amax(2)  # (B, H_kv, N)
        return scores if previous is None else scores + previous


def accumulated_attention(inp: PrefillInputs, chunk: int) -> torch.Tensor:
    """(B, H, S) column sums of the causal attention matrix, ``chunk`` rows at a time."""
    k = _expand_kv(inp.keys.float(), inp.num_groups)  # (B, H, S, d)
    b, h, s, _ = k.shape
    total = torch.zeros(b, h, s, dtype=torch.float32, device=k.device)
    cols = torch.arange(s, device=k.device)
    for start in range(0, s, chunk):
        stop = min(s, start + chunk)  # rows start..stop-1 see the keys before stop: no column past it
        q = inp.query[:, :, start:stop].float()  # (B, H, c, d)
        logits = torch.matmul(q, k[:, :, :stop].transpose(-1, -2)).mul_(inp.scaling)  # (B, H, c, stop)
        allowed = (cols[None, :stop] <= torch.arange(start, stop, device=k.device)[:, None])[None, None]
        allowed = allowed & inp.key_valid[:, None, None, :stop]
        row_valid = inp.key_valid[:, start:stop]  # (B, c)
        logits.masked_fill_(~allowed, float("-inf"))
        probs = torch.softmax(logits.masked_fill_(~allowed.any(-1, keepdim=True), 0.0), dim=-1)
        total[..., :stop] += probs.mul_(row_valid[:, None, :, None]).sum(2)
    return total
