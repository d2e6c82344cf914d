"""LongBench (v1) from local files: loading, the official prompts, truncation, and the context split.

LongBench (Bai et al., 2023, https://arxiv.org/abs/2308.14508; THUDM/LongBench, folder
``LongBench/`` of the repository) is the benchmark the CAKE, Ada-KV and CriticalKV papers report.
The Hub cannot be reached here, so the user downloads ``data.zip`` from
https://huggingface.co/datasets/THUDM/LongBench once and points :func:`load_longbench` at the
unzipped folder, which holds ``{dataset}.jsonl`` (LongBench) and ``{dataset}_e.jsonl``
(LongBench-E, balanced over lengths). Each row has ``input``, ``context``, ``answers``,
``length``, ``dataset``, ``language``, ``all_classes`` and ``_id``.

Reproduced from the official ``config/dataset2prompt.json``, ``config/dataset2maxlen.json`` and
``pred.py``:

- the prompt template of each dataset, filled with ``template.format(context=..., input=...)``;
  the narrativeqa template keeps the official typo "asconcisely" (fixed upstream only in the
  repository's older top-level copy), since published scores were produced with it;
- the maximum number of generated tokens per dataset;
- the truncation rule: a prompt longer than ``max_length`` tokens keeps its first and last
  ``int(max_length / 2)`` tokens, "since the left and right side may contain crucial instructions";
- the datasets on which chat models get no chat template (:data:`NO_CHAT_TEMPLATE_DATASETS`).

For the context-only scenario a prompt is split after ``{context}``: the first part (instruction
and context) is compressed, the rest (question and answer cue) is appended afterwards.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcake.eval.tasks import encode

logger = logging.getLogger(__name__)

LONGBENCH_DATASETS: tuple[str, ...] = (
    "narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa", "musique",
    "dureader", "gov_report", "qmsum", "multi_news", "vcsum", "trec", "triviaqa", "samsum", "lsht",
    "passage_count", "passage_retrieval_en", "passage_retrieval_zh", "lcc", "repobench-p",
)  # fmt: skip
"""The 21 LongBench datasets, in the official order (``pred.py``)."""

LONGBENCH_E_DATASETS: tuple[str, ...] = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa",
    "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)  # fmt: skip
"""The 13 datasets that have a LongBench-E version."""

_QA_PASSAGES = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other "
    "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. "
    "Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
)
_QASPER_RULES = (
    "as concisely as you can, using a single phrase or sentence if possible. If the question cannot be "
    'answered based on the information in the article, write "unanswerable". If the question is a yes/no '
    'question, answer "yes", "no", or "unanswerable". Do not provide any explanation.'
)

DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
        "question asconcisely as you can, using a single phrase if possible. Do not provide any explanation."
        "\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a "
        "single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        f"You are given a scientific article and a question. Answer the question {_QASPER_RULES}\n\n"
        "Article: {context}\n\n Answer the question based on the above article "
        f"{_QASPER_RULES}\n\nQuestion: {{input}}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based "
        "on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\n"
        "Answer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，"
        "不要输出任何其他字词。\n\n问题：{input}\n回答："
    ),
    "hotpotqa": _QA_PASSAGES,
    "2wikimqa": _QA_PASSAGES,
    "musique": _QA_PASSAGES,
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
        "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query "
        "in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
        "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
        "Now, write a one-page summary of all the news.\n\nSummary:"
    ),
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other "
        "words. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully "
        "read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In "
        "other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the "
        "final count of unique paragraphs after removing duplicates. The output format should only contain the "
        "number, such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number "
        'of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", '
        '"Paragraph 2", etc.\n\nThe answer is: '
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n"
        '{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：'
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
"""Prompt templates, as LongBench's ``config/dataset2prompt.json``."""

DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32,
    "2wikimqa": 32, "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512,
    "vcsum": 512, "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32,
    "passage_retrieval_en": 32, "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
}  # fmt: skip
"""Maximum new tokens per dataset, as LongBench's ``config/dataset2maxlen.json``."""

NO_CHAT_TEMPLATE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
"""Few-shot and code datasets: the official ``pred.py`` gives chat models the raw prompt there
("chat models are better off without build prompts on these tasks")."""


def _check_dataset(dataset: str, longbench_e: bool = False) -> None:
    valid = LONGBENCH_E_DATASETS if longbench_e else LONGBENCH_DATASETS
    if dataset not in valid:
        kind = "LongBench-E" if longbench_e else "LongBench"
        raise ValueError(f"unknown {kind} dataset {dataset!r}: valid names are {', '.join(valid)}")


def split_prompt_template(dataset: str) -> tuple[str, str]:
    """The dataset's template cut just after ``{context}``: (instruction + context, question part)."""
    _check_dataset(dataset)
    template = DATASET2PROMPT[dataset]
    cut = template.index("{context}") + len("{context}")
    return template[:cut], template[cut:]


@dataclass(frozen=True)
class LongBenchSample:
    """One LongBench row.

    ``input_text`` is the row's ``input`` (the question, the query to classify, the dialogue to
    summarise, or the code prefix for repobench-p; empty for some datasets). ``id`` is ``_id``.
    """

    dataset: str
    input_text: str
    context: str
    answers: list[str]
    length: int
    language: str
    all_classes: list[str] | None
    id: str

    @property
    def max_new_tokens(self) -> int:
        """Official generation length for this dataset."""
        return DATASET2MAXLEN[self.dataset]

    @property
    def use_chat_template(self) -> bool:
        """Whether the official ``pred.py`` wraps this prompt in a chat model's template."""
        return self.dataset not in NO_CHAT_TEMPLATE_DATASETS

    def prompt(self) -> str:
        """The full official prompt (question-aware scenario)."""
        return DATASET2PROMPT[self.dataset].format(context=self.context, input=self.input_text)

    def context_prompt(self) -> str:
        """The template up to and including the context: what the context-only scenario compresses."""
        return split_prompt_template(self.dataset)[0].format(context=self.context, input=self.input_text)

    def question_prompt(self) -> str:
        """The template after the context, with ``input`` filled: appended after compression."""
        return split_prompt_template(self.dataset)[1].format(context=self.context, input=self.input_text)


def longbench_path(folder: str | os.PathLike[str], dataset: str, longbench_e: bool = False) -> Path:
    """``{folder}/{dataset}.jsonl``, or ``{folder}/{dataset}_e.jsonl`` for LongBench-E."""
    _check_dataset(dataset, longbench_e)
    return Path(folder) / f"{dataset}{'_e' if longbench_e else ''}.jsonl"


_REQUIRED = ("input", "context", "answers")


def _row_to_sample(row: Any, dataset: str, where: str) -> LongBenchSample:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in _REQUIRED if k not in row]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    answers = row["answers"]
    if isinstance(answers, str) or not isinstance(answers, list):
        raise ValueError(f"{where}: 'answers' must be a list of strings")
    classes = row.get("all_classes")
    return LongBenchSample(
        dataset=dataset,
        input_text=row["input"] or "",
        context=row["context"] or "",
        answers=[str(a) for a in answers],
        length=int(row.get("length") or 0),
        language=str(row.get("language") or ""),
        all_classes=None if classes is None else [str(c) for c in classes],
        id=str(row.get("_id") or ""),
    )


def load_longbench(
    folder: str | os.PathLike[str], dataset: str, *, longbench_e: bool = False, limit: int | None = None
) -> list[LongBenchSample]:
    """Rows of one LongBench (or LongBench-E) dataset from the user's local copy.

    Parameters
    ----------
    folder:
        Folder holding the official JSONL files (``data/`` inside LongBench's ``data.zip``).
    dataset:
        One of :data:`LONGBENCH_DATASETS` (:data:`LONGBENCH_E_DATASETS` with ``longbench_e``).
    limit:
        Read at most this many rows, in file order.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    path = longbench_path(folder, dataset, longbench_e)
    if not path.is_file():
        raise FileNotFoundError(
            f"LongBench file not found: {path}. Download data.zip from "
            "https://huggingface.co/datasets/THUDM/LongBench, unzip it and pass the folder holding "
            f"{path.name}"
        )
    samples: list[LongBenchSample] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            samples.append(_row_to_sample(row, dataset, f"{path}:{lineno}"))
            if limit is not None and len(samples) == limit:
                break
    logger.info("loaded %d rows of %s from %s", len(samples), dataset, path)
    return samples


# --------------------------------------------------------------------------------------------
# Truncation
# --------------------------------------------------------------------------------------------


def _check_max_length(max_length: Any) -> None:
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")


def truncate_middle(token_ids: Sequence[int], max_length: int) -> list[int]:
    """LongBench's rule: if longer than ``max_length``, keep ``ids[:half] + ids[-half:]``,
    ``half = int(max_length / 2)`` (so an odd ``max_length`` keeps ``max_length - 1`` tokens)."""
    _check_max_length(max_length)
    ids = list(token_ids)
    if len(ids) <= max_length:
        return ids
    half = int(max_length / 2)
    return ids[:half] + ids[-half:]


def truncate_prompt(tokenizer: Any, prompt: str, max_length: int) -> str:
    """The official ``pred.py`` truncation of a whole prompt, as text.

    The prompt is tokenised with the tokenizer's default special tokens (as ``pred.py`` does), and
    if too long the two halves are decoded separately with ``skip_special_tokens=True`` and joined.
    """
    _check_max_length(max_length)
    ids = encode(tokenizer, prompt, add_special_tokens=True)
    if len(ids) <= max_length:
        return prompt
    half = int(max_length / 2)
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[-half:], skip_special_tokens=True
    )


def truncate_split(tokenizer: Any, context_part: str, question_part: str, max_length: int) -> tuple[str, str]:
    """Official truncation applied to a prompt kept in two parts (context-only scenario).

    The tokens of ``context_part`` (with default special tokens) followed by those of
    ``question_part`` (without) are cut as :func:`truncate_middle` cuts the whole prompt; each part
    keeps its surviving tokens, decoded as in :func:`truncate_prompt`. Usually the whole question
    survives and the context loses its middle. Tokenising the parts separately can differ from
    tokenising the joined prompt by a token at the seam.
    """
    _check_max_length(max_length)
    ctx = encode(tokenizer, context_part, add_special_tokens=True)
    qst = encode(tokenizer, question_part, add_special_tokens=False)
    total = len(ctx) + len(qst)
    if total <= max_length:
        return context_part, question_part
    half = int(max_length / 2)
    tail_start = total - half  # kept: positions [0, half) and [tail_start, total)

    def dec(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True) if ids else ""

    new_ctx = dec(ctx[:half]) + dec(ctx[max(tail_start, half) :])
    q_head = qst[: max(half - len(ctx), 0)]
    q_tail = qst[max(tail_start - len(ctx), len(q_head)) :]
    if len(q_head) + len(q_tail) == len(qst):
        new_qst = question_part  # the whole question survives: keep its text as given
    else:
        new_qst = dec(q_head) + dec(q_tail)
    logger.debug("truncated %d tokens to %d (context %d, question %d)", total, 2 * half, len(ctx), len(qst))
    return new_ctx, new_qst
