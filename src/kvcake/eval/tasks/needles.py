"""What every needle task shares: drawing needle words, the builders' common start, and
fitting filler around the needles into a :class:`Sample`."""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvcake.eval.tasks.placement import _check_int, _fit, _insert
from kvcake.eval.tasks.sample import Sample, count_tokens
from kvcake.haystack import Haystack, resolve_haystack

logger = logging.getLogger(__name__)


def _clean(word: str, texts: Sequence[str]) -> bool:
    low = word.lower()
    return not any(low in t.lower() for t in texts)


def _draw_words(
    rng: random.Random, pool: Sequence[str], n: int, haystack: Haystack, texts: Sequence[str], what: str
) -> list[str]:
    """``n`` distinct words from ``pool`` that do not occur in the haystack or in the task's texts."""
    usable = [w for w in pool if w.lower() not in haystack.vocabulary and _clean(w, texts)]
    if len(usable) < n:
        logger.warning(
            "only %d of %d %s are absent from haystack %r; drawing from all of them",
            len(usable),
            len(pool),
            what,
            haystack.name,
        )
        usable = [w for w in pool if _clean(w, texts)]
    if len(usable) < n:
        raise ValueError(f"asked for {n} distinct {what} but only {len(usable)} are available")
    return rng.sample(usable, n)


def _draw_random(rng: random.Random, kind: str, n: int, num_digits: int, taken: set[str]) -> list[str]:
    """``n`` distinct random numbers (``num_digits`` digits, as RULER) or UUIDs, avoiding ``taken``."""
    if kind == "numbers" and n + len(taken) > 9 * 10 ** (num_digits - 1):
        raise ValueError(f"cannot draw {n} distinct {num_digits}-digit numbers: raise num_digits")
    out: list[str] = []
    while len(out) < n:
        if kind == "numbers":
            s = str(rng.randint(10 ** (num_digits - 1), 10**num_digits - 1))
        else:
            s = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        if s not in taken:
            taken.add(s)
            out.append(s)
    return out


def _check_common(tokenizer: Any, target_tokens: Any, seed: Any) -> None:
    if tokenizer is None:
        raise TypeError("a tokenizer is required: lengths are counted in the model's own tokens")
    _check_int("target_tokens", target_tokens, 1)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")


@dataclass(frozen=True)
class _Draw:
    """One sample being built: its task, tokenizer, target length and seed, the resolved haystack
    and the task's seeded random generator."""

    task: str
    tokenizer: Any
    target_tokens: int
    seed: int
    haystack: Haystack
    rng: random.Random


def _start(
    task: str, config: Any, tokenizer: Any, target_tokens: Any, seed: Any, haystack: Any, options: dict
) -> tuple[Any, _Draw]:
    """The start of every builder: check the arguments, build the task's config from ``options``,
    resolve the haystack and seed the task's random generator."""
    _check_common(tokenizer, target_tokens, seed)
    cfg = config(**options)
    return cfg, _Draw(
        task, tokenizer, target_tokens, seed, resolve_haystack(haystack), random.Random(f"{task}/{seed}")
    )


def _build_with_needles(
    draw: _Draw,
    *,
    needles: Sequence[str],
    depths: Sequence[float],
    answer_needle: int,
    preamble: str,
    question: str,
    answer_prefix: str,
    answers: list[str],
    metadata: dict[str, Any],
) -> Sample:
    """Fit filler words around ``needles`` to ``draw.target_tokens`` and assemble the sample."""
    start = draw.rng.randrange(draw.haystack.num_documents)
    built: dict[int, tuple[str, list[int]]] = {}

    def measure(n: int) -> int:
        if n not in built:
            built[n] = _insert(" ".join(draw.haystack.words(n, start)), needles, depths)
        return count_tokens(draw.tokenizer, preamble + built[n][0] + question + answer_prefix)

    n_words, n_tokens = _fit(measure, draw.target_tokens, 0, f"task {draw.task!r}")
    context, offsets = built[n_words]
    metadata.update(
        needles=list(needles),
        needle_depths=list(depths),
        needle_positions=[100.0 * o / max(len(context), 1) for o in offsets],
        answer_needle=answer_needle,
        haystack=draw.haystack.name,
        filler_words=n_words,
        prompt_tokens=n_tokens,
        metric="string_match_all",
    )
    logger.debug(
        "%s seed=%d: %d filler words, %d/%d tokens",
        draw.task,
        draw.seed,
        n_words,
        n_tokens,
        draw.target_tokens,
    )
    return Sample(
        task=draw.task,
        context=context,
        question=question,
        answers=answers,
        depth=depths[answer_needle],
        seed=draw.seed,
        target_tokens=draw.target_tokens,
        metadata=metadata,
        preamble=preamble,
        answer_prefix=answer_prefix,
    )
