"""Fidelity measures against the full cache, and the shared prefill the eval runner replays.

Invariants: a budget covering the whole prompt gives zero KL and zero perturbations (to float
error), a smaller one positive ones; a cache rebuilt from a recorded full-cache forward equals
``kvcake.compress``'s entry for entry, for every preset and with scores reused across budgets;
hooks and attention implementations are restored, errors included.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

import kvcake
from kvcake import temperatures
from kvcake.adapters import with_cache
from kvcake.eval.fidelity import (
    Captured,
    ScoreMemo,
    attention_modules,
    attention_outputs,
    capture_queries,
    compare,
    replay_compress,
    teacher_force,
)
from kvcake.method import PRESETS
from kvcake.models import model_fingerprint
from kvcake.temperatures import Calibration, TauPoint, save_calibration

WINDOW = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run faster on one thread, and far faster when other work shares the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (1, n), generator=g)


def _full(model, ids: torch.Tensor, captured: Captured | None = None):
    """(DynamicCache, last logits) of ``ids``, recording queries into ``captured`` if given."""
    cache = DynamicCache(config=model.config)
    ctx = capture_queries(model, captured) if captured is not None else torch.no_grad()
    with ctx, torch.no_grad():
        out = model(ids, attention_mask=torch.ones_like(ids), **with_cache(model, cache), logits_to_keep=1)
    return cache, out.logits[:, -1]


def _layers(cache) -> list[tuple[torch.Tensor, ...]]:
    return [(layer.keys, layer.values, layer.padded_positions()) for layer in cache.layers]


@pytest.mark.parametrize("preset", list(PRESETS))
def test_replay_equals_compress(tiny_llama, preset):
    ids = _ids(40, 0)
    captured = Captured()
    full, logits = _full(tiny_llama, ids, captured)
    memo = ScoreMemo()
    for budget in (12, 20):  # the second budget reuses the first one's scores
        method = kvcake.make_method(preset, budget=budget, window=WINDOW)
        ref = kvcake.compress(tiny_llama, ids, method)
        got = replay_compress(tiny_llama, method, captured, full, ids, logits, memo=memo)
        assert got.cache.kv_bytes() == ref.cache.kv_bytes() < 40 * 4 * 2 * 2 * 16 * 4
        assert (got.cache.layer_counts() == ref.cache.layer_counts()).all()
        for (k1, v1, p1), (k2, v2, p2) in zip(_layers(got.cache), _layers(ref.cache), strict=True):
            assert torch.equal(p1, p2)
            torch.testing.assert_close(k1, k2, rtol=0, atol=1e-6)
            torch.testing.assert_close(v1, v2, rtol=0, atol=1e-6)
        torch.testing.assert_close(got.logits, ref.logits)
    assert len(full.layers[0].keys[0, 0]) == 40  # the full cache was not touched


@pytest.fixture
def max7_calibration(tmp_path, monkeypatch, tiny_llama):
    """A calibration for ``tiny_llama`` whose point chose max pooling (kernel 7), nothing shipped."""
    monkeypatch.setenv("KVCAKE_CACHE_DIR", str(tmp_path / "models"))
    monkeypatch.setattr(temperatures, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setattr(temperatures, "_warned", set())
    save_calibration(Calibration(model_fingerprint(tiny_llama), (TauPoint(40, 0.5, 2.0, "max7"),), "tiny"))


@pytest.mark.parametrize("preset", ["cake", "cake-adakv"])
def test_reused_scores_keep_the_method_kvcake_compress_uses(tiny_llama, max7_calibration, preset):
    """With a memo the replay scored with a stand-in scorer that carried neither the calibrated
    indicator (it scored with the paper's avg5 where the calibration chose max7) nor the scorer's
    ``order_sensitive`` (CAKE's decoding pooled entries in held order), so the eval runner's shared
    prefill measured CAKE's cells with another method than ``kvcake.compress`` runs."""
    ids, question = _ids(150, 3), _ids(6, 4)
    captured = Captured()
    full, logits = _full(tiny_llama, ids, captured)
    memo = ScoreMemo()
    for budget in (40, 48):  # the second budget reuses the first one's scores
        method = kvcake.make_method(preset, budget=budget, window=WINDOW)
        ref = kvcake.compress(tiny_llama, ids, method, scenario="context")
        got = replay_compress(tiny_llama, method, captured, full, ids, logits, memo=memo, scenario="context")
        assert got.cache.method == ref.cache.method and got.cache.score_memo is None
        assert (got.cache.method.scorer.pooling, got.cache.method.scorer.kernel) == ("max", 7)
        for (k1, _, p1), (k2, _, p2) in zip(_layers(got.cache), _layers(ref.cache), strict=True):
            assert torch.equal(p1, p2)
            torch.testing.assert_close(k1, k2, rtol=0, atol=1e-6)
        answers = [
            c.generate(question, max_new_tokens=24, min_new_tokens=24, do_sample=False) for c in (got, ref)
        ]
        assert torch.equal(*answers)


def test_replay_of_a_question_extension_equals_compress_of_the_whole_prompt(tiny_llama):
    """Question-aware replay joins the context's and the question's recorded queries."""
    ctx, question = _ids(32, 1), _ids(7, 2)
    captured = Captured()
    cache, _ = _full(tiny_llama, ctx, captured)
    with capture_queries(tiny_llama, captured), torch.no_grad():
        out = tiny_llama(
            question, attention_mask=torch.ones(1, 39, dtype=torch.long), **with_cache(tiny_llama, cache)
        )
    full_ids = torch.cat([ctx, question], dim=1)
    method = kvcake.make_method("cake", budget=12, window=WINDOW)
    got = replay_compress(tiny_llama, method, captured, cache, full_ids, out.logits[:, -1])
    ref = kvcake.compress(tiny_llama, full_ids, method)
    for (k1, _, p1), (k2, _, p2) in zip(_layers(got.cache), _layers(ref.cache), strict=True):
        assert torch.equal(p1, p2)
        torch.testing.assert_close(k1, k2, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="must match"):  # the context's queries alone are too short
        replay_compress(tiny_llama, method, captured, cache, full_ids, out.logits[:, -1], chunks=1)


def _fidelity(model, prefix: torch.Tensor, question: torch.Tensor | None, continuation_len: int, method):
    """Measures of ``method`` against the full cache; ``question=None``: question-aware (the
    question is already in ``prefix``), else context-only (``prefix`` is the context)."""
    full, logits = _full(model, prefix)
    # the full cache's greedy continuation
    cont, cache, last = [], copy.deepcopy(full), logits
    appended = question if question is not None else torch.zeros(1, 0, dtype=torch.long)
    if question is not None:
        with torch.no_grad():
            out = model(question, **with_cache(model, cache))
        last = out.logits[:, -1]
    for _ in range(continuation_len):
        cont.append(last.argmax(-1))
        with torch.no_grad():
            last = model(cont[-1][:, None], **with_cache(model, cache)).logits[:, -1]
    cont = torch.cat(cont)
    n = cont.numel()
    appended = torch.cat([appended, cont[None, :-1]], dim=1)
    s = prefix.shape[1]
    ref = teacher_force(model, copy.deepcopy(full), s, logits, appended, n)
    ctx = kvcake.compress(model, prefix, method)
    got = teacher_force(model, ctx.fork(), s, ctx.logits, appended, n)
    return compare(ref, got, cont)


@pytest.mark.parametrize("scenario", ["context", "question"])
@pytest.mark.parametrize("preset", ["snapkv", "cake", "adakv", "h2o"])
def test_fidelity_is_zero_when_the_budget_covers_the_prompt(tiny_llama, scenario, preset):
    prefix = _ids(36, 3)
    question = _ids(6, 4) if scenario == "context" else None
    fid = _fidelity(tiny_llama, prefix, question, 6, kvcake.make_method(preset, ratio=1.0, window=WINDOW))
    assert fid.tokens == 6
    assert fid.kl == pytest.approx(0.0, abs=1e-9)
    assert fid.nll == pytest.approx(fid.nll_full, abs=1e-6)
    assert len(fid.attn_rel_l1_layers) == 4
    assert max(fid.attn_rel_l1_layers) < 1e-5 and fid.hidden_rel_l1 < 1e-5


@pytest.mark.parametrize("scenario", ["context", "question"])
def test_fidelity_is_positive_when_the_budget_is_small(tiny_llama, scenario):
    prefix = _ids(36, 3)
    question = _ids(6, 4) if scenario == "context" else None
    fid = _fidelity(tiny_llama, prefix, question, 6, kvcake.make_method("snapkv", budget=8, window=WINDOW))
    assert fid.kl > 1e-6
    assert fid.nll != pytest.approx(fid.nll_full, abs=1e-6)
    assert all(x > 1e-4 for x in fid.attn_rel_l1_layers) and fid.hidden_rel_l1 > 1e-4
    assert fid.attn_rel_l1 == pytest.approx(sum(fid.attn_rel_l1_layers) / 4)


def test_one_token_question_aware_continuation_has_no_perturbation(tiny_llama):
    """N == 1 question-aware: nothing is appended, the only prediction is the prefill's (exact)."""
    fid = _fidelity(tiny_llama, _ids(30, 5), None, 1, kvcake.make_method("snapkv", budget=8, window=WINDOW))
    assert fid.tokens == 1 and fid.kl == pytest.approx(0.0, abs=1e-9)
    assert fid.attn_rel_l1 is None and fid.attn_rel_l1_layers == [] and fid.hidden_rel_l1 is None


def test_hooks_and_attention_implementation_are_restored(make_tiny_llama):
    model = make_tiny_llama()
    modules = attention_modules(model)
    assert [m.layer_idx for m in modules] == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="boom"), attention_outputs(model) as outputs:
        model(_ids(5, 6))
        assert sorted(outputs) == [0, 1, 2, 3] and outputs[0].shape == (1, 5, 64)
        raise RuntimeError("boom")
    assert all(not m._forward_hooks for m in modules)
    captured = Captured()
    with pytest.raises(RuntimeError, match="boom"), capture_queries(model, captured):
        assert model.config._attn_implementation.startswith("kvcake_eval_capture_")
        model(_ids(5, 6))
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    assert captured.query(0).shape == (1, 4, 5, 16) and captured.scaling[0] == 16**-0.5


@pytest.mark.parametrize("preset", ["cake", "h2o", "snapkv"])
def test_stepwise_teacher_forcing_sees_what_generate_sees(tiny_llama, preset):
    """A question after a compressed context, then the greedy answer: ``stepwise=True`` gives the
    logits ``ctx.generate`` decided each token on. Fed in one forward, a ``decode=fixed`` cache
    (cake, h2o) evicts only after the chunk, so its logits differ; ``decode=none`` (snapkv) keeps
    what is appended, so both feedings agree."""
    g = torch.Generator().manual_seed(0)
    context, question = (
        torch.randint(10, 100, (1, 300), generator=g),
        torch.randint(10, 100, (1, 12), generator=g),
    )
    ctx = kvcake.compress(tiny_llama, context, preset, budget=40, window=WINDOW)
    n = 10
    out = ctx.generate(
        question,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    seen = torch.log_softmax(torch.stack(out.logits)[:, 0].double(), dim=-1)  # (n, vocab)
    appended = torch.cat([question, out.sequences[:, : n - 1]], dim=1)
    steps = teacher_force(tiny_llama, ctx.fork(), 300, ctx.logits, appended, n, stepwise=True)
    torch.testing.assert_close(steps.logprobs, seen, atol=1e-4, rtol=0)
    assert len(steps.attn) == 4 and steps.attn[0].shape[0] == appended.shape[1]  # every token's, joined
    assert steps.hidden.shape[0] == appended.shape[1]
    chunk = teacher_force(tiny_llama, ctx.fork(), 300, ctx.logits, appended, n)
    gap = float((chunk.logprobs - seen).abs().max())
    assert gap > 1e-3 if preset != "snapkv" else gap < 1e-4
