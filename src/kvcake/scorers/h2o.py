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
    """(B, H, S) column sums of the causal attention matrix, ``chunk`` rows at a time.

    A chunk of query rows reads only the keys before its last row (the causal columns); padding
    keys and the chunk's own upper triangle are masked with -inf, and the rows are summed
    by one matmul with the rows' validity (a padding row adds nothing; one that sees no key at
    all is 0, not NaN)."""
    k = _expand_kv(inp.keys.float(), inp.num_groups)  # (B, H, S, d)
    b, h, s, _ = k.shape
    dev = k.device
    total = torch.zeros(b, h, s, dtype=torch.float32, device=dev)
    padding = ~inp.key_valid[:, None, None, :]  # (B, 1, 1, S)
    rows = inp.key_valid.float()[:, None, None, :]  # (B, 1, 1, S)
    upper = torch.full((chunk, chunk), float("-inf"), device=dev).triu_(1)  # (c, c): later columns
    for start in range(0, s, chunk):
        stop = min(s, start + chunk)
        q = inp.query[:, :, start:stop].float()  # (B, H, c, d)
        logits = torch.matmul(q, k[:, :, :stop].transpose(-1, -2))  # (B, H, c, stop)
        logits.mul_(inp.scaling)[..., start:stop].add_(upper[: stop - start, : stop - start])
        logits.masked_fill_(padding[..., :stop], float("-inf"))  # (whatever padding keys hold)
        probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
        total[..., :stop] += torch.matmul(rows[..., start:stop], probs).squeeze(2)  # (B, H, stop)
    return total
