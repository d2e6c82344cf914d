"""A task instance (:class:`Sample`), its prompt template, and token counting."""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Any

from kvcake.eval.metrics import string_match_all

# --------------------------------------------------------------------------------------------
# Tokens
# --------------------------------------------------------------------------------------------


def encode(tokenizer: Any, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text``: ``tokenizer(text, ...)["input_ids"]``, or ``tokenizer.encode`` if not callable."""
    if callable(tokenizer):
        ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    elif hasattr(tokenizer, "encode"):
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    else:
        raise TypeError(f"tokenizer must be callable or have .encode, got {type(tokenizer).__name__}")
    return list(ids)


def count_tokens(tokenizer: Any, text: str) -> int:
    """Number of tokens of ``text`` without special tokens."""
    return len(encode(tokenizer, text))


# --------------------------------------------------------------------------------------------
# Samples and templates
# --------------------------------------------------------------------------------------------

DEFAULT_TEMPLATE = "{preamble}{context}{question}"
"""RULER's layout: the instruction, the long context, then the question (separators live in the
sample's ``preamble`` and ``question``). Fields: ``{preamble}``, ``{context}``, ``{question}``."""

_TEMPLATE_FIELDS = frozenset({"preamble", "context", "question"})


def split_template(template: str) -> tuple[str, str]:
    """Split ``template`` just after ``{context}``: (part holding the context, part after it).

    The first part is what the context-only scenario compresses; the second is appended later.
    """
    if not isinstance(template, str):
        raise TypeError(f"template must be a str, got {type(template).__name__}")
    fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    unknown = sorted(set(fields) - _TEMPLATE_FIELDS)
    if unknown or fields.count("context") != 1:
        raise ValueError(
            f"template must contain {{context}} exactly once and only the fields {sorted(_TEMPLATE_FIELDS)}; "
            f"got fields {fields}"
        )
    cut = template.index("{context}") + len("{context}")
    return template[:cut], template[cut:]


@dataclass(frozen=True)
class Sample:
    """One task instance.

    Parameters
    ----------
    task:
        Task name, a key of :data:`TASKS`.
    context:
        The long text: filler with the needles inserted (for ``common_words``, the word list).
    question:
        The query, with its leading separator (RULER puts a newline between context and question).
    answers:
        Reference strings; RULER's ``string_match_all`` scores the fraction found in the output.
    depth:
        Requested depth (percent of the context) of the first needle that carries an answer;
        ``None`` for tasks without needles.
    seed, target_tokens:
        What the sample was built from; the same pair (and tokenizer, haystack, options) rebuilds it.
    metadata:
        Needles, their requested and realised depths, token count, filler size, options.
    preamble:
        Instruction placed before the context (RULER: "Some special magic words are hidden ...").
    answer_prefix:
        Start of the answer, appended after the question so that small models answer in format
        (RULER's ``answer_prefix``). For a chat model put it at the start of the assistant turn.
    """

    task: str
    context: str
    question: str
    answers: list[str]
    depth: float | None
    seed: int
    target_tokens: int
    metadata: dict[str, Any] = field(default_factory=dict)
    preamble: str = ""
    answer_prefix: str = ""

    def _fields(self) -> dict[str, str]:
        return {"preamble": self.preamble, "context": self.context, "question": self.question}

    def context_prompt(self, template: str = DEFAULT_TEMPLATE) -> str:
        """The part of the prompt up to and including the context (compressed in context-only mode)."""
        return split_template(template)[0].format(**self._fields())

    def question_prompt(self, template: str = DEFAULT_TEMPLATE, *, answer_prefix: bool = True) -> str:
        """The part after the context, plus the answer prefix unless ``answer_prefix=False``."""
        tail = split_template(template)[1].format(**self._fields())
        return tail + self.answer_prefix if answer_prefix else tail

    def prompt(self, template: str = DEFAULT_TEMPLATE, *, answer_prefix: bool = True) -> str:
        """Full question-aware prompt: ``context_prompt(template) + question_prompt(template)``."""
        return self.context_prompt(template) + self.question_prompt(template, answer_prefix=answer_prefix)

    def score(self, prediction: str) -> float:
        """RULER's per-sample ``string_match_all``: fraction of answers found in ``prediction``."""
        return string_match_all(prediction, self.answers)
