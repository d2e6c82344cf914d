"""The Python API: compress with ``model.generate``, or compress once and ask many times.

>>> method = kvcake.make_method("cake", budget=128)
>>> with kvcake.enable(model):
...     out = model.generate(ids, past_key_values=kvcake.KVCakeCache(model, method), max_new_tokens=32)

or, for a document served to many questions (context-only compression):

>>> ctx = kvcake.compress(model, context_ids, method)
>>> answer_ids = ctx.generate(question_ids, max_new_tokens=32)   # ctx itself is unchanged
"""

from __future__ import annotations

import logging

import torch
from transformers import CompileConfig

from .attention import enable
from .cache import KVCakeCache
from .context import CompressedContext
from .method import Method, make_method

logger = logging.getLogger(__name__)


def _as_method(method: Method | str, budget: int | None, ratio: float | None, window: int) -> Method:
    if isinstance(method, Method):
        if budget is not None or ratio is not None:
            raise ValueError("give budget=/ratio= either to make_method or here, not both")
        return method
    return make_method(method, budget=budget, ratio=ratio, window=window)


def _check_ids(input_ids: torch.Tensor, model: torch.nn.Module) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise TypeError("input_ids must be a (batch, length) tensor of token ids")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and input_ids.shape[1] > limit:
        raise ValueError(
            f"the prompt has {input_ids.shape[1]} tokens but the model has {limit} positions: shorten it "
            "(compression keeps positions, it does not extend the context window)"
        )


def _check_generate_kwargs(model: torch.nn.Module, generate_kwargs: dict) -> None:
    """Refuse, before any compute, the generation modes a compressed cache cannot serve, whether
    asked for by keyword or through a ``generation_config`` (the model's default included)."""
    if "past_key_values" in generate_kwargs:
        raise ValueError(
            "kvcake.generate makes its own KVCakeCache: to pass your own, call model.generate(..., "
            "past_key_values=cache) inside `with kvcake.enable(model):`"
        )
    config = generate_kwargs.get("generation_config") or getattr(model, "generation_config", None)

    def setting(name: str):
        return generate_kwargs[name] if name in generate_kwargs else getattr(config, name, None)

    for bad in ("num_beams", "assistant_model", "prompt_lookup_num_tokens"):
        value = setting(bad)
        if value not in (None, 1):
            shown = value if isinstance(value, int) else type(value).__name__
            source = "" if bad in generate_kwargs else " (from the generation config)"
            raise ValueError(
                f"{bad}={shown}{source} is not supported with a compressed cache: it needs to roll the "
                "cache back or reorder it; decode greedily or by sampling instead"
            )
    if setting("use_cache") is False:
        raise ValueError(
            "use_cache=False would feed the whole sequence again at every step into the compressed "
            "cache: drop use_cache=False (kvcake always decodes with its cache)"
        )


def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    method: Method | str = "cake",
    *,
    budget: int | None = None,
    ratio: float | None = None,
    window: int = 32,
    progress: bool = False,
    compile: bool | CompileConfig = False,
    **generate_kwargs,
) -> tuple[torch.Tensor, KVCakeCache]:
    """``model.generate`` with a compressed cache; returns the output ids and the cache.

    The prompt (question included: question-aware compression) is compressed during prefill.
    ``progress=True`` shows a progress bar over the layers while the prompt is prefilled.
    ``compile=True`` decodes in static storage and lets ``generate`` compile the decoding forward
    (``torch.compile(fullgraph=True)``, CUDA graphs through ``mode="reduce-overhead"`` on CUDA;
    on a CPU inductor is often slower than eager); a ``CompileConfig`` chooses the options.
    """
    _check_ids(input_ids, model)
    m = _as_method(method, budget, ratio, window)
    _check_generate_kwargs(model, generate_kwargs)
    new = generate_kwargs.get("max_new_tokens")
    room = input_ids.shape[1] + new if isinstance(new, int) else None  # decode storage, preallocated
    if compile is not False:
        config = compile if isinstance(compile, CompileConfig) else CompileConfig(fullgraph=True)
        config._compile_all_devices = True  # transformers compiles on accelerators only by default
        generate_kwargs["compile_config"] = config
    cache = KVCakeCache(model, m, progress=progress, max_cache_len=room, static=compile is not False)
    with enable(model), torch.no_grad():
        out = model.generate(input_ids, past_key_values=cache, **generate_kwargs)
    return out, cache


def compress(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    method: Method | str = "cake",
    *,
    attention_mask: torch.Tensor | None = None,
    budget: int | None = None,
    ratio: float | None = None,
    window: int = 32,
    progress: bool = False,
) -> CompressedContext:
    """Prefill ``input_ids`` (B, S) into a compressed cache (context-only compression).

    The returned context answers any number of follow-ups with ``.generate`` / ``.forward``;
    each works on its own copy, so the context is never changed by answering."""
    _check_ids(input_ids, model)
    m = _as_method(method, budget, ratio, window)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    cache = KVCakeCache(model, m, progress=progress)
    with enable(model), torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, past_key_values=cache, logits_to_keep=1)
    return CompressedContext(model, cache, input_ids, attention_mask, out.logits[:, -1])
