"""Run compression methods on long-context tasks, in both scenarios, and log every answer.

:func:`run_eval` evaluates every (method, budget or ratio, task, length, scenario, sample) *cell*
and appends one JSON line per cell to a results file; a later call with the same file skips the
cells already there (the key is :data:`KEY_FIELDS`, the model's fingerprint included), so an
interrupted run resumes where it stopped.

Scenarios (see ``docs/METHODS.md``):

- ``question`` (question-aware): the context and the question are compressed together, then the
  answer is generated;
- ``context`` (context-only): the context alone is compressed once (``kvcake.compress``) and each
  of its questions is answered from that same compressed context with ``ctx.generate``, which
  works on a fork: answering never changes it. Questions sharing a context (LongBench rows on the
  same document) share one compression.

Per sample, the full cache (a transformers ``DynamicCache``) runs once, whatever the number of
methods: it gives the ``full`` baseline's answer, the greedy continuation the fidelity measures
use (``kvcake.eval.fidelity``), and, with ``prefill="shared"`` (the default), the queries from
which every method's compressed cache is rebuilt without running the model again
(:func:`kvcake.eval.fidelity.replay_compress`; the prefill's forward is the same for every
method, only what is kept differs). ``prefill="direct"`` runs ``kvcake.generate`` and
``kvcake.compress`` for each cell instead: the same answers, one model prefill per cell.

Answers are greedy and stop at EOS or ``max_new_tokens``. The full cache's answer is the start
of its fidelity continuation (``fidelity_tokens`` greedy tokens, not stopped at EOS). A compressed
question-aware answer takes its first token from the prefill's last logits and the rest from
``model.generate`` on the compressed cache: what ``kvcake.generate`` does in one call (the tests
check that both give the same answers). A context-only answer is ``ctx.generate(question)``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

import kvcake
from kvcake.attention import enable
from kvcake.eval.fidelity import (
    Captured,
    Fidelity,
    ScoreMemo,
    TeacherForced,
    cache_bytes,
    capture_queries,
    compare,
    replay_compress,
    teacher_force,
)
from kvcake.eval.tasks import TASKS, make_samples
from kvcake.method import make_method
from kvcake.models import model_fingerprint
from kvcake.prompts import build_prompt
from kvcake.temperatures import method_tau_label

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "FULL",
    "KEY_FIELDS",
    "SCENARIOS",
    "EvalResult",
    "cell_key",
    "load_records",
    "parse_methods",
    "run_eval",
]

FULL = "full"
"""The method name of the uncompressed baseline (a transformers ``DynamicCache``)."""

SCENARIOS = ("question", "context")

KEY_FIELDS = (
    "model_fp", "method", "budget", "ratio", "window", "task", "task_options", "length", "scenario", "seed",
    "haystack", "max_new_tokens", "prefill", "tau",
)  # fmt: skip
"""The fields that identify a cell: a line with the same values is not run again."""

DEFAULT_MAX_NEW_TOKENS = {
    "niah_single": 12,
    "niah_multikey": 12,
    "niah_multivalue": 32,
    "niah_multiquery": 32,
    "variable_tracking": 32,
    "common_words": 48,
    "multi_needle_reasoning": 12,
}
"""Answer lengths by task when ``max_new_tokens`` is not given (long enough for every reference
answer with the default tokenizer; LongBench datasets use their official lengths)."""

NIAH_TASKS = frozenset(t for t in TASKS if t.startswith("niah_"))
LONGBENCH_PREFIX = "longbench:"


# --------------------------------------------------------------------------------------------
# Inputs: contexts and their questions
# --------------------------------------------------------------------------------------------


@dataclass
class Question:
    """One question about a context: ``ids`` (1, Q) follow the context's ids."""

    sample: int
    seed: int
    ids: torch.Tensor
    answers: list[str]
    score: Callable[[str], float]
    max_new_tokens: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class ContextGroup:
    """A context (1, C) and the questions asked about it (one for a synthetic sample)."""

    task: str
    length: int
    context: torch.Tensor
    questions: list[Question]


def _task_options(task: str, needle_style: str, extra: dict[str, Any] | None) -> dict[str, Any]:
    opts = {"needle_style": needle_style} if task in NIAH_TASKS else {}
    opts.update((extra or {}).get(task, {}))
    return opts


def _options_label(opts: dict[str, Any]) -> str:
    return ",".join(f"{k}={opts[k]}" for k in sorted(opts))


def _synthetic_groups(
    task: str, tokenizer: Any, samples: int, length: int, seed: int, haystack: Any, options: dict[str, Any],
    max_new_tokens: int | None,
) -> list[ContextGroup]:  # fmt: skip
    groups = []
    for i, s in enumerate(
        make_samples(task, tokenizer, samples, length, seed=seed, haystack=haystack, **options)
    ):
        p = build_prompt(
            tokenizer, s.context_prompt(), s.question_prompt(answer_prefix=False), s.answer_prefix
        )
        q = Question(
            sample=i, seed=s.seed, ids=p.question, answers=list(s.answers), score=s.score,
            max_new_tokens=max_new_tokens or DEFAULT_MAX_NEW_TOKENS.get(task, 32),
            info={"depth": s.depth, "target_tokens": s.target_tokens},
        )  # fmt: skip
        groups.append(ContextGroup(task, length, p.context, [q]))
    return groups


def _longbench_groups(
    task: str, tokenizer: Any, samples: int, length: int, folder: str | os.PathLike[str] | None,
    max_new_tokens: int | None,
) -> list[ContextGroup]:  # fmt: skip
    from kvcake.eval.longbench import load_longbench, truncate_split
    from kvcake.eval.metrics import longbench_sample_score

    if folder is None:
        raise ValueError(
            f"task {task!r} needs the LongBench data folder: pass longbench_dir= (--longbench-dir)"
        )
    dataset = task[len(LONGBENCH_PREFIX) :]
    by_context: dict[str, ContextGroup] = {}
    for i, row in enumerate(load_longbench(folder, dataset, limit=samples)):
        ctx_text, q_text = truncate_split(tokenizer, row.context_prompt(), row.question_prompt(), length)
        p = build_prompt(tokenizer, ctx_text, q_text, "", chat=None if row.use_chat_template else False)

        def score(pred: str, row=row) -> float:
            return longbench_sample_score(row.dataset, pred, row.answers, row.all_classes)

        q = Question(
            sample=i, seed=i, ids=p.question, answers=list(row.answers), score=score,
            max_new_tokens=max_new_tokens or row.max_new_tokens, info={"id": row.id, "length_words": row.length},
        )  # fmt: skip
        key = hashlib.sha256(p.context.numpy().tobytes()).hexdigest()
        group = by_context.setdefault(key, ContextGroup(task, length, p.context, []))
        group.questions.append(q)
    return list(by_context.values())


def _groups_for(task: str, tokenizer: Any, samples: int, length: int, seed: int, haystack: Any,
                options: dict[str, Any], max_new_tokens: int | None, longbench_dir) -> list[ContextGroup]:  # fmt: skip
    if task.startswith(LONGBENCH_PREFIX):
        return _longbench_groups(task, tokenizer, samples, length, longbench_dir, max_new_tokens)
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: valid tasks are {', '.join(TASKS)} or longbench:<dataset>")
    return _synthetic_groups(task, tokenizer, samples, length, seed, haystack, options, max_new_tokens)


# --------------------------------------------------------------------------------------------
# Methods and cells
# --------------------------------------------------------------------------------------------


def parse_methods(text: str | Sequence[str]) -> list[str]:
    """Method specs from a comma list: ``"full,snapkv,cake,select=critical"`` -> full, snapkv,
    ``cake,select=critical``. A part with ``=`` continues the method before it (an override or a
    composed spec); use ``;`` between methods to be explicit (``"layers=cake,heads=adakv;snapkv"``)."""
    if not isinstance(text, str):
        return [m.strip() for m in text if m.strip()]
    if ";" in text:
        return [m.strip() for m in text.split(";") if m.strip()]
    methods: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "=" in part and methods and methods[-1] != FULL:
            methods[-1] += "," + part
        else:
            methods.append(part)
    return methods


def _budget_settings(
    budgets: Sequence[int], ratios: Sequence[float]
) -> list[tuple[int | None, float | None]]:
    settings = [(int(b), None) for b in budgets] + [(None, float(r)) for r in ratios]
    if not settings:
        raise ValueError("give at least one budget (budgets=) or ratio (ratios=)")
    return settings


def cell_key(record: dict[str, Any]) -> tuple:
    """The identity of a cell (:data:`KEY_FIELDS`), from a record."""
    return tuple(json.dumps(record.get(k), sort_keys=True) for k in KEY_FIELDS)


def load_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a results file (a missing file has none; a torn last line is skipped)."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                logger.warning("%s:%d: unreadable line skipped (an interrupted write?)", path, lineno)
    return records


@dataclass
class EvalResult:
    """What :func:`run_eval` did: ``records`` of the requested cells (new and resumed), how many
    cells it ran (``new``), skipped (``skipped``: already done) and left ``missing`` (not run:
    ``compute=False``), the summary ``table`` (markdown), the ``plots`` written and the wall-clock
    ``seconds``."""

    records: list[dict[str, Any]]
    new: int
    skipped: int
    table: str
    plots: list[Path]
    path: Path
    seconds: float
    missing: int = 0


# --------------------------------------------------------------------------------------------
# The full-cache reference of one context group
# --------------------------------------------------------------------------------------------


@dataclass
class _QuestionRef:
    question: Question
    cache: DynamicCache  # context + question, full
    captured: Captured | None  # queries of the context and the question (two chunks)
    logits: torch.Tensor  # (1, vocab) of the question's last token
    tokens: torch.Tensor  # (g,) the full cache's greedy continuation
    prefill_s: float
    generate_s: float
    tf: dict[str, TeacherForced] = field(default_factory=dict)  # scenario -> full teacher forcing


@dataclass
class _GroupRef:
    cache: DynamicCache  # context only, full
    captured: Captured | None
    logits: torch.Tensor  # (1, vocab) of the context's last token
    prefill_s: float
    questions: list[_QuestionRef]


def _ones(n: int, device) -> torch.Tensor:
    return torch.ones(1, n, dtype=torch.long, device=device)


def _eos_ids(model) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def _continue(model, cache, prefix: torch.Tensor, logits: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy tokens (n,) after a cache holding ``prefix`` (1, S) whose last logits are ``logits``.

    The first token is the argmax of ``logits``; the rest come from ``model.generate`` on the
    cache (consumed), which processes that token and decodes, stopping at EOS."""
    first = logits.argmax(-1, keepdim=True)  # (1, 1)
    if max_new_tokens <= 1 or int(first) in _eos_ids(model):
        return first[0]
    ids = torch.cat([prefix, first], dim=1)
    with enable(model), torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=max_new_tokens - 1, do_sample=False)  # fmt: skip
    return out[0, prefix.shape[1] :]


def _greedy_tokens(model, cache, prefix_len: int, logits: torch.Tensor, n: int) -> torch.Tensor:
    """Exactly ``n`` greedy tokens (n,) after a full cache holding ``prefix_len`` tokens, not
    stopping at EOS (the fidelity continuation); ``cache`` is consumed."""
    tokens = [logits.argmax(-1)]  # (1,) each
    with torch.no_grad():
        for i in range(1, n):
            mask = _ones(prefix_len + i, logits.device)
            out = model(tokens[-1][:, None], attention_mask=mask, past_key_values=cache, logits_to_keep=1)
            tokens.append(out.logits[:, -1].argmax(-1))
    return torch.cat(tokens)


def _answer(model, tokens: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The answer part of a greedy continuation: up to the first EOS (kept), at most ``max_new_tokens``."""
    eos = _eos_ids(model)
    for i, t in enumerate(tokens[:max_new_tokens].tolist()):
        if t in eos:
            return tokens[: i + 1]
    return tokens[:max_new_tokens]


def _full_reference(model, group: ContextGroup, shared: bool, fidelity: bool, fidelity_tokens: int,
                    scenarios: Sequence[str]) -> _GroupRef:  # fmt: skip
    dev = model.device
    ctx_ids = group.context.to(dev)
    c = ctx_ids.shape[1]
    captured = Captured() if shared else None
    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    with capture_queries(model, captured) if shared else nullcontext(), torch.no_grad():
        out = model(ctx_ids, attention_mask=_ones(c, dev), past_key_values=cache, logits_to_keep=1)
    logits = out.logits[:, -1]  # (1, vocab)
    ref = _GroupRef(cache, captured, logits, time.perf_counter() - t0, [])
    for q in group.questions:
        q_ids = q.ids.to(dev)
        full_ids = torch.cat([ctx_ids, q_ids], dim=1)
        q_cache = copy.deepcopy(cache)
        q_captured = captured.snapshot() if shared else None
        t0 = time.perf_counter()
        with capture_queries(model, q_captured) if shared else nullcontext(), torch.no_grad():
            out = model(
                q_ids, attention_mask=_ones(full_ids.shape[1], dev), past_key_values=q_cache, logits_to_keep=1
            )
        q_logits = out.logits[:, -1]
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        n_gen = max(q.max_new_tokens, fidelity_tokens if fidelity else 0)
        tokens = _greedy_tokens(model, copy.deepcopy(q_cache), full_ids.shape[1], q_logits, n_gen)
        qref = _QuestionRef(q, q_cache, q_captured, q_logits, tokens, prefill_s, time.perf_counter() - t0)
        if fidelity:
            cont = tokens[:fidelity_tokens][None]  # (1, n)
            n = cont.shape[1]
            if "context" in scenarios:
                appended = torch.cat([q_ids, cont[:, :-1]], dim=1)
                qref.tf["context"] = teacher_force(model, copy.deepcopy(cache), c, logits, appended, n)
            if "question" in scenarios:
                qref.tf["question"] = teacher_force(
                    model, copy.deepcopy(q_cache), full_ids.shape[1], q_logits, cont[:, :-1], n
                )
        ref.questions.append(qref)
    return ref


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def _round(x: float | None, digits: int = 6) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


def _fidelity_fields(fid: Fidelity | None) -> dict[str, Any]:
    if fid is None:
        return {}
    rec = fid.as_record()
    for k in ("kl", "nll", "nll_full", "attn_rel_l1", "hidden_rel_l1"):
        rec[k] = _round(rec[k])
    return rec


def run_eval(
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    *,
    model_name: str | None = None,
    methods: str | Sequence[str] = (FULL, "snapkv", "cake"),
    budgets: Sequence[int] = (),
    ratios: Sequence[float] = (0.25,),
    tasks: Sequence[str] = ("niah_single",),
    lengths: Sequence[int] = (2048,),
    samples: int = 2,
    scenario: str = "both",
    seed: int = 0,
    haystack: str | os.PathLike[str] = "paul_graham",
    needle_style: str = "restated",
    task_options: dict[str, dict[str, Any]] | None = None,
    max_new_tokens: int | None = None,
    fidelity: bool = True,
    fidelity_tokens: int = 16,
    window: int = 32,
    out: str | os.PathLike[str] = "eval-results.jsonl",
    longbench_dir: str | os.PathLike[str] | None = None,
    prefill: str = "shared",
    progress: bool = True,
    report: bool = True,
    compute: bool = True,
    command: str | None = None,
) -> EvalResult:
    """Evaluate ``methods`` x (``budgets`` + ``ratios``) on ``tasks`` x ``lengths`` x ``samples``.

    Parameters
    ----------
    model, tokenizer:
        A loaded model and its tokenizer; by default ``kvcake.load_model(model_name)``.
    model_name:
        Recorded in every line (default: the model's ``name_or_path``) and loaded if ``model`` is None.
    methods:
        Presets or composed specs (see :func:`parse_methods`); ``"full"`` is the uncompressed
        baseline (one cell per task, length, scenario and sample, whatever the budgets).
    budgets, ratios:
        Average KV entries per layer, and/or kept fractions of each prompt; every method runs at each.
    tasks:
        Names in :data:`kvcake.eval.tasks.TASKS`, or ``"longbench:<dataset>"`` (with ``longbench_dir``,
        where ``lengths`` are the official middle-truncation lengths and ``samples`` the rows read).
    lengths:
        Target prompt lengths in tokens (synthetic tasks; the chat template adds a few).
    samples:
        Samples per (task, length): seeds ``seed .. seed + samples - 1``.
    scenario:
        ``"question"`` (question-aware), ``"context"`` (context-only) or ``"both"``.
    haystack:
        Filler of the synthetic tasks: ``"paul_graham"``, ``"noise"`` or a text file/folder.
    needle_style:
        Wording of the ``niah_*`` needles (``"restated"`` by default: the default 135M model fails
        RULER's wording even with the full cache on most prompts; see ``kvcake.eval.tasks``).
    task_options:
        Extra options per task, e.g. ``{"niah_single": {"value_type": "numbers"}}``.
    max_new_tokens:
        Answer length for every task (default: :data:`DEFAULT_MAX_NEW_TOKENS`, LongBench's own).
    fidelity, fidelity_tokens:
        Compute the measures of :mod:`kvcake.eval.fidelity` on the full cache's first
        ``fidelity_tokens`` greedy tokens.
    window:
        Observation window of every method.
    out:
        The JSONL results file (appended to; existing cells are skipped). The plots go next to it
        (``<stem>_score.png``, ``<stem>_kl.png``) and a log of runs to ``<stem>.runs.jsonl``.
    prefill:
        ``"shared"`` (one full-cache forward per sample, replayed into each method's cache) or
        ``"direct"`` (``kvcake.generate``/``kvcake.compress`` per cell).
    progress:
        Show a tqdm progress bar on stderr.
    report:
        Build the summary table and write the plots at the end.
    compute:
        ``False`` runs nothing: only the table and plots of the cells already in ``out``.
    command:
        The command line, recorded in ``<stem>.runs.jsonl``.
    """
    started = time.perf_counter()
    if scenario not in ("both", *SCENARIOS):
        raise ValueError(f"scenario must be 'question', 'context' or 'both', got {scenario!r}")
    if prefill not in ("shared", "direct"):
        raise ValueError(f"prefill must be 'shared' or 'direct', got {prefill!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive int, got {samples!r}")
    if isinstance(fidelity_tokens, bool) or not isinstance(fidelity_tokens, int) or fidelity_tokens < 1:
        raise ValueError(f"fidelity_tokens must be a positive int, got {fidelity_tokens!r}")
    scenarios = list(SCENARIOS) if scenario == "both" else [scenario]
    method_specs = parse_methods(methods)
    if not method_specs:
        raise ValueError("give at least one method")
    settings = _budget_settings(budgets, ratios)
    compressed = [m for m in method_specs if m != FULL]
    for spec in compressed:  # fail on a bad spec before any work
        for b, r in settings:
            make_method(spec, budget=b, ratio=r, window=window)
    if model is None:
        model_name = model_name or kvcake.DEFAULT_MODEL
        model, tokenizer = kvcake.load_model(model_name)
    elif tokenizer is None:
        raise ValueError("pass the tokenizer with the model")
    model_name = model_name or str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
    fp = model_fingerprint(model)
    shared = prefill == "shared"
    # CAKE's temperatures in force (source + calibration hash): a new calibration reruns its cells
    taus = {spec: method_tau_label(model, make_method(spec, ratio=0.5)) for spec in compressed}
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = {cell_key(r): r for r in load_records(path)}
    haystack_label = str(haystack)

    # every cell, grouped by context, to know what is left before building the full reference
    plan: list[tuple[ContextGroup, dict[str, Any], list[dict[str, Any]]]] = []
    for task in tasks:
        opts = {} if task.startswith(LONGBENCH_PREFIX) else _task_options(task, needle_style, task_options)
        for length in lengths:
            groups = _groups_for(task, tokenizer, samples, length, seed, haystack, opts, max_new_tokens,
                                 longbench_dir)  # fmt: skip
            for group in groups:
                cells = []
                for q in group.questions:
                    base = {
                        "model": model_name, "model_fp": fp, "task": task, "task_options": _options_label(opts),
                        "length": length, "seed": q.seed, "sample": q.sample,
                        "haystack": None if task.startswith(LONGBENCH_PREFIX) else haystack_label,
                        "window": window, "max_new_tokens": q.max_new_tokens, "prefill": prefill,
                    }  # fmt: skip
                    for sc in scenarios:
                        for spec in method_specs:
                            for b, r in [(None, None)] if spec == FULL else settings:
                                cells.append({**base, "method": spec, "budget": b, "ratio": r, "scenario": sc,
                                              "tau": taus.get(spec), "_question": q})  # fmt: skip
                plan.append((group, opts, cells))
    # sample 0 of every task and length first, then sample 1, ...: a run stopped early covers them all
    plan.sort(key=lambda item: min(q.sample for q in item[0].questions))
    all_keys = [cell_key(c) for _, _, cells in plan for c in cells]
    todo_total = sum(1 for k in all_keys if k not in done)
    skipped = len(all_keys) - todo_total
    logger.info("%d cells: %d to run, %d already in %s", len(all_keys), todo_total, skipped, path)

    from tqdm.auto import tqdm

    bar = tqdm(total=len(all_keys), initial=skipped, desc="kvcake eval", unit="cell", disable=not progress,
               dynamic_ncols=True, file=sys.stderr)  # fmt: skip
    new = 0
    try:
        with path.open("a", encoding="utf-8") as sink:
            for group, _, cells in plan if compute else []:
                left = [c for c in cells if cell_key(c) not in done]
                if not left:
                    continue
                ref = _full_reference(model, group, shared, fidelity, fidelity_tokens, scenarios)
                for record in _run_group(model, tokenizer, group, ref, left, window, shared, fidelity,
                                         fidelity_tokens):  # fmt: skip
                    sink.write(json.dumps(record, sort_keys=True) + "\n")
                    sink.flush()
                    done[cell_key(record)] = record
                    new += 1
                    bar.update(1)
                    bar.set_postfix_str(
                        f"{record['task']} {record['length']} {record['method']}", refresh=False
                    )
                del ref
    finally:
        bar.close()
        if compute:
            _log_run(path, started, new, skipped, command, model_name)
    records = [done[k] for k in all_keys if k in done]
    table, plots = "", []
    if report:
        from kvcake.eval.report import summary_markdown, write_plots

        table = summary_markdown(records, methods=method_specs)
        plots = write_plots(records, path.with_suffix(""), methods=method_specs)
    missing = len(all_keys) - len(records)
    return EvalResult(records, new, skipped, table, plots, path, time.perf_counter() - started, missing)


def _log_run(
    path: Path, started: float, new: int, skipped: int, command: str | None, model_name: str
) -> None:
    entry = {
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "seconds": round(time.perf_counter() - started, 1),
        "new_cells": new,
        "skipped_cells": skipped,
        "command": command,
        "model": model_name,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads",
    }
    with runs_log_path(path).open("a", encoding="utf-8") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")


def runs_log_path(path: str | os.PathLike[str]) -> Path:
    """``<stem>.runs.jsonl`` beside a results file: one line per :func:`run_eval` call."""
    path = Path(path)
    return path.with_name(path.stem + ".runs.jsonl")


def _run_group(model, tokenizer, group: ContextGroup, ref: _GroupRef, cells: list[dict[str, Any]], window: int,
               shared: bool, fidelity: bool, fidelity_tokens: int) -> Iterable[dict[str, Any]]:  # fmt: skip
    """Yield the records of ``cells`` (all about ``group``), compressing each context once per
    method and budget in the context-only scenario."""
    dev = model.device
    ctx_ids = group.context.to(dev)
    c = ctx_ids.shape[1]
    qrefs = {id(r.question): r for r in ref.questions}
    memo = ScoreMemo() if shared else None  # prefill scores, shared by every budget of a method

    def decode(ids: torch.Tensor) -> str:
        return tokenizer.decode(ids.tolist(), skip_special_tokens=True)

    def record(cell: dict[str, Any], tokens: torch.Tensor, fid: Fidelity | None, **extra) -> dict[str, Any]:
        q: Question = cell["_question"]
        pred = decode(tokens[: q.max_new_tokens])
        rec = {k: v for k, v in cell.items() if not k.startswith("_")}
        rec.update(
            context_tokens=c, question_tokens=q.ids.shape[1], prediction=pred, answers=q.answers,
            score=float(q.score(pred)), generated_tokens=int(tokens[: q.max_new_tokens].numel()), **q.info,
        )  # fmt: skip
        rec.update(_fidelity_fields(fid))
        rec.update({k: (_round(v, 4) if isinstance(v, float) else v) for k, v in extra.items()})
        return rec

    # the full cache: one line per scenario, from the shared reference
    for cell in [x for x in cells if x["method"] == FULL]:
        qref = qrefs[id(cell["_question"])]
        sc = cell["scenario"]
        fid = None
        if fidelity:
            tf = qref.tf[sc]
            n = tf.logprobs.shape[0]
            nll = float(-tf.logprobs.gather(1, qref.tokens[:n].reshape(n, 1)).mean())
            fid = Fidelity.identical(nll, len(tf.attn), n, bool(tf.attn))
        full_bytes = cache_bytes(ref.cache if sc == "context" else qref.cache)
        yield record(cell, _answer(model, qref.tokens, cell["max_new_tokens"]), fid, kv_bytes=full_bytes, full_kv_bytes=full_bytes, kv_fraction=1.0,
                     prefill_s=ref.prefill_s + qref.prefill_s, compress_s=0.0, generate_s=qref.generate_s)  # fmt: skip

    by_setting: dict[tuple, list[dict[str, Any]]] = {}
    for cell in cells:
        if cell["method"] != FULL:
            by_setting.setdefault(
                (cell["method"], cell["budget"], cell["ratio"], cell["scenario"]), []
            ).append(cell)
    for (spec, budget, ratio, sc), todo in by_setting.items():
        method = make_method(spec, budget=budget, ratio=ratio, window=window)
        if sc == "context":
            t0 = time.perf_counter()
            if shared:
                ctx = replay_compress(
                    model, method, ref.captured, ref.cache, ctx_ids, ref.logits, chunks=1, memo=memo
                )
            else:
                ctx = kvcake.compress(model, ctx_ids, method)
            compress_s = time.perf_counter() - t0
            kv = ctx.cache.kv_bytes()
            full_bytes = cache_bytes(ref.cache)
            before = _cache_digest(ctx.cache) if len(todo) > 1 else None
            for cell in todo:
                qref = qrefs[id(cell["_question"])]
                q_ids = cell["_question"].ids.to(dev)
                t0 = time.perf_counter()
                tokens = ctx.generate(q_ids, max_new_tokens=cell["max_new_tokens"], do_sample=False)[0]
                generate_s = time.perf_counter() - t0
                fid, fid_s = None, 0.0
                if fidelity:
                    t0 = time.perf_counter()
                    full_tf = qref.tf["context"]
                    n = full_tf.logprobs.shape[0]
                    appended = torch.cat([q_ids, qref.tokens[None, : n - 1]], dim=1)
                    tf = teacher_force(model, ctx.fork(), c, ctx.logits, appended, n)
                    fid = compare(full_tf, tf, qref.tokens[:n])
                    fid_s = time.perf_counter() - t0
                yield record(cell, tokens, fid, kv_bytes=kv, full_kv_bytes=full_bytes, kv_fraction=kv / full_bytes,
                             prefill_s=ref.prefill_s if shared else 0.0, compress_s=compress_s,
                             generate_s=generate_s, fidelity_s=fid_s)  # fmt: skip
            if before is not None and _cache_digest(ctx.cache) != before:
                raise RuntimeError(
                    f"{spec}: answering changed the compressed context (a bug in fork/generate)"
                )
        else:
            for cell in todo:
                q: Question = cell["_question"]
                qref = qrefs[id(q)]
                full_ids = torch.cat([ctx_ids, q.ids.to(dev)], dim=1)
                t0 = time.perf_counter()
                if shared:
                    qctx = replay_compress(
                        model, method, qref.captured, qref.cache, full_ids, qref.logits, memo=memo
                    )
                    compress_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    tokens = _continue(model, qctx.fork(), full_ids, qctx.logits, q.max_new_tokens)
                    generate_s = time.perf_counter() - t0
                else:
                    out, _ = kvcake.generate(
                        model, full_ids, method, max_new_tokens=q.max_new_tokens, do_sample=False
                    )
                    tokens = out[0, full_ids.shape[1] :]
                    generate_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    qctx = kvcake.compress(model, full_ids, method)  # for kv_bytes and fidelity
                    compress_s = time.perf_counter() - t0
                kv = qctx.cache.kv_bytes()
                full_bytes = cache_bytes(qref.cache)
                fid, fid_s = None, 0.0
                if fidelity:
                    t0 = time.perf_counter()
                    full_tf = qref.tf["question"]
                    n = full_tf.logprobs.shape[0]
                    tf = teacher_force(
                        model, qctx.fork(), full_ids.shape[1], qctx.logits, qref.tokens[None, : n - 1], n
                    )
                    fid = compare(full_tf, tf, qref.tokens[:n])
                    fid_s = time.perf_counter() - t0
                yield record(cell, tokens, fid, kv_bytes=kv, full_kv_bytes=full_bytes,
                             kv_fraction=kv / full_bytes,
                             prefill_s=(ref.prefill_s + qref.prefill_s) if shared else 0.0, compress_s=compress_s,
                             generate_s=generate_s, fidelity_s=fid_s)  # fmt: skip


def _cache_digest(cache) -> str:
    """A hash of every layer's keys, values and positions (to check a context is never changed)."""
    h = hashlib.sha256()
    for layer in cache.layers:
        for t in (layer.keys, layer.values, getattr(layer, "positions", None)):
            if t is not None:
                h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
