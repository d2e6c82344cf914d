"""Hostile and odd input: each case either works correctly or raises an error that names the
problem and what to do, and nothing leaves the model changed (its attention implementation,
hooks and logits are as before, errors included)."""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import types
import warnings

import pytest
import torch
import transformers as tf

import kvcake
from kvcake import KVCakeCache, make_method
from kvcake.adapters import with_cache
from kvcake.cache import LEGACY_PENDING
from kvcake.layer_types import attention_shape

PROBE = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(123))


def ids(n, seed=0, batch=1):
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _snapshot(model):
    impls = [(sub, sub.config._attn_implementation) for sub in model.modules()
             if getattr(sub, "config", None) is not None and hasattr(sub.config, "_attn_implementation")]  # fmt: skip
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return impls, hooks


@contextlib.contextmanager
def untouched(model):
    """Asserts on exit that the model is as it was: attention implementation of every (sub)config,
    no added hooks, no hand-off left pending, and the same logits for a plain forward."""
    impls, hooks = _snapshot(model)
    before = _logits(model)
    yield
    assert [(s, s.config._attn_implementation) for s, _ in impls] == impls, "attention implementation changed"
    assert _snapshot(model)[1] == hooks, "hooks left on the model"
    assert LEGACY_PENDING.get() is None, "a hand-off left behind"  # releases whose update takes cache_kwargs
    assert torch.equal(_logits(model), before), "plain forward changed"


def _logits(model):
    probe = PROBE.clamp(max=model.config.get_text_config().vocab_size - 1)  # (a VLM: its text config)
    extra = {"decoder_input_ids": probe[:, :5]} if model.config.is_encoder_decoder else {}
    with torch.no_grad():
        return model(probe, **extra).logits


# -- prompts -----------------------------------------------------------------------------------
def test_empty_prompt(tiny_llama):
    empty = torch.zeros(1, 0, dtype=torch.long)
    with untouched(tiny_llama):
        for fn in (kvcake.generate, kvcake.compress):
            with pytest.raises(ValueError, match="the prompt is empty: give at least one token"):
                fn(tiny_llama, empty, "cake", budget=16, window=8)
        # what a newcomer passes instead of ids, each refused with its fix
        encoding = tf.BatchEncoding(
            {"input_ids": ids(24), "attention_mask": torch.ones(1, 24, dtype=torch.long)}
        )
        wrong = [
            ("Name three colours.", "got text: tokenize it .* or ask in text with kvcake.answer"),
            (
                encoding,
                r"got the tokenizer's output \(BatchEncoding\): unpack it, kvcake.generate\(model, \*\*enc\)",
            ),
            ([1, 2, 3], r"got a list: torch.tensor\(\[ids\]\)"),
            (torch.tensor([1, 2, 3]), r"got a 1-D tensor of 3 ids: ids.unsqueeze\(0\)"),
            (torch.tensor([[[1, 2, 3]]]), r"got a tensor of shape \(1, 1, 3\)"),
            (ids(24).float(), r"got a torch.float32 tensor: ids are integers \(torch.long; ids.long\(\)"),
            (ids(24).bool(), r"got a torch.bool tensor: ids are integers"),
        ]
        for value, fix in wrong:
            for fn in (kvcake.generate, kvcake.compress):
                with pytest.raises(
                    TypeError, match=r"must be a \(batch, length\) tensor of token ids, " + fix
                ):
                    fn(tiny_llama, value, "cake", budget=16)
        # the fix the tokenizer's output is given works
        out, _ = kvcake.generate(tiny_llama, **encoding, budget=16, window=8, max_new_tokens=2)
        assert out.shape == (1, 26)
        assert kvcake.compress(tiny_llama, **encoding, budget=16, window=8).input_ids.shape == (1, 24)
        # A plain forward of nothing fails inside the model itself (transformers' reshape), before
        # the cache sees anything: documented, not ours to intercept.
        cache = KVCakeCache(tiny_llama, "cake", budget=16, window=8)
        with pytest.raises(RuntimeError, match="0 elements"), kvcake.enable(tiny_llama), torch.no_grad():
            tiny_llama(empty, **with_cache(tiny_llama, cache))


def test_attention_mask_not_shaped_like_the_ids(tiny_llama):
    """A mask of another shape failed deep inside the model ("The size of tensor a (40) must match
    the size of tensor b (39)"); it is refused up front with the fix, for generate and compress."""
    with untouched(tiny_llama):
        for mask, got in [(torch.ones(1, 39, dtype=torch.long), r"\(1, 39\)"), ([1] * 40, "list")]:
            for fn in (kvcake.generate, kvcake.compress):
                with pytest.raises(
                    ValueError, match=r"attention_mask must be shaped like input_ids \(1, 40\), got " + got
                ):
                    fn(tiny_llama, ids(40), "snapkv", budget=16, window=8, attention_mask=mask)


def test_ids_outside_the_vocabulary(tiny_llama):
    """Ids another tokenizer made (a larger vocabulary) or negative ones failed in the embedding as
    "index out of range in self" (on CUDA: a device-side assert that spoils the process); refused
    up front for the prompt and the follow-ups, naming the range and the fix."""
    vocab = tiny_llama.get_input_embeddings().num_embeddings
    ok = ids(24)
    with untouched(tiny_llama):
        for bad, token in [(vocab, vocab), (vocab + 1000, vocab + 1000), (-1, -1)]:
            prompt = ok.clone()
            prompt[0, 7] = bad
            for fn in (kvcake.generate, kvcake.compress):
                with pytest.raises(
                    ValueError,
                    match=rf"input_ids holds token id {token}, outside the model's vocabulary "
                    rf"\(ids 0 to {vocab - 1}\): tokenize with this model's own tokenizer",
                ):
                    fn(tiny_llama, prompt, "snapkv", budget=16, window=8)
        ctx = kvcake.compress(tiny_llama, ok, "snapkv", budget=16, window=8)
        follow_up = torch.tensor([[5, vocab]])
        with pytest.raises(ValueError, match=rf"question_ids holds token id {vocab}, outside"):
            ctx.generate(follow_up, max_new_tokens=2)
        with pytest.raises(ValueError, match=rf"ids holds token id {vocab}, outside"):
            ctx.forward(follow_up)
        # the last id of the table is a token like any other
        edge = torch.tensor([[5, vocab - 1]])
        assert ctx.generate(edge, max_new_tokens=2).shape == (1, 2)
        assert ctx.forward(edge).shape[:2] == (1, 2)


def test_follow_ups_that_are_not_ids(tiny_llama):
    """A compressed context's follow-ups: text or non-integer tensors are refused with the fix
    (text failed with "'str' object has no attribute 'shape'"); (B, q) and (q,) ids are taken."""
    ctx = kvcake.compress(tiny_llama, ids(40), "snapkv", budget=16, window=8)
    wrong = [("What?", "got text: tokenize it"), (ids(3).float(), "got a torch.float32 tensor"),
             ([5, 6], "got a list"), (ids(3)[None], r"got a tensor of shape \(1, 1, 3\)")]  # fmt: skip
    for value, fix in wrong:
        with pytest.raises(
            TypeError, match=r"question_ids must be a \(batch, length\) tensor of token ids, " + fix
        ):
            ctx.generate(value, max_new_tokens=2)
        with pytest.raises(TypeError, match=r"^ids must be a \(batch, length\) tensor of token ids, " + fix):
            ctx.forward(value)
    one = ctx.generate(ids(3), max_new_tokens=2, do_sample=False)
    assert torch.equal(one, ctx.generate(ids(3)[0], max_new_tokens=2, do_sample=False))
    assert torch.equal(one, ctx.generate(ids(3).int(), max_new_tokens=2, do_sample=False))


def test_an_empty_follow_up_is_refused(tiny_llama):
    """A follow-up of no token: generate fed the context again behind the cache and answered
    wrongly (a full context: [100, 23, 7, 10] where the model says [86, 88, 88, 88]); forward
    failed on a reshape. Both refuse it, naming ctx.logits."""
    ctx = kvcake.compress(tiny_llama, ids(40), "full")
    for empty in (
        torch.zeros(1, 0, dtype=torch.long),
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, 3).long(),
    ):
        with pytest.raises(ValueError, match=r"holds no token: .*ctx\.logits"):
            ctx.generate(empty, max_new_tokens=2)
        with pytest.raises(ValueError, match=r"holds no token: .*ctx\.logits"):
            ctx.forward(empty)


def test_context_after_the_model_moved(make_tiny_llama, tmp_path):
    """A context's keys and values are in the dtype (and on the device) the model ran in when it was
    compressed; a model cast since failed inside the attention ("Expected query, key, and value to
    have the same dtype", or an index_put error for Ada-KV) and saved a file its own loader refuses.
    Now generate, forward and save name what changed and the fix; moved back, it answers as before."""
    model = make_tiny_llama()
    for method in ("snapkv", "adakv"):
        ctx = kvcake.compress(model, ids(60), method, budget=16, window=8)
        before = ctx.generate(ids(3, seed=1), max_new_tokens=2, do_sample=False)
        model.to(torch.bfloat16)
        fix = r"compressed with the model in torch.float32 on cpu, which now runs in torch.bfloat16 on cpu: " \
            r"move it back \(model.to\(torch.float32\)\), or compress the document again"  # fmt: skip
        for call, args in ((ctx.generate, (ids(3, seed=1),)), (ctx.forward, (ids(3),)),
                           (ctx.save, (tmp_path / "ctx.kvc",))):  # fmt: skip
            with pytest.raises(ValueError, match=fix):
                call(*args)
        model.to(torch.float32)
        assert torch.equal(ctx.generate(ids(3, seed=1), max_new_tokens=2, do_sample=False), before)
    assert not (tmp_path / "ctx.kvc").exists()


def test_prompt_longer_than_the_models_positions(tiny_llama):
    too_long = ids(tiny_llama.config.max_position_embeddings + 1)
    with untouched(tiny_llama):
        for fn in (kvcake.generate, kvcake.compress):
            with pytest.raises(ValueError, match="model has 4096 positions: shorten it"):
                fn(tiny_llama, too_long, "snapkv", budget=16)


def test_right_padding_and_all_padding_raise(tiny_llama):
    x = ids(60, batch=2)
    right = torch.ones_like(x)
    right[1, -10:] = 0
    empty = torch.ones_like(x)
    empty[1] = 0
    with untouched(tiny_llama):
        for fn, extra in ((kvcake.generate, {"max_new_tokens": 2}), (kvcake.compress, {})):
            with pytest.raises(ValueError, match="kvcake needs left padding.*padding_side='left'"):
                fn(tiny_llama, x, "cake", budget=16, window=8, attention_mask=right, **extra)
            with pytest.raises(
                ValueError, match="empty .all padding.: give every sequence at least one token"
            ):
                fn(tiny_llama, x, "cake", budget=16, window=8, attention_mask=empty, **extra)
        cache = KVCakeCache(tiny_llama, "adakv", budget=16, window=8)
        with pytest.raises(ValueError, match="left padding"), kvcake.enable(tiny_llama), torch.no_grad():
            tiny_llama(x, attention_mask=right, **with_cache(tiny_llama, cache))


@pytest.mark.parametrize("spec", ["snapkv", "cake", "adakv"])
def test_padding_among_appended_tokens_raises(tiny_llama, spec):
    """A second generate on a kept cache whose new tokens are padded after a real one (the last
    generated token, then a shorter row's pads) would store the padding as entries and attend it:
    refused, where it used to answer (padding on the left of the appended tokens is settled:
    tests/test_padded_follow_ups.py)."""
    cache = KVCakeCache(tiny_llama, spec, budget=16, window=8)
    with kvcake.enable(tiny_llama), torch.no_grad():
        out = tiny_llama.generate(ids(60, batch=2), **with_cache(tiny_llama, cache), max_new_tokens=2)
        more = torch.cat([out, ids(6, seed=3, batch=2)], 1)
        mask = torch.ones_like(more)
        mask[1, out.shape[1] : out.shape[1] + 2] = 0  # row 2's follow-up is 4 tokens, left-padded
        with pytest.raises(
            ValueError, match="padding among tokens appended to a compressed cache is not supported"
        ):
            tiny_llama.generate(more, attention_mask=mask, **with_cache(tiny_llama, cache), max_new_tokens=2)
        unpadded = KVCakeCache(tiny_llama, spec, budget=16, window=8)  # the same without padding runs
        tiny_llama.generate(ids(60, batch=2), **with_cache(tiny_llama, unpadded), max_new_tokens=2)
        tiny_llama.generate(
            more, attention_mask=torch.ones_like(more), **with_cache(tiny_llama, unpadded), max_new_tokens=2
        )


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_gemma3"])
@pytest.mark.parametrize("spec", ["snapkv", "adakv"])  # a dense and a ragged cache
@pytest.mark.parametrize("where", ["keyword", "generation config"])
def test_model_generate_with_use_cache_false_is_refused(request, model_name, spec, where):
    """With use_cache=False, generate feeds the whole sequence at every step, and transformers stored
    it again behind the compressed prompt (a DynamicCache does the same): the answer came out wrong,
    silently. Checkpoints trained with gradient checkpointing save use_cache=False in their configs,
    which generate forwards. Refused before the cache moves; a plain forward is served."""
    model = request.getfixturevalue(model_name)
    cache = KVCakeCache(model, spec, budget=16, window=8)
    config = model.generation_config
    before = config.use_cache
    kwargs = {"use_cache": False} if where == "keyword" else {}
    try:
        config.use_cache = where == "keyword"
        with (
            untouched(model),
            pytest.raises(ValueError, match=r"use_cache=False with a KVCakeCache: .* Pass use_cache=True"),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")  # (past_key_values= deprecated from 5.24)
            with kvcake.enable(model), torch.no_grad():
                model.generate(ids(40), **with_cache(model, cache), max_new_tokens=3, **kwargs)
        assert cache.get_seq_length() == 0  # refused before the prompt reached it
        with kvcake.enable(model), torch.no_grad():
            model(ids(40), **with_cache(model, cache))
        assert cache.get_seq_length() == 40
    finally:
        config.use_cache = before


class _Wrapper(torch.nn.Module):
    """A model wrapped as PEFT wraps one: its generate calls the inner model's generate."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def generate(self, *args, **kwargs):
        return self.inner.generate(*args, **kwargs)


def test_use_cache_false_is_refused_through_a_wrapper(tiny_llama):
    """``enable(wrapper)``: the refusal is also registered on the wrapped model, whose own call the
    wrapper's generate reaches (PEFT 0.21's LoRA models, checked by hand: not refused before)."""
    wrapper = _Wrapper(tiny_llama)
    cache = KVCakeCache(tiny_llama, "snapkv", budget=16, window=8)
    with (
        untouched(tiny_llama),
        pytest.raises(ValueError, match=r"use_cache=False with a KVCakeCache"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        with kvcake.enable(wrapper), torch.no_grad():
            wrapper.generate(ids(40), **with_cache(tiny_llama, cache), use_cache=False, max_new_tokens=3)
    assert cache.get_seq_length() == 0
    with kvcake.enable(wrapper), torch.no_grad():  # and the wrapped model decodes with the cache
        out = wrapper.generate(ids(40), **with_cache(tiny_llama, cache), max_new_tokens=3, do_sample=False)
    assert out.shape[1] > 40 and cache.budgets.tolist() == [[16] * 4]


def test_output_attentions_after_the_prompt(tiny_llama):
    """Transformers' eager attention returns its weights; a compressed layer's later steps return
    its kept entries' by position (they left empty tuples, with a warning, until 2026-12-07;
    ``tests/test_position_weights.py`` checks the values)."""
    eager = tiny_llama.config._attn_implementation
    tiny_llama.config._attn_implementation = "eager"
    try:
        cache = KVCakeCache(tiny_llama, "snapkv", budget=16, window=8)
        with kvcake.enable(tiny_llama), torch.no_grad():
            out = tiny_llama.generate(ids(40), **with_cache(tiny_llama, cache), max_new_tokens=3, min_new_tokens=3,
                                      return_dict_in_generate=True, output_attentions=True)  # fmt: skip
        assert [a.shape for a in out.attentions[0]] == [(1, 4, 40, 40)] * 4  # the prompt's: the model's
        assert [[a.shape for a in step] for step in out.attentions[1:]] == [
            [(1, 4, 1, 41)] * 4,
            [(1, 4, 1, 42)] * 4,
        ]
    finally:
        tiny_llama.config._attn_implementation = eager


# -- budgets -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (
            {"budget": 0},
            ValueError,
            "budget= must be at least 1 entry per layer and KV head, got 0: pass e.g. budget=128",
        ),
        ({"budget": -5}, ValueError, "budget= must be at least 1 entry"),
        ({"budget": float("nan")}, TypeError, "budget must be an int, got float"),
        ({"budget": 12.5}, TypeError, "budget must be an int"),
        ({"budget": True}, TypeError, "budget must be an int, got bool"),
        ({"budget": "64"}, TypeError, "budget must be an int, got str"),
        (
            {"ratio": 0.0},
            ValueError,
            r"keep_ratio= must be in \(0, 1\], got 0.0 \(the fraction of the prompt kept; .*=0.25\)",
        ),
        ({"ratio": -0.2}, ValueError, r"keep_ratio= must be in \(0, 1\]"),
        ({"ratio": 1.0001}, ValueError, r"keep_ratio= must be in \(0, 1\]"),
        ({"ratio": float("nan")}, ValueError, r"keep_ratio= must be in \(0, 1\]"),
        ({"ratio": float("inf")}, ValueError, r"keep_ratio= must be in \(0, 1\]"),
        ({"ratio": True}, TypeError, "ratio must be a number, got bool"),
        (
            {"budget": 16, "window": 32},
            ValueError,
            r"window=32 is larger than budget=16.*lower window=",
        ),
        ({"budget": 16, "window": 0}, ValueError, "window= must be at least 1 token, got 0"),
        (
            {"budget": 16, "window": 2.5},
            TypeError,
            "window must be a positive int, got float: pass e.g. window=32",
        ),
        ({"budget": 16, "window": "4"}, TypeError, "window must be a positive int, got str"),
        ({"budget": 16, "window": None}, TypeError, "window must be a positive int, got NoneType"),
        ({"budget": 10**31, "window": 10**30}, ValueError, "is beyond any prompt: pass at most"),
        (
            {},
            ValueError,
            "give exactly one of budget= .entries per layer. or keep_ratio= .the fraction kept.",
        ),
        ({"budget": 64, "ratio": 0.5}, ValueError, "give exactly one of budget"),
    ],
)
def test_bad_budgets_raise_everywhere(tiny_llama, kwargs, error, match):
    with untouched(tiny_llama):
        with pytest.raises(error, match=match):
            make_method("cake", **kwargs)
        if kwargs and kwargs.get("window", 1) is not None:  # kvcake.generate: no size keeps its
            # scenario's default keep ratio, and window=None is its default window (32)
            with pytest.raises(error, match=match):
                kvcake.generate(tiny_llama, ids(50), "cake", **kwargs, max_new_tokens=2)
        with pytest.raises(error, match=match):
            KVCakeCache(tiny_llama, "adakv", **kwargs)


@pytest.mark.parametrize("window", [2.5, "4", 0])
def test_a_bad_window_without_a_size_is_refused_by_name(tiny_llama, window):
    """No size given: the default keep ratio is weighed against the window first, which failed
    on a comparison ("'<' not supported between instances of 'int' and 'str'"). None is
    ``kvcake.generate``'s default: 32."""
    error, match = (
        (ValueError, "window= must be at least 1 token, got 0")
        if window == 0
        else (TypeError, "window must be a positive int, got")
    )
    with untouched(tiny_llama), pytest.raises(error, match=match):
        kvcake.generate(tiny_llama, ids(50), "cake", window=window, max_new_tokens=2)
    _, cache = kvcake.generate(tiny_llama, ids(50), "cake", window=None, max_new_tokens=2)
    assert cache.method.budget.window == 32


def test_ratio_too_small_for_the_window(tiny_llama):
    with (
        untouched(tiny_llama),
        pytest.raises(ValueError, match="smaller than the window .8.: raise keep_ratio= or lower window="),
    ):
        kvcake.compress(tiny_llama, ids(60), "cake", ratio=0.1, window=8)


@pytest.mark.parametrize("budget", [10**6, 2**61, 2**63 - 1, 10**30])
def test_huge_budget_is_a_bit_identical_no_op(tiny_llama, budget):
    """Every budget covering the prompt is a no-op, also far beyond int64 arithmetic (the
    per-layer budget times the number of layers must not overflow into a tiny budget), and costs
    nothing for its size (the global ranking kept a slot per entry of the budget: `budget="all"`,
    2**40 a layer, asked for terabytes).

    Bit for bit with ``static=False``. With the static default the layers stay as they are (they
    evicted nothing) but the cache is compileable, for which transformers builds an explicit
    causal mask instead of letting SDPA skip it: the same tokens, logits equal to float rounding
    (measured at most 9e-8; asserted at 1e-5)."""
    x = ids(70, seed=1)
    with torch.no_grad():
        full = tiny_llama.generate(x, max_new_tokens=6, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True)  # fmt: skip
    with untouched(tiny_llama):
        for spec, static in itertools.product(("cake", "adakv", "h2o", "pyramidkv", "layers=random,score=tova", "layer-defensivekv"),
                                              (False, True)):  # fmt: skip
            out, cache = kvcake.generate(tiny_llama, x, spec, budget=budget, max_new_tokens=6, do_sample=False,
                                         output_logits=True, return_dict_in_generate=True, static=static)  # fmt: skip
            assert torch.equal(out.sequences, full.sequences), spec
            assert cache.budgets.tolist() == [[70] * 4] and all(layer.plain for layer in cache.layers)
            if static or (cache.method.scorer.stateful and cache.method.decode == "fixed"):
                # H2O accumulates every step's attention for later evictions, so its decoding steps
                # run kvcake's float32 attention instead of the stock kernel: equal up to rounding;
                # static: the explicit mask (docstring).
                for a, b in zip(out.logits, full.logits, strict=True):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            else:
                assert all(torch.equal(a, b) for a, b in zip(out.logits, full.logits, strict=True)), spec


def test_huge_budget_with_padding_is_a_no_op_up_to_rounding(tiny_llama):
    """With left padding the cache drops the padding entries, so attention runs over the compacted
    layer: the same greedy tokens, logits equal to float rounding (not bit for bit)."""
    x = ids(60, seed=2, batch=2)
    mask = torch.ones_like(x)
    mask[1, :25] = 0
    kw = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0,
          "output_logits": True, "return_dict_in_generate": True}  # fmt: skip
    with torch.no_grad():
        full = tiny_llama.generate(x, **kw)
    for spec in ("cake", "adakv"):
        out, cache = kvcake.generate(tiny_llama, x, spec, budget=2**62, **kw)
        assert torch.equal(out.sequences, full.sequences)
        for a, b in zip(out.logits, full.logits, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert cache.budgets.tolist() == [[60] * 4, [35] * 4]


# -- methods -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec,match",
    [
        ("cakee", "unknown method 'cakee'; presets: streamingllm"),
        ("", "method must be a preset name or a composed string"),
        ("=cake", "unknown method key ''; valid: layers, heads, score, select, decode"),
        ("cake,foo=1", "unknown method key 'foo'"),
        ("cake,window", "bad method part 'window': expected key=value"),
        (
            "layers=cascade",
            "unknown layers 'cascade'; valid: cake, cake-oneshot, global, pyramid, random, uniform",
        ),
        ("heads=ada", "unknown heads 'ada'; valid: adakv, uniform"),
        ("score=h3o", "unknown score 'h3o'; valid: cake, defensive, h2o, snapkv, streamingllm, tova"),
        ("cake,xyz.a=1", "unknown method part 'xyz'"),
        (
            "cake,layers.foo=1",
            "bad option for layers=cake: unknown option 'foo'; valid: tau1, tau2, cascading",
        ),
        ("cake,heads.alpha=0.1", "bad option for heads=uniform: unknown option 'alpha'; it takes no options"),
        ("cake,score.gama=100", "unknown option 'gama'; valid: gamma, kernel, pooling, reduce"),
        ("cake,layers.tau1=abc", "bad option for layers=cake: tau1 must be a number, got 'abc'"),
        ("cake,score.kernel=2.5", "bad option for score=cake: kernel must be an integer, got 2.5"),
        ("cake,layers.tau2=true", "bad option for layers=cake: tau2 must be a number, got 'true'"),
        ("cake-oneshot,layers.cascading=true", "unknown option 'cascading'"),
        ("layers=pyramid,layers=uniform", "'layers' is given twice in method"),
        ("cake,score.gamma=1,score.gamma=2", "'score.gamma' is given twice"),
        ("cake,,select=critical", "empty part in method 'cake,,select=critical': remove the extra comma"),
        ("cake,", "empty part in method"),
        ("cake,select=", "'select' has no value"),
        ("caek", "did you mean 'cake'"),
        (
            "full,decode=fixed",
            "method 'full' keeps every entry and takes no parts or options, got 'full,decode=fixed'",
        ),
        ("cake,score.gamma=abc", "bad option for score=cake"),
        ("cake,score.gamma=nan", "CAKE gamma must be a finite number >= 0"),
        ("cake,score.gamma=inf", "CAKE gamma must be a finite number >= 0, got inf"),
        ("cake,score.kernel=4", "pooling kernel must be a positive odd int"),
        ("cake,score.reduce=min", "GQA reduction must be 'mean' or 'max'"),
        ("adakv,heads.alpha=nan", "Ada-KV safeguard alpha must be in"),
        ("criticalkv,select.alpha=1.5", "CriticalKV first-stage ratio alpha must be in"),
        ("criticalkv,select.eps=-1", "CriticalKV eps must be a finite number >= 0"),
        ("cake,layers.tau1=0", "CAKE tau1 must be a finite number > 0, got 0: pass e.g. layers.tau1=1.0"),
        ("cake,layers.cascading=flase", "CAKE cascading must be true or false, got 'flase'"),
        ("layers=random,layers.seed=abc", "random allocation seed must be an int, got 'abc'"),
        ("pyramidkv,layers.beta=0", "pyramid beta must be an int >= 1, got 0: pass e.g. layers.beta=20"),
        ("streamingllm,score.n_sink=-1", "StreamingLLM n_sink must be an int >= 0"),
        ("h2o,score.chunk=0", "H2O chunk must be an int >= 1"),
        ("cake,decode=sometimes", r"decode policy must be one of \('none', 'fixed'\)"),
    ],
)
def test_unknown_methods_and_options(tiny_llama, spec, match):
    with untouched(tiny_llama):
        with pytest.raises(ValueError, match=match):
            make_method(spec, budget=64)
        with pytest.raises(ValueError, match=match):  # the spec is named before a budget under the window
            make_method(spec, budget=3)
        with pytest.raises(ValueError, match=match):
            kvcake.generate(tiny_llama, ids(30), spec, budget=16, window=8, max_new_tokens=2)


def test_method_object_and_budget_twice(tiny_llama):
    method = make_method("cake", budget=16, window=8)
    with untouched(tiny_llama):
        with pytest.raises(
            ValueError, match="give budget=/keep_ratio= either to make_method or here, not both"
        ):
            kvcake.generate(tiny_llama, ids(30), method, budget=16)
        with pytest.raises(
            ValueError, match="pass budget=/keep_ratio= to make_method, not with a Method object"
        ):
            KVCakeCache(tiny_llama, method, budget=16)
        for bad in (None, 3, ["cake"]):
            with pytest.raises(TypeError, match="method must be a preset name or a composed string, got"):
                KVCakeCache(tiny_llama, bad, budget=16)


# -- models the integration does not support ----------------------------------------------------
SMALL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4}  # fmt: skip


def _build(config):
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        cls = {
            "mistral": tf.MistralForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "gemma3_text": tf.Gemma3ForCausalLM,
            "t5": tf.T5ForConditionalGeneration, "bart": tf.BartForConditionalGeneration,
            "bloom": tf.BloomForCausalLM, "openai-gpt": tf.OpenAIGPTLMHeadModel,
            "gemma3n_text": tf.Gemma3nForCausalLM,
            "jetmoe": tf.JetMoeForCausalLM, "doge": tf.DogeForCausalLM, "diffllama": tf.DiffLlamaForCausalLM,
            "dory": getattr(tf, "DoryForCausalLM", None), "hrm_text": getattr(tf, "HrmTextForCausalLM", None),
            "dots3_note_text": getattr(tf, "Dots3NoteForCausalLM", None), "minimax": tf.MiniMaxForCausalLM,
        }[config.model_type]  # fmt: skip
        return cls(config).eval()


UNSUPPORTED = {
    "mistral-sliding": (
        lambda: tf.MistralConfig(
            **SMALL, num_key_value_heads=2, sliding_window=16, max_position_embeddings=512
        ),
        r"mistral: every layer uses sliding-window attention \(window 16\).*set config.sliding_window=None",
    ),
    # (a Qwen2 config with max_window_layers=1 mixes full and sliding layers: a supported hybrid)
    "gemma3-sliding": (  # 2 layers of Gemma 3's 5-sliding-1-global pattern: both slide
        lambda: tf.Gemma3TextConfig(**SMALL, num_key_value_heads=2, head_dim=16, sliding_window=16),
        r"gemma3_text: every layer uses sliding-window attention.*no full-attention layer to compress",
    ),
    "t5": (
        lambda: tf.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4),
        "t5: encoder-decoder models .cross-attention. are not supported by kvcake",
    ),
    "bart": (
        lambda: tf.BartConfig(
            vocab_size=128,
            d_model=64,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
        ),  # fmt: skip
        "bart: encoder-decoder models .cross-attention. are not supported by kvcake",
    ),
    "gemma3n-kv-sharing": (  # its last 2 layers read the keys of the last earlier layer of their type
        lambda: tf.Gemma3nTextConfig(
            **{**SMALL, "num_hidden_layers": 4, "intermediate_size": [128] * 4},
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=128,
            laurel_rank=8,
            altup_num_inputs=2,
            activation_sparsity_pattern=[0.0] * 4,
        ),
        r"gemma3n_text: its last 2 layers read earlier layers' keys and values \(KV sharing, Gemma 3n\)",
    ),
    "bloom-own-attention": (  # ALiBi written out in BloomAttention: attn_implementation never reaches it
        lambda: tf.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4),
        r"bloom: its attention is computed in the model's own code \(BloomAttention\), not through "
        "transformers' attention interface",
    ),
    "gpt1-no-cache": (  # GPT-1's forward has no past_key_values
        lambda: tf.OpenAIGPTConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64),
        r"openai-gpt: OpenAIGPTLMHeadModel's forward takes no KV cache",
    ),
    "jetmoe-tiled-heads": (  # 4 query heads: 2 KV heads x 2 experts a token, query head h on KV head h % 2
        lambda: tf.JetMoeConfig(
            vocab_size=128,
            hidden_size=64,
            num_hidden_layers=2,
            num_key_value_heads=2,
            kv_channels=16,
            intermediate_size=128,
            num_local_experts=4,
            num_experts_per_tok=2,
            pad_token_id=0,
        ),  # fmt: skip
        r"jetmoe: its attention heads are experts: query head h reads KV head h mod H_kv",
    ),
    "doge-dynamic-mask": (
        lambda: tf.DogeConfig(**SMALL, keep_window_size=2048, pad_token_id=0),
        r"doge: its attention adds a learned bias per head and key to the mask",
    ),
    "diffllama-two-calls": (
        lambda: tf.DiffLlamaConfig(**SMALL, num_key_value_heads=2, pad_token_id=0),
        r"diffllama: its attention calls the attention function twice per layer",
    ),
    "dory-loops": (
        lambda: _config(
            "DoryConfig",
            **SMALL,
            num_key_value_heads=2,
            head_dim=16,
            layer_types=["full_attention", "full_attention"],
            pad_token_id=0,
        ),  # fmt: skip
        r"dory: its layers run in loops",
    ),
    "hrm-cycles": (  # one stack of 2 layers run 2 x (1 + 1) times: 8 cache layers
        lambda: _config(
            "HrmTextConfig",
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            head_dim=16,
            num_layers_per_stack=2,
            H_cycles=2,
            L_cycles=1,
            num_hidden_layers=8,
        ),  # fmt: skip
        r"hrm_text: its layers run in cycles over the same modules",
    ),
    "minimax-own-cache": (
        lambda: tf.MiniMaxConfig(
            **SMALL,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=2,
            num_experts_per_tok=1,
            layer_types=["linear_attention", "full_attention"],
            pad_token_id=0,
        ),  # fmt: skip
        r"minimax: its model takes no cache but its own class",
    ),
    "dots3-latent-per-layer": (  # latent attention with an indexer in its indexed layers, none in the sliding ones
        lambda: _config(
            "Dots3NoteTextConfig",
            **SMALL,
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=12,
            head_dim=8,
            sliding_window=8,
            layer_types=["indexed_attention", "sliding_attention"],
            mlp_layer_types=["dense", "dense"],
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),  # fmt: skip
        r"dots3_note_text: its sparse attention keeps an indexer's keys in the cache beside the latents",
    ),
}


def _config(name: str, **kwargs):
    """transformers' config class ``name`` (the test is skipped where the installed release lacks it)."""
    cls = getattr(tf, name, None)
    if cls is None:
        pytest.skip(f"transformers {tf.__version__} has no {name}")
    return cls(**kwargs)


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_models_are_refused_up_front(name):
    make_config, match = UNSUPPORTED[name]
    model = _build(make_config())
    with untouched(model):
        with pytest.raises(ValueError, match=match):
            KVCakeCache(model, "cake", budget=16, window=8)
        with pytest.raises(ValueError, match=match), kvcake.enable(model):
            pass
        with pytest.raises(ValueError, match=match):
            kvcake.generate(model, ids(30), "cake", budget=16, window=8, max_new_tokens=2)
        with pytest.raises(ValueError, match=match):
            kvcake.compress(model, ids(30), "snapkv", budget=16, window=8)


# -- threads -------------------------------------------------------------------------------------
def test_threads_share_one_enable(tiny_llama):
    """Two threads answering follow-ups of one compressed context, as a server's worker threads do:
    B starts while A is decoding (A installed the kvcake attention), and A finishes and leaves its
    ``enable`` block while B is inside its prefill. Each block used to restore the model as it left,
    so B went on with the stock attention over its KVCakeCache (shape errors: 6 of 8 threads in a
    run of 8 on this model). The blocks now share one installation, undone by the last to leave:
    both answers equal the ones asked alone, and the model is restored after."""
    ctx = kvcake.compress(tiny_llama, ids(80), "snapkv", budget=24, window=8)
    questions = {"a": ids(4, seed=1), "b": ids(4, seed=2)}
    alone = {name: ctx.generate(q, max_new_tokens=5, do_sample=False) for name, q in questions.items()}
    a_decoding, b_inside, a_done = threading.Event(), threading.Event(), threading.Event()
    forwards = collections.Counter()

    def interleave(module, args, kwargs):
        name = threading.current_thread().name
        forwards[name] += 1
        if name == "a" and forwards[name] == 2:  # A's first decode step: let B start, wait till it is inside
            a_decoding.set()
            b_inside.wait(30)
        if name == "b" and forwards[name] == 1:  # B's prefill: wait till A has left its block
            b_inside.set()
            a_done.wait(30)

    answers, errors = {}, []

    def ask(name):
        try:
            answers[name] = ctx.generate(questions[name], max_new_tokens=5, do_sample=False)
        except Exception as exc:  # reported below, with the thread's name
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
        finally:
            if name == "a":
                a_done.set()

    with untouched(tiny_llama):
        handle = tiny_llama.register_forward_pre_hook(interleave, with_kwargs=True)
        try:
            a = threading.Thread(target=ask, args=("a",), name="a")
            b = threading.Thread(target=ask, args=("b",), name="b")
            a.start()
            assert a_decoding.wait(30)
            b.start()
            a.join(60)
            b.join(60)
        finally:
            handle.remove()
    assert not errors, errors
    assert all(torch.equal(answers[name], alone[name]) for name in questions)


# -- one cache, one conversation -----------------------------------------------------------------
def test_generate_and_compress_always_make_a_fresh_cache(tiny_llama):
    x, y = ids(60, seed=3), ids(45, seed=4)
    out1, c1 = kvcake.generate(tiny_llama, x, "cake", budget=16, window=8, max_new_tokens=3, do_sample=False)
    out2, c2 = kvcake.generate(tiny_llama, y, "cake", budget=16, window=8, max_new_tokens=3, do_sample=False)
    alone, _ = kvcake.generate(tiny_llama, y, "cake", budget=16, window=8, max_new_tokens=3, do_sample=False)
    assert c1 is not c2 and c2.get_seq_length() == 47 and torch.equal(out2, alone)
    assert kvcake.compress(tiny_llama, x, "cake", budget=16, window=8).cache is not \
        kvcake.compress(tiny_llama, x, "cake", budget=16, window=8).cache  # fmt: skip


def test_cache_made_for_another_model_raises(tiny_llama):
    """A KVCakeCache holds one layer per layer of the model it was made for: a deeper model failed
    with an IndexError, a shallower one left the cache half prefilled and was told an earlier
    forward had failed. Both name the fix now."""
    config = tiny_llama.config.to_dict() | {"num_hidden_layers": 2}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        shallow = tf.LlamaForCausalLM(tf.LlamaConfig(**config)).eval()
    for made_for, runs, error, match in [
        (shallow, tiny_llama, ValueError, "layer 2 of a model updated this KVCakeCache of 2 layers: make the cache "
         r"with the model that runs it, KVCakeCache\(model, ...\)"),
        (tiny_llama, shallow, RuntimeError, "prefill did not finish .* or a model of fewer than its 4 layers ran "
         "it.* make a new KVCakeCache with the model that runs it"),
    ]:  # fmt: skip
        cache = KVCakeCache(made_for, "snapkv", budget=16, window=8)
        with untouched(runs), pytest.raises(error, match=match), kvcake.enable(runs), torch.no_grad():
            runs.generate(ids(40), **with_cache(runs, cache), max_new_tokens=3, do_sample=False)


@pytest.mark.parametrize("method", ["criticalkv", "critical-adakv", "defensivekv"])
def test_cache_made_for_a_model_of_other_kv_heads_raises_with_value_norms(tiny_llama, tiny_mha, method):
    """Made for 2 KV heads and run by a model of 4 (the same width): the selection that projects
    values through W_O failed with a RuntimeError of a reshape; it names the fix now (the other
    parts read every shape off the tensors, and run it as a cache made for that model would)."""
    cache = KVCakeCache(tiny_llama, method, budget=16, window=8)
    with untouched(tiny_mha), kvcake.enable(tiny_mha), torch.no_grad(), pytest.raises(
        ValueError, match=r"output projection takes 64 features, not the 8 query heads x 16 dims.*"
        r"make it with the model that runs it, KVCakeCache\(model, ...\)"
    ):  # fmt: skip
        tiny_mha.generate(ids(40), **with_cache(tiny_mha, cache), max_new_tokens=3, do_sample=False)


def test_reused_cache_with_another_batch_size_raises(tiny_llama):
    cache = KVCakeCache(tiny_llama, "cake", budget=16, window=8)
    with untouched(tiny_llama), kvcake.enable(tiny_llama), torch.no_grad():
        tiny_llama(ids(60), **with_cache(tiny_llama, cache))
        with pytest.raises(
            ValueError, match="holds a batch of 1 sequences but got 2.*make a new KVCakeCache"
        ):
            tiny_llama(ids(30, batch=2), **with_cache(tiny_llama, cache))


def test_cache_after_an_interrupted_prefill_raises(tiny_llama, monkeypatch):
    """An error in the middle of the prompt's forward (here a hook on layer 2) leaves layers 0-1
    filled (layer 1's CAKE stage pending on the route a GPU takes: it runs at the next layer's
    update) and the rest empty: reusing that cache would treat the prompt as a continuation of
    itself. The cache refuses instead, before running anything left pending."""
    from kvcake import devices

    monkeypatch.setattr(devices, "CPU_ROUTES", False)  # on a CPU the stage runs as its layer is scored
    cache = KVCakeCache(tiny_llama, "cake", budget=16, window=8)

    class Boom(Exception):
        pass

    def boom(module, args):
        raise Boom

    with untouched(tiny_llama):
        handle = tiny_llama.model.layers[2].register_forward_pre_hook(boom)
        try:
            with pytest.raises(Boom), kvcake.enable(tiny_llama), torch.no_grad():
                tiny_llama(ids(60), **with_cache(tiny_llama, cache))
        finally:
            handle.remove()
        assert not cache.prefilled and cache.pending_stage is not None
        assert cache.layers[1].is_initialized and not cache.layers[2].is_initialized
        pending = cache.pending_stage
        with pytest.raises(RuntimeError, match="prefill did not finish.*make a new KVCakeCache"), \
                kvcake.enable(tiny_llama), torch.no_grad():  # fmt: skip
            tiny_llama(ids(60), **with_cache(tiny_llama, cache))
        assert cache.pending_stage is pending


def test_reused_cache_is_a_continuation(tiny_llama):
    """Current, documented behaviour: transformers cannot tell a new prompt from a continuation,
    so a prefilled cache given to a new generate call treats the new ids after its length as
    appended tokens (budgets and kept prompt entries unchanged), and a shorter prompt fails inside
    transformers. Use a new cache per prompt (kvcake.generate does) or ctx.fork()."""
    cache = KVCakeCache(tiny_llama, "cake", budget=16, window=8)
    with kvcake.enable(tiny_llama), torch.no_grad():
        tiny_llama.generate(ids(60), **with_cache(tiny_llama, cache), max_new_tokens=3, do_sample=False)
        budgets = cache.budgets.clone()
        tiny_llama.generate(
            ids(90, seed=5), **with_cache(tiny_llama, cache), max_new_tokens=3, do_sample=False
        )
        assert torch.equal(cache.budgets, budgets) and cache.get_seq_length() == 92
        # transformers' own error, whose type changed: IndexError in 5.0, RuntimeError later
        with pytest.raises((RuntimeError, IndexError)):
            tiny_llama.generate(
                ids(20, seed=6), **with_cache(tiny_llama, cache), max_new_tokens=3, do_sample=False
            )


def test_cache_without_the_kvcake_attention_raises(tiny_llama):
    cache = KVCakeCache(tiny_llama, "snapkv", budget=16, window=8)
    with (
        untouched(tiny_llama),
        pytest.raises(RuntimeError, match=r"run the model inside `with kvcake.enable\(model\):`"),
    ):
        with torch.no_grad():
            tiny_llama(ids(40), **with_cache(tiny_llama, cache))


# -- generation modes that roll the cache back or reorder it -------------------------------------
# Refused by kvcake.generate and by a compressed context's generate alike.
ROLLBACKS = [
    (
        {"prompt_lookup_num_tokens": 3},
        "prompt_lookup_num_tokens=3 is not supported with a compressed cache: .*by beam search instead",
    ),
    (
        {"generation_config": tf.GenerationConfig(prompt_lookup_num_tokens=2, max_new_tokens=3)},
        r"prompt_lookup_num_tokens=2 \(from the generation config\) is not supported",
    ),
    # one drafted token still rolls a rejected draft back: 1 was let through, and the cache was
    # cropped (or refused the crop) after the prefill
    ({"prompt_lookup_num_tokens": 1}, "prompt_lookup_num_tokens=1 is not supported"),
    ({"assistant_early_exit": 1}, "assistant_early_exit=1 is not supported"),
    ({"use_cache": False}, "use_cache=False would feed the whole sequence again"),
]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        *ROLLBACKS,
        (
            {"prefill_chunk_size": 16},
            r"prefill_chunk_size=16 would prefill the 40-token prompt in 3 forwards",
        ),
        (
            {"generation_config": tf.GenerationConfig(prefill_chunk_size=39, max_new_tokens=3)},
            r"prefill_chunk_size=39 \(from the generation config\) would prefill .* in 2 forwards",
        ),
        ({"past_key_values": None}, "kvcake.generate makes its own KVCakeCache"),
        ({"cache": None}, "kvcake.generate makes its own KVCakeCache"),
    ],
)
def test_kvcake_generate_refuses_rollbacks_up_front(tiny_llama, kwargs, match):
    with untouched(tiny_llama), pytest.raises(ValueError, match=match):
        kvcake.generate(tiny_llama, ids(40), "cake", budget=16, window=8, max_new_tokens=3, **kwargs)


@pytest.mark.parametrize("kwargs,match", ROLLBACKS)
def test_a_contexts_generate_refuses_the_same_modes_up_front(tiny_llama, kwargs, match):
    """A compressed context's generate checked none of them: use_cache=False answered, wrongly (the
    whole sequence fed again into the fork). Beam search is served (tests/test_beams.py)."""
    ctx = kvcake.compress(tiny_llama, ids(40), "snapkv", budget=16, window=8)
    with untouched(tiny_llama), pytest.raises(ValueError, match=match):
        ctx.generate(ids(5, seed=9), max_new_tokens=3, **kwargs)


def test_a_prefill_chunk_covering_the_prompt_is_one_forward(tiny_llama):
    """Chunked prefill is refused only where it splits the prompt (the refusals above): before, the
    first chunk alone was compressed, and the rest kept whole (decode=none) or evicted as appended
    tokens (decode=fixed), silently."""
    x = ids(40)
    plain, _ = kvcake.generate(tiny_llama, x, "snapkv", budget=16, window=8, max_new_tokens=3)
    whole, cache = kvcake.generate(tiny_llama, x, "snapkv", budget=16, window=8, max_new_tokens=3,
                                   prefill_chunk_size=40)  # fmt: skip
    assert torch.equal(whole, plain) and cache.budgets.tolist() == [[16] * 4]


def test_a_cache_implementation_in_the_generation_config_is_set_aside(tiny_llama):
    """Checkpoints ship generation configs naming a cache (``cache_implementation``), and
    transformers refuses a cache object beside one ("Passing both `cache_implementation` ... and
    `cache`"), so kvcake.generate and a context's generate failed for such a model; with
    ``use_cache=False`` saved in it, kvcake.generate told the user to drop an argument they never
    passed. Both are now overridden for the call; the model's config is left as it was. Passed by
    keyword, a cache_implementation is refused (use_cache=False too, above)."""
    x = ids(40)
    plain, _ = kvcake.generate(tiny_llama, x, "snapkv", budget=16, window=8, max_new_tokens=3)
    answer = kvcake.compress(tiny_llama, x, "snapkv", budget=16, window=8).generate(
        ids(5, seed=9), max_new_tokens=3
    )
    config = tiny_llama.generation_config
    before = config.cache_implementation, config.use_cache
    config.cache_implementation = "static"
    config.use_cache = False  # as training with gradient checkpointing saves it
    try:
        out, cache = kvcake.generate(tiny_llama, x, "snapkv", budget=16, window=8, max_new_tokens=3)
        assert torch.equal(out, plain) and cache.budgets.tolist() == [[16] * 4]
        ctx = kvcake.compress(tiny_llama, x, "snapkv", budget=16, window=8)
        assert torch.equal(ctx.generate(ids(5, seed=9), max_new_tokens=3), answer)
        assert (config.cache_implementation, config.use_cache) == ("static", False)
        for call in (lambda **kw: kvcake.generate(tiny_llama, x, "snapkv", budget=16, window=8, max_new_tokens=3, **kw),
                     lambda **kw: ctx.generate(ids(5, seed=9), max_new_tokens=3, **kw)):  # fmt: skip
            with pytest.raises(
                ValueError, match="cache_implementation='dynamic' asks transformers to build its own"
            ):
                call(cache_implementation="dynamic")
    finally:
        config.cache_implementation, config.use_cache = before


def test_kvcake_generate_refuses_an_assistant(tiny_llama, make_tiny_llama):
    with (
        untouched(tiny_llama),
        pytest.raises(ValueError, match="assistant_model=LlamaForCausalLM is not supported"),
    ):
        kvcake.generate(tiny_llama, ids(40), "cake", budget=16, window=8, max_new_tokens=3,
                        assistant_model=make_tiny_llama())  # fmt: skip


# Who refuses a rollback first depends on the transformers release: from 5.24, generate checks
# ``cache.is_croppable`` (False for a KVCakeCache) after the first forward and raises ValueError;
# before, kvcake's ``crop`` raises NotImplementedError at the same point. Either way the message
# names the crop, the model is as it was, and the cache was not rolled back half-way.
_CROP_REFUSED = "a compressed KV cache cannot be cropped|requires a cache that can be cropped"


@pytest.mark.parametrize("spec", ["cake", "adakv"])  # a dense and a ragged cache
@pytest.mark.parametrize("mode", ["assistant", "prompt-lookup"])
def test_model_generate_with_a_kvcake_cache_refuses_rollbacks(tiny_llama, make_tiny_llama, spec, mode):
    kwargs = {
        "assistant": {"assistant_model": make_tiny_llama()},
        "prompt-lookup": {"prompt_lookup_num_tokens": 3},
    }[mode]
    match = _CROP_REFUSED
    prompt = ids(40)
    cache = KVCakeCache(tiny_llama, spec, budget=16, window=8)
    assert not cache.is_croppable
    with (
        untouched(tiny_llama),
        pytest.raises((NotImplementedError, ValueError), match=match),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        with kvcake.enable(tiny_llama), torch.no_grad():
            tiny_llama.generate(prompt, **with_cache(tiny_llama, cache), max_new_tokens=4, **kwargs)
    # Nothing cropped: the cache is empty (refused before any forward) or holds every token the
    # refused verifying forward fed it (the prompt, plus the drafts of assisted decoding).
    assert cache.get_seq_length() == 0 or cache.get_seq_length() >= prompt.shape[1]


def test_sampling_several_sequences_per_prompt_works(tiny_llama):
    """num_return_sequences expands the prompt before prefill: each copy is compressed alike."""
    torch.manual_seed(0)
    out, cache = kvcake.generate(tiny_llama, ids(50), "cake", budget=16, window=8, max_new_tokens=4,
                                 do_sample=True, num_return_sequences=2)  # fmt: skip
    assert out.shape == (2, 54) and torch.equal(cache.budgets[0], cache.budgets[1])


def test_errors_inside_enable_restore_the_model(tiny_llama):
    """An error raised by kvcake in the middle of a forward (right padding, found at layer 0)
    leaves the attention implementation, hooks and logits as they were."""
    x = ids(50, batch=2)
    right = torch.ones_like(x)
    right[0, -3:] = 0
    cache = KVCakeCache(tiny_llama, "critical-adakv", budget=16, window=8)
    with untouched(tiny_llama):
        with pytest.raises(ValueError, match="left padding"), kvcake.enable(tiny_llama), torch.no_grad():
            assert tiny_llama.config._attn_implementation == "kvcake_sdpa"
            tiny_llama(x, attention_mask=right, **with_cache(tiny_llama, cache))


def test_full_attention_layers_of_two_shapes_are_refused():
    """A heterogeneous config (transformers' per-layer configs, Gemma 4's) whose compressed layers differ
    in head dim: one cache shape would not cover them (transformers 5.24's Gemma 4 keeps its global
    layers alike, so the config is a stand-in)."""
    views = [
        types.SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=d) for d in (16, 32, 16)
    ]
    text = types.SimpleNamespace(per_layer_config=views)
    assert attention_shape(text, [0, 2], "probe") == (4, 2, 16)
    with pytest.raises(
        ValueError, match=r"probe: its full-attention layers differ .*\[\(4, 2, 16\), \(4, 2, 32\)\]"
    ):
        attention_shape(text, [0, 1, 2], "probe")
