"""The parts' numeric options refuse what is not a number of their kind when the part is built
directly (``Pyramid(beta=True)``), as the method string already did (``layers.beta=true``): a
bool is not an int (``True`` would read as 1), text is not a number, and the error names the
option and the fix."""

from __future__ import annotations

import math

import pytest

from kvcake.allocators.adakv import AdaKV
from kvcake.allocators.cake import CakeAllocator
from kvcake.allocators.pyramid import Pyramid
from kvcake.budget import check_int, check_real
from kvcake.scorers.cake import CakeScorer
from kvcake.scorers.defensive import DefensiveScorer
from kvcake.scorers.h2o import H2OScorer
from kvcake.scorers.snapkv import SnapKVScorer
from kvcake.scorers.streaming import StreamingScorer
from kvcake.selectors.critical import Critical

INTS = [
    (Pyramid, "beta", "pyramid beta", "layers.beta=20"),
    (StreamingScorer, "n_sink", "StreamingLLM n_sink", "score.n_sink=4"),
    (H2OScorer, "chunk", "H2O chunk", "score.chunk=512"),
    (SnapKVScorer, "kernel", "pooling kernel", "score.kernel=7"),
    (CakeScorer, "kernel", "pooling kernel", "score.kernel=7"),
    (DefensiveScorer, "kernel", "defensive pooling kernel", "score.kernel=5"),
]
REALS = [
    (AdaKV, "alpha", "Ada-KV safeguard alpha", "heads.alpha=0.2"),
    (Critical, "alpha", "CriticalKV first-stage ratio alpha", "select.alpha=0.5"),
    (Critical, "eps", "CriticalKV eps", "select.eps=0.0001"),
    (CakeScorer, "gamma", "CAKE gamma", "score.gamma=200"),
    (DefensiveScorer, "critical_mass", "defensive critical_mass", "score.critical_mass=0.9"),
    (CakeAllocator, "tau1", "CAKE tau1", "layers.tau1=1.0"),
    (CakeAllocator, "tau2", "CAKE tau2", "layers.tau2=1.0"),
]


@pytest.mark.parametrize("cls,field,what,fix", INTS, ids=lambda x: getattr(x, "__name__", x))
def test_int_options_refuse_bools_floats_and_text(cls, field, what, fix):
    for bad in (True, False, 3.0, "5", None):
        with pytest.raises(TypeError, match=f"{what} must be an int, got {bad!r}.*pass e.g. {fix}"):
            cls(**{field: bad})
    cls(**{field: 5})  # a valid value still builds


@pytest.mark.parametrize("cls,field,what,fix", REALS, ids=lambda x: getattr(x, "__name__", x))
def test_real_options_refuse_bools_text_and_non_finite(cls, field, what, fix):
    for bad in (True, "0.2", None if field not in ("tau1", "tau2") else [1.0]):
        with pytest.raises(TypeError, match=f"{what} must be a number, got .*pass e.g. {fix}"):
            cls(**{field: bad})
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError, match=f"{what} must be .*, got {bad}: pass e.g. {fix}"):
            cls(**{field: bad})
    cls(**{field: 0.5})


def test_the_checks_bounds():
    check_int("n", 0, 0, "n=1")
    with pytest.raises(ValueError, match=r"n must be an int >= 1, got 0: pass e.g. n=1"):
        check_int("n", 0, 1, "n=1")
    check_real("x", 1, "x=1", high=1.0)  # an int is a number; the bounds are inclusive
    with pytest.raises(ValueError, match=r"x must be in \[0, 1\], got 1.5"):
        check_real("x", 1.5, "x=1", high=1.0)
    with pytest.raises(ValueError, match="x must be a finite number > 0, got 0"):
        check_real("x", 0, "x=1", above=True)
