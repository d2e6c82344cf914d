"""Attention sinks (GPT-OSS): a learned logit per query head in every row's softmax, its
probability dropped. kvcake's attention over the kept entries, in every layout (dynamic dense and
ragged, static dense and ragged, a hybrid's sliding ring), compiled or eager, puts the sink in
each row's denominator exactly as the model's own attention does; the scorers read the
probabilities the model gives its tokens."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.cache_utils import DynamicCache

import kvcake
from kvcake.adapters import with_cache
from kvcake.attention import _eager
from kvcake.dense import dense_attention
from kvcake.ragged import RaggedMeta, ragged_attention_reference
from kvcake.scorers.base import PrefillInputs, window_attention_reference
from kvcake.scorers.h2o import accumulated_attention
from kvcake.sinks import sink_softmax
from shared_checks import KWARGS_HANDOFF

gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")

SMALL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2, "head_dim": 16, "num_local_experts": 2, "num_experts_per_tok": 1,
         "sliding_window": 8, "max_position_embeddings": 512}  # fmt: skip
STEPS = 16
needs_handoff = pytest.mark.skipif(
    not KWARGS_HANDOFF, reason="static storage needs the kwargs hand-off (transformers 5.24)"
)


def _gpt_oss(layer_types=("sliding_attention", "full_attention"), seed=0) -> tf.GptOssForCausalLM:
    """A tiny random GPT-OSS whose sinks are large (N(0, 2)), so that they matter: the stock
    initialisation (std 0.02) gives each row's sink about the weight of one more token."""
    torch.manual_seed(seed)
    config = tf.GptOssConfig(**SMALL, layer_types=list(layer_types))
    model = tf.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.Tensor):
                module.sinks.normal_(0.0, 2.0)
    return model


def _reference(query, keys, values, visible, sinks):
    """float64, every query head's keys expanded: softmax over [logits, sink], sink dropped.
    query (B, H, q, d); keys, values (B, H_kv, N, d); visible (B, H_kv, q, N) bool."""
    g = query.shape[1] // keys.shape[1]
    k, v = keys.double().repeat_interleave(g, 1), values.double().repeat_interleave(g, 1)
    logits = (query.double() @ k.transpose(-1, -2)) * 0.25
    logits = logits.masked_fill(~visible.repeat_interleave(g, 1), float("-inf"))
    both = torch.cat([logits, sinks.double()[None, :, None, None].expand(*logits.shape[:-1], 1)], -1)
    probs = torch.softmax(both, -1)[..., :-1]
    return (probs @ v).transpose(1, 2), probs


def test_sink_softmax_drops_the_sinks_share():
    logits = torch.tensor([[0.0, 1.0, float("-inf")], [float("-inf")] * 3])
    got = sink_softmax(logits, torch.tensor([[1.0], [0.0]]))
    e = torch.tensor([1.0, torch.e, 0.0])
    torch.testing.assert_close(got[0], e / (e.sum() + torch.e))
    assert torch.equal(got[1], torch.zeros(3))  # nothing visible: the sink takes the row, no NaN


def test_kvcakes_eager_is_gpt_osss_own_bit_for_bit():
    """A plain layer (nothing evicted) runs kvcake's copy of the eager kernel: with ``s_aux`` it
    is the model file's ``eager_attention_forward``, bit for bit, mask and all."""
    model = _gpt_oss()
    module = model.model.layers[1].self_attn
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, n, 7, 16, generator=g) for n in (4, 2, 2))
    mask = torch.zeros(2, 1, 7, 7).masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    mask[1, :, :, :3] = float("-inf")
    mask[1, :, :3, :] = torch.finfo(torch.float32).min  # left padding: rows that see nothing
    want = gpt_oss.eager_attention_forward(module, q, k, v, mask, scaling=0.25, s_aux=module.sinks)
    got = _eager(module, q, k, v, mask, scaling=0.25, s_aux=module.sinks)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_dense_and_ragged_attention_put_the_sinks_in_every_rows_denominator():
    """The dynamic layouts (dense, with empty slots and a multi-token append; ragged, with
    segments of their own lengths) against a float64 reference; probabilities included."""
    g = torch.Generator().manual_seed(2)
    b, h, hkv, q, n, d = 2, 4, 2, 3, 9, 16
    query, keys, values = torch.randn(b, h, q, d, generator=g), *torch.randn(2, b, hkv, n, d, generator=g)
    sinks = torch.randn(h, generator=g) * 3
    positions = torch.arange(n).repeat(b, hkv, 1)
    positions[0, 1, :4] = -1  # empty slots
    positions[1, 0, :2] = -1
    qpos = torch.tensor([[9, 10, 11]]).expand(b, q) - torch.tensor([[0], [3]])  # the second sees fewer
    visible = (positions[:, :, None, :] >= 0) & (positions[:, :, None, :] <= qpos[:, None, :, None])
    want_out, want_probs = _reference(query, keys, values, visible, sinks)
    out, probs = dense_attention(query, keys, values, positions, qpos, 0.25, True, sinks)
    torch.testing.assert_close(out, want_out.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probs, want_probs.float(), rtol=1e-5, atol=1e-6)
    alone, none = dense_attention(query, keys, values, positions, qpos, 0.25, False, sinks)
    assert none is None and torch.equal(alone, out)
    assert not torch.allclose(dense_attention(query, keys, values, positions, qpos, 0.25)[0], out, atol=1e-3)

    held = positions.reshape(-1, n) >= 0  # the same entries as ragged segments
    meta = RaggedMeta.from_lengths(held.sum(-1), int(held.sum(-1).max()), int(held.sum()))
    flat = lambda t: t.reshape(-1, n, *t.shape[3:])[held]  # noqa: E731
    out_r, probs_r = ragged_attention_reference(
        query, flat(keys), flat(values), flat(positions), meta, qpos, 0.25, True, sinks
    )
    torch.testing.assert_close(out_r, want_out.float(), rtol=1e-5, atol=1e-6)
    per_entry = want_probs.reshape(b, hkv, h // hkv, q, n).permute(0, 1, 4, 2, 3).reshape(-1, n, h // hkv, q)
    torch.testing.assert_close(probs_r, per_entry[held].float(), rtol=1e-5, atol=1e-6)


def test_the_window_attention_scorers_read_has_the_sinks():
    g = torch.Generator().manual_seed(3)
    query, keys = torch.randn(1, 4, 12, 16, generator=g), torch.randn(1, 2, 12, 16, generator=g)
    valid = torch.ones(1, 12, dtype=torch.bool)
    sinks = torch.randn(4, generator=g) * 3
    inp = PrefillInputs(query, keys, keys, valid, window=5, scaling=0.25, sinks=sinks)
    probs, _ = inp.window_attention()
    torch.testing.assert_close(probs, window_attention_reference(inp)[0])
    causal = torch.ones(12, 12, dtype=torch.bool).tril()[-5:].expand(1, 2, 5, 12)
    torch.testing.assert_close(probs, _reference(query[:, :, -5:], keys, keys, causal, sinks)[1].float())
    assert (probs.sum(-1) < 1 - 1e-3).all()  # each row leaves the sink its share


def test_h2os_column_sums_have_the_sinks():
    """H2O's prefill sums (the eager kernel's route: no fused attention) over a reference's."""
    g = torch.Generator().manual_seed(5)
    query, keys = torch.randn(1, 4, 12, 16, generator=g), torch.randn(1, 2, 12, 16, generator=g)
    sinks = torch.randn(4, generator=g) * 3
    inp = PrefillInputs(query, keys, keys, torch.ones(1, 12, dtype=torch.bool), 4, 0.25, sinks=sinks)
    causal = torch.ones(12, 12, dtype=torch.bool).tril().expand(1, 2, 12, 12)
    want = _reference(query, keys, keys, causal, sinks)[1].sum(2).float()  # (B, H, S)
    torch.testing.assert_close(accumulated_attention(inp, chunk=5), want, rtol=1e-5, atol=1e-6)


def test_the_scorers_are_handed_the_models_sinks(monkeypatch):
    seen = []

    def recorded(**fields):
        seen.append(fields["sinks"])
        return PrefillInputs(**fields)

    monkeypatch.setattr(kvcake.cascade, "PrefillInputs", recorded)
    model = _gpt_oss()
    kvcake.generate(model, torch.randint(3, 128, (1, 30)), "snapkv", budget=16, window=4, max_new_tokens=1)
    assert len(seen) == 1 and seen[0] is model.model.layers[1].self_attn.sinks  # the full layer's


def _kept_as_dynamic_cache(model, ids, cache) -> DynamicCache:
    """The stock model's cache of the prompt, its full layers holding kvcake's kept entries."""
    with torch.no_grad():
        stock = model(ids, use_cache=True).past_key_values
    for lid, layer in enumerate(cache.layers):
        if getattr(layer, "positions", None) is None:  # a sliding layer: the stock one's
            continue
        held = int((layer.positions >= 0).sum(-1).max())  # static storage: empty slots at -1
        order = layer.positions.argsort(-1)[..., -held:]  # (B, H_kv, held): in position order
        pick = order[..., None].expand(*order.shape, layer.keys.shape[-1])
        stock.layers[lid].keys = layer.keys.gather(2, pick)
        stock.layers[lid].values = layer.values.gather(2, pick)
    return stock


@pytest.mark.parametrize("static", [False, pytest.param(True, marks=needs_handoff)])
@pytest.mark.parametrize("layer_types", [("full_attention",) * 2, ("sliding_attention", "full_attention")])
def test_a_compressed_step_is_the_models_attention_over_the_kept_entries(layer_types, static):
    """SnapKV (one budget per head) keeps 16 of 40 tokens; the next token's logits through the
    KVCakeCache (dynamic layout, or static storage with the hybrid's sliding layer in its ring)
    equal the stock model's, eager, over a DynamicCache that holds exactly the kept entries."""
    model = _gpt_oss(layer_types)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    nxt = torch.tensor([[5]])
    method = kvcake.make_method("snapkv", budget=16, window=4)
    cache = kvcake.KVCakeCache(model, method, static=static, max_cache_len=41)
    with kvcake.enable(model), torch.no_grad():
        model(ids, **with_cache(model, cache))
    oracle = _kept_as_dynamic_cache(model, ids, cache)
    assert oracle.layers[-1].keys.shape[2] == 16
    with torch.no_grad():
        want = model(nxt, **with_cache(model, oracle), position_ids=torch.tensor([[40]])).logits
        with kvcake.enable(model):
            got = model(nxt, **with_cache(model, cache), position_ids=torch.tensor([[40]])).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _decode(model, spec, compiled=False, static=True, batch=2):
    """Prefill eagerly (left padding on sequence 1), then STEPS single-token steps."""
    torch._dynamo.reset()
    step = torch.compile(model.forward, backend="eager", fullgraph=True) if compiled else model.forward
    ids = torch.randint(3, 128, (batch, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1:, :6] = 0
    cache = kvcake.KVCakeCache(model, kvcake.make_method(spec, budget=16, window=4), static=static,
                               max_cache_len=40 + STEPS)  # fmt: skip
    logits = []
    with kvcake.enable(model), torch.no_grad():
        tok = model(ids, attention_mask=mask, **with_cache(model, cache)).logits[:, -1:].argmax(-1)
        for _ in range(STEPS):
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            out = step(tok, attention_mask=mask, **with_cache(model, cache),
                       position_ids=mask.cumsum(-1)[:, -1:] - 1)  # fmt: skip
            tok = out.logits[:, -1:].argmax(-1)
            logits.append(out.logits[:, -1])
    return torch.stack(logits)


@needs_handoff
@pytest.mark.parametrize("spec", ["snapkv", "h2o", "adakv", "cake-adakv", "streamingllm"])
def test_static_and_compiled_steps_decode_as_the_dynamic_reference(spec):
    """A hybrid GPT-OSS, a left-padded batch of 2: static storage (dense, ragged; appending or
    evicting every step) decodes as the dynamic layout, and its steps compiled whole as eager."""
    model = _gpt_oss()
    reference = _decode(model, spec, static=False)
    static = _decode(model, spec)
    torch.testing.assert_close(static, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_decode(model, spec, compiled=True), static, rtol=1e-6, atol=1e-6)


def test_a_budget_covering_the_prompt_decodes_the_stock_models_tokens():
    model = _gpt_oss()
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(4))
    want = model.generate(ids, max_new_tokens=12, do_sample=False)
    got, _ = kvcake.generate(model, ids, "h2o", budget=64, window=4, max_new_tokens=12)
    assert torch.equal(got, want)
