"""TOVA: Oren et al., "Transformers are Multi-State RNNs", 2024, https://arxiv.org/abs/2401.06104."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import PrefillInputs, Scorer


@dataclass(frozen=True)
class TOVAScorer(Scorer):
    """Attention of the last query token only, averaged over all the layer's heads (TOVA keeps
    one set per layer); during decoding, the current token's attention."""

    reduce: str = "mean"
    name = "tova"
    layer_wide = True

    def score_heads(self, inp: PrefillInputs) -> torch.Tensor:
        probs, _ = inp.window_attention()
        last = probs[:, :, -1, :]  # (B, H, S)
        return last.mean(1, keepdim=True).expand_as(last)

    def decode_heads(self, probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cur = probs[:, :, -1, :]
        return cur.mean(1, keepdim=True).expand_as(cur)

    def decode_step(self, probs, positions, previous):
        b, hkv, g, n = probs.shape
        return probs.reshape(b, hkv * g, n).mean(1, keepdim=True)  # (B, 1, N): one set per layer
