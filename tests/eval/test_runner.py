"""The eval runner, its command line and its report, on a tiny random Llama.

Invariants: a compressed context answers two questions the same in either order and is unchanged
by answering; questions sharing a context share one compression; the shared prefill gives the
answers and fidelity numbers of per-cell ``kvcake.generate``/``compress``; a run writes one line
per cell, a table and plots; a rerun skips finished cells without calling the model.
"""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import kvcake
from kvcake import fp8
from kvcake.eval import cells, runner
from kvcake.eval.report import render_page, summary_markdown
from kvcake.eval.runner import FULL, KEY_FIELDS, load_records, parse_methods, run_eval

WINDOW = 4
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
# the noise haystack's words and a few of the tasks' own; everything else is <unk>
KNOWN = (
    "The grass is green . sky blue sun yellow Here we go There and back again A special magic word "
    "for What the is : ? Remember it I will quiz you about afterwards hidden within following text"
).split()
TINY = {
    "ratios": (0.5,), "tasks": ("niah_single",), "lengths": (90,), "samples": 2, "haystack": "noise",
    "window": WINDOW, "max_new_tokens": 3, "fidelity_tokens": 4, "progress": False,
}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run faster on one thread, and far faster when other work shares the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer whose ids fit the tiny model's 128-token vocabulary (no chat template)."""
    words = list(dict.fromkeys(KNOWN))
    vocab = {t: i for i, t in enumerate(SPECIALS + words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def _layers(cache) -> list[torch.Tensor]:
    return [t.clone() for layer in cache.layers for t in (layer.keys, layer.values, layer.padded_positions())]


@pytest.mark.parametrize("preset", ["cake", "adakv"])
def test_context_only_answers_do_not_depend_on_order_or_change_the_context(tiny_llama, preset):
    g = torch.Generator().manual_seed(0)
    context, q1, q2 = (torch.randint(3, 128, (1, n), generator=g) for n in (48, 5, 7))
    ctx = kvcake.compress(tiny_llama, context, preset, budget=12, window=WINDOW)
    before = _layers(ctx.cache)
    a1 = ctx.generate(q1, max_new_tokens=6, do_sample=False)
    a2 = ctx.generate(q2, max_new_tokens=6, do_sample=False)
    b2 = ctx.generate(q2, max_new_tokens=6, do_sample=False)
    b1 = ctx.generate(q1, max_new_tokens=6, do_sample=False)
    assert torch.equal(a1, b1) and torch.equal(a2, b2)
    after = _layers(ctx.cache)
    assert len(before) == len(after) == 3 * 4
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    fresh = kvcake.compress(tiny_llama, context, preset, budget=12, window=WINDOW)
    assert torch.equal(fresh.generate(q2, max_new_tokens=6, do_sample=False), a2)


def test_parse_methods():
    assert parse_methods("full,snapkv,cake") == ["full", "snapkv", "cake"]
    assert parse_methods("full,cake,select=critical,snapkv") == ["full", "cake,select=critical", "snapkv"]
    assert parse_methods("layers=cake,heads=adakv;snapkv") == ["layers=cake,heads=adakv", "snapkv"]
    assert parse_methods(["full", " h2o "]) == ["full", "h2o"]


def _count_forwards(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls, handle


def test_run_writes_cells_table_and_plots_and_resumes(tiny_llama, tokenizer, tmp_path):
    out = tmp_path / "res.jsonl"
    res = run_eval(tiny_llama, tokenizer, methods="full,snapkv,cake", out=out, **TINY)
    # (1 full + 2 methods x 1 ratio) x 2 scenarios x 2 samples
    assert res.new == len(res.records) == 12 and res.skipped == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 12
    records = [json.loads(line) for line in lines]
    assert all(set(KEY_FIELDS) <= set(r) for r in records)
    for r in records:
        assert 0.0 <= r["score"] <= 1.0 and isinstance(r["prediction"], str)
        assert r["kv_bytes"] <= r["full_kv_bytes"] and r["fidelity_tokens"] == 4
        assert r["kl"] >= 0 and len(r["attn_rel_l1_layers"]) == (4 if r["scenario"] == "context" else 4)
        if r["method"] == FULL:
            assert r["kl"] == 0 and r["kv_bytes"] == r["full_kv_bytes"] and r["nll"] == r["nll_full"]
        else:
            assert 0.4 < r["kv_fraction"] < 0.6 and r["kl"] > 0
    # the full cache answers the same in both scenarios (one shared reference per sample)
    full = {(r["seed"], r["scenario"]): r["prediction"] for r in records if r["method"] == FULL}
    assert full[(0, "question")] == full[(0, "context")]
    for name in ("full cache", "`snapkv`", "`cake`", "question-aware", "context-only", "ratio 0.5"):
        assert name in res.table
    assert sorted(p.name for p in res.plots) == [
        "res_attn.png",
        "res_kl.png",
        "res_layers.png",
        "res_score.png",
    ]
    assert all(p.stat().st_size > 1000 for p in res.plots)
    assert len(load_records(runner.runs_log_path(out))) == 1

    calls, handle = _count_forwards(tiny_llama)
    try:
        again = run_eval(tiny_llama, tokenizer, methods="full,snapkv,cake", out=out, report=False, **TINY)
        assert again.new == 0 and again.skipped == 12 and not calls  # no model call at all
        assert len(out.read_text().splitlines()) == 12
        # drop two lines: only they are recomputed
        out.write_text("\n".join(lines[:-2]) + "\n")
        third = run_eval(tiny_llama, tokenizer, methods="full,snapkv,cake", out=out, report=False, **TINY)
        assert third.new == 2 and third.skipped == 10
        assert len(out.read_text().splitlines()) == 12
        # a new method adds only its own cells
        fourth = run_eval(tiny_llama, tokenizer, methods="full,snapkv,cake,streamingllm", out=out, **TINY)
        assert fourth.new == 4 and fourth.skipped == 12
    finally:
        handle.remove()
    page = render_page(fourth.records, figures=fourth.plots, doc=tmp_path / "doc" / "results.md",
                       methods=["full", "snapkv", "cake", "streamingllm"], command="kvcake eval ...",
                       runs=load_records(runner.runs_log_path(out)))  # fmt: skip
    assert "kvcake eval ..." in page and "](../res_score.png)" in page and "4 run(s)" in page


def test_shared_prefill_matches_per_cell_compression(tiny_llama, tokenizer, tmp_path):
    args = {**TINY, "samples": 1, "methods": "cake,adakv", "report": False}
    shared = run_eval(tiny_llama, tokenizer, out=tmp_path / "a.jsonl", prefill="shared", **args).records
    direct = run_eval(tiny_llama, tokenizer, out=tmp_path / "b.jsonl", prefill="direct", **args).records
    assert len(shared) == len(direct) == 4
    for s, d in zip(shared, direct, strict=True):
        assert (s["method"], s["scenario"]) == (d["method"], d["scenario"])
        assert s["prediction"] == d["prediction"] and s["kv_bytes"] == d["kv_bytes"]
        for key in ("kl", "nll", "attn_rel_l1", "hidden_rel_l1"):
            assert s[key] == pytest.approx(d[key], rel=1e-3, abs=1e-6), key


def test_questions_sharing_a_context_share_one_compression(tiny_llama, tokenizer, tmp_path, monkeypatch):
    """LongBench rows with the same document: context-only compresses it once per method and
    budget; question-aware compresses each row's whole prompt."""
    rows = [
        {"input": "What is green ?", "context": "The grass is green . " * 20, "answers": ["grass"]},
        {"input": "What is blue ?", "context": "The grass is green . " * 20, "answers": ["sky"]},
        {"input": "Where we go ?", "context": "Here we go . " * 25, "answers": ["There"]},
    ]
    (tmp_path / "hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls = []
    real = cells.replay_compress

    def counting(model, method, captured, cache, ids, logits, chunks=None, memo=None, scenario=None):
        calls.append((ids.shape[1], chunks))
        assert scenario == ("context" if chunks == 1 else "question")  # the cell's set of CAKE temperatures
        return real(model, method, captured, cache, ids, logits, chunks=chunks, memo=memo, scenario=scenario)

    monkeypatch.setattr(cells, "replay_compress", counting)
    res = run_eval(tiny_llama, tokenizer, methods="full,snapkv", ratios=(0.5,), tasks=("longbench:hotpotqa",),
                   lengths=(500,), samples=3, longbench_dir=tmp_path, window=WINDOW, max_new_tokens=3,
                   fidelity_tokens=3, out=tmp_path / "lb.jsonl", progress=False, report=False)  # fmt: skip
    assert res.new == 3 * 2 * 2
    assert sum(1 for _, chunks in calls if chunks == 1) == 2  # two distinct contexts
    assert sum(1 for _, chunks in calls if chunks is None) == 3  # one per row
    by_row = {(r["seed"], r["scenario"], r["method"]): r for r in res.records}
    assert by_row[(0, "context", "snapkv")]["kv_bytes"] == by_row[(1, "context", "snapkv")]["kv_bytes"]
    assert {r["task"] for r in res.records} == {"longbench:hotpotqa"}


def test_bad_arguments_fail_before_any_work(tiny_llama, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="unknown method"):
        run_eval(tiny_llama, tokenizer, methods="full,nosuch", out=tmp_path / "x.jsonl", **TINY)
    with pytest.raises(ValueError, match="scenario"):
        run_eval(tiny_llama, tokenizer, scenario="neither", out=tmp_path / "x.jsonl", **TINY)
    with pytest.raises(ValueError, match="unknown task"):
        run_eval(tiny_llama, tokenizer, out=tmp_path / "x.jsonl", **{**TINY, "tasks": ("nosuch",)})
    with pytest.raises(ValueError, match="longbench_dir"):
        run_eval(tiny_llama, tokenizer, out=tmp_path / "x.jsonl", **{**TINY, "tasks": ("longbench:trec",)})
    for bad in (-3, 0, 2.5):  # -3 wrote empty answers that a rerun then kept; 0 ran each task's own length
        with pytest.raises(ValueError, match=f"max_new_tokens must be a positive int .*, got {bad}"):
            run_eval(tiny_llama, tokenizer, out=tmp_path / "x.jsonl", **{**TINY, "max_new_tokens": bad})
    assert not (tmp_path / "x.jsonl").exists() or not (tmp_path / "x.jsonl").read_text()


def test_a_length_past_the_models_positions_fails_before_any_work(tiny_llama, tokenizer, tmp_path):
    """The tiny Llama reads 4096 positions: a 5000-token sample is refused by task and length
    (before, it ran and scored a cell on positions the model never learned)."""
    calls, handle = _count_forwards(tiny_llama)
    try:
        with pytest.raises(ValueError, match=r"niah_single at length 5000 .*4096.*shorter --lengths"):
            run_eval(tiny_llama, tokenizer, out=tmp_path / "x.jsonl", **{**TINY, "lengths": (90, 5000)})
    finally:
        handle.remove()
    assert calls == [] and not (tmp_path / "x.jsonl").exists()


def test_command_line_through_kvcake_and_python_m(make_tiny_llama, tokenizer, tmp_path, capsys):
    """``kvcake eval`` (the top-level command) and ``python -m kvcake.eval``'s ``main`` on a saved
    tiny model: JSONL, table on stdout, plots and a results page; the second command resumes."""
    from kvcake import cli as top
    from kvcake.eval import cli

    folder = tmp_path / "model"
    make_tiny_llama().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "runs" / "r.jsonl"
    args = ["--model", str(folder), "--methods", "full,streamingllm", "--ratios", "0.5", "--tasks",
            "niah_single", "--lengths", "90", "--samples", "1", "--haystack", "noise", "--window", "4",
            "--max-new-tokens", "2", "--fidelity-tokens", "2", "--scenario", "context", "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert top.main(["eval", *args]) == 0
    printed = capsys.readouterr().out
    assert "context-only" in printed and "`streamingllm`" in printed and "2 new cells" in printed
    assert len(out.read_text().splitlines()) == 2
    assert (tmp_path / "runs" / "r_score.png").is_file() and (tmp_path / "runs" / "r_kl.png").is_file()
    doc = tmp_path / "docs" / "results.md"
    assert cli.main([*args, "--doc", str(doc)]) == 0
    assert "0 new cells, 2 resumed" in capsys.readouterr().out
    page = doc.read_text()
    assert "python -m kvcake.eval --model" in page and "## context-only" in page
    assert "![r_score](../runs/r_score.png)" in page
    # --report-only runs nothing and says which cells are missing
    partial = [a if a != "full,streamingllm" else "full,streamingllm,snapkv" for a in args]
    assert cli.main([*partial, "--doc", str(doc), "--report-only"]) == 0
    assert "1 requested cells are not in" in capsys.readouterr().out
    assert "Partial results: 1 of the 3 requested cells" in doc.read_text()
    assert len(out.read_text().splitlines()) == 2


def test_summary_of_records():
    rec = {
        "model": "m",
        "model_fp": "f",
        "task": "t",
        "length": 10,
        "seed": 0,
        "window": 4,
        "max_new_tokens": 2,
    }
    records = [
        {**rec, "method": FULL, "budget": None, "ratio": None, "scenario": "question", "score": 1.0, "kl": 0.0},
        {**rec, "method": "a", "budget": None, "ratio": 0.1, "scenario": "question", "score": 0.0, "kl": 2.0},
        {**rec, "method": "a", "budget": None, "ratio": 0.5, "scenario": "question", "score": 1.0, "kl": 0.5},
        {**rec, "method": "a", "budget": None, "ratio": 0.5, "scenario": "question", "score": 0.0, "kl": 1.5,
         "seed": 1},
    ]  # fmt: skip
    table = summary_markdown(records)
    assert "| method | ratio 0.1 | ratio 0.5 |" in table
    assert "| full cache | 100 | 100 |" in table and "| `a` | 0 | 50 |" in table
    assert "| `a` | 2.0000 | 1.0000 |" in table


def test_a_calibration_that_changes_one_scenarios_set_reruns_only_that_scenarios_cells(
    tiny_llama, tokenizer, tmp_path, monkeypatch
):
    from kvcake import temperatures
    from kvcake.models import model_fingerprint
    from kvcake.temperatures import Calibration, TauPoint, save_calibration

    monkeypatch.setenv("KVCAKE_CACHE_DIR", str(tmp_path / "models"))
    monkeypatch.setattr(temperatures, "SHIPPED_DIR", tmp_path / "shipped")
    fp, question = model_fingerprint(tiny_llama), (TauPoint(12.0, 2.0, 0.5),)
    save_calibration(Calibration(fp, {"question": question, "context": (TauPoint(12.0, 1.0, 3.0),)}, "m"))
    out = tmp_path / "res.jsonl"
    first = run_eval(tiny_llama, tokenizer, methods="full,cake", out=out, report=False, **TINY)
    save_calibration(Calibration(fp, {"question": question, "context": (TauPoint(12.0, 50.0, 50.0),)}, "m"))
    again = run_eval(tiny_llama, tokenizer, methods="full,cake", out=out, report=False, **TINY)
    assert again.new == 2 and again.skipped == first.new - 2  # cake's context-only cells, one per sample
    label = {(r["scenario"], r["method"]): r["tau"] for r in again.records}
    old = {(r["scenario"], r["method"]): r["tau"] for r in first.records}
    assert label[("question", "cake")] == old[("question", "cake")] != label[("context", "cake")]
    assert label[("context", "cake")] != old[("context", "cake")] and label[("context", "full")] is None


@pytest.mark.parametrize("prefill", ["shared", "direct"])
def test_a_float8_method_is_measured_beside_its_model_dtype_self(
    tiny_llama, tokenizer, tmp_path, prefill, monkeypatch
):
    """``snapkv+fp8``: SnapKV with its kept entries in float8 (``kvcake.fp8``), in both scenarios: the
    replayed prefill stored afterwards (``fp8.store``) or ``kv_dtype="fp8"`` directly; a quarter of
    float32's bytes (without the rings, ``RECENT = 0``: their bytes are ``tests/test_fp8.py``'s), a
    KL of its own."""
    monkeypatch.setattr(fp8, "RECENT", 0)
    res = run_eval(tiny_llama, tokenizer, methods="full,snapkv,snapkv+fp8", out=tmp_path / "r.jsonl",
                   prefill=prefill, report=False, **TINY)  # fmt: skip
    rows = {(r["method"], r["scenario"], r["sample"]): r for r in res.records}
    assert sum(m == "snapkv+fp8" for m, _, _ in rows) == 4  # 2 scenarios x 2 samples
    for (method, scenario, sample), r in rows.items():
        if method == "snapkv+fp8":
            plain = rows[("snapkv", scenario, sample)]
            assert r["kv_bytes"] * 4 == plain["kv_bytes"]
            assert r["kl"] is not None and r["kl"] != plain["kl"]


def test_the_float8_section_pairs_each_method_with_its_model_dtype_self(
    tiny_llama, tokenizer, tmp_path, monkeypatch
):
    """The results page's float8 section: one row per scenario and ratio for ``snapkv+fp8`` beside
    ``snapkv``, means over the prompts both have, and beside ``snapkv`` at half the ratio where the
    run has it; nothing without a ``+fp8`` method or its base. (Without the rings, ``RECENT = 0``,
    so float8's bytes are a quarter of float32's.)"""
    monkeypatch.setattr(fp8, "RECENT", 0)
    from kvcake.eval.fp8_section import fp8_section
    from kvcake.eval.tables import mean_of

    res = run_eval(tiny_llama, tokenizer, methods="full,snapkv,snapkv+fp8", out=tmp_path / "r.jsonl",
                   report=False, **{**TINY, "ratios": (0.25, 0.5)})  # fmt: skip
    rows = [line for line in fp8_section(res.records).splitlines() if line.startswith("| `snapkv`")]
    assert len(rows) == 4  # question-aware and context-only, ratios 0.25 and 0.5
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        scenario = {"question-aware": "question", "context-only": "context"}[cells[1]]
        ratio = float(cells[2])
        of = [r for r in res.records if r["scenario"] == scenario]
        at = {
            m: [r for r in of if r["method"] == m and r["ratio"] == ratio] for m in ("snapkv", "snapkv+fp8")
        }
        kl = {m: mean_of(r["kl"] for r in rs)[0] for m, rs in at.items()}
        below = sum(
            f["kl"] <= p["kl"] for f in at["snapkv+fp8"] for p in at["snapkv"] if f["seed"] == p["seed"]
        )
        assert cells[3:6] == [f"{kl['snapkv']:.4g}", f"{kl['snapkv+fp8']:.4g}", f"{below}/2"]
        fraction = {m: mean_of(r["kv_fraction"] for r in rs)[0] for m, rs in at.items()}
        assert cells[8:10] == [f"{fraction['snapkv']:.3f}", f"{fraction['snapkv+fp8']:.3f}"]
        assert fraction["snapkv+fp8"] == pytest.approx(
            fraction["snapkv"] / 4, rel=1e-3
        )  # float32; records round
        half = [r for r in of if r["method"] == "snapkv" and r["ratio"] == ratio / 2]
        if not half:  # no snapkv cell at 0.125
            assert cells[10:] == ["-", "-"]
            continue
        below = sum(f["kl"] <= p["kl"] for f in at["snapkv+fp8"] for p in half if f["seed"] == p["seed"])
        assert cells[10:] == [f"{mean_of(r['kl'] for r in half)[0]:.4g}", f"{below}/2"]
    assert fp8_section([r for r in res.records if r["method"] != "snapkv"]) == ""
    assert fp8_section([r for r in res.records if r["method"] != "snapkv+fp8"]) == ""


def test_a_page_with_float8_methods_has_their_section(make_tiny_llama, tokenizer, tmp_path):
    """``--doc`` with a ``+fp8`` method and its base writes the float8 section on the page."""
    from kvcake.eval import cli

    folder = tmp_path / "model"
    make_tiny_llama().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    args = ["--model", str(folder), "--methods", "full,snapkv,snapkv+fp8", "--ratios", "0.5", "--tasks",
            "niah_single", "--lengths", "90", "--samples", "1", "--haystack", "noise", "--window", "4",
            "--max-new-tokens", "2", "--fidelity-tokens", "2", "--scenario", "context", "--out",
            str(tmp_path / "r.jsonl"), "--no-progress", "--doc", str(tmp_path / "results.md")]  # fmt: skip
    assert cli.main(args) == 0
    page = (tmp_path / "results.md").read_text()
    assert '## Kept entries in float8 (`kv_dtype="fp8"`)' in page
    assert "| `snapkv` | context-only | 0.5 |" in page


def test_stepwise_feeding_keeps_its_own_cells(tiny_llama, tokenizer, tmp_path):
    """``feed="steps"`` (the fidelity measures fed as ``generate`` feeds the cache) is part of a
    cell's key: in the file of a chunk run its cells are new, and a line written before ``feed``
    existed is read as a chunk line."""
    out = tmp_path / "res.jsonl"
    chunk = run_eval(tiny_llama, tokenizer, methods="full,snapkv,h2o", out=out, report=False, **TINY)
    assert chunk.new == 12 and {r["feed"] for r in chunk.records} == {"chunk"}
    steps = run_eval(
        tiny_llama, tokenizer, methods="full,snapkv,h2o", out=out, report=False, feed="steps", **TINY
    )
    assert steps.new == 12 and {r["feed"] for r in steps.records} == {"steps"}
    by = {
        (r["method"], r["seed"], r["scenario"], r["feed"]): r["kl"] for r in [*chunk.records, *steps.records]
    }
    for seed in (0, 1):
        for sc in ("question", "context"):
            assert by[("snapkv", seed, sc, "steps")] == pytest.approx(
                by[("snapkv", seed, sc, "chunk")], rel=1e-4
            )
    lines = out.read_text().splitlines()
    old = [{k: v for k, v in json.loads(line).items() if k != "feed"} for line in lines[:12]]
    out.write_text("".join(json.dumps(r) + "\n" for r in old))
    again = run_eval(tiny_llama, tokenizer, methods="full,snapkv,h2o", out=out, report=False, **TINY)
    assert again.new == 0 and again.skipped == 12
    with pytest.raises(ValueError, match="feed must be 'chunk' or 'steps', got 'tokens'"):
        run_eval(tiny_llama, tokenizer, out=out, feed="tokens", **TINY)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budgets", "16"], "--window 32 is larger than --budgets 16: the window is part of the budget"),
        (["--budgets", "64,8", "--window", "16"], "--window 16 is larger than --budgets 8"),
        (["--window", "0"], "--window must be at least 1 token, got 0"),
    ],
)
def test_the_window_is_checked_against_the_budgets_by_their_flags(args, message, monkeypatch, capsys):
    """``make_method``'s message named ``window=`` and ``budget=``, keywords the command line has not."""
    from kvcake import cli as top

    monkeypatch.setattr(kvcake, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert top.main(["eval", "--methods", "snapkv", *args]) == 2
    assert message in capsys.readouterr().err
