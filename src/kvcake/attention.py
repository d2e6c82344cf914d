"""The kvcake attention function, registered through transformers' ``AttentionInterface``.

For every stock implementation ``X`` (``sdpa``, ``eager``, ``flash_attention_2``, ...) we
register ``kvcake_X``: the same kernel and the same mask builder (``AttentionMaskInterface``),
plus the compression hooks of a :class:`~kvcake.cache.KVCakeCache`. ``enable(model)`` switches
the model to ``kvcake_X`` for the duration of a ``with`` block and restores it in ``finally``;
nothing is patched at import and a call without a KVCakeCache runs the stock kernel unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import weakref
from collections.abc import Iterator

import torch
from transformers import AttentionInterface, GenerationMixin
from transformers.cache_utils import Cache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .adapters import describe_model
from .cache import HANDOFF, LEGACY_PENDING, KVCakeCache
from .devices import input_device
from .fp8 import take_before
from .latent import expand_output, query_over
from .layer import KVCakeLayer
from .logit_terms import LogitTerms, model_terms
from .position_weights import by_position, ring_weights
from .sdpa import check_policy, sdpa_policy
from .sequences import real_rows, settle_padding
from .sliding import SlidingLayer
from .sliding_appends import appended_validity, held_validity, own_mask, settle, visible_keys

logger = logging.getLogger(__name__)
PREFIX = "kvcake_"


def _eager(
    module, query, key, value, attention_mask, scaling, dropout=0.0, softcap=None, s_aux=None, **kwargs
):
    """transformers' eager attention (each model file has its own copy; this is the same math), with
    Gemma 2's soft cap (``softcap``) and GPT-OSS's sinks (``s_aux``: a logit per head in the softmax,
    its probability dropped) where the model passes them (``kvcake.logit_terms``)."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, k.transpose(2, 3)) * scaling
    weights = LogitTerms(softcap).cap(weights)  # as gemma2's eager_attention_forward
    if attention_mask is not None:
        weights = weights + attention_mask
    if s_aux is None:
        weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    else:  # as gpt_oss's eager_attention_forward: the maxima subtracted, the softmax in the logits' dtype
        sinks = s_aux.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
        both = torch.cat([weights, sinks], dim=-1)
        both = both - both.max(dim=-1, keepdim=True).values
        weights = torch.softmax(both, dim=-1, dtype=both.dtype)[..., :-1].to(value.dtype)
    out = torch.matmul(weights, v).transpose(1, 2).contiguous()
    return out, weights


def key_validity(mask: torch.Tensor | None, batch: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """(B, kv_len) bool: which key columns are real tokens, read off whatever mask the stock
    implementation was given (4-D bool for sdpa, 4-D additive float for eager, 2-D for flash,
    or None when there is no padding). The last query row of a left-padded batch sees every
    real key."""
    if mask is None:
        return torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    if mask.dim() == 2:
        return mask[:, -kv_len:].bool()
    row = mask[:, 0, -1, -kv_len:]
    valid = row if row.dtype == torch.bool else row == 0
    return valid.expand(batch, kv_len) if valid.shape[0] != batch else valid


def _settle_padded_append(
    cache, layer: KVCakeLayer, mask: torch.Tensor | None, batch: int, q: int
) -> torch.Tensor | None:
    """Tokens appended to a compressed cache several at a time (follow-ups of a compressed context,
    a second ``generate`` on a kept cache) were stored as entries: where the mask pads some rows on
    the left (follow-ups of different lengths in one batch), the pads become empty slots and each
    row its own sequence shifted (``kvcake.sequences.settle_padding``; a sliding layer's window then
    counts each row's own tokens, ``kvcake.sliding_appends``). Other padding, and padding in caches
    whose other layers would keep it (chunked attention counts the pads' columns, recurrent states
    read the pad tokens), is refused. Returns the appended tokens' validity (B, q) where some are
    pads, else None."""
    before = take_before(layer)  # float8 storage: its rings before the append (fp8.remember)
    valid = key_validity(mask, batch, q, layer.keys.device) if mask is not None else None
    if valid is None or bool(valid.all()):
        return None
    _refuse_padding(cache, valid)
    settle_padding(layer, valid, before)
    return valid


def _refuse_padding(cache: KVCakeCache, valid: torch.Tensor) -> None:
    if why := padding_refused(cache, valid):
        raise ValueError(
            f"padding among tokens appended to a compressed cache is not supported here ({why}; the cache "
            "would store and attend it as text, and is now unusable): append rows of one length without "
            "padding, one batch per length (kvcake.answer groups follow-ups so there)"
        )


def _sliding_attention(cache, layer: SlidingLayer, inner, module, query, key, value, mask, **kwargs):
    """A sliding layer's call outside its ring (the prompt, an append, a dynamic step): the model's
    kernel and mask, or once padding is among the appended tokens the layer's own mask, each row's
    window counted in its own tokens (``kvcake.sliding_appends``); then into the ring if planned."""
    batch, q, n = query.shape[0], query.shape[2], key.shape[-2]
    appended = n > q and (layer.settled or (q > 1 and not torch.compiler.is_compiling()))
    valid = appended_validity(mask, batch, q, n, key.device).to(key.device) if appended else None
    if valid is not None and not layer.settled and bool(valid.all()):
        valid = None  # no padding: the model's mask describes the layer
    if valid is None:
        out = inner(module, query, key, value, mask, **kwargs)
        layer.to_ring(visible_keys(mask, batch, n))  # after the prompt (or an append)
        return out
    if not layer.settled:
        _refuse_padding(cache, valid)  # (padding not on the left; chunked or recurrent layers)
    held = layer.held_valid if layer.settled else held_validity(mask, batch, q, n, key.device)
    valid = torch.cat([held.to(key.device), valid], dim=1)  # (B, n)
    out = inner(module, query, key, value, own_mask(valid, q, layer.sliding_window, mask), **kwargs)
    settle(layer, key, value, valid)
    layer.to_ring(layer.held_valid)
    return out


def padding_refused(cache: KVCakeCache, valid: torch.Tensor | None = None) -> str | None:
    """Why padding among tokens appended to ``cache`` (``valid`` (B, q), False at a pad) cannot be
    settled, or None where it can: chunked attention counts the pads' columns, a recurrent state
    reads the pad tokens (layers whose ``takes_padding`` is not true); padding must be on the left."""
    odd = sorted(
        {("chunked " if getattr(other, "chunked", False) else "") + type(other).__name__
         for other in cache.layers if not getattr(other, "takes_padding", False)}
    )  # fmt: skip
    if odd:
        return f"the cache holds {', '.join(odd)} layers"
    if valid is not None and not bool((valid[:, 1:] >= valid[:, :-1]).all() & valid[:, -1].all()):
        return "padding not on the left"
    return None


def _refuse_use_cache_off(module, args: tuple, kwargs: dict) -> None:
    """A forward pre-hook of the model inside ``enable``: ``use_cache=False`` beside a KVCakeCache
    (passed, or a model config's that ``generate`` forwards: training with gradient checkpointing
    saves one) makes ``generate`` feed the whole sequence at every step, which transformers stores
    again behind what the cache holds (a ``DynamicCache`` too, silently): refused before the cache
    moves. Read at the model's own call, where the flag is the caller's (a decoder layer's default
    is ``False`` in some models, so the attention cannot tell)."""
    if kwargs.get("use_cache") is False and any(
        isinstance(kwargs.get(name), KVCakeCache) for name in ("cache", "past_key_values")
    ):
        raise ValueError(
            "use_cache=False with a KVCakeCache: model.generate would feed the whole sequence again at every "
            "step and the cache would store it a second time, so the answer would be wrong. Pass "
            "use_cache=True (a model whose config or generation config says use_cache=False, as training "
            "with gradient checkpointing saves it, needs it explicitly), or no cache"
        )


def _legacy_handoff(layer_idx: int | None, key: torch.Tensor):
    """The cache a release without the kwargs hand-off left for this layer (``cache.LEGACY_PENDING``),
    taken once: the same layer and the very keys its ``update`` returned, else None."""
    pending = LEGACY_PENDING.get()
    if pending is None or pending[1] != layer_idx or pending[2] is not key:
        return None
    LEGACY_PENDING.set(None)
    return pending[0]


def _refuse_stray_cache(kwargs: dict) -> None:
    """A cache that reached the attention as a plain keyword argument was not the model's cache: a
    release before transformers 5.24 takes ``past_key_values=``, and its forward passes an unknown
    ``cache=`` down to here unused, so the prompt would be neither stored nor compressed."""
    stray = kwargs.get("cache")
    if isinstance(stray, Cache):
        raise TypeError(
            f"the model got cache={type(stray).__name__}(...) but this transformers release does not know the "
            "`cache` keyword (it arrived unused in the attention): pass past_key_values=cache, or "
            "**kvcake.with_cache(model, cache), which picks the keyword the installed release takes"
        )


def _plain_sdpa(module, dropout: float, kwargs: dict) -> bool:
    """Whether transformers' SDPA call would be plain causal attention: no dropout while training,
    causal (``is_causal`` as ``sdpa_attention_forward`` reads it), no position bias or soft cap."""
    if (
        (dropout and module.training)
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    ):
        return False
    causal = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True) if causal is None else causal)


def _returns_weights(inner_name: str, kwargs: dict) -> bool:
    """``output_attentions=True`` under the eager kernel, the one whose weights transformers returns
    (SDPA's and the others' are None), outside a compiled step."""
    return (
        inner_name == "eager" and bool(kwargs.get("output_attentions")) and not torch.compiler.is_compiling()
    )


def _make_attention(inner_name: str):
    def kvcake_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        inner = ALL_ATTENTION_FUNCTIONS[inner_name] if inner_name != "eager" else _eager
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        if "cache" in kwargs and isinstance(getattr(module, "layer_idx", None), int):  # a decoder layer's
            _refuse_stray_cache(kwargs)  # (Kosmos-2's generate hands its kwargs to its vision tower too)
        cache = kwargs.pop(HANDOFF, None)
        layer_idx = getattr(module, "layer_idx", None)
        if cache is not None and not (isinstance(layer_idx, int) and layer_idx >= 0):
            # one module for several layers (Zamba's shared block: layer_idx -1, or None in its tied copies):
            # the hand-off came in this call's own kwargs, from the update of the layer it runs for
            layer_idx = cache._unconsumed
        if cache is None and not torch.compiler.is_compiling():  # an older release's hand-off
            cache = _legacy_handoff(layer_idx, key)
        if cache is None or cache._unconsumed != layer_idx:  # any other cache, or none: the stock kernel
            return inner(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
            )
        # Gemma 2's soft cap, GPT-OSS's sinks; any other term refused before the cache moves (kvcake.logit_terms)
        terms = LogitTerms.of(kwargs)
        if dropout:  # (a model in training mode with attention_dropout set)
            raise ValueError(
                f"the attention asks for dropout {dropout}, which kvcake's attention over the kept entries "
                "does not apply: call model.eval() (or set the config's attention_dropout to 0)"
            )
        cache.consume(layer_idx)
        layer = cache.layers[layer_idx]
        if isinstance(layer, SlidingLayer):  # a hybrid model's sliding layer, decoded in its ring
            if layer.static is not None:  # one token over the ring, without the model's mask
                # output_attentions: over the window's tokens, as transformers' (position_weights.py)
                weights = None
                if _returns_weights(inner_name, kwargs):  # a second pass: the output rounds as without it
                    weights = ring_weights(layer, layer.attend(query, scaling, terms, True)[1]).to(
                        query.dtype
                    )
                return layer.attend(query, scaling, terms)[0].to(query.dtype), weights
            out = _sliding_attention(
                cache,
                layer,
                inner,
                module,
                query,
                key,
                value,
                attention_mask,
                scaling=scaling,
                dropout=dropout,
                **kwargs,
            )
            cache._track_bytes(layer_idx)  # after the prompt (or an append): no decode step converts it
            return out
        q = query.shape[2]
        if not cache.prefilled and layer.keys.shape[-2] == q and layer.length == q:
            # the prompt: the model's own kernel on the full keys (or the scorer's, which computes
            # the same attention and its scores in one pass), then score and evict
            valid = key_validity(attention_mask, query.shape[0], key.shape[-2], key.device)
            fused = None
            if inner_name == "sdpa" and _plain_sdpa(module, dropout, kwargs) and not layer.latent:
                fused = cache.prompt_attention(layer_idx, query, key, value, attention_mask, valid, scaling)
            if fused is None:
                out = inner(
                    module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
                )
                sums = None
            else:
                out, sums = (fused[0], None), fused[1]
            cache.after_prefill_attention(layer_idx, module, query, valid, scaling, sums, terms)
            return out
        padded = None  # tokens appended several at a time: any padding among them settled first
        if q > 1 and not torch.compiler.is_compiling():
            padded = _settle_padded_append(cache, layer, attention_mask, query.shape[0], q)
        want = cache.wants_probs(layer_idx, q)
        if layer.plain:  # every position in order, as a full cache holds them: the model's own kernel,
            out = inner(  # so the output rounds exactly as a full cache's (bf16 on CUDA: a float32
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
            )  # attention here flipped a near-tied greedy token of h2o's, H100, 2026-11-26)
            if want:  # the scorer's probabilities beside it (H2O's sums accumulate from the first step)
                probs = layer.attend(query_over(layer, module, query), scaling, True, terms)[1]
                cache.after_extend_attention(layer_idx, probs)
            if q > 1:  # a multi-token append: into static storage now if it will evict (decoding.plan)
                cache.lay_out_after_append(layer_idx)
            return out
        over = query_over(layer, module, query)  # (latent: absorbed)
        out, probs = layer.attend(over, scaling, want, terms)
        weights = None  # output_attentions: the kept entries' weights by position (position_weights.py)
        if _returns_weights(inner_name, kwargs):
            held = probs if probs is not None else layer.attend(over, scaling, True, terms)[1]
            weights = by_position(layer, held, query.shape[1], layer.length).to(query.dtype)
        if padded is not None and probs is not None:  # the pads' own rows read as their sequence's
            probs = real_rows(probs, padded)
        cache.after_extend_attention(layer_idx, probs)
        if q > 1:  # a multi-token append (a context's question): back into static storage now
            cache.lay_out_after_append(layer_idx)
        out = expand_output(module, out) if layer.latent else out  # (B, q, H, d_v)
        return out.to(query.dtype), weights

    kvcake_attention.__name__ = f"{PREFIX}{inner_name}"
    return kvcake_attention


@functools.cache
def register(inner_name: str) -> str:
    """Register ``kvcake_<inner_name>`` (attention and mask) once; returns the new name."""
    if inner_name.startswith(PREFIX):
        return inner_name
    if inner_name != "eager" and inner_name not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"unknown attention implementation {inner_name!r}")
    name = PREFIX + inner_name
    AttentionInterface.register(name, _make_attention(inner_name))
    mask_fn = ALL_MASK_ATTENTION_FUNCTIONS.get(inner_name) or ALL_MASK_ATTENTION_FUNCTIONS["eager"]
    AttentionMaskInterface.register(name, mask_fn)
    return name


def _set_impl(model: torch.nn.Module, name: str) -> None:
    for sub in model.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name


@contextlib.contextmanager
def enable(model: torch.nn.Module, sdpa: str = "auto") -> Iterator[torch.nn.Module]:
    """Run ``model`` with the kvcake attention inside the block; restored on exit, errors included.

    A KVCakeCache passed as ``cache`` (``past_key_values`` before transformers 5.24) inside the
    block compresses itself; any other cache (or none) runs exactly as before (a model loaded with
    ``attn_implementation="flex_attention"`` runs SDPA inside the block, the same attention). ``sdpa``: the SDPA
    backend policy of the block's attention calls (``kvcake.sdpa``; ``"auto"``: flash, then
    memory-efficient, then math on CUDA, SDPA's own choice elsewhere; ``"default"``: SDPA's own
    choice everywhere). Blocks on one model, nested or in several threads at once, share one
    installation: the first block's ``sdpa`` holds until the last one ends, which restores the model.
    """
    check_policy(sdpa)
    describe_model(model)
    with _HELD_LOCK:
        held = _HELD.get(model)
        if held is None and not (model.config._attn_implementation or "").startswith(PREFIX):
            held = _HELD[model] = _install(model, sdpa)
        if held is not None:
            held.count += 1
    try:
        yield model
    finally:
        LEGACY_PENDING.set(None)
        if held is not None:
            with _HELD_LOCK:
                held.count -= 1
                if held.count == 0:
                    del _HELD[model]
                    held.restore.close()


@dataclasses.dataclass
class _Held:
    """One model's installation of the kvcake attention: the blocks inside it, and its undoing."""

    restore: contextlib.ExitStack
    count: int = 0


_HELD: weakref.WeakKeyDictionary[torch.nn.Module, _Held] = weakref.WeakKeyDictionary()
_HELD_LOCK = threading.Lock()


def _install(model: torch.nn.Module, sdpa: str) -> _Held:
    """Switch ``model`` (and every sub-model's config) to the kvcake attention, refuse
    ``use_cache=False`` beside a KVCakeCache, and hold the SDPA policy; the returned stack undoes it."""
    configs = [(sub.config, sub.config._attn_implementation) for sub in model.modules()
               if getattr(sub, "config", None) is not None and hasattr(sub.config, "_attn_implementation")]  # fmt: skip
    original = model.config._attn_implementation or "eager"
    # flex_attention's mask is a BlockMask, which kvcake cannot read (padding, positions), and the CPU
    # kernel with a tensor mask as score mod crashed the process (torch 2.13): SDPA computes the same,
    # or eager where the model caps its logits or has sinks (SDPA has neither)
    if original == "flex_attention":
        original = "eager" if model_terms(model) else "sdpa"
    name = register(original)

    def configs_back() -> None:
        for config, impl in configs:
            config._attn_implementation = impl

    with contextlib.ExitStack() as restore:
        restore.callback(configs_back)
        for m in model.modules():  # the model's call, and a wrapped model's (PEFT's calls its base's)
            if m is model or isinstance(m, GenerationMixin):
                restore.callback(m.register_forward_pre_hook(_refuse_use_cache_off, with_kwargs=True).remove)
        _set_impl(model, name)
        restore.enter_context(sdpa_policy(sdpa, input_device(model)))
        return _Held(restore.pop_all())
