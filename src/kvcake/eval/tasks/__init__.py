"""RULER- and NeedleBench-style synthetic tasks, built to a target length in the model's own tokens.

RULER (Hsieh et al., 2024, https://arxiv.org/abs/2404.06654; NVIDIA/RULER
``scripts/data/synthetic``) hides key-value "needles" in filler text and asks for the values
back; NeedleBench (Li et al., 2024, https://arxiv.org/abs/2407.11963; opencompass
``datasets/needlebench``) adds needles whose facts must be combined. The tasks here follow their
wording and layout, with these choices made for KV-cache compression studies on small models:

- **Needle values are words by default.** Small tokenizers spend one token per digit, so RULER's
  7-digit values are 7 tokens that eviction must all keep, and they are lost long before a word is.
  ``value_type="numbers"`` (or ``"uuids"``) restores RULER's values. Words come from
  :data:`VALUE_WORDS`; those that occur in the haystack are skipped, so a string match cannot come
  from copied filler.
- **Length is counted in the model's tokens and hit exactly.** RULER grows the filler by
  chunks and stops below a maximum; here a binary search over the number of filler words (entries
  for ``common_words``) finds the longest prompt that is at most ``target_tokens``, so the prompt
  lands within one word's tokens of the target. The count is of :meth:`Sample.prompt` with the
  default template and answer prefix, without special tokens or a chat template.
- **Depths are controlled.** ``depth`` is a percentage of the context: a number puts the needles
  there (together, in order), a sequence gives one depth per needle, ``None`` spreads them evenly
  (a single needle goes to 50), ``"random"`` draws them from RULER's 40-point grid. Needles go in at
  the sentence boundary nearest to the requested position.
- **Context and question stay apart.** :class:`Sample` keeps the long ``context`` and the
  ``question`` separate, so the context-only (question-agnostic) scenario can compress
  :meth:`Sample.context_prompt` alone and append :meth:`Sample.question_prompt` afterwards.

Generation is deterministic: every random choice comes from ``random.Random(f"{task}/{seed}")``.
RULER's few-shot examples (variable tracking, common words) are not added.
"""

import os
from collections.abc import Callable
from typing import Any

from kvcake.eval.tasks.common_words import CommonWordsConfig, common_words
from kvcake.eval.tasks.needles import _check_common
from kvcake.eval.tasks.niah import (
    NEEDLE_STYLES,
    NIAH_NEEDLE,
    RESTATED_NEEDLE,
    NiahConfig,
    niah_multikey,
    niah_multiquery,
    niah_multivalue,
    niah_single,
)
from kvcake.eval.tasks.placement import Depth, _check_int
from kvcake.eval.tasks.reasoning import MultiNeedleReasoningConfig, multi_needle_reasoning
from kvcake.eval.tasks.sample import DEFAULT_TEMPLATE, Sample, count_tokens, encode, split_template
from kvcake.eval.tasks.variable_tracking import VariableTrackingConfig, variable_tracking
from kvcake.eval.tasks.vocab import (
    KEY_ADJECTIVES,
    KEY_NOUNS,
    KEY_TYPES,
    NAMES,
    RULER_DEPTHS,
    VALUE_TYPES,
    VALUE_WORDS,
)
from kvcake.haystack import Haystack, resolve_haystack

# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

TASKS: dict[str, Callable[..., Sample]] = {
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "niah_multiquery": niah_multiquery,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
    "multi_needle_reasoning": multi_needle_reasoning,
}
"""Task name -> builder ``(tokenizer, target_tokens, seed, haystack="paul_graham", **options) -> Sample``."""


def get_task(name: str) -> Callable[..., Sample]:
    """The builder registered as ``name``; ``ValueError`` listing the valid names otherwise."""
    try:
        return TASKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown task {name!r}: valid tasks are {', '.join(TASKS)}") from None


def make_samples(
    task: str,
    tokenizer: Any,
    n: int,
    target_tokens: int,
    seed: int = 0,
    haystack: str | os.PathLike[str] | Haystack = "paul_graham",
    **kw: Any,
) -> list[Sample]:
    """``n`` samples of ``task`` at ``target_tokens`` tokens, sample ``i`` built from seed ``seed + i``.

    Parameters
    ----------
    task:
        A name in :data:`TASKS`.
    tokenizer:
        The model's tokenizer; lengths are counted with ``tokenizer(text, add_special_tokens=False)``.
    n, target_tokens:
        Number of samples and prompt length in tokens (see the module docstring for what is counted).
    seed:
        Base seed; the output is a pure function of the arguments.
    haystack:
        ``"paul_graham"``, ``"noise"``, a text file or folder, or a :class:`Haystack`.
    **kw:
        Task options (fields of the task's config dataclass, e.g. ``depth=25``, ``value_type="numbers"``).
    """
    build = get_task(task)
    _check_int("n", n, 1)
    _check_common(tokenizer, target_tokens, seed)
    hay = resolve_haystack(haystack)
    return [build(tokenizer, target_tokens, seed + i, hay, **kw) for i in range(n)]


__all__ = [
    "DEFAULT_TEMPLATE",
    "KEY_ADJECTIVES",
    "KEY_NOUNS",
    "KEY_TYPES",
    "NAMES",
    "NEEDLE_STYLES",
    "NIAH_NEEDLE",
    "RESTATED_NEEDLE",
    "RULER_DEPTHS",
    "TASKS",
    "VALUE_TYPES",
    "VALUE_WORDS",
    "CommonWordsConfig",
    "Depth",
    "MultiNeedleReasoningConfig",
    "NiahConfig",
    "Sample",
    "VariableTrackingConfig",
    "common_words",
    "count_tokens",
    "encode",
    "get_task",
    "make_samples",
    "multi_needle_reasoning",
    "niah_multikey",
    "niah_multiquery",
    "niah_multivalue",
    "niah_single",
    "split_template",
    "variable_tracking",
]
