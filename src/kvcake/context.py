"""A compressed context: the prompt's compressed cache, answering many follow-ups unchanged.

It sits below both the API (``compress`` makes one) and storage (``load_context`` rebuilds one)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from dataclasses import dataclass, field

import torch
import transformers
from transformers import CompileConfig

from .adapters import (
    IMAGE_IN_EVERY_FORWARD,
    describe_model,
    extend_token_input,
    generate_with_cache,
    generation_setting,
    padded_positions,
    rope_delta_holders,
    with_cache,
)
from .attention import PREFIX, enable, padding_refused
from .cache import KVCakeCache
from .decoding import check_compiled_room
from .prompts import check_vocabulary, is_integer, not_ids
from .sliding import SlidingLayer


def check_generation(model: torch.nn.Module, generate_kwargs: dict) -> None:
    """Refuse, before any compute, the generation modes a compressed cache cannot serve (rollbacks:
    assisted, prompt-lookup and early-exit decoding), whether asked for by keyword or through a
    ``generation_config`` (the model's default included). Beam search reorders the cache
    (``kvcake.sequences``)."""
    for bad in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit"):
        value = generation_setting(model, generate_kwargs, bad)
        if value is not None:  # any value turns assisted decoding on, 1 included
            shown = value if isinstance(value, int) else type(value).__name__
            source = "" if bad in generate_kwargs else " (from the generation config)"
            raise ValueError(
                f"{bad}={shown}{source} is not supported with a compressed cache: it needs to roll the "
                "cache back (evicted entries are gone); decode greedily, by sampling or by beam search instead"
            )
    if generate_kwargs.get("use_cache") is False:  # one from a config is overridden (generate_with_cache)
        raise ValueError(
            "use_cache=False would feed the whole sequence again at every step into the compressed "
            "cache: drop use_cache=False (kvcake always decodes with its cache)"
        )


def compile_options(model: torch.nn.Module, compile, static: bool, generate_kwargs: dict) -> None:
    """Put ``compile`` (``kvcake.generate``'s and ``CompressedContext.generate``'s argument) into
    ``generate_kwargs`` after refusing what it cannot compile: None leaves it to transformers,
    which compiles a compileable cache's decoding forward on accelerators, not on a CPU; False
    decodes eagerly everywhere; True (``torch.compile(fullgraph=True)``, on a CPU with inductor's
    projections' products fused: ``row_products.compile_kwargs``) or a ``CompileConfig`` (as given)
    compiles it on any device."""
    if compile is False:
        generate_kwargs["disable_compile"] = True  # transformers would compile a static cache on CUDA
        return
    if compile is None:
        return
    if not isinstance(compile, (bool, CompileConfig)):
        raise TypeError(f"compile must be None, True, False or a transformers CompileConfig, got {compile!r}")
    if not static:
        raise ValueError(
            "compile=True compiles the static decode step, and this cache decodes in the dynamic layout: drop "
            "static=False (given to kvcake.generate or kvcake.compress), or compile=True"
        )
    if (generation_setting(model, generate_kwargs, "num_beams") or 1) > 1:
        raise ValueError(
            "compile=True compiles greedy and sampled decoding; transformers' beam search runs the model's "
            "forward eagerly, so nothing would be compiled: drop compile=True (or num_beams)"
        )
    info = describe_model(model)
    if info.own_masks:
        raise ValueError(
            f"compile=True: {info.model_type} builds its masks from a 2-D padding mask and cannot take the 4-D "
            "mask transformers gives a compiled decode (its StaticCache fails there too): use compile=False"
        )
    if not info.hands_kwargs:
        raise ValueError(
            f"compile=True needs a model whose attention passes its kwargs to cache.update, as transformers' "
            f"models do from 5.24 ({info.model_type} under the installed transformers "
            f"{transformers.__version__} does not, so the kvcake attention reads its cache back eagerly "
            "only): upgrade transformers or use compile=False"
        )
    if isinstance(compile, CompileConfig):
        config = compile
    else:
        from .row_products import compile_kwargs  # imports inductor: only when compiling

        config = CompileConfig(fullgraph=True, **compile_kwargs(model))
    config._compile_all_devices = True  # transformers compiles on accelerators only by default
    generate_kwargs["compile_config"] = config


def check_answerable(model: torch.nn.Module) -> None:
    """Refuse, before any compute, to compress a context for a model whose ``generate`` takes its
    image at every call (``pixel_values`` required: BLIP-2, InstructBLIP, which encode it again into
    the language model's inputs): a compressed context's follow-ups have no image to give it."""
    required = inspect.signature(type(model).generate).parameters.get("pixel_values")
    if required is not None and required.default is inspect.Parameter.empty:
        raise ValueError(
            f"{type(model).__name__}.generate encodes its image again at every call (pixel_values is required), "
            "so a compressed context could not answer a follow-up: compress the whole prompt with "
            "kvcake.generate(model, input_ids, method, pixel_values=...) instead"
        )


def check_positions(model: torch.nn.Module, prompt_tokens: int, generate_kwargs: dict) -> None:
    """Refuse, before any compute, a prompt whose length plus the tokens asked for passes the
    model's positions (``config.max_position_embeddings``; compression keeps positions)."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    total = generation_length(model, generate_kwargs, prompt_tokens)
    new = None if total is None else total - prompt_tokens
    _check_total(limit, prompt_tokens if total is None else total, prompt_tokens, new)


def generation_length(model: torch.nn.Module, generate_kwargs: dict, prompt_tokens: int) -> int | None:
    """The length ``model.generate`` stops at by transformers' rule, a static cache's capacity: the
    prompt plus ``max_new_tokens`` (by keyword, else from the generation config), else ``max_length``
    by keyword or in a ``generation_config`` passed; None otherwise. A ``max_length`` saved in the
    model's own generation config is left unknown: transformers 5.0 counts it after the prompt,
    later releases from the start."""
    new = generation_setting(model, generate_kwargs, "max_new_tokens")
    if new is not None:
        return prompt_tokens + int(new)
    length = generate_kwargs.get("max_length")
    if length is None and generate_kwargs.get("generation_config") is not None:
        length = generate_kwargs["generation_config"].max_length
    return None if length is None else max(int(length), prompt_tokens)


def generation_rows(model: torch.nn.Module, generate_kwargs: dict) -> int:
    """How many rows ``model.generate`` runs per sequence of the batch: its ``num_beams`` beams or its
    ``num_return_sequences`` samples, whichever is more (transformers' ``expand_size``)."""
    beams = generation_setting(model, generate_kwargs, "num_beams") or 1
    return max(int(beams), int(generation_setting(model, generate_kwargs, "num_return_sequences") or 1))


def _check_total(limit: int | None, total: int, prompt_tokens: int, new: int | None) -> None:
    if limit is None or total <= limit:
        return
    asked = f" + {new} new tokens" if new else ""
    raise ValueError(
        f"{prompt_tokens} prompt tokens{asked} = {total} positions, but the model has {limit}: shorten the "
        "prompt or lower max_new_tokens (compression keeps positions, it does not extend the context window)"
    )


@dataclass
class CompressedContext:
    """A compressed prompt that can answer many follow-ups without being changed by them.

    Attributes: ``cache`` (the compressed KVCakeCache), ``input_ids`` (B, S) the context's ids,
    ``attention_mask`` (B, S), ``logits`` (B, vocab) of the context's last token, ``rope_deltas``
    (B, 1) or None: the offset of multimodal RoPE positions after the context, on models that keep
    one between calls (Qwen2-VL: an image's tokens take fewer positions than tokens), handed to the
    model for each follow-up; ``token_inputs``: the context's inputs with a row per token that the
    model reads again for later tokens (``adapters.TOKEN_INPUTS``: Mllama's ``cross_attention_mask``,
    (B, S, images, tiles)), handed to it for each follow-up with a row per appended token (the
    context's last, as the model's own generate extends it).
    """

    model: torch.nn.Module = field(repr=False)
    cache: KVCakeCache
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits: torch.Tensor
    rope_deltas: torch.Tensor | None = None
    token_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    placed: tuple[torch.dtype, torch.device] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.placed = _placement(self.model)  # what the cache's keys and values were computed in

    def check_placement(self) -> None:
        """The model must still run in the dtype and on the device the context was compressed with."""
        if (now := _placement(self.model)) != self.placed:
            back = [f"model.to({was})" if isinstance(was, torch.dtype) else f"model.to('{was}')"
                    for held, was in zip(now, self.placed, strict=True) if held != was]  # fmt: skip
            raise ValueError(
                f"this context was compressed with the model in {self.placed[0]} on {self.placed[1]}, which now "
                f"runs in {now[0]} on {now[1]}: move it back ({', '.join(back)}), or compress the document again"
            )

    def fork(self) -> KVCakeCache:
        """A private copy of the compressed cache, to extend without touching this context."""
        return copy.deepcopy(self.cache)

    def _follow_ups(
        self, ids: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[CompressedContext, torch.Tensor, torch.Tensor]:
        """(the context to extend, the whole ids, the whole mask) for follow-ups ``ids`` (B, q) and
        their own ``mask`` (B, q) or None (every one a token): padding on the left, where the cache
        takes it (:meth:`padding_refused`). A follow-up per sequence of the context, or any number of
        them at once to a context compressed alone (batch 1): then a copy of it with that many rows
        (:meth:`_repeated`)."""
        ids = ids[None] if ids.dim() == 1 else ids
        b, n = self.input_ids.shape[0], ids.shape[0]
        if n != b and b != 1:
            raise ValueError(
                f"{n} follow-ups for a context of {b} sequences: give one per sequence (row i follows "
                "sequence i), or compress the document alone (a batch of 1), which takes any number at once"
            )
        ids = ids.to(self.input_ids.device)
        if mask is not None and mask.shape != ids.shape:
            raise ValueError(
                f"attention_mask is the follow-ups' own, shaped like them {tuple(ids.shape)}, got "
                f"{tuple(mask.shape)}: the context's part is the context's"
            )
        if mask is None or bool(mask.bool().all()):
            mask = torch.ones_like(ids, dtype=self.attention_mask.dtype)
        else:
            mask = mask.to(ids.device).bool()
            if why := self.padding_refused() or padding_refused(self.cache, mask):
                raise ValueError(
                    f"follow-ups with padding are not supported here ({why}): ask follow-ups of different "
                    "lengths one at a time (kvcake.answer(..., question=[...]) groups them so); follow-ups of "
                    "one length go in one batch"
                )
            mask = mask.to(self.attention_mask.dtype)
        ctx = self if n == b else self._repeated(n)
        full = torch.cat([ctx.input_ids, ids], dim=1)
        return ctx, full, torch.cat([ctx.attention_mask, mask], dim=1)

    def padding_refused(self) -> str | None:
        """Why follow-ups of different lengths cannot share a batch, left-padded, or None where they
        can (each row answered as alone: ``kvcake.sequences.settle_padding``): the padding would be
        read as text by chunked attention (which counts its columns), a recurrent state or an
        image's rows; a sliding window settles it from the model's 4-D mask, which the flash
        kernels do not make (``kvcake.sliding_appends``)."""
        if self.rope_deltas is not None or self.token_inputs:
            return "the context holds multimodal inputs"
        impl = str(getattr(self.model.config, "_attn_implementation", None)).removeprefix(PREFIX)
        if impl not in ("sdpa", "eager", "flex_attention") and any(
            isinstance(layer, SlidingLayer) for layer in self.cache.layers
        ):  # (flex runs SDPA inside kvcake.enable)
            return f"sliding-window layers under attn_implementation={impl!r}, whose mask kvcake cannot read"
        return padding_refused(self.cache)

    def _repeated(self, n: int) -> CompressedContext:
        """A context of ``n`` sequences, each this one's (batch 1), its cache a private copy."""
        cache = self.fork()
        cache.batch_repeat_interleave(n)

        def rows(t):
            return None if t is None else t.repeat_interleave(n, dim=0)

        return dataclasses.replace(
            self, cache=cache, input_ids=rows(self.input_ids), attention_mask=rows(self.attention_mask),
            logits=rows(self.logits), rope_deltas=rows(self.rope_deltas),
            token_inputs={k: rows(t) for k, t in self.token_inputs.items()},
        )  # fmt: skip

    def generate(
        self, question_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
        compile: bool | CompileConfig | None = None, **generate_kwargs,
    ) -> torch.Tensor:  # fmt: skip
        """Append ``question_ids`` (B, q) to a fork of the context and generate; returns only the
        new tokens (B, n): the answer's ids, as ``kvcake.generate``'s ``output[:, prompt_length:]``
        (with ``return_dict_in_generate=True``, ``model.generate``'s output whose ``sequences`` are
        the answer's ids). A context of B sequences takes a follow-up per sequence; one compressed
        alone takes any number of follow-ups at once, answered in one batch, each row what its
        follow-up alone gets (``attention_mask``, where given, the follow-ups' own: follow-ups of
        different lengths padded on the left, where the cache takes padding: :meth:`padding_refused`).
        ``compile``: as ``kvcake.generate``'s (None: transformers compiles the decoding forward on
        accelerators; True: on any device; False: never), the context's layers laid out in static
        storage right after the question."""
        _check_follow_ups(self.model, question_ids)
        self.check_placement()
        if taken := sorted({"cache", "past_key_values"} & set(generate_kwargs)):
            raise ValueError(
                f"a compressed context answers from a copy of its own cache, so {taken[0]}= is not taken: "
                "drop it (to decode from a cache of your own, pass it to model.generate inside `with kvcake.enable(model):`)"
            )
        check_generation(self.model, generate_kwargs)  # refusals first, before any copy
        compile_options(self.model, compile, self.cache.static, generate_kwargs)
        check_positions(self.model, self.input_ids.shape[1] + question_ids.shape[-1], generate_kwargs)
        ctx, full, mask = self._follow_ups(question_ids, attention_mask)
        cache = self.fork() if ctx is self else ctx.cache
        room = generation_length(self.model, generate_kwargs, full.shape[1])
        check_compiled_room(self.cache.method, compile, room)
        cache.reserve(room)  # static storage's capacity
        rows = generation_rows(self.model, generate_kwargs)
        cache.batch_repeat_interleave(rows)  # generate repeats each sequence for its beams or samples
        with enable(self.model), torch.no_grad(), ctx._positions(rows):
            out = self.model.generate(
                input_ids=full, attention_mask=mask, **ctx._token_inputs(full.shape[1]),
                **generate_with_cache(self.model, cache, generate_kwargs),
            )  # fmt: skip
        if hasattr(out, "sequences"):  # return_dict_in_generate=True: the output, its sequences the answer's
            out.sequences = out.sequences[:, full.shape[1] :]
            return out
        return out[:, full.shape[1] :]

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, q, vocab) of ``ids`` appended to a fork of the context (teacher forcing);
        ``attention_mask`` as :meth:`generate`'s (follow-ups of different lengths padded on the left:
        each row's last tokens are its own, the rows of its padding meaningless)."""
        if (mtype := describe_model(self.model).model_type) in IMAGE_IN_EVERY_FORWARD:
            raise ValueError(
                f"{mtype}'s forward encodes an image at every call, so a context's text follow-up cannot be "
                "teacher-forced through it; generate() answers follow-ups (its generate takes the cache alone)"
            )
        _check_follow_ups(self.model, ids, "ids")
        self.check_placement()
        ctx, full, mask = self._follow_ups(ids, attention_mask)
        ids = full[:, self.input_ids.shape[1] :]
        cache = self.fork() if ctx is self else ctx.cache
        with enable(self.model), torch.no_grad(), ctx._positions():
            out = self.model(input_ids=ids, attention_mask=mask, **ctx._appended_positions(ids, mask),
                             **ctx._token_inputs(full.shape[1], ids.shape[1]), **with_cache(self.model, cache))  # fmt: skip
        return out.logits

    @contextlib.contextmanager
    def _positions(self, rows: int = 1):
        """The model holds this context's ``rope_deltas`` for the call (it keeps the last prefill's
        between calls, another prompt's or none), each repeated for ``rows`` beams or samples, and
        what it held before afterwards."""
        holders = rope_delta_holders(self.model)
        before = [h.rope_deltas for h in holders]
        deltas = None if self.rope_deltas is None else self.rope_deltas.repeat_interleave(rows, dim=0)
        for h in holders:
            h.rope_deltas = deltas
        try:
            yield
        finally:
            for h, deltas in zip(holders, before, strict=True):
                h.rope_deltas = deltas

    def _token_inputs(self, length: int, appended: int | None = None) -> dict:
        """``token_inputs`` over ``length`` tokens: the context's rows, then its last for each appended.
        For a forward of ``appended`` tokens, their ``cache_position`` too where the model's forward
        takes one: transformers 5.0's Mllama picks the tokens' rows by it (later releases by the
        cache's length, or take the rows as they are)."""
        out = {k: extend_token_input(t, length - t.shape[1]) for k, t in self.token_inputs.items()}
        if (
            out
            and appended is not None
            and "cache_position" in inspect.signature(self.model.forward).parameters
        ):
            out["cache_position"] = torch.arange(length - appended, length, device=self.input_ids.device)
        return out

    def _appended_positions(self, ids: torch.Tensor, mask: torch.Tensor) -> dict:
        """``position_ids`` (3, B, q) of ``ids`` appended to a context with ``rope_deltas`` (the rule the
        model's forward applies to appended tokens without a mask: past length + delta; with the mask
        transformers 5.24 builds them for the whole sequence and fails); after a left-padded batch of
        contexts, (B, q) counted from each row's first token, as the context's own were
        (``adapters.padded_positions``); else none (the model's own)."""
        if self.rope_deltas is None:
            return {k: t[:, -ids.shape[1] :] for k, t in padded_positions(self.model, mask).items()}
        if not bool(mask[:, : self.input_ids.shape[1]].all()):
            raise ValueError(
                "forward() on a padded batch of contexts with multimodal RoPE positions (rope_deltas) is not "
                "supported: transformers releases place the tokens after padding differently there; pass "
                "the contexts one at a time (generate() has no such limit)"
            )
        past = self.input_ids.shape[1]
        steps = torch.arange(past, past + ids.shape[1], device=ids.device)
        deltas = self.rope_deltas.to(ids.device)  # (B, 1)
        return {"position_ids": (steps[None] + deltas).expand(3, -1, -1)}

    def save(self, path) -> None:
        from .storage.writer import save_context  # the writer does not import this module

        save_context(self, path)


def _check_follow_ups(model: torch.nn.Module, ids, name: str = "question_ids") -> None:
    """Refuse follow-ups that are not a (B, q) or (q,) tensor of integer ids of ``model``'s
    vocabulary, naming the fix."""
    if not isinstance(ids, torch.Tensor) or ids.dim() not in (1, 2) or not is_integer(ids):
        raise TypeError(not_ids(ids, name))
    if ids.numel() == 0:  # generate would feed the context again behind the cache (a wrong answer)
        raise ValueError(
            f"{name} of shape {tuple(ids.shape)} holds no token: a follow-up needs at least one "
            "(the context's own next-token logits are ctx.logits)"
        )
    check_vocabulary(model, ids, name)


def _placement(model: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    """(dtype, device) of the model's first floating-point parameter: what its keys are computed in."""
    first = next((p for p in model.parameters() if p.is_floating_point()), None)
    return (torch.float32, torch.device("cpu")) if first is None else (first.dtype, first.device)
