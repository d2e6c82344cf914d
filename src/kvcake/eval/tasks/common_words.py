"""RULER's common words extraction: name the most frequent words of a long list."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvcake.eval.tasks.needles import _clean, _start
from kvcake.eval.tasks.placement import _check_int, _fit
from kvcake.eval.tasks.sample import Sample, count_tokens
from kvcake.eval.tasks.vocab import KEY_ADJECTIVES, KEY_NOUNS, VALUE_WORDS
from kvcake.haystack import Haystack

# --------------------------------------------------------------------------------------------
# Common words extraction (RULER scripts/data/synthetic/common_words_extraction.py)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommonWordsConfig:
    """Options of RULER's common-words extraction (cwe).

    A numbered list where ``num_common`` words appear ``freq_common`` times each and the other
    words ``freq_uncommon`` times; the model must name the common ones. ``None`` frequencies take
    RULER's values: 30 and 3, or 6 and 1 below 4096 tokens. The length is fitted by the number of
    list entries (the last uncommon word may appear fewer times). Words come from the haystack's
    vocabulary (RULER: an English word list), topped up with made-up syllable words if it is
    small (the noise haystack), together with the built-in word lists; no filler text is inserted.
    """

    num_common: int = 10
    freq_common: int | None = None
    freq_uncommon: int | None = None

    def __post_init__(self) -> None:
        _check_int("num_common", self.num_common, 1)
        for name in ("freq_common", "freq_uncommon"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        if None not in (self.freq_common, self.freq_uncommon) and self.freq_common <= self.freq_uncommon:
            raise ValueError(
                f"freq_common ({self.freq_common}) must exceed freq_uncommon ({self.freq_uncommon})"
            )


_CWE_PREAMBLE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
_CWE_QUESTION = "\nQuestion: What are the {n} most common words in the above list?"
_CWE_PREFIX = " Answer: The top {n} words that appear most often in the list are:"
_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"


class _WordSource:
    """Distinct words for the list, drawn on demand: the haystack's words and the built-in
    vocabularies in random order, then made-up syllable words once those run out."""

    def __init__(self, rng: random.Random, hay: Haystack, banned: Sequence[str]) -> None:
        builtin = (w.lower() for w in (*VALUE_WORDS, *KEY_ADJECTIVES, *KEY_NOUNS))
        pool = sorted({w for w in (*hay.vocabulary, *builtin) if 3 <= len(w) <= 12})
        rng.shuffle(pool)
        self._pool, self._rng, self._banned = pool, rng, banned
        self._seen: set[str] = set()
        self._gen = self._candidates()
        self.common: list[str] = []

    def _candidates(self) -> Iterator[str]:
        yield from self._pool
        while True:
            yield "".join(self._rng.choice(_CONSONANTS) + self._rng.choice(_VOWELS) for _ in range(3))

    def take(self, n: int, common: bool) -> list[str]:
        out: list[str] = []
        for w in self._gen:
            if w in self._seen or not _clean(w, self._banned):
                continue
            if any(w in c or c in w for c in self.common):
                continue
            self._seen.add(w)
            out.append(w)
            if common:
                self.common.append(w)
            if len(out) == n:
                return out
        return out


def common_words(
    tokenizer: Any, target_tokens: int, seed: int, haystack: Any = "paul_graham", **kw: Any
) -> Sample:
    """RULER cwe: name the most frequent words of a long numbered list. Options: :class:`CommonWordsConfig`."""
    task = "common_words"
    cfg, draw = _start(task, CommonWordsConfig, tokenizer, target_tokens, seed, haystack, kw)
    hay, rng = draw.haystack, draw.rng
    f_c = cfg.freq_common or (30 if target_tokens >= 4096 else 6)
    f_u = cfg.freq_uncommon or (3 if target_tokens >= 4096 else 1)
    if f_c <= f_u:
        raise ValueError(f"freq_common ({f_c}) must exceed freq_uncommon ({f_u})")
    n = cfg.num_common
    preamble, question, prefix = _CWE_PREAMBLE, _CWE_QUESTION.format(n=n), _CWE_PREFIX.format(n=n)
    source = _WordSource(rng, hay, (preamble, question, prefix))
    common = source.take(n, common=True)
    uncommon: list[str] = []
    shuffle_seed = rng.getrandbits(64)
    built: dict[int, str] = {}

    def words_for(entries: int) -> list[str]:
        rest = entries - n * f_c
        need = -(-rest // f_u)
        if need > len(uncommon):
            uncommon.extend(source.take(need - len(uncommon), common=False))
        listed = common * f_c + [w for w in uncommon[:need] for _ in range(f_u)][:rest]
        random.Random(shuffle_seed).shuffle(listed)
        return listed

    def measure(entries: int) -> int:
        if entries not in built:
            built[entries] = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words_for(entries)))
        return count_tokens(tokenizer, preamble + built[entries] + question + prefix)

    entries, n_tokens = _fit(measure, target_tokens, n * f_c, f"task {task!r} (lower freq_common)")
    return Sample(
        task=task,
        context=built[entries],
        question=question,
        answers=list(common),
        depth=None,
        seed=seed,
        target_tokens=target_tokens,
        metadata={
            "freq_common": f_c,
            "freq_uncommon": f_u,
            "entries": entries,
            "haystack": hay.name,
            "prompt_tokens": n_tokens,
            "metric": "string_match_all",
            "config": dataclasses.asdict(cfg),
        },
        preamble=preamble,
        answer_prefix=prefix,
    )
