"""The oracle temperature sweep of the results page (``kvcake.eval.tau_sweep``), on a tiny Llama:
its measures are the eval's own (a grid point equals the eval cell of CAKE with those
temperatures, a reference equals the eval cell of that preset), a rerun resumes without the
model, and the section picks the grid's best points from the numbers."""

from __future__ import annotations

import json

import pytest
from test_runner import TINY, one_thread, tokenizer  # noqa: F401  (fixtures)

from kvcake import temperatures
from kvcake.eval import tau_sweep
from kvcake.eval.runner import run_eval

SWEEP = {"tasks": TINY["tasks"], "lengths": TINY["lengths"], "samples": 1, "ratios": TINY["ratios"],
         "haystack": TINY["haystack"], "window": TINY["window"], "fidelity_tokens": TINY["fidelity_tokens"],
         "progress": False}  # fmt: skip


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCAKE_CACHE_DIR", str(tmp_path / "models"))
    monkeypatch.setattr(temperatures, "SHIPPED_DIR", tmp_path / "shipped")


def test_sweep_measures_are_the_eval_cells_and_a_rerun_resumes(tiny_llama, tokenizer, tmp_path, monkeypatch):  # noqa: F811
    out = tmp_path / "sweep.jsonl"
    records = tau_sweep.run_sweep(tiny_llama, tokenizer, out=out, **SWEEP)
    grid = len(tau_sweep.TAU1_GRID) * len(tau_sweep.TAU2_GRID)
    assert len(records) == 2 * (grid + len(tau_sweep.REFERENCES))  # two scenarios, one ratio, one prompt
    evals = run_eval(tiny_llama, tokenizer, methods=("snapkv", "cake,layers.tau1=2,layers.tau2=3"),
                     out=tmp_path / "eval.jsonl", report=False, samples=1,
                     **{k: v for k, v in TINY.items() if k != "samples"}).records  # fmt: skip
    assert len(evals) == 4
    for e in evals:
        if e["method"] == "snapkv":
            mine = [r for r in records if r["method"] == "snapkv" and r["scenario"] == e["scenario"]]
        else:
            mine = [r for r in records if r["method"] == "tau" and (r["tau1"], r["tau2"]) == (2.0, 3.0)
                    and r["scenario"] == e["scenario"]]  # fmt: skip
        assert len(mine) == 1
        assert mine[0]["kl"] == pytest.approx(e["kl"], rel=1e-3, abs=1e-7)
        assert mine[0]["attn"] == pytest.approx(e["attn_rel_l1"], rel=1e-3, abs=1e-7)

    def no_model(*args, **kwargs):
        raise AssertionError("a finished prompt was swept again")

    monkeypatch.setattr(tau_sweep, "sweep_group", no_model)
    again = tau_sweep.run_sweep(tiny_llama, tokenizer, out=out, **SWEEP)
    assert again == records


def test_a_new_calibration_keeps_the_grid_and_takes_cake_from_the_results(
    tiny_llama,
    tokenizer,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    out = tmp_path / "sweep.jsonl"
    records = tau_sweep.run_sweep(tiny_llama, tokenizer, out=out, **SWEEP)
    old = [{**r, "cake_tau": "shipped:older"} for r in records]  # swept before today's calibration
    out.write_text("".join(json.dumps(r) + "\n" for r in old))

    def no_model(*args, **kwargs):
        raise AssertionError("the grid does not depend on the calibration: nothing to sweep again")

    monkeypatch.setattr(tau_sweep, "sweep_group", no_model)
    again = tau_sweep.run_sweep(tiny_llama, tokenizer, out=out, **SWEEP)
    assert {r["method"] for r in again} == {"snapkv", "pyramidkv", "tau"}  # the stale cake rows left out
    assert len(again) == len(records) - 2
    label = next(r["cake_tau"] for r in records)
    fresh = [r for r in records if r["method"] == "cake"]
    results = [{"method": "cake", "tau": label, "attn_rel_l1": r["attn"], **{k: r[k] for k in
               ("model_fp", "task", "length", "seed", "sample", "scenario", "ratio", "kl", "window")}}
               for r in fresh]  # fmt: skip
    results.append({**results[0], "tau": "shipped:older", "kl": 9.0})  # another calibration's cell: ignored
    merged = tau_sweep.with_shipped(tiny_llama, again, results)
    assert sorted((r["scenario"], r["kl"], r["attn"]) for r in merged if r["method"] == "cake") == sorted(
        (r["scenario"], r["kl"], r["attn"]) for r in fresh
    )
    assert tau_sweep.sweep_markdown(merged) == tau_sweep.sweep_markdown(records)
    assert tau_sweep.with_shipped(tiny_llama, records, results) == records  # the sweep's own cake rows win


def _records(cells: dict) -> list[dict]:
    """(scenario, ratio) -> {method or (tau1, tau2): [(kl, attn) per prompt]} as sweep records."""
    out = []
    for (sc, ratio), by in cells.items():
        for who, values in by.items():
            for seed, (kl, attn) in enumerate(values):
                r = {
                    "task": "t",
                    "length": 100,
                    "seed": seed,
                    "scenario": sc,
                    "ratio": ratio,
                    "kl": kl,
                    "attn": attn,
                }
                if isinstance(who, tuple):
                    r.update(method="tau", tau1=who[0], tau2=who[1])
                else:
                    r["method"] = who
                out.append(r)
    return out


def test_section_picks_the_best_points_from_the_numbers():
    cell = {
        "snapkv": [(0.2, 0.2), (0.2, 0.2)],
        "pyramidkv": [(0.3, 0.1), (0.3, 0.1)],
        "cake": [(0.25, 0.15)] * 2,
        (1.0, 1.0): [(0.1, 0.3), (0.1, 0.3)],  # lowest KL: 2 targets
        (2.0, 3.0): [(0.2, 0.1), (0.2, 0.1)],  # every target (ties with the references count)
        (0.2, 0.4): [(0.5, 0.05), (0.5, 0.05)],
    }  # fmt: skip  lowest attention: 2 targets
    text = tau_sweep.sweep_markdown(_records({("question", 0.1): cell}))
    row = next(line for line in text.splitlines() if line.startswith("| question-aware"))
    assert "0.2500 / 0.1500, 2/4" in row  # cake: KL <= pyramidkv and attn <= snapkv only
    assert "2/3: 0.2000 / 0.1000, 4/4" in row
    assert "1/1: 0.1000 (0.3000)" in row and "0.2/0.4: 0.0500 (0.5000)" in row
    assert "the best single pair of temperatures meets 4 (2/3); the shipped calibration meets 2." in text
    assert tau_sweep.sweep_markdown([]) == ""


def test_means_use_the_prompts_every_entry_has():
    cell = {
        "snapkv": [(0.2, 0.2), (9.0, 9.0)],
        "pyramidkv": [(0.3, 0.1)],
        "cake": [(0.25, 0.15)],
        (1.0, 1.0): [(0.1, 0.3)],
    }
    means = tau_sweep._means(_records({("context", 0.5): cell}))[("context", 0.5)]
    assert means["snapkv"] == (0.2, 0.2, 1)  # seed 1 has only snapkv: left out


def _saved_model(make_tiny_llama, tok, tmp_path):
    """A tiny Llama and its tokenizer saved in a folder, for the command line's --model."""
    folder = tmp_path / "model"
    make_tiny_llama().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_command_line_runs_the_sweep_beside_the_results(make_tiny_llama, tokenizer, tmp_path, capsys):  # noqa: F811
    from kvcake.eval import cli

    folder = _saved_model(make_tiny_llama, tokenizer, tmp_path)
    out = tmp_path / "r.jsonl"
    args = ["--model", str(folder), "--methods", "full,snapkv", "--ratios", "0.5", "--tasks", "niah_single",
            "--lengths", "90", "--samples", "1", "--haystack", "noise", "--window", "4", "--max-new-tokens", "2",
            "--fidelity-tokens", "3", "--out", str(out), "--no-progress", "--tau-sweep"]  # fmt: skip
    assert cli.main(args) == 0
    assert "What CAKE's temperatures alone can reach" in capsys.readouterr().out
    swept = tau_sweep.sweep_path(out)
    assert swept == tmp_path / "r_tau_sweep.jsonl" and len(swept.read_text().splitlines()) == 2 * 45
    with pytest.raises(ValueError, match="drop --budgets"):
        cli.main([*args, "--budgets", "64"])


def test_a_variant_on_the_suites_prompts_leaves_the_page_alone(
    make_tiny_llama,
    tokenizer,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
):
    from kvcake.eval import cli

    folder = _saved_model(make_tiny_llama, tokenizer, tmp_path)
    monkeypatch.chdir(tmp_path)  # the suite's page and results file are relative paths
    args = ["--suite", "results", "--model", str(folder), "--methods", "full;snapkv;cake,score.pooling=max;cake",
            "--ratios", "0.5", "--tasks", "niah_single", "--lengths", "90", "--samples", "1", "--haystack", "noise",
            "--window", "4", "--max-new-tokens", "2", "--fidelity-tokens", "3", "--out", "v.jsonl", "--no-progress"]  # fmt: skip
    assert cli.main(args) == 0
    assert "its page was left alone" in capsys.readouterr().out
    methods = {json.loads(line)["method"] for line in (tmp_path / "v.jsonl").read_text().splitlines()}
    assert methods == {"full", "snapkv", "cake,score.pooling=max", "cake"}  # no ablation cells
    assert not (tmp_path / "docs").exists()
    assert cli.main([*args, "--doc", "v.md", "--report-only"]) == 0  # a page of this part's cells
    page = (tmp_path / "v.md").read_text()
    assert "`cake` kl <= 1.1 x `snapkv`" in page and "| `cake-adakv` kl" in page  # its targets, on its cells
    assert "## Observations" not in page and "Every kvcake preset" not in page  # not the suite's text
    assert not (tmp_path / "docs").exists()
