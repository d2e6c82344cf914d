"""The full-cache reference of one context group: what every method's cells compare with.

Per context the full cache (a transformers ``DynamicCache``) runs once: it gives the ``full``
baseline's answer, the greedy continuation the fidelity measures use, and (shared prefill) the
recorded queries every method's compressed cache is replayed from.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvcake.adapters import with_cache
from kvcake.attention import enable
from kvcake.eval.questions import ContextGroup, Question
from kvcake.replay import Captured, TeacherForced, capture_queries, greedy_tokens, teacher_force


@dataclass
class QuestionRef:
    question: Question
    cache: DynamicCache  # context + question, full
    captured: Captured | None  # queries of the context and the question (two chunks)
    logits: torch.Tensor  # (1, vocab) of the question's last token
    tokens: torch.Tensor  # (g,) the full cache's greedy continuation
    prefill_s: float
    generate_s: float
    tf: dict[str, TeacherForced] = field(default_factory=dict)  # scenario -> full teacher forcing


@dataclass
class GroupRef:
    cache: DynamicCache  # context only, full
    captured: Captured | None
    logits: torch.Tensor  # (1, vocab) of the context's last token
    prefill_s: float
    questions: list[QuestionRef]


def _ones(n: int, device) -> torch.Tensor:
    return torch.ones(1, n, dtype=torch.long, device=device)


def eos_ids(model) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def continue_greedy(
    model, cache, prefix: torch.Tensor, logits: torch.Tensor, max_new_tokens: int
) -> torch.Tensor:
    """Greedy tokens (n,) after a cache holding ``prefix`` (1, S) whose last logits are ``logits``.

    The first token is the argmax of ``logits``; the rest come from ``model.generate`` on the
    cache (consumed), which processes that token and decodes, stopping at EOS."""
    first = logits.argmax(-1, keepdim=True)  # (1, 1)
    if max_new_tokens <= 1 or int(first) in eos_ids(model):
        return first[0]
    ids = torch.cat([prefix, first], dim=1)
    with enable(model), torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **with_cache(model, cache),
                             max_new_tokens=max_new_tokens - 1, do_sample=False)  # fmt: skip
    return out[0, prefix.shape[1] :]


def answer_tokens(model, tokens: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The answer part of a greedy continuation: up to the first EOS (kept), at most ``max_new_tokens``."""
    eos = eos_ids(model)
    for i, t in enumerate(tokens[:max_new_tokens].tolist()):
        if t in eos:
            return tokens[: i + 1]
    return tokens[:max_new_tokens]


def full_reference(model, group: ContextGroup, shared: bool, fidelity: bool, fidelity_tokens: int,
                    scenarios: Sequence[str]) -> GroupRef:  # fmt: skip
    dev = model.device
    ctx_ids = group.context.to(dev)
    c = ctx_ids.shape[1]
    captured = Captured() if shared else None
    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    with capture_queries(model, captured) if shared else nullcontext(), torch.no_grad():
        out = model(ctx_ids, attention_mask=_ones(c, dev), **with_cache(model, cache), logits_to_keep=1)
    logits = out.logits[:, -1]  # (1, vocab)
    ref = GroupRef(cache, captured, logits, time.perf_counter() - t0, [])
    for q in group.questions:
        q_ids = q.ids.to(dev)
        full_ids = torch.cat([ctx_ids, q_ids], dim=1)
        q_cache = copy.deepcopy(cache)
        q_captured = captured.snapshot() if shared else None
        t0 = time.perf_counter()
        with capture_queries(model, q_captured) if shared else nullcontext(), torch.no_grad():
            out = model(
                q_ids,
                attention_mask=_ones(full_ids.shape[1], dev),
                **with_cache(model, q_cache),
                logits_to_keep=1,
            )
        q_logits = out.logits[:, -1]
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        n_gen = max(q.max_new_tokens, fidelity_tokens if fidelity else 0)
        tokens = greedy_tokens(model, copy.deepcopy(q_cache), full_ids.shape[1], q_logits, n_gen)
        qref = QuestionRef(q, q_cache, q_captured, q_logits, tokens, prefill_s, time.perf_counter() - t0)
        if fidelity:
            cont = tokens[:fidelity_tokens][None]  # (1, n)
            n = cont.shape[1]
            if "context" in scenarios:
                appended = torch.cat([q_ids, cont[:, :-1]], dim=1)
                qref.tf["context"] = teacher_force(model, copy.deepcopy(cache), c, logits, appended, n)
            if "question" in scenarios:
                qref.tf["question"] = teacher_force(
                    model, copy.deepcopy(q_cache), full_ids.shape[1], q_logits, cont[:, :-1], n
                )
        ref.questions.append(qref)
    return ref
