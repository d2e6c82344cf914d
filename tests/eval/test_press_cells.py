"""``kvcake eval --methods kvpress:<preset>``: kvpress's presses as rows of the eval (kvcake.eval.press_cells).

kvpress is not among the development requirements (0.5 requires transformers < 5.3), so the rows'
plumbing (the prefill inside the press, the question and answer at their own positions after a
cache shorter than the prompt, the cache cropped back between questions, the teacher forcing) is
tested with stand-in presses: one that keeps everything must answer as the full cache, one that
keeps the last entries must hold that many bytes and answer each question as if it were alone.
The real presses are checked where kvpress is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from test_runner import TINY, WINDOW, one_thread, tokenizer  # noqa: F401  (fixtures)

try:  # the real kvpress, where installed, imported before any test enables kvcake (kvpress_rows._kvpress)
    import kvpress  # noqa: F401
except ImportError:
    pass

import kvcake
from kvcake.bench.kvpress_rows import PRESSES, press_context
from kvcake.eval import press_cells
from kvcake.eval.runner import FULL, run_eval
from kvcake.eval.suites import KVPRESS_ADAKV, KVPRESS_CRITICAL, KVPRESS_CRITICAL_ADAKV, KVPRESS_POOLING
from kvcake.method import make_method
from kvcake.scorers.streaming import StreamingScorer
from kvpress_standin import StandinPress, install


@pytest.fixture
def standin(monkeypatch):
    return install(monkeypatch)


def _by_cell(records) -> dict:
    return {(r["seed"], r["scenario"], r["method"]): r for r in records}


def test_keeping_everything_answers_as_the_full_cache(tiny_llama, tokenizer, tmp_path, monkeypatch, standin):  # noqa: F811
    """Fed at their own positions after the press's cache, the question and the answer match the
    full cache's, and so do the teacher-forced continuation's predictions."""
    monkeypatch.setattr(StandinPress, "keep_all", True)
    res = run_eval(tiny_llama, tokenizer, methods="full,kvpress:snapkv", out=tmp_path / "r.jsonl", **TINY)
    cells = _by_cell(res.records)
    assert len(cells) == 2 * 2 * 2
    for (seed, sc, method), r in cells.items():
        if method == FULL:
            continue
        full = cells[(seed, sc, FULL)]
        assert r["prediction"] == full["prediction"] and r["kv_bytes"] == full["kv_bytes"]
        assert r["kl"] == pytest.approx(0, abs=1e-9) and r["nll"] == pytest.approx(full["nll"], abs=1e-6)
        assert r["attn_rel_l1"] < 1e-5 and r["hidden_rel_l1"] < 1e-5
        assert r["kvpress"] is None and r["tau"] is None  # a stand-in, not an installed release
    assert "`kvpress:snapkv`" in res.table


def test_a_press_holds_its_budget_and_answers_each_question_alone(tiny_llama, tokenizer, tmp_path, standin):  # noqa: F811
    """Questions sharing a document: the press compresses it once, and each question's answer and
    fidelity are those it gets first (the cache cropped back to the compressed document)."""
    rows = [
        {"input": "What is green ?", "context": "The grass is green . " * 20, "answers": ["grass"]},
        {"input": "What is blue sky ?", "context": "The grass is green . " * 20, "answers": ["sky"]},
    ]
    results = []
    for order in (rows, rows[::-1]):
        folder = tmp_path / str(len(results))
        folder.mkdir()
        (folder / "hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in order))
        res = run_eval(tiny_llama, tokenizer, methods="kvpress:snapkv,snapkv", budgets=(40,), ratios=(),
                       tasks=("longbench:hotpotqa",), lengths=(500,), samples=2, longbench_dir=folder,
                       window=WINDOW, max_new_tokens=3, fidelity_tokens=3, scenario="context",
                       out=folder / "lb.jsonl", progress=False, report=False)  # fmt: skip
        results.append({(r["question_tokens"], r["method"]): r for r in res.records})
    first, second = results
    assert len(first) == 4
    for key, r in first.items():
        assert r["prediction"] == second[key]["prediction"] and r["kl"] == second[key]["kl"]
        if key[1] == "kvpress:snapkv":
            assert r["kept_per_head"] == 40
            assert r["kv_bytes"] == first[(key[0], "snapkv")]["kv_bytes"]  # the same 40 entries a layer


def test_after_a_shorter_cache_the_question_and_answer_are_read_at_their_own_positions(tiny_llama, standin):
    """The stand-in keeps a document's last 20 entries; kvcake keeping the same (StreamingLLM without
    sinks, nothing evicted while decoding) answers the same. Fed at the cache's length instead of
    the document's, the answer differs: the test sees the positions."""
    g = torch.Generator().manual_seed(1)
    document, question = (
        torch.randint(3, 128, (1, 60), generator=g),
        torch.randint(3, 128, (1, 6), generator=g),
    )
    method = make_method("streamingllm,decode=none", budget=20, window=WINDOW)
    method = dataclasses.replace(method, scorer=StreamingScorer(n_sink=0))
    expected = kvcake.compress(tiny_llama, document, method).generate(
        question, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    with (
        torch.no_grad(),
        press_context(tiny_llama, "kvpress:streamingllm", budget=20, length=60, window=WINDOW),
    ):
        cache, _ = press_cells._prefill(tiny_llama, document)
        assert cache.get_seq_length() == 20
        answers, first = [], []
        for start in (60, 20):  # the document's length, then (wrongly) the cache's
            out = press_cells._forward(tiny_llama, question, cache, start, logits_to_keep=1)
            first.append(out.logits[:, -1])
            answers.append(press_cells._greedy(tiny_llama, cache, start + 6, out.logits[:, -1], 8, set()))
            press_cells._back_to(cache, 20)
    assert torch.equal(answers[0], expected.sequences[0])
    assert torch.allclose(first[0], expected.logits[0], atol=1e-5)
    assert (first[1] - expected.logits[0]).abs().max() > 1e-3


def test_a_ratio_is_resolved_on_the_compressed_prompt(tiny_llama, tokenizer, tmp_path, standin):  # noqa: F811
    res = run_eval(tiny_llama, tokenizer, methods="kvpress:streamingllm", out=tmp_path / "r.jsonl", **TINY)
    for r in res.records:
        length = r["context_tokens"] + (r["question_tokens"] if r["scenario"] == "question" else 0)
        assert r["kept_per_head"] == round(0.5 * length)
        assert r["kv_fraction"] == pytest.approx(r["kept_per_head"] / length)


def test_bad_press_methods_fail_before_any_work(tiny_llama, tokenizer, tmp_path, standin):  # noqa: F811
    out = tmp_path / "x.jsonl"
    with pytest.raises(ValueError, match="no kvpress press implements h2o"):
        run_eval(tiny_llama, tokenizer, methods="full,kvpress:h2o", out=out, **TINY)
    with pytest.raises(ValueError, match="smaller than the window"):
        run_eval(tiny_llama, tokenizer, methods="kvpress:snapkv", out=out, **{**TINY, "ratios": (0.01,)})
    with pytest.raises(ValueError, match="keeps the whole"):
        run_eval(tiny_llama, tokenizer, methods="kvpress:snapkv", out=out, **{**TINY, "ratios": (1.0,)})
    assert not out.exists() or not out.read_text()


def test_without_kvpress_the_fix_is_named(tiny_llama, tokenizer, tmp_path, monkeypatch):  # noqa: F811
    if "kvpress" in sys.modules:
        pytest.skip("kvpress is installed here")
    monkeypatch.setitem(sys.modules, "kvpress", None)  # import kvpress raises ImportError
    with pytest.raises(ValueError, match="install it in an environment of its own"):
        run_eval(tiny_llama, tokenizer, methods="kvpress:snapkv", out=tmp_path / "x.jsonl", **TINY)


def test_a_report_of_press_rows_needs_no_kvpress(tiny_llama, tokenizer, tmp_path, monkeypatch):  # noqa: F811
    """``--report-only`` renders the records already measured: kvpress's rows need kvpress to be
    measured, not to be read (the kvpress page was rendered from kvpress's environment alone)."""
    out = tmp_path / "x.jsonl"
    with monkeypatch.context() as patch:
        install(patch)
        first = run_eval(tiny_llama, tokenizer, methods="kvpress:snapkv", out=out, report=False, **TINY)
    monkeypatch.setitem(sys.modules, "kvpress", None)  # import kvpress raises ImportError
    again = run_eval(
        tiny_llama, tokenizer, methods="kvpress:snapkv", out=out, report=False, compute=False, **TINY
    )
    assert again.records and [r["kl"] for r in again.records] == [r["kl"] for r in first.records]
    with pytest.raises(
        ValueError, match="install it in an environment of its own"
    ):  # measuring still needs it
        run_eval(tiny_llama, tokenizer, methods="kvpress:snapkv", out=tmp_path / "y.jsonl", **TINY)


def test_budget_below_the_window_or_the_whole_prompt_is_refused():
    assert press_cells.press_budget(None, 0.25, 101, 8) == 25
    assert press_cells.press_budget(64, None, 1000, 8) == 64
    with pytest.raises(ValueError, match="smaller than the window"):
        press_cells.press_budget(4, None, 1000, 8)
    with pytest.raises(ValueError, match="keeps the whole"):
        press_cells.press_budget(1000, None, 1000, 8)


def test_real_presses_keep_their_budget_and_adakv_masks_what_it_drops(tiny_llama, tokenizer, tmp_path):  # noqa: F811
    """kvpress's own SnapKV holds the budget; its Ada-KV holds the whole prompt and masks while the
    answer is decoded (so it is not the full cache), and leaves no mask behind. (Question-aware: on
    this random model kvpress's fake-key search fails for a question's many queries after a masked
    context, ``search_hyperplane``'s ValueError; the eval lets that error through.)"""
    pytest.importorskip("kvpress")
    res = run_eval(tiny_llama, tokenizer, methods="full,kvpress:snapkv,kvpress:adakv",
                   out=tmp_path / "r.jsonl", **{**TINY, "scenario": "question"})  # fmt: skip
    for (_, _, method), r in _by_cell(res.records).items():
        if method == "kvpress:snapkv":
            assert r["kv_fraction"] == pytest.approx(0.5, abs=0.02) and r["kl"] > 0
        elif method == "kvpress:adakv":
            assert r["kv_fraction"] == 1.0 and r["kl"] > 0
            assert isinstance(r["kvpress"], str)
    assert all(getattr(m, "masked_key_indices", None) is None for m in tiny_llama.modules())


def test_the_kvpress_suite_pairs_each_preset_with_its_press():
    from kvcake.eval.cli import add_arguments
    from kvcake.eval.suites import KVPRESS_PAIRS, resolve

    suite = resolve(add_arguments(argparse.ArgumentParser()).parse_args(["--suite", "kvpress"]))
    assert suite["doc"] == "docs/kvpress.md" and not suite["narrowed"] and not suite["ablation"]
    assert set(KVPRESS_PAIRS) == set(PRESSES)  # every press kvcake can name
    for preset in KVPRESS_PAIRS:
        assert suite["methods"].index(f"kvpress:{preset}") == suite["methods"].index(preset) + 1
    for alike in (KVPRESS_POOLING, KVPRESS_CRITICAL, KVPRESS_ADAKV, KVPRESS_CRITICAL_ADAKV):
        assert alike in suite["methods"]
    assert suite["intro"].startswith("## kvcake beside kvpress") and "kvpress 0.5.5" in suite["notes"]


def test_the_pages_notes_hold_on_its_results_file():
    """docs/kvpress.md's hand-written notes, checked on the cells they were written from."""
    path = Path(__file__).parents[2] / "docs" / "figures" / "eval_kvpress.jsonl"
    cells = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        cells[(r["scenario"], r["method"], r["task"], r["seed"])] = r
    prompts = {(t, s) for _, _, t, s in cells}
    assert len(prompts) == 18
    for sc in ("question", "context"):
        for task, seed in prompts:
            kl = {m: r["kl"] for (c, m, t, n), r in cells.items() if (c, t, n) == (sc, task, seed)}
            assert kl["streamingllm"] == pytest.approx(kl["kvpress:streamingllm"], abs=1e-5)
            assert kl["tova"] == pytest.approx(kl["kvpress:tova"], abs=1.4e-3)
            assert kl[KVPRESS_POOLING] == pytest.approx(
                kl["kvpress:snapkv"], rel=1e-4
            )  # SnapKV, pooled alike
            assert kl[KVPRESS_CRITICAL] == pytest.approx(
                kl["kvpress:criticalkv"], rel=1e-4
            )  # CriticalKV, pooled alike, the window counted in the first stage
            for preset, alike in (("adakv", KVPRESS_ADAKV), ("critical-adakv", KVPRESS_CRITICAL_ADAKV)):
                assert kl[alike] == pytest.approx(
                    kl[f"kvpress:{preset}"], rel=1e-4, abs=5e-6
                )  # masked vs removed
            assert kl["kvpress:pyramidkv"] == kl["kvpress:snapkv"]  # kvpress's pyramid fell back to uniform
            for preset in ("adakv", "critical-adakv"):
                assert cells[(sc, f"kvpress:{preset}", task, seed)]["kv_fraction"] == 1.0
                assert cells[(sc, preset, task, seed)]["kv_fraction"] == pytest.approx(0.25, abs=0.01)

    def below(scenario: str, method: str, other: str) -> int:  # prompts where method's KL is the lower
        return sum(
            cells[(scenario, method, t, n)]["kl"] < cells[(scenario, other, t, n)]["kl"] for t, n in prompts
        )

    def close(method: str, other: str) -> int:  # prompt-scenarios where the KLs agree to 1e-4 relative
        return sum(
            cells[(sc, method, t, n)]["kl"] == pytest.approx(cells[(sc, other, t, n)]["kl"], rel=1e-4)
            for sc in ("question", "context")
            for t, n in prompts
        )

    # the notes' prompt counts: the Ada-KV rows configured alike, CriticalKV, SnapKV's pooling, CAKE
    assert (
        close(KVPRESS_ADAKV, "kvpress:adakv"),
        close(KVPRESS_CRITICAL_ADAKV, "kvpress:critical-adakv"),
    ) == (34, 36)
    assert below("question", "kvpress:criticalkv", "criticalkv") == 14
    assert below("context", "kvpress:criticalkv", "criticalkv") == 13
    assert (below("question", "snapkv", "kvpress:snapkv"), below("question", "kvpress:snapkv", "snapkv")) == (
        7,
        11,
    )
    assert (below("question", "cake", "snapkv"), below("context", "cake", "snapkv")) == (2, 12)
