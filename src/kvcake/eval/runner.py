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
(:func:`kvcake.replay.replay_compress`; the prefill's forward is the same for every
method, only what is kept differs). ``prefill="direct"`` runs ``kvcake.generate`` and
``kvcake.compress`` for each cell instead: the same answers, one model prefill per cell.

Answers are greedy and stop at EOS or ``max_new_tokens``. The full cache's answer is the start
of its fidelity continuation (``fidelity_tokens`` greedy tokens, not stopped at EOS). A compressed
question-aware answer takes its first token from the prefill's last logits and the rest from
``model.generate`` on the compressed cache: what ``kvcake.generate`` does in one call (the tests
check that both give the same answers). A context-only answer is ``ctx.generate(question)``.

A method ``kvpress:<preset>`` (``kvpress:snapkv``) is NVIDIA kvpress's press for that preset, told
the same budget and window, answered as kvpress's pipeline answers (:mod:`kvcake.eval.press_cells`;
run from an environment with kvpress installed), so its rows stand beside kvcake's in one table.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import kvcake
from kvcake.context import check_positions
from kvcake.eval.cells import run_group
from kvcake.eval.press_cells import check_press_methods, is_press
from kvcake.eval.questions import (
    DEFAULT_MAX_NEW_TOKENS,
    LONGBENCH_PREFIX,
    ContextGroup,
    groups_for,
    options_label,
    task_options_for,
)
from kvcake.eval.records import (
    FULL,
    KEY_FIELDS,
    SCENARIOS,
    cell_key,
    load_records,
    log_run,
    parse_methods,
    runs_log_path,
)
from kvcake.eval.reference import full_reference
from kvcake.fp8 import storage_spec
from kvcake.method import make_method
from kvcake.models import model_fingerprint
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
    "runs_log_path",
]


def _budget_settings(
    budgets: Sequence[int], ratios: Sequence[float]
) -> list[tuple[int | None, float | None]]:
    settings = [(int(b), None) for b in budgets] + [(None, float(r)) for r in ratios]
    if not settings:
        raise ValueError("give at least one budget (budgets=) or ratio (ratios=)")
    return settings


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
    feed: str = "chunk",
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
        baseline (one cell per task, length, scenario and sample, whatever the budgets);
        ``"kvpress:<preset>"`` kvpress's press for a preset (:mod:`kvcake.eval.press_cells`).
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
    feed:
        How the fidelity measures feed a compressed cache the appended tokens
        (``kvcake.replay.teacher_force``): ``"chunk"``, one forward (a ``decode=fixed`` preset
        evicts after it, so its predictions see entries ``generate`` would have evicted), or
        ``"steps"``, as ``generate`` feeds them. ``feed`` is part of a cell's key, so the two
        never stand for each other in one file (a line without it was fed in one chunk).
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
    if max_new_tokens is not None and (type(max_new_tokens) is not int or max_new_tokens < 1):
        raise ValueError(
            f"max_new_tokens must be a positive int (or None: each task's own), got {max_new_tokens!r}"
        )
    if feed not in ("chunk", "steps"):
        raise ValueError(f"feed must be 'chunk' or 'steps', got {feed!r}")
    scenarios = list(SCENARIOS) if scenario == "both" else [scenario]
    method_specs = parse_methods(methods)
    if not method_specs:
        raise ValueError("give at least one method")
    settings = _budget_settings(budgets, ratios)
    compressed = [m for m in method_specs if m != FULL and not is_press(m)]
    if compute:  # ``kvpress:snapkv``: kvpress's press (kvcake.eval.press_cells); a report reads its records
        check_press_methods(method_specs)
    for name in compressed:  # fail on a bad spec before any work (``cake+fp8``: fp8.storage_spec)
        for b, r in settings:
            make_method(storage_spec(name)[0], budget=b, ratio=r, window=window)
    if model is None:
        model_name = model_name or kvcake.DEFAULT_MODEL
        model, tokenizer = kvcake.load_model(model_name)
    elif tokenizer is None:
        raise ValueError("pass the tokenizer with the model")
    model_name = model_name or str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
    fp = model_fingerprint(model)
    shared = prefill == "shared"
    # CAKE's temperatures in force (source + hash of the scenario's set): a calibration that changes
    # a scenario's set reruns that scenario's cells
    taus = {(spec, sc): method_tau_label(model, make_method(storage_spec(spec)[0], ratio=0.5), sc)
            for spec in compressed for sc in scenarios}  # fmt: skip
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = {cell_key(r): r for r in load_records(path)}
    haystack_label = str(haystack)

    # every cell, grouped by context, to know what is left before building the full reference
    plan: list[tuple[ContextGroup, dict[str, Any], list[dict[str, Any]]]] = []
    for task in tasks:
        opts = {} if task.startswith(LONGBENCH_PREFIX) else task_options_for(task, needle_style, task_options)
        for length in lengths:
            groups = groups_for(task, tokenizer, samples, length, seed, haystack, opts, max_new_tokens,
                                 longbench_dir)  # fmt: skip
            for group in groups:
                cells = []
                for q in group.questions:
                    _check_fits(model, group, q, max(q.max_new_tokens, fidelity_tokens if fidelity else 0))
                    base = {
                        "model": model_name, "model_fp": fp, "task": task, "task_options": options_label(opts),
                        "length": length, "seed": q.seed, "sample": q.sample,
                        "haystack": None if task.startswith(LONGBENCH_PREFIX) else haystack_label,
                        "window": window, "max_new_tokens": q.max_new_tokens, "prefill": prefill,
                        "feed": feed,
                    }  # fmt: skip
                    for sc in scenarios:
                        for spec in method_specs:
                            for b, r in [(None, None)] if spec == FULL else settings:
                                cells.append({**base, "method": spec, "budget": b, "ratio": r, "scenario": sc,
                                              "tau": taus.get((spec, sc)), "_question": q})  # fmt: skip
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
                ref = full_reference(model, group, shared, fidelity, fidelity_tokens, scenarios)
                for record in run_group(model, tokenizer, group, ref, left, window, shared, fidelity,
                                         fidelity_tokens, feed == "steps"):  # fmt: skip
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
            log_run(path, started, new, skipped, command, model_name)
    records = [done[k] for k in all_keys if k in done]
    table, plots = "", []
    if report:
        from kvcake.eval.report import summary_markdown, write_plots

        table = summary_markdown(records, methods=method_specs)
        plots = write_plots(records, path.with_suffix(""), methods=method_specs)
    missing = len(all_keys) - len(records)
    return EvalResult(records, new, skipped, table, plots, path, time.perf_counter() - started, missing)


def _check_fits(model, group: ContextGroup, q, new_tokens: int) -> None:
    """Refuse, before any compute, a sample whose context, question and answer pass the model's
    positions (``--lengths`` asked for more than the model reads), naming the task and length."""
    try:
        check_positions(model, group.context.shape[1] + q.ids.shape[1], {"max_new_tokens": new_tokens})
    except ValueError as e:
        raise ValueError(
            f"{group.task} at length {group.length} (sample {q.sample}): {e}; ask for shorter --lengths"
        ) from None
