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
    """Bytes of keys and values of a cache, in parts.

    sliding: held by the sliding-window layers (at most their window); compressed: held by the
    full-attention layers kvcake compresses; full: what transformers' ``DynamicCache`` would
    hold for the same tokens (sliding layers at their window, global layers every token)."""

    sliding: int
    compressed: int
    full: int

    @property
    def total(self) -> int:
        return self.sliding + self.compressed

    @property
    def fraction(self) -> float:
        """Held bytes as a fraction of the full cache's."""
        return self.total / self.full if self.full else 1.0


def kv_bytes_parts(cache: Cache) -> KVBytes:
    """Split a KVCakeCache's bytes into sliding and compressed layers, against the full cache."""
    sliding = compressed = full = 0
    for layer in cache.layers:
        if layer.keys is None:
            continue
        held = layer.kv_bytes()
        if isinstance(layer, SlidingLayer):
            sliding += held
            full += held
        else:
            compressed += held
            b, hkv = layer.batch, layer.kv_heads
            entry = layer.keys.shape[-1] * layer.keys.element_size() + layer.values.shape[-1] * layer.values.element_size()
            full += b * hkv * layer.length * entry
    return KVBytes(sliding, compressed, full)
