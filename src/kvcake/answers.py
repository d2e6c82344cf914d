"""The text-level API: ``kvcake.answer`` (text in, text out; kvpress's pipeline's questions=).

A document compressed alone serves every question asked after it, and they are answered
together in batches, left-padded: ``CompressedContext.generate`` takes follow-ups of different
lengths (each row answered as alone: ``kvcake.sequences.settle_padding``; one length a batch for
the caches it refuses padding, ``CompressedContext.padding_refused``), and ``generate`` prompts of
different lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .api import compress, generate
from .budget import DEFAULT_METHOD
from .context import CompressedContext, check_positions
from .defaults import SCENARIOS
from .method import Method
from .prompts import build_prompt


def answer(
    model: torch.nn.Module,
    tokenizer,
    context: str,
    question: str | Sequence[str],
    method: Method | str | None = None,
    *,
    scenario: str = "context",
    budget: int | None = None,
    keep_ratio: float | None = None,
    ratio: float | None = None,
    window: int | None = None,
    chat: bool | None = None,
    answer_prefix: str = "",
    max_new_tokens: int = 64,
    kv_dtype: str | None = None,
    kv_recent: int | None = None,
    batch_size: int | None = None,
    **generate_kwargs,
) -> str | list[str]:
    """Answer ``question`` about ``context`` (plain text) with a compressed cache; returns the
    answer as text, or, for a list of questions, the list of their answers in order (kvpress's
    pipeline's ``questions=``): in the context scenario the document is compressed once and every
    question is asked after it; question-aware, each question is compressed with the document.

    The prompt is laid out as the ``kvcake`` command lays it out (:func:`kvcake.build_prompt`):
    with the tokenizer's chat template when it has one (``chat=None``), the document and the
    question form one user turn, ``<context>\n\n<question>``.

    Parameters
    ----------
    scenario:
        ``"context"`` (default): the document is compressed alone, then the question is asked
        after it, as when one document serves many questions (use :func:`compress` to keep it);
        ``"question"``: the question is compressed with the document (question-aware, easier).
    budget, keep_ratio:
        Entries kept per layer, or the fraction of the prompt kept (``ratio`` is its older
        name; kvpress's ``compression_ratio=0.2`` is ``keep_ratio=0.8``). Neither keeps
        ``kvcake.budget.DEFAULT_KEEP_RATIO[scenario]`` (0.5 of a document, 0.25 question-aware).
    window:
        The protected recent window, 32 where None; a :class:`Method` carries its own.
    method:
        A preset, a composed string, a :class:`Method`, or ``"full"`` (no compression); by
        default the scenario's recommendation, ``kvcake.budget.DEFAULT_METHOD`` (``layer-defensivekv``
        in both scenarios: README "Which method").
    answer_prefix:
        Text the answer starts with (kvpress's pipeline's ``answer_prefix``), put after the question
        (at the start of the assistant turn with a chat template); the returned answer is what
        the model writes after it.
    kv_dtype, kv_recent:
        ``"fp8"``: the kept entries in float8, the last ``kv_recent`` tokens' also in the model's
        dtype (:func:`generate`); None: the model's dtype.
    batch_size:
        Questions answered together, at most this many in one batch: after the document, any
        lengths, left-padded (each row holds its own copy of the compressed document while it
        decodes; one length a batch where the model's cache refuses padding: chunked attention,
        recurrent states, sliding windows under a flash kernel); question-aware, any lengths,
        left-padded, each row compressed as it would be alone; 1 answers one question at a time,
        and so does a ``streamer=`` (transformers' streamers take one sequence). None: 8, but 1
        question-aware on a CPU, where batching the long prefills saved nothing (SmolLM2, 2
        threads, 2130-token prompts: 4 questions 25.96 s batched against 24.21 s one at a time,
        8: 52.37 s against 44.62 s; ``scripts/answer_batches.py --scenario question``). A row's
        answer is the one it gets alone, up to the rounding of batched matrix products.
    generate_kwargs:
        Passed to ``model.generate`` (greedy unless ``do_sample=True``), but for ``compile=``,
        as ``kvcake.generate`` and ``CompressedContext.generate`` take it.
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be 'context' or 'question', got {scenario!r}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)):
        raise TypeError(f"batch_size= is how many questions are answered at once, an int: got {batch_size!r}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size= must be at least 1 (1: one question at a time), got {batch_size}")
    set_here = ("input_ids", "attention_mask", "inputs", "past_key_values", "cache")  # (answer's own)
    if own := [k for k in set_here if k in generate_kwargs]:
        raise TypeError(
            f"kvcake.answer builds the prompt and its cache itself and takes no {', '.join(own)}: pass the "
            "text as context= and question=, or use kvcake.generate / kvcake.compress for token ids"
        )
    if method is None:
        method = DEFAULT_METHOD[scenario]
    questions = _questions(question)
    if not isinstance(context, str) or not context.strip():
        raise ValueError(f"context= must be non-empty text, got {context!r}")
    if not isinstance(answer_prefix, str):
        raise TypeError(f"answer_prefix= must be text, got {type(answer_prefix).__name__}")
    prompts = [
        build_prompt(tokenizer, context.strip() + "\n\n", q.strip(), answer_prefix, chat) for q in questions
    ]
    device = next(model.parameters()).device
    generate_kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False, **generate_kwargs}
    generate_kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    for prompt in prompts:  # every question checked before any work
        check_positions(model, prompt.full.shape[1], generate_kwargs)
    sizes = {
        "budget": budget,
        "keep_ratio": keep_ratio,
        "ratio": ratio,
        "window": window,
        "kv_dtype": kv_dtype,
        "kv_recent": kv_recent,
    }
    answers: list[str] = [""] * len(prompts)
    contexts: dict[bytes, CompressedContext] = {}  # one per distinct context ids: the document's, once
    if batch_size is None:
        batch_size = 1 if scenario == "question" and device.type == "cpu" else 8
    size = 1 if generate_kwargs.get("streamer") is not None else batch_size
    documents = [p.context.numpy().tobytes() for p in prompts]  # (a chat template: the same before each)
    if scenario == "question":  # any lengths share a batch, left-padded, each prompt sized as alone
        keys = [None] * len(prompts)
    else:
        # the question appended to the document, compressed once: any lengths, left-padded, where
        # its cache takes padding; else one length a batch
        for doc, prompt in zip(documents, prompts, strict=True):
            if doc not in contexts:
                contexts[doc] = compress(model, prompt.context.to(device), method, **sizes)
        refused = {doc: ctx.padding_refused() is not None for doc, ctx in contexts.items()}
        keys = [
            p.question.shape[1] if refused[doc] else None for doc, p in zip(documents, prompts, strict=True)
        ]
    for key, group in _batches(documents, keys, size):
        if scenario == "question":  # each prompt compressed whole, a row of one batch
            ids, mask = _left_padded([prompts[i].full for i in group], generate_kwargs["pad_token_id"])
            out, _ = generate(model, ids.to(device), method, attention_mask=mask.to(device), **sizes,
                              **generate_kwargs)  # fmt: skip
            new = getattr(out, "sequences", out)[:, ids.shape[1] :]  # return_dict_in_generate=True
        else:
            ids, mask = _left_padded([prompts[i].question for i in group], generate_kwargs["pad_token_id"])
            new = contexts[key].generate(ids.to(device), attention_mask=mask.to(device), **generate_kwargs)
            new = getattr(new, "sequences", new)
        rows = new.shape[0] // len(group)  # each question's first row (beams, num_return_sequences)
        for j, i in enumerate(group):
            answers[i] = tokenizer.decode(new[j * rows], skip_special_tokens=True).strip()
    return answers[0] if isinstance(question, str) else answers


def _batches(documents: list[bytes], keys: list, size: int) -> list[tuple[bytes, list[int]]]:
    """(a document, indices of its questions): batches of at most ``size`` questions that share
    the document (each question's context ids as bytes) and their ``keys``, such groups in the
    order of their first questions, each cut in order."""
    groups: dict[tuple[bytes, object], list[int]] = {}
    for i, (doc, key) in enumerate(zip(documents, keys, strict=True)):
        groups.setdefault((doc, key), []).append(i)
    return [(key, g[k : k + size]) for (key, _), g in groups.items() for k in range(0, len(g), size)]


def _left_padded(rows: list[torch.Tensor], pad_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), each (B, longest): the (1, n) rows padded on the left with ``pad_id``
    (0 where the tokenizer has none: masked either way)."""
    width = max(r.shape[1] for r in rows)
    device = rows[0].device
    ids = torch.full((len(rows), width), 0 if pad_id is None else pad_id, dtype=rows[0].dtype, device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for j, r in enumerate(rows):
        ids[j, width - r.shape[1] :], mask[j, width - r.shape[1] :] = r[0], 1
    return ids, mask


def _questions(question: str | Sequence[str]) -> list[str]:
    """``answer``'s question, or its list of questions, checked: non-empty text each."""
    questions = [question] if isinstance(question, str) else question
    if not isinstance(questions, (list, tuple)) or not questions:
        raise ValueError(f"question= must be non-empty text or a non-empty list of it, got {question!r}")
    for text in questions:
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"question= must be non-empty text (or a list of it), got {text!r}")
    return list(questions)
