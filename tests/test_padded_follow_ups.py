"""Follow-ups of different lengths in one batch, left-padded, after a document compressed once
(``CompressedContext.generate(ids, attention_mask=mask)``, ``kvcake.answer``'s batches): every row
answers what its follow-up alone gets. The pads land after the document's kept entries; each layer
turns them into empty slots and shifts its row's earlier entries by its padding
(``kvcake.sequences.settle_padding``), and the append's probabilities read the pads' rows as their
sequence's mean (``real_rows``), so decoding-time eviction sees each row as alone."""

from __future__ import annotations

import pytest
import torch

import kvcake
from kvcake.method import PRESETS
from shared_checks import prompt

LENGTHS = (3, 7, 5)  # rows 0 and 2 padded (4 and 2 pads), row 1 the longest
STEPS = 10


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.shape[1] for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - r.shape[1] :], mask[i, width - r.shape[1] :] = r[0], 1
    return ids, mask


def follow_ups(seed: int = 11) -> list[torch.Tensor]:
    return [prompt(n, seed=seed + n) for n in LENGTHS]


def assert_rows_as_alone(ctx, questions, **generate_kwargs) -> None:
    kw = {"max_new_tokens": STEPS, "min_new_tokens": STEPS, "do_sample": False, "pad_token_id": 0}
    kw.update(generate_kwargs)
    alone = [ctx.generate(q, **kw) for q in questions]
    ids, mask = left_padded(questions)
    together = ctx.generate(ids, attention_mask=mask, **kw)
    rows = together.shape[0] // len(questions)
    for i, a in enumerate(alone):
        assert torch.equal(together[i * rows], a[0]), f"follow-up {i} ({questions[i].shape[1]} tokens)"


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("static", [True, False])
def test_each_padded_row_answers_as_alone(tiny_llama, name, static):
    """Every preset, static and dynamic layouts: a 90-token document kept at 24 entries a layer (the
    decode=fixed presets evict at every step), three follow-ups of 3, 7 and 5 tokens."""
    sizes = {} if name == "full" else {"budget": 24, "window": 4}
    ctx = kvcake.compress(tiny_llama, prompt(90, seed=1), name, static=static, **sizes)
    kept = [layer.padded_positions().clone() for layer in ctx.cache.layers]
    assert ctx.padding_refused() is None
    assert_rows_as_alone(ctx, follow_ups())
    assert all(
        torch.equal(layer.padded_positions(), k) for layer, k in zip(ctx.cache.layers, kept, strict=True)
    )


@pytest.mark.parametrize("tiny_llama", ["sdpa", "eager"], indirect=True)
@pytest.mark.parametrize("name", ["h2o", "cake", "adakv", "tova"])
def test_more_padding_than_window_with_a_keep_ratio(tiny_llama, name):
    """A 2-token follow-up beside a 30-token one (28 pads, more than the window and the budget's
    share of the follow-up), a keep ratio; both attention kernels' masks."""
    ctx = kvcake.compress(tiny_llama, prompt(120, seed=3), name, ratio=0.3, window=8)
    assert_rows_as_alone(ctx, [prompt(2, seed=4), prompt(30, seed=5)])


@pytest.mark.parametrize("name", ["snapkv", "cake", "critical-adakv"])
def test_beams_of_padded_rows(tiny_llama, name):
    ctx = kvcake.compress(tiny_llama, prompt(80, seed=6), name, budget=20, window=4)
    assert_rows_as_alone(ctx, follow_ups(seed=21), num_beams=2, num_return_sequences=2)


def test_padding_not_on_the_left_is_refused(tiny_llama):
    ctx = kvcake.compress(tiny_llama, prompt(60, seed=7), "snapkv", budget=16, window=4)
    ids, mask = left_padded(follow_ups())
    with pytest.raises(
        ValueError, match=r"follow-ups with padding are not supported here \(padding not on the left\)"
    ):
        ctx.generate(ids, attention_mask=mask.flip(-1), max_new_tokens=2)
    empty = mask.clone()
    empty[0] = 0
    with pytest.raises(ValueError, match="padding not on the left"):  # a row of padding alone
        ctx.generate(ids, attention_mask=empty, max_new_tokens=2)


def test_caches_that_would_keep_the_padding_refuse_it(tiny_gemma3):
    """A sliding window counts the pads' columns (Gemma 3's sliding layers): one length a batch
    there, said before any work; ``kvcake.answer`` groups so."""
    ids, mask = left_padded(follow_ups())
    hybrid = kvcake.compress(tiny_gemma3, prompt(60, seed=8), "snapkv", budget=16, window=4)
    assert "SlidingLayer" in hybrid.padding_refused()
    with pytest.raises(ValueError, match=r"not supported here \(the cache holds SlidingLayer layers\)"):
        hybrid.generate(ids, attention_mask=mask, max_new_tokens=2)
    assert hybrid.generate(ids[1:2], max_new_tokens=2).shape == (1, 2)  # unpadded follow-ups still run


@pytest.mark.parametrize("kv_recent", [None, 8, 0])
@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("static", [True, False])
def test_float8_storage_rows_answer_as_alone(tiny_llama, name, static, kv_recent):
    """Entries kept in float8: the same, and the rings of recent entries held exactly hold each
    row's own last tokens (its earlier ones shifted by its padding, its pads nowhere), as alone: the
    pads' ring writes overwrote earlier tokens, which come back from the rings before the append
    (``fp8.settle_recent``; without it every preset answered otherwise with a ring of 8 or 32). A
    ring of 8 is shorter than the follow-ups and their padding; 0: no ring."""
    sizes = {} if name == "full" else {"budget": 24, "window": 4}
    ctx = kvcake.compress(
        tiny_llama, prompt(90, seed=1), name, static=static, kv_dtype="fp8", kv_recent=kv_recent, **sizes
    )
    assert ctx.padding_refused() is None
    assert_rows_as_alone(ctx, follow_ups())
    out = ctx.generate(*left_padded(follow_ups()), max_new_tokens=1, return_dict_in_generate=True)
    assert all(layer.recent_before is None for layer in out.past_key_values.layers)  # let go at the append


@pytest.mark.parametrize("name", list(PRESETS))
def test_a_padded_batch_of_documents_answers_each_as_alone(tiny_llama, name):
    """Documents of different lengths compressed in one left-padded batch, then a follow-up per
    row (padded too): each row gets what its document alone gets, tokens and logits. The prompt's
    positions count from each row's first token, as ``generate`` counts its follow-ups' (by the
    columns, a shorter document's keys were rotated 25 positions further from its follow-up than
    alone: TOVA and CAKE answered otherwise from the third token, every preset's logits moved)."""
    docs, qs = [prompt(70, seed=12), prompt(95, seed=13)], [prompt(9, seed=14), prompt(3, seed=15)]
    sizes = {} if name == "full" else {"budget": 20, "window": 4}
    ids, mask = left_padded(docs)
    pair = kvcake.compress(tiny_llama, ids, name, attention_mask=mask, **sizes)
    kw = {"max_new_tokens": STEPS, "min_new_tokens": STEPS, "do_sample": False, "pad_token_id": 0}
    kw.update(return_dict_in_generate=True, output_logits=True)
    q_ids, q_mask = left_padded(qs)
    together = pair.generate(q_ids, attention_mask=q_mask, **kw)
    same = torch.cat([qs[0], prompt(9, seed=16)])  # forward() takes follow-ups of one length
    logits = pair.forward(same)
    for i, (doc, q) in enumerate(zip(docs, qs, strict=True)):
        alone = kvcake.compress(tiny_llama, doc, name, **sizes)
        own = alone.generate(q, **kw)
        assert torch.equal(together.sequences[i], own.sequences[0]), f"row {i}"
        torch.testing.assert_close(together.logits[0][i], own.logits[0][0])  # the follow-up's own
        torch.testing.assert_close(pair.logits[i], alone.logits[0])
        torch.testing.assert_close(logits[i], alone.forward(same[i : i + 1])[0])


@pytest.mark.parametrize("name", ["snapkv", "cake", "adakv", "full"])
def test_a_padded_batch_of_documents_on_a_hybrid_model(tiny_gemma3, name):
    """The same on Gemma 3 (sliding layers; follow-ups of one length, since its cache refuses their
    padding): by the columns, the shorter document's row answered otherwise for every method, the
    full cache's included (first logits 0.16 apart)."""
    docs, qs = [prompt(70, seed=12), prompt(95, seed=13)], [prompt(6, seed=14), prompt(6, seed=15)]
    sizes = {} if name == "full" else {"budget": 20, "window": 4}
    ids, mask = left_padded(docs)
    pair = kvcake.compress(tiny_gemma3, ids, name, attention_mask=mask, **sizes)
    kw = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    kw.update(return_dict_in_generate=True, output_logits=True)
    together = pair.generate(torch.cat(qs), **kw)
    for i, (doc, q) in enumerate(zip(docs, qs, strict=True)):
        own = kvcake.compress(tiny_gemma3, doc, name, **sizes).generate(q, **kw)
        assert torch.equal(together.sequences[i], own.sequences[0]), f"row {i}"
        torch.testing.assert_close(together.logits[0][i], own.logits[0][0])


@pytest.mark.parametrize("name", ["snapkv", "cake", "adakv", "full"])
def test_teacher_forcing_padded_follow_ups(tiny_llama, name):
    """``forward(ids, attention_mask=mask)``: each row's last logits are those its follow-up gets
    alone."""
    sizes = {} if name == "full" else {"budget": 24, "window": 4}
    ctx = kvcake.compress(tiny_llama, prompt(90, seed=1), name, **sizes)
    questions = follow_ups(seed=31)
    ids, mask = left_padded(questions)
    logits = ctx.forward(ids, attention_mask=mask)
    for i, q in enumerate(questions):
        torch.testing.assert_close(logits[i, -q.shape[1] :], ctx.forward(q)[0])
