"""``output_attentions=True`` after the prompt: a compressed layer returns its kept entries' weights
by position, (B, H, q, positions seen), as a full cache's eager attention does, 0 where evicted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import kvcake
from kvcake import KVCakeCache
from kvcake.adapters import with_cache
from kvcake.inspect import kept_mask
from kvcake.method import PRESETS

PROMPT = 40


@pytest.fixture(scope="module")
def eager(make_tiny_llama):
    return make_tiny_llama(attn_implementation="eager")


def _ids(n, seed=0, batch=1):
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _step(model, cache, ids, mask=None):
    """Prefill ``ids`` into ``cache``, then one token with output_attentions: its weights per layer."""
    with kvcake.enable(model), torch.no_grad():
        out = model(ids, attention_mask=mask, **with_cache(model, cache), use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        held = [kept_mask(cache, PROMPT, row) for row in range(ids.shape[0])]  # (L, H_kv, S) each
        more = None if mask is None else torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        step = model(
            nxt, attention_mask=more, **with_cache(model, cache), use_cache=True, output_attentions=True
        )
    return step, np.stack(held, 1)  # (L, B, H_kv, S)


@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "full"])
def test_weights_sit_on_the_kept_positions(eager, preset, static):
    """Every preset and layout, a left-padded batch of 2: each row sums to 1 and is non-zero exactly
    on the positions the head held (``kept_mask``) and the new token."""
    ids = _ids(PROMPT, 1, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding of the second row
    cache = KVCakeCache(eager, preset, budget=16, window=4, static=static)
    step, held = _step(eager, cache, ids, mask)
    heads = eager.config.num_attention_heads
    group = heads // eager.config.num_key_value_heads
    assert len(step.attentions) == len(cache.layers)
    for lid, w in enumerate(step.attentions):
        assert w.shape == (2, heads, 1, PROMPT + 1)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, heads, 1), rtol=0, atol=1e-5)
        expect = np.concatenate([held[lid], np.ones((*held.shape[1:3], 1), bool)], -1)  # the new token
        expect = np.repeat(expect, group, axis=1)  # (B, H, S + 1)
        assert np.array_equal(w[:, :, 0].numpy() > 0, expect), (preset, lid)
        assert not w[1, :, 0, :6].any()  # the pads


def test_weights_equal_a_full_cache_masked_to_the_kept_positions(eager):
    """StreamingLLM keeps the same positions in every layer and head, so the full cache's eager
    attention, with the new token's row masked to them, gives the same weights and logits."""
    ids = _ids(PROMPT, 2)
    cache = KVCakeCache(eager, "streamingllm", budget=16, window=4)
    step, held = _step(eager, cache, ids)
    kept = held[0, 0, 0]  # (S,)
    assert (held == kept).all() and 0 < kept.sum() < PROMPT  # one kept set: every layer and head
    with torch.no_grad():
        first = eager(ids).logits[:, -1:].argmax(-1)
        full_ids = torch.cat([ids, first], dim=1)
        n = PROMPT + 1
        allowed = torch.ones(n, n, dtype=torch.bool).tril()
        allowed[-1, :PROMPT] = torch.from_numpy(kept)
        bias = torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
        ref = eager(full_ids, attention_mask=bias, output_attentions=True, use_cache=False)
    for w, r in zip(step.attentions, ref.attentions, strict=True):
        torch.testing.assert_close(w, r[:, :, -1:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(step.logits[:, -1], ref.logits[:, -1], rtol=1e-4, atol=1e-4)


def test_static_and_dynamic_layouts_give_the_same_weights(eager):
    """Generating several tokens (entries evicted as it goes): the static storage's weights equal
    the dynamic reference's, step by step, dense and ragged."""
    for preset in ("h2o", "adakv", "cake"):
        got = []
        for static in (True, False):
            cache = KVCakeCache(eager, preset, budget=16, window=4, static=static)
            with kvcake.enable(eager), torch.no_grad():
                out = eager.generate(_ids(PROMPT, 3), **with_cache(eager, cache), max_new_tokens=5,
                                     min_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                                     output_attentions=True)  # fmt: skip
            got.append(out.attentions[1:])
        for a, b in zip(*got, strict=True):
            for x, y in zip(a, b, strict=True):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def _generated_weights(model, cache, steps=5):
    with kvcake.enable(model), torch.no_grad():
        out = model.generate(_ids(PROMPT, 4), **with_cache(model, cache), max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, return_dict_in_generate=True, output_attentions=True)  # fmt: skip
    return out.attentions[1:]


@pytest.mark.parametrize("tiny_gemma3", ["eager"], indirect=True)
def test_hybrid_weights_every_layer(tiny_gemma3):
    """A hybrid (Gemma 3): its sliding layers' ring returns the window's weights as transformers'
    sliding layers do, so with nothing evicted every layer's weights equal the full cache's, step by
    step; compressed, the static layout's equal the dynamic reference's."""
    full = _generated_weights(tiny_gemma3, DynamicCache(config=tiny_gemma3.config))
    roomy = _generated_weights(tiny_gemma3, KVCakeCache(tiny_gemma3, "snapkv", budget=64, window=4))
    static = _generated_weights(tiny_gemma3, KVCakeCache(tiny_gemma3, "adakv", budget=16, window=4))
    dynamic = _generated_weights(
        tiny_gemma3, KVCakeCache(tiny_gemma3, "adakv", budget=16, window=4, static=False)
    )
    windows = {a.shape[-1] for step in full for a in step}
    assert len(windows) > 2  # the sliding layers' window beside the global layers' growing width
    for pair in ((full, roomy), (static, dynamic)):
        for a, b in zip(*pair, strict=True):
            assert len(a) == len(b) == len(tiny_gemma3.model.layers)
            for x, y in zip(a, b, strict=True):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_full_method_on_a_padded_batch_equals_the_full_cache(eager):
    """``method="full"`` drops a left-padded prompt's pads (so its layers are not plain): its weights
    by position equal a ``DynamicCache``'s, the pads' columns 0 in both."""
    ids = _ids(PROMPT, 1, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    got = []
    for cache in (DynamicCache(config=eager.config), KVCakeCache(eager, "full")):
        with kvcake.enable(eager), torch.no_grad():
            out = eager.generate(ids, attention_mask=mask, **with_cache(eager, cache), max_new_tokens=3,
                                 min_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                                 output_attentions=True, pad_token_id=0)  # fmt: skip
        got.append([a for step in out.attentions[1:] for a in step])
    assert not any(layer.plain for layer in cache.layers)  # the kept entries' path, not the model's kernel
    for a, b in zip(*got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("preset", ["snapkv", "adakv", "cake"])
def test_a_question_appended_to_a_compressed_context(eager, preset):
    """A question of several tokens after ``kvcake.compress``: one row per question token, each
    summing to 1 and causal (no weight on the question's later tokens)."""
    ctx = kvcake.compress(eager, _ids(PROMPT, 5), preset, budget=16, window=4)
    with torch.no_grad():
        out = ctx.generate(_ids(6, 6), max_new_tokens=2, min_new_tokens=2, do_sample=False,
                           return_dict_in_generate=True, output_attentions=True)  # fmt: skip
    for w in out.attentions[0]:
        assert w.shape == (1, eager.config.num_attention_heads, 6, PROMPT + 6)
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]), rtol=0, atol=1e-5)
        future = torch.ones(6, 6, dtype=torch.bool).triu(1)
        assert not w[..., PROMPT:][..., future].any() and (w[..., PROMPT:][..., ~future] > 0).all()


def test_sdpa_returns_none_as_transformers_does(tiny_llama):
    """Only the eager kernel's weights are returned (transformers warns that SDPA has none and
    returns none): a compressed cache under SDPA returns none after the prompt either."""
    got = []
    for cache in (
        DynamicCache(config=tiny_llama.config),
        KVCakeCache(tiny_llama, "snapkv", budget=16, window=4),
    ):
        with kvcake.enable(tiny_llama), torch.no_grad():
            out = tiny_llama.generate(_ids(PROMPT), **with_cache(tiny_llama, cache), max_new_tokens=2,
                                      min_new_tokens=2, do_sample=False, return_dict_in_generate=True,
                                      output_attentions=True)  # fmt: skip
        got.append([[a for a in step or () if a is not None] for step in out.attentions])  # None: 5.0
    assert got[0] == got[1] == [[], []]
