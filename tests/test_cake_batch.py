"""CAKE's temperatures in a batch: each prompt takes those of its own budget (``kvcake.cake_tau``).

A calibration's temperatures change with the budget per layer, and ``ratio=`` gives prompts of
different lengths different budgets. Until 2026-12-07 a batch took the temperatures of its mean
budget, so a prompt's layer budgets depended on the prompts beside it.
"""

from __future__ import annotations

import pytest
import torch

import kvcake
from kvcake import temperatures
from kvcake.models import model_fingerprint
from kvcake.temperatures import Calibration, TauPoint, save_calibration
from shared_checks import (
    KWARGS_HANDOFF,
    assert_batch_matches_each_alone,
    compiled_and_eager_decoding,
    left_padded,
    prompt,
)

RUN = {"ratio": 0.3, "window": 8, "max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}


@pytest.fixture
def calibrated(tmp_path, monkeypatch, tiny_llama):
    """Save a calibration for ``tiny_llama`` (one set, steep in the budget) and return a writer of
    others; nothing shipped, fresh warn-once memories."""
    monkeypatch.setenv("KVCAKE_CACHE_DIR", str(tmp_path / "models"))
    monkeypatch.setattr(temperatures, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setattr(temperatures, "_warned", set())

    def write(*points: TauPoint) -> None:
        save_calibration(Calibration(model_fingerprint(tiny_llama), points, "tiny"))

    write(TauPoint(30, 0.3, 3.0), TauPoint(60, 3.0, 0.3))
    return write


def _prompts():
    return prompt(200, seed=8)[0], prompt(110, seed=9)[0]  # 60 and 33 entries per layer at 0.3


def test_a_prompt_takes_the_temperatures_of_its_own_budget(tiny_llama, calibrated):
    assert_batch_matches_each_alone(tiny_llama, "cake", *_prompts(), 90, **RUN)


def _batch(model):
    ids, mask = left_padded(*_prompts())
    return kvcake.generate(model, ids, "cake", attention_mask=mask, **RUN)[1]


def test_a_batch_describes_each_prompts_temperatures(tiny_llama, calibrated):
    cache = _batch(tiny_llama)
    t1, t2 = cache.seq.tau1.tolist(), cache.seq.tau2.tolist()
    assert t1[0] == pytest.approx(3.0) and t2[0] == pytest.approx(0.3) and t1[1] < 0.5 < 2.0 < t2[1]
    assert cache.tau.rows == ((t1[0], t2[0]), (t1[1], t2[1]))
    assert cache.tau.describe().startswith("per prompt 3/0.3, ")


def test_indicators_that_differ_are_each_prompts_own(tiny_llama, calibrated):
    """Where the prompts' calibration points chose different indicators (33 entries per layer:
    max7, 60: the paper's avg5), each row is pooled with its own, prefill and decoding: every prompt
    gets what it gets alone (until 2026-12-07 the batch shared the one at its mean budget, with a
    warning), and the cache says so."""
    calibrated(TauPoint(30, 0.3, 3.0, "max7"), TauPoint(60, 3.0, 0.3))
    a, b = _prompts()
    assert_batch_matches_each_alone(tiny_llama, "cake", a, b, 90, **RUN)
    cache = _batch(tiny_llama)
    assert cache.method.scorer.row_indicators == "avg5/max7"
    assert "indicators per prompt avg5/max7" in cache.tau.describe()
    alone = kvcake.generate(tiny_llama, b[None], "cake", **RUN)[1]
    assert (alone.method.scorer.pooling, alone.method.scorer.kernel, alone.method.scorer.row_indicators) == (
        "max",
        7,
        "",
    )  # alone: the scorer's own fields
    # the indicator decides this prompt's kept entries, so sharing avg5 would have changed them
    paper = kvcake.generate(tiny_llama, b[None], "cake,score.indicator_from=paper", **RUN)[1]
    assert any(
        not torch.equal(alone.layers[lid].padded_positions(), paper.layers[lid].padded_positions())
        for lid in alone.compressed
    )


def test_beams_keep_each_prompts_indicator(tiny_llama, calibrated):
    """Beam search repeats and reorders the rows: each row's indicator follows it (``sequences.py``)."""
    calibrated(TauPoint(30, 0.3, 3.0, "max7"), TauPoint(60, 3.0, 0.3))
    a, b = _prompts()
    ids, mask = left_padded(a, b)
    beams = {**RUN, "num_beams": 2}
    out, cache = kvcake.generate(tiny_llama, ids, "cake", attention_mask=mask, **beams)
    assert cache.method.scorer.row_indicators == "avg5/avg5/max7/max7"
    for i, seq in enumerate((a, b)):
        alone = kvcake.generate(tiny_llama, seq[None], "cake", **beams)[0]
        assert torch.equal(out[i, -RUN["max_new_tokens"] :], alone[0, -RUN["max_new_tokens"] :])
    cache = _batch(tiny_llama)  # rows swapped and one repeated: the indicators go with them
    cache.reorder_cache(torch.tensor([1, 0, 1]))
    assert cache.method.scorer.row_indicators == "max7/avg5/max7"


@pytest.mark.skipif(
    not KWARGS_HANDOFF, reason="a compiled step needs the kwargs hand-off (transformers 5.24)"
)
def test_each_prompts_indicator_in_a_compiled_step(tiny_llama, calibrated):
    """Decoding pools each row with its own indicator inside one compiled graph (the rows are fixed
    for the graph), and the compiled logits equal the eager ones."""
    calibrated(TauPoint(30, 0.3, 3.0, "max7"), TauPoint(60, 3.0, 0.3))
    ids, mask = left_padded(*_prompts())
    graphs, compiled, eager = compiled_and_eager_decoding(
        tiny_llama, "cake", ids, mask, 6, ratio=0.3, window=8
    )
    assert graphs <= 2
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_row_indicators_are_checked():
    from kvcake.scorers.cake import CakeScorer

    assert CakeScorer(row_indicators="avg5/max7").rows == (("avg", 5), ("max", 7))
    with pytest.raises(ValueError, match="one per batch row"):
        CakeScorer(row_indicators="avg5/mean3")
    with pytest.raises(ValueError, match="positive odd int"):
        CakeScorer(row_indicators="max4")
