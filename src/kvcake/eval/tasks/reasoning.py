"""NeedleBench-style multi-needle reasoning over kinship facts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvcake.eval.tasks.needles import _build_with_needles, _draw_words, _start
from kvcake.eval.tasks.placement import Depth, _check_int, _depths, _normalise_depth
from kvcake.eval.tasks.sample import Sample
from kvcake.eval.tasks.vocab import NAMES

# --------------------------------------------------------------------------------------------
# Multi-needle reasoning (NeedleBench M-RS, with the kinship needles of its Ancestral Trace Challenge)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MultiNeedleReasoningConfig:
    """Options of the NeedleBench-style multi-needle reasoning task.

    ``num_needles`` kinship facts link ``num_needles + 1`` people in a chain ("Alice is Bruno's
    father.", in NeedleBench's Ancestral Trace Challenge wording); they are shuffled and hidden in
    the filler. The question asks for the eldest relative the last person can trace back to, so
    every needle must be found and the facts combined.
    """

    num_needles: int = 3
    depth: Depth = None

    def __post_init__(self) -> None:
        _check_int("num_needles", self.num_needles, 1)
        if self.num_needles + 1 > len(NAMES):
            raise ValueError(f"num_needles must be below {len(NAMES)}, got {self.num_needles}")
        object.__setattr__(self, "depth", _normalise_depth(self.depth))


_MNR_PREAMBLE = (  # NeedleBench multi.py, English, question at the end
    "You are an intelligent AI assistant skilled in answering user questions.\n"
    "Please keep your answers concise and clear. Do not talk about irrelevant topics or repeat your answers.\n"
    "The document given to you by the user is "
)
_MNR_QUESTION = (
    "\n\nNow, the question is: Based on the family relationships mentioned in the document, "
    "who is the eldest relative that {person} can trace back to?"
)
_MNR_PREFIX = " Answer: The eldest relative that {person} can trace back to is"
_RELATIONS = ("father", "mother", "dad", "mom", "grandfather", "grandmother")
_RELATION_TEMPLATES = ("{A} is {B}'s {relationship}.", "{B}'s {relationship} is {A}.")


def multi_needle_reasoning(
    tokenizer: Any, target_tokens: int, seed: int, haystack: Any = "paul_graham", **kw: Any
) -> Sample:
    """NeedleBench-style multi-needle reasoning. Options: :class:`MultiNeedleReasoningConfig`."""
    task = "multi_needle_reasoning"
    cfg, draw = _start(task, MultiNeedleReasoningConfig, tokenizer, target_tokens, seed, haystack, kw)
    hay, rng = draw.haystack, draw.rng
    fixed = (_MNR_PREAMBLE, _MNR_QUESTION, _MNR_PREFIX, *_RELATIONS, *_RELATION_TEMPLATES)
    people = _draw_words(rng, NAMES, cfg.num_needles + 1, hay, fixed, "names")
    needles = [
        rng.choice(_RELATION_TEMPLATES).format(
            A=people[i], B=people[i + 1], relationship=rng.choice(_RELATIONS)
        )
        for i in range(cfg.num_needles)
    ]
    rng.shuffle(needles)
    depths = _depths(cfg.depth, len(needles), rng)
    eldest, last = people[0], people[-1]
    return _build_with_needles(
        draw,
        needles=needles,
        depths=depths,
        answer_needle=next(i for i, s in enumerate(needles) if eldest in s),
        preamble=_MNR_PREAMBLE,
        question=_MNR_QUESTION.format(person=last),
        answer_prefix=_MNR_PREFIX.format(person=last),
        answers=[eldest],
        metadata={"people": people, "config": dataclasses.asdict(cfg)},
    )
