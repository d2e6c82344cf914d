"""The records of an eval run: what identifies a cell, the JSONL results file and its run log."""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvcake.defaults import SCENARIOS
from kvcake.eval.fidelity import Fidelity

logger = logging.getLogger(__name__)

__all__ = ["FULL", "KEY_FIELDS", "SCENARIOS", "cell_key", "load_records", "parse_methods", "runs_log_path"]

FULL = "full"
"""The method name of the uncompressed baseline (a transformers ``DynamicCache``)."""

KEY_FIELDS = (
    "model_fp", "method", "budget", "ratio", "window", "task", "task_options", "length", "scenario", "seed",
    "haystack", "max_new_tokens", "prefill", "tau", "feed",
)  # fmt: skip
"""The fields that identify a cell: a line with the same values is not run again."""

KEY_DEFAULTS = {"feed": "chunk"}
"""What a line without a key field had: lines written before ``feed`` existed fed in one chunk."""


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


def cell_key(record: dict[str, Any]) -> tuple:
    """The identity of a cell (:data:`KEY_FIELDS`), from a record."""
    return tuple(json.dumps(record.get(k, KEY_DEFAULTS.get(k)), sort_keys=True) for k in KEY_FIELDS)


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


def log_run(path: Path, started: float, new: int, skipped: int, command: str | None, model_name: str) -> None:
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


def round_sig(x: float | None, digits: int = 6) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


def fidelity_fields(fid: Fidelity | None) -> dict[str, Any]:
    if fid is None:
        return {}
    rec = fid.as_record()
    for k in ("kl", "nll", "nll_full", "attn_rel_l1", "hidden_rel_l1"):
        rec[k] = round_sig(rec[k])
    return rec
