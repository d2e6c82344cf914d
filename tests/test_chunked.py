"""Chunked attention (Llama 4): its chunked layers are kept as transformers keeps them, only the
full-attention layers are compressed.

A chunked layer attends, for a token at position ``p``, the tokens of its chunk
``[p - p % C, p]`` (``attention_chunk_size`` C); transformers holds its last ``C - 1`` tokens in a
sliding-window layer and the model's chunked mask hides those of earlier chunks. kvcake keeps such
a layer whole (``SlidingLayer(chunked=True)``): the prompt and multi-token appends through
transformers' layer and the model's mask, single-token steps in the ring of ``C`` slots, where a
token starting a new chunk hides every other slot.

Oracle: the stock model with transformers' ``DynamicCache``, decoding across several chunk
boundaries (C = 16, a 40-token prompt, 30 new tokens); kvcake's ring against its own dynamic path
and its compiled step against eager."""

from __future__ import annotations

import pytest
import torch

import kvcake
from kvcake.adapters import describe_model
from kvcake.layer_types import layer_windows
from kvcake.sliding import SlidingLayer
from shared_checks import (
    GREEDY,
    KWARGS_HANDOFF,
    assert_same_decoding,
    compiled_and_eager_decoding,
    tiny_model,
)

CHUNK, PROMPT, NEW = 16, 40, 30
# transformers 5.0-5.23's models hand cache.update no kwargs: no ring there, nothing compiled (test_compile.py)
needs_kwargs_handoff = pytest.mark.skipif(
    not KWARGS_HANDOFF, reason="this transformers' models do not hand their attention kwargs to cache.update"
)


def _llama4(layers: int = 8) -> torch.nn.Module:
    """A tiny random Llama 4: three chunked layers, then a full-attention (NoPE) one, repeated."""
    return tiny_model("Llama4TextConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        attention_chunk_size=CHUNK, num_local_experts=2, num_experts_per_tok=1, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, max_position_embeddings=1024,
    ))  # fmt: skip


def _ids(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_chunked_layers_are_kept_and_the_full_attention_ones_compressed():
    model = _llama4()
    info = describe_model(model)
    assert info.windows == (CHUNK, CHUNK, CHUNK, None) * 2 and info.chunked == (0, 1, 2, 4, 5, 6)
    assert info.compressed_layers == (3, 7)
    cache = kvcake.KVCakeCache(model, "snapkv", budget=12, window=4)
    assert [layer.chunked for layer in cache.layers if isinstance(layer, SlidingLayer)] == [True] * 6


def test_a_model_whose_every_layer_is_chunked_is_refused():
    """Nothing to compress: its cache is bounded by the chunk already."""
    config = _llama4(layers=2).config
    config.layer_types = ["chunked_attention"] * 2
    with pytest.raises(ValueError, match=r"every layer uses chunked attention \(window 16\)"):
        layer_windows(config, "llama4_text")


@pytest.mark.parametrize("static", [True, False])
def test_a_covering_budget_decodes_the_stock_models_tokens_across_chunk_boundaries(static):
    """30 steps from position 40 cross the chunks starting at 48 and 64: the ring (static) and
    transformers' layer with the model's mask (dynamic) both hide the earlier chunk's tokens."""
    model = _llama4()
    x = _ids(PROMPT)
    kw = {"max_new_tokens": NEW, **GREEDY}
    with torch.no_grad():
        stock = model.generate(x, **kw)
    out, cache = kvcake.generate(model, x, "cake-adakv", budget=128, window=8, static=static, **kw)
    assert_same_decoding(out, stock)
    rings = any(layer.static == "ring" for layer in cache.layers if isinstance(layer, SlidingLayer))
    assert rings == (static and KWARGS_HANDOFF)  # (older releases hand no kwargs: the dynamic layer decodes)
    batch = torch.cat([x, torch.cat([torch.zeros(1, 5, dtype=torch.long), x[:, :-5]], 1)])
    mask = (torch.arange(PROMPT) >= torch.tensor([[0], [5]])).long()
    with torch.no_grad():
        stock = model.generate(batch, attention_mask=mask, **kw)
    out, _ = kvcake.generate(
        model, batch, "cake-adakv", budget=128, window=8, attention_mask=mask, static=static, **kw
    )
    assert_same_decoding(out, stock, "left-padded")


@needs_kwargs_handoff
def test_the_ring_hides_the_earlier_chunk_and_equals_the_dynamic_layer():
    """Compressed (budget 12 of 40): the ring's steps equal the dynamic path's to float rounding
    (the ring sums in slot order), tokens and logits."""
    model = _llama4()
    x = _ids(PROMPT, seed=1)
    kw = {"max_new_tokens": NEW, **GREEDY}
    ring, cache = kvcake.generate(model, x, "snapkv", budget=12, window=4, **kw)
    dynamic, _ = kvcake.generate(model, x, "snapkv", budget=12, window=4, static=False, **kw)
    assert_same_decoding(ring, dynamic)
    layer = cache.layers[0]
    seen = PROMPT + NEW - 1  # the last token generated was never appended
    assert layer.static == "ring" and layer.length == seen
    assert layer.valid[0].tolist() == [i <= (seen - 1) % CHUNK for i in range(CHUNK)]


def test_beam_search_and_a_context_with_a_covering_budget_are_the_stock_models():
    """Beams reorder each row's place in its chunk with the ring; a question appended to a context
    goes through transformers' layer and the model's mask, then back into the ring."""
    model = _llama4()
    x = _ids(PROMPT, seed=4)
    kw = {"max_new_tokens": 20, "num_beams": 3, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        stock = model.generate(x, **kw)
    out, _ = kvcake.generate(model, x, "snapkv", budget=128, window=4, **kw)
    assert torch.equal(out, stock)
    question = _ids(7, seed=5)
    with torch.no_grad():
        stock = model.generate(
            torch.cat([x, question], 1), max_new_tokens=NEW, do_sample=False, pad_token_id=0
        )
    ctx = kvcake.compress(model, x, "snapkv", budget=128, window=4)
    answer = ctx.generate(question, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert torch.equal(answer, stock[:, PROMPT + 7 :])


def test_budgets_sum_over_the_full_attention_layers():
    model = _llama4()
    for preset in ("cake", "adakv", "h2o", "criticalkv"):
        out, cache = kvcake.generate(model, _ids(PROMPT, seed=2), preset, budget=12, window=4, max_new_tokens=4,
                                     min_new_tokens=4, do_sample=False, pad_token_id=0)  # fmt: skip
        assert out.shape == (1, PROMPT + 4), preset
        assert cache.budgets.shape == (1, 2) and int(cache.budgets.sum()) == 24, preset


@pytest.mark.slow
@needs_kwargs_handoff
def test_a_decode_step_compiles_whole_across_chunk_boundaries_and_equals_eager():
    model = _llama4(layers=4)
    ids = _ids(PROMPT, seed=3, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    graphs, compiled, eager = compiled_and_eager_decoding(
        model, "cake-adakv", ids, mask, NEW, budget=12, window=4
    )
    assert 1 <= graphs <= 2
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_padded_follow_ups_are_refused_before_any_work():
    """A chunk counts the pads' columns (its place in the chunk is the model's mask's): follow-ups
    of different lengths in one left-padded batch are refused, said before any work; one length a
    batch runs (``kvcake.answer`` groups so). Gemma 3's sliding windows take them
    (``tests/test_padded_follow_ups.py``)."""
    ctx = kvcake.compress(_llama4(), _ids(40), "snapkv", budget=16, window=4)
    assert ctx.padding_refused() == "the cache holds chunked SlidingLayer layers"
    ids, mask = torch.cat([_ids(5, seed=1), _ids(5, seed=2)]), torch.ones(2, 5, dtype=torch.long)  # host
    mask[0, :2] = 0
    with pytest.raises(
        ValueError, match=r"not supported here \(the cache holds chunked SlidingLayer layers\)"
    ):
        ctx.generate(ids, attention_mask=mask, max_new_tokens=2)
    assert ctx.generate(ids, max_new_tokens=2).shape == (2, 2)
