"""``KVCakeCache``: a transformers ``Cache`` that compresses itself while the model runs.

Flow for one layer ``l`` of the prompt's forward (prefill):

1. the model calls ``cache.update(k, v, l)`` with post-RoPE keys and values; the layer stores
   them in full;
2. the kvcake attention function (``attention.py``) runs the model's own attention kernel on
   the full keys and values, then hands the queries to ``cache.after_prefill_attention``,
   which scores the tokens, and (cascade) re-allocates the budgets of layers ``0..l`` and
   evicts them; so the cache never holds more than the total budget plus one full layer.

Later forwards (decoding, or a question appended to a compressed context) append to each
layer and attend over what it physically holds, with logical positions; with the ``fixed``
decoding policy each layer and head is evicted back to its budget every step.

The cache reports the *logical* length (tokens seen), so transformers derives RoPE positions
and the 2-D padding mask in logical columns; the attention maps them onto the physical
entries through their stored positions.

Hybrid models (Gemma 3): sliding-window layers get transformers' own sliding layer
(``sliding.py``) and are never scored or evicted; "layers" in budgets, allocation and the
cascade mean the ``L_g`` full-attention layers (``info.compressed_layers``), in model order:
``budgets`` is ``(B, L_g)``, ``budget=128`` keeps 128 entries per global layer.
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import Cache

from . import static
from .adapters import ModelInfo, describe_model, output_projection
from .allocators import AllocationRequest, preference
from .allocators.cake import CakeAllocator
from .method import Method, make_method
from .models import model_fingerprint
from .scorers import PrefillInputs
from .scorers.base import window_rows_mean_var
from .selectors import SelectionInputs, TopK, projected_value_norms
from .sliding import KVBytes, SlidingLayer, kv_bytes_parts
from .temperatures import TauChoice, resolve_tau

logger = logging.getLogger(__name__)

# The layer whose update() ran last and whose attention has not run yet: set by the cache,
# read once by the kvcake attention function (the model calls them back to back).
PENDING: contextvars.ContextVar[tuple[KVCakeCache, int, torch.Tensor] | None] = contextvars.ContextVar(
    "kvcake_pending", default=None
)


@dataclass
class SequenceBudgets:
    """Per-sequence budget facts fixed at the start of prefill. All (B,) int64 on the host
    side of the device (small)."""

    lengths: torch.Tensor  # valid prompt tokens
    per_layer: torch.Tensor  # average budget per layer
    total: torch.Tensor  # B_total = per_layer * L_g (compressed layers)
    window: torch.Tensor  # protected window, min(Sw, length)


class KVCakeCache(Cache):
    """A compressing KV cache for one batch of prompts.

    Parameters
    ----------
    model:
        The transformers causal LM it will serve (checked by ``adapters.describe_model``).
    method:
        A :class:`~kvcake.method.Method`, or a preset/composed string with ``budget=``/``ratio=``.

    Use it inside :func:`kvcake.attention.kvcake_attention` (or through the helpers in
    ``kvcake.api``), e.g. ``with kvcake.enable(model): model.generate(ids, past_key_values=cache)``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        method: Method | str = "cake",
        *,
        record: bool = False,
        progress: bool = False,
        static: bool = False,
        **budget_kwargs,
    ) -> None:
        self.info: ModelInfo = describe_model(model)
        if budget_kwargs and isinstance(method, Method):
            raise ValueError("pass budget=/ratio= to make_method, not with a Method object")
        self.method = method if isinstance(method, Method) else make_method(method, **budget_kwargs)
        self.model_type = self.info.model_type
        from .layer import KVCakeLayer

        windows = self.info.windows or (None,) * self.info.num_layers
        super().__init__(layers=[KVCakeLayer() if w is None else SlidingLayer(w) for w in windows])
        self.compressed: tuple[int, ...] = self.info.compressed_layers  # model layer of each budget column
        self._slot = {lid: g for g, lid in enumerate(self.compressed)}
        self.seq: SequenceBudgets | None = None
        self.budgets: torch.Tensor | None = None  # (B, L_g) final budgets of the compressed layers
        self.stage_budgets: list[torch.Tensor] = []  # cascade history, (B, m+1) per stage
        self.preferences: list[torch.Tensor] = []  # per layer (B,) float64
        self.entropy: list[torch.Tensor] = []
        self.variance: list[torch.Tensor] = []
        self.decode_budget: np.ndarray | None = None  # (B, L_g, H_kv), host
        self.prefilled = False
        self.peak_kv_bytes = 0
        self.prefill_peak_kv_bytes = 0
        self._unconsumed: int | None = None
        self._layer_bytes: list[int] | None = None
        self._held_bytes = 0
        # record=True keeps, for every prefill eviction, (stage, layer, kept positions (B, H_kv, N)
        # on the CPU, -1 = empty): used by tests of the cascade's guarantees.
        self.record = record
        self.history: list[tuple[int, int, torch.Tensor]] = []
        self._stage = -1
        # progress=True shows a bar over the layers during prefill (long prompts on a CPU).
        self.progress = progress
        self._bar = None
        # CAKE's temperatures: resolved once the budget is known (kvcake.temperatures)
        self.tau: TauChoice | None = None
        self._fingerprint = model_fingerprint(model) if isinstance(self.method.layers, CakeAllocator) else None
        # static=True: decode in preallocated buffers with in-place eviction (static.py; opt-in
        # while its capacity policy costs memory); False (default): the dynamic path.
        self.static = static

    # -- Cache interface -----------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if isinstance(layer, SlidingLayer):  # transformers' own sliding layer, never compressed
            keys, values = layer.update(key_states, value_states, *args, **kwargs)
            self._track_bytes(layer_idx)
            return keys, values
        if not self.prefilled and layer_idx == self.compressed[0] and layer.is_initialized:
            raise RuntimeError(
                "this KVCakeCache's prefill did not finish (an earlier forward was interrupted by an "
                "error): its state is incomplete, so make a new KVCakeCache"
            )
        if self._unconsumed is not None:
            PENDING.set(None)  # do not keep this cache's keys alive past the error
            raise RuntimeError(
                "KVCakeCache was updated but the kvcake attention did not run for layer "
                f"{self._unconsumed}: run the model inside `with kvcake.enable(model):` (or use "
                "kvcake.generate / kvcake.compress), otherwise nothing is compressed. If it already ran "
                f"inside, this architecture ({self.model_type}) does not call transformers' attention "
                "interface (e.g. ALiBi models) and kvcake cannot compress it"
            )
        if layer.is_initialized and key_states.shape[0] != layer.batch:
            raise ValueError(
                f"this KVCakeCache holds a batch of {layer.batch} sequences but got {key_states.shape[0]}: "
                "a cache serves one batch of prompts, so make a new KVCakeCache per prompt (or batch)"
            )
        keys, values = self.layers[layer_idx].update(key_states, value_states, **kwargs)
        self._unconsumed = layer_idx
        PENDING.set((self, layer_idx, keys))
        self._track_bytes(layer_idx)
        return keys, values

    def crop(self, tokens_to_remove: int) -> None:
        self.layers[self.compressed[0]].crop(tokens_to_remove)

    @property
    def is_croppable(self) -> bool:
        return False

    # -- bookkeeping ---------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes of keys and values the cache holds now (sliding layers included)."""
        return sum(layer.kv_bytes() for layer in self.layers)

    def kv_bytes_parts(self) -> KVBytes:
        """Bytes held by the sliding and the compressed layers, and the full cache's."""
        return kv_bytes_parts(self)

    def kept_entries(self) -> int:
        """Kept entries over sequences, layers and KV heads."""
        return sum(layer.entries() for layer in self.layers)

    def _track_bytes(self, layer_idx: int) -> None:
        """Update the peak from layer ``layer_idx``'s change (a running total: re-summing every
        layer on each update would cost O(L) per layer and step)."""
        if getattr(self, "_layer_bytes", None) is None or len(self._layer_bytes) != len(self.layers):
            self._layer_bytes = [layer.kv_bytes() for layer in self.layers]
            self._held_bytes = sum(self._layer_bytes)
        new = self.layers[layer_idx].kv_bytes()
        self._held_bytes += new - self._layer_bytes[layer_idx]
        self._layer_bytes[layer_idx] = new
        now = self._held_bytes
        self.peak_kv_bytes = max(self.peak_kv_bytes, now)
        if not self.prefilled:
            self.prefill_peak_kv_bytes = max(self.prefill_peak_kv_bytes, now)

    def layer_counts(self) -> np.ndarray:
        """(B, L_g, H_kv) entries kept per sequence, compressed layer and KV head."""
        return np.stack([self.layers[lid].counts for lid in self.compressed], axis=1)

    # -- called by the attention function ------------------------------------------------------
    def consume(self, layer_idx: int) -> None:
        self._unconsumed = None

    def after_prefill_attention(
        self, layer_idx: int, module: torch.nn.Module, query: torch.Tensor, key_valid: torch.Tensor, scaling: float
    ) -> None:
        """Score layer ``layer_idx``'s prompt and run this cascade stage's evictions.

        query: (B, H, S, d) post-RoPE; key_valid: (B, S) bool (False on left padding)."""
        layer = self.layers[layer_idx]
        m = self.method
        self._stage = layer_idx
        g = self._slot[layer_idx]  # budget column of this layer
        if g == 0:
            self._start(key_valid)
            if self.progress:
                from tqdm.auto import tqdm

                self._bar = tqdm(total=len(self.compressed), desc=f"prefill {query.shape[2]} tokens", unit="layer")
        inputs = PrefillInputs(
            query=query, keys=layer.keys, values=layer.values, key_valid=key_valid,
            window=m.budget.window, scaling=scaling,
        )  # fmt: skip
        layer.scores = m.scorer.prefill(inputs)  # (B, H_kv, S)
        if m.selector.needs_value_norms:
            layer.norms = projected_value_norms(layer.values, output_projection(module), self.info.num_heads)
        if m.layers.needs_preferences:
            probs, row_valid = inputs.window_attention()
            w = probs.shape[2]
            sub = probs[..., : probs.shape[-1] - w]  # window rows, prefix columns
            entropy = -(sub * torch.log(sub + 1e-10)).sum((1, 2, 3))  # (B,)
            _, var = window_rows_mean_var(sub, row_valid)
            variance = var.sum((1, 2))  # (B,)
            tau1, tau2 = self._resolve_tau()
            # host: (B,) per layer, stacked across layers that may sit on different devices
            entropy, variance = entropy.double().cpu(), variance.double().cpu()
            self.entropy.append(entropy)
            self.variance.append(variance)
            self.preferences.append(preference(entropy, variance, tau1, tau2))
        last = g == len(self.compressed) - 1
        if m.layers.needs_preferences:
            if m.layers.cascading or last:
                budgets = self._allocate(torch.stack(self.preferences, 1), final=last)
                self.stage_budgets.append(budgets)
                for j in range(g + 1):
                    self._evict_layer(self.compressed[j], budgets[:, j])
        else:
            if self.budgets is None:
                self.budgets = self._allocate(None, final=True)
            self._evict_layer(layer_idx, self.budgets[:, g])
        if self._bar is not None:
            self._bar.update(1)
            if last:
                self._bar.close()
                self._bar = None
        if last:
            self._finish_prefill()

    def _start(self, key_valid: torch.Tensor) -> None:
        if self.prefilled:
            raise RuntimeError("this KVCakeCache already holds a prompt; make a new cache per prompt")
        if bool((key_valid[:, 1:].long() < key_valid[:, :-1].long()).any()):
            raise ValueError(
                "kvcake needs left padding (padding tokens before the prompt): set tokenizer.padding_side='left'"
            )
        lengths = key_valid.sum(-1).long().cpu()
        if bool((lengths == 0).any()):
            raise ValueError("a sequence in the batch is empty (all padding): give every sequence at least one token")
        per_layer = self.method.budget.per_layer(lengths)
        window = torch.clamp(lengths, max=self.method.budget.window)
        self.seq = SequenceBudgets(lengths, per_layer, per_layer * len(self.compressed), window)
        if bool((per_layer >= lengths).all()):
            logger.warning(
                "the budget (%s) covers the whole prompt (%d tokens): nothing is compressed",
                self.method.budget.describe(), int(lengths.max()),
            )

    def _resolve_tau(self) -> tuple[float, float]:
        if self.tau is None:
            lay, avg = self.method.layers, float(self.seq.per_layer.double().mean())
            self.tau = resolve_tau(self._fingerprint, self.model_type, avg, lay.tau1, lay.tau2, lay.tau_from)
        return self.tau.tau1, self.tau.tau2

    @property
    def _tau(self) -> tuple[float, float] | None:  # the temperatures in force, as storage saves them
        return None if self.tau is None else (self.tau.tau1, self.tau.tau2)

    @_tau.setter
    def _tau(self, value: tuple[float, float] | None) -> None:  # a context file read back
        self.tau = None if value is None else TauChoice(float(value[0]), float(value[1]), "saved")

    def _allocate(self, preferences: torch.Tensor | None, final: bool) -> torch.Tensor:
        s = self.seq
        req = AllocationRequest(
            total=s.total, cap=s.lengths, window=s.window, num_layers=len(self.compressed),
            preferences=preferences, final=final,
        )  # fmt: skip
        budgets = self.method.layers.allocate(req)
        return budgets

    def _evict_layer(self, layer_idx: int, budget: torch.Tensor) -> None:
        """Evict layer ``layer_idx`` to ``budget`` (B,) entries per KV head (window included)."""
        layer = self.layers[layer_idx]
        m = self.method
        dev = layer.keys.device
        scores = layer.padded(layer.scores, float("-inf"))  # (B, H_kv, N)
        window = self.seq.window.to(dev)
        budget = budget.to(dev)
        if m.heads.ragged:
            counts = m.heads.counts(scores, budget, window)
        else:
            n_valid = (scores > float("-inf")).sum(-1)
            counts = torch.minimum(budget[:, None].expand_as(n_valid), n_valid)
        counts_host = counts.cpu().numpy()
        if bool((counts_host == layer.counts).all()):
            return  # nothing to evict in this layer at this stage
        keep = m.selector.select(SelectionInputs(scores, counts, layer.padded(layer.norms, 0.0)))
        layer.evict(keep, counts_host, ragged=m.heads.ragged)
        self._track_bytes(layer_idx)
        if self.record:
            self.history.append((self._stage, layer_idx, layer.padded_positions().cpu().clone()))

    def _finish_prefill(self) -> None:
        if self.budgets is None:
            self.budgets = self.stage_budgets[-1]
        counts = self.layer_counts()  # (B, L_g, H_kv)
        lengths = self.seq.lengths.numpy()[:, None, None]
        avg = self.seq.per_layer.numpy()[:, None, None]
        # A head that was compressed keeps its count while decoding; one that kept its whole
        # prompt may grow to the average budget before eviction starts.
        self.decode_budget = np.where(counts < lengths, counts, np.maximum(counts, avg)).astype(np.int64)
        keep_scores = self.method.scorer.stateful and self.method.decode == "fixed"
        fixed = self.method.decode == "fixed"
        for g, lid in enumerate(self.compressed):
            layer = self.layers[lid]
            layer.norms = None
            if not keep_scores:
                layer.scores = None
            if self.static:
                layer.static_plan = ("fixed", self.decode_budget[:, g]) if fixed else ("none", None)
        self.prefilled = True

    def wants_probs(self, layer_idx: int, q: int) -> bool:
        """Whether this step's attention must return probabilities (decoding-time eviction)."""
        if not self.prefilled or self.method.decode != "fixed":
            return False
        layer = self.layers[layer_idx]
        # a static layer has not counted the new entry yet (it is in the spare slot)
        counts = layer.counts + (1 if layer.static == "fixed" else 0)
        return layer.scores is not None or bool((counts > self.decode_budget[:, self._slot[layer_idx]]).any())

    def after_extend_attention(self, layer_idx: int, probs: torch.Tensor | None) -> None:
        """Decoding-time eviction (policy ``fixed``): each head back to its budget, by the
        scorer's per-step scores; the newest ``window`` positions are protected."""
        layer = self.layers[layer_idx]
        if layer.static == "fixed":
            self._place_static(layer, probs)
            return
        if probs is None:
            return
        budget = self.decode_budget[:, self._slot[layer_idx]]  # (B, H_kv)
        over = bool((layer.counts > budget).any())
        positions = layer.padded_positions()  # (B, H_kv, N)
        scores = self.method.scorer.decode(probs, positions, layer.padded(layer.scores, float("-inf")))
        if layer.scores is not None:  # stateful (H2O): keep the accumulated sums
            layer.scores = layer.unpad(scores.masked_fill(positions < 0, 0.0))
        if not over:
            return
        newest = positions.amax(-1, keepdim=True)
        protected = positions > newest - self.method.budget.window
        scores = scores.masked_fill(protected, float("inf")).masked_fill(positions < 0, float("-inf"))
        counts = np.minimum(layer.counts, budget)
        keep = TopK().select(SelectionInputs(scores, torch.as_tensor(counts, device=scores.device)))
        layer.evict(keep, counts, ragged=layer.layout == "ragged")
        self._track_bytes(layer_idx)

    def _place_static(self, layer, probs: torch.Tensor | None) -> None:
        """The in-place counterpart of the eviction above (static.py): one victim per head by
        argmin, nothing sorted or copied but the new entry, nothing read back from the device."""
        scores = None if probs is None else static.decode_scores(layer, self.method.scorer, probs)
        static.place_newest(layer, scores, layer.length - 1 - self.method.budget.window)


def cache_kv_bytes(cache: Cache) -> int:
    """Bytes of keys and values any transformers ``Cache`` holds now: ``kv_bytes()`` for a
    KVCakeCache, else read off its layers' ``keys``/``values`` (e.g. a ``DynamicCache``)."""
    if isinstance(cache, KVCakeCache):
        return cache.kv_bytes()
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def new_cache(model: torch.nn.Module, method: Method | str = "cake", **budget_kwargs) -> KVCakeCache:
    """Shorthand for ``KVCakeCache(model, method, **budget_kwargs)``."""
    return KVCakeCache(model, method, **budget_kwargs)
