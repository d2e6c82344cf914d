"""The static decode step of a dense layer, top to bottom: lay out, append, attend, evict.

Layout ``(B, H_kv, C, d)``: every KV head of the batch has the same ``C`` columns (position -1
= empty slot, mask ``bias`` (B, H_kv, 1, C)).

* ``decode=none``: entries are appended at column ``used_dev`` (a device index, the same for
  every head); the capacity grows in fixed chunks of ``GROWTH`` columns.
* ``decode=fixed``: capacity ``C = max(kept, budget) + 1`` never grows, so every head has one
  *free* slot (``free``, (B, H_kv, 1)): the new entry is written there and attended; then the
  victim (argmin of the scores, window protected) is marked empty and its slot becomes the
  head's next free slot (nothing moves), or, for a head still under its budget, its next empty
  slot does.

The reference is the dynamic dense layer of ``layer.py`` (empty slots on the left, position
order), which ``to_dynamic`` restores.
"""

from __future__ import annotations

import numpy as np
import torch

from ..devices import cpu_route
from ..fp8 import folded, scaled
from ..logit_terms import PLAIN, LogitTerms
from .common import (
    FILLS,
    GROWTH,
    advance,
    attention_probs,
    attention_with_probs,
    bias,
    check_room,
    choose_victim,
    count_step,
    filled,
    finish,
    fused_attention,
    in_held_order,
    in_position_order,
    prepare,
    rank,
)


def to_static(layer, budget: np.ndarray | None, room: int = GROWTH) -> None:
    """Move a dense ``layer`` into columns with capacity.

    budget: (B, H_kv) decode budgets for ``decode=fixed``, None for ``decode=none``; room:
    ``decode=none`` steps preallocated before the storage grows (the cache's ``max_cache_len``
    minus the prompt when known, else ``GROWTH``). See ``common.prepare``."""
    room = max(int(room), 1)
    padded = prepare(layer, budget)
    n = layer.keys.shape[2]
    width = n + room if budget is None else max(n, int(budget.max())) + 1  # host ints
    if layer.full:  # and the budget fills every column but the free one
        layer.full = bool((budget == width - 1).all())
    for name, t in padded.items():
        if t is not None:
            out = filled(t, width, FILLS[name])
            out[:, :, :n] = t
            setattr(layer, name, out)
    layer.bias = None if layer.full else bias(layer.positions, layer.dtype)  # (B, H_kv, 1, C)
    finish(layer, budget)
    if budget is None:
        layer.used_dev = torch.full((1,), n, device=layer.keys.device)  # (1,) next free column
        layer.room = width - n
    else:  # each head's first empty column, and the rows that index it (``append``)
        layer.free = layer.positions.argmin(-1, keepdim=True)  # (B, H_kv, 1)
        # every head full and holding what the scorer's oldest_victim needs: the victim by rank (``evict``)
        k, least = layer.oldest or (0, 0)
        layer.kth = k if layer.full and int(budget.min()) >= least else 0
        b, h = layer.positions.shape[:2]
        layer.batch_rows = torch.arange(b, device=layer.keys.device).view(b, 1, 1)
        layer.head_rows = torch.arange(h, device=layer.keys.device).view(1, h, 1)
        col = layer.free.unsqueeze(-1)  # views of ``free``, which steps write in place: ``append``'s indices
        layer.free_keys = col.expand(b, h, 1, layer.keys.shape[-1])
        layer.free_values = col.expand(b, h, 1, layer.values.shape[-1])


def append(layer, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write the new token's entry in place: one write per stored tensor, and the mask's slot
    opened. k, v: (B, H_kv, 1, d)."""
    advance(layer, grow)
    if layer.static == "none":
        col = layer.used_dev  # (1,): the same column for every head
        check_room(layer, col, layer.keys.shape[2])
        layer.keys.index_copy_(2, col, k)
        layer.values.index_copy_(2, col, v)
        layer.positions.index_copy_(2, col, layer.newest)
        layer.bias.index_fill_(3, col, 0.0)
        layer.used_dev.add_(1)
        return
    # fixed: one column per head, keys[b, h, free[b, h]] = k[b, h]. Compiled, index_put_, which inductor
    # writes in place, where scatter_ became a copy of the whole tensor, the scatter into it and a copy
    # back (SmolLM2, `cake` at budget 128, one CPU step compiled: 34 -> 29 ms, its generated kernels 1.9
    # -> 0.7 ms, 2026-11-30); eagerly scatter_, the same writes without index_put_'s broadcast of its
    # three indices at every call (CPU profiler: 19 against 6 us a call; the CAKE presets' eager step
    # 1.47-1.50 -> 1.36-1.40 x DynamicCache's, scripts/eager_host_time.py, 2026-12-01).
    if layer.bias is not None:
        layer.bias.scatter_(3, layer.free.unsqueeze(-1), 0.0)
    if torch.compiler.is_compiling():
        at = (layer.batch_rows, layer.head_rows, layer.free)  # (B, 1, 1), (1, H_kv, 1), (B, H_kv, 1)
        layer.keys.index_put_(at, k)
        layer.values.index_put_(at, v)  # (latent: narrower values)
    else:  # free_keys, free_values: (B, H_kv, 1, d) views of free (to_static)
        layer.keys.scatter_(2, layer.free_keys, k)
        layer.values.scatter_(2, layer.free_values, v)
    layer.positions.scatter_(2, layer.free, layer.newest)


def attend(layer, query: torch.Tensor, scaling: float, return_probs: bool, terms: LogitTerms = PLAIN):
    """Attention of the new token over the layer (every stored entry is in its past and its own
    entry is stored, so ``bias`` is the whole mask). query: (B, H, 1, d).

    Returns the output (B, 1, H, d) and, if asked, the probabilities (B, H_kv, G, C) in float32.
    The reference is ``layer.dense_attention``. The output comes from the fused kernel over the
    storage as held (mask (B, H_kv, 1, C)), the call the layer makes without a scorer, so that a
    policy that reads probabilities changes nothing of the output's rounding: in bfloat16 on CUDA
    a float32 attention beside it flipped a near-tied greedy token against the StaticCache (h2o,
    2026-11-26, H100). The probabilities, where asked, are computed beside it in float32. Two
    exceptions, where both come from the explicit softmax: a soft cap or sinks (``terms``,
    ``kvcake.logit_terms``), and a float32 layer asked for probabilities on the CPU route
    (``devices.cpu_route``), where the fused kernel's second read of the keys and values cost more
    than one product of the probabilities with the values (``scripts/step_profile.py --methods
    snapkv,cake,h2o --budget 1024 --length 4096 --threads 2``, SmolLM2, 2026-12-06: ``snapkv``'s
    fused kernel 9.3 ms a compiled step, ``h2o``'s two products 6.6 ms)."""
    query, keys, values, value_scale = folded(layer, query, *layer.operands(), layer.positions)  # (fp8.py)
    b, hkv, c, d = keys.shape  # 3-D for bmm: (B*H_kv, C, d), mask (B*H_kv, 1, C)
    mask = None if layer.bias is None else layer.bias.reshape(b * hkv, 1, c)
    if not terms.fused or (return_probs and keys.dtype == torch.float32 and cpu_route(keys.device)):
        # (B*H_kv, C, d) and (B*H_kv, C, d_v): a latent layer's values are narrower than its keys
        flat_keys, flat_values = keys.reshape(b * hkv, c, d), values.reshape(b * hkv, c, values.shape[-1])
        out, probs = attention_with_probs(query, flat_keys, flat_values, mask, scaling, terms)
        return scaled(out, value_scale), probs if return_probs else None
    out, _ = fused_attention(query, keys, values, layer.bias, scaling)
    out = scaled(out, value_scale)
    if not return_probs:
        return out, None
    return out, attention_probs(query, keys.reshape(b * hkv, c, d), mask, scaling)


def evict(layer, scorer, probs: torch.Tensor | None, window: int, across=None) -> None:
    """decode=fixed: score the entries, evict one victim per head over its budget.

    probs: (B, H_kv, G, C) from ``attend``; ``across``: see ``common.rank``. The victim's column
    (``common.choose_victim``) becomes the head's ``free`` slot, where the next token is written:
    nothing is moved. Where the scorer ranks by position alone (``Scorer.oldest_victim``, StreamingLLM)
    and ``to_static`` found every head full and large enough (``layer.kth``), the victim is each
    head's ``kth`` oldest entry, one ``kthvalue``: what the scores would pick (``tests/test_static.py``)."""
    if layer.kth:
        victim = layer.positions.kthvalue(layer.kth, -1, keepdim=True).indices  # (B, H_kv, 1)
        layer.positions.scatter_(2, layer.free.copy_(victim), -1)
        count_step(layer)
        return
    ranked = rank(scorer, probs, layer.positions, layer.scores if scorer.stateful else None, across)
    if scorer.stateful:  # keep the new sums, in place (common.mark_static)
        in_held_order(ranked, out=layer.scores)
    # the victims (B, H_kv, 1), into the layer's own free (common.mark_static)
    free = choose_victim(layer, ranked, layer.positions, window, empty_slots=not layer.full, out=layer.free)
    layer.positions.scatter_(2, free, -1)  # an under-budget head's empty slot stays empty
    if scorer.stateful:
        layer.scores.scatter_(2, free, 0.0)  # the next token's sum starts at 0


# per sequence, (B, ...): what ``permute`` moves (``free``/``under`` for decode=fixed only); the
# rest of the layout (``used_dev``, ``pos_zero``, ``steps``, ``batch_rows``, ``head_rows``) is the
# same for every row
PER_SEQUENCE = ("keys", "values", "positions", "scores", "bias", "newest", "free", "under")


def permute(layer, rows: torch.Tensor, host: np.ndarray) -> bool:
    """Beam search's reorder (``kvcake.sequences``; as many ``rows`` (B,) as the batch holds):
    row ``i`` of every per-sequence buffer becomes row ``rows[i]``'s, written into itself, so
    the addresses a compiled step holds stay (``common.mark_static``). Always in place (True)."""
    for name in PER_SEQUENCE:  # what this layout holds
        t = getattr(layer, name, None)
        if t is not None:
            t.copy_(t.index_select(0, rows.to(t.device)))
    return True


def to_dynamic(layer) -> None:
    """Back to the reference layout: position order, empty slots on the left, as wide as the
    head with the most entries."""
    new_n = int(layer.counts.max())  # host
    for name, t in in_position_order(layer).items():
        setattr(layer, name, t[:, :, t.shape[2] - new_n :].contiguous())
    layer.static = None


def grow(layer) -> None:
    """decode=none: add ``GROWTH`` columns once the host-known room is gone (amortised)."""
    layer.room = GROWTH
    grown = [(name, fill, 2) for name, fill in FILLS.items()] + [("bias", float("-inf"), 3)]
    for name, fill, dim in grown:
        t = getattr(layer, name)
        if t is not None:
            out = filled(t, t.shape[dim] + GROWTH, fill, dim)
            out.narrow(dim, 0, t.shape[dim]).copy_(t)
            setattr(layer, name, out)
