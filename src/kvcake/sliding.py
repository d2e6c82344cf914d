"""Sliding-window layers of hybrid models (Gemma 3, ...): left exactly as transformers keeps them.

A hybrid model interleaves sliding-window layers, whose cache is already bounded by the window,
with a few full-attention ("global") layers. A :class:`~kvcake.cache.KVCakeCache` holds a
:class:`SlidingLayer` for each sliding layer: transformers' own ``DynamicSlidingWindowLayer``
plus the byte and entry counts kvcake reports. The cache never scores or evicts these layers,
the kvcake attention hands them straight to the model's kernel, and transformers builds their
sliding masks from ``get_mask_sizes`` as it does for a ``DynamicCache``. Every compression
method, budget and allocation applies to the global layers only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer


class SlidingLayer(DynamicSlidingWindowLayer):
    """transformers' ``DynamicSlidingWindowLayer``, untouched, plus kvcake's bookkeeping.

    Holds keys/values ``(B, H_kv, min(seen, window - 1), d)``, the last ``window - 1`` entries
    (the query itself makes ``window``)."""

    is_croppable = False  # the cache as a whole cannot be cropped (its global layers evicted)

    @property
    def length(self) -> int:
        """Logical columns seen, as ``KVCakeLayer.length``."""
        return self.cumulative_length

    @property
    def batch(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    @property
    def counts(self) -> np.ndarray | None:
        """(B, H_kv) entries held per sequence and KV head."""
        if self.keys is None:
            return None
        b, hkv, n = self.keys.shape[:3]
        return np.full((b, hkv), n, dtype=np.int64)

    def kv_bytes(self) -> int:
        if not self.is_initialized or self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def entries(self) -> int:
        counts = self.counts
        return 0 if counts is None else int(counts.sum())


@dataclass(frozen=True)
class KVBytes:
    """Bytes (and entries) of keys and values of a cache, in parts.

    sliding: held by the sliding-window layers (at most their window); compressed: held by the
    full-attention layers kvcake compresses; full: what transformers' ``DynamicCache`` would
    hold for the same tokens (sliding layers at their window, global layers every token).
    ``entries`` / ``full_entries``: the same totals in (sequence, layer, KV head, token) entries."""

    sliding: int
    compressed: int
    full: int
    entries: int = 0
    full_entries: int = 0

    @property
    def total(self) -> int:
        return self.sliding + self.compressed

    @property
    def fraction(self) -> float:
        """Held bytes as a fraction of the full cache's."""
        return self.total / self.full if self.full else 1.0


def kv_bytes_parts(cache: Cache) -> KVBytes:
    """Split a KVCakeCache's bytes into sliding and compressed layers, against the full cache."""
    sliding = compressed = full = entries = full_entries = 0
    for layer in cache.layers:
        if layer.keys is None:
            continue
        held = layer.kv_bytes()
        entries += layer.entries()
        if isinstance(layer, SlidingLayer):
            sliding += held
            full += held
            full_entries += layer.entries()
        else:
            compressed += held
            n = layer.batch * layer.kv_heads * layer.length
            entry = (
                layer.keys.shape[-1] * layer.keys.element_size()
                + layer.values.shape[-1] * layer.values.element_size()
            )
            full += n * entry
            full_entries += n
    return KVBytes(sliding, compressed, full, entries, full_entries)


def copy_sliding_state(source, target: SlidingLayer) -> None:
    """Give ``target`` what the sliding layer ``source`` of a full ``DynamicCache`` holds (the
    last ``window - 1`` keys/values and the count of tokens seen), e.g. to replay a recorded
    full-cache forward into a KVCakeCache. A layer that kept every token is cut to the window."""
    seen = getattr(source, "cumulative_length", None)
    if seen is None:  # a plain DynamicLayer: it holds every token
        seen = source.keys.shape[-2]
    keep = target.sliding_window - 1
    target.lazy_initialization(source.keys, source.values)
    target.keys, target.values = source.keys[:, :, -keep:], source.values[:, :, -keep:]
    target.cumulative_length = int(seen)


def sliding_entry(layer: SlidingLayer) -> dict:
    """The JSON facts a saved context keeps for a sliding layer (its keys/values go alongside)."""
    return {"layout": "sliding", "window": int(layer.sliding_window), "length": int(layer.cumulative_length)}


def restore_sliding(layer: SlidingLayer, keys, values, entry: dict, device) -> str | None:
    """Load a saved sliding layer into ``layer``; returns what does not fit, or None."""
    if not isinstance(layer, SlidingLayer) or entry.get("window") != layer.sliding_window:
        return f"a sliding layer of window {entry.get('window')} where the model has {type(layer).__name__}"
    if keys.dim() != 4 or keys.shape != values.shape or keys.shape[2] > layer.sliding_window - 1:
        return f"sliding keys {tuple(keys.shape)} do not fit its window {layer.sliding_window}"
    layer.lazy_initialization(keys.to(device), values.to(device))
    layer.keys, layer.values = keys.to(device), values.to(device)
    layer.cumulative_length = int(entry["length"])
    return None
