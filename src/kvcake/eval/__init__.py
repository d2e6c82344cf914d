"""Evaluation: RULER / NeedleBench-style synthetic tasks, LongBench, their scoring, and the runner
(``run_eval``, ``kvcake eval``) that scores compression methods on them in both scenarios."""

from kvcake.eval.longbench import LongBenchSample, load_longbench, truncate_prompt, truncate_split
from kvcake.eval.metrics import (
    LONGBENCH_METRICS,
    score_longbench,
    score_ruler,
    string_match_all,
    string_match_part,
)
from kvcake.eval.runner import EvalResult, run_eval
from kvcake.eval.tasks import TASKS, Sample, make_samples
from kvcake.haystack import FileHaystack, Haystack, NoiseHaystack, PaulGrahamHaystack, resolve_haystack

__all__ = [
    "LONGBENCH_METRICS",
    "TASKS",
    "EvalResult",
    "FileHaystack",
    "Haystack",
    "LongBenchSample",
    "NoiseHaystack",
    "PaulGrahamHaystack",
    "Sample",
    "load_longbench",
    "make_samples",
    "resolve_haystack",
    "run_eval",
    "score_longbench",
    "score_ruler",
    "string_match_all",
    "string_match_part",
    "truncate_prompt",
    "truncate_split",
]
