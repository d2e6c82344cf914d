"""What a model's attention adds around its softmax (``kvcake.logit_terms``): Gemma 2's soft cap
on the logits and GPT-OSS's sinks (a learned logit per query head in every row's softmax, its
probability dropped). kvcake's attention over the kept entries, in every layout (dynamic dense and
ragged, static dense and ragged, a hybrid's sliding ring), compiled or eager, applies them exactly
as the model's own attention does; the scorers read the probabilities the model gives its tokens."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.cache_utils import DynamicCache

import kvcake
from kvcake.adapters import with_cache
from kvcake.attention import _eager
from kvcake.dense import dense_attention
from kvcake.logit_terms import LogitTerms
from kvcake.ragged import RaggedMeta, ragged_attention_reference
from kvcake.replay import Captured, capture_queries, replay_compress
from kvcake.scorers.base import PrefillInputs, window_attention_reference
from kvcake.scorers.h2o import accumulated_attention
from shared_checks import KWARGS_HANDOFF, kept_as_dynamic_cache, step_and_oracle_logits

SMALL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2, "head_dim": 16, "sliding_window": 8, "max_position_embeddings": 512}  # fmt: skip
HYBRID = ("sliding_attention", "full_attention")
STEPS = 16
SCALE = 0.25
needs_handoff = pytest.mark.skipif(
    not KWARGS_HANDOFF, reason="static storage needs the kwargs hand-off (transformers 5.24)"
)


def _gpt_oss(layer_types=HYBRID) -> tf.PreTrainedModel:
    """A tiny random GPT-OSS whose sinks are large (N(0, 2)), so that they matter: the stock
    initialisation (std 0.02) gives each row's sink about the weight of one more token."""
    config = tf.GptOssConfig(
        **SMALL, num_local_experts=2, num_experts_per_tok=1, layer_types=list(layer_types)
    )
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        model = tf.GptOssForCausalLM(config).eval()
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def _gemma2(layer_types=HYBRID) -> tf.PreTrainedModel:
    """A tiny random Gemma 2 whose soft cap (1.0) bends its logits: the query and key projections
    are drawn large (std 0.3), so logits reach several units where tanh is far from linear."""
    config = tf.Gemma2Config(**SMALL, layer_types=list(layer_types), attn_logit_softcapping=1.0,
                             final_logit_softcapping=None, query_pre_attn_scalar=16,
                             attn_implementation="eager")  # fmt: skip
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        model = tf.Gemma2ForCausalLM(config).eval()
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.normal_(0.0, 0.3)
            layer.self_attn.k_proj.weight.normal_(0.0, 0.3)
    return model


MODELS = {"gpt_oss": _gpt_oss, "gemma2": _gemma2}
TERMS = {
    "sinks": lambda h: LogitTerms(sinks=torch.randn(h, generator=torch.Generator().manual_seed(9)) * 3),
    "softcap": lambda h: LogitTerms(softcap=0.5),
    "both": lambda h: LogitTerms(0.5, torch.randn(h, generator=torch.Generator().manual_seed(9)) * 3),
}


@pytest.mark.parametrize(
    ("kind", "what"),
    [
        ("gemma2", r"caps its logits \(attn_logit_softcapping=1.0\)"),
        ("gpt_oss", r"has attention sinks \(a learned logit per head in the softmax\)"),
    ],
)
def test_the_terms_under_sdpa_are_refused(kind, what):
    """SDPA leaves both terms out (transformers up to 5.12 run Gemma 2 so by default; 5.24 refuses
    its soft cap there, and ignores GPT-OSS's sinks): kvcake's attention over the kept entries would
    not match the model's own, so the cache says how to load the model."""
    model = MODELS[kind]()
    model.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match=what + r", which SDPA leaves out.*attn_implementation='eager'"):
        kvcake.KVCakeCache(model, "snapkv", budget=16, window=4)


def _reference(query, keys, values, visible, terms):
    """float64, every query head's keys expanded: capped logits, the softmax over [logits, sink],
    the sink dropped. query (B, H, q, d); keys, values (B, H_kv, N, d); visible (B, H_kv, q, N)."""
    g = query.shape[1] // keys.shape[1]
    k, v = keys.double().repeat_interleave(g, 1), values.double().repeat_interleave(g, 1)
    logits = (query.double() @ k.transpose(-1, -2)) * SCALE
    if terms.softcap is not None:
        logits = torch.tanh(logits / terms.softcap) * terms.softcap
    logits = logits.masked_fill(~visible.repeat_interleave(g, 1), float("-inf"))
    if terms.sinks is not None:
        sink = terms.sinks.double()[None, :, None, None].expand(*logits.shape[:-1], 1)
        probs = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(logits, -1)
    return (probs @ v).transpose(1, 2), probs


def test_a_sink_takes_its_share_of_each_row():
    terms = LogitTerms(sinks=torch.tensor([1.0, 0.0]))
    logits = torch.tensor([[0.0, 1.0, float("-inf")], [float("-inf")] * 3])
    got = terms.softmax(logits, terms.sinks[:, None])
    e = torch.tensor([1.0, torch.e, 0.0])
    torch.testing.assert_close(got[0], e / (e.sum() + torch.e))
    assert torch.equal(got[1], torch.zeros(3))  # nothing visible: the sink takes the row, no NaN
    assert LogitTerms().fused and not terms.fused and not LogitTerms(softcap=2.0).fused


@pytest.mark.parametrize("kind", list(MODELS))
def test_kvcakes_eager_is_the_models_own_bit_for_bit(kind):
    """A plain layer (nothing evicted) runs kvcake's copy of the eager kernel: with ``s_aux`` or
    ``softcap`` it is the model file's ``eager_attention_forward``, bit for bit, mask and all."""
    model = MODELS[kind]()
    module = model.model.layers[1].self_attn
    own = __import__(type(module).__module__, fromlist=["eager_attention_forward"]).eager_attention_forward
    extra = {"s_aux": module.sinks} if kind == "gpt_oss" else {"softcap": module.attn_logit_softcapping}
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, n, 7, 16, generator=g) * 3 for n in (4, 2, 2))
    mask = torch.zeros(2, 1, 7, 7).masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    mask[1, :, :, :3] = torch.finfo(torch.float32).min  # left padding
    want = own(module, q, k, v, mask, scaling=SCALE, **extra)
    got = _eager(module, q, k, v, mask, scaling=SCALE, **extra)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("which", list(TERMS))
def test_dense_and_ragged_attention_apply_the_terms(which):
    """The dynamic layouts (dense, with empty slots and a multi-token append; ragged, with
    segments of their own lengths) against a float64 reference; probabilities included."""
    g = torch.Generator().manual_seed(2)
    b, h, hkv, q, n, d = 2, 4, 2, 3, 9, 16
    query, keys, values = torch.randn(b, h, q, d, generator=g) * 2, *torch.randn(2, b, hkv, n, d, generator=g)
    terms = TERMS[which](h)
    positions = torch.arange(n).repeat(b, hkv, 1)
    positions[0, 1, :4] = -1  # empty slots
    positions[1, 0, :2] = -1
    qpos = torch.tensor([[9, 10, 11]]).expand(b, q) - torch.tensor([[0], [3]])  # the second sees fewer
    visible = (positions[:, :, None, :] >= 0) & (positions[:, :, None, :] <= qpos[:, None, :, None])
    want_out, want_probs = _reference(query, keys, values, visible, terms)
    out, probs = dense_attention(query, keys, values, positions, qpos, SCALE, True, terms)
    torch.testing.assert_close(out, want_out.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probs, want_probs.float(), rtol=1e-5, atol=1e-6)
    alone, none = dense_attention(query, keys, values, positions, qpos, SCALE, False, terms)
    assert none is None and torch.equal(alone, out)
    assert not torch.allclose(dense_attention(query, keys, values, positions, qpos, SCALE)[0], out, atol=1e-3)

    held = positions.reshape(-1, n) >= 0  # the same entries as ragged segments
    meta = RaggedMeta.from_lengths(held.sum(-1), int(held.sum(-1).max()), int(held.sum()))
    flat = lambda t: t.reshape(-1, n, *t.shape[3:])[held]  # noqa: E731
    out_r, probs_r = ragged_attention_reference(
        query, flat(keys), flat(values), flat(positions), meta, qpos, SCALE, True, terms
    )
    torch.testing.assert_close(out_r, want_out.float(), rtol=1e-5, atol=1e-6)
    per_entry = want_probs.reshape(b, hkv, h // hkv, q, n).permute(0, 1, 4, 2, 3).reshape(-1, n, h // hkv, q)
    torch.testing.assert_close(probs_r, per_entry[held].float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("which", list(TERMS))
def test_the_attention_scorers_read_has_the_terms(which):
    """The observation window's attention (SnapKV, CAKE, TOVA, CriticalKV read it) and H2O's
    column sums of the prompt's attention (the eager kernel's route), against the reference."""
    g = torch.Generator().manual_seed(3)
    query, keys = torch.randn(1, 4, 12, 16, generator=g) * 2, torch.randn(1, 2, 12, 16, generator=g)
    terms = TERMS[which](4)
    inp = PrefillInputs(query, keys, keys, torch.ones(1, 12, dtype=torch.bool), 5, SCALE, terms=terms)
    probs, _ = inp.window_attention()
    torch.testing.assert_close(probs, window_attention_reference(inp)[0])
    causal = torch.ones(12, 12, dtype=torch.bool).tril().expand(1, 2, 12, 12)
    want = _reference(query, keys, keys, causal, terms)[1].float()  # (B, H, S, S)
    torch.testing.assert_close(probs, want[:, :, -5:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(accumulated_attention(inp, chunk=5), want.sum(2), rtol=1e-5, atol=1e-6)
    plain = PrefillInputs(
        query, keys, keys, torch.ones(1, 12, dtype=torch.bool), 5, SCALE
    ).window_attention()[0]
    assert not torch.allclose(plain, probs, atol=1e-3)


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_scorers_are_handed_the_models_terms(kind, monkeypatch):
    seen = []

    def recorded(**fields):
        seen.append(fields["terms"])
        return PrefillInputs(**fields)

    monkeypatch.setattr(kvcake.cascade, "PrefillInputs", recorded)
    model = MODELS[kind]()
    kvcake.generate(
        model,
        torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(7)),
        "snapkv",
        budget=16,
        window=4,
        max_new_tokens=1,
    )
    attn = model.model.layers[1].self_attn  # the full layer
    want = (
        LogitTerms(sinks=attn.sinks) if kind == "gpt_oss" else LogitTerms(softcap=attn.attn_logit_softcapping)
    )
    assert len(seen) == 1 and seen[0].softcap == want.softcap and seen[0].sinks is want.sinks


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_evals_replayed_prefill_applies_the_terms(kind):
    """The eval's shared prefill (the full cache's queries recorded, then replayed into each
    method's cache) records each layer's terms and keeps what ``kvcake.compress`` keeps."""
    model = MODELS[kind]()
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(6))
    captured, full = Captured(), DynamicCache(config=model.config)
    with capture_queries(model, captured), torch.no_grad():
        logits = model(ids, **with_cache(model, full)).logits[:, -1]
    for preset in ("snapkv", "h2o", "cake-adakv"):
        method = kvcake.make_method(preset, budget=16, window=4)
        got = replay_compress(model, method, captured, full, ids, logits)
        ref = kvcake.compress(model, ids, method)
        for a, b in zip(got.cache.layers, ref.cache.layers, strict=True):
            if getattr(a, "positions", None) is not None:  # a compressed layer: the same entries kept
                assert torch.equal(a.positions, b.positions)
            torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=1e-5)


@pytest.mark.parametrize("static", [False, pytest.param(True, marks=needs_handoff)])
@pytest.mark.parametrize("layer_types", [("full_attention",) * 2, HYBRID])
@pytest.mark.parametrize("kind", list(MODELS))
def test_a_compressed_step_is_the_models_attention_over_the_kept_entries(kind, layer_types, static):
    """SnapKV (one budget per head) keeps 16 of 40 tokens; the next token's logits through the
    KVCakeCache (dynamic layout, or static storage with a hybrid's sliding layer in its ring)
    equal the stock model's, eager, over a DynamicCache that holds exactly the kept entries."""
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    got, want, oracle = step_and_oracle_logits(
        MODELS[kind](layer_types), ids, "snapkv", static, kept_as_dynamic_cache
    )
    assert oracle.layers[-1].keys.shape[2] == 16 + 1  # the kept entries, then the new token
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _decode(model, spec, compiled=False, static=True, batch=2, **cache_kw):
    """Prefill eagerly (left padding on sequence 1), then STEPS single-token steps; ``cache_kw``:
    more of the ``KVCakeCache``'s options (float8 storage)."""
    torch._dynamo.reset()
    step = torch.compile(model.forward, backend="eager", fullgraph=True) if compiled else model.forward
    ids = torch.randint(3, 128, (batch, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1:, :6] = 0
    cache = kvcake.KVCakeCache(model, kvcake.make_method(spec, budget=16, window=4), static=static,
                               max_cache_len=40 + STEPS, **cache_kw)  # fmt: skip
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
@pytest.mark.parametrize("kind", list(MODELS))
def test_static_and_compiled_steps_decode_as_the_dynamic_reference(kind, spec):
    """A hybrid, a left-padded batch of 2: static storage (dense, ragged; appending or evicting
    every step) decodes as the dynamic layout, and its steps compiled whole as eager."""
    model = MODELS[kind]()
    reference = _decode(model, spec, static=False)
    static = _decode(model, spec)
    torch.testing.assert_close(static, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_decode(model, spec, compiled=True), static, rtol=1e-6, atol=1e-6)


@needs_handoff
@pytest.mark.parametrize("spec", ["snapkv", "h2o", "adakv"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_float8_storage_applies_the_terms(kind, spec):
    """Kept entries in float8 (``kvcake.fp8``): with a ring of recent tokens in the model's dtype
    that covers every token (``kv_recent``), the logits are the unquantised cache's, bit for bit;
    with a ring of 4, static storage decodes as the dynamic layout, and float8 shows."""
    model = MODELS[kind]()
    plain = _decode(model, spec)
    assert torch.equal(_decode(model, spec, kv_dtype="fp8", kv_recent=40 + STEPS), plain)
    fp8 = {"kv_dtype": "fp8", "kv_recent": 4}
    static = _decode(model, spec, **fp8)
    torch.testing.assert_close(_decode(model, spec, static=False, **fp8), static, rtol=1e-5, atol=1e-5)
    assert (static - plain).abs().max() > 1e-3


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_budget_covering_the_prompt_decodes_the_stock_models_tokens(kind):
    model = MODELS[kind]()
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(4))
    want = model.generate(ids, max_new_tokens=12, do_sample=False)
    got, _ = kvcake.generate(model, ids, "h2o", budget=64, window=4, max_new_tokens=12)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["position_bias", "sinks", "alibi"])
def test_a_term_kvcake_does_not_apply_is_refused(tiny_llama, name):
    """A model whose attention call gets a term kvcake does not apply (T5's and Inkling's additive
    position bias, sinks under another name than GPT-OSS's ``s_aux``, ALiBi) would decode other
    tokens under compression with no error: the call is refused, naming the term, where a
    compressed layer is reached (the keyword reaches the attention as a model's own would; the
    stock cache passes it through untouched)."""
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    term = {name: torch.zeros(1, 4, 12, 12)}
    cache = kvcake.KVCakeCache(tiny_llama, "snapkv", budget=8, window=2)
    with kvcake.enable(tiny_llama), torch.no_grad():
        with pytest.raises(ValueError, match=rf"hands its attention .*\({name}=\.\.\.\).*DynamicCache"):
            tiny_llama(ids, **with_cache(tiny_llama, cache), **term)
        other = kvcake.KVCakeCache(tiny_llama, "snapkv", budget=8, window=2)
        with_none = tiny_llama(ids, **with_cache(tiny_llama, other), **{name: None}).logits
        assert torch.equal(with_none, tiny_llama(ids).logits)  # the prompt's own attention, as stock
