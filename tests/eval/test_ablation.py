"""The CAKE ablation section of the results page, from records."""

from pathlib import Path

from kvcake.eval.ablation import ABLATION, ABLATION_LENGTHS, ablation_markdown


def _record(method, length, scenario, ratio, kl, seed=0):
    return {"method": method, "task": "t", "seed": seed, "length": length, "scenario": scenario, "ratio": None if method == "full" else ratio,
            "budget": None, "kl": kl, "attn_rel_l1": kl / 2, "score": 100.0}  # fmt: skip


def test_ablation_tables_hold_every_ablation_method_at_its_lengths_only():
    length = ABLATION_LENGTHS[0]
    records = [_record(m, length, sc, r, 0.01 * (i + 1) + r)
               for i, m in enumerate(["full", *ABLATION]) for sc in ("question", "context") for r in (0.1, 0.5)]  # fmt: skip
    records.append(_record("cake", 123, "context", 0.1, 99.0))  # another length: left out
    text = ablation_markdown(records, Path("docs/figures/x.png"), Path("docs/results.md"))
    assert "### question-aware" in text and "### context-only" in text
    for m in ABLATION:
        assert f"`{m}`" in text
    assert "99" not in text.replace("ratio 0.1", "")
    assert "![x](figures/x.png)" in text
    cake_kl = f"{0.01 * (1 + list(ABLATION).index('cake') + 1) + 0.1:.4f}"
    assert cake_kl[:5] in text  # the mean of cake's cells at ratio 0.1


def test_ablation_counts_the_prompts_at_or_below_snapkv_prompt_by_prompt():
    """A row's mean can be one prompt's: the section also counts, per ratio, the prompts (task,
    length, sample) where a row's KL is at or below ``snapkv``'s, over the prompts both have."""
    length, cake = ABLATION_LENGTHS[0], "cake"
    records = []
    for seed, (mine, ref) in enumerate([(0.1, 0.2), (0.3, 0.3), (5.0, 0.4)]):  # below, tie, far above
        records += [
            _record(cake, length, "context", 0.25, mine, seed),
            _record("snapkv", length, "context", 0.25, ref, seed),
        ]
    records.append(_record(cake, length, "context", 0.25, 0.0, seed=7))  # no snapkv cell: not compared
    text = ablation_markdown(records, None, Path("docs/results.md")).split("at or below `snapkv`'s**")[1]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in text.splitlines()
            if line.startswith("| `")}  # fmt: skip
    assert rows["`cake`"] == "2/3"  # the mean (1.8 against 0.3) says otherwise
    assert rows["`layers=uniform,score=cake`"] == "-"  # no cells of its own


def test_no_ablation_records_no_section():
    assert ablation_markdown([_record("cake", 123, "context", 0.1, 0.1)], None, Path("d.md")) == ""


def _rows(text):
    return {(line.split("|")[1].strip(), line.split("|")[2].strip(), line.split("|")[3].strip()): line.split("|")[6].strip()
            for line in text.splitlines()[2:]}  # fmt: skip


def test_targets_hold_or_fail_from_the_numbers():
    from kvcake.eval.ablation import targets_markdown

    kl = {"cake": 0.105, "snapkv": 0.1, "pyramidkv": 0.05, "cake-adakv": 0.1, "adakv": 0.3}
    records = [
        _record(m, 2048, sc, r, v)
        for m, v in kl.items()
        for sc in ("question", "context")
        for r in (0.1, 0.5)
    ]
    rows = _rows(targets_markdown(records))
    assert rows[("`cake` kl <= 1.1 x `snapkv`", "question-aware", "0.1")] == "yes"  # 0.105 <= 0.11
    assert rows[("`cake` kl <= `snapkv`", "context-only", "0.1")] == "**no**"  # no 10% slack context-only
    assert rows[("`cake` kl <= `pyramidkv`", "question-aware", "0.5")] == "**no**"
    assert rows[("`cake-adakv` kl <= 1.1 x `adakv`", "question-aware", "0.5")] == "yes"
    assert rows[("`cake` kl vs `snapkv`", "context-only", "0.5")] == "no target: 1.05 x"
    assert ("`cake` kl <= `snapkv`", "context-only", "0.5") not in rows  # 0.5 context-only: shown only
    assert rows[("`cake` score >= `snapkv` - 10", "context-only", "0.1")] == "yes"  # equal scores
    assert "| - |" not in targets_markdown(records)
    assert "| - |" in targets_markdown([r for r in records if r["method"] != "adakv"])


def test_the_score_target_allows_ten_points_and_no_more():
    from kvcake.eval.ablation import targets_markdown

    def rows(cake_score):
        records = [
            _record("cake", 2048, "question", 0.25, 0.1),
            _record("snapkv", 2048, "question", 0.25, 0.1),
        ]
        records[0]["score"], records[1]["score"] = cake_score, 0.5
        return _rows(targets_markdown(records))[("`cake` score >= `snapkv` - 10", "question-aware", "0.25")]

    assert rows(0.41) == "yes" and rows(0.39) == "**no**"


def test_targets_compare_the_same_prompts_only():
    from kvcake.eval.ablation import targets_markdown

    records = [_record("cake", 2048, "context", 0.1, 0.3, seed=0), _record("snapkv", 2048, "context", 0.1, 0.4, seed=0),
               _record("snapkv", 2048, "context", 0.1, 0.01, seed=1)]  # fmt: skip
    row = next(
        line for line in targets_markdown(records).splitlines() if "`cake` kl <= `snapkv` | context" in line
    )
    assert "| 0.3 | 0.4 | yes | 1/1 |" in row  # seed 1 has no cake cell: left out of both means


def test_targets_count_the_prompts_where_they_hold():
    from kvcake.eval.ablation import targets_markdown

    kl = {("cake", 0): 0.1, ("cake", 1): 0.5, ("snapkv", 0): 0.2, ("snapkv", 1): 0.3}
    records = [_record(m, 2048, "question", 0.1, v, seed=s) for (m, s), v in kl.items()]
    row = next(
        line
        for line in targets_markdown(records).splitlines()
        if "`cake` kl <= 1.1 x `snapkv` | question" in line
    )
    assert "| 0.3 | 0.25 | **no** | 1/2 |" in row  # the mean fails (0.3 > 0.275), one prompt of two holds


def test_a_part_of_the_suite_leaves_its_page_and_ablation_alone():
    import argparse

    from kvcake.eval.cli import add_arguments
    from kvcake.eval.suites import resolve

    parser = add_arguments(argparse.ArgumentParser())
    suite = resolve(parser.parse_args(["--suite", "results", "--threads", "1", "--report-only"]))
    assert suite["ablation"] and suite["doc"] == "docs/results.md" and not suite["narrowed"]
    variant = ["--suite", "results", "--methods", "full;cake,score.pooling=max", "--out", "/tmp/v.jsonl"]
    part = resolve(parser.parse_args(variant))
    assert not part["ablation"] and part["doc"] is None and part["narrowed"] == ["--methods", "--out"]
    assert part["methods"] == ("full", "cake,score.pooling=max")
    assert part["tasks"] == suite["tasks"] and part["ratios"] == suite["ratios"]  # the suite's prompts
    named = resolve(parser.parse_args([*variant, "--doc", "/tmp/v.md"]))
    assert named["doc"] == "/tmp/v.md" and not named["ablation"] and named["targets"]
    assert named["intro"] == named["notes"] == "" and suite["notes"].startswith("## Observations")
    gemma = resolve(parser.parse_args(["--suite", "results-gemma3"]))
    assert not gemma["ablation"] and not gemma["narrowed"]  # the ablation is the default model's
    assert resolve(parser.parse_args(["--lengths", "2k"]))["narrowed"] == []  # no suite, nothing to narrow


def test_the_suite_measures_the_target_methods_on_more_samples(monkeypatch):
    """``--suite results`` runs its every-preset cells, then the methods of issue 24's targets at 6
    samples into the same file; the page gets both runs' cells (each cell once), a part of the
    suite neither."""
    import argparse

    from kvcake.eval import cli, runner
    from kvcake.eval.cli import add_arguments
    from kvcake.eval.suites import TARGET_METHODS, resolve

    parser = add_arguments(argparse.ArgumentParser())
    suite = resolve(parser.parse_args(["--suite", "results"]))
    assert suite["more_samples"] == (TARGET_METHODS, 6) and suite["samples"] == 2
    assert {"full", "snapkv", "pyramidkv", "cake", "adakv", "cake-adakv"} == set(TARGET_METHODS)
    assert resolve(parser.parse_args(["--suite", "results", "--methods", "cake"]))["more_samples"] is None
    assert resolve(parser.parse_args(["--suite", "results-gemma3"]))["more_samples"] is None

    calls = []

    def fake_run_eval(model, tokenizer, *, methods, samples, report=True, **kw):
        calls.append((tuple(methods), samples, report))
        records = [_record(m, 2048, "question", 0.25, 0.1, seed=s) for m in methods for s in range(samples)]
        for r in records:
            r["sample"] = r["seed"]
        return runner.EvalResult(records, len(records), 0, "", [], Path("r.jsonl"), 1.0, 1)

    monkeypatch.setattr(runner, "run_eval", fake_run_eval)
    monkeypatch.setattr(
        "kvcake.eval.report.summary_markdown", lambda records, methods: f"{len(records)} cells"
    )
    monkeypatch.setattr("kvcake.eval.report.write_plots", lambda records, prefix, methods: [])
    first = fake_run_eval(None, None, methods=("full", "snapkv", "h2o"), samples=2)
    merged = cli._more_samples(first, None, None, "m", {**suite, "methods": ("full", "snapkv", "h2o")}, {})
    assert calls[-1] == (TARGET_METHODS, 6, False)
    keys = [(r["method"], r["seed"]) for r in merged.records]
    assert len(keys) == len(set(keys)) == 3 * 2 + len(TARGET_METHODS) * 6 - 2 * 2  # full, snapkv 0-1 once
    assert merged.table == f"{len(keys)} cells" and merged.missing == 2 and merged.new == 6 + 6 * 6


def test_targets_report_their_margin_and_whether_one_prompt_decides_them():
    from kvcake.eval.ablation import targets_markdown

    cake, snap = [0.1, 0.1, 1.0], [0.2, 0.2, 0.3]
    records = [_record("cake", 2048, "context", 0.25, v, seed=s) for s, v in enumerate(cake)]
    records += [_record("snapkv", 2048, "context", 0.25, v, seed=s) for s, v in enumerate(snap)]
    row = next(
        line for line in targets_markdown(records).splitlines() if "`cake` kl <= `snapkv` | context" in line
    )
    margins = [b - a for a, b in zip(cake, snap, strict=True)]  # 0.1, 0.1, -0.7
    mean = sum(margins) / 3
    se = (sum((m - mean) ** 2 for m in margins) / 2 / 3) ** 0.5
    # missed on the mean, by one prompt: without it both others hold
    assert row.endswith(f"| **no** | 2/3 | {mean:+.3g} ({se:.2g}) | yes |"), row
    records[2]["kl"] = 0.35  # now the mean holds (margin -0.05 on that prompt only)
    row = next(
        line for line in targets_markdown(records).splitlines() if "`cake` kl <= `snapkv` | context" in line
    )
    assert "| yes | 2/3 | +0.05 (" in row and row.endswith("| yes |")
    # scores: the margin is in points, above the reference less the slack
    score = [
        line for line in targets_markdown(records).splitlines() if "score >=" in line and "context" in line
    ]
    assert score and all("| 3/3 | +10 (0) | yes |" in line for line in score)


def test_a_report_only_page_shows_the_suites_own_command():
    """``--report-only`` shows the command that computed the cells: for a suite its own last command,
    not a part's (``--methods``) nor the ablation's run line; without a suite the last run's."""
    from kvcake.eval.ablation import RUN_TAG
    from kvcake.eval.cli import page_command

    suite = "python -m kvcake.eval --suite results --threads 1"
    runs = [
        {"command": suite},
        {"command": suite + RUN_TAG},
        {"command": "python -m kvcake.eval --methods cake"},
        # a part of the suite run with it (the page showed this one: docs/kvpress.md, 2026-12-07)
        {"command": "python -m kvcake.eval --suite results --methods cake --samples=6"},
    ]
    assert page_command(runs, suite=True) == suite
    runs = runs[:3]
    assert page_command(runs, suite=False) == "python -m kvcake.eval --methods cake"
    assert page_command(runs[1:], suite=True) == "python -m kvcake.eval --methods cake"  # no suite line left


def test_the_results_suite_adds_the_float8_rows_of_four_methods():
    import argparse

    from kvcake.eval.cli import add_arguments
    from kvcake.eval.suites import FP8_METHODS, resolve
    from kvcake.method import PRESETS

    parser = add_arguments(argparse.ArgumentParser())
    assert resolve(parser.parse_args(["--suite", "results"]))["methods"] == ("full", *PRESETS, *FP8_METHODS)
    assert resolve(parser.parse_args(["--suite", "results-gemma3"]))["methods"] == ("full", *PRESETS)
    assert all(m.endswith("+fp8") and m.removesuffix("+fp8") in PRESETS for m in FP8_METHODS)
