"""What kvcake reads from a model's code rather than its config: whether the model takes a KV cache at
all, whether its layers' attention calls transformers' attention interface (the only way the kvcake
attention runs), and whether that attention hands its kwargs to ``cache.update``. Each answer is read
once per class."""

from __future__ import annotations

import functools
import inspect
import re

import torch
from transformers import PreTrainedModel

# The registry ``attn_implementation`` selects from; an attention module that never reads it computes
# attention in its own code, where the kvcake attention (``AttentionInterface.register``) cannot run
_INTERFACE = "ALL_ATTENTION_FUNCTIONS"
# A cache's update, its arguments next: ``cache.update(``, ``past_key_values.update(``, ``layer_past.update(``
_CACHE_UPDATE = re.compile(r"\b\w*(?:cache|past)\w*\.update\(")


def check_takes_cache(model: torch.nn.Module, mtype: str) -> None:
    """Raise ``ValueError`` where no forward of ``model`` (its own, its language model's, any
    transformers model inside it) takes a ``Cache`` (``cache`` or ``past_key_values``): GPT-1, RWKV
    (its own state), XLNet (``mems``), Reformer; kvcake would have nothing to hand the cache to."""
    if any(forward_cache_keyword(type(m)) for m in model.modules() if isinstance(m, PreTrainedModel)):
        return
    raise ValueError(
        f"{mtype}: {type(model).__name__}'s forward takes no KV cache (neither `cache` nor `past_key_values`), "
        "so kvcake has no cache to compress; it supports models that generate over a transformers Cache"
    )


def check_attention_calls(model: torch.nn.Module, mtype: str) -> None:
    """Raise ``ValueError`` where no module of ``model``'s layers (one with a ``layer_idx`` attribute) calls
    transformers' attention interface: Bloom and MPT (ALiBi), XGLM, GIT, CPM-Ant and other ports whose
    attention is written out in their own code, where ``attn_implementation`` and so the kvcake
    attention never run; their cache would be updated and nothing compressed (``cache.py`` says so at
    run time for a model where only some layers bypass the interface)."""
    # (Zamba's one attention block serves several layers: its layer_idx is None)
    layers = [m for m in model.modules() if hasattr(m, "layer_idx") and not isinstance(m, PreTrainedModel)]
    if any(calls_attention_interface(type(m)) for m in layers):
        return
    names = sorted({type(m).__name__ for m in layers})[:2] or [type(model).__name__]
    raise ValueError(
        f"{mtype}: its attention is computed in the model's own code ({', '.join(names)}), not through "
        "transformers' attention interface (ALL_ATTENTION_FUNCTIONS, which attn_implementation selects), so "
        "kvcake's attention would never run and nothing would be compressed; use a DynamicCache for this model"
    )


@functools.cache
def calls_attention_interface(cls: type) -> bool:
    """Whether a method of ``cls`` (or of its bases below ``nn.Module``), or a function of its module
    one of them calls, reads transformers' attention registry (``ALL_ATTENTION_FUNCTIONS``), read from
    the compiled code: the names each code object loads, its nested functions, the functions it calls
    by global name."""
    pending = [code for klass in cls.__mro__ if klass not in (torch.nn.Module, object)
               for code in map(_code, vars(klass).values()) if code is not None]  # fmt: skip
    seen: set = set()
    while pending:
        code, scope = pending.pop()
        if code in seen:
            continue
        seen.add(code)
        if _INTERFACE in code.co_names:
            return True
        pending += [(c, scope) for c in code.co_consts if inspect.iscode(c)]
        pending += [found for name in code.co_names if (found := _code(scope.get(name))) is not None]
    return False


def _code(obj) -> tuple | None:
    """(code object, its globals) of a function, method, static or class method or property; else None."""
    obj = getattr(obj, "fget", None) or getattr(obj, "__func__", obj)
    if not inspect.isfunction(obj):
        return None
    obj = inspect.unwrap(obj)
    return (obj.__code__, obj.__globals__) if inspect.isfunction(obj) else None


def hands_kwargs_to_cache(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention hands its attention kwargs to ``cache.update`` (``update(k, v,
    layer_idx, kwargs=kwargs)``), the hand-off a compiled kvcake step needs (``cache.HANDOFF``).
    transformers' models do from 5.24 (5.0-5.3 pass ``cache_kwargs``, 5.6-5.23 nothing: checked on
    5.0.0, 5.1.0, 5.3.0, 5.6.0, 5.10.4, 5.15.0, 5.18.0, 5.20.2-5.23.0); GPT-NeoX's not even in 5.24.
    True where every class of the model whose forward updates a cache hands ``kwargs=`` in each call
    (read from the source); False where none does, or none can be read."""
    found = [forward_hands_kwargs(type(m)) for m in model.modules()]
    return any(found) and False not in found


@functools.cache
def forward_hands_kwargs(cls: type) -> bool | None:
    """Whether every cache update in ``cls.forward``'s source hands ``kwargs=``; None where it has
    none, or its source cannot be read."""
    try:
        source = inspect.getsource(cls.forward)
    except (TypeError, OSError):
        return None
    handed = []
    for call in _CACHE_UPDATE.finditer(source):
        depth, end = 1, call.end()
        while depth and end < len(source):  # to the call's closing parenthesis
            depth += {"(": 1, ")": -1}.get(source[end], 0)
            end += 1
        handed.append("kwargs=" in source[call.end() : end])
    return all(handed) if handed else None


@functools.cache
def forward_cache_keyword(cls: type) -> str | None:
    """``cache`` or ``past_key_values``, the name under which ``cls.forward`` takes a Cache; None if neither."""
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):  # an opaque forward
        return None
    return next((name for name in ("cache", "past_key_values") if name in params), None)
