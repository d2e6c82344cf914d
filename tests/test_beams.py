"""Beam search, and a batch repeated or cut, on a compressed cache (``kvcake.sequences``).

Invariants: a covering budget decodes the stock beams; static storage (permuted in place, or laid
out again) decodes as the dynamic reference; a reorder equals a cache that held the reordered
prompts from the start (kept positions, budgets and logits); a compiled step stays one graph across
reorders, in place.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import kvcake
from kvcake import KVCakeCache
from kvcake.adapters import with_cache
from kvcake.step.dense import PER_SEQUENCE
from kvcake.step.ragged import PER_HEAD, PER_SEGMENT, PER_SLOT, SLOT_INDICES
from shared_checks import KWARGS_HANDOFF, graph_recorder

# a dense prefill-only preset, dense and ragged decode=fixed ones (H2O's kept sums, CAKE's budgets),
# ragged decode=none ones: every kind of state the rows carry
SPECS = ["snapkv", "h2o", "cake", "adakv", "cake-adakv", "layer-defensivekv"]
BEAMS = {"num_beams": 3, "num_return_sequences": 2, "do_sample": False}


def _prompts(n: int = 40, batch: int = 2, pad: int = 0, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[-1, :pad] = 0
    return ids, mask


def _beams(model, ids, mask, cache, **kw) -> torch.Tensor:
    with warnings.catch_warnings(), kvcake.enable(model), torch.no_grad():
        warnings.simplefilter("ignore")  # a cache passed as past_key_values (5.24 names it cache)
        return model.generate(
            ids, attention_mask=mask, **with_cache(model, cache), max_new_tokens=8, **BEAMS, **kw
        )


@pytest.mark.parametrize("spec", kvcake.PRESETS)
def test_beam_search_with_a_covering_budget_is_stocks(tiny_llama, spec):
    """Every preset, a left-padded batch of two prompts, three beams each: the stock beams, token
    for token (static storage; the fixed-decoding presets reorder their kept sums too)."""
    ids, mask = _prompts(pad=5)
    stock = _beams(tiny_llama, ids, mask, DynamicCache())
    assert torch.equal(_beams(tiny_llama, ids, mask, KVCakeCache(tiny_llama, spec, budget=4096)), stock)


@pytest.mark.parametrize("spec", kvcake.PRESETS)
def test_beam_search_in_static_storage_decodes_as_the_reference(tiny_llama, spec):
    """Small budgets: static storage (dense permuted in place, ragged laid out again) decodes the
    beams the dynamic reference layout does, for a left-padded batch."""
    ids, mask = _prompts(pad=5)
    caches = [KVCakeCache(tiny_llama, spec, budget=12, window=4, static=s) for s in (True, False)]
    static, dynamic = (_beams(tiny_llama, ids, mask, c) for c in caches)
    assert torch.equal(static, dynamic)
    assert caches[0].layers[0].batch == 6 and caches[0].decode_budget.shape[0] == 6


@pytest.mark.parametrize("spec", SPECS)
def test_beam_search_over_float8_entries_decodes_as_the_reference(tiny_llama, spec):
    """Kept entries in float8 (uint8 bits, reordered like any entry): static storage decodes the
    beams the dynamic reference layout does, and the entries stay float8 bits."""
    ids, mask = _prompts(pad=5)
    caches = [
        KVCakeCache(tiny_llama, spec, budget=12, window=4, static=s, kv_dtype="fp8") for s in (True, False)
    ]
    static, dynamic = (_beams(tiny_llama, ids, mask, c) for c in caches)
    assert torch.equal(static, dynamic)
    assert all(caches[0].layers[lid].keys.dtype == torch.uint8 for lid in caches[0].compressed)
    # rings of recent entries covering every token follow their beams: the model's dtype's beams exactly
    ring = KVCakeCache(tiny_llama, spec, budget=12, window=4, kv_dtype="fp8", kv_recent=256)
    exact = KVCakeCache(tiny_llama, spec, budget=12, window=4)
    assert torch.equal(_beams(tiny_llama, ids, mask, ring), _beams(tiny_llama, ids, mask, exact))


def test_beam_search_on_a_hybrid_model_is_stocks(tiny_gemma3):
    """Gemma 3's sliding layers decode in a ring (permuted in place); its global layers are covered."""
    ids, mask = _prompts(n=30, pad=3)
    stock = _beams(tiny_gemma3, ids, mask, DynamicCache(config=tiny_gemma3.config))
    assert torch.equal(_beams(tiny_gemma3, ids, mask, KVCakeCache(tiny_gemma3, "cake", budget=4096)), stock)
    small = [KVCakeCache(tiny_gemma3, "cake", budget=10, window=4, static=s) for s in (True, False)]
    assert torch.equal(*(_beams(tiny_gemma3, ids, mask, c) for c in small))


def _decode(model, cache, ids: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Prefill ``ids`` (B, S), then feed ``steps`` (B, n) one token a step; the last logits (B, vocab)."""
    n = ids.shape[1]
    with kvcake.enable(model), torch.no_grad():
        model(input_ids=ids, **with_cache(model, cache))
        for i in range(steps.shape[1]):
            out = model(input_ids=steps[:, i : i + 1], **with_cache(model, cache),
                        position_ids=torch.full((ids.shape[0], 1), n + i))  # fmt: skip
    return out.logits[:, -1]


def _decode_more(model, cache, steps: torch.Tensor, at: int) -> torch.Tensor:
    """Feed ``steps`` (B, n) one token a step from position ``at``; the last logits (B, vocab)."""
    with kvcake.enable(model), torch.no_grad():
        for i in range(steps.shape[1]):
            out = model(input_ids=steps[:, i : i + 1], **with_cache(model, cache),
                        position_ids=torch.full((steps.shape[0], 1), at + i))  # fmt: skip
    return out.logits[:, -1]


def _kept(cache) -> list[list[int]]:
    """Each compressed layer's kept positions per sequence and head, in position order (static
    storage's empty slots, however many, left out)."""
    out = []
    for lid in cache.compressed:
        pos = cache.layers[lid].padded_positions().cpu().numpy()
        out += [sorted(p[p >= 0].tolist()) for p in pos.reshape(-1, pos.shape[-1])]
    return out


@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
@pytest.mark.parametrize("spec", SPECS)
def test_a_reorder_equals_a_cache_of_the_reordered_prompts(tiny_llama, spec, static):
    """Three prompts decoded 3 steps, then rows (2, 0, 0) taken (one dropped, one repeated, as beams
    are) and 3 more steps: the same kept positions, budgets and logits as a cache that held
    prompts (2, 0, 0) from the start and was fed the same tokens."""
    ids, _ = _prompts(batch=3)
    first = torch.randint(3, 128, (3, 3), generator=torch.Generator().manual_seed(2))
    then = torch.randint(3, 128, (3, 3), generator=torch.Generator().manual_seed(3))
    rows = torch.tensor([2, 0, 0])
    kw = {"budget": 12, "window": 4, "static": static}
    cache = KVCakeCache(tiny_llama, spec, **kw)
    _decode(tiny_llama, cache, ids, first)
    cache.reorder_cache(rows)
    with kvcake.enable(tiny_llama), torch.no_grad():  # the 3 more steps, after the prompt's
        for i in range(3):
            out = tiny_llama(input_ids=then[:, i : i + 1], **with_cache(tiny_llama, cache),
                             position_ids=torch.full((3, 1), 43 + i))  # fmt: skip
    reference = KVCakeCache(tiny_llama, spec, **kw)
    expected = _decode(tiny_llama, reference, ids[rows], torch.cat([first[rows], then], 1))
    torch.testing.assert_close(out.logits[:, -1], expected, rtol=1e-5, atol=1e-6)
    assert _kept(cache) == _kept(reference)
    assert np.array_equal(cache.decode_budget, reference.decode_budget)
    assert torch.equal(cache.budgets, reference.budgets)
    assert np.array_equal(cache.layer_counts(), reference.layer_counts())


# what a static layer's permutation in place leaves as it is: the same for every row, or (ragged)
# fixed by the capacities, which rows of one prompt share
UNMOVED = {"used_dev", "pos_zero", "steps", "batch_rows", "head_rows", "pad_index", "pad_rows", "pad_heads",
           "pad_rows4", "pad_bias", "cu_k", "next_end", "zero", "empty"}  # fmt: skip
MOVED = {"dense": set(PER_SEQUENCE), "ragged": {*PER_SLOT, *PER_SEGMENT, *PER_HEAD, *SLOT_INDICES}}
VIEWS_OF_FREE = {"free_keys", "free_values"}  # (B, H_kv, 1, d) views of ``free``: moved with it


@pytest.mark.parametrize("spec,layout", [("cake", "dense"), ("snapkv", "dense"), ("adakv", "ragged"),
                                         ("cake-adakv", "ragged")])  # fmt: skip
def test_a_static_reorder_of_beams_is_in_place(tiny_llama, spec, layout):
    """Rows of one prompt (beams) reordered: every tensor a static layer holds keeps its address (a
    compiled step's or a CUDA graph's buffers), each head's entries, as the step reads them (the
    padded view), are its source row's. Every tensor of the layout is classified: one added and not
    named in the permutation fails here."""
    ids, _ = _prompts(batch=1)
    cache = KVCakeCache(tiny_llama, spec, budget=12, window=4)
    _decode(tiny_llama, cache, ids.expand(3, -1), torch.full((3, 2), 7))
    _decode_more(tiny_llama, cache, torch.tensor([[5], [6], [9]]), 42)  # the beams differ
    layer = cache.layers[cache.compressed[0]]
    assert layer.static is not None and layer.layout == layout
    tensors = {name: t for name, t in vars(layer).items() if isinstance(t, torch.Tensor)}
    assert set(tensors) - MOVED[layout] <= UNMOVED | VIEWS_OF_FREE
    view = layer.pad_heads if layout == "ragged" else slice(None)
    before = {name: t.data_ptr() for name, t in tensors.items()}
    entries = [layer.positions[view].clone(), layer.keys[view].clone()]
    cache.reorder_cache(torch.tensor([1, 2, 1]))
    assert {name: getattr(layer, name).data_ptr() for name in tensors} == before
    assert torch.equal(layer.positions[view], entries[0][[1, 2, 1]])
    assert torch.equal(layer.keys[view], entries[1][[1, 2, 1]])
    for name in VIEWS_OF_FREE & set(tensors):  # views of the permuted free
        assert torch.equal(getattr(layer, name)[..., 0], layer.free)


@pytest.mark.skipif(not KWARGS_HANDOFF, reason="this transformers' models do not hand kwargs to cache.update")
@pytest.mark.parametrize("spec", ["cake", "adakv", "cake-adakv", "h2o"])  # dense, ragged; none, fixed
def test_a_compiled_step_stays_one_graph_across_reorders(tiny_llama, spec):
    """``torch.compile(model.forward, fullgraph=True)`` over 8 steps of two prompts' three beams each,
    the beams reordered after each step as beam search does (inside each prompt's): one graph, and
    the logits of the eager decode with the same reorders."""
    backend, graphs = graph_recorder()

    ids = _prompts(batch=2)[0].repeat_interleave(3, 0)  # (6, 40)
    reorders = torch.tensor([[1, 1, 0, 3, 5, 4], [2, 0, 1, 5, 3, 3]])
    logits = {}
    for compiled in (True, False):
        torch._dynamo.reset()
        step = torch.compile(tiny_llama.forward, backend=backend, fullgraph=True) if compiled else tiny_llama
        cache = KVCakeCache(tiny_llama, spec, budget=12, window=4, max_cache_len=60)
        with kvcake.enable(tiny_llama), torch.no_grad():
            tok = tiny_llama(input_ids=ids, **with_cache(tiny_llama, cache)).logits[:, -1:].argmax(-1)
            seen = []
            for i in range(8):
                out = step(input_ids=tok, **with_cache(tiny_llama, cache), position_ids=torch.full((6, 1), 40 + i),
                           cache_position=torch.tensor([40 + i]))  # fmt: skip
                seen.append(out.logits[:, -1])
                cache.reorder_cache(reorders[i % 2])
                tok = (torch.arange(6)[:, None] + 5 * i) % 128 + 3
        logits[compiled] = torch.stack(seen)
    assert len(graphs) == 1
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", ["snapkv", "h2o", "adakv"])
@pytest.mark.parametrize(
    "kw",
    [{"num_beams": 3, "num_return_sequences": 2}, {"do_sample": True, "num_return_sequences": 3}],
    ids=["beams", "samples"],
)
def test_a_context_answers_with_beams_and_samples(tiny_llama, spec, kw):
    """A compressed context repeats its rows for generate's beams or samples: covering, the stock
    answer (same seed); small budgets, static storage as the dynamic reference."""
    ids, mask = _prompts()
    question = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(4))
    full = torch.cat([ids, question], 1)
    torch.manual_seed(5)
    stock = tiny_llama.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=6, **kw)
    ctx = kvcake.compress(tiny_llama, ids, spec, budget=4096, attention_mask=mask)
    torch.manual_seed(5)
    assert torch.equal(ctx.generate(question, max_new_tokens=6, **kw), stock[:, full.shape[1] :])
    answers = []
    for static in (True, False):
        ctx = kvcake.compress(tiny_llama, ids, spec, budget=12, window=4, static=static)
        torch.manual_seed(5)
        answers.append(ctx.generate(question, max_new_tokens=6, **kw))
    assert torch.equal(*answers) and answers[0].shape == (2 * kw["num_return_sequences"], 6)


@pytest.mark.parametrize("spec", ["snapkv", "adakv"])  # dense, ragged
def test_a_repeated_then_cut_batch_is_the_batch_again(tiny_llama, spec):
    ids, _ = _prompts(batch=2)
    follow = torch.randint(3, 128, (2, 2), generator=torch.Generator().manual_seed(6))
    plain = KVCakeCache(tiny_llama, spec, budget=12, window=4)
    expected = _decode(tiny_llama, plain, ids, follow)
    cache = KVCakeCache(tiny_llama, spec, budget=12, window=4)
    _decode(tiny_llama, cache, ids, follow[:, :1])
    cache.batch_repeat_interleave(3)
    assert cache.layer_counts().shape[0] == 6 and cache.decode_budget.shape[0] == 6
    cache.batch_select_indices(torch.tensor([3, 0]))  # the second prompt's middle copy, the first's
    with kvcake.enable(tiny_llama), torch.no_grad():
        out = tiny_llama(input_ids=follow[[1, 0], 1:], **with_cache(tiny_llama, cache),
                         position_ids=torch.full((2, 1), 41))  # fmt: skip
    torch.testing.assert_close(out.logits[:, -1], expected[[1, 0]], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "rows,match",
    [
        (torch.tensor([0, 3]), r"row indices must lie in \[0, 2\)"),
        (torch.tensor([-1, 0]), r"row indices must lie in \[0, 2\)"),
        (torch.tensor([], dtype=torch.long), "at least one"),
        (torch.tensor([0.0, 1.0]), "1-D tensor of integer row indices"),
        (torch.tensor([[0, 1]]), "1-D tensor of integer row indices"),
    ],
)
def test_bad_rows_are_refused(tiny_llama, rows, match):
    cache = KVCakeCache(tiny_llama, "adakv", budget=12, window=4)
    _decode(tiny_llama, cache, _prompts()[0], torch.full((2, 1), 7))
    with pytest.raises(ValueError, match=match):
        cache.reorder_cache(rows)
    with pytest.raises(ValueError, match="repeats must be a positive int"):
        cache.batch_repeat_interleave(0)


@pytest.mark.parametrize("spec", ["cake", "adakv", "h2o"])
def test_kvcake_generate_searches_beams(tiny_llama, spec):
    """kvcake.generate refused num_beams: covering, the stock beams; small budgets, static storage
    as the dynamic reference, each prompt's beams compressed alike (the same layer budgets)."""
    ids, mask = _prompts(pad=5)
    kw = {"attention_mask": mask, "max_new_tokens": 8, **BEAMS}
    stock = tiny_llama.generate(ids, **kw)
    covered, _ = kvcake.generate(tiny_llama, ids, spec, budget=4096, **kw)
    assert torch.equal(covered, stock)
    (static, cache), (dynamic, _) = (kvcake.generate(tiny_llama, ids, spec, budget=12, window=4, static=s, **kw)
                                     for s in (True, False))  # fmt: skip
    assert torch.equal(static, dynamic) and static.shape == (4, 48)
    assert torch.equal(cache.budgets[0], cache.budgets[2]) and torch.equal(cache.budgets[3], cache.budgets[5])


def test_compile_with_beams_is_refused(tiny_llama):
    """transformers compiles the forward of greedy and sampled decoding only: compile=True with beams
    would decode eagerly while saying it compiles."""
    with pytest.raises(ValueError, match="beam search runs the model's forward eagerly"):
        kvcake.generate(tiny_llama, _prompts()[0], "snapkv", budget=12, window=4, max_new_tokens=2, num_beams=2,
                        compile=True)  # fmt: skip
