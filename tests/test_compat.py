"""The transformers releases we declare: the cache keyword (``cache=`` from 5.24, which deprecates
``past_key_values=`` for removal in 5.40) and no deprecation warning from kvcake's own calls.

pyproject.toml also turns that deprecation into an error for the whole suite, so any call that
still spells the old name on a release that deprecates it fails where it is."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import transformers as tf

import kvcake
from kvcake import KVCakeCache
from kvcake.adapters import cache_keyword, with_cache
from kvcake.cache import cache_kv_bytes
from kvcake.model_code import calls_attention_interface, forward_hands_kwargs, hands_kwargs_to_cache

TAKES_CACHE = "cache" in inspect.signature(tf.LlamaForCausalLM.forward).parameters


def ids(n, seed=0):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def test_cache_keyword_follows_the_forward_signature():
    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None): ...

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs): ...

    assert cache_keyword(Old()) == "past_key_values" and cache_keyword(New()) == "cache"
    assert with_cache(New(), "c") == {"cache": "c"}


def test_the_kwargs_hand_off_is_read_off_every_cache_update_of_the_model():
    """A model hands its attention kwargs to the cache only where each cache update in its classes'
    forwards passes ``kwargs=`` (transformers 5.24's models; 5.6-5.23's called ``update(k, v,
    layer_idx)``, 5.0-5.3's passed ``cache_kwargs``, GPT-NeoX's still nothing in 5.24)."""

    class Hands(torch.nn.Module):
        def forward(self, k, v, cache, **kwargs):
            return cache.update(k, v, max(0, 1), kwargs=kwargs)  # nested parentheses in the call

    class Bare(torch.nn.Module):
        def forward(self, k, v, layer_past):
            return layer_past.update(k, v, 0)

    class Legacy(torch.nn.Module):
        def forward(self, k, v, past_key_values, cache_kwargs):
            return past_key_values.update(k, v, 0, cache_kwargs)

    class NoCache(torch.nn.Module):
        def forward(self, x, kwargs):
            kwargs.update(seen=True)  # a dict's update, not a cache's
            return x

    assert [forward_hands_kwargs(c) for c in (Hands, Bare, Legacy, NoCache)] == [True, False, False, None]
    assert hands_kwargs_to_cache(torch.nn.Sequential(Hands(), NoCache()))
    assert not hands_kwargs_to_cache(torch.nn.Sequential(Hands(), Bare()))
    assert not hands_kwargs_to_cache(torch.nn.Sequential(NoCache()))  # nothing read: not claimed


def attend_through_the_registry(query):
    return ALL_ATTENTION_FUNCTIONS  # noqa: F821 (never run: only the loaded name is read)


def test_the_attention_interface_is_read_off_the_code_of_a_layers_class():
    """A class calls the interface where a method, a method's nested function, a property, a module
    function one of them calls, or a base class reads the registry (``ALL_ATTENTION_FUNCTIONS``)."""

    class Direct(torch.nn.Module):
        def forward(self, query):
            return ALL_ATTENTION_FUNCTIONS  # noqa: F821

    class Helper(torch.nn.Module):
        def forward(self, query):
            return attend_through_the_registry(query)

    class Nested(torch.nn.Module):
        def forward(self, query):
            return (lambda: ALL_ATTENTION_FUNCTIONS)()  # noqa: F821

    class Property(torch.nn.Module):
        @property
        def attend(self):
            return ALL_ATTENTION_FUNCTIONS  # noqa: F821

    class Inherits(Direct):
        pass

    class Own(torch.nn.Module):  # attention written out (Bloom's ALiBi, XGLM)
        def forward(self, query, key):
            return torch.softmax(query @ key.transpose(-1, -2), -1)

    assert all(map(calls_attention_interface, (Direct, Helper, Nested, Property, Inherits)))
    assert not calls_attention_interface(Own) and not calls_attention_interface(torch.nn.Linear)
    assert calls_attention_interface(tf.models.llama.modeling_llama.LlamaAttention)
    assert not calls_attention_interface(tf.models.bloom.modeling_bloom.BloomAttention)


def test_the_installed_release_gets_its_own_keyword(tiny_llama):
    assert cache_keyword(tiny_llama) == ("cache" if TAKES_CACHE else "past_key_values")


def test_kvcake_calls_print_no_deprecation(tiny_llama):
    """Every entry point that runs the model (question-aware, context-only, follow-ups) under
    ``FutureWarning`` as an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        kvcake.generate(tiny_llama, ids(50), "cake", budget=16, window=8, max_new_tokens=3, do_sample=False)
        ctx = kvcake.compress(tiny_llama, ids(50), "adakv", budget=16, window=8)
        ctx.generate(ids(5, seed=1), max_new_tokens=3, do_sample=False)
        ctx.forward(ids(5, seed=2))


@pytest.mark.skipif(not TAKES_CACHE, reason=f"transformers {tf.__version__} takes past_key_values= only")
@pytest.mark.parametrize("spec", ["snapkv", "adakv"])  # a dense and a ragged cache
def test_cache_equals_past_key_values(tiny_llama, spec):
    """``cache=KVCakeCache(...)`` compresses exactly as ``past_key_values=`` did, in ``model(...)``
    and ``model.generate``."""
    prompt = ids(60)
    outs, caches, logits = [], [], []
    for name in ("cache", "past_key_values"):
        with warnings.catch_warnings(), kvcake.enable(tiny_llama), torch.no_grad():
            warnings.simplefilter("ignore", FutureWarning)  # the old name, on purpose
            # the capacity as transformers' StaticCache takes it (prompt + new tokens): without it
            # static storage reserves step.GROWTH slots per head, more than this short prompt
            cache = KVCakeCache(tiny_llama, spec, budget=16, window=8, max_cache_len=prompt.shape[1] + 5)
            outs.append(tiny_llama.generate(prompt, max_new_tokens=5, do_sample=False, **{name: cache}))
            caches.append(cache)
            one = KVCakeCache(tiny_llama, spec, budget=16, window=8)
            logits.append(tiny_llama(prompt, **{name: one}).logits)
            logits.append(tiny_llama(prompt[:, -1:], **{name: one}).logits)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(logits[0], logits[2]) and torch.equal(logits[1], logits[3])
    full = tf.DynamicCache(config=tiny_llama.config)
    with torch.no_grad():
        tiny_llama(outs[0], **with_cache(tiny_llama, full))
    assert caches[0].kv_bytes() == caches[1].kv_bytes() < cache_kv_bytes(full) / 2


def test_a_cache_keyword_the_attention_got_unused_is_refused(tiny_llama):
    """A ``cache=`` that reached the kvcake attention as a plain keyword (a release before 5.24
    passes unknown keywords down unused) is refused, naming the fix, on every release."""
    from kvcake.attention import _make_attention

    attention = _make_attention("sdpa")
    module = tiny_llama.model.layers[0].self_attn
    q, k = torch.zeros(1, 4, 3, 16), torch.zeros(1, 2, 3, 16)
    with pytest.raises(TypeError, match="past_key_values=cache, or \\*\\*kvcake.with_cache"):
        attention(module, q, k, k, None, cache=KVCakeCache(tiny_llama, "snapkv", budget=16, window=8))


def test_a_cache_keyword_in_a_module_without_a_layer_is_not_the_models(tiny_llama):
    """Kosmos-2's ``generate`` hands its keywords, the cache among them, to its vision tower too, whose
    attention (no ``layer_idx``) is not a decoder layer's: the stock kernel runs there, as without
    kvcake (it was refused as a stray cache)."""
    from kvcake.attention import _make_attention

    attention = _make_attention("sdpa")
    module = torch.nn.Module()  # a vision attention: no layer_idx
    module.is_causal = False
    q = torch.randn(1, 4, 3, 16, generator=torch.Generator().manual_seed(0))
    cache = KVCakeCache(tiny_llama, "snapkv", budget=16, window=8)
    out, _ = attention(module, q, q, q, None, cache=cache)
    expected = torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=0.25).transpose(1, 2)
    torch.testing.assert_close(out, expected)


@pytest.mark.skipif(TAKES_CACHE, reason=f"transformers {tf.__version__} takes cache=")
def test_old_release_model_call_with_cache_keyword_is_refused(tiny_llama):
    """On a release that takes ``past_key_values=`` only, ``model(ids, cache=kvcake_cache)``
    would silently compress nothing; under ``kvcake.enable`` it is refused."""
    cache = KVCakeCache(tiny_llama, "snapkv", budget=16, window=8)
    with kvcake.enable(tiny_llama), pytest.raises(TypeError, match="does not know the `cache` keyword"):
        tiny_llama(ids(40), cache=cache)


def test_a_sliding_layer_hands_transformers_its_window_by_name(monkeypatch):
    """transformers 5.8.1-5.13.1's ``DynamicSlidingWindowLayer(config=None, sliding_window=None)`` takes a
    config first (5.0-5.7 and 5.14.1-5.24 the window): given positionally, the window became the config
    and every hybrid cache failed to build there (50 tests on 5.12.0, 2026-11-29)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    from kvcake.sliding import SlidingLayer

    got = {}

    def config_first(self, config=None, sliding_window=None):  # 5.8.1-5.13.1's signature
        DynamicLayer.__init__(self)
        got.update(config=config, sliding_window=sliding_window)
        self.sliding_window, self.cumulative_length = sliding_window, 0

    monkeypatch.setattr(DynamicSlidingWindowLayer, "__init__", config_first)
    assert SlidingLayer(7).sliding_window == 7 and got == {"config": None, "sliding_window": 7}
