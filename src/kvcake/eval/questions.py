"""The inputs of an eval run: contexts and the questions asked about them.

A synthetic sample (``kvcake.eval.tasks``) is one context with one question; LongBench rows on the
same document share one :class:`ContextGroup`, so the context-only scenario compresses it once.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcake.eval.tasks import TASKS, make_samples
from kvcake.prompts import build_prompt

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "LONGBENCH_PREFIX", "ContextGroup", "Question", "groups_for"]

DEFAULT_MAX_NEW_TOKENS = {
    "niah_single": 12,
    "niah_multikey": 12,
    "niah_multivalue": 32,
    "niah_multiquery": 32,
    "variable_tracking": 32,
    "common_words": 48,
    "multi_needle_reasoning": 12,
}
"""Answer lengths by task when ``max_new_tokens`` is not given (long enough for every reference
answer with the default tokenizer; LongBench datasets use their official lengths)."""

NIAH_TASKS = frozenset(t for t in TASKS if t.startswith("niah_"))
LONGBENCH_PREFIX = "longbench:"


@dataclass
class Question:
    """One question about a context: ``ids`` (1, Q) follow the context's ids."""

    sample: int
    seed: int
    ids: torch.Tensor
    answers: list[str]
    score: Callable[[str], float]
    max_new_tokens: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class ContextGroup:
    """A context (1, C) and the questions asked about it (one for a synthetic sample)."""

    task: str
    length: int
    context: torch.Tensor
    questions: list[Question]


def task_options_for(task: str, needle_style: str, extra: dict[str, Any] | None) -> dict[str, Any]:
    opts = {"needle_style": needle_style} if task in NIAH_TASKS else {}
    opts.update((extra or {}).get(task, {}))
    return opts


def options_label(opts: dict[str, Any]) -> str:
    return ",".join(f"{k}={opts[k]}" for k in sorted(opts))


def _synthetic_groups(
    task: str, tokenizer: Any, samples: int, length: int, seed: int, haystack: Any, options: dict[str, Any],
    max_new_tokens: int | None,
) -> list[ContextGroup]:  # fmt: skip
    groups = []
    for i, s in enumerate(
        make_samples(task, tokenizer, samples, length, seed=seed, haystack=haystack, **options)
    ):
        p = build_prompt(
            tokenizer, s.context_prompt(), s.question_prompt(answer_prefix=False), s.answer_prefix
        )
        q = Question(
            sample=i, seed=s.seed, ids=p.question, answers=list(s.answers), score=s.score,
            max_new_tokens=DEFAULT_MAX_NEW_TOKENS.get(task, 32) if max_new_tokens is None else max_new_tokens,
            info={"depth": s.depth, "target_tokens": s.target_tokens},
        )  # fmt: skip
        groups.append(ContextGroup(task, length, p.context, [q]))
    return groups


def _longbench_groups(
    task: str, tokenizer: Any, samples: int, length: int, folder: str | os.PathLike[str] | None,
    max_new_tokens: int | None,
) -> list[ContextGroup]:  # fmt: skip
    from kvcake.eval.longbench import load_longbench, truncate_split
    from kvcake.eval.metrics import longbench_sample_score

    if folder is None:
        raise ValueError(
            f"task {task!r} needs the LongBench data folder: pass longbench_dir= (--longbench-dir)"
        )
    dataset = task[len(LONGBENCH_PREFIX) :]
    by_context: dict[str, ContextGroup] = {}
    for i, row in enumerate(load_longbench(folder, dataset, limit=samples)):
        ctx_text, q_text = truncate_split(tokenizer, row.context_prompt(), row.question_prompt(), length)
        p = build_prompt(tokenizer, ctx_text, q_text, "", chat=None if row.use_chat_template else False)

        def score(pred: str, row=row) -> float:
            return longbench_sample_score(row.dataset, pred, row.answers, row.all_classes)

        q = Question(
            sample=i, seed=i, ids=p.question, answers=list(row.answers), score=score,
            max_new_tokens=row.max_new_tokens if max_new_tokens is None else max_new_tokens, info={"id": row.id, "length_words": row.length},
        )  # fmt: skip
        key = hashlib.sha256(p.context.numpy().tobytes()).hexdigest()
        group = by_context.setdefault(key, ContextGroup(task, length, p.context, []))
        group.questions.append(q)
    return list(by_context.values())


def groups_for(task: str, tokenizer: Any, samples: int, length: int, seed: int, haystack: Any,
                options: dict[str, Any], max_new_tokens: int | None, longbench_dir) -> list[ContextGroup]:  # fmt: skip
    if task.startswith(LONGBENCH_PREFIX):
        return _longbench_groups(task, tokenizer, samples, length, longbench_dir, max_new_tokens)
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: valid tasks are {', '.join(TASKS)} or longbench:<dataset>")
    return _synthetic_groups(task, tokenizer, samples, length, seed, haystack, options, max_new_tokens)
