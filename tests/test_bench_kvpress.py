"""``kvcake bench gpu --kvpress``: kvpress's presses as rows beside the presets (kvcake.bench.kvpress_rows).

kvpress is not among the development requirements (0.5 requires transformers < 5.3), so the
plumbing is tested with a stand-in module of the same shape (``kvpress_standin``: press classes
built with kvpress's keyword arguments whose ``press(model)`` keeps the prompt's last entries). The
real presses are checked where kvpress is installed.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from transformers import DynamicCache

try:  # the real kvpress, where installed, imported before any test enables kvcake (kvpress_rows._kvpress)
    import kvpress  # noqa: F401
except ImportError:
    pass

from kvcake.bench import kvpress_rows
from kvcake.bench.cli import main
from kvcake.bench.gpu import FULL_DYNAMIC, FULL_STATIC, GpuSettings, merge, targets
from kvcake.bench.kvpress_rows import PRESSES, make_press, row_name
from kvpress_standin import install

TINY = dict(shape="tiny", lengths=(64,), budget=40, rounds=1, steps=1, compile=False)


@pytest.fixture
def standin(monkeypatch):
    return install(monkeypatch)


def test_each_press_is_built_for_the_same_budget_and_window(standin):
    for preset, (press, scorer) in PRESSES.items():
        built = make_press(row_name(preset), budget=40, length=64, window=8)
        assert type(built).__name__ == press
        inner = built.kwargs["press"] if scorer else built
        assert type(inner).__name__ == (scorer or press)
        assert int(64 * (1 - inner.kwargs["compression_ratio"])) == 40  # kvpress's own rounding keeps 40
        assert inner.kwargs.get("window_size") == (
            8 if type(inner).__name__ in kvpress_rows.WINDOWED else None
        )


@pytest.mark.parametrize("length", [257, 299, 300, 32768, 131072])
def test_the_ratio_keeps_exactly_the_budget_whatever_the_rounding(standin, length):
    for budget in (1, 64, 128, 1024, length - 1):
        built = make_press(row_name("snapkv"), budget=budget, length=length, window=8)
        kept = length * (1 - built.kwargs["compression_ratio"])
        assert int(kept) == round(kept) == budget  # the presses' int(), PyramidKV's round() at its fallback


def test_rows_beside_the_presets_and_the_page_says_what_they_are(standin, tmp_path):
    doc, out = tmp_path / "page.md", tmp_path / "out"
    argv = ["gpu", "--device", "cpu", "--shape", "tiny", "--lengths", "64", "--budget", "40", "--rounds", "1",
            "--steps", "1", "--no-compile", "--methods", "snapkv", "--kvpress", "snapkv,adakv",
            "--out", str(out), "--doc", str(doc)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads((out / "gpu.json").read_text())
    rows = {r["cache"]: r for r in result["rows"]}
    assert list(rows) == [FULL_DYNAMIC, FULL_STATIC, "snapkv", "kvpress:snapkv", "kvpress:adakv"]
    for name in ("kvpress:snapkv", "kvpress:adakv"):  # the stand-in's hooks ran in the prefill: 40 of 64 kept
        assert 0 < rows[name]["kv_mib"] < rows[FULL_DYNAMIC]["kv_mib"], name
        assert rows[name]["eager_ms"] > 0 and rows[name]["compiled_ms"] == "n/a (--no-compile)"
    assert result["settings"]["kvpress"] == ["snapkv", "adakv"]
    page = doc.read_text()
    assert page.startswith("# kvcake on the CPU: ")  # (the device of the run; "a GPU" on CUDA)
    assert "| 64 | kvpress:snapkv |" in page and "`kvpress:adakv` AdaKVPress(SnapKVPress)" in page
    assert "wrapped every attention function" in page
    # the kvpress of the run, kept with its machine (a page rendered later elsewhere still names it):
    # the stand-in has no release, even where kvpress is installed beside it
    assert result["machine"]["kvpress"] is None and "are kvpress (version unknown)'s press" in page
    assert {c["cache"] for c in targets(result)} <= {"snapkv"}  # kvpress's rows are compared, not targeted


def test_all_names_every_press(standin, tmp_path):
    out = tmp_path / "out"
    argv = ["gpu", "--device", "cpu", "--shape", "tiny", "--lengths", "64", "--budget", "40", "--rounds", "1",
            "--steps", "1", "--no-compile", "--methods", "snapkv", "--kvpress", "all", "--out", str(out),
            "--doc", str(tmp_path / "page.md")]  # fmt: skip
    assert main(argv) == 0
    names = [r["cache"] for r in json.loads((out / "gpu.json").read_text())["rows"]]
    assert names[3:] == [row_name(p) for p in PRESSES]


def test_a_preset_kvpress_lacks_or_kvpress_missing_is_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"no kvpress press implements h2o, cake; choose among streamingllm"):
        GpuSettings(**TINY, kvpress=("h2o", "cake"))
    monkeypatch.setitem(sys.modules, "kvpress", None)  # not installed: importing it raises ImportError
    GpuSettings(**TINY, methods=("snapkv",))  # needed only where asked for
    with pytest.raises(
        ValueError, match=r"kvpress package, which is not installed here.*transformers < 5\.3"
    ):
        GpuSettings(**TINY, methods=("snapkv",), kvpress=("snapkv",))


def test_a_page_from_before_the_option_still_merges():
    settings = GpuSettings(**TINY, methods=("snapkv",))
    new = dict(settings=settings.__dict__ | {"lengths": [64], "methods": ["snapkv"], "kvpress": []}, rows=[],
               runs=[], sdpa_backends={})  # fmt: skip
    old = dict(new, settings={k: v for k, v in new["settings"].items() if k != "kvpress"} | {"lengths": [80]})
    assert merge(old, new)["settings"]["kvpress"] == []  # an earlier page without the key: no kvpress rows
    with pytest.raises(ValueError, match="differs in kvpress"):
        merge(old, dict(new, settings=new["settings"] | {"kvpress": ["snapkv"]}))


def test_the_real_presses_keep_the_budget():
    """Where kvpress is installed (an environment of its own): each press keeps exactly the budget in
    every layer, but the Ada-KV ones, which keep the whole prompt and mask what they drop."""
    pytest.importorskip("kvpress")
    from kvcake.bench.shapes import random_model

    model = random_model("tiny", 320, device=torch.device("cpu"), dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (1, 299), generator=torch.Generator().manual_seed(0))
    for preset in PRESSES:
        cache = DynamicCache(config=model.config)
        with make_press(row_name(preset), budget=64, length=299, window=8)(model), torch.no_grad():
            model(ids, past_key_values=cache)
        held = {layer.keys.shape[2] for layer in cache.layers}
        if preset == "pyramidkv":  # its own per-layer budgets, averaging the budget
            assert sum(layer.keys.shape[2] for layer in cache.layers) == pytest.approx(
                64 * len(cache.layers), abs=len(cache.layers)
            ), held
        else:
            assert held == ({299} if "adakv" in preset else {64}), preset


def test_the_masks_an_ada_press_leaves_on_the_model_are_forgotten(standin):
    """kvpress's Ada-KV presses leave ``masked_key_indices`` on the attention modules, which its
    attention patch would apply to the next row's decode steps: cleared when the row ends."""
    from kvcake.bench.kvpress_rows import press_context
    from kvcake.bench.shapes import random_model

    model = random_model("tiny", 64, device=torch.device("cpu"), dtype=torch.float32)
    attention = model.model.layers[0].self_attn
    attention.masked_key_indices = ("left", "by", "an earlier press")
    with press_context(model, row_name("adakv"), budget=40, length=64, window=8):
        assert attention.masked_key_indices is None
        attention.masked_key_indices = ("set", "by", "this press")
    assert attention.masked_key_indices is None


def test_kvcake_rows_after_real_ada_presses_run():
    """Where kvpress is installed: kvcake's Ada-KV rows measured after kvpress's in the same run (the
    rounds rotate the order) decode; before the masks were forgotten, kvpress's patch failed there."""
    pytest.importorskip("kvpress")
    from kvcake.bench.gpu import run_gpu

    settings = GpuSettings(**{**TINY, "rounds": 3}, methods=("adakv", "critical-adakv"),
                           kvpress=("adakv", "critical-adakv"))  # fmt: skip
    rows = run_gpu(settings, device=torch.device("cpu"), dtype=torch.float32)["rows"]
    assert all(r["eager_ms"] > 0 for r in rows)


def test_kvpress_imported_after_kvcake_enabled_a_model_is_refused(monkeypatch):
    """kvpress's import wraps the attention functions registered then; kvcake's, wrapped, would be
    called with dropout where it takes scaling (measured: TypeError in every kvcake row)."""
    from kvcake.attention import register

    monkeypatch.delitem(sys.modules, "kvpress", raising=False)  # not imported yet
    register("sdpa")  # what kvcake.enable(model) registers
    with pytest.raises(ValueError, match="kvpress must be imported before kvcake enables a model"):
        GpuSettings(**TINY, methods=("snapkv",), kvpress=("snapkv",))
