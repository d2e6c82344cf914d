"""Which layers of a model are of which kind, read from its config as transformers' caches read it:
full attention (compressed by kvcake), sliding-window and chunked attention (kept as transformers
keeps them, ``sliding.py``), linear-attention and convolution layers holding a fixed-size state, and
blocks without attention (both ``recurrent.py``), full attention beside a recurrent block
(``hybrid_layer.py``); and the kinds kvcake refuses (KV sharing, sliding-window attention beside a
recurrent block), with the reason."""

from __future__ import annotations

from collections.abc import Sequence

from .recurrent import RECURRENT_TYPES, check_supported

# Layer types attending a bounded span, which transformers holds in a sliding-window layer (the
# chunk size in its "sliding_window" keyword for a chunked one)
WINDOWED = ("sliding_attention", "chunked_attention")
_NAMES = {"sliding_attention": "sliding-window", "chunked_attention": "chunked"}

try:  # transformers 5.24's heterogeneous configs (Gemma 4): a per-layer field read as one raises this
    from transformers.integrations.heterogeneity.configuration_utils import (
        AmbiguousGlobalPerLayerAttributeError as PerLayerAttributeError,
    )
except ImportError:  # earlier releases set every field once

    class PerLayerAttributeError(RuntimeError):
        """Never raised: a release without per-layer configs."""


try:  # transformers >= 5.x: per-layer types and kwargs, inferred the way its caches infer them
    from transformers.cache_utils import get_layer_types_and_kwargs
except ImportError:  # transformers 5.0 (our floor) lacks the helper: read the config as its caches do
    get_layer_types_and_kwargs = None


def layer_windows(text, mtype: str) -> tuple[int | None, ...]:
    """Per layer, the sliding window or the chunk (a sliding or chunked layer, left to transformers:
    :func:`chunked_layers` says which), or None (a full-attention layer, compressed by kvcake, or a
    layer holding no keys: :func:`recurrent_layers`), read with transformers' own
    ``get_layer_types_and_kwargs`` (which also infers the types of configs without ``layer_types``
    from ``sliding_window`` / ``attention_chunk_size``).

    Raises ``ValueError`` for KV sharing and unknown layer types, and for a model none of whose
    attention layers is full attention: its cache is already bounded, nothing to compress."""
    types, kwargs = _layer_types(text)
    max_pos = getattr(text, "max_position_embeddings", None) or 1 << 30
    windows: list[int | None] = []
    for i, (kind, kw) in enumerate(zip(types, kwargs, strict=True)):
        window = _window(text, kind, kw)
        if (
            kind in ("full_attention", "hybrid")  # hybrid: a recurrent block beside (hybrid_layer.py)
            or kind in RECURRENT_TYPES
            or (kind in WINDOWED and (window is None or window >= max_pos))
        ):
            windows.append(None)  # a window (or a chunk) beyond every position is full attention
        elif kind in WINDOWED:
            windows.append(int(window))
        elif kind == "dummy" and not _shares_kv(text):  # a block without attention (Nemotron-H's MLP/MoE)
            windows.append(None)
        elif kind == "dummy":  # transformers' name for a layer that reads another layer's cache
            raise ValueError(
                f"{mtype}: layer {i} stores no keys and reads an earlier layer's (KV sharing, e.g. Gemma 3n), "
                "which kvcake does not support: evicting for one layer would evict for the layers that share it"
            )
        elif kind == "hybrid_sliding":
            raise ValueError(
                f"{mtype}: layer {i} runs sliding-window attention and a recurrent block side by side in one "
                "cache layer, which kvcake does not support (it does full attention beside one: Falcon-H1); "
                "use a DynamicCache for this model"
            )
        else:
            raise ValueError(
                f"{mtype}: layer {i} is of type {kind!r}, which kvcake does not support (only "
                "full, sliding, chunked and linear-attention layers); use a DynamicCache for this model"
            )
    attending = [w for w, kind in zip(windows, types, strict=True) if kind not in (*RECURRENT_TYPES, "dummy")]
    if not attending:
        raise ValueError(
            f"{mtype}: no layer of this model attends over its keys: kvcake has nothing to compress"
        )
    if all(w is not None for w in attending):
        kinds = " and ".join(sorted({_NAMES[kind] for kind in types if kind in WINDOWED}))
        raise ValueError(
            f"{mtype}: every layer uses {kinds} attention (window {attending[0]}), so its cache is "
            "already bounded and kvcake has no full-attention layer to compress; use transformers' "
            "DynamicCache, or set config.sliding_window=None if the model was trained without it"
        )
    return tuple(windows) if any(w is not None for w in windows) else ()


def attention_shape(text, layers: Sequence[int], mtype: str) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of the attention ``layers`` (those kvcake compresses): the
    config's, or each layer's where the config sets them per layer (transformers' heterogeneous configs:
    Gemma 4's global layers have a head dim and KV heads of their own). Raises ``ValueError`` where those
    layers differ, which one cache shape does not cover."""
    per_layer = getattr(text, "per_layer_config", None)
    if per_layer is None and getattr(text, "global_head_dim", None):
        # Gemma 4 before per-layer configs (5.12): its full-attention layers' own shape
        alternative = getattr(text, "attention_k_eq_v", False)
        kv = text.num_global_key_value_heads if alternative else text.num_key_value_heads
        return text.num_attention_heads, kv, text.global_head_dim
    views = [per_layer[i] for i in layers] if per_layer is not None else [text]
    shapes = set()
    for view in views:
        heads = getattr(view, "num_attention_heads", None)
        if heads is None:
            raise ValueError(f"{mtype}: cannot find num_attention_heads in the config")
        kv = getattr(view, "num_key_value_heads", None) or heads
        shapes.add((heads, kv, getattr(view, "head_dim", None) or view.hidden_size // heads))
    if len(shapes) > 1:
        raise ValueError(
            f"{mtype}: its full-attention layers differ in (query heads, KV heads, head dim): {sorted(shapes)}, "
            "which kvcake does not support (one shape for the layers it compresses); use a DynamicCache"
        )
    return shapes.pop()


def chunked_layers(text) -> tuple[int, ...]:
    """The layers attending within chunks (Llama 4: ``chunked_attention``, ``attention_chunk_size``
    tokens each) among those :func:`layer_windows` gives a window: ``sliding.py`` keeps them whole."""
    types, kwargs = _layer_types(text)
    max_pos = getattr(text, "max_position_embeddings", None) or 1 << 30
    return tuple(
        i
        for i, (kind, kw) in enumerate(zip(types, kwargs, strict=True))
        if kind == "chunked_attention" and (_window(text, kind, kw) or max_pos) < max_pos
    )


def recurrent_layers(text, mtype: str) -> tuple[tuple[int, int], ...]:
    """(layer, number of states) for each layer holding no per-token keys (``recurrent.py``): a
    linear-attention or convolution layer's fixed-size states, 0 states for a block without
    attention. Raises ``ValueError`` where this transformers cannot hold them."""
    types, kwargs = _layer_types(text)
    blocks = getattr(
        text, "layers_block_type", None
    )  # releases before 5.2x: "mamba" / "attention" (Jamba, Bamba)
    if {*types, *(blocks if isinstance(blocks, (list, tuple)) else ())} & {
        *RECURRENT_TYPES,
        "mamba",
        "hybrid",
    }:
        check_supported(mtype)  # before anything reads an old release's block names as attention types
    held = tuple(
        (i, kw.get("number_of_states", 1) if kind in RECURRENT_TYPES else 0)
        for i, (kind, kw) in enumerate(zip(types, kwargs, strict=True))
        if kind in RECURRENT_TYPES or (kind == "dummy" and not _shares_kv(text))
    )
    return held


def hybrid_layers(text, mtype: str) -> tuple[tuple[int, int], ...]:
    """(layer, number of states) for each full-attention layer that also holds a recurrent block's
    states (layer type ``"hybrid"``: Falcon-H1; ``hybrid_layer.py``). Raises ``ValueError`` where this
    transformers cannot hold them."""
    types, kwargs = _layer_types(text)
    held = tuple(
        (i, kw.get("number_of_states", 1)) for i, (kind, kw) in enumerate(zip(types, kwargs, strict=True))
        if kind == "hybrid"
    )  # fmt: skip
    if held:
        check_supported(mtype)
    return held


def _window(text, kind: str, kw: dict) -> int | None:
    """A sliding layer's window, a chunked layer's chunk (transformers' ``sliding_window`` keyword for
    both; read from the config where an older release's kwargs lack it)."""
    window = kw.get("sliding_window")
    if window is None and kind == "chunked_attention":
        window = getattr(text, "attention_chunk_size", None)
    return window


def _layer_types(text) -> tuple[list[str], list[dict]]:
    types, kwargs = (get_layer_types_and_kwargs or _config_layer_types)(text)
    if isinstance(kwargs, dict):  # transformers before 5.2x (5.17 seen): one dict for every layer
        kwargs = [kwargs] * len(types)
    return types, kwargs


def _shares_kv(text) -> bool:
    """Whether the config marks layers that read another layer's cache (transformers' "dummy" too)."""
    return (
        bool(getattr(text, "num_kv_shared_layers", None))
        or getattr(text, "kv_sharing_modes", None) is not None
    )


def _config_layer_types(text) -> tuple[list[str], list[dict]]:
    """What transformers 5.0's caches read from a config: ``layer_types`` if given, else every
    layer sliding (``sliding_window``), chunked (``attention_chunk_size``) or full attention."""
    n = text.num_hidden_layers
    types = getattr(text, "layer_types", None)
    if types is None:
        if getattr(text, "sliding_window", None) is not None:
            types = ["sliding_attention"] * n
        elif getattr(text, "attention_chunk_size", None) is not None:
            types = ["chunked_attention"] * n
        else:
            types = ["full_attention"] * n
    kwargs = []
    for kind in types:
        if kind == "sliding_attention":
            kwargs.append({"sliding_window": getattr(text, "sliding_window", None)})
        elif kind == "chunked_attention":
            kwargs.append({"sliding_window": getattr(text, "attention_chunk_size", None)})
        else:
            kwargs.append({})
    return list(types), kwargs


def latent_dims(text_config) -> tuple[int, int] | None:
    """(kv_lora_rank, qk_rope_head_dim) of a latent-attention (MLA) model's config, else None."""
    rank = getattr(text_config, "kv_lora_rank", None)
    return (int(rank), int(text_config.qk_rope_head_dim)) if rank else None
