"""The real default model (SmolLM2-135M-Instruct) retrieves a one-word needle at ~2k tokens,
question inside the compressed prompt, with the full cache and with the compressed ones.

Five fixed seeds at depths 10% to 90%. This is question-aware compression: the question's own
tokens attended to the whole prompt during prefill, so even StreamingLLM (which evicts the
needle) answers 4/5 of these (measured); the context-only scenario in the evaluation harness is
the discriminating one. The needle is RULER's single needle in the "restated"
wording (see kvcake.eval.tasks.RESTATED_NEEDLE and the README's Limitations): with RULER's own
wording this 135M model misses about half of these prompts even with the full cache, which would
measure the model, not the compression. Each test prints every method's score.
"""

import pytest
import torch

import kvcake
from kvcake.eval.tasks import make_samples
from kvcake.prompts import build_prompt

pytestmark = pytest.mark.integration

# (seed, depth). Seed 4 at 90% was replaced by seed 5: there the full cache itself answers
# "Econo-..." instead of "Geneva", so it cannot measure compression.
CASES = ((0, 10), (1, 30), (2, 50), (3, 70), (5, 90))


@pytest.fixture(scope="module")
def needles(default_model):
    model, tok = default_model
    out = []
    for seed, depth in CASES:
        s = make_samples("niah_single", tok, 1, 2000, seed=seed, depth=depth, needle_style="restated")[0]
        ids = build_prompt(tok, s.context_prompt(), s.question_prompt(answer_prefix=False), s.answer_prefix)
        out.append((s, ids.full))
    return out


def found(default_model, needles, method, **budget) -> list[bool]:
    model, tok = default_model
    hits = []
    for sample, ids in needles:
        if method == "full":
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=6, do_sample=False)
        else:
            out, _ = kvcake.generate(model, ids, method, max_new_tokens=6, do_sample=False, **budget)
        text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        hits.append(sample.answers[0].lower() in text.lower())
    print(f"{method}: {sum(hits)}/{len(hits)} {hits}")
    return hits


def test_full_cache_finds_every_needle(default_model, needles):
    assert all(1900 <= ids.shape[1] <= 2200 for _, ids in needles), "prompts of ~2k tokens"
    assert sum(found(default_model, needles, "full")) == 5


@pytest.mark.parametrize("method", ["cake", "snapkv", "pyramidkv", "criticalkv", "adakv", "cake-adakv"])
def test_compressed_at_quarter_budget(default_model, needles, method):
    assert sum(found(default_model, needles, method, ratio=0.25)) >= 3


@pytest.mark.parametrize("method", ["cake", "adakv"])  # dense and ragged static storage, reordered per step
def test_beam_search_on_the_real_model(default_model, needles, method):
    """Four beams: a budget covering the prompt gives the stock beams token for token; at a quarter
    budget the beams still find the needle as often as greedy decoding does here (3 of 5 or more)."""
    model, tok = default_model
    sample, ids = needles[2]
    beams = {"max_new_tokens": 6, "num_beams": 4, "do_sample": False}
    with torch.no_grad():
        stock = model.generate(ids, attention_mask=torch.ones_like(ids), **beams)
    covered, _ = kvcake.generate(model, ids, method, budget=4096, **beams)
    assert torch.equal(covered, stock)
    hits = []
    for sample, ids in needles:
        out, _ = kvcake.generate(model, ids, method, ratio=0.25, **beams)
        hits.append(
            sample.answers[0].lower() in tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).lower()
        )
    print(f"{method} beams: {sum(hits)}/{len(hits)} {hits}")
    assert sum(hits) >= 3
