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

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import numbers
import os
import random
import re
import string
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcake.eval.haystack import Haystack, resolve_haystack
from kvcake.eval.metrics import string_match_all

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# Vocabularies. Chosen so that no value word is a substring of another value, of a key word or
# of a common English word (checked against the Paul Graham essays), and, for the default
# SmolLM2 tokenizer, each value is a single token after a space.
# --------------------------------------------------------------------------------------------

VALUE_WORDS: tuple[str, ...] = tuple(
    """
    tiger zebra giraffe elephant monkey rabbit turtle dolphin whale shark penguin falcon parrot goose
    duck pigeon deer moose camel donkey horse pony chicken frog snake lizard spider butterfly squirrel
    beaver kangaroo panda rhino leopard gorilla crab lobster octopus salmon trout oyster bison buffalo
    alligator crocodile tortoise jellyfish mosquito orange yellow blue purple violet pink grey silver
    golden scarlet navy turquoise ivory lavender indigo olive London Berlin Madrid Vienna Prague Warsaw
    Dublin Lisbon Athens Oslo Stockholm Helsinki Moscow Cairo Nairobi Tokyo Beijing Shanghai Seoul Delhi
    Mumbai Manila Sydney Melbourne Toronto Chicago Boston Denver Dallas Houston Miami Seattle Atlanta
    Budapest Zurich Geneva Munich Hamburg Milan Naples Venice Florence Istanbul Dubai Singapore Havana
    Montreal Vancouver Phoenix Portland Detroit banana cherry grape lemon mango tomato potato carrot
    onion garlic pepper cabbage pumpkin anchor candle pillow blanket mirror ladder bucket kettle spoon
    fork knife bowl jacket helmet umbrella violin guitar piano trumpet drum flute castle tower garden
    mountain island desert valley canyon ocean volcano glacier meadow diamond pearl marble granite
    copper bronze rocket tractor canoe wagon lantern glove necklace crown sword kite balloon pencil
    envelope wallet clock carpet curtain broom shovel wrench
    """.split()
)
"""Needle values: concrete nouns, colours, animals and cities (187 words)."""

KEY_ADJECTIVES: tuple[str, ...] = tuple(
    """
    brave calm eager fancy gentle happy jolly kind lively proud quiet shiny silly swift witty bold
    bright clever cozy curly dizzy fuzzy grumpy hasty humble lucky mighty noble polite rapid rusty
    sleepy sneaky steady sunny tidy wise young ancient frozen hidden hollow velvet wooden
    """.split()
)
KEY_NOUNS: tuple[str, ...] = tuple(
    """
    puzzle ticket riddle button pocket whistle feather cookie muffin noodle pretzel waffle biscuit
    pebble ribbon saddle tunnel harbor market station temple palace garage attic cellar chapel
    lighthouse windmill fountain statue engine magnet robot wizard pirate knight baker farmer sailor
    tailor
    """.split()
)
"""Needle keys are ``"{adjective}-{noun}"``, as RULER's (wonderwords adjective-noun pairs)."""

NAMES: tuple[str, ...] = tuple(
    """
    Alice Bianca Carlos Daniel Elena Felix Hugo Irene Jonas Karen Maria Oscar Paula Quentin Rosa
    Samuel Tessa Victor Wendy Xavier Yusuf Zara Beatrice Dmitri Edgar Fiona Gustav Ivan Kofi Marco
    Nina Olga Pablo Sven Tomas Ursula Walter Yara Zoe Amara Boris Celine Dorian Esther Farid Gemma
    Hector Ingrid Joaquin Kenji Lucia Mateo Priya Rafael Sofia Valentin Willa Ximena Yosef Zelda
    """.split()
)
"""People in the multi-needle reasoning task."""

RULER_DEPTHS: tuple[int, ...] = tuple(round(100 * i / 39) for i in range(40))
"""RULER's depth grid, ``np.round(np.linspace(0, 100, 40))``, used by ``depth="random"``."""

KEY_TYPES = ("words", "numbers", "uuids")
VALUE_TYPES = ("words", "numbers", "uuids")

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


# --------------------------------------------------------------------------------------------
# Argument checks, depths, needle insertion and length fitting
# --------------------------------------------------------------------------------------------

Depth = float | Sequence[float] | str | None


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_one_depth(d: Any) -> float:
    if isinstance(d, bool) or not isinstance(d, numbers.Real):
        raise TypeError(f"depth must be a number in [0, 100], got {type(d).__name__}")
    if not math.isfinite(d) or not 0.0 <= d <= 100.0:
        raise ValueError(f"depth must be a percentage in [0, 100], got {d}")
    return float(d)


def _normalise_depth(depth: Any) -> float | tuple[float, ...] | str | None:
    if depth is None or depth == "random":
        return depth
    if isinstance(depth, str):
        raise ValueError(f"depth must be a number, a sequence of numbers, None or 'random', got {depth!r}")
    if isinstance(depth, Sequence):
        if not depth:
            raise ValueError("depth sequence is empty")
        return tuple(_check_one_depth(d) for d in depth)
    return _check_one_depth(depth)


def _depths(depth: float | tuple[float, ...] | str | None, n: int, rng: random.Random) -> list[float]:
    """One requested depth per needle, in placement order."""
    if depth is None:
        return [100.0 * (i + 1) / (n + 1) for i in range(n)]
    if depth == "random":
        grid = rng.sample(RULER_DEPTHS, n) if n <= len(RULER_DEPTHS) else rng.choices(RULER_DEPTHS, k=n)
        return [float(d) for d in grid]
    if isinstance(depth, tuple):
        if len(depth) != n:
            raise ValueError(
                f"got {len(depth)} depths for {n} needles: give one per needle, a number or None"
            )
        return list(depth)
    return [float(depth)] * n


_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")


def _insert(filler: str, needles: Sequence[str], depths: Sequence[float]) -> tuple[str, list[int]]:
    """Insert each needle at the sentence boundary nearest to its depth; return text and char offsets.

    Needles sharing a boundary keep their order. ``filler`` has single spaces (see haystack.py).
    """
    bounds = [0, *(m.end() for m in _SENTENCE_END.finditer(filler)), len(filler)]
    placed = []
    for i, d in enumerate(depths):
        want = d / 100.0 * len(filler)
        j = bisect.bisect_left(bounds, want)
        cands = bounds[max(j - 1, 0) : j + 1]
        placed.append((min(cands, key=lambda b: abs(b - want)), i))
    placed.sort()
    parts: list[str] = []
    offsets = [0] * len(needles)
    length = 0

    def add(text: str) -> int:
        nonlocal length
        if parts:
            length += 1  # the joining space
        start = length
        parts.append(text)
        length += len(text)
        return start

    cur = 0
    for b, i in placed:
        seg = filler[cur:b].strip()
        if seg:
            add(seg)
        offsets[i] = add(needles[i])
        cur = b
    seg = filler[cur:].strip()
    if seg:
        add(seg)
    return " ".join(parts), offsets


def _fit(measure: Callable[[int], int], target: int, lo: int, what: str) -> tuple[int, int]:
    """Largest ``n >= lo`` with ``measure(n) <= target`` (measure: prompt tokens for n filler units).

    Token counts grow with ``n`` up to tokenizer boundary effects; only measured values are
    accepted, so the result never exceeds ``target``.
    """
    base = measure(lo)
    if base > target:
        raise ValueError(
            f"target_tokens={target} is too small for {what}: the prompt has {base} tokens with the "
            "least filler; raise target_tokens"
        )
    best, best_count = lo, base
    probe = lo + 64
    count = measure(probe)
    if count > target:
        hi = probe
    else:
        best, best_count = probe, count
        per_unit = max((count - base) / 64, 1e-3)
        guess = lo + int((target - base) / per_unit)
        for trial in (int(guess * 0.99), int(guess * 1.01) + 2):
            if trial <= best:
                continue
            count = measure(trial)
            if count > target:
                hi = trial
                break
            best, best_count = trial, count
        else:
            hi = best + max(best - lo, 1)
            while (count := measure(hi)) <= target:
                if hi > lo + 4 * target + 256:  # every unit adds at least one token
                    raise RuntimeError(
                        f"the prompt of {what} does not grow with its filler: check the tokenizer"
                    )
                best, best_count = hi, count
                hi = best + max(best - lo, 1)
    while hi - best > 1:  # invariant: measure(best) <= target < measure(hi)
        mid = (best + hi) // 2
        count = measure(mid)
        if count <= target:
            best, best_count = mid, count
        else:
            hi = mid
    return best, best_count


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


def _build_with_needles(
    task: str,
    tokenizer: Any,
    target_tokens: int,
    seed: int,
    haystack: Haystack,
    rng: random.Random,
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
    """Fit filler words around ``needles`` to ``target_tokens`` and assemble the sample."""
    start = rng.randrange(haystack.num_documents)
    built: dict[int, tuple[str, list[int]]] = {}

    def measure(n: int) -> int:
        if n not in built:
            built[n] = _insert(" ".join(haystack.words(n, start)), needles, depths)
        return count_tokens(tokenizer, preamble + built[n][0] + question + answer_prefix)

    n_words, n_tokens = _fit(measure, target_tokens, 0, f"task {task!r}")
    context, offsets = built[n_words]
    metadata.update(
        needles=list(needles),
        needle_depths=list(depths),
        needle_positions=[100.0 * o / max(len(context), 1) for o in offsets],
        answer_needle=answer_needle,
        haystack=haystack.name,
        filler_words=n_words,
        prompt_tokens=n_tokens,
        metric="string_match_all",
    )
    logger.debug("%s seed=%d: %d filler words, %d/%d tokens", task, seed, n_words, n_tokens, target_tokens)
    return Sample(
        task=task,
        context=context,
        question=question,
        answers=answers,
        depth=depths[answer_needle],
        seed=seed,
        target_tokens=target_tokens,
        metadata=metadata,
        preamble=preamble,
        answer_prefix=answer_prefix,
    )


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


def _build_niah(
    task: str, cfg: NiahConfig, tokenizer: Any, target_tokens: int, seed: int, hay: Haystack
) -> Sample:
    rng = random.Random(f"{task}/{seed}")
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
        task,
        tokenizer,
        target_tokens,
        seed,
        hay,
        rng,
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
        _check_common(tokenizer, target_tokens, seed)
        cfg = NiahConfig(**{**defaults, **kw})
        return _build_niah(name, cfg, tokenizer, target_tokens, seed, resolve_haystack(haystack))

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
    _check_common(tokenizer, target_tokens, seed)
    cfg = VariableTrackingConfig(**kw)
    hay = resolve_haystack(haystack)
    task = "variable_tracking"
    rng = random.Random(f"{task}/{seed}")
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
        task,
        tokenizer,
        target_tokens,
        seed,
        hay,
        rng,
        needles=statements,
        depths=depths,
        answer_needle=statements.index(chains[0][0]),
        preamble=_VT_PREAMBLE,
        question=_VT_QUESTION.format(value=values[0]),
        answer_prefix=_VT_PREFIX.format(num_v=cfg.num_hops + 1, value=values[0]),
        answers=answers,
        metadata={"chains": chains, "config": dataclasses.asdict(cfg)},
    )


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
    _check_common(tokenizer, target_tokens, seed)
    cfg = CommonWordsConfig(**kw)
    hay = resolve_haystack(haystack)
    task = "common_words"
    rng = random.Random(f"{task}/{seed}")
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
    _check_common(tokenizer, target_tokens, seed)
    cfg = MultiNeedleReasoningConfig(**kw)
    hay = resolve_haystack(haystack)
    task = "multi_needle_reasoning"
    rng = random.Random(f"{task}/{seed}")
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
        task,
        tokenizer,
        target_tokens,
        seed,
        hay,
        rng,
        needles=needles,
        depths=depths,
        answer_needle=next(i for i, s in enumerate(needles) if eldest in s),
        preamble=_MNR_PREAMBLE,
        question=_MNR_QUESTION.format(person=last),
        answer_prefix=_MNR_PREFIX.format(person=last),
        answers=[eldest],
        metadata={"people": people, "config": dataclasses.asdict(cfg)},
    )


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
