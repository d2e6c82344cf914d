"""Teacher-force tokens after a cache, keeping what the fidelity measures compare."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcake.adapters import with_cache
from kvcake.attention import enable

from .capture import attention_outputs

__all__ = [
    "TeacherForced",
    "forced",
    "greedy_tokens",
    "kl_per_token",
    "perturbation",
    "rel_l1",
    "teacher_force",
]


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


def kl_per_token(full_logprobs: torch.Tensor, logprobs: torch.Tensor) -> float:
    """Mean over the ``n`` positions of ``KL(full || compressed)`` of the next-token distributions
    (nats per token); both (n, vocab) log-probabilities, e.g. :attr:`TeacherForced.logprobs`."""
    p = full_logprobs.exp()
    return float((p * (full_logprobs - logprobs)).sum(-1).clamp_min(0.0).mean())


def perturbation(
    compressed: list[torch.Tensor], full: list[torch.Tensor]
) -> tuple[list[float], float | None]:
    """Attention-output perturbation: :func:`rel_l1` of each layer's outputs (one tensor per layer,
    e.g. :attr:`TeacherForced.attn`) and their mean over layers (``None`` for no layers)."""
    layers = [rel_l1(c, f) for c, f in zip(compressed, full, strict=True)]
    return layers, (sum(layers) / len(layers) if layers else None)


def teacher_force(
    model: torch.nn.Module,
    cache,
    prefix_len: int,
    prefix_logits: torch.Tensor,
    appended: torch.Tensor,
    n_predictions: int,
    stepwise: bool = False,
) -> TeacherForced:
    """Teacher-force ``appended`` (1, a) after a cache holding ``prefix_len`` tokens.

    ``cache`` is consumed (pass a fork). ``prefix_logits`` (1, vocab) are the logits of the prefix's
    last token. The last ``n_predictions`` of the ``1 + a`` next-token predictions are kept: the
    continuation's.

    ``stepwise=False`` feeds ``appended`` in one forward. ``True`` feeds it as ``generate`` does:
    the tokens before the continuation's (a question asked after a compressed context) in one
    forward, then the continuation's ``n_predictions - 1`` tokens one a forward. The logits are
    the same up to rounding for a cache that keeps what is appended (``decode=none``); a
    ``decode=fixed`` cache evicts back to its budget after each forward, so in one forward every
    prediction sees the entries that decoding would have evicted by then."""
    a = appended.shape[1]
    chunks = [appended]
    if stepwise:
        head = a - (n_predictions - 1)  # the continuation's tokens are the last n - 1
        chunks = ([appended[:, :head]] if head > 0 else []) + list(
            appended[:, max(head, 0) :].split(1, dim=1)
        )

    def one(ids: torch.Tensor, end: int):
        mask = torch.ones(1, prefix_len + end, dtype=torch.long, device=appended.device)
        with enable(model):
            return model(ids, attention_mask=mask, **with_cache(model, cache), output_hidden_states=True)

    def forward(ids: torch.Tensor):
        if len(chunks) == 1:
            return one(ids, a)
        outs, seen = [], 0
        for chunk in chunks:
            seen += chunk.shape[1]
            outs.append(one(chunk, seen))
        return _joined(outs)

    return forced(model, forward, prefix_logits, appended, n_predictions, several=len(chunks) > 1)


@dataclass
class _Joined:
    """Several forwards' outputs as one forward's: what :func:`forced` reads."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]


def _joined(outs: list) -> _Joined:
    return _Joined(
        torch.cat([o.logits for o in outs], dim=1), (torch.cat([o.hidden_states[-1] for o in outs], dim=1),)
    )


def forced(
    model: torch.nn.Module,
    forward,
    prefix_logits: torch.Tensor,
    appended: torch.Tensor,
    n_predictions: int,
    several: bool = False,
):
    """What :func:`teacher_force` keeps, for any way of feeding the cache: ``forward(appended)``
    runs ``model`` on the appended tokens after the prefix (positions, mask and attention are the
    caller's) with ``output_hidden_states=True``; ``several``: in several forwards, whose attention
    outputs are joined. The last ``n_predictions`` of the ``1 + a`` next-token predictions
    (``prefix_logits`` first) are kept."""
    preds = [prefix_logits.float()]
    attn: list[torch.Tensor] = []
    hidden = None
    if appended.shape[1] > 0:
        with attention_outputs(model, join=several) as outputs, torch.no_grad():
            out = forward(appended)
        preds.append(out.logits[0].float())
        attn = [outputs[i][0] for i in sorted(outputs)]
        hidden = out.hidden_states[-1][0]
    logits = torch.cat([p.reshape(-1, p.shape[-1]) for p in preds])[-n_predictions:]
    return TeacherForced(torch.log_softmax(logits.double(), dim=-1), attn, hidden)


def greedy_tokens(
    model: torch.nn.Module, cache, prefix_len: int, logits: torch.Tensor, n: int
) -> torch.Tensor:
    """Exactly ``n`` greedy tokens (n,) after a full cache holding ``prefix_len`` tokens whose last
    logits are ``logits`` (1, vocab), not stopping at EOS: the continuation the fidelity measures
    score (evaluation and calibration alike). ``cache`` is extended by ``n - 1`` tokens."""
    tokens = [logits.argmax(-1)]  # (1,) each
    with torch.no_grad():
        for i in range(1, n):
            mask = torch.ones(1, prefix_len + i, dtype=torch.long, device=logits.device)
            out = model(
                tokens[-1][:, None], attention_mask=mask, **with_cache(model, cache), logits_to_keep=1
            )
            tokens.append(out.logits[:, -1].argmax(-1))
    return torch.cat(tokens)
