"""A cascade stage's per-head counts for head-wise methods (Ada-KV and its combinations).

At every stage a cascade re-evicts every layer seen so far; a head-wise method first decides
how many entries each head of each layer keeps. Ada-KV counts on the host: each layer's scores
are laid out once for it when the layer is scored (``AdaKV.places``, copied to the host behind
the layer's work, ``devices.HostRead``), and every stage's counts are then host arithmetic, with
no read of the device (on a GPU each read drains the queue). Otherwise (tensor parallelism, whose
counts span every rank's heads, or ``HOST_COUNTS = False``, the reference) they are computed on
each layer's device and read back once a stage per device, and where the head allocator's kept
set is the selection itself (a top-k selector) the layers of a stage are selected in one call.
``cache`` is always a ``KVCakeCache`` (typed by its base: this module sits below ``cache.py``)."""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import Cache

from .devices import HostRead
from .ragged import to_device

# False counts on the device and reads the counts back at every stage (the reference; tests compare).
HOST_COUNTS = True


def hold_prompt_scores(cache: Cache, layer_idx: int, scores: torch.Tensor) -> bool:
    """Keep what later stages count layer ``layer_idx``'s heads on, from its prompt's scores
    (B, H_kv, S); True where that is a copy on its way to the host, which the stage should wait
    for a layer later (``cascade.PendingStage``). Head counts on the host: the scores' places
    (``cache.head_places``). Else, in a cascade whose selector may drop a top score (CriticalKV,
    whose kept set then lacks it), the scores themselves (``cache.count_scores``, 4 bytes an
    entry, freed at the end of prefill), so that every stage counts on the whole prompt and the
    cascade stays equal to one-shot eviction. The global allocator ranks layers on them too."""
    m = cache.method
    on_host = HOST_COUNTS and m.heads.host_counts and cache.split is None
    if on_host:
        cache.head_places[layer_idx] = HostRead(m.heads.places(scores))
    recount = m.heads.ragged and m.layers.cascading and not m.selector.keeps_top_scores and not on_host
    if recount or m.layers.needs_scores:
        cache.count_scores[layer_idx] = scores
    return on_host


def stage_head_counts(cache: Cache, layer_ids, budgets: torch.Tensor) -> None:
    """A cascade stage's head-wise counts of every layer in ``layer_ids`` (budgets (B, m) host,
    column j for ``layer_ids[j]``), computed on each layer's device and read back in one copy per
    device instead of one per layer (on a GPU each read drains the queue; a stage re-evicts every
    layer seen so far). Each layer's counts depend on its own scores and budget only, so they are
    those :func:`evict_layer` would compute; it takes them (and the padded scores) from
    ``cache.stage_counts``. Where the allocator's kept set is the selection, the layers of one
    device and layout are selected together (:func:`_kept_together`)."""
    m = cache.method
    window_host = cache.seq.window.numpy()
    by_device: dict[torch.device, list[tuple]] = {}
    together: dict[tuple[torch.device, str, int | None], list[tuple[int, int]]] = {}
    sent: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # budgets and windows, once a device
    for j, lid in enumerate(layer_ids):
        if lid in cache.head_places:  # on the host: the eviction pads the scores it selects on
            counts_host = m.heads.counts_on_host(_host_places(cache, lid), budgets[:, j].numpy(), window_host)
            cache.stage_counts[lid] = (None, None, counts_host, None)
            continue
        layer = cache.layers[lid]
        dev = layer.keys.device
        if dev not in sent:
            sent[dev] = (budgets.to(dev, non_blocking=True), cache.seq.window.to(dev, non_blocking=True))
        on_dev, window = sent[dev]
        if m.selector.top_counts and lid not in cache.count_scores:
            # dense layers (before their first eviction) go by length: they are evicted flat
            length = layer.keys.shape[2] if layer.layout == "dense" else None
            together.setdefault((dev, layer.layout, length), []).append((j, lid))
            continue
        # a cascade counts on the prompt's scores (``count_scores``): the layer's own are padded
        # only where its eviction selects (evict_layer), not where it keeps a ranked layer's first
        scores = None if lid in cache.count_scores else layer.padded(layer.scores, float("-inf"))
        counts = head_counts(cache, lid, scores, on_dev[:, j], window)
        by_device.setdefault(dev, []).append((lid, scores, counts, None))
    for (dev, _, _), group in together.items():
        by_device.setdefault(dev, []).extend(_kept_together(cache, group, budgets, *sent[dev]))
    for group in by_device.values():
        host = torch.stack([c for _, _, c, _ in group]).cpu().numpy()  # (m, B, H_kv): one read
        for (lid, scores, counts, keep), counts_host in zip(group, host, strict=True):
            cache.stage_counts[lid] = (scores, counts, counts_host, keep)


def _kept_together(cache: Cache, group: list[tuple[int, int]], budgets, on_dev, window) -> list[tuple]:
    """The allocator's kept sets of the layers ``group`` ((column of ``budgets``, layer) pairs, one
    device and layout, dense ones of one length) in one selection instead of one per layer: their
    padded scores side by side as ``m * B`` sequences of ``N`` entries (the longest layer's; -inf
    beyond a layer's own, which no selection keeps), each with its own layer's budget. A layer's
    kept set depends on its own scores and budget only, so it is the one a selection of that
    layer alone makes; on a GPU this is about forty launches a stage instead of forty a layer.
    Returns :func:`stage_head_counts`'s ``(layer, scores, counts, keep)`` per layer; ``budgets``
    (B, m) on the host, ``on_dev`` and ``window`` (B,) on the device."""
    layers = [cache.layers[lid] for _, lid in group]
    b, h = layers[0].batch, layers[0].kv_heads
    width = max(
        layer.meta.max_len if layer.layout == "ragged" else layer.scores.shape[-1] for layer in layers
    )
    padded = [layer.padded(layer.scores, float("-inf"), width) for layer in layers]
    scores = torch.stack(padded) if len(padded) > 1 else padded[0][None]  # (m, B, H_kv, N)
    m, n = len(layers), scores.shape[-1]
    if m == 1:
        budget = on_dev[:, group[0][0]]
    else:  # (m * B,) layer-major, as the scores
        budget = to_device(budgets[:, [j for j, _ in group]].T.reshape(-1).numpy(), scores.device)
        window = window.repeat(m)
    keep = cache.method.heads.select(scores.reshape(m * b, h, n), budget, window, cache.split).view(
        m, b, h, n
    )
    counts = keep.sum(-1)
    return [(lid, scores[k], counts[k], keep[k]) for k, (_, lid) in enumerate(group)]


def head_counts(cache: Cache, layer_idx: int, scores: torch.Tensor | None, budget, window) -> torch.Tensor:
    """(B, H_kv) per-head counts of a head-wise method on the device; a cascade counts on the
    prompt's scores (``count_scores``) at every stage, and ``scores`` (the layer's own, padded)
    may then be None."""
    full = cache.count_scores.get(layer_idx, scores)
    return cache.method.heads.counts(full, budget, window, cache.split)


def pinned_on(cache: Cache, budget: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """(B,) on ``device``: the prefix entries the head allocator pinned in each head at ``budget``
    (B,) host entries per head, where the selector keeps them (``Selector.keeps_pinned``), else None."""
    m = cache.method
    if (
        not m.selector.keeps_pinned
        or (pins := m.heads.pinned(budget.numpy(), cache.seq.window.numpy())) is None
    ):
        return None
    return to_device(pins, device)


def _host_places(cache: Cache, layer_idx: int):
    """Layer ``layer_idx``'s ``HostPlaces``, from its copy the first time (a wait, not a drain)."""
    got = cache.head_places[layer_idx]
    if isinstance(got, HostRead):
        got = cache.head_places[layer_idx] = cache.method.heads.host_places(got.wait().numpy())
    return got


def dense_counts(layer, budget: torch.Tensor, lengths: torch.Tensor) -> np.ndarray:
    """(B, H_kv) int64 entries each head keeps with uniform heads: ``budget`` (B,) capped by the
    entries it can hold, on the host. A layer holds its prompt (left padding included) until its
    first eviction and only real tokens after it, so the real entries of a head are the fewer of
    ``layer.counts`` and the sequence's length ``lengths`` (B,); they are the entries whose score
    is above -inf (padding's is -inf), which :func:`dense_counts_reference` counts on the device."""
    held = np.minimum(layer.counts, lengths.numpy()[:, None])
    return np.minimum(budget.numpy()[:, None], held).astype(np.int64)


def dense_counts_reference(scores: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """:func:`dense_counts` from the padded scores (B, H_kv, N) on their device (the tests' oracle)."""
    n_valid = (scores > float("-inf")).sum(-1)
    return torch.minimum(budget.to(scores.device)[:, None].expand_as(n_valid), n_valid)
