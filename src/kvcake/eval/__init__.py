"""Evaluation: RULER / NeedleBench-style synthetic tasks, LongBench, their scoring, and the runner
(``run_eval``, ``kvcake eval``) that scores compression methods on them in both scenarios."""

from typing import TYPE_CHECKING

from kvcake.lazy import lazy_exports

# Each public name and the module that defines it, imported on first use: ``kvcake --help``
# builds ``kvcake eval``'s parser without loading torch.
_EXPORTS = {
    "LongBenchSample": "kvcake.eval.longbench",
    "load_longbench": "kvcake.eval.longbench",
    "truncate_prompt": "kvcake.eval.longbench",
    "truncate_split": "kvcake.eval.longbench",
    "LONGBENCH_METRICS": "kvcake.eval.metrics",
    "score_longbench": "kvcake.eval.metrics",
    "score_ruler": "kvcake.eval.metrics",
    "string_match_all": "kvcake.eval.metrics",
    "string_match_part": "kvcake.eval.metrics",
    "EvalResult": "kvcake.eval.runner",
    "run_eval": "kvcake.eval.runner",
    "TASKS": "kvcake.eval.tasks",
    "Sample": "kvcake.eval.tasks",
    "make_samples": "kvcake.eval.tasks",
    "FileHaystack": "kvcake.haystack",
    "Haystack": "kvcake.haystack",
    "NoiseHaystack": "kvcake.haystack",
    "PaulGrahamHaystack": "kvcake.haystack",
    "resolve_haystack": "kvcake.haystack",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # the same names, for type checkers and editors
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
