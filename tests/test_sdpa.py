"""The SDPA backend policy (``kvcake.sdpa``): what each policy allows, that ``kvcake.enable``
applies it to the block and restores it, and that ``fastest`` picks the fastest usable backend."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

import kvcake
from kvcake import sdpa
from kvcake.sdpa import backends_for, fastest, sdpa_policy

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _flags() -> tuple[bool, bool, bool]:
    b = torch.backends.cuda
    return b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled()


def test_what_each_policy_allows():
    assert backends_for("auto", CUDA) == [
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    assert backends_for("auto", CPU) is None  # SDPA's own choice off CUDA
    assert backends_for("default", CUDA) is None
    assert backends_for("cudnn", CUDA) == [SDPBackend.CUDNN_ATTENTION]  # only when asked: it plans per shape
    with pytest.raises(ValueError, match="unknown SDPA backend policy 'fast'.*auto"):
        backends_for("fast", CUDA)


def test_policy_is_scoped_and_restored():
    before = _flags()
    with sdpa_policy("math", CPU):
        assert _flags() == (False, False, True)
    assert _flags() == before
    with sdpa_policy("auto", CPU):  # nothing forced on the CPU
        assert _flags() == before


def test_enable_applies_the_policy(tiny_llama):
    before = _flags()
    with kvcake.enable(tiny_llama, sdpa="math"):
        assert _flags() == (False, False, True)
    assert _flags() == before
    with kvcake.enable(tiny_llama):  # "auto" on a CPU model: untouched
        assert _flags() == before
    with (
        pytest.raises(ValueError, match="unknown SDPA backend policy"),
        kvcake.enable(tiny_llama, sdpa="nope"),
    ):
        pass
    assert _flags() == before


def test_outputs_do_not_depend_on_the_policy(tiny_llama):
    ids = torch.arange(40)[None] % 100
    with torch.no_grad():
        ref = kvcake.compress(tiny_llama, ids, "snapkv", budget=24, window=8).logits
    with sdpa_policy("math", CPU), torch.no_grad():
        got = kvcake.compress(tiny_llama, ids, "snapkv", budget=24, window=8).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_fastest_picks_the_fastest_usable_backend(monkeypatch):
    seen, clock = [], [0.0]

    def work():
        flash, _, math = _flags()
        seen.append((flash, math))
        if flash:
            raise RuntimeError("No available kernel")  # this backend cannot serve the call
        clock[0] += 2.0 if math else 1.0  # math takes twice as long as memory-efficient

    monkeypatch.setattr(sdpa, "candidates", lambda device: ("flash", "efficient", "math"))
    before = _flags()
    name, times = fastest(work, CPU, repeats=2, timer=lambda: clock[0])
    assert name == "efficient" and times == {"flash": None, "efficient": 1.0, "math": 2.0}
    assert (True, False) in seen and (False, True) in seen and _flags() == before
    with pytest.raises(RuntimeError, match="no SDPA backend"):
        fastest(lambda: (_ for _ in ()).throw(RuntimeError("none")), CPU, names=("math",))
