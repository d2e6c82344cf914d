"""RULER's variable tracking: follow chains of variable assignments."""

from __future__ import annotations

import dataclasses
import string
from dataclasses import dataclass
from typing import Any

from kvcake.eval.tasks.needles import _build_with_needles, _clean, _draw_random, _draw_words, _start
from kvcake.eval.tasks.placement import Depth, _check_int, _depths, _normalise_depth
from kvcake.eval.tasks.sample import Sample
from kvcake.eval.tasks.vocab import VALUE_WORDS

# --------------------------------------------------------------------------------------------
# Variable tracking (RULER scripts/data/synthetic/variable_tracking.py)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VariableTrackingConfig:
    """Options of RULER's variable tracking: ``num_chains`` chains of ``num_hops`` assignments.

    Each chain is ``VAR A = value. VAR B = VAR A. ...``; the question gives the first chain's value
    and asks for all its variables (``num_hops + 1`` answers). Values are words by default
    (RULER: 5-digit numbers, ``value_type="numbers"``). Chains are interleaved at random, keeping
    each chain's order; the statements go in at the sorted ``depth`` values.
    """

    num_chains: int = 1
    num_hops: int = 4
    value_type: str = "words"
    depth: Depth = None

    def __post_init__(self) -> None:
        _check_int("num_chains", self.num_chains, 1)
        _check_int("num_hops", self.num_hops, 1)
        if self.value_type not in ("words", "numbers"):
            raise ValueError(f"value_type must be 'words' or 'numbers', got {self.value_type!r}")
        object.__setattr__(self, "depth", _normalise_depth(self.depth))


_VT_PREAMBLE = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
_VT_QUESTION = "\nQuestion: Find all variables that are assigned the value {value} in the text above."
_VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assigned the value {value}, they are: "
)


def variable_tracking(
    tokenizer: Any, target_tokens: int, seed: int, haystack: Any = "paul_graham", **kw: Any
) -> Sample:
    """RULER vt: follow a chain of variable assignments. Options: :class:`VariableTrackingConfig`."""
    task = "variable_tracking"
    cfg, draw = _start(task, VariableTrackingConfig, tokenizer, target_tokens, seed, haystack, kw)
    hay, rng = draw.haystack, draw.rng
    n_vars = cfg.num_chains * (cfg.num_hops + 1)
    fixed = (_VT_PREAMBLE, _VT_QUESTION, _VT_PREFIX)
    names: list[str] = []
    while len(names) < n_vars:  # RULER: 5 random upper-case letters, distinct
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names and name.lower() not in hay.vocabulary and _clean(name, fixed):
            names.append(name)
    if cfg.value_type == "words":
        values = _draw_words(rng, VALUE_WORDS, cfg.num_chains, hay, fixed, "value words")
    else:
        values = _draw_random(rng, "numbers", cfg.num_chains, 5, set())
    chains = []
    for c in range(cfg.num_chains):
        vs = names[c * (cfg.num_hops + 1) : (c + 1) * (cfg.num_hops + 1)]
        chains.append(
            [f"VAR {vs[0]} = {values[c]}."] + [f"VAR {vs[j + 1]} = VAR {vs[j]}." for j in range(cfg.num_hops)]
        )
    order = [c for c in range(cfg.num_chains) for _ in chains[c]]
    rng.shuffle(order)  # random interleaving that keeps each chain's order
    pos = [0] * cfg.num_chains
    statements = []
    for c in order:
        statements.append(chains[c][pos[c]])
        pos[c] += 1
    depths = sorted(_depths(cfg.depth, len(statements), rng))
    answers = names[: cfg.num_hops + 1]
    return _build_with_needles(
        draw,
        needles=statements,
        depths=depths,
        answer_needle=statements.index(chains[0][0]),
        preamble=_VT_PREAMBLE,
        question=_VT_QUESTION.format(value=values[0]),
        answer_prefix=_VT_PREFIX.format(num_v=cfg.num_hops + 1, value=values[0]),
        answers=answers,
        metadata={"chains": chains, "config": dataclasses.asdict(cfg)},
    )
