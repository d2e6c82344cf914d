"""The shared prefill: record one full-cache forward, then rebuild any method's cache from it.

Used by the eval runner (one forward per sample, whatever the number of methods and budgets) and
by CAKE calibration (one forward per calibration prompt, whatever the temperature). It sits below
both, beside the API: it builds on the cache, the method and the attention function only.
"""

from .capture import Captured, attention_modules, attention_outputs, capture_queries
from .compress import ScoreMemo, cache_bytes, replay_compress
from .teacher import TeacherForced, forced, greedy_tokens, kl_per_token, perturbation, rel_l1, teacher_force

__all__ = [
    "Captured",
    "ScoreMemo",
    "TeacherForced",
    "attention_modules",
    "attention_outputs",
    "cache_bytes",
    "capture_queries",
    "forced",
    "greedy_tokens",
    "kl_per_token",
    "perturbation",
    "rel_l1",
    "replay_compress",
    "teacher_force",
]
