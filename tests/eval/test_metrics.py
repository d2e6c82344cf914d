"""RULER and LongBench metrics against values computed by hand (worked out in the comments)."""

from __future__ import annotations

import math

import pytest

from kvcake.eval.metrics import (
    FIRST_LINE_DATASETS,
    LONGBENCH_METRICS,
    classification_score,
    code_sim_score,
    count_score,
    fuzz_ratio,
    longbench_sample_score,
    normalize_answer,
    qa_f1_score,
    qa_f1_zh_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_l_score,
    rouge_l_zh_score,
    ruler_postprocess,
    score_longbench,
    score_longbench_e,
    score_ruler,
    string_match_all,
    string_match_part,
)

# ------------------------------------------------------------------ RULER


def test_string_match_all_and_part():
    refs = ["tiger", "Paris"]
    assert string_match_all("The TIGER sleeps.", refs) == 0.5  # 1 of 2 references, case-insensitive
    assert string_match_part("The TIGER sleeps.", refs) == 1.0  # any reference
    assert string_match_all("tiger in paris", refs) == 1.0
    assert string_match_all("lion", refs) == string_match_part("lion", refs) == 0.0
    with pytest.raises(TypeError):
        string_match_all("tiger", "tiger")
    with pytest.raises(ValueError):
        string_match_part("tiger", [])


def test_score_ruler_postprocesses_and_averages():
    assert ruler_postprocess("  tiger\x00lion\t ") == "tiger\nlion"
    preds = ["tiger\x07", "Paris and Rome", "none"]
    refs = [["tiger"], ["Paris", "Berlin"], ["x"]]
    # all: (1 + 0.5 + 0) / 3 * 100 = 50.0 ; part: (1 + 1 + 0) / 3 * 100 = 66.67
    assert score_ruler(preds, refs) == 50.0
    assert score_ruler(preds, refs, metric="part") == 66.67
    with pytest.raises(ValueError):
        score_ruler(preds, refs[:2])
    with pytest.raises(ValueError):
        score_ruler(preds, refs, metric="exact")


# ------------------------------------------------------------------ F1


def test_normalize_answer():
    assert normalize_answer("The  Cat, a dog; AN apple!") == "cat dog apple"


def test_qa_f1_by_hand():
    # pred -> "cat sat on mat" (articles and "." removed); gold -> "cat sat on red mat"
    # common = 4, P = 4/4, R = 4/5, F1 = 2 * 1 * 0.8 / 1.8 = 8/9
    assert qa_f1_score("The cat sat on the mat.", "A cat sat on a red mat") == pytest.approx(8 / 9)
    # duplicates count once per occurrence in both: common = min(2, 1) = 1, P = 1/3, R = 1, F1 = 0.5
    assert qa_f1_score("paris paris london", "Paris") == pytest.approx(0.5)
    assert qa_f1_score("nothing", "Paris") == 0.0
    assert qa_f1_score("", "Paris") == 0.0


def test_qa_f1_zh_by_character():
    # pred chars [北, 京] ("。" dropped), gold [北, 京, 市]: P = 1, R = 2/3, F1 = 0.8
    assert qa_f1_zh_score("北京。", "北京市") == pytest.approx(0.8)
    # ASCII runs stay whole: [2023, 年] vs [2023, 年]
    assert qa_f1_zh_score("2023年", "2023 年") == pytest.approx(1.0)


# ------------------------------------------------------------------ ROUGE-L


def test_rouge_l_single_sentence_by_hand():
    # ref words {the, cat, is, on, mat}: m = 5 distinct; pred {the, cat, sat, on, mat}: n = 5 distinct.
    # LCS(ref, pred) = "the cat on the mat", whose distinct words are {the, cat, on, mat}: 4.
    # R = P = 4/5, F = 2 * 0.64 / (1.6 + 1e-8) = 0.8 (the textbook LCS-based value would be 5/6).
    assert rouge_l_score("the cat sat on the mat", "the cat is on the mat") == pytest.approx(0.8, abs=1e-8)


def test_rouge_l_union_over_sentences_by_hand():
    # sentences split on ".": pred ["a b", "c d"], ref ["a c", "b d"].
    # ref "a c": LCS with "a b" = [a], with "c d" = [c]; ref "b d": [b] and [d]. Union = {a, b, c, d}.
    # m = n = 4 distinct words, so R = P = 1 and F = 2 / (2 + 1e-8).
    assert rouge_l_score("a b. c d", "a c. b d") == pytest.approx(1.0, abs=1e-8)
    # case-sensitive and no normalisation: {The, cat} vs {the, cat} share only "cat": R = P = F = 0.5
    assert rouge_l_score("The cat", "the cat") == pytest.approx(0.5, abs=1e-8)


def test_rouge_l_empty_prediction_scores_zero():
    assert rouge_l_score("", "the cat") == 0.0
    assert rouge_l_score("...", "the cat") == 0.0  # only dots: no sentence left, rouge raises, LongBench -> 0


def test_rouge_l_zh_by_character():
    # "今 天 天 气 好" vs "今 天 天 气 很 好": n = 4 distinct, m = 5 distinct, LCS distinct = 4
    # R = 4/5, P = 1, F = 2 * 0.8 / 1.8 = 8/9
    assert rouge_l_zh_score("今天天气好", "今天天气很好") == pytest.approx(8 / 9, abs=1e-7)


# ------------------------------------------------------------------ edit similarity


def test_fuzz_ratio_by_hand():
    # kitten / sitting: matching blocks "itt" + "n" = 4 chars of 13 -> 2 * 4 / 13 = 0.615 -> 62
    assert fuzz_ratio("kitten", "sitting") == 62
    assert fuzz_ratio("", "") == 100  # equal strings first, as fuzzywuzzy
    assert fuzz_ratio("", "x") == 0


def test_code_sim_takes_first_code_line():
    # fences and comment lines are skipped; the first remaining line is compared
    assert code_sim_score("```python\n# set x\nx = foo(1)\nreturn x\n```", "x = foo(1)") == 1.0
    # "return y;" vs "return x;": "return " + ";" = 8 matching chars of 18 -> 16/18 = 0.889 -> 89
    assert code_sim_score("\n\n// c-style comment\nreturn y;", "return x;") == 0.89
    # official rule: a line *containing* "#" is skipped, even inside a string
    assert code_sim_score('s = "#"\nreturn x;', "return x;") == 1.0
    assert code_sim_score("# only comments", "x = 1") == 0.0  # no code line -> ""


# ------------------------------------------------------------------ classification, retrieval, count


def test_classification_by_hand():
    classes = ["Animal", "Food", "Color"]
    assert classification_score("Animal", "Animal", all_classes=classes) == 1.0
    assert classification_score("Animal or Food", "Food", all_classes=classes) == 0.5  # 2 classes named
    assert classification_score("Color", "Food", all_classes=classes) == 0.0
    # names that are substrings of the gold class are dropped: ["Sport", "Sports event"] -> 1 class
    assert classification_score("Sports event", "Sports event", all_classes=["Sport", "Sports event"]) == 1.0
    # the official loop removes while iterating, skipping the next entry: "Spo" survives -> 1/2
    assert (
        classification_score("Sports event", "Sports event", all_classes=["Sport", "Spo", "Sports event"])
        == 0.5
    )
    with pytest.raises(ValueError):
        classification_score("Animal", "Animal")


def test_retrieval_and_count_by_hand():
    assert retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert retrieval_score("Paragraph 2 or Paragraph 12", "Paragraph 12") == 0.5  # numbers [2, 12]
    assert retrieval_score("I do not know", "Paragraph 12") == 0.0
    assert retrieval_zh_score("答案是段落3", "段落3") == 1.0
    with pytest.raises(ValueError):
        retrieval_score("Paragraph 1", "the first one")
    assert count_score("There are 3 unique paragraphs, not 4", "3") == 0.5  # numbers [3, 4]
    assert count_score("three", "3") == 0.0


# ------------------------------------------------------------------ LongBench aggregation


def test_metric_table_matches_longbench_eval():
    assert set(LONGBENCH_METRICS) == {
        "narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa", "musique",
        "dureader", "gov_report", "qmsum", "multi_news", "vcsum", "trec", "triviaqa", "samsum", "lsht",
        "passage_retrieval_en", "passage_count", "passage_retrieval_zh", "lcc", "repobench-p",
    }  # fmt: skip
    assert LONGBENCH_METRICS["gov_report"] is rouge_l_score
    assert LONGBENCH_METRICS["dureader"] is rouge_l_zh_score
    assert LONGBENCH_METRICS["multifieldqa_zh"] is qa_f1_zh_score
    assert LONGBENCH_METRICS["trec"] is LONGBENCH_METRICS["lsht"] is classification_score
    assert LONGBENCH_METRICS["lcc"] is LONGBENCH_METRICS["repobench-p"] is code_sim_score
    assert FIRST_LINE_DATASETS == {"trec", "triviaqa", "samsum", "lsht"}


def test_first_line_preprocessing():
    classes = ["Animal", "Food"]
    # trec: only the first line "Animal" is scored (the whole text would name both classes: 0.5)
    assert longbench_sample_score("trec", "\nAnimal\nFood", ["Food"], classes) == 0.0
    assert longbench_sample_score("trec", "\nFood\nAnimal", ["Food"], classes) == 1.0
    # triviaqa: first line "Paris" vs gold "London" -> 0; hotpotqa (no cut) sees "London" -> F1 > 0
    assert longbench_sample_score("triviaqa", "\nParis\nLondon", ["London"]) == 0.0
    assert longbench_sample_score("hotpotqa", "\nParis\nLondon", ["London"]) == pytest.approx(2 / 3)


def test_score_longbench_max_over_references_mean_times_100():
    preds = ["Paris", "the London", "Rome"]
    answers = [["paris"], ["Berlin", "London"], ["Madrid"]]
    # per sample: 1.0, max(0, 1.0) = 1.0, 0.0 -> mean 2/3 -> 66.67
    assert score_longbench("hotpotqa", preds, answers) == 66.67
    assert score_longbench("hotpotqa_e", preds, answers) == 66.67  # LongBench-E file names
    with pytest.raises(ValueError, match="narrativeqa"):
        score_longbench("squad", preds, answers)
    with pytest.raises(ValueError):
        score_longbench("hotpotqa", preds, answers[:2])
    with pytest.raises(ValueError):
        score_longbench("hotpotqa", [], [])


def test_score_longbench_e_buckets():
    preds, answers = ["paris", "rome", "oslo"], [["Paris"], ["Berlin"], ["Oslo"]]
    got = score_longbench_e("hotpotqa", preds, answers, lengths=[100, 3999, 9000])
    assert got["0-4k"] == 50.0 and got["8k+"] == 100.0 and math.isnan(got["4-8k"])
