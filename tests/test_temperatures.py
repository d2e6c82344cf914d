"""Which CAKE temperatures a cache uses: user > local calibration > shipped > family > fallback."""

from __future__ import annotations

import logging
import math

import pytest
import torch

import kvcake
from kvcake import temperatures
from kvcake.allocators import preference
from kvcake.allocators.cake import FALLBACK_TAU, default_tau
from kvcake.models import model_fingerprint
from kvcake.temperatures import Calibration, TauPoint, find_calibration, resolve_tau, save_calibration


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No real calibrations, an empty shipped folder, and a fresh warn-once memory."""
    monkeypatch.setenv("KVCAKE_CACHE_DIR", str(tmp_path / "models"))
    monkeypatch.setattr(temperatures, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setattr(temperatures, "_warned", set())


def _ids(n: int = 64) -> torch.Tensor:
    return torch.randint(3, 120, (1, n), generator=torch.Generator().manual_seed(1))


CAL = Calibration("f" * 16, (TauPoint(200.0, 0.5, 3.0), TauPoint(50.0, 2.0, 0.5)), "m")


def test_interpolation_is_log_log_and_clamped():
    assert CAL.points[0].budget == 50.0  # sorted
    assert CAL.at(50) == (2.0, 0.5) and CAL.at(200) == (0.5, 3.0)
    assert CAL.at(10) == (2.0, 0.5) and CAL.at(10_000) == (0.5, 3.0)
    t1, t2 = CAL.at(100)  # the log-midpoint of 50 and 200: the geometric means
    assert math.isclose(t1, 1.0) and math.isclose(t2, math.sqrt(1.5))
    a, _ = CAL.at(70)
    b, _ = CAL.at(140)
    assert 2.0 > a > b > 0.5  # monotone between the points


def test_json_round_trip_and_bad_files():
    assert Calibration.from_json(CAL.to_json()) == CAL
    for text in ("{", '{"fingerprint": "x", "points": []}', '{"fingerprint": "x", "points": [{"budget": -1, '
                 '"tau1": 1, "tau2": 1}]}'):  # fmt: skip
        with pytest.raises(ValueError, match="kvcake calibrate"):
            Calibration.from_json(text)
    with pytest.raises(ValueError, match="tau1 must be a positive"):
        TauPoint(10, 0, 1)


def test_resolution_order(tmp_path, caplog):
    fp = CAL.fingerprint
    assert resolve_tau(fp, "llama", 128).source == "family"
    assert resolve_tau(fp, "madeup", 128) == temperatures.TauChoice(*FALLBACK_TAU, "fallback")
    save_calibration(CAL, temperatures.SHIPPED_DIR)
    assert resolve_tau(fp, "llama", 100).source == "shipped"
    local = Calibration(fp, (TauPoint(100, 0.7, 0.9),))
    save_calibration(local)
    assert resolve_tau(fp, "llama", 100) == temperatures.TauChoice(0.7, 0.9, "calibrated")
    assert resolve_tau(fp, "llama", 100, 1.5, 2.5) == temperatures.TauChoice(1.5, 2.5, "user")
    assert resolve_tau(fp, "llama", 100, tau1=1.5) == temperatures.TauChoice(1.5, 0.9, "user+calibrated")


def test_a_calibration_for_another_model_is_refused():
    save_calibration(CAL)
    temperatures.calibration_path(CAL.fingerprint).rename(temperatures.calibration_path("0" * 16))
    with pytest.raises(ValueError, match="delete it"):
        find_calibration("0" * 16)


def test_uncalibrated_model_warns_once_naming_the_command(tiny_llama, caplog):
    caplog.set_level(logging.WARNING, logger="kvcake.temperatures")
    for _ in range(2):
        ctx = kvcake.compress(tiny_llama, _ids(), "cake", budget=20, window=4)
    warnings = [r for r in caplog.records if r.name == "kvcake.temperatures"]
    assert len(warnings) == 1 and "kvcake calibrate" in warnings[0].getMessage()
    assert ctx.cache.tau.source == "family" and ctx.cache._tau == default_tau("llama", 20)
    caplog.clear()
    assert resolve_tau("e" * 16, "madeup", 20).source == "fallback"
    assert len([r for r in caplog.records if "kvcake calibrate --model MODEL" in r.getMessage()]) == 1


def test_uncalibrated_warning_names_the_model(tiny_llama, tmp_path, caplog):
    """The command in the warning loads this very model: its folder, or a built-in's name."""
    caplog.set_level(logging.WARNING, logger="kvcake.temperatures")
    tiny_llama.save_pretrained(tmp_path / "my model")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "my model")
    kvcake.compress(model, _ids(), "cake", budget=20, window=4)
    assert f"kvcake calibrate --model '{tmp_path / 'my model'}'" in caplog.text
    model.name_or_path = str(tmp_path / "smollm2-135m-instruct@transformers-5.0.0")
    assert kvcake.models.model_name(model) == "smollm2-135m-instruct"


@pytest.mark.parametrize("spec", ["cake", "cake-oneshot", "cake-adakv", "layers=cake,score=snapkv"])
def test_stored_calibration_is_found_and_applied(tiny_llama, spec, caplog):
    fp = model_fingerprint(tiny_llama)
    cal = Calibration(fp, (TauPoint(10, 0.3, 2.5), TauPoint(40, 1.7, 0.45)))
    save_calibration(cal)
    caplog.set_level(logging.WARNING)
    ctx = kvcake.compress(tiny_llama, _ids(), spec, budget=20, window=4)
    cache = ctx.cache
    assert cache.tau.source == "calibrated" and cache._tau == pytest.approx(cal.at(20))
    want = [preference(h, v, *cal.at(20)) for h, v in zip(cache.entropy, cache.variance, strict=True)]
    assert all(torch.equal(a, b) for a, b in zip(cache.preferences, want, strict=True))
    assert not [r for r in caplog.records if "kvcake calibrate" in r.getMessage()]
    user = kvcake.compress(tiny_llama, _ids(), f"{spec},layers.tau1=0.9,layers.tau2=1.1", budget=20, window=4)
    assert user.cache.tau == temperatures.TauChoice(0.9, 1.1, "user")


def test_non_cake_methods_resolve_nothing(tiny_llama):
    assert kvcake.compress(tiny_llama, _ids(), "snapkv", budget=20, window=4).cache.tau is None


def test_tau_source_label_changes_with_the_calibration():
    fp = CAL.fingerprint
    before = temperatures.tau_source_label(fp, "llama", None, None)
    save_calibration(CAL)
    after = temperatures.tau_source_label(fp, "llama", None, None)
    assert before == "family:llama" and after.startswith("calibrated:") and after != before
    assert temperatures.tau_source_label(fp, "llama", 1.0, 3.0) == "user:1/3"


REAL_SHIPPED = temperatures.SHIPPED_DIR  # before the fixture points it elsewhere


def test_every_shipped_calibration_is_valid_and_named_by_its_fingerprint():
    files = sorted(REAL_SHIPPED.glob("*.json"))
    assert files, "the default model's calibration must ship with the package"
    for path in files:
        cal = Calibration.from_json(path.read_text(), str(path))
        assert path.stem == cal.fingerprint and len(cal.points) >= 2
        assert [p.budget for p in cal.points] == sorted({p.budget for p in cal.points})
        # made by the current search: each point is the grid's best or a flatter allocation within
        # one standard error of it (kvcake.calibration.search.choose), recorded in its metadata
        for point, meta in zip(cal.points, cal.meta["points"], strict=True):
            assert (point.tau1, point.tau2) == (meta["tau1"], meta["tau2"])
            assert meta["loss"] <= meta["grid_best_loss"] + meta["standard_error"] + 1e-9
            assert meta["unevenness"] <= meta["grid_best_unevenness"]
            grid = {(a, b): x for a, b, x in meta["grid"]}
            assert grid[(point.tau1, point.tau2)] == pytest.approx(meta["loss"], abs=1e-6)


def test_the_default_model_uses_its_shipped_calibration(default_model, monkeypatch, caplog):
    model, tokenizer = default_model
    monkeypatch.setattr(temperatures, "SHIPPED_DIR", REAL_SHIPPED)
    cal, source = find_calibration(model_fingerprint(model))
    assert source == "shipped"
    caplog.set_level(logging.WARNING)
    ids = tokenizer("The quick brown fox. " * 120, return_tensors="pt").input_ids
    cache = kvcake.compress(model, ids, "cake", ratio=0.25).cache
    assert cache.tau.source == "shipped" and cache._tau == pytest.approx(
        cal.at(0.25 * ids.shape[1]), rel=0.01
    )
    assert not [r for r in caplog.records if "kvcake calibrate" in r.getMessage()]
