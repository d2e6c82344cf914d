"""Static storage is the default (issue 22, item 1): its capacity is known up front, nothing
reallocates while decoding within it, the bytes count it, and the dynamic layout
(``static=False``) stays the reference.

Tolerance: static storage attends over the same entries as the reference but in another slot
order and with another mask, so its logits equal the reference's up to float32 rounding
(measured: at most 1.8e-7 over every preset and 80 steps of the tiny model; asserted at 1e-5).
Layers that evicted nothing stay in the dynamic layout, so a budget covering an unpadded prompt
keeps the prompt's logits bit-identical either way (``test_cache``); its decoding steps are bit for
bit with ``static=False`` and, with the static default, equal to rounding (at most 9e-8 measured):
transformers gives a compileable cache an explicit causal mask instead of SDPA's ``is_causal``
(``test_hostile.test_huge_budget_is_a_bit_identical_no_op``).
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import kvcake
from kvcake import KVCakeCache, make_method
from kvcake.adapters import with_cache
from kvcake.context import CompressedContext
from kvcake.step import GROWTH
from shared_checks import prompt


def _decode(model, cache, ids, steps, mask=None):
    """Prefill ``ids``, then ``steps`` greedy single-token steps: (steps, B, vocab) logits and,
    per step, the data pointers of every compressed layer's keys and values.

    Every step's key and value tensors are held until the end, so a storage freed by a
    reallocation cannot be handed out again at the same address (the CPU allocator did that once:
    a reference that reallocated every step showed the same pointers at its first and last step).
    Equal pointers therefore mean the same storage."""
    logits, pointers, held = [], [], []
    with kvcake.enable(model), torch.no_grad():
        out = model(ids, attention_mask=mask, **with_cache(model, cache))
        for _ in range(steps):
            tok = out.logits[:, -1:].argmax(-1)
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(tok)], 1)
            out = model(tok, attention_mask=mask, **with_cache(model, cache))
            logits.append(out.logits[:, -1])
            layers = [cache.layers[lid] for lid in cache.compressed]
            pointers.append([(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in layers])
            held.append([(layer.keys, layer.values) for layer in layers])
    return (torch.stack(logits) if logits else None), pointers


def test_the_default_is_static(tiny_llama):
    model = tiny_llama
    assert KVCakeCache(model, "snapkv", budget=24, window=4).static is True
    assert KVCakeCache(model, "snapkv", budget=24, window=4, static=False).static is False


@pytest.mark.parametrize("spec", ["snapkv", "adakv", "cake", "h2o", "cake-adakv"])
def test_nothing_reallocates_within_max_cache_len(tiny_llama, spec):
    """With ``max_cache_len`` = prompt + steps, both policies decode past ``GROWTH`` tokens in the
    buffers laid out at the end of the prompt; the reference reallocates every step."""
    model = tiny_llama
    ids, steps = prompt(100, seed=3), GROWTH + 6
    method = make_method(spec, budget=24, window=4)
    cache = KVCakeCache(model, method, max_cache_len=ids.shape[1] + steps)
    logits, pointers = _decode(model, cache, ids, steps)
    assert all(cache.layers[lid].static == method.decode for lid in cache.compressed)
    assert all(p == pointers[0] for p in pointers), "static storage reallocated while decoding"
    ref = KVCakeCache(model, method, static=False)
    ref_logits, ref_pointers = _decode(model, ref, ids, steps)
    assert ref_pointers[0] != ref_pointers[-1]
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert (cache.layer_counts() == ref.layer_counts()).all()


def test_the_capacity_follows_how_generate_is_told_to_stop(tiny_llama, monkeypatch):
    """The capacity is the length ``model.generate`` stops at, however it is told: ``max_new_tokens``
    by keyword or from the model's generation config (first, as transformers has it), ``max_length``
    by keyword or in a generation config passed. Only the first was read: with the others a
    decode=none cache reserved 64 slots at a time and grew past them (a new shape for a compiled
    step). A ``max_length`` saved in the model's own config is left unknown: 5.0 counts it after the
    prompt, later releases from the start."""
    model = tiny_llama
    ids, steps = prompt(100, seed=3), GROWTH + 6
    method = make_method("snapkv,decode=none", budget=24, window=4)
    config = model.generation_config
    reserved = []
    monkeypatch.setattr(KVCakeCache, "reserve", lambda self, n: reserved.append(n))
    ctx = kvcake.compress(model, ids[:, :90], method)
    passed = GenerationConfig(max_length=100 + steps, do_sample=False, eos_token_id=None, pad_token_id=0)
    ways = [
        ({"max_new_tokens": steps}, None),
        ({"max_length": 100 + steps}, None),
        ({"max_length": 10, "max_new_tokens": steps}, None),
        ({"generation_config": passed}, None),
        ({}, steps),
    ]  # fmt: skip  (the last: max_new_tokens saved in the model's config)
    held = []  # bytes: room for every token to come, or GROWTH slots at a time past the prompt
    for kw, saved in ways:
        monkeypatch.setattr(config, "max_new_tokens", saved)
        greedy = {} if "generation_config" in kw else {"do_sample": False, "eos_token_id": None}
        out, cache = kvcake.generate(model, ids, method, **greedy, **kw)
        assert cache.max_cache_len == 100 + steps == out.shape[1], kw
        held.append(cache.kv_bytes())
        assert held[-1] == held[0], kw
        ctx.generate(ids[:, 90:], **greedy, **kw)
        assert reserved.pop() == 100 + steps, kw
    monkeypatch.setattr(config, "max_new_tokens", None)
    monkeypatch.setattr(config, "max_length", 100 + steps)
    _, cache = kvcake.generate(model, ids, method, do_sample=False, eos_token_id=None)
    assert cache.max_cache_len is None


def test_capacity_is_memory(tiny_llama):
    """decode=none reserves every token up to max_cache_len; decode=fixed a head's budget (+ the
    spare slot), or its entries plus the tokens left when that is less."""
    model = tiny_llama
    ids = prompt(100, seed=3)
    entry = 2 * 16 * 4  # K + V, head_dim 16, float32
    none = KVCakeCache(model, make_method("snapkv,decode=none", budget=24, window=4), max_cache_len=110)
    _decode(model, none, ids, 0)
    kept = none.layer_counts()  # (1, L, H_kv)
    assert none.kv_bytes() == (int(kept.sum()) + 10 * kept.size) * entry
    fixed = KVCakeCache(model, make_method("snapkv,decode=fixed", budget=24, window=4), max_cache_len=110)
    _decode(model, fixed, ids, 0)
    assert fixed.kv_bytes() == (int(fixed.layer_counts().sum()) + kept.size) * entry  # budget + spare
    ref = KVCakeCache(model, make_method("snapkv,decode=fixed", budget=24, window=4), static=False)
    _decode(model, ref, ids, 0)
    assert ref.kv_bytes() == int(ref.layer_counts().sum()) * entry  # the reference: what is kept
    assert fixed.peak_kv_bytes >= fixed.kv_bytes() > ref.kv_bytes()


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "64"])
def test_bad_capacity_is_refused(tiny_llama, bad):
    with pytest.raises(ValueError, match="max_cache_len must be a positive int"):
        KVCakeCache(tiny_llama, "snapkv", budget=24, window=4, max_cache_len=bad)


@pytest.mark.parametrize("bad", ["False", "yes", 0, None])
def test_a_flag_that_is_not_a_bool_is_refused(tiny_llama, bad):
    """bool('False') is True: a string or a number for static= (record=, progress=) would have
    turned static storage on silently (static='False' was taken as True)."""
    for flag in ("static", "record", "progress"):
        with pytest.raises(TypeError, match=rf"{flag} must be True or False, got {bad!r}"):
            KVCakeCache(tiny_llama, "snapkv", budget=24, window=4, **{flag: bad})
    ctx = kvcake.compress(tiny_llama, prompt(40), "snapkv", budget=24, window=4)
    with pytest.raises(TypeError, match="static must be True or False"):
        ctx.cache.serve(bad)
    with pytest.raises(TypeError, match="static must be True or False"):  # before the prefill
        kvcake.compress(tiny_llama, prompt(40), "snapkv", budget=24, window=4, static=bad)
    with pytest.raises(TypeError, match="static must be True or False"):
        kvcake.generate(tiny_llama, prompt(40), "snapkv", budget=24, window=4, static=bad, max_new_tokens=2)


def test_a_prompt_longer_than_the_capacity_is_refused_before_any_compute(tiny_llama):
    model = tiny_llama
    cache = KVCakeCache(model, "snapkv", budget=24, window=4, max_cache_len=50)
    with kvcake.enable(model), torch.no_grad(), pytest.raises(ValueError, match="max_new_tokens"):
        model(prompt(60), **with_cache(model, cache))
    assert all(layer.keys is None for layer in cache.layers)


def test_a_budget_covering_a_padded_prompt_equals_the_reference_up_to_rounding(tiny_llama):
    """Left padding makes every layer compact itself (not plain), so both layouts decode over the
    same entries: static=False bit for bit as before, the static default to float rounding."""
    model = tiny_llama
    ids = torch.randint(3, 128, (2, 60), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :25] = 0
    method = make_method("cake", budget=100, window=4)
    static = KVCakeCache(model, method, max_cache_len=90)
    logits, _ = _decode(model, static, ids, 30, mask)
    assert any(static.layers[lid].static is not None for lid in static.compressed)
    ref = KVCakeCache(model, method, static=False)
    ref_logits, _ = _decode(model, ref, ids, 30, mask)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))


@pytest.mark.parametrize("spec", ["snapkv", "adakv"])
def test_a_compressed_context_holds_exactly_the_kept_entries(tiny_llama, spec):
    """kvcake.compress leaves its cache in the dynamic layout (kv_bytes = what was kept, the same as
    static=False's); each answer decodes in static storage on its fork, as the reference does."""
    model = tiny_llama
    ids, question = prompt(120, seed=4), prompt(6, seed=5)
    ctx = kvcake.compress(model, ids, spec, budget=24, window=4)
    ref = kvcake.compress(model, ids, spec, budget=24, window=4, static=False)
    assert all(layer.static is None for layer in ctx.cache.layers)
    assert ctx.cache.kv_bytes() == ref.cache.kv_bytes()
    assert ctx.cache.kv_bytes() == ctx.cache.kept_entries() * 2 * 16 * 4
    before = ctx.cache.kv_bytes()
    out = ctx.generate(question, max_new_tokens=GROWTH + 4, do_sample=False)
    assert torch.equal(out, ref.generate(question, max_new_tokens=GROWTH + 4, do_sample=False))
    assert ctx.cache.kv_bytes() == before and all(layer.static is None for layer in ctx.cache.layers)


def test_a_context_with_static_layers_saves_its_kept_entries(tiny_llama, tmp_path):
    """A context whose layers are in static storage saves (and loads back) exactly the kept
    entries; the loaded context answers as the original."""
    model = tiny_llama
    ids, question = prompt(120, seed=6), prompt(5, seed=7)
    ctx = kvcake.compress(model, ids, "cake", budget=24, window=4)
    expected = ctx.cache.kv_bytes()
    cache = ctx.fork()
    cache.plan_static(lay_out=True)
    assert all(cache.layers[lid].static == "fixed" for lid in cache.compressed)
    static_ctx = CompressedContext(model, cache, ctx.input_ids, ctx.attention_mask, ctx.logits)
    static_ctx.save(tmp_path / "c.kvc")
    assert cache.layers[cache.compressed[0]].static == "fixed", "saving does not change the context"
    loaded = kvcake.load_context(model, tmp_path / "c.kvc")
    assert loaded.cache.kv_bytes() == expected
    assert all(layer.static is None and layer.static_plan is not None for layer in loaded.cache.layers)
    torch.testing.assert_close(loaded.forward(question), ctx.forward(question), rtol=1e-5, atol=1e-5)
    a = loaded.generate(question, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, ctx.generate(question, max_new_tokens=8, do_sample=False))
    dynamic = kvcake.load_context(model, tmp_path / "c.kvc", static=False)
    assert all(layer.static_plan is None for layer in dynamic.cache.layers)


def test_generate_compile_switch(tiny_llama, monkeypatch):
    """compile=None leaves it to transformers (no config, compiling allowed: it compiles a static
    cache on CUDA, not on a CPU); False forbids it; True needs static storage."""
    model = tiny_llama
    ids = prompt(40, seed=8)
    seen = []
    real = model.generate

    def spy(*args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        seen.append((kwargs.get("disable_compile"), kwargs.get("compile_config"), cache.static))
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    default, _ = kvcake.generate(model, ids, "snapkv", budget=24, window=4, max_new_tokens=4, do_sample=False)
    eager, _ = kvcake.generate(
        model, ids, "snapkv", budget=24, window=4, max_new_tokens=4, do_sample=False, compile=False
    )
    dynamic, _ = kvcake.generate(
        model, ids, "snapkv", budget=24, window=4, max_new_tokens=4, do_sample=False, static=False
    )
    assert seen == [(None, None, True), (True, None, True), (None, None, False)]
    assert torch.equal(default, eager) and torch.equal(default, dynamic)
    with pytest.raises(ValueError, match="drop static=False"):
        kvcake.generate(
            model, ids, "snapkv", budget=24, window=4, max_new_tokens=4, static=False, compile=True
        )


def test_a_huge_budget_is_bounded_by_the_capacity(tiny_llama):
    """A left-padded batch compacts its layers, so a budget far beyond the prompt would make
    decode=fixed storage preallocate the whole budget (refused, naming max_cache_len:
    test_static); with the capacity known, each head reserves only what the tokens left can fill."""
    model = tiny_llama
    ids = torch.randint(3, 128, (2, 60), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :25] = 0
    method = make_method("cake", budget=2**40, window=4)
    cache = KVCakeCache(model, method, max_cache_len=68)
    logits, pointers = _decode(model, cache, ids, 8, mask)
    assert all(p == pointers[0] for p in pointers)
    for lid in cache.compressed:
        layer = cache.layers[lid]
        assert layer.static == "fixed" and layer.keys.shape[2] <= 60 + 8 + 1
    ref_logits, _ = _decode(model, KVCakeCache(model, method, static=False), ids, 8, mask)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
