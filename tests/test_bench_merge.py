"""``kvcake bench memory|prefill --add``: a run of new methods joins the results already written."""

from __future__ import annotations

import json

import pytest
import torch

from kvcake.bench import cli, decode
from kvcake.bench.merge import merge


def _kv(method, length, peak):
    return dict(method=method, length=length, peak=peak, end=1, end_theory=1, counts_bytes=1,
                cascade_bound=100, layout=["ragged"])  # fmt: skip


def test_merge_replaces_only_the_new_cells_and_recomputes_targets():
    old = dict(bench="memory", budget=128, window=32, lengths=[1024, 2048], methods=["snapkv", "cake"],
               kv=[_kv("full", 1024, 9), _kv("snapkv", 1024, 5), _kv("cake", 1024, 101), _kv("full", 2048, 9)],
               rss=[_kv("full", 1024, 9), _kv("snapkv", 1024, 5)], targets=[])  # fmt: skip
    new = dict(bench="memory", budget=128, window=32, lengths=[1024], methods=["layer-defensivekv"],
               kv=[_kv("full", 1024, 8), _kv("layer-defensivekv", 1024, 99)],
               rss=[_kv("full", 1024, 8), _kv("layer-defensivekv", 1024, 7)], targets=[])  # fmt: skip
    got = merge("memory", old, new)
    # bytes read off the caches: the new run's full row replaces the old one at its length
    assert [r["peak"] for r in got["kv"] if r["method"] == "full"] == [8, 9]
    # process memory is noisy: the old methods' rss rows keep the full cache's row they were compared with
    rss = [(r["method"], r["peak"]) for r in got["rss"]]
    assert rss == [("full", 9), ("snapkv", 5), ("layer-defensivekv", 7)]
    assert got["methods"] == ["snapkv", "cake", "layer-defensivekv"]
    assert [(r["method"], r["length"]) for r in got["kv"]] == [
        ("full", 1024), ("snapkv", 1024), ("cake", 1024), ("layer-defensivekv", 1024), ("full", 2048)
    ]  # fmt: skip
    names = {t["target"].split(" peak")[0]: t["ok"] for t in got["targets"]}
    assert names == {"CAKE cascade": True, "Layer-DefensiveKV cascade": True}
    with pytest.raises(ValueError, match="budget=128, this run 64"):
        merge("memory", old, {**new, "budget": 64})
    with pytest.raises(ValueError, match="not 'bandwidth'"):
        merge("bandwidth", old, new)


def _step(method, length, s, policy="none", budget=128):
    return dict(method=method, length=length, budget=budget, policy=policy, s=s, compiled_s=None, bound_s=0.01,
                times=[s], kv_bytes=1, speedup=1.0, allowed=1.0, fraction=1.0, hook_s=0.0, hook_share=0.0)  # fmt: skip


def test_a_decode_run_replaces_every_row_at_its_lengths():
    """Decode rows are compared with their length's full cache, so a run replaces whole lengths."""
    old = dict(bench="decode", window=32, lengths=[4096, 16384], budgets=[128, 512], methods=["snapkv"],
               policies=["fixed", "none"], bandwidth=dict(read_gbps=10.0), compile=False,
               rows=[_step("full", 4096, 0.1), _step("snapkv", 4096, 0.05), _step("full", 16384, 0.2),
                     _step("snapkv", 16384, 0.08, budget=512)], targets=[])  # fmt: skip
    new = dict(bench="decode", window=32, lengths=[16384], budgets=[128], methods=["snapkv", "cake"],
               policies=["preset"], bandwidth=dict(read_gbps=12.0), compile=True, counts=dict(intro="", table="|t|"),
               rows=[_step("full", 16384, 0.3), _step("full-static", 16384, 0.25), _step("snapkv", 16384, 0.1),
                     _step("cake", 16384, 0.12, policy="fixed")], targets=[])  # fmt: skip
    got = merge("decode", old, new)
    assert [(r["method"], r["length"], r["s"]) for r in got["rows"]] == [
        ("full", 4096, 0.1), ("snapkv", 4096, 0.05), ("full", 16384, 0.3), ("full-static", 16384, 0.25),
        ("snapkv", 16384, 0.1), ("cake", 16384, 0.12),
    ]  # fmt: skip
    assert got["lengths"] == [4096, 16384] and got["budgets"] == [128, 512] and got["compile"]
    assert got["policies"] == ["fixed", "none", "preset"] and got["counts"]["table"] == "|t|"
    assert {t["method"] for t in got["targets"] if "at its best" in t["target"]} == {"snapkv", "cake"}
    with pytest.raises(ValueError, match="window=32, this run 16"):
        merge("decode", old, {**new, "window": 16})


def test_add_on_the_command_line(tiny_llama, tmp_path, monkeypatch):
    """A memory run of one method, then --add of another: the file holds both."""
    from kvcake.bench import common

    monkeypatch.setattr(
        common, "load_models",
        lambda *a, **k: common.BenchModels(tiny_llama, None, "tiny", torch.device("cpu"), torch.float32),
    )  # fmt: skip
    base = ["memory", "--memory-lengths", "64", "--rss-lengths", "none", "--budget", "24", "--window", "8",
            "--out", str(tmp_path)]  # fmt: skip
    page = tmp_path / "page.md"
    assert cli.main([*base, "--methods", "snapkv", "--doc", str(page)]) == 0
    assert "layer-defensivekv" not in page.read_text()
    assert cli.main([*base, "--methods", "layer-defensivekv", "--add", "--doc", str(page)]) == 0
    data = json.loads((tmp_path / "memory.json").read_text())
    assert {r["method"] for r in data["kv"]} == {"full", "snapkv", "layer-defensivekv"} and data["rss"] == []
    text = page.read_text()
    assert "| 64 | snapkv |" in text and "| 64 | layer-defensivekv |" in text
    assert "Rows added since (`--add`" in text and "--methods layer-defensivekv --add" in text
    assert cli.main(["bandwidth", "--add", "--out", str(tmp_path)]) == 2
    # --add of a bench the page's run did not have: on the page too (it was left out before)
    decode = ["decode", "--decode-lengths", "64", "--budgets", "24", "--window", "8", "--methods", "snapkv",
              "--steps", "1", "--rounds", "1", "--out", str(tmp_path), "--add", "--doc", str(page)]  # fmt: skip
    assert cli.main(decode) == 0
    text = page.read_text()
    assert (
        "## Decode time per token" in text
        and "| 64 | snapkv |" in text
        and "| 64 | layer-defensivekv |" in text
    )


def _pair(method, length, s, full_s=10.0):
    return dict(method=method, length=length, round=0, full_s=full_s, s=s, hook_s=0.1, evict_s=0.05)


def test_a_prefill_run_replaces_its_rows_and_runs_at_its_lengths_only():
    """Merging a 4096-token run keeps the 8192-token rows of the same methods and the runs behind
    them; the targets are rechecked on the merged rows."""
    from kvcake.bench import speed

    def result(pairs):
        rows = [speed.prefill_row([p], [p["full_s"]], length=p["length"], method=p["method"]) for p in pairs]
        return dict(bench="prefill", budget=128, window=32, lengths=sorted({p["length"] for p in pairs}),
                    methods=list(dict.fromkeys(p["method"] for p in pairs)), rows=rows, runs=pairs,
                    targets=speed.prefill_targets(rows))  # fmt: skip

    old = result([_pair("snapkv", 4096, 12.0), _pair("cake", 4096, 10.5), _pair("snapkv", 8192, 10.2)])
    new = result([_pair("snapkv", 4096, 10.3)])
    got = merge("prefill", old, new)
    assert [(r["method"], r["length"], r["s"]) for r in got["rows"]] == [
        ("snapkv", 4096, 10.3), ("cake", 4096, 10.5), ("snapkv", 8192, 10.2)
    ]  # fmt: skip
    assert sorted((r["method"], r["length"], r["s"]) for r in got["runs"]) == [
        ("cake", 4096, 10.5), ("snapkv", 4096, 10.3), ("snapkv", 8192, 10.2)
    ]  # fmt: skip
    assert [(t["method"], t["length"], t["ok"]) for t in got["targets"]] == [
        ("snapkv", 4096, True), ("cake", 4096, True), ("snapkv", 8192, True)
    ]  # fmt: skip


def test_merged_prefill_rows_keep_the_machine_they_were_measured_on(tmp_path):
    """A run on another machine merged into older rows (written before rows named their machine):
    each row names its own, and the page's table gets a machine column only when they differ."""
    from kvcake.bench import speed

    def result(pairs, cpu, named):
        machine = dict(device="cpu", cpu=cpu)
        rows = [speed.prefill_row([p], [p["full_s"]], length=p["length"], method=p["method"],
                                  **({"machine": speed.machine_label(machine)} if named else {}))
                for p in pairs]  # fmt: skip
        return dict(bench="prefill", machine=machine, budget=128, window=32, methods=["snapkv"],
                    lengths=sorted({p["length"] for p in pairs}), rows=rows, runs=pairs,
                    targets=speed.prefill_targets(rows))  # fmt: skip

    old = result([_pair("snapkv", 4096, 12.0), _pair("snapkv", 8192, 10.2)], "Intel Xeon", named=False)
    assert "machine" not in speed.prefill_tables(old).splitlines()[2]
    new = result([_pair("snapkv", 4096, 10.3)], "AMD EPYC", named=True)
    got = merge("prefill", old, new)
    assert [(r["length"], r["machine"]) for r in got["rows"]] == [(4096, "AMD EPYC"), (8192, "Intel Xeon")]
    table = speed.prefill_tables(got).splitlines()
    assert table[2].startswith("| S | method | machine | full s |")
    assert table[4].startswith("| 4096 | snapkv | AMD EPYC | 10.00 |")
    assert table[5].startswith("| 8192 | snapkv | Intel Xeon | 10.00 |")
    from kvcake.bench import report

    page = report._prefill(got, tmp_path, tmp_path / "page.md")
    assert "Rows from runs on 2 machines (AMD EPYC, Intel Xeon; the machine column)" in page
    again = merge("prefill", got, result([_pair("snapkv", 8192, 10.0)], "AMD EPYC", named=True))
    assert {r["machine"] for r in again["rows"]} == {"AMD EPYC"}
    assert "machine" not in speed.prefill_tables(again).splitlines()[2]


def test_merged_decode_rows_say_which_bandwidth_their_bounds_used():
    """``--add`` keeps each row's bound from its own run's bandwidth, and the page's heading said
    every bound used the newest run's (77.2 GB/s on a page whose 1024-8192-token rows used 18.8)."""

    def row(length, gbps):
        return {**_step("full", length, 0.1), "weight_bytes": 4e9, "kv_bytes": 1e9, "bound_s": 5 / gbps}

    old = dict(bench="decode", window=32, lengths=[4096], budgets=[128], methods=["snapkv"], policies=["none"],
               bandwidth=dict(read_gbps=18.8), compile=False, rows=[row(4096, 18.8)], targets=[])  # fmt: skip
    new = {**old, "lengths": [16384], "bandwidth": dict(read_gbps=77.2), "rows": [row(16384, 77.2)]}
    got = merge("decode", old, new)
    assert decode.row_bandwidths(got["rows"]) == {18.8: [4096], 77.2: [16384]}
    words = decode._bandwidth_words(got)
    assert (
        "77.2 GB/s read bandwidth measured in the newest run" in words and "18.8 GB/s at 4096 tokens" in words
    )
    assert decode._bandwidth_words(new) == "77.2 GB/s read bandwidth measured in this run (one read probe)"
