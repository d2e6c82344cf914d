"""Every preset and a few free compositions, end to end on a tiny model: prefill, 20 decoding
steps, a batch of 2, and the bytes held equal to what the budgets say plus the capacity that
static storage (the default) reserves."""

import numpy as np
import pytest
import torch

import kvcake
from kvcake import PRESETS, KVCakeCache, make_method
from kvcake.adapters import with_cache
from kvcake.step import GROWTH

COMPOSITIONS = [
    "layers=cake,heads=adakv,score=cake,select=critical",
    "layers=cake,score=h2o",
    "layers=cake,score=snapkv,select=critical",
    "layers=pyramid,heads=adakv,score=tova,decode=fixed",
    "layers=random,score=cake,layers.seed=3",
    "cake,select=critical,decode=none",
    "snapkv,score.pooling=avg,decode=fixed",
]


@pytest.mark.parametrize("spec", [*PRESETS, *COMPOSITIONS])
def test_method_end_to_end(tiny_llama, spec):
    method = make_method(spec, budget=40, window=8)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (2, 150), generator=g)
    cache = KVCakeCache(tiny_llama, method)
    with kvcake.enable(tiny_llama), torch.no_grad():
        out = tiny_llama(ids, **with_cache(tiny_llama, cache))
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(20):
            tok = tiny_llama(tok, **with_cache(tiny_llama, cache)).logits[:, -1:].argmax(-1)
    counts = cache.layer_counts()  # (B, L, H_kv)
    assert torch.equal(cache.budgets.sum(1), torch.tensor([40 * 4, 40 * 4]))
    grown = 20 if method.decode == "none" else 0
    if method.heads.ragged:
        assert np.array_equal(counts.sum(2), cache.budgets.numpy() * 2 + grown * 2)
    else:
        assert np.array_equal(counts[..., 0], cache.budgets.numpy() + grown)
    entry = 2 * 16 * 4  # K + V, head_dim 16, float32
    assert all(layer.static == method.decode for layer in cache.layers), "every layer evicted: static"
    # capacity is memory: static storage holds, per layer, sequence and KV head, one spare slot
    # (decode=fixed) or GROWTH slots for the new tokens, of which 20 are used (decode=none)
    reserved = (1 if method.decode == "fixed" else GROWTH - grown) * counts.size
    if all(layer.layout == "ragged" for layer in cache.layers):
        empty = len(cache.layers)  # the one always-empty slot per static ragged layer (its padded view)
        assert cache.kv_bytes() == (int(counts.sum()) + reserved + empty) * entry, (
            "ragged: per-head budgets + reserve"
        )
    else:  # dense: each layer holds the batch's largest budget for every sequence and head
        physical = sum(int(counts[:, i].max()) * counts.shape[0] * counts.shape[2] for i in range(4))
        assert cache.kv_bytes() == (physical + reserved) * entry
    assert cache.get_seq_length() == 170
    assert torch.isfinite(tok.float()).all()


def test_registry_lists_every_preset_and_rejects_unknown():
    names = [name for name, _ in kvcake.list_methods()]
    assert names == list(PRESETS)
    for required in ("streamingllm", "h2o", "tova", "snapkv", "pyramidkv", "cake", "criticalkv", "adakv",
                     "ada-pyramidkv", "critical-adakv", "cake-adakv", "defensivekv", "layer-defensivekv"):  # fmt: skip
        assert required in PRESETS
    with pytest.raises(ValueError, match="presets: streamingllm"):
        make_method("snapkvv", budget=64)
    with pytest.raises(ValueError, match="valid: cake, cake-oneshot, global, pyramid, random, uniform"):
        make_method("layers=cak", budget=64)
    with pytest.raises(ValueError, match="valid: critical, topk"):
        make_method("select=best", budget=64)
    with pytest.raises(ValueError, match="bad option for layers=cake"):
        make_method("cake,layers.gamma=3", budget=64)
    with pytest.raises(ValueError, match="decode policy"):
        make_method("cake,decode=sometimes", budget=64)


def test_composition_string_builds_the_parts():
    m = make_method("layers=cake,heads=adakv,score=cake,select=critical,layers.tau1=1.2", ratio=0.2)
    assert m.layers.name == "cake" and m.layers.tau1 == 1.2 and m.heads.name == "adakv"
    assert m.scorer.name == "cake" and m.selector.name == "critical" and m.budget.ratio == 0.2
    assert make_method("cake", budget=64).name == "cake"
    assert make_method("cake,decode=none", budget=64).decode == "none"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"budget": 0}, "budget= must be at least 1 entry"),
        ({"budget": -5}, "budget= must be at least 1 entry"),
        ({"ratio": 0.0}, r"keep_ratio= must be in \(0, 1\]"),
        ({"ratio": 1.5}, r"keep_ratio= must be in \(0, 1\]"),
        ({"ratio": float("nan")}, r"keep_ratio= must be in \(0, 1\]"),
        ({"budget": 16, "window": 32}, "window=32 is larger than budget=16"),
        ({}, "give exactly one of budget"),
        ({"budget": 64, "ratio": 0.5}, "give exactly one of budget"),
    ],
)
def test_bad_budgets_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_method("cake", **kwargs)


def test_bad_budget_types():
    with pytest.raises(TypeError, match="budget must be an int"):
        make_method("cake", budget=12.5)
    with pytest.raises(ValueError, match="smaller than the window"):
        kvcake.compress(_model(), torch.randint(3, 100, (1, 60)), "cake", ratio=0.1)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("spec", ["cake", "h2o", "snapkv", "cake,decode=none"])
def test_a_question_appended_to_a_context_counts_against_a_fixed_budget(tiny_llama, spec):
    """A question fed to a compressed context (one multi-token forward, as ``ctx.generate`` and the
    results page's teacher forcing feed it) leaves a ``decode=fixed`` head at its budget, the
    question's tokens (its newest ``window`` protected) in place of as many context entries; a ``decode=none`` head keeps the whole
    context and grows by the question's length (README, Limitations)."""
    g = torch.Generator().manual_seed(1)
    ctx = kvcake.compress(tiny_llama, torch.randint(3, 128, (1, 150), generator=g), spec, budget=40, window=8)
    before = ctx.cache.layer_counts()
    cache = ctx.fork()
    question = torch.randint(3, 128, (1, 12), generator=g)
    mask = torch.ones(1, 150 + 12, dtype=torch.long)
    with kvcake.enable(tiny_llama), torch.no_grad():
        tiny_llama(question, attention_mask=mask, **with_cache(tiny_llama, cache))
    after = cache.layer_counts()
    fixed = make_method(spec, budget=40).decode == "fixed"
    assert np.array_equal(after, before if fixed else before + 12), (before, after)
    held = set(cache.layers[cache.compressed[0]].padded_positions()[0, 0].tolist())
    assert set(range(162 - 8 if fixed else 150, 162)) <= held  # the window's 8 newest are protected
