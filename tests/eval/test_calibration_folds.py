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


def _fold(seed: int) -> dict:
    """Four continued passages (KL 0.1 under uniform budgets) and four documents asked about (KL
    1.0). Candidate 1/1 halves the passages' KL and costs the documents 5%; 2/2 cuts the
    documents' by 10% and leaves the passages alone; 2/2 is the more uneven."""
    parts = ["text"] * 4 + ["asked-after"] * 4
    kl = {
        "50.0/50.0": [0.1] * 4 + [1.0] * 4,
        "1.0/1.0": [0.05] * 4 + [1.05] * 4,
        "2.0/2.0": [0.1] * 4 + [0.9] * 4,
    }
    ratio = {
        "uniform": {"text": 0.1, "asked-after": 1.0},
        "kl": kl,
        "unevenness": {"50.0/50.0": 0.0, "1.0/1.0": 0.1, "2.0/2.0": 0.2},
        "snapkv": [0.1] * 4 + [0.95] * 4,
    }
    return {
        "scenario": "context",
        "seed": seed,
        "parts": parts,
        "ratios": {str(r): ratio for r in (0.1, 0.25, 0.5)},
    }


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
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 0.")]
    assert len(rows) == 3 * 2 * 2  # ratios x (train on either fold) x objectives
    nats = [r for r in rows if "| nats |" in r][0].split("|")
    # kept 2/2 on one fold, measured on the other: (4 x 0.1 + 4 x 0.9) / 8, SnapKV (0.4 + 3.8) / 8
    assert nats[4].strip() == "2.0/2.0" and float(nats[5]) == pytest.approx(0.5, abs=1e-4)
    assert float(nats[7]) == pytest.approx(0.55, abs=1e-4) and float(nats[8]) == pytest.approx(
        0.525, abs=1e-4
    )
    assert nats[9].strip() == "8/8"
