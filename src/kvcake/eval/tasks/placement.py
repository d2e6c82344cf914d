"""Where needles go: argument checks, depths, insertion at sentence boundaries, length fitting."""

from __future__ import annotations

import bisect
import math
import numbers
import random
import re
from collections.abc import Callable, Sequence
from typing import Any

from kvcake.eval.tasks.vocab import RULER_DEPTHS

# --------------------------------------------------------------------------------------------
# Argument checks, depths, needle insertion and length fitting
# --------------------------------------------------------------------------------------------

Depth = float | Sequence[float] | str | None


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_one_depth(d: Any) -> float:
    if isinstance(d, bool) or not isinstance(d, numbers.Real):
        raise TypeError(f"depth must be a number in [0, 100], got {type(d).__name__}")
    if not math.isfinite(d) or not 0.0 <= d <= 100.0:
        raise ValueError(f"depth must be a percentage in [0, 100], got {d}")
    return float(d)


def _normalise_depth(depth: Any) -> float | tuple[float, ...] | str | None:
    if depth is None or depth == "random":
        return depth
    if isinstance(depth, str):
        raise ValueError(f"depth must be a number, a sequence of numbers, None or 'random', got {depth!r}")
    if isinstance(depth, Sequence):
        if not depth:
            raise ValueError("depth sequence is empty")
        return tuple(_check_one_depth(d) for d in depth)
    return _check_one_depth(depth)


def _depths(depth: float | tuple[float, ...] | str | None, n: int, rng: random.Random) -> list[float]:
    """One requested depth per needle, in placement order."""
    if depth is None:
        return [100.0 * (i + 1) / (n + 1) for i in range(n)]
    if depth == "random":
        grid = rng.sample(RULER_DEPTHS, n) if n <= len(RULER_DEPTHS) else rng.choices(RULER_DEPTHS, k=n)
        return [float(d) for d in grid]
    if isinstance(depth, tuple):
        if len(depth) != n:
            raise ValueError(
                f"got {len(depth)} depths for {n} needles: give one per needle, a number or None"
            )
        return list(depth)
    return [float(depth)] * n


_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")


def _insert(filler: str, needles: Sequence[str], depths: Sequence[float]) -> tuple[str, list[int]]:
    """Insert each needle at the sentence boundary nearest to its depth; return text and char offsets.

    Needles sharing a boundary keep their order. ``filler`` has single spaces (see haystack.py).
    """
    bounds = [0, *(m.end() for m in _SENTENCE_END.finditer(filler)), len(filler)]
    placed = []
    for i, d in enumerate(depths):
        want = d / 100.0 * len(filler)
        j = bisect.bisect_left(bounds, want)
        cands = bounds[max(j - 1, 0) : j + 1]
        placed.append((min(cands, key=lambda b: abs(b - want)), i))
    placed.sort()
    parts: list[str] = []
    offsets = [0] * len(needles)
    length = 0

    def add(text: str) -> int:
        nonlocal length
        if parts:
            length += 1  # the joining space
        start = length
        parts.append(text)
        length += len(text)
        return start

    cur = 0
    for b, i in placed:
        seg = filler[cur:b].strip()
        if seg:
            add(seg)
        offsets[i] = add(needles[i])
        cur = b
    seg = filler[cur:].strip()
    if seg:
        add(seg)
    return " ".join(parts), offsets


def _fit(measure: Callable[[int], int], target: int, lo: int, what: str) -> tuple[int, int]:
    """Largest ``n >= lo`` with ``measure(n) <= target`` (measure: prompt tokens for n filler units).

    Token counts grow with ``n`` up to tokenizer boundary effects; only measured values are
    accepted, so the result never exceeds ``target``.
    """
    base = measure(lo)
    if base > target:
        raise ValueError(
            f"target_tokens={target} is too small for {what}: the prompt has {base} tokens with the "
            "least filler; raise target_tokens"
        )
    best, best_count = lo, base
    probe = lo + 64
    count = measure(probe)
    if count > target:
        hi = probe
    else:
        best, best_count = probe, count
        per_unit = max((count - base) / 64, 1e-3)
        guess = lo + int((target - base) / per_unit)
        for trial in (int(guess * 0.99), int(guess * 1.01) + 2):
            if trial <= best:
                continue
            count = measure(trial)
            if count > target:
                hi = trial
                break
            best, best_count = trial, count
        else:
            hi = best + max(best - lo, 1)
            while (count := measure(hi)) <= target:
                if hi > lo + 4 * target + 256:  # every unit adds at least one token
                    raise RuntimeError(
                        f"the prompt of {what} does not grow with its filler: check the tokenizer"
                    )
                best, best_count = hi, count
                hi = best + max(best - lo, 1)
    while hi - best > 1:  # invariant: measure(best) <= target < measure(hi)
        mid = (best + hi) // 2
        count = measure(mid)
        if count <= target:
            best, best_count = mid, count
        else:
            hi = mid
    return best, best_count
