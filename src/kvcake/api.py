"""The Python API on token ids: compress with ``model.generate``, or compress once and ask many
times (``kvcake.answer``, text in and text out, is in ``answers.py`` above this module).

>>> kvcake.answer(model, tokenizer, context=document, question="Who wrote it?")   # -> str
>>> kvcake.answer(model, tokenizer, context=document, question=["Who?", "When?"])  # -> list[str]

Return conventions: ``answer`` returns text (a list of texts for a list of questions);
``generate`` returns what ``model.generate`` returns (prompt and answer ids, (B, S + n)) and the
cache; ``CompressedContext.generate`` returns only the answer's ids (B, n), since its prompt is
split between the context and the question.

>>> method = kvcake.make_method("cake", budget=128)
>>> with kvcake.enable(model):
...     out = model.generate(ids, cache=kvcake.KVCakeCache(model, method), max_new_tokens=32)

(``cache=`` on transformers >= 5.24; ``past_key_values=`` before.)

or, for a document served to many questions (context-only compression):

>>> ctx = kvcake.compress(model, context_ids, method)
>>> answer_ids = ctx.generate(question_ids, max_new_tokens=32)   # ctx itself is unchanged
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging

import torch
from transformers import CompileConfig
from transformers.utils import TransformersKwargs

from .adapters import (
    TOKEN_INPUTS,
    cache_keyword,
    generate_with_cache,
    generation_setting,
    padded_positions,
    rope_delta_holders,
    with_cache,
)
from .attention import enable
from .budget import DEFAULT_WINDOW, STARVED_FRACTION, STARVED_MIN_TOKENS, check_flag, default_budget
from .cache import KVCakeCache
from .context import (
    CompressedContext,
    check_answerable,
    check_generation,
    check_positions,
    compile_options,
    generation_length,
)
from .decoding import check_compiled_room
from .method import FULL, Method, make_method, resolve_ratio
from .prompts import check_mask, check_model, check_vocabulary, is_integer, not_ids
from .temperatures import Scenario

logger = logging.getLogger(__name__)


def sized_method(
    method: Method | str,
    budget: int | None,
    ratio: float | None,
    window: int | None,
    scenario: str,
    prompt_tokens: int,
) -> Method:
    """The method with its sizes: as given, or where neither ``budget`` nor ``ratio`` is, the
    scenario's default keep ratio for prompts of at most ``prompt_tokens`` (the batch's padded
    length), each prompt too short for it kept whole as it would be alone
    (:func:`kvcake.budget.default_budget`). A :class:`Method` object carries its own sizes and
    window: one given here as well is refused, as ``KVCakeCache`` refuses it."""
    if isinstance(method, Method):
        if budget is not None or ratio is not None:
            raise ValueError("give budget=/keep_ratio= either to make_method or here, not both")
        if window is not None and window != method.budget.window:
            raise ValueError(
                f"window={window} here, and the Method object's is {method.budget.window}: give window= "
                "to make_method, not here"
            )
        return method
    window = DEFAULT_WINDOW if window is None else window
    sizes = {"budget": budget, "ratio": ratio}
    if budget is None and ratio is None and not (isinstance(method, str) and method.strip().lower() == FULL):
        sizes = default_budget(scenario, prompt_tokens, window)
    keep_short = sizes.pop("keep_short", False)
    m = make_method(method, window=window, **sizes)
    return m.replace(budget=dataclasses.replace(m.budget, keep_short=keep_short)) if keep_short else m


def _warn_if_starved(method: Method, prompt_tokens: int) -> None:
    """Warn when a long prompt keeps only a few percent of its entries: answers about a document
    compressed that far are often made up (docs/results.md, context-only tables)."""
    spec = method.budget
    if method.name == FULL or prompt_tokens < STARVED_MIN_TOKENS:
        return
    kept = spec.ratio if spec.ratio is not None else spec.budget / prompt_tokens
    if kept < STARVED_FRACTION:
        logger.warning(
            "%s keeps %.1f%% of a %d-token prompt: answers about text compressed this far are often made "
            "up; keep more (keep_ratio=0.5, or --keep-ratio 0.5) or compare with method 'full'",
            spec.describe(),
            100 * kept,
            prompt_tokens,
        )


def _check_ids(input_ids: torch.Tensor, model: torch.nn.Module, mask: torch.Tensor | None) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or not is_integer(input_ids):
        raise TypeError(not_ids(input_ids))
    check_mask(mask, input_ids)
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token")
    check_vocabulary(model, input_ids)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and input_ids.shape[1] > limit:
        raise ValueError(
            f"the prompt has {input_ids.shape[1]} tokens but the model has {limit} positions: shorten it "
            "(compression keeps positions, it does not extend the context window)"
        )


def _check_generate_kwargs(model: torch.nn.Module, generate_kwargs: dict, prompt_tokens: int) -> None:
    """Refuse, before any compute, the generation modes a compressed cache cannot serve, whether
    asked for by keyword or through a ``generation_config`` (the model's default included)."""
    for name in ("past_key_values", "cache"):
        if name in generate_kwargs:
            raise ValueError(
                f"kvcake.generate makes its own KVCakeCache, so {name}= is not taken: to pass your "
                f"own, call model.generate(..., {cache_keyword(model)}=cache) inside "
                "`with kvcake.enable(model):`"
            )
    check_generation(model, generate_kwargs)
    chunk = generation_setting(model, generate_kwargs, "prefill_chunk_size")  # transformers' chunked prefill
    if chunk is not None and chunk < prompt_tokens:
        source = "" if "prefill_chunk_size" in generate_kwargs else " (from the generation config)"
        raise ValueError(
            f"prefill_chunk_size={chunk}{source} would prefill the {prompt_tokens}-token prompt in "
            f"{-(-prompt_tokens // chunk)} forwards, and kvcake compresses a prompt in its first forward (its "
            "scores read the whole prompt's attention): the later chunks would be kept or evicted as appended "
            "tokens. Drop prefill_chunk_size (or set it to at least the prompt's length)"
        )


def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    method: Method | str = "cake",
    *,
    budget: int | None = None,
    ratio: float | None = None,
    window: int | None = None,
    progress: bool = False,
    keep_ratio: float | None = None,
    scenario: str | None = None,
    static: bool = True,
    compile: bool | CompileConfig | None = None,
    kv_dtype: str | None = None,
    kv_recent: int | None = None,
    **generate_kwargs,
) -> tuple[torch.Tensor, KVCakeCache]:
    """``model.generate`` with a compressed cache; returns ``(output_ids, cache)``.

    ``output_ids`` is what ``model.generate`` returns, (B, S + n): the prompt followed by the
    answer (``output_ids[:, input_ids.shape[1]:]`` is the answer alone). The prompt (question
    included: question-aware compression) is compressed during prefill. ``keep_ratio`` (older
    name ``ratio``) is the fraction of the prompt kept, ``budget`` the entries kept per layer;
    give at most one, or neither to keep ``DEFAULT_KEEP_RATIO["question"]`` (a prompt of a
    padded batch too short for it kept whole, as alone). ``window`` (None: 32) is the protected
    recent window; a :class:`Method` object carries its sizes and window (give them to
    ``make_method``). ``method="full"`` keeps everything. ``progress=True`` shows a progress bar
    over the layers during prefill.
    ``scenario`` picks the set of calibrated CAKE temperatures: ``"question"`` by default (the
    prompt ends with its question), ``"context"`` for a prompt that does not.
    ``static`` (True by default) decodes in storage preallocated for the length ``generate`` stops
    at (``max_new_tokens`` or ``max_length``, by keyword or from the generation config;
    ``KVCakeCache(static=, max_cache_len=)``), so nothing reallocates while
    decoding; ``static=False`` decodes in the dynamic reference layout.
    ``compile``: None (the default) leaves it to transformers, which compiles the decoding
    forward of a compileable cache (static storage) on CUDA and other accelerators, not on a
    CPU; ``True`` compiles it on any device (``torch.compile(fullgraph=True)``, CUDA graphs
    through ``mode="reduce-overhead"`` on CUDA; on a CPU with the projections' products fused,
    ``row_products.compile_kwargs``: 0.34-0.41 x an eager step at 16k tokens on docs/benchmarks.md's
    host, after a compilation of minutes),
    a ``CompileConfig`` chooses the options; ``False`` decodes eagerly everywhere.
    ``kv_dtype="fp8"`` stores the kept entries in float8 from the end of the prompt (one byte per
    element, read back in the model's dtype: ``kvcake.fp8``), the last ``kv_recent`` tokens' entries
    (None: 32; 0: none) also in the model's dtype; None keeps the model's dtype.
    """
    check_model(model, "generate")
    scenario = Scenario.pick(scenario, "question", "kvcake.generate compresses the prompt with its question")
    _check_ids(input_ids, model, generate_kwargs.get("attention_mask"))
    m = sized_method(method, budget, resolve_ratio(ratio, keep_ratio), window, "question", input_ids.shape[1])
    _check_generate_kwargs(model, generate_kwargs, input_ids.shape[1])
    check_positions(model, input_ids.shape[1], generate_kwargs)
    _warn_if_starved(m, input_ids.shape[1])
    room = generation_length(model, generate_kwargs, input_ids.shape[1])  # decode storage, preallocated
    compile_options(model, compile, static, generate_kwargs)
    check_compiled_room(m, compile, room)
    cache = KVCakeCache(model, m, progress=progress, max_cache_len=room, static=static, scenario=scenario,
                        kv_dtype=kv_dtype, kv_recent=kv_recent)  # fmt: skip
    with enable(model), torch.no_grad():
        out = model.generate(input_ids=input_ids, **generate_with_cache(model, cache, generate_kwargs))
    return out, cache


def compress(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    method: Method | str = "cake",
    *,
    attention_mask: torch.Tensor | None = None,
    budget: int | None = None,
    ratio: float | None = None,
    window: int | None = None,
    progress: bool = False,
    keep_ratio: float | None = None,
    scenario: str | None = None,
    static: bool = True,
    kv_dtype: str | None = None,
    kv_recent: int | None = None,
    **model_inputs,
) -> CompressedContext:
    """Prefill ``input_ids`` (B, S) into a compressed cache (context-only compression).

    The returned context answers any number of follow-ups with ``.generate`` (which returns the
    answer's ids only) / ``.forward``; each works on its own copy, so the context is never
    changed by answering. Budget and window keywords as in :func:`generate`; no size keeps
    ``DEFAULT_KEEP_RATIO["context"]``. ``scenario`` picks the set of calibrated CAKE
    temperatures: ``"context"`` by default, ``"question"`` when ``input_ids`` already end with
    the question (as ``kvcake inspect --prompt`` compresses).

    The context holds exactly the kept entries (the dynamic layout, ``kv_bytes()`` is what
    compression kept); with ``static=True`` (the default) each ``.generate`` moves its fork into
    storage preallocated for the question plus the tokens to generate; ``static=False`` decodes in
    the dynamic reference layout. ``kv_dtype="fp8"``, ``kv_recent``: the context's kept entries in
    float8 (as in :func:`generate`), saved so by ``save_context``.

    ``model_inputs`` go to the model's forward with the context: the images of a vision-language
    model, as its processor returns them (``pixel_values``, ``image_grid_thw``, ``token_type_ids``,
    ...). The image's tokens are compressed like the text's; follow-ups are text."""
    check_model(model, "compress")
    scenario = Scenario.pick(scenario, "context", "kvcake.compress compresses a context before its questions")
    _check_ids(input_ids, model, attention_mask)
    check_answerable(model)
    m = sized_method(method, budget, resolve_ratio(ratio, keep_ratio), window, "context", input_ids.shape[1])
    _warn_if_starved(m, input_ids.shape[1])
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    _check_model_inputs(model, model_inputs, input_ids.shape)
    holders = rope_delta_holders(model)
    for holder in holders:  # computed from this context's images, not left from an earlier prompt
        holder.rope_deltas = None
    # prefilled in the dynamic layout (no capacity is reserved for questions not yet asked);
    # the static plans are set for the forks that answer them
    check_flag("static", static)  # before the prefill: the cache is made with static=False
    cache = KVCakeCache(model, m, progress=progress, scenario=scenario, static=False, kv_dtype=kv_dtype,
                        kv_recent=kv_recent)  # fmt: skip
    with enable(model), torch.no_grad():
        out = model(
            input_ids=input_ids,  # by keyword: BLIP-2's and Kosmos-2's forward take pixel_values first
            attention_mask=attention_mask,
            **({} if "position_ids" in model_inputs else padded_positions(model, attention_mask)),
            **model_inputs,
            **with_cache(model, cache),
            logits_to_keep=1,
        )
    cache.serve(static)
    deltas = next((h.rope_deltas for h in holders if h.rope_deltas is not None), None)
    kept = {name: model_inputs[name] for name in TOKEN_INPUTS if model_inputs.get(name) is not None}
    return CompressedContext(model, cache, input_ids, attention_mask, out.logits[:, -1], deltas, kept)


def _check_model_inputs(model: torch.nn.Module, model_inputs: dict, ids_shape: torch.Size) -> None:
    """``compress``'s ``model_inputs``: each one the model's forward names (the check
    ``model.generate`` makes of its keywords), those with a row per token shaped so, and none
    that ``compress`` sets itself. A forward taking ``**kwargs`` would drop a misspelt keyword
    (``keep_rato=``) or a generation option (``max_new_tokens=``) without a word."""
    named = set(getattr(TransformersKwargs, "__optional_keys__", ()))  # output_attentions, ...
    for fn in (model.forward, getattr(model, "prepare_inputs_for_generation", None)):
        params = inspect.signature(fn).parameters.values() if fn is not None else ()
        named |= {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    unknown = sorted(k for k in model_inputs if k not in named)
    if unknown:
        own = [p for p in inspect.signature(compress).parameters if p not in ("model", "model_inputs")]
        close = [m for k in unknown for m in difflib.get_close_matches(k, [*own, *sorted(named)], n=1)]
        raise TypeError(
            f"kvcake.compress got {', '.join(map(repr, unknown))}, which neither it nor "
            f"{type(model).__name__}'s forward takes{f' (did you mean {close[0]!r}?)' if close else ''}: its own keywords are "
            f"{', '.join(own)}; generation options go to the context's generate()"
        )
    for name in TOKEN_INPUTS:  # a row per token of the context, which its follow-ups extend
        t = model_inputs.get(name)
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape[:2]) != tuple(ids_shape)):
            raise ValueError(
                f"{name} must have a row per token of the context, (B, S, ...) = {tuple(ids_shape)}, got "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
            )
    taken = sorted(
        set(model_inputs) & {"cache", "past_key_values", "use_cache", "logits_to_keep", "inputs_embeds"}
    )
    if taken:
        raise TypeError(
            f"kvcake.compress got {', '.join(taken)}: it prefills its own cache from input_ids and keeps the "
            "last token's logits; pass only the model's other inputs (images: pixel_values, image_grid_thw, ...)"
        )
