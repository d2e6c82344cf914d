"""Scores for RULER and LongBench predictions, re-implemented from the official definitions.

RULER (NVIDIA/RULER ``scripts/eval/synthetic/constants.py``) scores by case-insensitive substring
match. LongBench (Bai et al., 2023, https://arxiv.org/abs/2308.14508; THUDM/LongBench
``LongBench/metrics.py`` and ``eval.py``) uses one metric per dataset, takes the maximum over the
reference answers and reports the mean x 100. The LongBench code depends on ``jieba``,
``fuzzywuzzy`` and ``rouge``; none is needed here:

- ``rouge_l_score`` reproduces ``rouge==1.0.1``'s ``Rouge().get_scores(...)["rouge-l"]["f"]``
  exactly (see its docstring: it is not the textbook ROUGE-L).
- ``code_sim_score`` reproduces ``fuzzywuzzy.fuzz.ratio`` without python-Levenshtein installed,
  i.e. ``difflib.SequenceMatcher``.
- The Chinese metrics tokenise by character instead of with jieba's word segmentation, so their
  values differ from the official ones (usually higher for F1); they are marked as such.

Every metric takes ``(prediction, ground_truth, *, all_classes=None)`` and returns a float in
[0, 1], as the official functions do.
"""

from __future__ import annotations

import difflib
import math
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

Metric = Callable[..., float]

# --------------------------------------------------------------------------------------------
# RULER
# --------------------------------------------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x1f]")


def ruler_postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``: strip, turn control characters into newlines, strip again."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def _hits(prediction: str, references: Sequence[str]) -> list[float]:
    """1.0 for each of ``references`` contained in ``prediction`` (case-insensitive), else 0.0."""
    if isinstance(references, str):
        raise TypeError("references must be a sequence of strings, not one string")
    if not references:
        raise ValueError("references is empty")
    pred = prediction.lower()
    return [1.0 if r.lower() in pred else 0.0 for r in references]


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of ``references`` contained in ``prediction``, case-insensitive (RULER, most tasks)."""
    hits = _hits(prediction, references)
    return sum(hits) / len(hits)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any of ``references`` is contained in ``prediction``, case-insensitive (RULER QA)."""
    return max(_hits(prediction, references))


def score_ruler(
    predictions: Sequence[str], references: Sequence[Sequence[str]], metric: str = "all"
) -> float:
    """RULER's task score: mean of ``string_match_all`` (``metric="all"``) or ``_part`` x 100, 2 decimals.

    Predictions are passed through :func:`ruler_postprocess` first, as RULER's evaluator does.
    """
    fn = {"all": string_match_all, "part": string_match_part}.get(metric)
    if fn is None:
        raise ValueError(f"metric must be 'all' or 'part', got {metric!r}")
    _check_lengths(predictions, references)
    total = sum(fn(ruler_postprocess(p), r) for p, r in zip(predictions, references, strict=True))
    return round(100.0 * total / len(predictions), 2)


# --------------------------------------------------------------------------------------------
# LongBench: text normalisation and F1
# --------------------------------------------------------------------------------------------

_PUNCT = frozenset(string.punctuation)
_ZH_PUNCT = frozenset(
    string.punctuation
    + "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ZH_TOKEN = re.compile(r"[A-Za-z0-9]+|\S")


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower case, drop ASCII punctuation, drop a/an/the, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def normalize_zh_answer(s: str) -> str:
    """LongBench's Chinese normalisation: lower case, drop ASCII and CJK punctuation, drop whitespace."""
    return "".join("".join(ch for ch in s.lower() if ch not in _ZH_PUNCT).split())


def zh_tokens(s: str) -> list[str]:
    """Character-level stand-in for ``jieba.cut``: each CJK character or symbol alone, ASCII
    letter/digit runs whole, whitespace dropped. jieba would group characters into words."""
    return _ZH_TOKEN.findall(s)


def _f1(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    common = Counter(prediction) & Counter(ground_truth)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **_: object) -> float:
    """Token F1 after :func:`normalize_answer` (LongBench English QA, TriviaQA)."""
    return _f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **_: object) -> float:
    """Token F1 on Chinese text, by **character** (official: jieba words; jieba is not available).

    Tokens are :func:`zh_tokens`, each normalised with :func:`normalize_zh_answer`, empty ones
    (punctuation) dropped, as the official code does with jieba's tokens.
    """
    pred = [t for t in map(normalize_zh_answer, zh_tokens(prediction)) if t]
    gold = [t for t in map(normalize_zh_answer, zh_tokens(ground_truth)) if t]
    return _f1(pred, gold)


# --------------------------------------------------------------------------------------------
# LongBench: ROUGE-L as the ``rouge`` package (1.0.1) computes it
# --------------------------------------------------------------------------------------------


def _lcs_words(x: Sequence[str], y: Sequence[str]) -> list[str]:
    """One longest common subsequence of ``x`` and ``y``, reconstructed the way ``rouge`` does
    (``_recon_lcs``: match -> diagonal; else up if ``T[i-1][j] > T[i][j-1]``, otherwise left)."""
    n, m = len(x), len(y)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        xi, row, prev = x[i - 1], table[i], table[i - 1]
        for j in range(1, m + 1):
            row[j] = prev[j - 1] + 1 if xi == y[j - 1] else max(prev[j], row[j - 1])
    out: list[str] = []
    i, j = n, m
    while i > 0 and j > 0:  # iterative; rouge recurses and hits the recursion limit on ~1000 words
        if x[i - 1] == y[j - 1]:
            out.append(x[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return out[::-1]


def _sentences(text: str) -> list[str]:
    # rouge: split on ".", drop empty pieces, collapse whitespace (a blank piece becomes "")
    return [" ".join(s.split()) for s in text.split(".") if len(s) > 0]


def rouge_l_score(prediction: str, ground_truth: str, **_: object) -> float:
    """ROUGE-L F as ``rouge==1.0.1`` returns it in LongBench's ``rouge_score``.

    That package's summary-level ROUGE-L, with its default ``exclusive=True``, is set-based:

    1. Both texts are split into sentences on ``"."`` and each sentence into words on ``" "``
       (case-sensitive, no stemming, punctuation other than "." stays attached to words).
    2. ``m`` and ``n`` are the numbers of **distinct** words of the reference and the prediction.
    3. For every (reference sentence, prediction sentence) pair one LCS is reconstructed
       (:func:`_lcs_words`); ``llcs`` is the number of **distinct words** in the union of all of them.
    4. ``R = llcs / m``, ``P = llcs / n``, ``F = 2PR / (P + R + 1e-8)`` (beta = 1).

    An empty prediction (or one made only of dots) makes ``rouge`` raise, which LongBench turns
    into 0.0; so does this function. Not reproduced: ``rouge``'s recursive LCS reconstruction
    raises ``RecursionError`` (also scored 0.0 by LongBench) when a reference sentence and a
    prediction sentence together exceed about 1000 words; here they are scored normally.
    """
    hyp, ref = _sentences(prediction), _sentences(ground_truth)
    if not hyp or not ref:
        return 0.0
    hyp_words = [s.split(" ") for s in hyp]
    m = len({w for s in ref for w in s.split(" ")})
    n = len({w for s in hyp_words for w in s})
    union: set[str] = set()
    for r in ref:
        r_words = r.split(" ")
        for h in hyp_words:
            union.update(_lcs_words(r_words, h))
    r_lcs, p_lcs = len(union) / m, len(union) / n
    return 2.0 * (p_lcs * r_lcs) / (p_lcs + r_lcs + 1e-8)


def rouge_l_zh_score(prediction: str, ground_truth: str, **_: object) -> float:
    """:func:`rouge_l_score` on space-joined :func:`zh_tokens` (official: jieba words)."""
    return rouge_l_score(" ".join(zh_tokens(prediction)), " ".join(zh_tokens(ground_truth)))


# --------------------------------------------------------------------------------------------
# LongBench: classification, retrieval, counting, code
# --------------------------------------------------------------------------------------------


def classification_score(
    prediction: str, ground_truth: str, *, all_classes: Sequence[str] | None = None, **_: object
) -> float:
    """TREC / LSHT: ``1 / k`` if the gold class is among the ``k`` class names found in the prediction.

    Class names that are substrings of the gold class (but not equal to it) are dropped first.
    The official loop removes them from the list it is iterating over, which skips the entry
    after each removal; that quirk is kept so scores match.
    """
    if all_classes is None:
        raise ValueError("classification_score needs all_classes (the dataset's class names)")
    matches = [c for c in all_classes if c in prediction]
    i = 0
    while i < len(matches):  # = `for term in matches: ... matches.remove(term)`
        term = matches[i]
        i += 1
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _numbers_score(prediction: str, gold: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(1 for x in numbers if x == gold) / len(numbers) if numbers else 0.0


def count_score(prediction: str, ground_truth: str, **_: object) -> float:
    """PassageCount: the fraction of numbers in the prediction that equal the gold count."""
    return _numbers_score(prediction, str(ground_truth))


def retrieval_score(prediction: str, ground_truth: str, **_: object) -> float:
    """PassageRetrieval-en: fraction of numbers in the prediction equal to N of the gold "Paragraph N"."""
    found = re.findall(r"Paragraph (\d+)", ground_truth)
    if not found:
        raise ValueError(f"ground truth {ground_truth!r} does not name a 'Paragraph N'")
    return _numbers_score(prediction, found[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **_: object) -> float:
    """PassageRetrieval-zh: as :func:`retrieval_score` with the gold written "段落N"."""
    found = re.findall(r"段落(\d+)", ground_truth)
    if not found:
        raise ValueError(f"ground truth {ground_truth!r} does not name a '段落N'")
    return _numbers_score(prediction, found[0])


def fuzz_ratio(a: str, b: str) -> int:
    """``fuzzywuzzy.fuzz.ratio`` (0.18, pure-Python path): ``round(100 * SequenceMatcher.ratio())``.

    100 for equal strings (even empty), 0 if exactly one is empty. ``ratio() = 2 M / T`` with ``M``
    the matched characters and ``T`` the total length; ``difflib``'s autojunk heuristic is on, as
    in fuzzywuzzy. With python-Levenshtein installed fuzzywuzzy uses ``Levenshtein.ratio``
    instead, which can differ slightly; LongBench does not pin it.
    """
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim_score(prediction: str, ground_truth: str, **_: object) -> float:
    """LCC / RepoBench-P edit similarity: ``fuzz_ratio / 100`` on the first code line predicted.

    The line is the first one (after leading newlines) that *contains* none of "`", "#", "//"
    (so Markdown fences and comments are skipped); "" if there is none.
    """
    line = next(
        (ln for ln in prediction.lstrip("\n").split("\n") if not any(t in ln for t in ("`", "#", "//"))), ""
    )
    return fuzz_ratio(line, ground_truth) / 100


# --------------------------------------------------------------------------------------------
# LongBench: per-dataset metric and the aggregate score
# --------------------------------------------------------------------------------------------

LONGBENCH_METRICS: dict[str, Metric] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_l_zh_score,
    "gov_report": rouge_l_score,
    "qmsum": rouge_l_score,
    "multi_news": rouge_l_score,
    "vcsum": rouge_l_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_l_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}
"""Dataset -> metric, as ``dataset2metric`` in LongBench's ``eval.py``."""

FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})
"""Few-shot datasets whose prediction is cut to its first line before scoring (LongBench ``eval.py``)."""


def _dataset(name: str) -> str:
    base = name[:-2] if name.endswith("_e") else name  # LongBench-E files are named "<dataset>_e"
    if base not in LONGBENCH_METRICS:
        raise ValueError(
            f"unknown LongBench dataset {name!r}: valid names are {', '.join(LONGBENCH_METRICS)}"
        )
    return base


def _check_lengths(
    predictions: Sequence[object], answers: Sequence[object], *others: Sequence[object]
) -> None:
    if isinstance(predictions, str):
        raise TypeError("predictions must be a sequence of strings, not one string")
    if not predictions:
        raise ValueError("no predictions to score")
    for other in (answers, *others):
        if len(other) != len(predictions):
            raise ValueError(f"got {len(predictions)} predictions but {len(other)} answers / lengths")


def longbench_sample_score(
    dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """One prediction's score in [0, 1]: the dataset's preprocessing, then the max over ``answers``."""
    base = _dataset(dataset)
    if isinstance(answers, str):
        raise TypeError("answers must be a list of reference strings")
    if base in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = LONGBENCH_METRICS[base]
    score = 0.0
    for gold in answers:
        score = max(score, metric(prediction, gold, all_classes=all_classes))
    return score


def score_longbench(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    all_classes: Sequence[str] | None = None,
) -> float:
    """LongBench's ``scorer``: mean per-sample score x 100, rounded to 2 decimals."""
    _check_lengths(predictions, answers)
    total = sum(
        longbench_sample_score(dataset, p, a, all_classes) for p, a in zip(predictions, answers, strict=True)
    )
    return round(100 * total / len(predictions), 2)


def score_longbench_e(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    lengths: Sequence[int],
    all_classes: Sequence[str] | None = None,
) -> dict[str, float]:
    """LongBench-E's ``scorer_e``: scores by length bucket ``0-4k``, ``4-8k``, ``8k+`` (the row's
    ``length`` field, in words). An empty bucket is NaN, as ``np.mean([])`` gives officially."""
    _check_lengths(predictions, answers, lengths)
    buckets: dict[str, list[float]] = {"0-4k": [], "4-8k": [], "8k+": []}
    for p, a, n in zip(predictions, answers, lengths, strict=True):
        key = "0-4k" if n < 4000 else "4-8k" if n < 8000 else "8k+"
        buckets[key].append(longbench_sample_score(dataset, p, a, all_classes))
    return {k: round(100 * sum(v) / len(v), 2) if v else math.nan for k, v in buckets.items()}
