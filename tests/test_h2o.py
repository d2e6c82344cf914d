"""H2O's accumulated attention against the stock model's attention matrix.

H2O scores an entry by the sum of the attention every query gave it, the prompt's rows and each
decoding step's. The reference is the eager model's own attention over the whole sequence
(``output_attentions``, no cache): with nothing evicted a kept entry's score is its column sum
there, group-averaged over the KV head's query heads; with the prompt evicted, the prompt's
part of every kept entry's score is that column sum over the prompt. Until 2026-12-07 the
window's entries (at +inf during prefill) began decoding at 0, so the prompt's rows after them
were lost as they left the window. Tolerance: float32 sums of the same terms in another order
(measured at most 1.4e-6 here; asserted at 1e-5).
"""

from __future__ import annotations

import pytest
import torch

import kvcake
from kvcake import KVCakeCache, make_method
from kvcake.adapters import with_cache
from shared_checks import left_padded, prefill, prompt

WINDOW = 8


def column_sums(eager, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer (H_kv, T) float64: each key's attention summed over every query of ``ids`` (1, T),
    the query heads of each KV head averaged."""
    with torch.no_grad():
        out = eager(ids, output_attentions=True, use_cache=False)
    kv = eager.config.num_key_value_heads
    return [a[0].double().sum(1).reshape(kv, -1, a.shape[-1]).mean(1) for a in out.attentions]


def assert_scores_are_sums(
    cache: KVCakeCache, sums: list[torch.Tensor], row: int = 0, shift: int = 0
) -> None:
    """Every kept entry of ``row`` scored with its column sum (positions ``shift`` past the row's own)."""
    for lid in cache.compressed:
        layer = cache.layers[lid]
        scores = layer.padded(layer.scores, float("nan"))[row].double()
        positions = layer.padded_positions()[row]
        held = positions >= 0
        assert held.any()
        expected = sums[lid].gather(-1, (positions - shift).clamp(min=0))
        torch.testing.assert_close(scores[held], expected[held], rtol=0, atol=1e-5)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("tiny_llama", ["sdpa", "eager"], indirect=True)
def test_the_prompt_sums_are_kept_for_every_entry_the_window_included(tiny_llama, make_tiny_llama, static):
    eager = make_tiny_llama(attn_implementation="eager")
    ids = prompt(40, seed=3)
    cache = KVCakeCache(
        tiny_llama, make_method("h2o", budget=16, window=WINDOW), static=static, max_cache_len=48
    )
    with kvcake.enable(tiny_llama), torch.no_grad():
        tiny_llama(ids, **with_cache(tiny_llama, cache))
    assert (cache.layer_counts() == 16).all()  # the prompt was evicted
    assert_scores_are_sums(cache, column_sums(eager, ids))


def test_a_left_padded_row_keeps_its_own_prompt_sums(tiny_llama, make_tiny_llama):
    eager = make_tiny_llama(attn_implementation="eager")
    long, short = prompt(40, seed=4)[0], prompt(30, seed=5)[0]
    ids, mask = left_padded(long, short)
    cache, _ = prefill(tiny_llama, ids, make_method("h2o", budget=16, window=WINDOW), mask, static=False)
    assert_scores_are_sums(cache, column_sums(eager, long[None]), row=0)
    assert_scores_are_sums(cache, column_sums(eager, short[None]), row=1, shift=10)


@pytest.mark.parametrize("static", [False, True])
def test_decoding_adds_each_step_to_the_prompt_sums(tiny_llama, make_tiny_llama, static):
    """A budget covering the prompt and the new tokens: nothing is evicted, so every step attends
    over the whole sequence and each score is its column sum over all of it."""
    eager = make_tiny_llama(attn_implementation="eager")
    ids, steps = prompt(40, seed=6), 6
    method = make_method("h2o", budget=64, window=WINDOW)
    cache = KVCakeCache(tiny_llama, method, static=static, max_cache_len=ids.shape[1] + steps)
    seq = ids
    with kvcake.enable(tiny_llama), torch.no_grad():
        out = tiny_llama(ids, **with_cache(tiny_llama, cache))
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            seq = torch.cat([seq, token], dim=1)
            out = tiny_llama(token, **with_cache(tiny_llama, cache))
    assert_scores_are_sums(cache, column_sums(eager, seq))


def test_a_question_after_a_compressed_context_adds_every_row(tiny_llama, make_tiny_llama):
    """Five tokens appended in one forward: each of their rows adds its attention (a mean over
    the rows, the decoding rule of the other scorers, would divide the sums by five)."""
    eager = make_tiny_llama(attn_implementation="eager")
    ids, question = prompt(40, seed=7), prompt(5, seed=8)
    context = kvcake.compress(tiny_llama, ids, method=make_method("h2o", budget=64, window=WINDOW))
    cache = context.fork()
    with kvcake.enable(tiny_llama), torch.no_grad():
        tiny_llama(question, **with_cache(tiny_llama, cache))
    assert_scores_are_sums(cache, column_sums(eager, torch.cat([ids, question], dim=1)))
