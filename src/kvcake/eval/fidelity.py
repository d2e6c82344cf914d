"""How far a compressed cache moves the model from the full cache, measured on the full cache's own text.

A small model fails many long-context tasks even with its full cache, so task scores alone say
little about a compression method there. These measures compare the compressed cache with the
full one on the *same* token ids, whether or not the answer is right:

1. the full cache (a transformers ``DynamicCache``) greedily continues the prompt for ``N``
   tokens (``c_1 .. c_N``; not stopped at EOS, so every sample is measured on ``N`` tokens: the
   answer and whatever the model writes after it);
2. both caches are teacher-forced on the tokens that follow their prefix: in the context-only
   scenario the prefix is the context and the appended tokens are ``question + c_1..c_{N-1}``; in
   the question-aware scenario the prefix is context + question and the appended tokens are
   ``c_1..c_{N-1}``. The prediction of ``c_1`` comes from the prefix's last logits;
3. from the two runs:

   - ``kl``: mean over the ``N`` continuation positions of ``KL(p_full || p_compressed)`` of the
     next-token distributions (nats);
   - ``nll`` / ``nll_full``: mean negative log-likelihood (nats per token) of ``c_1..c_N`` under
     the compressed and the full cache;
   - ``attn_rel_l1``: per layer, ``||o_c - o_f||_1 / ||o_f||_1`` of the attention output (after
     the output projection) over the appended positions: the output perturbation the CriticalKV
     paper (Feng et al., 2025, https://arxiv.org/abs/2502.03805) bounds; and its mean over layers;
   - ``hidden_rel_l1``: the same ratio for the final hidden state (``output_hidden_states``' last
     element, after the final norm).

   In the question-aware scenario the prefill itself runs on full keys and values, so its last
   logits equal the full cache's: the first KL term is 0 and the perturbations cover ``N - 1``
   positions (``None`` when ``N == 1``).

With a budget that covers the whole prompt every measure is 0 up to float error: the compressed
cache then keeps everything (exactly 0 with the stock kernel; ~1e-7 for methods that evict while
decoding, whose later steps attend through kvcake's own kernel).

The shared prefill the runner uses (record one full-cache forward, replay it into each method's
cache) lives in :mod:`kvcake.replay`, below both this module and CAKE calibration; its names are
re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcake.replay import (
    Captured,
    ScoreMemo,
    TeacherForced,
    attention_modules,
    attention_outputs,
    cache_bytes,
    capture_queries,
    kl_per_token,
    perturbation,
    rel_l1,
    replay_compress,
    teacher_force,
)

__all__ = [
    "Captured",
    "Fidelity",
    "ScoreMemo",
    "TeacherForced",
    "attention_modules",
    "attention_outputs",
    "capture_queries",
    "compare",
    "replay_compress",
    "teacher_force",
    "cache_bytes",
]


@dataclass(frozen=True)
class Fidelity:
    """Measures of one compressed run against the full cache (see the module docstring).

    ``kl`` nats per token; ``nll``/``nll_full`` nats per token; ``attn_rel_l1_layers`` one value
    per layer (empty when nothing was appended); ``tokens`` the continuation's length ``N``."""

    kl: float
    nll: float
    nll_full: float
    attn_rel_l1: float | None
    attn_rel_l1_layers: list[float]
    hidden_rel_l1: float | None
    tokens: int

    def as_record(self) -> dict[str, object]:
        return {
            "kl": self.kl,
            "nll": self.nll,
            "nll_full": self.nll_full,
            "attn_rel_l1": self.attn_rel_l1,
            "attn_rel_l1_layers": [float(f"{x:.4g}") for x in self.attn_rel_l1_layers],
            "hidden_rel_l1": self.hidden_rel_l1,
            "fidelity_tokens": self.tokens,
        }

    @classmethod
    def identical(cls, nll_full: float, layers: int, tokens: int, appended: bool) -> Fidelity:
        """The full cache compared with itself."""
        return cls(0.0, nll_full, nll_full, 0.0 if appended else None, [0.0] * layers if appended else [],
                   0.0 if appended else None, tokens)  # fmt: skip


def compare(full: TeacherForced, compressed: TeacherForced, continuation: torch.Tensor) -> Fidelity:
    """The measures of ``compressed`` against ``full``; ``continuation`` (n,) the full cache's tokens."""
    n = continuation.numel()
    if full.logprobs.shape[0] != n or compressed.logprobs.shape[0] != n:
        raise ValueError(
            f"expected {n} predictions, got {full.logprobs.shape[0]} and {compressed.logprobs.shape[0]}"
        )
    idx = continuation.reshape(n, 1).to(full.logprobs.device)
    nll = -compressed.logprobs.gather(1, idx).mean()
    nll_full = -full.logprobs.gather(1, idx).mean()
    layers, attn = perturbation(compressed.attn, full.attn)
    hidden = None
    if full.hidden is not None and compressed.hidden is not None:
        hidden = rel_l1(compressed.hidden, full.hidden)
    return Fidelity(
        kl=kl_per_token(full.logprobs, compressed.logprobs),
        nll=float(nll),
        nll_full=float(nll_full),
        attn_rel_l1=attn,
        attn_rel_l1_layers=layers,
        hidden_rel_l1=hidden,
        tokens=n,
    )
