"""Sliding-window layers of hybrid models (Gemma 3, ...): never compressed, decoded in place.

A hybrid model interleaves sliding-window layers, whose cache is already bounded by the window,
with a few full-attention ("global") layers. A :class:`~kvcake.cache.KVCakeCache` holds a
:class:`SlidingLayer` for each sliding layer: transformers' own ``DynamicSlidingWindowLayer``
plus the byte and entry counts kvcake reports. The cache never scores or evicts these layers.
The prompt, and any multi-token append, go through transformers' own layer and the model's
kernel and mask, exactly as a ``DynamicCache``'s, but for padding among appended tokens (follow-ups
of different lengths in one batch), which the layer settles with a mask of its own
(``kvcake.sliding_appends``). Every compression method, budget and allocation applies to the
global layers only.

Decoding with static storage (the cache's default, ``static=True``), a sliding layer moves at
its first single-token step into a *ring* of ``window`` slots (``static == "ring"``; no more than
the cache's ``max_cache_len`` where that is known, as transformers' static sliding layers, grown
to the window by an eager step past it): token ``p`` is written in place at slot ``p % window``,
over the one that left the window, and the kvcake attention reads every slot holding a token
(``valid``: not empty, not padding) without the model's mask. Nothing in a step depends on a host
count (the tokens seen are a device tensor while compiling, read back once when asked), so a
compiled step is one graph for hybrid models too. A multi-token append moves the layer back to
transformers' layout first. Slots are in ring order, not position order, so the attention sums in
another order than the model's kernel on the dynamic layer: equal up to float rounding (tests),
not bit for bit.

Chunked layers (Llama 4's ``chunked_attention``) are the same layer with ``chunked=True``: a token
attends the tokens of its chunk (``C`` tokens, the chunk size, held as the window, as transformers
holds it), and transformers keeps the last ``C - 1`` tokens, the model's chunked mask hiding those
of earlier chunks. Chunks start at each row's first token (column ``pad + kC`` after ``pad`` left
padding columns, as transformers' mask counts them). In the ring a row keeps its place in its chunk
(``phase``, read from the model's mask when the ring is laid out: the tokens its last row sees,
less one) and a token opening a chunk hides every other slot of its row; the slots written since
are its chunk's (``tests/test_chunked.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from .cross import CrossLayer
from .dense import folded_attention
from .devices import cache_kv_bytes, owned, storage_bytes  # noqa: F401 (cache_kv_bytes: kvcake.cache's)
from .layer import KVCakeLayer
from .logit_terms import PLAIN, LogitTerms
from .recurrent import LinearAttentionLayer, RecurrentLayer, state_bytes
from .step.common import PAST_CAPACITY


class SlidingLayer(DynamicSlidingWindowLayer):
    """transformers' ``DynamicSlidingWindowLayer`` plus kvcake's bookkeeping and the ring (module
    docstring).

    Holds keys/values ``(B, H_kv, min(seen, window - 1), d)``, the last ``window - 1`` entries
    (the query itself makes ``window``), or in the ring ``(B, H_kv, window, d)`` (fewer slots where
    ``capacity`` is less)."""

    is_croppable = False  # the cache as a whole cannot be cropped (its global layers evicted)

    def __init__(self, sliding_window: int, chunked: bool = False, **kwargs) -> None:
        self._seen, self._seen_on_device = 0, False
        self.chunked = chunked  # attends within chunks of ``sliding_window`` tokens (module docstring)
        super().__init__(sliding_window=sliding_window, **kwargs)  # by name: 5.8.1-5.13.1 take a config first
        self.plan = False  # decode in the ring (the cache's static storage), from the next step
        self.capacity: int | None = None  # the cache's max_cache_len: a ring no longer (None: the window)
        self.static: str | None = None  # "ring" while decoding in place
        self.valid: torch.Tensor | None = None  # (B, window) bool: ring slots holding a token
        self.seen: torch.Tensor | None = None  # 0-d long: tokens seen, counted on the device
        # padding settled among appended tokens (kvcake.sliding_appends): the model's mask no longer
        # describes the layer; held_valid (B, held) says which held columns are tokens (None in the ring)
        self.settled, self.held_valid = False, None

    @property
    def takes_padding(self) -> bool:
        """Padding among appended tokens is settled (``kvcake.sliding_appends``), not in chunks."""
        return not self.chunked

    def attended(self, q: int) -> bool:
        """Whether the kvcake attention takes this call of ``q`` tokens, just stored (else the model's
        kernel): the ring (or into it), an append of several tokens (any padding settled), a settled
        layer's every call."""
        return self.plan or self.settled or (q > 1 and self.length > q)

    @property
    def cumulative_length(self) -> int:
        """Tokens seen (transformers' count); read back once from the device after compiled steps."""
        if self._seen_on_device:
            self._seen, self._seen_on_device = int(self.seen), False
        return self._seen

    @cumulative_length.setter
    def cumulative_length(self, value: int) -> None:
        self._seen, self._seen_on_device = int(value), False

    @property
    def length(self) -> int:
        """Logical columns seen, as ``KVCakeLayer.length``."""
        return self.cumulative_length

    @property
    def batch(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    @property
    def counts(self) -> np.ndarray | None:
        """(B, H_kv) entries held per sequence and KV head (in the ring: its slots holding a token
        or padding, ``min(seen, window)``)."""
        if self.keys is None:
            return None
        b, hkv, n = self.keys.shape[:3]
        if self.static is not None:
            n = min(self.length, self.sliding_window)
        return np.full((b, hkv), n, dtype=np.int64)

    def kv_bytes(self) -> int:
        """Bytes held: the ring's slots all count (allocated memory), its ``valid`` flags too."""
        if not self.is_initialized or self.keys is None:
            return 0
        held = self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
        flags = self.valid if self.valid is not None else self.held_valid
        return held + (flags.numel() if flags is not None else 0)

    def dynamic_entries(self) -> int:
        """Entries transformers' ``DynamicSlidingWindowLayer`` holds for the same tokens."""
        if not self.is_initialized or self.keys is None:
            return 0
        return self.keys.shape[0] * self.keys.shape[1] * min(self.length, self.sliding_window - 1)

    def dynamic_bytes(self) -> int:
        """Bytes of :meth:`dynamic_entries`."""
        if not self.is_initialized or self.keys is None:
            return 0
        entry = (
            self.keys.shape[-1] * self.keys.element_size()
            + self.values.shape[-1] * self.values.element_size()
        )
        return self.dynamic_entries() * entry

    def entries(self) -> int:
        counts = self.counts
        return 0 if counts is None else int(counts.sum())

    # -- transformers' interface ---------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.static is not None:
            if key_states.shape[-2] == 1:
                return self._ring_append(key_states, value_states)
            self.to_dynamic()  # a multi-token append: transformers' layout, the model's mask
        out = super().update(key_states, value_states, *args, **kwargs)
        self.keys, self.values = owned(self.keys), owned(self.values)  # a slice of the whole: its own copy
        return out

    def get_seq_length(self) -> int | torch.Tensor:
        if self.static is not None and torch.compiler.is_compiling():
            return self.seen + 0  # a 0-d tensor, as a StaticLayer's cumulative_length
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        self.static, self.valid, self.seen = None, None, None
        self.settled, self.held_valid = False, None
        self.cumulative_length = 0

    # beam search, a batch repeated or cut (``kvcake.sequences``), as for the compressed layers
    reorder_cache = KVCakeLayer.reorder_cache
    batch_repeat_interleave = KVCakeLayer.batch_repeat_interleave
    batch_select_indices = KVCakeLayer.batch_select_indices

    def select_rows(self, rows: torch.Tensor, host: np.ndarray) -> None:
        """Keep the sequences ``rows`` (B',) in that order: in place in the ring where the batch keeps
        its size (its addresses held), else in transformers' layout (the ring is laid out again at
        the next step, from the model's mask)."""
        if self.static is not None and len(host) == self.batch:
            for t in (self.keys, self.values, self.valid, self.phase):
                t.copy_(t.index_select(0, rows.to(t.device)))
            return
        self.to_dynamic()
        self.keys = self.keys.index_select(0, rows.to(self.keys.device))
        self.values = self.values.index_select(0, rows.to(self.values.device))
        if self.held_valid is not None:
            self.held_valid = self.held_valid.index_select(0, rows.to(self.held_valid.device))

    # -- the ring ------------------------------------------------------------------------------
    def ring_slots(self, n: int) -> torch.Tensor:
        """The ring slots of the last ``n`` tokens seen, oldest first."""
        seen = self.length
        return torch.arange(seen - n, seen, device=self.keys.device) % self.sliding_window

    def to_ring(self, visible: torch.Tensor | None = None) -> None:
        """Move the held window into the ring. ``visible`` (B, n): which of the last ``n`` keys the
        attention just read are tokens rather than padding (None: all)."""
        if self.static is not None or not self.plan or self.keys is None:
            return
        b, hkv, n, _ = self.keys.shape
        n = min(n, self.sliding_window - 1, self.length)
        slots = self.ring_slots(n)
        # as transformers' static sliding layers: no more slots than the tokens the cache will hold
        # (token p at slot p % window: a shorter ring is the first slots of the window's)
        held = self.sliding_window if self.capacity is None else max(self.capacity, self.length + 1)
        keys, values, valid = self._empty_ring(min(self.sliding_window, held))
        keys[:, :, slots] = self.keys[:, :, self.keys.shape[2] - n :]
        values[:, :, slots] = self.values[:, :, self.values.shape[2] - n :]
        valid[:, slots] = True if visible is None else visible[:, visible.shape[1] - n :].to(keys.device)
        self.keys, self.values, self.valid = keys, values, valid
        self.seen = torch.tensor(self.length, dtype=torch.long, device=keys.device)
        # (B,) long, a chunked layer's: each row's place in its chunk, the tokens its last query saw less one
        self.phase = torch.full((b,), (self.length - 1) % self.sliding_window, device=keys.device)
        if visible is not None:
            self.phase.copy_(visible.sum(-1) - 1)
        self.static, self.held_valid = "ring", None
        self._mark_static()

    def _empty_ring(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Zeroed keys and values (B, H_kv, size, d) like the held ones, their flags (B, size), and
        ``slot_order`` set for ``size`` slots."""
        b, hkv = self.keys.shape[:2]
        keys = self.keys.new_zeros(b, hkv, size, self.keys.shape[-1])
        values = self.values.new_zeros(b, hkv, size, self.values.shape[-1])
        self.slot_order = torch.arange(size, device=keys.device)  # (size,)
        return keys, values, torch.zeros(b, size, dtype=torch.bool, device=keys.device)

    def _mark_static(self) -> None:
        if not torch.compiler.is_compiling():  # fixed addresses, as transformers' static layers (CUDA graphs)
            for t in (self.keys, self.values, self.valid, self.seen, self.slot_order, self.phase):
                torch._dynamo.mark_static_address(t)

    def _grow(self) -> None:
        """Past the capacity its ring was laid out for, eagerly: a ring of the whole window, every slot
        where it was (a compiled step stops instead, ``_ring_append``)."""
        size = self.keys.shape[2]
        keys, values, valid = self._empty_ring(self.sliding_window)
        keys[:, :, :size], values[:, :, :size], valid[:, :size] = self.keys, self.values, self.valid
        self.keys, self.values, self.valid = keys, values, valid
        self._mark_static()

    def window(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values transformers' layer holds (the last ``window - 1`` tokens, oldest
        first), whichever the layout."""
        if self.static is None:
            return self.keys, self.values
        slots = self.ring_slots(min(self.length, self.sliding_window - 1))
        return self.keys[:, :, slots], self.values[:, :, slots]

    def to_dynamic(self) -> None:
        """Back to transformers' layout (:meth:`window`; padding among the tokens stays, as
        transformers keeps it: the model's mask hides it, or a settled layer's ``held_valid``)."""
        if self.static is not None:
            self.keys, self.values = self.window()
            if self.settled:
                self.held_valid = self.valid[:, self.ring_slots(self.keys.shape[2])]
            self.static, self.valid, self.seen = None, None, None

    def _ring_append(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """One token written in place at slot ``seen % window``; returns the ring."""
        if self.keys.shape[2] < self.sliding_window:  # a ring the capacity cut short
            if torch.compiler.is_compiling():
                torch._assert_async(self.seen < self.keys.shape[2], PAST_CAPACITY)
            elif self.length >= self.keys.shape[2]:
                self._grow()
        slot = torch.remainder(self.seen, self.sliding_window).reshape(1)
        self.keys.index_copy_(2, slot, key_states)
        self.values.index_copy_(2, slot, value_states)
        self.valid.index_fill_(1, slot, True)
        if self.chunked:  # a row whose token opens a chunk sees that token alone (module docstring)
            opens = self.phase.add_(1).remainder_(self.sliding_window) == 0  # (B,)
            self.valid &= ~opens[:, None] | (self.slot_order == slot)
        if torch.compiler.is_compiling():  # counted on the device only (``cumulative_length``)
            self.seen.add_(1)
            self._seen_on_device = True
        else:
            seen = self.length  # read back before the count moves
            self.seen.add_(1)
            self.cumulative_length = seen + 1
        return self.keys, self.values

    def attend(
        self, query: torch.Tensor, scaling: float, terms: LogitTerms = PLAIN, return_probs: bool = False
    ):
        """One token's attention over the ring's tokens: query (B, H, 1, d) -> (B, 1, H, d), and the
        probabilities (B, H, 1, slots) in float32 if asked (else None). The GQA group folded into the
        query rows (keys never repeated), as ``dense_attention``; with a soft cap or sinks (``terms``,
        ``kvcake.logit_terms``), or probabilities asked, the explicit softmax."""
        b, h, q, d = query.shape
        hkv = self.keys.shape[1]
        qs = query.reshape(b, hkv, h // hkv * q, d)
        out, probs = folded_attention(
            qs, self.keys, self.values, self.valid[:, None, None, :], scaling, q, return_probs, terms
        )
        return out.reshape(b, h, q, -1).transpose(1, 2), None if probs is None else probs.reshape(b, h, q, -1)


@dataclass(frozen=True)
class KVBytes:
    """Bytes (and entries) of keys and values of a cache, in parts.

    sliding: held by the sliding-window layers (at most their window); compressed: held by the
    full-attention layers kvcake compresses; full: what transformers' ``DynamicCache`` holds
    for the same tokens once it decodes (sliding layers at their window, global layers every token, the
    image's states of cross-attention layers as they are); cross: held by the cross-attention
    layers (Mllama: the image's states, never compressed); recurrent: the fixed-size states of a
    hybrid's linear-attention layers (``recurrent.py``; a full cache holds the same, and ``full``
    counts them). ``entries`` / ``full_entries``: the key/value totals in (sequence, layer, KV head,
    token) entries. ``index``: what the layers hold beside their keys and values (kvcake's
    bookkeeping, which a full cache does without: a position per kept entry and KV head, the
    eviction scores or value norms a method keeps, a ragged layout's index tensors, static
    storage's padding rows and biases, float8's scales and recent positions, the sliding ring's
    order), each layer's storages once; ``held`` counts it with ``total``."""

    sliding: int
    compressed: int
    full: int
    entries: int = 0
    full_entries: int = 0
    cross: int = 0
    recurrent: int = 0
    index: int = 0

    @property
    def total(self) -> int:
        """Bytes of keys and values (and states) held."""
        return self.sliding + self.compressed + self.cross + self.recurrent

    @property
    def held(self) -> int:
        """Every byte the layers hold: keys and values with their bookkeeping (``index``)."""
        return self.total + self.index

    @property
    def fraction(self) -> float:
        """Bytes of keys and values held as a fraction of the full cache's."""
        return self.total / self.full if self.full else 1.0

    @property
    def held_fraction(self) -> float:
        """Every byte held (``held``) as a fraction of the full cache's keys and values."""
        return self.held / self.full if self.full else 1.0


def kv_bytes_parts(cache: Cache) -> KVBytes:
    """Split a KVCakeCache's bytes into sliding and compressed layers, against the full cache."""
    sliding = compressed = full = entries = full_entries = cross = recurrent = 0
    # bookkeeping: each layer's storages beside what its kv_bytes counts (a full cache's layers hold none)
    index = sum(storage_bytes(layer) - layer.kv_bytes() for layer in cache.layers)
    for layer in cache.layers:
        # a linear-attention layer's states (or those beside an attention: hybrid_layer.py), as a full cache's
        holds_states = LinearAttentionLayer is not None and isinstance(layer, LinearAttentionLayer)
        states = state_bytes(layer) if holds_states else 0
        recurrent, full = recurrent + states, full + states
        if isinstance(layer, RecurrentLayer) or layer.keys is None:
            continue
        held = layer.kv_bytes() - states
        entries += layer.entries()
        if isinstance(layer, CrossLayer):
            cross += held  # a cross-attention layer (cross.py): the image's states, as a full cache's
            full += held
            full_entries += layer.entries()
        elif isinstance(layer, SlidingLayer):
            sliding += held
            full += layer.dynamic_bytes()  # a DynamicCache's window - 1 entries
            full_entries += layer.dynamic_entries()
        else:
            compressed += held
            n = layer.batch * layer.kv_heads * layer.length
            entry = (layer.keys.shape[-1] + layer.values.shape[-1]) * layer.dtype.itemsize  # the model's
            # dtype: a full cache's entry, whatever the compressed layer stores (fp8.py)
            full += n * entry
            full_entries += n
    return KVBytes(sliding, compressed, full, entries, full_entries, cross, recurrent, index)


def copy_sliding_state(source, target: SlidingLayer) -> None:
    """Give ``target`` what the sliding layer ``source`` of a full ``DynamicCache`` holds (the
    last ``window - 1`` keys/values and the count of tokens seen), e.g. to replay a recorded
    full-cache forward into a KVCakeCache. A layer that kept every token is cut to the window."""
    seen = getattr(source, "cumulative_length", None)
    if seen is None:  # a plain DynamicLayer: it holds every token
        seen = source.keys.shape[-2]
    keep = target.sliding_window - 1
    target.lazy_initialization(source.keys, source.values)
    target.keys, target.values = owned(source.keys[:, :, -keep:]), owned(source.values[:, :, -keep:])
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
