"""LongBench loading, official prompts, truncation and the context / question split.

The fixtures are small rows shaped like the official JSONL files, written into ``tmp_path``.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from word_tokenizer import WordTokenizer

from kvcake.eval.longbench import (
    DATASET2MAXLEN,
    DATASET2PROMPT,
    LONGBENCH_DATASETS,
    LONGBENCH_E_DATASETS,
    LongBenchSample,
    load_longbench,
    longbench_path,
    truncate_middle,
    truncate_prompt,
    truncate_split,
)

HOTPOT_ROWS = [
    {
        "input": "Which city hosted both events?",
        "context": "Passage 1:\nThe fair was held in Lyon.\nPassage 2:\nThe games were held in Lyon too.",
        "answers": ["Lyon"],
        "length": 17,
        "dataset": "hotpotqa",
        "language": "en",
        "all_classes": None,
        "_id": "a1b2",
    },
    {
        "input": "Who wrote it?",
        "context": "Passage 1:\nIt was written by Ann Lee.",
        "answers": ["Ann Lee", "Lee"],
        "length": 7,
        "dataset": "hotpotqa",
        "language": "en",
        "all_classes": None,
        "_id": "c3d4",
    },
]
TREC_ROW = {
    "input": "What is the capital of Peru?",
    "context": "Question: Who invented radio?\nType: Individual\nQuestion: How far is the moon?\nType: Distance",
    "answers": ["City"],
    "length": 20,
    "dataset": "trec",
    "language": "en",
    "all_classes": ["Individual", "Distance", "City"],
    "_id": "t1",
}


def _write(folder, name, rows):
    path = folder / name
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def folder(tmp_path):
    _write(tmp_path, "hotpotqa.jsonl", HOTPOT_ROWS)
    _write(tmp_path, "trec.jsonl", [TREC_ROW])
    _write(tmp_path, "qasper_e.jsonl", [{**HOTPOT_ROWS[0], "dataset": "qasper_e", "length": 5000}])
    return tmp_path


# ------------------------------------------------------------------ loading


def test_load_maps_the_official_fields(folder):
    rows = load_longbench(folder, "hotpotqa")
    assert len(rows) == 2
    r = rows[1]
    assert (r.dataset, r.input_text, r.answers, r.length, r.language, r.id) == (
        "hotpotqa",
        "Who wrote it?",
        ["Ann Lee", "Lee"],
        7,
        "en",
        "c3d4",
    )
    assert r.all_classes is None and r.max_new_tokens == 32 and r.use_chat_template
    (t,) = load_longbench(folder, "trec")
    assert t.all_classes == ["Individual", "Distance", "City"] and not t.use_chat_template
    assert load_longbench(folder, "hotpotqa", limit=1) == rows[:1]


def test_load_longbench_e(folder):
    (r,) = load_longbench(folder, "qasper", longbench_e=True)
    assert r.length == 5000 and r.dataset == "qasper"
    assert longbench_path(folder, "qasper", longbench_e=True) == folder / "qasper_e.jsonl"
    with pytest.raises(ValueError, match="LongBench-E"):
        load_longbench(folder, "narrativeqa", longbench_e=True)  # no LongBench-E version


def test_missing_file_names_the_expected_path(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_longbench(tmp_path, "gov_report")
    assert str(tmp_path / "gov_report.jsonl") in str(err.value)
    assert "THUDM/LongBench" in str(err.value)


def test_bad_names_and_rows(folder):
    with pytest.raises(ValueError, match="narrativeqa"):
        load_longbench(folder, "squad")
    (folder / "musique.jsonl").write_text('{"input": "q", "context": "c", "answers": ["a"]}\nnot json\n')
    with pytest.raises(ValueError, match=r"musique.jsonl:2"):
        load_longbench(folder, "musique")
    (folder / "qmsum.jsonl").write_text('{"input": "q", "context": "c"}\n')
    with pytest.raises(ValueError, match="answers"):
        load_longbench(folder, "qmsum")
    with pytest.raises(ValueError):
        load_longbench(folder, "hotpotqa", limit=0)


# ------------------------------------------------------------------ templates


def test_tables_cover_every_dataset():
    assert set(DATASET2PROMPT) == set(DATASET2MAXLEN) == set(LONGBENCH_DATASETS)
    assert len(LONGBENCH_DATASETS) == 21 and set(LONGBENCH_E_DATASETS) <= set(LONGBENCH_DATASETS)
    assert {DATASET2MAXLEN[d] for d in ("gov_report", "qmsum", "multi_news", "vcsum")} == {512}
    assert DATASET2MAXLEN["hotpotqa"] == 32 and DATASET2MAXLEN["samsum"] == 128
    assert "asconcisely" in DATASET2PROMPT["narrativeqa"]  # the official typo, kept on purpose


def test_templates_filled(folder):
    r = load_longbench(folder, "hotpotqa")[0]
    assert r.prompt() == (
        "Answer the question based on the given passages. Only give me the answer and do not output any other "
        "words.\n\nThe following are given passages.\n" + r.context + "\n\nAnswer the question based on the "
        "given passages. Only give me the answer and do not output any other words.\n\nQuestion: "
        "Which city hosted both events?\nAnswer:"
    )
    (t,) = load_longbench(folder, "trec")
    assert t.prompt().endswith(t.context + "\n" + t.input_text)


def _row(dataset: str) -> LongBenchSample:
    return LongBenchSample(dataset, "INPUT{x}", "CONTEXT {y}", ["a"], 3, "en", None, "id")


@pytest.mark.parametrize("dataset", LONGBENCH_DATASETS)
def test_context_question_split(dataset):
    r = _row(dataset)
    ctx, qst = r.context_prompt(), r.question_prompt()
    assert ctx + qst == r.prompt()
    assert ctx.endswith("CONTEXT {y}")  # braces in the data are not format fields
    assert "CONTEXT" not in qst
    if "{input}" in DATASET2PROMPT[dataset]:
        assert "INPUT{x}" in qst and "INPUT" not in ctx
    if dataset == "lcc":
        assert qst == "Next line of code:\n"


# ------------------------------------------------------------------ truncation


def test_truncate_middle_keeps_head_and_tail():
    assert truncate_middle(list(range(10)), 6) == [0, 1, 2, 7, 8, 9]
    assert truncate_middle(list(range(10)), 7) == [0, 1, 2, 7, 8, 9]  # half = int(7 / 2) = 3
    assert truncate_middle(list(range(5)), 6) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        truncate_middle([1, 2, 3], 0)


@given(st.lists(st.integers(), max_size=60), st.integers(min_value=2, max_value=40))
def test_truncate_middle_property(ids, max_length):
    out = truncate_middle(ids, max_length)
    if len(ids) <= max_length:
        assert out == ids
    else:
        half = max_length // 2
        assert out[:half] == ids[:half] and out[half:] == ids[-half:] and len(out) == 2 * half


def test_truncate_prompt_official_rule():
    tok = WordTokenizer()
    words = [f"w{i}" for i in range(20)]
    prompt = " ".join(words)
    assert truncate_prompt(tok, prompt, 64) == prompt
    # 21 tokens with BOS; half = 4: head [BOS, w0, w1, w2], tail [w16 .. w19]; BOS dropped on decode
    out = truncate_prompt(tok, prompt, 8)
    assert out == "w0 w1 w2" + "w16 w17 w18 w19"  # halves decoded separately and joined, as pred.py


def test_truncate_split_keeps_question_and_context_ends():
    tok = WordTokenizer()
    context = " ".join(f"c{i}" for i in range(30))
    question = " q0 q1 q2 q3"
    assert truncate_split(tok, context, question, 100) == (context, question)
    # 31 context tokens (with BOS) + 4 question tokens = 35 > 16: keep positions [0, 8) and [27, 35)
    new_ctx, new_q = truncate_split(tok, context, question, 16)
    assert new_q == question
    assert new_ctx == "c0 c1 c2 c3 c4 c5 c6" + "c26 c27 c28 c29"  # halves decoded separately, as pred.py
    # a question longer than half the budget loses its own beginning, as in the joined prompt
    long_q = " ".join(f"q{i}" for i in range(12))
    new_ctx, new_q = truncate_split(tok, "c0 c1 c2 c3 c4 c5 c6 c7 c8 c9", long_q, 8)
    assert new_ctx.split() == ["c0", "c1", "c2"] and new_q.split() == ["q8", "q9", "q10", "q11"]


def test_truncate_split_matches_whole_prompt_truncation(folder):
    tok = WordTokenizer()
    r = load_longbench(folder, "hotpotqa")[0]
    whole = truncate_prompt(tok, r.prompt(), 30)
    ctx, qst = truncate_split(tok, r.context_prompt(), r.question_prompt(), 30)
    pieces = re.compile(r"\w+|[^\w\s]").findall
    assert pieces(ctx + qst) == pieces(whole)  # same tokens survive, split after the context
