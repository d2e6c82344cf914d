"""Needle-in-a-haystack tasks: single, multi-key, multi-value, multi-query (RULER ``niah``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcake.eval.tasks.needles import _build_with_needles, _Draw, _draw_random, _draw_words, _start
from kvcake.eval.tasks.placement import Depth, _check_int, _depths, _normalise_depth
from kvcake.eval.tasks.sample import Sample
from kvcake.eval.tasks.vocab import KEY_ADJECTIVES, KEY_NOUNS, KEY_TYPES, VALUE_TYPES, VALUE_WORDS

# --------------------------------------------------------------------------------------------
# NIAH: single, multi-key, multi-value, multi-query (RULER scripts/data/synthetic/niah.py)
# --------------------------------------------------------------------------------------------

NIAH_NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
# "restated": the fact said twice in one insertion, with the question's own wording. The
# default model (SmolLM2-135M) retrieves RULER's one-word needle in only 3-6 of 10 prompts with
# the FULL cache at 2k tokens; restated, 9 of 10 (measured: see the README's Limitations).
RESTATED_NEEDLE = (
    "The special magic {type_s} for {key} is {value}. Remember it: the {type_s} for {key} is {value}."
)
NEEDLE_STYLES = ("ruler", "restated")


@dataclass(frozen=True)
class NiahConfig:
    """Options of the needle-in-a-haystack tasks (RULER's ``niah`` arguments).

    Parameters
    ----------
    num_keys, num_values, num_queries:
        Needles for ``num_keys`` keys with ``num_values`` values each; ``num_queries`` of the keys
        are asked for (RULER ``num_needle_k/v/q``; at most ``num_keys``).
    key_type, value_type:
        ``"words"`` (default), ``"numbers"`` (``num_digits`` digits, RULER's default value) or
        ``"uuids"``.
    depth:
        See the module docstring: a number, one number per needle, ``None`` or ``"random"``.
    needle_style:
        ``"ruler"`` (RULER's wording) or ``"restated"`` (the fact stated twice and asked for in
        the same words, which small models retrieve far more reliably).
    """

    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1
    key_type: str = "words"
    value_type: str = "words"
    num_digits: int = 7
    depth: Depth = None
    needle_style: str = "ruler"

    def __post_init__(self) -> None:
        if self.needle_style not in NEEDLE_STYLES:
            raise ValueError(f"needle_style must be one of {NEEDLE_STYLES}, got {self.needle_style!r}")
        for name in ("num_keys", "num_values", "num_queries", "num_digits"):
            _check_int(name, getattr(self, name), 1)
        if self.num_queries > self.num_keys:
            raise ValueError(f"num_queries ({self.num_queries}) cannot exceed num_keys ({self.num_keys})")
        if self.key_type not in KEY_TYPES:
            raise ValueError(f"key_type must be one of {KEY_TYPES}, got {self.key_type!r}")
        if self.value_type not in VALUE_TYPES:
            raise ValueError(f"value_type must be one of {VALUE_TYPES}, got {self.value_type!r}")
        object.__setattr__(self, "depth", _normalise_depth(self.depth))


def _niah_texts(type_v: str, query: str, singular: bool, style: str = "ruler") -> tuple[str, str, str]:
    if singular and style == "restated":
        t = type_v[:-1]
        return (
            f"A special magic {t} is hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {t} afterwards.\n",
            f"\nWhat is the special magic {t} for {query}?",
            f" The special magic {t} for {query} is",
        )
    if singular:  # RULER's template edits: Some->A, are all->is, are->is, plural->singular
        t = type_v[:-1]
        return (
            f"A special magic {t} is hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {t} afterwards.\n",
            f"\nWhat is the special magic {t} for {query} mentioned in the provided text?",
            f" The special magic {t} for {query} mentioned in the provided text is",
        )
    return (
        f"Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
        f"I will quiz you about the {type_v} afterwards.\n",
        f"\nWhat are all the special magic {type_v} for {query} mentioned in the provided text?",
        f" The special magic {type_v} for {query} mentioned in the provided text are",
    )


def _build_niah(cfg: NiahConfig, draw: _Draw) -> Sample:
    hay, rng = draw.haystack, draw.rng
    k, v = cfg.num_keys, cfg.num_values
    taken: set[str] = set()
    if cfg.key_type == "words":
        pairs = rng.sample(range(len(KEY_ADJECTIVES) * len(KEY_NOUNS)), k)
        keys = [f"{KEY_ADJECTIVES[p // len(KEY_NOUNS)]}-{KEY_NOUNS[p % len(KEY_NOUNS)]}" for p in pairs]
    else:
        keys = _draw_random(rng, cfg.key_type, k, cfg.num_digits, taken)
    fixed = _niah_texts(cfg.value_type, "", False) + _niah_texts(cfg.value_type, "", True) + tuple(keys)
    if cfg.value_type == "words":
        flat = _draw_words(rng, VALUE_WORDS, k * v, hay, fixed, "value words")
    else:
        flat = _draw_random(rng, cfg.value_type, k * v, cfg.num_digits, taken)
    values = [flat[i * v : (i + 1) * v] for i in range(k)]
    template = NIAH_NEEDLE if cfg.needle_style == "ruler" else RESTATED_NEEDLE
    needles = [
        (template.format(type_v=cfg.value_type, type_s=cfg.value_type[:-1], key=keys[i], value=val), val)
        for i in range(k)
        for val in values[i]
    ]
    rng.shuffle(needles)
    asked = rng.sample(range(k), cfg.num_queries)
    queries = [keys[i] for i in asked]
    answers = [val for i in asked for val in values[i]]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    preamble, question, prefix = _niah_texts(
        cfg.value_type, query, cfg.num_queries * v == 1, cfg.needle_style
    )
    depths = _depths(cfg.depth, len(needles), rng)
    answer_needle = next(i for i, (_, val) in enumerate(needles) if val == answers[0])
    return _build_with_needles(
        draw,
        needles=[n for n, _ in needles],
        depths=depths,
        answer_needle=answer_needle,
        preamble=preamble,
        question=question,
        answer_prefix=prefix,
        answers=answers,
        metadata={"keys": keys, "values": values, "queries": queries, "config": dataclasses.asdict(cfg)},
    )


def _niah_task(name: str, doc: str, **defaults: Any) -> Callable[..., Sample]:
    def build(
        tokenizer: Any, target_tokens: int, seed: int, haystack: Any = "paul_graham", **kw: Any
    ) -> Sample:
        return _build_niah(
            *_start(name, NiahConfig, tokenizer, target_tokens, seed, haystack, {**defaults, **kw})
        )

    build.__name__ = build.__qualname__ = name
    build.__doc__ = (
        f"{doc}\n\nKeyword options are the fields of :class:`NiahConfig` (defaults {defaults or 'as there'})."
    )
    return build


niah_single = _niah_task("niah_single", "RULER niah_single: one needle, asked for by its key.")
niah_multikey = _niah_task(
    "niah_multikey", "RULER niah_multikey_1: four needles with different keys, one asked for.", num_keys=4
)
niah_multivalue = _niah_task(
    "niah_multivalue", "RULER niah_multivalue: four values for the same key, all asked for.", num_values=4
)
niah_multiquery = _niah_task(
    "niah_multiquery", "RULER niah_multiquery: four keys, all asked for at once.", num_keys=4, num_queries=4
)
