"""Instrumented caches: a full ``DynamicCache`` that tracks its peak bytes, and a ``KVCakeCache``
that times its own work and shares one prefill with other caches."""

from __future__ import annotations

import contextlib
import time
import types
from collections.abc import Iterable, Iterator, Sequence

import torch
from transformers import DynamicCache, StaticCache

from ..adapters import cache_keyword, with_cache
from ..cache import KVCakeCache, cache_kv_bytes
from ..fp8 import storage_spec
from ..logit_terms import PLAIN
from ..method import Method, make_method
from .probes import Clock


def dynamic_cache_bytes(cache: DynamicCache) -> int:
    """Bytes of keys and values a transformers ``DynamicCache`` holds, read off its layers."""
    return cache_kv_bytes(cache)


class FullCache(DynamicCache):
    """transformers' ``DynamicCache``, plus its peak bytes (a full cache only grows)."""

    def __init__(self, config=None) -> None:
        # With the model's config, a hybrid's sliding layers keep only their window, as in
        # transformers' own generate(); without, every layer keeps every token.
        super().__init__(config=config)
        self.peak_kv_bytes = 0
        self.tracking = True  # set False before timing decode steps: the sum costs a little

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.tracking:
            self.peak_kv_bytes = max(self.peak_kv_bytes, dynamic_cache_bytes(self))
        return out

    def kv_bytes(self) -> int:
        return dynamic_cache_bytes(self)


def static_copy(full: DynamicCache, config, max_cache_len: int) -> StaticCache:
    """A transformers ``StaticCache`` holding what ``full`` holds (the same prompt's keys and
    values), with room for ``max_cache_len`` tokens: the full cache's other layout, prefilled once."""
    out = StaticCache(config=config, max_cache_len=max_cache_len)
    for i, layer in enumerate(full.layers):
        n = layer.keys.shape[-2]
        out.update(layer.keys, layer.values, i, {"cache_position": torch.arange(n, device=layer.keys.device)})
    return out


def greedy_step(model: torch.nn.Module, own_code: bool = False):
    """``step(tok, pos, cache) -> next tok``: one greedy decode step at position ``pos`` (1, 1),
    the function the benches time eagerly and hand to ``torch.compile``. ``own_code``: the step
    on a copy of its code object, which dynamo, keying its compiled graphs on the code, treats as
    a function of its own (one per cache, compiled side by side: ``decoder.time_compiled``)."""
    keyword = cache_keyword(model)  # outside the step: it may be traced

    def step(tok: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
        out = model(input_ids=tok, position_ids=pos, **{keyword: cache})
        return out.logits[:, -1:].argmax(-1)  # (1, 1) greedy

    if own_code:
        code = step.__code__.replace()
        return types.FunctionType(code, step.__globals__, step.__name__, step.__defaults__, step.__closure__)
    return step


class BenchCache(KVCakeCache):
    """A ``KVCakeCache`` that times its own work and can share one prefill with other caches.

    Timers (seconds, wall clock, device synchronised): ``prefill_hook_s`` inside
    ``after_prefill_attention`` and the stages it leaves to the next layer's update (scoring,
    allocation, eviction), ``prefill_evict_s`` the part in
    ``_evict_layer`` (selection and the copy), ``decode_hook_s`` inside ``after_extend_attention``
    (decoding-time scoring and eviction). Overriding a private method is acceptable here: the
    benchmark measures the core, it does not change it.

    Followers (``follow``): other caches fed the very same keys, values and queries during this
    cache's prefill, so one forward pass yields every method's compressed cache at once. Each
    follower stores, scores and evicts on its own exactly as it would alone (the model's attention
    reads the full prompt either way); ``detach()`` ends the sharing before decoding.
    """

    def __init__(self, model: torch.nn.Module, method: Method | str, **kwargs) -> None:
        super().__init__(model, method, **kwargs)
        self.clock = Clock(next(model.parameters()).device)
        self.prefill_hook_s = 0.0
        self.prefill_evict_s = 0.0
        self.decode_hook_s = 0.0
        self._timing_now: set[str] = set()  # the timers running (_timed)
        self.timing = True  # False: decode steps untimed (the compiled ones)
        self.followers: list[BenchCache] = []
        self.full: FullCache | None = None

    def follow(self, caches: Iterable[BenchCache], full: FullCache | None = None) -> BenchCache:
        self.followers = list(caches)
        self.full = full
        return self

    def detach(self) -> None:
        self.followers, self.full = [], None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        for other in self.followers:
            other.update(key_states, value_states, layer_idx, *args, **kwargs)
            other.consume(layer_idx)
        if self.full is not None:
            self.full.update(key_states, value_states, layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def after_prefill_attention(
        self, layer_idx, module, query, key_valid, scaling, column_sums=None, terms=PLAIN
    ) -> None:
        with self._timed("prefill_hook_s"):
            super().after_prefill_attention(layer_idx, module, query, key_valid, scaling, column_sums, terms)
        for other in self.followers:  # (the leader's column sums are its own scorer's)
            other.after_prefill_attention(layer_idx, module, query, key_valid, scaling, None, terms)

    def _run_stage(self, *incoming) -> None:
        # a stage the next layer's update runs (CAKE's, cascade.prefill_stage) is in-cache work too
        with self._timed("prefill_hook_s"):
            super()._run_stage(*incoming)

    def _evict_layer(self, layer_idx, budget) -> None:
        with self._timed("prefill_evict_s"):
            super()._evict_layer(layer_idx, budget)

    def after_extend_attention(self, layer_idx, probs) -> None:
        if not self.timing:  # compiled steps: nothing host-side in the traced step
            super().after_extend_attention(layer_idx, probs)
            return
        with self._timed("decode_hook_s"):
            super().after_extend_attention(layer_idx, probs)

    @contextlib.contextmanager
    def _timed(self, timer: str) -> Iterator[None]:
        """Add the block's wall time (device synchronised before and after) to the attribute
        ``timer``; a block inside one that already times ``timer`` adds nothing (the outer counts
        it once: a stage run inside ``after_prefill_attention``)."""
        if timer in self._timing_now:
            yield
            return
        self._timing_now.add(timer)
        self.clock.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._timing_now.discard(timer)
        self.clock.sync()
        setattr(self, timer, getattr(self, timer) + time.perf_counter() - t0)


def build_cache(
    model: torch.nn.Module, name: str, budget: int, window: int = 32, static: bool = True,
    max_cache_len: int | None = None,
) -> BenchCache:  # fmt: skip
    """The bench cache of method ``name`` (``storage_spec``: a spec, maybe ``+fp8``)."""
    spec, kv_dtype = storage_spec(name)
    method = make_method(spec, budget=budget, window=window)
    return BenchCache(model, method, static=static, max_cache_len=max_cache_len, kv_dtype=kv_dtype)


def shared_prefill(
    model: torch.nn.Module, ids: torch.Tensor, caches: Sequence[BenchCache], full: FullCache | None = None
) -> None:
    """Prefill ``ids`` (1, S) once into every cache of ``caches`` (and ``full``): see ``BenchCache``."""
    from ..attention import enable

    if not caches:
        raise ValueError("shared_prefill needs at least one KVCakeCache")
    lead = caches[0].follow(caches[1:], full)
    try:
        with enable(model), torch.no_grad():
            model(ids, **with_cache(model, lead), logits_to_keep=1)
    finally:
        lead.detach()
