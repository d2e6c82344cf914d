"""Asking for a device this process does not have: one line naming the device, what torch was
built with and the fix, from the API and from every command (never torch's ``AssertionError:
Torch not compiled with CUDA enabled`` traceback).

Each case fakes the build it describes (``torch.version.cuda``, ``torch.cuda.is_available``,
``device_count``), so the tests mean the same on a CPU-only build and on a GPU machine.
"""

from __future__ import annotations

import io
import sys

import pytest
import torch

import kvcake
from kvcake import cli
from kvcake.devices import check_device


@pytest.fixture
def cpu_build(monkeypatch):
    """torch as a CPU-only wheel sees itself."""
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _one_line(err: Exception | str) -> str:
    text = str(err)
    assert "\n" not in text.rstrip("\n"), text
    return text


def test_cpu_build_names_the_device_the_build_and_the_fix(cpu_build):
    with pytest.raises(ValueError) as info:
        check_device("cuda")
    text = _one_line(info.value)
    assert "'cuda'" in text and torch.__version__ in text and "without CUDA" in text
    assert "pytorch.org" in text and "--device cpu" in text


def test_cuda_build_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        ValueError, match=r"'cuda:0' is not available: .*CUDA 12.6 but sees no GPU.*nvidia-smi"
    ):
        check_device("cuda:0")


def test_gpu_index_past_the_last(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"'cuda:2' is not available: .*sees 2 GPU\(s\), cuda:0 to cuda:1"):
        check_device("cuda:2")
    assert check_device("cuda:1") == torch.device("cuda:1")  # present: returned, nothing allocated


def test_other_backends_and_bad_names(monkeypatch):
    if torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    with pytest.raises(ValueError, match=r"'mps' is not available: .*MPS"):
        check_device("mps")
    if hasattr(torch, "xpu") and not torch.xpu.is_available():
        with pytest.raises(ValueError, match=r"'xpu' is not available: .*no usable xpu device"):
            check_device("xpu")
    with pytest.raises(ValueError, match="invalid device 'gpu0'"):
        check_device("gpu0")
    with pytest.raises(TypeError, match="device must be a str or torch.device"):
        check_device(0)
    assert check_device("cpu") == torch.device("cpu")
    assert check_device(torch.device("meta")) == torch.device("meta")


def test_api_load_model_fails_before_loading(cpu_build, tmp_path):
    # the folder does not exist: the device is checked first, so the error is about the device
    with pytest.raises(ValueError, match="'cuda' is not available") as info:
        kvcake.load_model(str(tmp_path / "absent"), device="cuda")
    _one_line(info.value)
    with pytest.raises(
        ValueError, match="device 'meta' holds no weights, so a model loaded there cannot run"
    ):
        kvcake.load_model(str(tmp_path / "absent"), device="meta")  # (was a traceback at the first .item())


def _call(capsys, monkeypatch, module_main, args):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code = module_main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "--prompt", "w1", "--device", "cuda"],
        ["eval", "--device", "cuda", "--methods", "full", "--out", "OUT"],
        ["bench", "prefill", "--device", "cuda", "--out", "OUT"],
    ],
    ids=["generate", "eval", "bench"],
)
def test_cli_entry_points_say_one_line(cpu_build, tmp_path, capsys, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    code, out, err = _call(capsys, monkeypatch, cli.main, args)
    assert code == 2
    assert err.count("\n") == 1, err
    assert "'cuda' is not available" in err and "without CUDA" in err and "--device cpu" in err
    assert "Traceback" not in err and "AssertionError" not in err
    assert not list(tmp_path.iterdir())  # failed before writing anything
