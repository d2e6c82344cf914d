"""Cache layers: what one model layer keeps, dense or ragged.

Both layouts keep, per entry, its key, value and logical position (the column it had in the
prompt plus generated text: RoPE was applied with it and the causal mask is decided by it).

* ``dense``: keys/values ``(B, H_kv, N, d)``. Every KV head of a sequence keeps the same number
  of entries; sequences of a batch whose budgets differ leave empty slots (position -1) on the
  left, like left padding. Until the first eviction the layer is *plain*: exactly what
  transformers' ``DynamicLayer`` would hold, read by the model's own attention kernel, so a
  budget covering the prompt changes nothing, bit for bit.
* ``ragged``: keys/values ``(T, d)`` flattened over (sequence, KV head) segments with
  per-segment lengths (see ``ragged.py``); its bytes are the sum of the per-head budgets.
Eviction state kept during prefill (scores, value norms) shrinks with the entries."""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from . import devices, fp8
from .dense import dense_attention
from .fp8 import folded, readable, scaled, writable
from .logit_terms import PLAIN
from .ragged import (
    RaggedMeta,
    append_segments,
    first_rows,
    kept_indices,
    pad_probs,
    ragged_attention,
    ranked_rows,
    to_device,
)
from .sequences import host_rows, repeated_rows, select_dense, select_ragged
from .step import GROWTH, LAYOUTS
from .step.common import catch_up_counts, mark_static


class KVCakeLayer(CacheLayerMixin):
    """One layer of a :class:`~kvcake.cache.KVCakeCache`."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    counts_lag, host_steps, oldest, kth = False, 0, None, 0  # step.common.count_step; step.dense.evict
    latent = False  # latent attention (MLA): the attention reads ``operands``, not the entries as held
    takes_padding = True  # pads among appended tokens become empty slots (sequences.settle_padding)

    def __init__(self) -> None:
        super().__init__()
        self.length = 0  # logical columns seen (the property below)
        self.layout = "dense"
        self.plain = True
        self.evicts_ahead, self.evicts_past = False, None  # plain, decode=fixed (decoding.plan)
        self.ranked = False  # entries in the selector's order (each head's best first), not position order
        self.positions: torch.Tensor | None = None  # dense (B, H_kv, N) int64 / ragged (T,)
        self.scores: torch.Tensor | None = None  # eviction indicator, same layout as positions
        self.window_sums: torch.Tensor | None = None  # prefill only: H2O's window as scored (B, H_kv, w)
        self.norms: torch.Tensor | None = None  # CriticalKV value norms, same layout
        self.counts: np.ndarray | None = None  # (B, H_kv) kept entries, on the host
        self.meta: RaggedMeta | None = None
        self.batch = 0
        self.kv_heads = 0
        # static decode storage (``kvcake.step``): None = the dynamic reference layout, else the decoding
        # policy it serves; ``static_plan`` (``KVCakeCache.plan_static``): ((B, H_kv) decode budgets for
        # decode=fixed / None, max_cache_len or None), or None to stay dynamic (static=False).
        self.static: str | None = None
        self.static_plan: tuple[np.ndarray | None, int | None] | None = None
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None  # stored in float8 (fp8.py)
        self.recent_keys = self.recent_values = self.recent_positions = self.recent_base = None  # (fp8.py)
        self.recent_before: tuple[torch.Tensor, ...] | None = None  # (fp8.remember)

    @property
    def length(self) -> int:
        """Logical columns seen; after compiled decode steps, which count on the device only
        (``newest``: no graph holds a count that changes every step), read back once when asked."""
        if self._length_on_device:
            self._length, self._length_on_device = int(self.newest.reshape(-1)[0]) + 1, False
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        self._length, self._length_on_device = value, False

    @property
    def counts(self) -> np.ndarray | None:
        """(B, H_kv) kept entries, on the host (the steps since: ``step.common.count_step``)."""
        return catch_up_counts(self) if self.counts_lag or self.host_steps else self._counts

    @counts.setter
    def counts(self, value: np.ndarray | None) -> None:
        if self.counts_lag:  # replaced: what the steps counted no longer applies
            self.steps.zero_()
        self._counts, self.counts_lag, self.host_steps = value, False, 0

    # -- transformers' CacheLayerMixin interface ---------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch, self.kv_heads = key_states.shape[0], key_states.shape[1]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the prompt (first call) or append new entries; returns what a plain layer's
        attention reads (padding among appended entries: ``kvcake.sequences.settle_padding``)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, hkv, q, _ = key_states.shape
        if self.static is not None and q > 1:
            self.step.to_dynamic(self)  # multi-token appends take the reference path
        elif self.static is None and q == 1 and self.wants_static:
            self.to_static()  # after its first eviction (after a multi-token append, the attention laid it out)
        if self.static is not None:  # in place, positions on the device: no host int
            seen = None if torch.compiler.is_compiling() else self.length  # read back before ``newest`` moves
            self.step.append(self, *writable(self, key_states, value_states))
            fp8.remember_step(self, key_states, value_states)  # float8: the token exactly too (fp8.py)
            if seen is None:  # compiling: written, never read, in the graph (``length``)
                self._length_on_device = True
            else:
                self.length = seen + 1
            return self.keys, self.values
        pos = (
            torch.arange(self.length, self.length + q, device=key_states.device)
            .expand(b, hkv, q)
            .contiguous()
        )
        self.length += q
        if self.keys is None:
            self.keys, self.values, self.positions = *map(devices.owned, (key_states, value_states)), pos
            self.counts = np.full((b, hkv), q, dtype=np.int64)
            self.plain = True
            return self.keys, self.values
        add = np.full((b, hkv), q, dtype=np.int64)
        fp8.remember(self, key_states, value_states, pos, appended=q > 1)  # float8: the latest exactly too
        key_states, value_states = writable(self, key_states, value_states)
        if self.layout == "dense":
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            self.positions = torch.cat([self.positions, pos], dim=-1)
            self.scores = _cat_or_none(self.scores, torch.zeros(b, hkv, q, device=key_states.device))
            self.norms = None
        else:
            append_segments(self, key_states, value_states, pos)
        self.counts = self.counts + add
        # plain: the model's kernel reads the entries (decoded); else the kvcake attention reads the layer
        return readable(self) if self.plain else (self.keys, self.values)

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        # logical columns (the attention maps them through ``positions``); 5.0 passes cache_position
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.length + query_length, 0

    def get_seq_length(self) -> int | torch.Tensor:
        if self.static is not None and torch.compiler.is_compiling():  # a 0-d tensor, as a compiled
            return self.newest.reshape(-1)[0] + 1  # StaticLayer's (its cumulative_length)
        return self.length

    def get_max_length(self) -> int:  # (``get_max_cache_shape``: its name in 5.0)
        return -1

    get_max_cache_shape = get_max_length

    def reset(self) -> None:
        self.__init__()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "a compressed KV cache cannot be cropped: evicted entries are gone. Assisted/speculative "
            "decoding and other rollbacks need the full cache (use a plain DynamicCache)"
        )

    # Beam search, and a batch repeated or cut: the cache's own budgets follow in KVCakeCache's
    # (``kvcake.sequences.select_sequences``); these keep one layer consistent on its own.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.keys is not None:
            self.select_rows(*host_rows(beam_idx, self.batch))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.keys is not None:
            self.select_rows(*host_rows(repeated_rows(self.batch, repeats), self.batch))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.keys is not None:
            self.select_rows(*host_rows(indices, self.batch))

    def select_rows(self, rows: torch.Tensor, host: np.ndarray) -> None:
        """Keep the sequences ``rows`` (B',) int64 (``host``: the same as numpy) in that order, every
        per-sequence tensor, count and budget of the layer (``kvcake.sequences``)."""
        static = self.static is not None
        fp8.select_recent(self, rows)  # (float8: fp8.py)
        if not (static and len(host) == self.batch and self.step.permute(self, rows, host)):  # in place
            if static:  # the reference layout, laid out again below
                self.step.to_dynamic(self)
            if self.layout == "dense":
                select_dense(self, rows)
            else:
                select_ragged(self, rows, host)
        self.counts, self.batch = self.counts[host], len(host)
        if self.static_plan is not None and self.static_plan[0] is not None:
            self.static_plan = (self.static_plan[0][host], self.static_plan[1])
        if self.static == "fixed":
            self.static_budget_host = self.static_budget_host[host]
        elif static and self.static is None:
            self.to_static()  # laid out again now, not inside the next (maybe compiled) step

    # -- static storage ----------------------------------------------------------------------
    @property
    def wants_static(self) -> bool:
        """Whether it moves into its static plan's buffers at its next chance (evicted, or will: ``evicts_ahead``)."""
        return self.static_plan is not None and (not self.plain or self.evicts_ahead)

    def to_static(self) -> None:
        """Move into ``static_plan``'s buffers: ``decode=none`` reserves a slot per token up to
        ``max_cache_len`` (``GROWTH`` if unknown); ``decode=fixed`` per head its budget, or its
        entries plus the tokens left where that is less (then ``full_at``, the length past which
        it cannot serve: ``step.common.advance``), plus the spare slot."""
        budget, max_len = self.static_plan
        self.plain, self.full_at = False, None  # plain: read by the kvcake attention from now on
        room = GROWTH if max_len is None else max(max_len - self.length, 0)
        if budget is not None and max_len is not None and (budget > self.counts + room).any():
            budget, self.full_at = np.minimum(budget, self.counts + room), self.length + room
        self.step.to_static(self, budget, room)
        if budget is None and max_len is not None:  # decode=none with room for every token to come:
            self.room, self.full_at = None, self.length + max(room, 1)  # no count in the step
        mark_static(self)

    @property
    def step(self):
        """The module of this layout's static decode step (``kvcake.step.dense`` or
        ``kvcake.step.ragged``): the one place the step's calls choose by layout. Derived, not
        stored: a layer is deep-copied and pickled, a module is not."""
        return LAYOUTS[self.layout]

    # -- views and eviction ----------------------------------------------------------------
    def padded(self, tensor: torch.Tensor | None, fill: float, width: int = 0) -> torch.Tensor | None:
        """A per-entry tensor as (B, H_kv, N, ...); ragged layers scatter into the longest segment,
        or into ``width`` entries per head where that is more (to stand beside other layers)."""
        if tensor is None or self.layout == "dense":
            return tensor
        m = self.meta
        shape = (self.batch * self.kv_heads, max(m.max_len, width), *tensor.shape[1:])  # keys/values keep d
        out = torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)
        out[m.seg, m.local] = tensor[: m.seg.numel()]  # static storage: all but its dummy slot
        return out.reshape(self.batch, self.kv_heads, *shape[1:])

    def unpad(self, tensor: torch.Tensor) -> torch.Tensor:
        """Inverse of ``padded`` for a (B, H_kv, N) tensor."""
        if self.layout == "dense":
            return tensor
        return tensor.reshape(self.batch * self.kv_heads, -1)[self.meta.seg, self.meta.local]

    def padded_positions(self) -> torch.Tensor:
        return self.padded(self.positions, -1)

    def evict(
        self, keep: torch.Tensor, counts: np.ndarray, ragged: bool, order: torch.Tensor | None = None
    ) -> None:
        """Keep the entries where ``keep`` (B, H_kv, N) is True, ``counts`` (B, H_kv) per head.

        ``ragged`` turns the layer into the flattened layout (the first eviction of a head-wise
        method); otherwise a dense layer stays dense. ``order`` (B, H_kv, N), a dense layer's
        first eviction to ragged: each head's entries in the selector's order, the kept ones
        first (``Selector.rank_order``); the layer keeps them in that order (``ranked``)."""
        if self.layout == "dense" and self.plain and bool((counts == self.keys.shape[2]).all()):
            return  # nothing to evict: the layer stays identical to a full-cache layer
        if order is not None and self.layout == "dense":
            meta = RaggedMeta.from_counts(counts, keep.device)
            self.keep_rows(ranked_rows(order, meta), meta)
            self.ranked = True
        elif self.layout == "ragged" or ragged:
            self._evict_to_ragged(keep, counts)
        else:
            self._evict_dense(keep, counts)
        self.plain = False
        self.counts = counts.astype(np.int64)

    def _evict_dense(self, keep: torch.Tensor, counts: np.ndarray) -> None:
        b, hkv, n = keep.shape
        new_n = int(counts.max()) if counts.size else 0
        if bool((counts == new_n).all()):  # every head keeps the same number
            self.keep_positions(kept_indices(keep, new_n), counts)
            return
        cnt = to_device(counts, keep.device)
        rank = keep.long().cumsum(-1) - 1  # rank among kept entries
        dest = (new_n - cnt)[..., None] + rank  # left-aligned empty slots, like left padding
        dest = torch.where(keep, dest, torch.full_like(dest, new_n))  # dropped -> overflow slot

        def take(t, fill=0):
            if t is None:
                return None
            shape = (b, hkv, new_n + 1, *t.shape[3:])
            out = torch.full(shape, fill, dtype=t.dtype, device=t.device)
            idx = dest.reshape(b, hkv, n, *([1] * (t.dim() - 3))).expand_as(t)
            out.scatter_(2, idx, t)
            return devices.owned(out[:, :, :new_n])  # the overflow slot freed

        self.keys, self.values = take(self.keys), take(self.values)
        self.positions = take(self.positions, -1)
        self.scores = take(self.scores, float("-inf"))
        self.norms = take(self.norms, 0.0)

    def keep_positions(self, idx: torch.Tensor | int, counts: np.ndarray) -> None:
        """Evict a dense layer to the entries at ``idx`` (B, H_kv, n) along each head, in order, or
        to each head's first ``idx`` entries (an int): every head keeps ``n`` (``counts``, (B, H_kv)
        host, all equal to it)."""
        if self.layout != "dense":
            raise ValueError(f"keep_positions gathers a dense layer's entries; this layer is {self.layout}")
        if self.plain and (idx if isinstance(idx, int) else idx.shape[2]) == self.keys.shape[2]:
            return  # nothing to evict: the layer stays identical to a full-cache layer
        b, hkv, n = self.positions.shape
        if isinstance(idx, int):  # a copy of the first idx, so that the rest is freed

            def take(t):
                return None if t is None else t.narrow(2, 0, idx).clone()  # one slice op on every torch
        else:  # keys and values by whole rows of the flattened heads (a gather with the index
            # expanded over d reads an index per element: ten times slower on a CPU at 4096 x 64)
            rows = (idx + torch.arange(0, b * hkv * n, n, device=idx.device).view(b, hkv, 1)).reshape(-1)

            def take(t):
                if t is None or t.dim() == 3:  # positions, scores, norms: by the indices themselves
                    return None if t is None else t.gather(2, idx)
                kept = t.reshape(b * hkv * n, *t.shape[3:]).index_select(0, rows)
                return kept.reshape(*idx.shape, *t.shape[3:])

        self.keys, self.values = take(self.keys), take(self.values)
        self.positions, self.scores, self.norms = take(self.positions), take(self.scores), take(self.norms)
        self.plain = False
        self.counts = counts.astype(np.int64)

    def _evict_to_ragged(self, keep: torch.Tensor, counts: np.ndarray) -> None:
        b, hkv, n = keep.shape
        flat_keep = keep.reshape(-1) if self.layout == "dense" else self.unpad(keep)
        idx = kept_indices(flat_keep, int(counts.sum()))  # the kept rows in order, their number from the host
        self.keep_rows(idx, RaggedMeta.from_counts(counts, keep.device))

    def keep_rows(self, rows: torch.Tensor, meta: RaggedMeta) -> None:
        """Keep the entries at ``rows`` (T,) of the flattened heads (a dense layer's B * H_kv * N,
        a ragged one's T), laid out as ``meta``: the layer is ragged after it."""
        flat = self.layout == "dense"  # (B, H_kv, N) tensors, else already (T, ...) rows

        def take(t):
            if t is None:
                return None
            return (t.flatten(0, 2) if flat else t).index_select(0, rows)

        self.keys, self.values = take(self.keys), take(self.values)
        self.positions, self.scores, self.norms = take(self.positions), take(self.scores), take(self.norms)
        self.meta, self.layout = meta, "ragged"

    def keep_first(self, counts: np.ndarray) -> None:
        """A ragged layer kept in the selector's order (``ranked``) keeps each head's first
        ``counts`` (B, H_kv) host entries: its top ``counts`` (a cascade's later stage)."""
        if self.layout != "ragged" or not self.ranked or bool((counts > self.counts).any()):
            raise ValueError("keep_first keeps at most what each head of a ranked ragged layer holds")
        meta = RaggedMeta.from_counts(counts, self.keys.device)
        self.keep_rows(first_rows(self.meta, meta), meta)
        self.counts = counts.astype(np.int64)

    # -- attention over what the layer holds ---------------------------------------------------
    def attend(self, query: torch.Tensor, scaling: float, return_probs: bool, terms=PLAIN):
        """Attention of the newest ``q`` query rows (B, H, q, d) over the held entries (``operands``); terms:
        the model's soft cap and sinks (``kvcake.logit_terms``). Returns the output (B, q, H, d_v) and, if asked,
        the probabilities (B, H, q, N) in float32, 0 on empty slots; static storage's (one token): (B, H_kv, G, N)."""
        b, h, q, d = query.shape
        if self.static is not None:  # one new token over static storage
            return self.step.attend(self, query, scaling, return_probs, terms)
        qpos = torch.arange(self.length - q, self.length, device=query.device)[None, :].expand(b, q)
        keys, values = self.operands()
        query, keys, values, value_scale = folded(
            self, query, keys, values, self.positions, fp8.ring_base(self)
        )
        if self.layout == "ragged":
            out, probs = ragged_attention(
                query, keys, values, self.positions, self.meta, qpos, scaling, return_probs, terms
            )
            if probs is not None:  # (T, G, q) -> (B, H, q, N)
                probs = pad_probs(probs, self.meta, b, self.kv_heads)
        else:
            out, probs = dense_attention(query, keys, values, self.positions, qpos, scaling, return_probs, terms)  # fmt: skip
        return scaled(out, value_scale), probs

    def operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the attention reads: those held (a latent layer's: ``kvcake.latent``)."""
        return self.keys, self.values

    def kv_bytes(self) -> int:
        """Bytes of keys and values held: empty dense slots and static storage's capacity included."""
        if self.keys is None:
            return 0
        held = self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
        return held + fp8.recent_bytes(self)  # (float8: its recent entries also in the model's dtype)

    def entries(self) -> int:
        """Kept (valid) entries, summed over sequences and KV heads."""
        return 0 if self.counts is None else int(self.counts.sum())


def _cat_or_none(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor | None:
    return None if a is None else torch.cat([a, b], dim=-1)
