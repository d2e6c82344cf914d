"""Which CAKE temperatures a cache uses: user > local calibration > shipped > family > fallback."""

from __future__ import annotations

import hashlib
import json
import logging
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvcake
from kvcake import temperatures
from kvcake.adapters import with_cache
from kvcake.allocators import preference
from kvcake.allocators.cake import FALLBACK_TAU, default_tau, tau_family
from kvcake.fingerprints import kv_fingerprint
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


def test_tau_source_label_of_a_scenario_follows_that_scenarios_set_alone():
    """An eval cell is keyed by the label of its scenario's set: a calibration that changes only
    the context-only set reruns the context-only cells, not the question-aware ones."""
    fp = CAL.fingerprint
    q = (TauPoint(50.0, 2.0, 0.5),)
    save_calibration(Calibration(fp, {"question": q, "context": (TauPoint(50.0, 1.0, 3.0),)}, "m"))
    before = {
        s: temperatures.tau_source_label(fp, "llama", None, None, scenario=s)
        for s in (None, *temperatures.SCENARIOS)
    }
    save_calibration(Calibration(fp, {"question": q, "context": (TauPoint(50.0, 50.0, 50.0),)}, "m"))
    after = {
        s: temperatures.tau_source_label(fp, "llama", None, None, scenario=s)
        for s in (None, *temperatures.SCENARIOS)
    }
    assert after["question"] == before["question"] and len(set(before.values())) == 3
    assert after["context"] != before["context"] and after[None] != before[None]
    with pytest.raises(ValueError, match="scenario"):
        temperatures.tau_source_label(fp, "llama", None, None, scenario="both")


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
        scenarios = ("question",) if cal.shared else temperatures.SCENARIOS  # a shared set serves both
        kept = [p for s in scenarios for p in cal.set(s)]
        assert path.stem == cal.fingerprint and all(len(cal.set(s)) >= 2 for s in scenarios)
        for s in scenarios:
            assert [p.budget for p in cal.set(s)] == sorted({p.budget for p in cal.set(s)})
        metas = [m for s in scenarios for m in cal.meta["points"] if m.get("scenario", s) == s]
        # made by the search: each point is the grid's best or a flatter allocation within
        # one standard error of it (kvcake.calibration.search.choose), recorded in its metadata
        for point, meta in zip(kept, metas, strict=True):
            assert (point.tau1, point.tau2) == (meta["tau1"], meta["tau2"])
            assert meta["loss"] <= meta["grid_best_loss"] + meta["standard_error"] + 1e-9
            assert meta["unevenness"] <= meta["grid_best_unevenness"]
            grid = {(a, b): x for a, b, x in meta["grid"]}
            assert grid[(point.tau1, point.tau2)] == pytest.approx(meta["loss"], abs=1e-6)


def test_the_default_model_uses_its_shipped_calibration(default_model, monkeypatch, caplog):
    model, tokenizer = default_model
    monkeypatch.setattr(temperatures, "SHIPPED_DIR", REAL_SHIPPED)
    cal, source = find_calibration(model_fingerprint(model))
    assert source == "shipped" and cal.meta["kv_fingerprint"] == kv_fingerprint(model)
    caplog.set_level(logging.WARNING)
    ids = tokenizer("The quick brown fox. " * 120, return_tensors="pt").input_ids
    cache = kvcake.compress(model, ids, "cake", ratio=0.25).cache  # a document: the context-only set
    assert cache.tau.source == "shipped" and cache._tau == pytest.approx(
        cal.at(0.25 * ids.shape[1], "context"), rel=0.01
    )
    assert not cal.shared and cache.tau.set_used == "context"
    assert not [r for r in caplog.records if "kvcake calibrate" in r.getMessage()]


# -- one set per scenario (issue 24) ---------------------------------------------------------------

QUESTION_SET = (TauPoint(10, 0.3, 2.5), TauPoint(40, 0.5, 1.5))
CONTEXT_SET = (TauPoint(10, 3.0, 6.0), TauPoint(40, 2.5, 5.0))


def _per_scenario(model) -> Calibration:
    cal = Calibration(model_fingerprint(model), {"question": QUESTION_SET, "context": CONTEXT_SET}, "tiny")
    save_calibration(cal)
    return cal


def _applied(cache, cal: Calibration, scenario: str) -> bool:
    """The cache's temperatures and preferences are ``scenario``'s set at its budget."""
    taus = cal.at(float(cache.seq.per_layer.double().mean()), scenario)
    want = [preference(h, v, *taus) for h, v in zip(cache.entropy, cache.variance, strict=True)]
    return cache._tau == pytest.approx(taus) and all(
        torch.equal(a, b) for a, b in zip(cache.preferences, want, strict=True)
    )


def test_each_entry_point_picks_its_scenarios_set(tiny_llama):
    cal = _per_scenario(tiny_llama)
    assert cal.at(20, "question") != cal.at(20, "context")
    ctx = kvcake.compress(tiny_llama, _ids(), "cake", budget=20, window=4)
    assert _applied(ctx.cache, cal, "context") and ctx.cache.tau.set_used == "context"
    assert "context-only, context set: kvcake.compress" in ctx.cache.tau.describe()
    _, cache = kvcake.generate(tiny_llama, _ids(), "cake", budget=20, window=4, max_new_tokens=1)
    assert (
        _applied(cache, cal, "question")
        and "question-aware, question set: kvcake.generate" in cache.tau.describe()
    )
    own = kvcake.KVCakeCache(tiny_llama, "cake", budget=20, window=4)  # what model.generate is given
    with kvcake.enable(tiny_llama), torch.no_grad():
        tiny_llama.generate(
            _ids(), **kvcake.adapters.with_cache(tiny_llama, own), max_new_tokens=1, do_sample=False
        )
    assert _applied(own, cal, "question") and "KVCakeCache for model.generate" in own.tau.describe()


def test_an_explicit_scenario_overrides_the_entry_point(tiny_llama):
    cal = _per_scenario(tiny_llama)
    ctx = kvcake.compress(tiny_llama, _ids(), "cake", budget=20, window=4, scenario="question")
    assert _applied(ctx.cache, cal, "question") and "scenario='question' given" in ctx.cache.tau.describe()
    _, cache = kvcake.generate(
        tiny_llama, _ids(), "cake", budget=20, window=4, max_new_tokens=1, scenario="context"
    )
    assert _applied(cache, cal, "context")
    own = kvcake.KVCakeCache(tiny_llama, "cake", budget=20, window=4, scenario="context")
    with kvcake.enable(tiny_llama), torch.no_grad():
        tiny_llama(_ids(), **kvcake.adapters.with_cache(tiny_llama, own))
    assert _applied(own, cal, "context")
    # the eval's replays say their scenario too (kvcake.eval.cells, tau_sweep)
    from transformers import DynamicCache

    from kvcake.replay import Captured, capture_queries, replay_compress

    captured, full = Captured(), DynamicCache()
    with capture_queries(tiny_llama, captured), torch.no_grad():
        logits = tiny_llama(_ids(), **kvcake.adapters.with_cache(tiny_llama, full)).logits[:, -1]
    method = kvcake.make_method("cake", budget=20, window=4)
    for scenario in ("question", "context"):
        replayed = replay_compress(tiny_llama, method, captured, full, _ids(), logits, scenario=scenario)
        assert _applied(replayed.cache, cal, scenario)
    # user temperatures still win over either set
    user = kvcake.compress(tiny_llama, _ids(), "cake,layers.tau1=0.9,layers.tau2=1.1", budget=20, window=4)
    assert user.cache.tau == temperatures.TauChoice(0.9, 1.1, "user")


@pytest.mark.parametrize("bad", ["document", "Question", "", 1, True])
def test_bad_scenarios_are_refused(tiny_llama, bad):
    with pytest.raises(ValueError, match="scenario must be 'question'.*or 'context'"):
        kvcake.KVCakeCache(tiny_llama, "cake", budget=20, scenario=bad)
    with pytest.raises(ValueError, match="scenario must be"):
        kvcake.compress(tiny_llama, _ids(), "cake", budget=20, window=4, scenario=bad)
    with pytest.raises(ValueError, match="scenario must be"):
        kvcake.generate(tiny_llama, _ids(), "cake", budget=20, window=4, scenario=bad)
    with pytest.raises(ValueError, match="scenario must be"):
        CAL.at(100, bad)
    with pytest.raises(ValueError, match="scenario must be"):
        resolve_tau(CAL.fingerprint, "llama", 100, scenario=bad)


def test_per_scenario_files_round_trip_and_must_hold_both_sets():
    cal = Calibration("a" * 16, {"question": QUESTION_SET, "context": CONTEXT_SET}, "m", {"note": 1})
    text = cal.to_json()
    assert '"scenarios"' in text and Calibration.from_json(text) == cal and not cal.shared
    assert "question: 0.3/2.5 at 10" in cal.describe_sets() and "context: 3/6 at 10" in cal.describe_sets()
    with pytest.raises(ValueError, match="kvcake calibrate"):
        Calibration.from_json(text.replace('"context"', '"document"'))
    with pytest.raises(ValueError, match="exactly"):
        Calibration("a" * 16, {"question": QUESTION_SET})


def test_old_single_set_files_serve_both_scenarios(tiny_llama):
    """A file from before the split ("points" only) loads; its set serves both scenarios, and the
    cache says so; it writes back in its own format and keeps its eval label."""
    fp = model_fingerprint(tiny_llama)
    old = json.dumps({"fingerprint": fp, "model": "m", "points": [{"budget": 10, "tau1": 0.3, "tau2": 2.5}]})
    cal = Calibration.from_json(old)
    assert cal.shared and cal.set("question") == cal.set("context") == (TauPoint(10, 0.3, 2.5),)
    assert '"scenarios"' not in cal.to_json() and Calibration.from_json(cal.to_json()) == cal
    save_calibration(cal)
    digest = hashlib.sha256(json.dumps([{"budget": 10.0, "tau1": 0.3, "tau2": 2.5}]).encode()).hexdigest()[:8]
    assert temperatures.tau_source_label(fp, "llama", None, None) == f"calibrated:{digest}"
    for scenario in ("question", "context"):
        ctx = kvcake.compress(tiny_llama, _ids(), "cake", budget=20, window=4, scenario=scenario)
        assert ctx.cache._tau == pytest.approx((0.3, 2.5)) and ctx.cache.tau.set_used == "shared"
        assert "one set for both scenarios" in ctx.cache.tau.describe()
    shipped = [Calibration.from_json(p.read_text()) for p in REAL_SHIPPED.glob("*.json")]
    assert all(c.set("question") and c.set("context") for c in shipped)


def test_the_warning_comes_once_per_model_whatever_the_scenario(tiny_llama, caplog):
    caplog.set_level(logging.WARNING, logger="kvcake.temperatures")
    kvcake.compress(tiny_llama, _ids(), "cake", budget=20, window=4)
    _, cache = kvcake.generate(tiny_llama, _ids(), "cake", budget=20, window=4, max_new_tokens=1)
    kvcake.compress(tiny_llama, _ids(), "cake", budget=20, window=4, scenario="question")
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvcake.temperatures"]
    assert len(warnings) == 1 and "Run `kvcake calibrate --model" in warnings[0]
    assert cache.tau.source == "family" and "question-aware: kvcake.generate" in cache.tau.describe()


def test_methods_explains_the_scenarios(monkeypatch):
    text = temperatures.describe_resolution()
    assert "'question'" in text and "'context'" in text and "--scenario" in text


def _scores_with(model, spec: str) -> tuple:
    """The cache and each compressed layer's kept positions after compressing the same prompt."""
    ctx = kvcake.compress(model, _ids(), spec, budget=20, window=4)
    return ctx.cache, [ctx.cache.layers[i].positions for i in ctx.cache.compressed]


@pytest.mark.parametrize("spec", ["cake", "cake-adakv"])
def test_a_calibrated_indicator_is_used_with_its_temperatures(tiny_llama, spec):
    """A calibration point that chose max7 makes a CAKE cache score with max pooling, kernel 7,
    exactly as if the spec said so; an explicit pooling, ``score.indicator_from=paper``, the
    family temperatures (``layers.tau_from=family``) and a point without one keep the paper's."""
    fp = model_fingerprint(tiny_llama)
    taus = "layers.tau1=0.7,layers.tau2=1.3"
    save_calibration(Calibration(fp, (TauPoint(20, 0.7, 1.3, "max7"),)))
    cache, got = _scores_with(tiny_llama, spec)
    assert (cache.method.scorer.pooling, cache.method.scorer.kernel) == ("max", 7)
    assert cache.tau.indicator == "max7" and "indicator max7" in cache.tau.describe()
    _, want = _scores_with(tiny_llama, f"{spec},{taus},score.pooling=max,score.kernel=7")
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    _, paper = _scores_with(tiny_llama, f"{spec},{taus}")  # user temperatures: no calibration read
    assert not all(torch.equal(a, b) for a, b in zip(got, paper, strict=True))
    for kept in (f"{spec},score.indicator_from=paper", f"{spec},score.pooling=avg,score.kernel=3",
                 f"{spec},layers.tau_from=family"):  # fmt: skip
        cache, _ = _scores_with(tiny_llama, kept)
        assert (cache.method.scorer.pooling, cache.method.scorer.kernel) != ("max", 7), kept
    save_calibration(Calibration(fp, (TauPoint(20, 0.7, 1.3),)))
    cache, same = _scores_with(tiny_llama, spec)
    assert cache.tau.indicator is None and all(torch.equal(a, b) for a, b in zip(same, paper, strict=True))


def test_indicators_round_trip_and_are_checked():
    cal = Calibration("f" * 16, (TauPoint(50.0, 2.0, 0.5, "max7"), TauPoint(200.0, 0.5, 3.0)), "m")
    back = Calibration.from_json(cal.to_json())
    assert [p.indicator for p in back.points] == ["max7", None]
    assert back.indicator_at(60) == "max7"  # the nearest point in log budget
    assert back.indicator_at(150) is None
    assert back.describe_sets() == "one set for both scenarios: 2/0.5 max7 at 50, 0.5/3 at 200"
    for bad in ("max6", "sum5", "avg"):
        with pytest.raises(ValueError, match="indicator"):
            TauPoint(50.0, 2.0, 0.5, bad)
    with pytest.raises(ValueError, match="indicator_from"):
        kvcake.make_method("cake,score.indicator_from=calibrated", budget=40, window=4)


@pytest.mark.parametrize(
    ("vocab", "theta", "family", "tau"),
    [
        (32000, 10000.0, "llama2", (0.9, 2.3)),
        (128256, 500000.0, "llama", (1.6, 0.6)),
        (128, 10000.0, "llama", (1.6, 0.6)),
    ],
)
def test_llama_2_takes_its_own_family_default(vocab, theta, family, tau):
    """Llama 2 and Llama 3 both say model_type "llama": the config's vocabulary and RoPE base tell
    them apart, so an uncalibrated Llama 2 gets the paper's Llama-2 temperatures, not Llama 3.1's."""
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": theta},
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    assert tau_family(model) == family
    assert (
        temperatures.method_tau_label(model, kvcake.make_method("cake", budget=24, window=4))
        == f"family:{family}"
    )
    cache = kvcake.KVCakeCache(model, "cake", budget=24, window=4)
    with kvcake.enable(model), torch.no_grad():
        model(_ids(), **with_cache(model, cache))
    assert (cache.tau.tau1, cache.tau.tau2, cache.tau.source) == (*tau, "family")


def test_a_special_token_id_set_before_compressing_keeps_the_calibration(make_tiny_llama):
    """``model.config.pad_token_id = tokenizer.eos_token_id`` changes the model's fingerprint, under
    which its calibration is filed, and CAKE fell back to the family's temperatures with a warning
    to calibrate; a calibration keeps the fingerprint of the keys' and values' fields too."""
    model = make_tiny_llama()
    cal = Calibration(model_fingerprint(model), {"question": QUESTION_SET, "context": CONTEXT_SET}, "tiny",
                      {"kv_fingerprint": kv_fingerprint(model)})  # fmt: skip
    save_calibration(cal)
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    assert (
        model_fingerprint(model) != cal.fingerprint and temperatures.calibration_key(model) == cal.fingerprint
    )
    cache = kvcake.compress(model, _ids(), "cake", budget=24, window=8).cache
    assert cache.tau.source == "calibrated" and _applied(cache, cal, "context")
    model.config.rms_norm_eps *= 2  # a field the keys depend on: another model
    assert temperatures.calibration_key(model) == model_fingerprint(model) != cal.fingerprint
