"""CAKE's temperatures in a batch: each prompt takes those of its own budget (``kvcake.cake_tau``).

A calibration's temperatures change with the budget per layer, and ``ratio=`` gives prompts of
different lengths different budgets. Until 2026-12-07 a batch took the temperatures of its mean
budget, so a prompt's layer budgets depended on the prompts beside it.
"""

from __future__ import annotations

import logging

import pytest

import kvcake
from kvcake import cake_tau, temperatures
from kvcake.models import model_fingerprint
from kvcake.temperatures import Calibration, TauPoint, save_calibration
from shared_checks import assert_batch_matches_each_alone, left_padded, prompt

RUN = {"ratio": 0.3, "window": 8, "max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}


@pytest.fixture
def calibrated(tmp_path, monkeypatch, tiny_llama):
    """Save a calibration for ``tiny_llama`` (one set, steep in the budget) and return a writer of
    others; nothing shipped, fresh warn-once memories."""
    monkeypatch.setenv("KVCAKE_CACHE_DIR", str(tmp_path / "models"))
    monkeypatch.setattr(temperatures, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setattr(temperatures, "_warned", set())
    monkeypatch.setattr(cake_tau, "_warned", set())

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


def test_indicators_that_differ_are_shared_and_said_once(tiny_llama, calibrated, caplog):
    """The scorer is the cache's: the indicator at the batch's mean budget (46.5 entries, nearer
    60 than 30 in log budget: the paper's avg5) for both prompts, said once per model."""
    calibrated(TauPoint(30, 0.3, 3.0, "max7"), TauPoint(60, 3.0, 0.3))
    caplog.set_level(logging.WARNING, logger="kvcake.cake_tau")
    for _ in range(2):
        cache = _batch(tiny_llama)
        assert (cache.method.scorer.pooling, cache.method.scorer.kernel) == ("avg", 5)
        assert cache.seq.tau1.tolist()[0] == pytest.approx(3.0)  # the temperatures stay each prompt's
    said = [r.getMessage() for r in caplog.records if r.name == "kvcake.cake_tau"]
    assert len(said) == 1 and "different indicators" in said[0] and "separate calls" in said[0]
    assert "(33/60 entries per layer: max7/avg5)" in said[0]  # the budgets in ascending order
