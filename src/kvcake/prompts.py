"""Turning a context and a question into token ids, the same way for every caller.

The context and the question are tokenised separately and concatenated, so the question-aware
scenario (compress both) and the context-only one (compress the context, then append the
question) see exactly the same tokens. With a chat model the context opens the user turn and
the question closes it; an answer prefix, if any, starts the assistant turn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MARK = "\x00KVCAKE_SPLIT\x00"


@dataclass(frozen=True)
class PromptIds:
    """context: (1, C) ids compressed in every scenario; question: (1, Q) ids that follow."""

    context: torch.Tensor
    question: torch.Tensor

    @property
    def full(self) -> torch.Tensor:
        return torch.cat([self.context, self.question], dim=1)


def chat_frame(tokenizer) -> tuple[str, str] | None:
    """(text before, text after) a user turn's content in the tokenizer's chat template, with the
    assistant turn opened after it, as :func:`build_prompt` lays a chat prompt out; None for a
    tokenizer without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=True
    )
    head, tail = text.split(_MARK)
    return head, tail


def build_prompt(
    tokenizer, context: str, question: str, answer_prefix: str = "", chat: bool | None = None
) -> PromptIds:
    """Token ids of ``context`` + ``question`` (+ ``answer_prefix``), split after the context.

    ``chat=None`` uses the tokenizer's chat template when it has one."""
    if isinstance(tokenizer, torch.nn.Module):
        raise TypeError(f"the tokenizer is a model ({type(tokenizer).__name__}): give the model first, then its "
                        "tokenizer, kvcake.answer(model, tokenizer, ...)")  # fmt: skip
    if not (callable(tokenizer) and hasattr(tokenizer, "decode")):
        raise TypeError(f"a tokenizer turns the text into ids, got {type(tokenizer).__name__}: model, tokenizer = "
                        "kvcake.load_model(...) gives both (or AutoTokenizer.from_pretrained)")  # fmt: skip
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    elif not isinstance(chat, bool):  # bool("no") is True
        raise TypeError(
            f"chat must be None (the tokenizer's template when it has one), True or False, got {chat!r}"
        )
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": context + _MARK + question}],
            tokenize=False,
            add_generation_prompt=True,
        )
        head, tail = text.split(_MARK)
        tail += answer_prefix
    else:
        head, tail = context, question + answer_prefix
    ctx = tokenizer(head, add_special_tokens=not chat, return_tensors="pt")["input_ids"]
    q = tokenizer(tail, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return PromptIds(ctx, q)


def not_ids(value, name: str = "input_ids") -> str:
    """What is wrong with ``value`` where a (batch, length) tensor of token ids was expected, and
    the fix: text, a tokenizer's output, a list, a 1-D or a non-integer tensor each get their own."""
    head = f"{name} must be a (batch, length) tensor of token ids"
    if isinstance(value, str):
        return (f"{head}, got text: tokenize it (tokenizer(text, return_tensors='pt').input_ids, or "
                "tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors='pt')), "
                "or ask in text with kvcake.answer(model, tokenizer, context, question)")  # fmt: skip
    if hasattr(value, "keys") and "input_ids" in value.keys():  # a BatchEncoding or a dict
        return (f"{head}, got the tokenizer's output ({type(value).__name__}): unpack it, "
                "kvcake.generate(model, **enc) (or kvcake.compress(model, **enc)), which passes its attention_mask too")  # fmt: skip
    if isinstance(value, (list, tuple)):
        return f"{head}, got a {type(value).__name__}: torch.tensor([ids]) makes a batch of one"
    if isinstance(value, torch.Tensor) and not is_integer(value):
        return (
            f"{head}, got a {value.dtype} tensor: ids are integers (torch.long; ids.long() if these are ids)"
        )
    if isinstance(value, torch.Tensor) and value.dim() == 1:
        return f"{head}, got a 1-D tensor of {value.shape[0]} ids: ids.unsqueeze(0) makes a batch of one"
    if isinstance(value, torch.Tensor):
        return f"{head}, got a tensor of shape {tuple(value.shape)}"
    return f"{head}, got {type(value).__name__}"


def is_integer(ids: torch.Tensor) -> bool:
    """Whether ``ids`` can be token ids: an integer dtype (not floating, complex or bool)."""
    return not (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool)


def check_mask(mask, input_ids: torch.Tensor) -> None:
    """Refuse an ``attention_mask`` that is not a tensor shaped like ``input_ids`` (B, S), naming the fix."""
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape):
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"attention_mask must be shaped like input_ids {tuple(input_ids.shape)}, got {got}: pass the "
            "tokenizer's own with its ids (kvcake.generate(model, **tokenizer(texts, return_tensors='pt', "
            "padding=True)))"
        )


def check_vocabulary(model, ids: torch.Tensor, name: str = "input_ids") -> None:
    """Refuse ids outside a text model's embedding table, naming the likely cause: on the CPU the
    lookup fails as "index out of range in self", on CUDA as a device-side assert that also spoils
    every later call in the process. Models with images or audio (a ``vision_config`` or
    ``audio_config``) are passed by: some place their media tokens outside the text vocabulary."""
    try:
        table = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # not a transformers model, or one without a table
        return
    config = getattr(model, "config", None)
    if (
        not isinstance(table, torch.nn.Embedding)
        or getattr(config, "vision_config", None) is not None
        or getattr(config, "audio_config", None) is not None
        or ids.numel() == 0
    ):
        return
    low, high = (int(v) for v in torch.aminmax(ids))  # one host read, before any forward
    if low < 0 or high >= table.num_embeddings:
        bad = low if low < 0 else high
        raise ValueError(
            f"{name} holds token id {bad}, outside the model's vocabulary (ids 0 to "
            f"{table.num_embeddings - 1}): tokenize with this model's own tokenizer"
        )


def check_model(model: torch.nn.Module, entry: str) -> None:
    """Refuse, before anything reads it, a first argument that is not a model that generates: a
    tokenizer passed first, or a base model without its language-model head (``LlamaModel``)."""
    if isinstance(model, torch.nn.Module) and callable(getattr(model, "generate", None)):
        return
    kind = type(model).__name__
    if isinstance(model, torch.nn.Module):
        raise TypeError(
            f"{kind} has no generate (a base model without its language-model head): load the model with "
            f"AutoModelForCausalLM (or kvcake.load_model) and pass that to kvcake.{entry}"
        )
    raise TypeError(
        f"kvcake.{entry} takes the model first, got {kind}: kvcake.{entry}(model, input_ids, method, ...), "
        "with model, tokenizer = kvcake.load_model(...) (or AutoModelForCausalLM.from_pretrained)"
    )
