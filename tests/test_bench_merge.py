"""``kvcake bench memory|prefill --add``: a run of new methods joins the results already written."""

from __future__ import annotations

import json

import pytest
import torch

from kvcake.bench import cli
from kvcake.bench.merge import merge


def _kv(method, length, peak):
    return dict(method=method, length=length, peak=peak, end=1, end_theory=1, counts_bytes=1,
                cascade_bound=100, layout=["ragged"])  # fmt: skip


def test_merge_replaces_only_the_new_cells_and_recomputes_targets():
    old = dict(bench="memory", budget=128, window=32, lengths=[1024, 2048], methods=["snapkv", "cake"],
               kv=[_kv("full", 1024, 9), _kv("snapkv", 1024, 5), _kv("cake", 1024, 101), _kv("full", 2048, 9)],
               rss=[], targets=[])  # fmt: skip
    new = dict(bench="memory", budget=128, window=32, lengths=[1024], methods=["layer-defensivekv"],
               kv=[_kv("full", 1024, 8), _kv("layer-defensivekv", 1024, 99)], rss=[], targets=[])  # fmt: skip
    got = merge("memory", old, new)
    assert [r["peak"] for r in got["kv"] if r["method"] == "full"] == [9, 9], "the old run's full rows stay"
    assert got["methods"] == ["snapkv", "cake", "layer-defensivekv"]
    assert [(r["method"], r["length"]) for r in got["kv"]] == [
        ("full", 1024), ("snapkv", 1024), ("cake", 1024), ("layer-defensivekv", 1024), ("full", 2048)
    ]  # fmt: skip
    names = {t["target"].split(" peak")[0]: t["ok"] for t in got["targets"]}
    assert names == {"CAKE cascade": True, "Layer-DefensiveKV cascade": True}
    with pytest.raises(ValueError, match="budget=128, this run 64"):
        merge("memory", old, {**new, "budget": 64})
    with pytest.raises(ValueError, match="not 'decode'"):
        merge("decode", old, new)


def test_add_on_the_command_line(tiny_llama, tmp_path, monkeypatch):
    """A memory run of one method, then --add of another: the file holds both."""
    from kvcake.bench import common

    monkeypatch.setattr(
        common, "load_models",
        lambda *a, **k: common.BenchModels(tiny_llama, None, "tiny", torch.device("cpu"), torch.float32),
    )  # fmt: skip
    base = ["memory", "--memory-lengths", "64", "--budget", "24", "--window", "8", "--out", str(tmp_path)]
    monkeypatch.setattr(cli, "DEFAULTS", {**cli.DEFAULTS, "rss_lengths": ()})
    page = tmp_path / "page.md"
    assert cli.main([*base, "--methods", "snapkv", "--doc", str(page)]) == 0
    assert "layer-defensivekv" not in page.read_text()
    assert cli.main([*base, "--methods", "layer-defensivekv", "--add", "--doc", str(page)]) == 0
    data = json.loads((tmp_path / "memory.json").read_text())
    assert {r["method"] for r in data["kv"]} == {"full", "snapkv", "layer-defensivekv"}
    text = page.read_text()
    assert "| 64 | snapkv |" in text and "| 64 | layer-defensivekv |" in text
    assert "Rows added since (`--add`" in text and "--methods layer-defensivekv --add" in text
    assert cli.main(["decode", "--add", "--out", str(tmp_path)]) == 2
