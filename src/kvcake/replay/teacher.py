"""Teacher-force tokens after a cache, keeping what the fidelity measures compare."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcake.attention import enable

from .capture import attention_outputs

__all__ = ["TeacherForced", "rel_l1", "teacher_force"]


@dataclass
class TeacherForced:
    """One run's view of the continuation.

    ``logprobs``: (n, vocab) float64 log-probabilities of the ``n`` continuation predictions;
    ``attn``: per layer (a, hidden) attention outputs of the ``a`` appended tokens;
    ``hidden``: (a, hidden) final hidden states of the appended tokens (``a`` may be 0)."""

    logprobs: torch.Tensor
    attn: list[torch.Tensor]
    hidden: torch.Tensor | None


def rel_l1(compressed: torch.Tensor, full: torch.Tensor) -> float:
    """``||compressed - full||_1 / ||full||_1`` in float64: how far a compressed run's outputs
    (attention outputs, hidden states) are from the full cache's."""
    num = (compressed.double() - full.double()).abs().sum()
    den = full.double().abs().sum().clamp_min(1e-30)
    return float(num / den)


def teacher_force(
    model: torch.nn.Module,
    cache,
    prefix_len: int,
    prefix_logits: torch.Tensor,
    appended: torch.Tensor,
    n_predictions: int,
) -> TeacherForced:
    """Teacher-force ``appended`` (1, a) after a cache holding ``prefix_len`` tokens.

    ``cache`` is consumed (pass a fork). ``prefix_logits`` (1, vocab) are the logits of the prefix's
    last token. The last ``n_predictions`` of the ``1 + a`` next-token predictions are kept: the
    continuation's."""
    preds = [prefix_logits.float()]
    attn: list[torch.Tensor] = []
    hidden = None
    if appended.shape[1] > 0:
        mask = torch.ones(1, prefix_len + appended.shape[1], dtype=torch.long, device=appended.device)
        with attention_outputs(model) as outputs, enable(model), torch.no_grad():
            out = model(appended, attention_mask=mask, past_key_values=cache, output_hidden_states=True)
        preds.append(out.logits[0].float())
        attn = [outputs[i][0] for i in sorted(outputs)]
        hidden = out.hidden_states[-1][0]
    logits = torch.cat([p.reshape(-1, p.shape[-1]) for p in preds])[-n_predictions:]
    return TeacherForced(torch.log_softmax(logits.double(), dim=-1), attn, hidden)
