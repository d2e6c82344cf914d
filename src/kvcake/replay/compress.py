"""Rebuild a method's compressed cache from a recorded full-cache forward, without the model.

A prefill's forward does not depend on the method (every layer attends over its full keys and
values; eviction only changes what is kept), so one recorded forward (:mod:`.capture`) serves
every method and budget. :func:`replay_compress` feeds the recorded queries and the full cache's
keys and values to a fresh :class:`~kvcake.cache.KVCakeCache` exactly as the kvcake attention
function does during a real prefill (``update``, ``consume``, ``after_prefill_attention``);
``tests/eval/test_fidelity.py`` checks that a replayed cache equals ``kvcake.compress``'s, entry
for entry, for every preset, so a change of that protocol shows up there.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvcake.cache import KVCakeCache, cache_kv_bytes
from kvcake.context import CompressedContext
from kvcake.hybrid_layer import HybridLayer
from kvcake.method import Method
from kvcake.recurrent import EmptyLayer, RecurrentLayer, copy_states
from kvcake.scorers import PrefillInputs, Scorer
from kvcake.sliding import SlidingLayer, copy_sliding_state

from .capture import Captured

__all__ = ["ScoreMemo", "cache_bytes", "replay_compress"]


class ScoreMemo:
    """Prefill scores already computed for a layer's recorded inputs, to reuse across budgets.

    A scorer's prefill scores depend on the layer's queries, keys and the window, never on the
    budget, so replaying one prompt at several budgets needs them once. Entries are keyed on the
    identity of the recorded queries (kept alive here, so an id is never reused) and on the
    scorer's configuration, one per layer and scorer; the keys are compared by value, since each
    replay's cache holds its own copy of them (``devices.owned``: a recording cropped after its
    continuation keeps its keys as views of a longer storage). Until 2026-12-07 they were keyed
    on identity too: every replay of such a recording missed, scored again and kept its copy
    alive (a Gemma-3-270M calibration grew by 1.4 GB a minute). A hit returns a copy."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple] = {}  # (query, keys, scores, window sums or None)

    def scores(self, scorer: Scorer, inp: PrefillInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``scorer.prefill_sums(inp)``, copied."""
        key = (id(inp.query), inp.window, float(inp.scaling), type(scorer), repr(scorer))
        hit = self._entries.get(key)
        if hit is None or hit[0] is not inp.query or not _same(hit[1], inp.keys):
            hit = (inp.query, inp.keys, *scorer.prefill_sums(inp))
            self._entries[key] = hit  # replaces a stale entry: one per layer and scorer
        return hit[2].clone(), None if hit[3] is None else hit[3].clone()

    def __len__(self) -> int:
        return len(self._entries)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same keys (one tensor, or equal copies)."""
    if a is b:
        return True
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))


def replay_compress(
    model: torch.nn.Module,
    method: Method,
    captured: Captured,
    cache: DynamicCache,
    input_ids: torch.Tensor,
    logits: torch.Tensor,
    chunks: int | None = None,
    memo: ScoreMemo | None = None,
    scenario: str | None = None,
) -> CompressedContext:
    """Compress a prompt whose full-cache forward was recorded, without running the model again.

    Parameters
    ----------
    captured:
        Queries recorded by :func:`capture_queries` during the forward(s) that filled ``cache``.
    cache:
        The full ``DynamicCache`` holding the prompt's keys and values (B, H_kv, S, d) per layer;
        it is not modified.
    input_ids:
        (B, S) the prompt's ids; ``logits``: (B, vocab) of its last token.
    chunks:
        Use the first ``chunks`` recorded forwards' queries (their total length must be ``S``).
    memo:
        Reuse prefill scores across calls on the same recording (e.g. several budgets).
    scenario:
        The set of calibrated CAKE temperatures (``KVCakeCache``'s ``scenario``; default
        ``"question"``): give ``"context"`` when the prompt does not end with its question.

    Returns the same :class:`~kvcake.api.CompressedContext` ``kvcake.compress`` builds: each layer
    is stored in full, then scored and evicted by the cache's prefill hook, in layer order (so the
    CAKE cascade runs as in a real prefill).
    """
    kv = KVCakeCache(model, method, scenario=scenario, static=False)  # as kvcake.compress: the kept entries
    # The method stays the one given, so the cache resolves its scorer as kvcake.compress does (CAKE's
    # calibrated indicator included); only the scoring of each layer's prompt is looked up in the memo.
    kv.score_memo = memo
    try:
        _replay_layers(kv, captured, cache, input_ids, chunks)
    finally:
        kv.score_memo = None  # the prefill's alone: forks (deep copies) must not carry the recording
    kv.serve(static=True)  # its forks decode in static storage, as kvcake.compress's
    return CompressedContext(model, kv, input_ids, torch.ones_like(input_ids), logits)


def _replay_layers(
    kv: KVCakeCache, captured: Captured, cache: DynamicCache, input_ids: torch.Tensor, chunks: int | None
) -> None:
    """Feed every layer's recorded queries and full keys and values to ``kv``, in layer order."""
    valid = torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    with torch.no_grad():
        for layer in range(len(kv.layers)):
            if isinstance(kv.layers[layer], SlidingLayer):  # left as the full cache holds it
                copy_sliding_state(cache.layers[layer], kv.layers[layer])
                continue
            if isinstance(kv.layers[layer], (RecurrentLayer, EmptyLayer)):  # states: as the full cache's
                copy_states(cache.layers[layer], kv.layers[layer])
                continue
            query = captured.query(layer, chunks)
            keys, values = cache.layers[layer].keys, cache.layers[layer].values
            if query.shape[2] != keys.shape[2] or keys.shape[2] != input_ids.shape[1]:
                raise ValueError(
                    f"layer {layer}: {query.shape[2]} recorded queries, {keys.shape[2]} cached keys, "
                    f"{input_ids.shape[1]} prompt ids: they must match"
                )
            if isinstance(kv.layers[layer], HybridLayer):  # its states beside the keys: the full cache's
                copy_states(cache.layers[layer], kv.layers[layer])
            kv.update(keys, values, layer, kwargs={})  # a model's attention kwargs (hand-off unused)
            kv.consume(layer)  # what the kvcake attention function does before its hooks
            kv.after_prefill_attention(
                layer,
                captured.modules[layer],
                query,
                valid,
                captured.scaling[layer],
                None,
                captured.terms[layer],
            )


def cache_bytes(cache) -> int:
    """Bytes of keys and values a cache holds (``kv_bytes()`` for a KVCakeCache); a full
    ``DynamicCache``'s entries at their size (``storage=False``: a hybrid's sliding windows as held
    once decoding, not the whole prompt their slices keep until then), what records compare with."""
    return cache_kv_bytes(cache, storage=False)
