"""``KVCakeCache``: a transformers ``Cache`` that compresses itself while the model runs.

Flow for one layer ``l`` of the prompt's forward (prefill):

1. the model calls ``cache.update(k, v, l)`` with post-RoPE keys and values; the layer stores
   them in full;
2. the kvcake attention function (``attention.py``) runs the model's own attention kernel on
   the full keys and values, then hands the queries to ``cache.after_prefill_attention``,
   which scores the tokens, and (cascade) re-allocates the budgets of layers ``0..l`` and
   evicts them (``cascade.py``; CAKE's stage waits for the start of layer ``l + 1``'s update,
   before it stores anything); so the cache never holds more than the total budget plus one
   full layer.

Later forwards (decoding, or a question appended to a compressed context) append to each layer
and attend over what it physically holds, with logical positions; with the ``fixed`` decoding
policy each layer and head is evicted back to its budget every step (``decoding.py``). The cache
keeps the layers, the ``Cache`` interface (beam search's reorder: ``sequences.py``) and the bytes.

The cache reports the *logical* length (tokens seen), so transformers derives RoPE positions and the
2-D padding mask in logical columns; the attention maps them onto physical entries by their positions.

Hybrid models (Gemma 3): sliding-window layers get transformers' own sliding layer
(``sliding.py``), never scored or evicted; "layers" in budgets, allocation and the cascade mean
the ``L_g`` full-attention layers (``info.compressed_layers``), in model order: ``budgets`` is
``(B, L_g)``, ``budget=128`` keeps 128 entries per global layer."""

from __future__ import annotations

import contextvars
import copy

import numpy as np
import torch
from transformers.cache_utils import Cache

from . import cascade, decoding
from .adapters import ModelInfo, describe_model
from .allocators.cake import CakeAllocator, tau_family
from .budget import check_capacity, check_flag
from .cascade import SequenceBudgets
from .cross import CrossLayer
from .fp8 import check_kv_dtype, check_kv_recent
from .head_shards import find_splits
from .hybrid_layer import HybridLayer
from .latent import attention_layer
from .method import Method, make_method
from .models import model_name
from .pending_norms import PendingNorms
from .recurrent import RecurrentStates, keyless_layer
from .sequences import repeat_sequences, select_sequences
from .sliding import KVBytes, SlidingLayer, cache_kv_bytes, kv_bytes_parts  # noqa: F401 (cache_kv_bytes: re-exported)
from .temperatures import QUESTION_DEFAULT, Scenario, TauChoice, calibration_key

# The key under which ``update`` hands the cache to the kvcake attention: modules call ``cache.update(k,
# v, layer_idx, kwargs=kwargs)``, then ``attention_interface(..., **kwargs)`` with that same dict: it
# reaches that layer's attention and no other, as state the compiler traces (a ContextVar is not).
HANDOFF = "kvcake_cache"
# Models that hand nothing (transformers 5.0-5.23's, GPT-NeoX's: ``model_code.hands_kwargs_to_cache``)
# get ``(cache, layer_idx, keys)`` in ``LEGACY_PENDING`` for their attention, eagerly only: the
# compiler cannot trace a ContextVar, so their KVCakeCache is not compileable (``info.hands_kwargs``).
LEGACY_PENDING: contextvars.ContextVar[tuple[KVCakeCache, int, torch.Tensor] | None]
LEGACY_PENDING = contextvars.ContextVar("kvcake_pending", default=None)


class KVCakeCache(RecurrentStates, Cache):
    """A compressing KV cache for one batch of prompts.

    Parameters
    ----------
    model:
        The transformers causal LM it will serve (checked by ``adapters.describe_model``).
    method:
        A :class:`~kvcake.method.Method`, or a preset/composed string with ``budget=``/``ratio=``.
    scenario:
        Which set of a calibration's CAKE temperatures to use (``kvcake.temperatures``):
        ``"question"`` (the default: a cache passed to ``model.generate`` compresses the prompt
        with its question) or ``"context"`` (a document compressed alone, asked about later;
        what :func:`kvcake.compress` picks). Only CAKE's layer allocator reads it.
    static:
        True (the default): at the end of the prompt every compressed layer that evicted
        something moves into preallocated buffers (``kvcake.step``) and each decode step writes
        into them in place, a step the compiler traces whole (``is_compileable``). False: the
        dynamic layout, which holds exactly the kept entries and reallocates as it goes; it is
        the slow, obviously-right reference the tests compare with, and the layout autograd goes
        back through (its kept entries carry their gradients; scores never do): static storage is
        written in place, as transformers' ``StaticCache`` is, so a static cache moves to it at the
        first step autograd records (``decoding.fit_torch_mode``). Layers that evicted nothing (a
        budget at least as long as the prompt) stay in the dynamic layout either way, exactly what
        transformers' ``DynamicLayer`` holds, until their first eviction.
    max_cache_len:
        The capacity in logical tokens, the prompt plus the tokens to generate, as transformers'
        ``StaticCache`` takes it (:func:`kvcake.generate` passes the length ``generate`` stops at).
        With it nothing reallocates while decoding up to that length: ``decode=none`` reserves
        room for every token to come, ``decode=fixed`` a head's budget or, if fewer, what the
        remaining tokens can fill. Past it, ``decode=none`` storage grows by ``kvcake.step.GROWTH``
        slots and a ``decode=fixed`` head keeps evicting at its reserved capacity. None (unknown):
        ``decode=none`` reserves ``kvcake.step.GROWTH`` slots at a time, ``decode=fixed`` its budget.
    kv_dtype, kv_recent:
        None (the default): the kept entries in the model's dtype. ``"fp8"``: in float8 from the end
        of the prompt on, one byte per element, read back in the model's dtype, the last ``kv_recent``
        tokens' entries (None: 32; 0: none) also held and read in the model's dtype (``kvcake.fp8``).

    Memory: ``kv_bytes()`` (and the peaks) count the buffers the cache holds, so with static storage
    they include the reserved capacity (empty slots are memory too); a :class:`~kvcake.context.CompressedContext`
    keeps its cache in the dynamic layout, exactly the kept entries, and reserves capacity only when asked.

    Use it inside :func:`kvcake.enable` (or through ``kvcake.api``): ``with kvcake.enable(model):
    model.generate(ids, cache=cache)`` (``past_key_values=cache`` before transformers 5.24).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        method: Method | str = "cake",
        *,
        record: bool = False,
        progress: bool = False,
        static: bool = True,
        scenario: str | Scenario | None = None,
        max_cache_len: int | None = None,
        kv_dtype: str | None = None,
        kv_recent: int | None = None,
        **budget_kwargs,
    ) -> None:
        self.scenario = Scenario.pick(scenario, QUESTION_DEFAULT.name, QUESTION_DEFAULT.why)
        self.kv_dtype = check_kv_dtype(kv_dtype, model)  # how the kept entries are stored after the prompt
        positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self.kv_recent = check_kv_recent(kv_recent, self.kv_dtype, positions)
        self.info: ModelInfo = describe_model(model)
        if budget_kwargs and isinstance(method, Method):
            raise ValueError("pass budget=/keep_ratio= to make_method, not with a Method object")
        self.method = method if isinstance(method, Method) else make_method(method, **budget_kwargs)
        self.model_type = self.info.model_type
        windows = self.info.windows or (None,) * self.info.num_layers
        keyless, beside = dict(self.info.recurrent), dict(self.info.beside)  # (hybrid_layer.py: beside)
        super().__init__(layers=[keyless_layer(keyless[i]) if i in keyless else CrossLayer() if i in self.info.cross
                                 else HybridLayer(beside[i]) if i in beside else attention_layer(self.info) if w is None
                                 else SlidingLayer(w, i in self.info.chunked) for i, w in enumerate(windows)])  # fmt: skip
        self.compressed: tuple[int, ...] = self.info.compressed_layers  # model layer of each budget column
        self._slot = {lid: g for g, lid in enumerate(self.compressed)}
        self.seq: SequenceBudgets | None = None
        self.budgets: torch.Tensor | None = None  # (B, L_g) final budgets of the compressed layers
        self.stage_budgets: list[torch.Tensor] = []  # cascade history, (B, m+1) per stage
        self.preferences: list[torch.Tensor] = []  # per layer (B,) float64
        self.entropy: list[torch.Tensor] = []
        self.variance: list[torch.Tensor] = []
        self.decode_budget: np.ndarray | None = None  # (B, L_g, H_kv), host
        self.count_scores: dict[int, torch.Tensor] = {}  # prefill only: head_counts.hold_prompt_scores
        self.head_places: dict[int, object] = {}  # prefill only: head counts on the host (head_counts.py)
        self.allocation_carry: dict = {}  # prefill only: the layer allocator's state between stages
        self.o_weights: dict[int, torch.Tensor] = {}  # prefill only: CriticalKV's W_O until first eviction
        # prefill only: a cascade stage's head counts (and kept sets, counted on the device) (head_counts.py)
        self.stage_counts: dict[int, tuple] = {}
        # prefill only: a layer's stage left for the next layer's update (cascade.prefill_stage), a
        # layer's first eviction waiting for the read its value norms need (pending_norms.py)
        self.pending_stage: cascade.PendingStage | None = None
        self.pending_norms: PendingNorms | None = None
        self.stage_at_scoring = False  # whether the stage running now runs as its layer is scored
        self.prefilled, self.score_memo = False, None  # score_memo: a replay's prefill scores (kvcake.replay)
        self.peak_kv_bytes = self.prefill_peak_kv_bytes = self._held_bytes = 0
        self._unconsumed: int | None = None
        self._layer_bytes: list[int] | None = None
        # record=True keeps, for every prefill eviction, (stage, layer, kept positions (B, H_kv, N) on the
        # CPU, -1 = empty, in the layer's order: best first while ranked): the cascade's tests.
        self.record = check_flag("record", record)
        self.history: list[tuple[int, int, torch.Tensor]] = []
        self._stage, self._bar = -1, None
        self.progress = check_flag("progress", progress)  # True: a bar over the layers in prefill
        self.tau: TauChoice | None = None  # CAKE's temperatures, once the budget is known (temperatures.py)
        cake = isinstance(self.method.layers, CakeAllocator)  # its temperatures: per model
        self._fingerprint = calibration_key(model) if cake else None
        self._model_name, self._family = (model_name(model), tau_family(model)) if cake else (None, None)
        self.static = check_flag("static", static)  # see the class docstring; False: the dynamic reference
        self._max_cache_len = check_capacity(max_cache_len)
        self._plan_sliding()
        # Tensor parallelism: this process holds a block of each layer's KV heads (or of a latent layer's
        # query heads); what is decided over every head is decided over every rank's (tensor_parallel.py).
        self.split, self.group_split = find_splits(model)
        self._new = copy.deepcopy({k: v for k, v in vars(self).items() if not k.endswith("split")})  # reset()

    @property
    def _waiting(self) -> bool:  # whether a layer's stage or eviction waits for this update
        return self.pending_stage is not None or self.pending_norms is not None

    # -- Cache interface -----------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx >= len(self.layers):
            raise ValueError(f"layer {layer_idx} of a model updated this KVCakeCache of {len(self.layers)} layers: "
                             "make the cache with the model that runs it, KVCakeCache(model, ...)")  # fmt: skip
        decoding.fit_torch_mode(self, layer_idx, key_states)  # autograd, inference mode: the layout
        layer = self.layers[layer_idx]
        held = layer.keys, layer.values  # a static step (and the ring) writes into them
        if isinstance(layer, (SlidingLayer, CrossLayer)):  # never compressed (sliding.py, cross.py)
            if self._waiting:  # the previous layer's stage or eviction
                self._run_stage(key_states, value_states)
            keys, values = layer.update(key_states, value_states, *args, **kwargs)
            if layer.plan or (isinstance(layer, SlidingLayer) and layer.attended(key_states.shape[-2])):
                self._hand_off(layer_idx, keys, kwargs)
            self._track_bytes(layer_idx, held)
            return keys, values
        if (
            not layer.is_initialized
            and (cap := self._max_cache_len) is not None
            and key_states.shape[-2] > cap
        ):
            raise ValueError(
                f"the prompt has {key_states.shape[-2]} tokens but KVCakeCache(max_cache_len={cap}) holds at "
                "most that many: pass max_cache_len=prompt tokens + max_new_tokens (or None when unknown)"
            )
        if not self.prefilled and layer_idx == self.compressed[0] and layer.is_initialized:
            raise RuntimeError(
                "this KVCakeCache's prefill did not finish (an earlier forward was interrupted by an error, or "
                f"a model of fewer than its {len(self.layers)} layers ran it): its state is incomplete, so make "
                "a new KVCakeCache with the model that runs it"
            )
        if self._unconsumed is not None:
            LEGACY_PENDING.set(None)  # do not keep this cache's keys alive past the error
            raise RuntimeError(
                "KVCakeCache was updated but the kvcake attention did not run for layer "
                f"{self._unconsumed}: run the model inside `with kvcake.enable(model):` (or use "
                "kvcake.generate / kvcake.compress), otherwise nothing is compressed. If it already ran "
                f"inside, this architecture ({self.model_type}) does not call transformers' attention "
                "interface in every layer (some compute attention in their own code) and kvcake cannot compress it"
            )
        if layer.is_initialized and key_states.shape[0] != layer.batch:
            raise ValueError(
                f"this KVCakeCache holds a batch of {layer.batch} sequences but got {key_states.shape[0]}: "
                "a cache serves one batch of prompts, so make a new KVCakeCache per prompt (or batch)"
            )
        if self._waiting:  # the previous layer's stage (cascade.PendingStage) or eviction
            self._run_stage(key_states, value_states)  # (pending_norms.PendingNorms)
        decoding.outgrow_capacity(self, layer_idx, key_states.shape[-2])  # an eager step past max_cache_len
        keys, values = layer.update(key_states, value_states, **kwargs)
        self._hand_off(layer_idx, keys, kwargs)
        self._track_bytes(layer_idx, held)
        return keys, values

    def _hand_off(self, layer_idx: int, keys: torch.Tensor, kwargs: dict) -> None:
        """Leave this cache to layer ``layer_idx``'s kvcake attention (which ``consume``s it)."""
        self._unconsumed = layer_idx
        model_kwargs = kwargs.get("kwargs")
        if isinstance(model_kwargs, dict):  # the dict the model passes on to its attention function
            model_kwargs[HANDOFF] = self
        else:  # a model that hands nothing (5.0-5.23; see LEGACY_PENDING): its attention reads this back
            LEGACY_PENDING.set((self, layer_idx, keys))

    def crop(self, tokens_to_remove: int) -> None:
        self.layers[self.compressed[0]].crop(tokens_to_remove)

    is_croppable = False  # a property of transformers' Cache; a class attribute, as KVCakeLayer's
    reorder_cache = batch_select_indices = select_sequences  # beam search; a batch cut or repeated,
    batch_repeat_interleave = repeat_sequences  # every per-sequence budget following (sequences.py)

    def reset(self) -> None:
        """Forget the prompt, every layer and the state it left (budgets, temperatures, the layout),
        as new: transformers' ``Cache.reset`` (a StaticCache reused between prompts) reset the layers only."""
        self.__dict__.update(copy.deepcopy(self._new))

    @property
    def max_cache_len(self) -> int | None:
        """The capacity in logical tokens (prompt plus tokens to generate) when known
        (``KVCakeCache(max_cache_len=)``, :meth:`reserve`), else None. A property here:
        transformers 5.0's ``Cache`` has one without a setter."""
        return self._max_cache_len

    # -- static storage ------------------------------------------------------------------------
    def plan_static(self, lay_out: bool) -> None:
        """Give every compressed layer its static plan once the decoding budgets are fixed:
        ``((B, H_kv) decode budgets, max_cache_len)`` for ``decode=fixed``, ``(None,
        max_cache_len)`` for ``decode=none`` (``KVCakeLayer.to_static`` turns it into buffers).
        ``lay_out``: move the layers that evicted something into their buffers now (the end of
        the prompt, so that no decode step converts them); the others move at their first
        single-token step after an eviction. Sliding layers decode in their ring (``sliding.py``).
        None for ``static=False``."""
        self._plan_sliding()
        if not self.static:  # the dynamic layout: no plan (``serve(False)`` drops a static cache's)
            for lid in self.compressed:
                self.layers[lid].static_plan = None
            return
        for lid in self.compressed:
            layer = self.layers[lid]
            decoding.plan(self, lid)  # its static plan; a plain layer: whether it evicts before the capacity
            if lay_out and layer.static is None and layer.wants_static:
                layer.to_static()
                self._track_bytes(lid)

    def _plan_sliding(self) -> None:  # with static storage, in a ring (sliding.py; the kwargs hand-off)
        for layer in (x for x in self.layers if isinstance(x, SlidingLayer)):  # (its size: the capacity)
            layer.plan, layer.capacity = self.static and self.info.hands_kwargs, self.max_cache_len

    def serve(self, static: bool) -> None:
        """Choose how a prefilled cache kept in the dynamic layout (a compressed context) decodes:
        ``static`` sets the plans its layers move into static storage by right after their next
        multi-token append (a fork's question; ``lay_out_after_append``) or else at their first
        single-token step (nothing is laid out now, so it still holds exactly its kept entries)."""
        self.static = check_flag("static", static)
        self.plan_static(lay_out=False)

    def reserve(self, max_cache_len: int | None) -> None:
        """Set the capacity (class docstring) before decoding, e.g. a context's fork's once its question
        and ``max_new_tokens`` are known. Static layers keep theirs until a multi-token append."""
        self._max_cache_len = check_capacity(max_cache_len)
        if self.prefilled:
            self.plan_static(lay_out=False)
        else:
            self._plan_sliding()

    def compact(self) -> None:
        """Move the layers in static storage back to the dynamic layout, which holds exactly the
        kept entries (what a context file saves); they return to static storage at their next
        single-token step."""
        for lid, layer in enumerate(self.layers):
            if isinstance(layer, SlidingLayer):
                layer.to_dynamic()
            elif layer.static is not None:
                layer.step.to_dynamic(layer)
            self._track_bytes(lid)

    @property
    def is_compileable(self) -> bool:
        """Static storage (the default; sliding layers in their ring) makes a decode step one graph, which
        ``generate`` compiles as a static cache's; not where the model does not hand ``kwargs`` to ``update``
        or takes no 4-D mask (``info.own_masks``: Kosmos-2), whose static storage decodes eagerly."""
        return self.info.hands_kwargs and not self.info.own_masks and bool(self.static)

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        """One column where no layer reads the mask (a growing size would recompile a step): a sliding ring's
        token; a token over compressed layers all in static storage, compiled or in the 4-D mask ``generate``
        builds for that step, eagerly at its position (overlays index by it: Gemma 3's ``block_sequence_ids``)."""
        q = query_length.shape[0] if isinstance(query_length, torch.Tensor) else query_length  # (5.0)
        layer, static = self.layers[layer_idx], all(self.layers[i].static for i in self.compressed)
        if isinstance(layer, SlidingLayer):
            if layer.static is not None and q == 1:
                return 1, 0 if torch.compiler.is_compiling() else layer.cumulative_length
        elif static and (torch.compiler.is_compiling() or q == 1 and self.is_compileable):
            return 1, 0 if torch.compiler.is_compiling() else layer.length
        return super().get_mask_sizes(query_length, layer_idx)

    # -- bookkeeping ---------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes of keys and values held now (sliding layers too; static storage's capacity included)."""
        return sum(layer.kv_bytes() for layer in self.layers)

    def kv_bytes_parts(self) -> KVBytes:
        """Bytes held by the sliding and the compressed layers, and the full cache's."""
        return kv_bytes_parts(self)

    def kept_entries(self) -> int:
        """Kept entries over sequences, layers and KV heads."""
        return sum(layer.entries() for layer in self.layers)

    def _track_bytes(self, layer_idx: int, held: tuple | None = None) -> None:
        """Update the peak from layer ``layer_idx``'s change (a running total, not a sum over layers)."""
        target = self.layers[layer_idx]
        if held is not None and target.keys is held[0] and target.values is held[1]:
            return  # ``held``, its (keys, values) before an update, written in place: the same bytes
        if getattr(self, "_layer_bytes", None) is None or len(self._layer_bytes) != len(self.layers):
            self._layer_bytes = [layer.kv_bytes() for layer in self.layers]
            self._held_bytes = sum(self._layer_bytes)
        new = target.kv_bytes()
        self._held_bytes += new - self._layer_bytes[layer_idx]
        self._layer_bytes[layer_idx] = new
        self.peak_kv_bytes = max(self.peak_kv_bytes, self._held_bytes)
        if not self.prefilled:
            self.prefill_peak_kv_bytes = max(self.prefill_peak_kv_bytes, self._held_bytes)

    def layer_counts(self) -> np.ndarray:
        """(B, L_g, H_kv) entries kept per sequence, compressed layer and KV head."""
        return np.stack([self.layers[lid].counts for lid in self.compressed], axis=1)

    # -- called by the attention function ------------------------------------------------------
    def consume(self, layer_idx: int) -> None:
        self._unconsumed = None

    # The prefill stage (score, allocate, evict; cascade.py) and its eviction, kept as methods so
    # that a subclass can time them (bench/caches.py); ``self`` is their ``cache`` argument.
    after_prefill_attention = cascade.prefill_stage
    prompt_attention = cascade.prompt_attention
    _run_stage = cascade.run_stage
    _evict_layer = cascade.evict_layer

    def wants_probs(self, layer_idx: int, q: int) -> bool:
        """Whether this step's attention must return probabilities (decoding-time eviction)."""
        return decoding.wants_probs(self, layer_idx)

    def after_extend_attention(self, layer_idx: int, probs: torch.Tensor | None) -> None:
        """Decoding-time eviction (policy ``fixed``, ``decoding.evict_step``); scores carry no gradient."""
        scored = probs.detach() if probs is not None and probs.requires_grad else probs
        decoding.evict_step(self, layer_idx, scored)

    lay_out_after_append = decoding.lay_out_after_append

    # -- CAKE's temperatures -------------------------------------------------------------------
    @property
    def _tau(self) -> tuple[float, float] | None:  # the temperatures in force, as storage saves them
        return None if self.tau is None else (self.tau.tau1, self.tau.tau2)

    @_tau.setter
    def _tau(self, value: tuple[float, float] | None) -> None:  # a context file read back
        self.tau = None if value is None else TauChoice(float(value[0]), float(value[1]), "saved")
