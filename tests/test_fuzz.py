"""Fuzzing: random method compositions (every registry in ``method.py``), random budgets, ratios
and windows, batches of 1-3 left-padded prompts on tiny GQA/MHA models (sdpa and eager), driven
through prefill, a chunk and single-token decoding steps, with the cache's invariants checked
after every step. Seeded: case ``i`` is always the same composition."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

import kvcake
from kvcake import KVCakeCache, fp8
from kvcake.adapters import with_cache
from kvcake.budget import BudgetSpec
from kvcake.method import DECODE_POLICIES, HEAD_ALLOCATORS, LAYER_ALLOCATORS, SCORERS, SELECTORS, make_method

CASES = int(os.environ.get("KVCAKE_FUZZ_CASES", "25"))  # e.g. 500 for a deeper local run
STEPS = (1, 1, 3, 1, 1, 1)  # new tokens per forward after prefill: single tokens and one chunk


@pytest.fixture(scope="module")
def models(make_tiny_llama):
    """(GQA, sdpa), (MHA, sdpa), (GQA, eager), (MQA, eager): private copies for this module."""
    return [
        make_tiny_llama(num_key_value_heads=2, attn_implementation="sdpa"),
        make_tiny_llama(num_key_value_heads=4, attn_implementation="sdpa"),
        make_tiny_llama(num_key_value_heads=2, attn_implementation="eager"),
        make_tiny_llama(num_key_value_heads=1, attn_implementation="eager"),
    ]


def random_case(seed: int):
    rng = random.Random(seed)
    parts = {
        "layers": rng.choice(sorted(LAYER_ALLOCATORS)),
        "heads": rng.choice(sorted(HEAD_ALLOCATORS)),
        # every (scorer, decoding policy) pair within the first 10 cases; the rest is random
        "score": sorted(SCORERS)[seed % len(SCORERS)],
        "select": rng.choice(sorted(SELECTORS)),
        "decode": DECODE_POLICIES[(seed // len(SCORERS)) % len(DECODE_POLICIES)],
    }
    spec = ",".join(f"{k}={v}" for k, v in parts.items())
    batch = rng.randint(1, 3)
    lengths = [rng.randint(1, 120) for _ in range(batch)]
    window = rng.randint(1, 16)
    if rng.random() < 0.5:
        budget_kw = {"budget": rng.randint(window, 90)}
    else:
        budget_kw = {"ratio": round(rng.uniform(0.05, 1.0), 3)}
        try:
            BudgetSpec(ratio=budget_kw["ratio"], window=window).per_layer(torch.tensor(lengths))
        except ValueError:  # too small for the window on some prompt: the smallest ratio that fits
            budget_kw = {"ratio": min(1.0, window / min(n for n in lengths if n > window) + 0.01)}
    return spec, budget_kw, window, lengths, rng.randrange(4), rng.randrange(1 << 30)


def check_layers(cache: KVCakeCache, lengths, pads, prefill: bool, label: str) -> None:
    """Kept positions are valid, unique, never padding, the window (prefill) or the newest
    ``window`` tokens (decoding) are kept; bytes held match the layout (the dynamic one: the kept
    entries; static storage: its slots, with a free one per head for the next token)."""
    counts = cache.layer_counts()  # (B, L, H_kv)
    window = cache.method.budget.window
    total_bytes = 0
    for li, layer in enumerate(cache.layers):
        pos = layer.padded_positions()  # (B, H_kv, N), -1 = empty
        length = layer.length
        for b, n in enumerate(lengths):
            first = pads[b]
            prompt_end = first + n  # logical columns of the prompt: [first, prompt_end)
            must = set(range(prompt_end - min(window, n), prompt_end)) if prefill else \
                set(range(max(first, length - window), length))  # fmt: skip
            for h in range(pos.shape[1]):
                kept = pos[b, h][pos[b, h] >= 0].tolist()
                if layer.plain:  # nothing evicted: the layer holds every column, padding included
                    assert kept == list(range(length)), label
                    continue
                assert len(kept) == counts[b, li, h], label
                assert len(set(kept)) == len(kept), f"{label}: duplicate positions"
                assert all(first <= p < length for p in kept), f"{label}: padding or future position kept"
                assert must <= set(kept), (
                    f"{label}: layer {li} seq {b} head {h} lost {sorted(must - set(kept))}"
                )
        el = layer.keys.element_size()
        d = layer.keys.shape[-1]
        ring = fp8.recent_bytes(layer)  # float8 storage's recent entries, held beside the slots
        if layer.recent_positions is not None:
            check_ring(layer, pos, f"{label}: layer {li}")
        if layer.static is not None:  # static storage: every head's slots, reserved capacity included
            # ragged: every segment's capacity and the one always-empty slot of the padded view
            slots = (
                int(layer.capacity.sum()) + 1 if layer.layout == "ragged" else layer.keys.shape[:3].numel()
            )
            assert layer.kv_bytes() == slots * 2 * d * el + ring, label
            if layer.layout == "ragged":
                assert (layer.capacity > counts[:, li]).all(), f"{label}: a segment without a free slot"
            else:
                assert layer.keys.shape[2] > int(counts[:, li].max()), f"{label}: no free column"
        elif layer.layout == "ragged":
            assert layer.kv_bytes() == int(counts[:, li].sum()) * 2 * d * el + ring, label
        else:
            assert layer.keys.shape[2] == int(counts[:, li].max()), (
                f"{label}: dense layer wider than its fullest head"
            )
            assert (
                layer.kv_bytes()
                == layer.keys.shape[0] * layer.keys.shape[1] * layer.keys.shape[2] * 2 * d * el + ring
            )
        total_bytes += layer.kv_bytes()
    assert cache.kv_bytes() == total_bytes


def check_ring(layer, pos: torch.Tensor, label: str) -> None:
    """Float8 storage's rings (``kvcake.fp8``): every kept entry of the last ``R`` tokens is in its
    slot (``position % R`` of its KV head's ring), which is what makes the attention read it exactly,
    and no slot holds an older token's entry or a later one's."""
    rings = layer.recent_positions  # (B, H_kv, R)
    r = rings.shape[-1]
    assert bool((rings < layer.length).all()), f"{label}: a ring holds a future token"
    held = rings[rings >= 0]
    assert bool((held >= layer.length - r).all()), f"{label}: a ring holds a token older than its last {r}"
    for b in range(pos.shape[0]):
        for h in range(pos.shape[1]):
            recent = [p for p in pos[b, h].tolist() if p >= max(layer.length - r, 0)]
            slots = [int(rings[b, h, p % r]) for p in recent]
            assert slots == recent, f"{label} seq {b} head {h}: kept {recent}, rings {slots}"


def kept_sets(layer) -> list[list[int]]:
    """Each sequence's and KV head's kept positions, in order."""
    return [sorted(p[p >= 0].tolist()) for p in layer.padded_positions().flatten(0, 1)]


def float8_case(case: int) -> int | None:
    """The ring of a fuzz case stored in float8 (every third case; None: the model's dtype), drawn
    apart from ``random_case`` so that the compositions stay what they were."""
    if case % 3 != 2:
        return None
    return random.Random(case).choice([0, 1, 3, 8, 32])


def fuzz_inputs(models, case: int):
    """Case ``case``'s model, method, label, generator, prompt lengths, left padding, ids and mask."""
    spec, budget_kw, window, lengths, model_idx, seed = random_case(case)
    label = f"case {case}: {spec} {budget_kw} window={window} lengths={lengths} model={model_idx}"
    method = make_method(spec, window=window, **budget_kw)
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    pads = [s - n for n in lengths]
    ids = torch.randint(3, 128, (len(lengths), s), generator=g)
    mask = (torch.arange(s)[None, :] >= torch.tensor(pads)[:, None]).long()
    return models[model_idx], method, label, g, lengths, pads, ids, mask


@pytest.mark.parametrize("case", range(CASES))
def test_fuzz_prefill_and_decode(models, case):
    model, method, label, g, lengths, pads, ids, mask = fuzz_inputs(models, case)
    s = ids.shape[1]
    recent = float8_case(case)
    if recent is not None:
        label += f" kv_dtype=fp8 kv_recent={recent}"
    fp8_kw = {} if recent is None else {"kv_dtype": "fp8", "kv_recent": recent}
    cache = KVCakeCache(model, method, **fp8_kw)
    with kvcake.enable(model), torch.no_grad():
        logits = model(ids, attention_mask=mask, **with_cache(model, cache)).logits
    assert bool(torch.isfinite(logits[mask.bool()]).all()), label

    n_layers, lengths_t = len(cache.layers), torch.tensor(lengths)
    per_layer = method.budget.per_layer(lengths_t)
    kept_per_layer = torch.minimum(cache.budgets, lengths_t[:, None])
    assert torch.equal(cache.budgets.sum(1), torch.minimum(per_layer * n_layers, lengths_t * n_layers)), label
    assert bool((cache.budgets <= lengths_t[:, None]).all()), label
    counts0 = cache.layer_counts()
    hkv = counts0.shape[2]
    if method.heads.ragged:
        assert np.array_equal(counts0.sum(2), kept_per_layer.numpy() * hkv), label
    else:
        assert np.array_equal(counts0, np.repeat(kept_per_layer.numpy()[:, :, None], hkv, axis=2)), label
    check_layers(cache, lengths, pads, prefill=True, label=label)

    grown = 0
    tok = logits[:, -1:].argmax(-1)
    with kvcake.enable(model), torch.no_grad():
        for q in STEPS:
            new = torch.cat([tok, torch.randint(3, 128, (len(lengths), q - 1), generator=g)], 1)
            mask = torch.cat([mask, torch.ones(len(lengths), q, dtype=mask.dtype)], 1)
            out = model(new, attention_mask=mask, **with_cache(model, cache)).logits
            grown += q
            assert bool(torch.isfinite(out).all()), label
            assert cache.get_seq_length() == s + grown, label
            counts = cache.layer_counts()
            if method.decode == "none":
                assert np.array_equal(counts, counts0 + grown), f"{label}: decode=none grows by one per token"
            else:
                assert np.array_equal(counts, np.minimum(counts0 + grown, cache.decode_budget)), \
                    f"{label}: decode=fixed keeps each head at its decoding budget"  # fmt: skip
            check_layers(cache, lengths, pads, prefill=False, label=f"{label} after +{grown}")
            tok = out[:, -1:].argmax(-1)


@pytest.mark.parametrize("case", range(CASES))
def test_fuzz_float8_with_a_covering_ring_decodes_as_the_models_dtype(models, case):
    """Any composition, batch, padding and chunk: float8 storage whose rings hold every token reads
    every entry exactly (its scales are powers of two), so it keeps the same entries and gives the
    same logits, bit for bit, at every forward as the same cache in the model's dtype."""
    model, method, label, g, lengths, pads, ids, mask = fuzz_inputs(models, case)
    s = ids.shape[1]
    plain = KVCakeCache(model, method)
    stored = KVCakeCache(model, method, kv_dtype="fp8", kv_recent=s + sum(STEPS))
    forwards = [(ids, mask)]
    for q in STEPS:
        mask = torch.cat([mask, torch.ones(len(lengths), q, dtype=mask.dtype)], 1)
        forwards.append((torch.randint(3, 128, (len(lengths), q), generator=g), mask))
    with kvcake.enable(model), torch.no_grad():
        for step, (x, m) in enumerate(forwards):
            want = model(x, attention_mask=m, **with_cache(model, plain)).logits
            got = model(x, attention_mask=m, **with_cache(model, stored)).logits
            assert torch.equal(got, want), f"{label}: forward {step}"
            for li, (a, b) in enumerate(zip(plain.layers, stored.layers, strict=True)):
                if a.keys is not None:
                    assert kept_sets(b) == kept_sets(a), f"{label}: forward {step} layer {li} kept others"
    assert any(layer.kv_scales is not None for layer in stored.layers), label
