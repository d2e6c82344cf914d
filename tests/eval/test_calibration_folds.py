"""``scripts/calibration_folds.py``: the two objectives it compares pick what their definitions say."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "calibration_folds.py"


@pytest.fixture(scope="module")
def folds():
    spec = importlib.util.spec_from_file_location("calibration_folds", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fold(seed: int, indicator: str | None = None, factors=(1.0,) * 8) -> dict:
    """Four continued passages (KL 0.1 under uniform budgets) and four documents asked about (KL
    1.0). Candidate 1/1 halves the passages' KL and costs the documents 5%; 2/2 cuts the
    documents' by 10% and leaves the passages alone; 2/2 is the more uneven. ``indicator`` names
    the fold's CAKE indicator (``None``: a file from before the option, the paper's); each
    sample's KL is multiplied by its ``factors`` (uniform budgets' stay: the paper's scale)."""
    parts = ["text"] * 4 + ["asked-after"] * 4
    kl = {
        "50.0/50.0": [0.1] * 4 + [1.0] * 4,
        "1.0/1.0": [0.05] * 4 + [1.05] * 4,
        "2.0/2.0": [0.1] * 4 + [0.9] * 4,
    }
    kl = {t: [x * f for x, f in zip(v, factors, strict=True)] for t, v in kl.items()}
    ratio = {
        "uniform": {"text": 0.1, "asked-after": 1.0},
        "kl": kl,
        "unevenness": {"50.0/50.0": 0.0, "1.0/1.0": 0.1, "2.0/2.0": 0.2},
        "snapkv": [0.1] * 4 + [0.95] * 4,
    }
    return {
        "scenario": "context",
        "seed": seed,
        **({"indicator": indicator} if indicator else {}),
        "parts": parts,
        "ratios": {str(r): ratio for r in (0.1, 0.25, 0.5)},
    }


def _tables(out: str) -> tuple[list[str], list[str]]:
    """The lines of ``compare``'s two tables: one row per split, then the splits averaged."""
    per_split, averaged = out.split("Averaged over the splits")
    return per_split.splitlines(), averaged.splitlines()


def test_each_objective_keeps_the_point_its_definition_favours(folds):
    train = folds._merge([_fold(1000)], "0.25")
    # each half over its own uniform KL, the halves averaged: 1/1's 50% on the passages wins
    assert folds.pick(train, "parts") == "1.0/1.0"
    # the mean KL itself: the documents' 10% outweighs the passages' 0.05 nats
    assert folds.pick(train, "nats") == "2.0/2.0"


def test_compare_measures_the_kept_point_on_the_other_folds(folds, tmp_path, capsys, monkeypatch):
    paths = []
    for seed in (1000, 2000):
        paths.append(tmp_path / f"context-{seed}.json")
        paths[-1].write_text(json.dumps(_fold(seed)))
    monkeypatch.setattr("sys.argv", ["calibration_folds.py", "compare", *map(str, paths)])
    folds.main()
    rows = [line for line in _tables(capsys.readouterr().out)[0] if line.startswith("| 0.")]
    assert len(rows) == 3 * 2 * 2  # ratios x (train on either fold) x objectives
    nats = [r for r in rows if "| nats |" in r][0].split("|")
    # kept 2/2 on one fold, measured on the other: (4 x 0.1 + 4 x 0.9) / 8, SnapKV (0.4 + 3.8) / 8
    assert nats[4].strip() == "avg5" and nats[5].strip() == "avg5 2.0/2.0"
    assert float(nats[6]) == pytest.approx(0.5, abs=1e-4)
    assert float(nats[8]) == pytest.approx(0.55, abs=1e-4) and float(nats[9]) == pytest.approx(
        0.525, abs=1e-4
    )
    assert nats[10].strip() == "8/8"


def test_another_indicator_is_kept_only_when_better_beyond_one_standard_error(folds):
    merge = folds._merge
    paper = merge([_fold(1000)], "0.25")
    # max7 halves every sample's KL: better by far more than the noise
    halved = merge([_fold(1000, "max7", (0.5,) * 8)], "0.25")
    assert folds.pick_indicator({"avg5": paper, "max7": halved}, "nats") == ("max7", "2.0/2.0")
    # max7 1% lower on average but up or down by 20% per document: within one standard error,
    # so the paper's indicator stays
    noisy = merge([_fold(1000, "max7", (1.0,) * 4 + (0.8, 1.18, 0.8, 1.18))], "0.25")
    assert folds.pick_indicator({"avg5": paper, "max7": noisy}, "nats")[0] == "avg5"


def test_compare_adds_the_indicator_choice_when_every_seed_has_the_other_indicator(
    folds, tmp_path, capsys, monkeypatch
):
    paths = []
    for seed in (1000, 2000):
        for ind, factors in ((None, (1.0,) * 8), ("max7", (0.5,) * 8)):
            paths.append(tmp_path / f"context-{seed}{'-' + ind if ind else ''}.json")
            paths[-1].write_text(json.dumps(_fold(seed, ind, factors)))
    monkeypatch.setattr("sys.argv", ["calibration_folds.py", "compare", *map(str, paths)])
    folds.main()
    rows = [line.split("|") for line in _tables(capsys.readouterr().out)[0] if line.startswith("| 0.")]
    assert len(rows) == 3 * 2 * 2 * 2  # ratios x train folds x objectives x (paper's alone, both)
    both = [r for r in rows if r[4].strip() == "avg5+max7" and r[3].strip() == "nats"][0]
    # max7 kept, measured on the other fold's max7 record: half the paper's 0.5; SnapKV unchanged
    assert both[5].strip() == "max7 2.0/2.0" and float(both[6]) == pytest.approx(0.25, abs=1e-4)
    assert float(both[9]) == pytest.approx(0.525, abs=1e-4)
    # a seed without the paper's fold is refused
    monkeypatch.setattr("sys.argv", ["calibration_folds.py", "compare", str(paths[1])])
    with pytest.raises(ValueError, match="paper's indicator avg5"):
        folds.main()


def test_compare_prints_the_splits_averaged_over_near_uniform_budgets(folds, tmp_path, capsys, monkeypatch):
    paths = []
    for seed in (1000, 2000, 3000):
        for ind, factors in ((None, (1.0,) * 8), ("max7", (0.5,) * 8 if seed != 3000 else (1.2,) * 8)):
            paths.append(tmp_path / f"context-{seed}{'-' + ind if ind else ''}.json")
            paths[-1].write_text(json.dumps(_fold(seed, ind, factors)))
    monkeypatch.setattr("sys.argv", ["calibration_folds.py", "compare", *map(str, paths)])
    folds.main()
    rows = {tuple(c.strip() for c in r.split("|")[1:5]): [c.strip() for c in r.split("|")[5:9]]
            for r in _tables(capsys.readouterr().out)[1] if r.startswith("| 0.")}  # fmt: skip
    assert len(rows) == 3 * 2 * 2 * 2  # ratios x (one or two train folds) x objectives x indicator sets
    # the paper's indicator alone: 2/2 kept on every split, 0.5 held out over near-uniform's 0.55
    assert rows[("0.25", "1", "nats", "avg5")] == [
        "3",
        f"{0.5 / 0.55:.3f}",
        f"{0.525 / 0.55:.3f}",
        "avg5 3/3",
    ]
    # max7 kept when trained on 1000 or 2000 (half the KL), the paper's on 3000 (max7 20% worse);
    # held out, max7 is measured on the other folds' max7 records: 1000 on 2000+3000, and so on
    both = rows[("0.25", "1", "nats", "avg5+max7")]
    held = [(0.25 + 0.6) / 2 / 0.55, (0.25 + 0.6) / 2 / 0.55, 0.5 / 0.55]
    assert both[0] == "3" and float(both[1]) == pytest.approx(sum(held) / 3, abs=1e-3)
    assert both[3] == "max7 2/3, avg5 1/3"
    # two train folds: the three splits each hold one fold out
    assert rows[("0.25", "2", "nats", "avg5")][0] == "3"


def test_summarise_averages_each_group_of_splits(folds):
    rows = [
        {"key": ("0.1", 1, "nats", "avg5+max7"), "indicator": "max7", "kl": 0.8, "snapkv": 1.0},
        {"key": ("0.1", 1, "nats", "avg5+max7"), "indicator": "avg5", "kl": 1.0, "snapkv": 0.9},
        {"key": ("0.1", 2, "nats", "avg5+max7"), "indicator": "avg5", "kl": 0.7, "snapkv": 0.95},
    ]
    one, two = folds.summarise(rows)
    assert one["splits"] == 2 and one["kl"] == pytest.approx(0.9) and one["snapkv"] == pytest.approx(0.95)
    assert one["kept"] == {"max7": 1, "avg5": 1}
    assert two == {"key": ("0.1", 2, "nats", "avg5+max7"), "splits": 1, "kl": 0.7, "snapkv": 0.95,
                   "kept": {"avg5": 1}}  # fmt: skip


def test_export_writes_the_points_kept_on_all_folds_into_a_copy(folds, tmp_path, capsys, monkeypatch):
    paths = []
    for seed in (0, 16):
        paths.append(tmp_path / f"context-{seed}.json")
        paths[-1].write_text(json.dumps(_fold(seed)))
    base = tmp_path / "base.json"
    question = {"points": [{"budget": 205.0, "tau1": 3.0, "tau2": 1.0}]}
    points = [{"budget": b, "tau1": 50.0, "tau2": 50.0} for b in (205.0, 512.0, 1024.0)]
    base.write_text(
        json.dumps(
            {
                "fingerprint": "base",
                "scenarios": {"context": {"points": points}, "question": question},
                "meta": {},
            }
        )
    )
    out = tmp_path / "cache"
    args = ["calibration_folds.py", "export", *map(str, paths), "--base", str(base), "--out", str(out)]
    monkeypatch.setattr("sys.argv", args)
    folds.main()
    written = json.loads((out / "calibrations" / "base.json").read_text())
    # the mean KL pooled (the shipped objective): 2/2 at every ratio, as compare keeps it on either fold
    assert written["scenarios"]["context"]["points"] == [
        {"budget": b, "tau1": 2.0, "tau2": 2.0} for b in (205.0, 512.0, 1024.0)
    ]
    assert written["scenarios"]["question"] == question  # the other scenario as in the base
    assert written["meta"]["exported"]["objective"] == "nats"
    monkeypatch.setattr("sys.argv", [*args, "--objective", "parts"])
    folds.main()
    written = json.loads((out / "calibrations" / "base.json").read_text())
    assert {(p["tau1"], p["tau2"]) for p in written["scenarios"]["context"]["points"]} == {(1.0, 1.0)}


def test_export_refuses_a_base_at_other_budgets(folds, tmp_path, monkeypatch):
    fold = tmp_path / "context-0.json"
    fold.write_text(json.dumps(_fold(0)))
    base = tmp_path / "base.json"
    points = {"points": [{"budget": 100.0, "tau1": 50.0, "tau2": 50.0}]}
    body = {"fingerprint": "base", "scenarios": {"context": points, "question": points}, "meta": {}}
    base.write_text(json.dumps(body))
    monkeypatch.setattr(
        "sys.argv", ["calibration_folds.py", "export", str(fold), "--base", str(base), "--out", str(tmp_path)]
    )
    with pytest.raises(ValueError, match="entries per layer"):
        folds.main()


def test_several_other_indicators_each_beside_the_papers_and_gamma_not_exported(
    folds, tmp_path, capsys, monkeypatch
):
    """Folds of max7 and of another CAKE gamma (``record --gamma 0``): compare keeps each beside the
    paper's indicator and all three together; export refuses to write a kept gamma, which a
    calibration file cannot hold."""
    paths = []
    for seed in (1000, 2000):
        for ind, factor in ((None, 1.0), ("max7", 0.8), ("avg5-gamma0", 0.5)):
            paths.append(tmp_path / f"context-{seed}{'-' + ind if ind else ''}.json")
            paths[-1].write_text(json.dumps(_fold(seed, ind, (factor,) * 8)))
    monkeypatch.setattr("sys.argv", ["calibration_folds.py", "compare", *map(str, paths)])
    folds.main()
    rows = [line.split("|") for line in _tables(capsys.readouterr().out)[0] if line.startswith("| 0.")]
    sets = {r[4].strip() for r in rows}
    assert sets == {"avg5", "avg5+avg5-gamma0", "avg5+max7", "avg5+avg5-gamma0+max7"}
    kept = {r[4].strip(): r[5].strip() for r in rows if r[3].strip() == "nats"}
    assert kept["avg5+max7"] == "max7 2.0/2.0" and kept["avg5+avg5-gamma0+max7"] == "avg5-gamma0 2.0/2.0"
    monkeypatch.setattr(
        "sys.argv", ["calibration_folds.py", "export", *map(str, paths), "--out", str(tmp_path)]
    )
    with pytest.raises(ValueError, match="holds a pooling and a kernel but not CAKE's gamma"):
        folds.main()
