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
from kvcake.adapters import with_cache
from kvcake.method import PRESETS
from kvcake.sliding import SlidingLayer
from kvcake.sliding_appends import appended_validity, own_mask
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


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("static", [True, False])
def test_sliding_layers_answer_each_padded_row_as_alone(tiny_gemma3, name, static):
    """Gemma 3 (4 of 6 layers slide, window 12): a 60-token document, follow-ups of 3, 7 and 5
    tokens, then of 2 and 30 (28 pads, more than the window; the longer follow-up past it). By the
    columns (the model's mask) a row padded by ``p`` saw ``p`` fewer of the document's tokens in its
    window and kept ``p`` fewer: every padded row of every preset answered otherwise. Its own mask
    counts each row's tokens (``kvcake.sliding_appends``); the ring (static) and the dynamic layer
    alike."""
    sizes = {} if name == "full" else {"budget": 16, "window": 4}
    ctx = kvcake.compress(tiny_gemma3, prompt(60, seed=8), name, static=static, **sizes)
    assert ctx.padding_refused() is None
    assert_rows_as_alone(ctx, follow_ups())
    assert_rows_as_alone(ctx, [prompt(2, seed=4), prompt(30, seed=5)])
    assert not any(getattr(layer, "settled", False) for layer in ctx.cache.layers)  # the context's untouched


@pytest.mark.parametrize("tiny_gemma3", ["eager"], indirect=True)
@pytest.mark.parametrize("name", ["snapkv", "cake", "adakv", "full"])
@pytest.mark.parametrize("static", [True, False])
def test_sliding_layers_settle_padding_under_the_eager_kernels_mask(tiny_gemma3, name, static):
    """The eager kernel's additive mask: the layer's own mask in that format."""
    sizes = {} if name == "full" else {"budget": 16, "window": 4}
    ctx = kvcake.compress(tiny_gemma3, prompt(60, seed=8), name, static=static, **sizes)
    assert_rows_as_alone(ctx, follow_ups())


@pytest.mark.parametrize("name", ["snapkv", "cake", "critical-adakv"])
@pytest.mark.parametrize("static", [True, False])
def test_beams_of_padded_rows_on_sliding_layers(tiny_gemma3, name, static):
    """Beams reorder a settled layer's rows: its tokens' flags (dynamic) or the ring's go along."""
    ctx = kvcake.compress(tiny_gemma3, prompt(50, seed=6), name, static=static, budget=16, window=4)
    assert_rows_as_alone(ctx, follow_ups(seed=21), num_beams=2, num_return_sequences=2)


@pytest.mark.parametrize("static", [True, False])
def test_a_second_padded_round_on_a_settled_layer(tiny_gemma3, static):
    """Two rounds of padded follow-ups appended to one cache: the second reads the settled layers'
    own flags (from the ring's, static), not the model's mask, which still counts the first
    round's pads; each row's logits are its rounds' alone."""
    ctx = kvcake.compress(tiny_gemma3, prompt(40, seed=2), "snapkv", static=static, budget=16, window=4)
    rounds = [follow_ups(seed=41), [prompt(n, seed=50 + n) for n in (6, 2, 4)]]

    def logits(rows: list[list[torch.Tensor]], settled: bool = False) -> list[torch.Tensor]:
        cache, out = ctx.fork(), []
        cache.batch_repeat_interleave(len(rows[0]))
        mask = ctx.attention_mask.repeat(len(rows[0]), 1)
        with kvcake.enable(tiny_gemma3), torch.no_grad():
            for questions in rows:
                ids, own = left_padded(questions)
                mask = torch.cat([mask, own], dim=1)
                positions = (mask.cumsum(1) - 1).clamp(min=0)[:, -ids.shape[1] :]
                step = tiny_gemma3(
                    ids, attention_mask=mask, position_ids=positions, **with_cache(tiny_gemma3, cache)
                )
                out.append(step.logits)
        assert all(layer.settled == settled for layer in cache.layers if isinstance(layer, SlidingLayer))
        return out

    together = logits(rounds, settled=True)
    for i in range(3):
        alone = logits([[questions[i]] for questions in rounds])
        for r, questions in enumerate(rounds):
            n = questions[i].shape[1]
            torch.testing.assert_close(together[r][i, -n:], alone[r][0], msg=f"row {i}, round {r}")


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


@pytest.mark.parametrize("window", [3, 12])
def test_a_sliding_layers_own_mask_is_each_rows_window_over_its_own_tokens(window):
    """``own_mask`` against the reference: each row's tokens alone, token ``i`` sees token ``j``
    where ``j <= i`` and ``i - j < window``; pads are seen by no token, a pad's row is not empty; the
    additive format is the bool one."""
    held_pads, pads = [0, 3, 11, 5], [0, 8, 2, 5]  # 11 held columns, 9 appended
    valid = torch.tensor(  # host
        [
            [k >= h for k in range(11)] + [k >= p for k in range(9)]
            for h, p in zip(held_pads, pads, strict=True)
        ]
    )
    seen = own_mask(valid, 9, window, None)[:, 0]  # (4, 9, 20)
    for b in range(4):
        tokens = valid[b].nonzero().flatten().tolist()  # host: the reference's own loop
        for i in range(9):
            col = 11 + i
            if valid[b, col]:
                me = tokens.index(col)
                want = [c in tokens and me - window < tokens.index(c) <= me for c in range(20)]
                assert seen[b, i].tolist() == want, (b, i)
            else:  # a pad's row: itself, no other pad
                assert seen[b, i, col] and int((seen[b, i] & ~valid[b]).sum()) == 1, (b, i)
    like = torch.zeros(1, dtype=torch.float16)  # host
    additive = own_mask(valid, 9, window, like)
    assert additive.dtype == torch.float16
    assert torch.equal(additive == 0, seen[:, None])


def test_a_mask_kvcake_cannot_read_is_refused_with_the_fix(tiny_gemma3):
    """A flash kernel's 2-D mask: the sliding layer cannot tell pads from tokens by position, so the
    call is refused naming the kernels that work, and a context says so before any work."""
    with pytest.raises(ValueError, match="need the model's 4-D attention mask.*'sdpa' or 'eager'"):
        appended_validity(torch.ones(2, 20, dtype=torch.bool), 2, 5, 20, "cpu")
    ctx = kvcake.compress(tiny_gemma3, prompt(40, seed=2), "snapkv", budget=16, window=4)
    config = ctx.model.config
    held = config._attn_implementation
    try:
        config._attn_implementation = "flash_attention_2"
        assert "attn_implementation='flash_attention_2'" in ctx.padding_refused()
    finally:
        config._attn_implementation = held
    assert ctx.padding_refused() is None
