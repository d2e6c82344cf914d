"""``python -m kvcake.demo`` refuses bad options before loading its model (``make demo`` runs it
on the real model; these need none)."""

from __future__ import annotations

import pytest

import kvcake
from kvcake import demo


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--method", "snapkv", "--scenario", "context"], "--method 'snapkv' has no CAKE layer allocation"),
        (["--method", "snapk"], "did you mean 'snapkv'"),
        (["--budget", "0"], "--budget must be at least 1 entry per layer"),
        (["--rounds", "0"], "--rounds must be at least 1"),
    ],
)
def test_bad_options_fail_before_the_model_loads(argv, words, monkeypatch, capsys):
    monkeypatch.setattr(kvcake, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_:
        demo.main(argv)
    assert exit_.value.code == 2 and words in capsys.readouterr().err
