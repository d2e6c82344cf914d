"""Cross-attention layers (Mllama, Llama 3.2 Vision): the image's keys and values, never compressed.

Mllama interleaves layers that attend to the image's states (``config.cross_attention_layers``)
with ordinary self-attention layers. A cross-attention layer's cache holds the projected image
tokens (``(B, H_kv, image tokens, d)``), written once, when the image is encoded, and read at
every later step; no budget over the prompt applies to it. A
:class:`~kvcake.cache.KVCakeCache` holds a :class:`CrossLayer` there: transformers' own
``DynamicLayer`` plus the counts kvcake reports, and the batch operations of beam search. Every
method, budget and allocation applies to the self-attention layers only (``info.cross`` is
outside ``info.compressed_layers``), and the model's own kernel attends a cross layer (its update
hands no cache to the kvcake attention). A text-only prompt leaves these layers empty, as the
model skips them.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import DynamicLayer

from .layer import KVCakeLayer


class CrossLayer(DynamicLayer):
    """transformers' ``DynamicLayer`` for a cross-attention layer, plus kvcake's bookkeeping
    (module docstring). Holds keys/values ``(B, H_kv, image tokens, d)``, or nothing."""

    is_croppable = False  # the cache as a whole cannot be cropped (its self-attention layers evicted)
    static = None  # never in static storage: the step writes nothing here
    plan = False  # nothing to hand the kvcake attention: the model's kernel attends the image

    @property
    def held(self) -> bool:
        """Whether the layer holds the image's states (transformers' lazy initialisation leaves an
        empty 1-D tensor; a text-only prompt, nothing)."""
        return self.keys is not None and self.keys.dim() == 4

    @property
    def batch(self) -> int:
        return self.keys.shape[0] if self.held else 0

    @property
    def counts(self) -> np.ndarray | None:
        """(B, H_kv) image entries held per sequence and KV head; None while empty."""
        if not self.held:
            return None
        b, hkv, n = self.keys.shape[:3]
        return np.full((b, hkv), n, dtype=np.int64)

    def kv_bytes(self) -> int:
        if not self.held:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def entries(self) -> int:
        counts = self.counts
        return 0 if counts is None else int(counts.sum())

    # beam search, a batch repeated or cut (``kvcake.sequences``), as for the compressed layers
    reorder_cache = KVCakeLayer.reorder_cache
    batch_repeat_interleave = KVCakeLayer.batch_repeat_interleave
    batch_select_indices = KVCakeLayer.batch_select_indices

    def select_rows(self, rows: torch.Tensor, host: np.ndarray) -> None:
        """Keep the sequences ``rows`` (B',) in that order."""
        if not self.held:
            return
        self.keys = self.keys.index_select(0, rows.to(self.keys.device))
        self.values = self.values.index_select(0, rows.to(self.values.device))


def cross_entry(layer: CrossLayer) -> dict:
    """The JSON facts a saved context keeps for a cross-attention layer (its keys/values alongside)."""
    return {"layout": "cross", "empty": not layer.held}


def restore_cross(layer, keys, values, entry: dict, device) -> str | None:
    """Load a saved cross-attention layer into ``layer``; returns what does not fit, or None."""
    if not isinstance(layer, CrossLayer):
        return f"a cross-attention layer where the model has {type(layer).__name__}"
    if entry.get("empty"):
        return None
    if keys.dim() != 4 or keys.shape[:3] != values.shape[:3]:
        return f"cross-attention keys {tuple(keys.shape)} and values {tuple(values.shape)} do not fit"
    layer.lazy_initialization(keys.to(device), values.to(device))
    layer.keys, layer.values = keys.to(device), values.to(device)
    return None
