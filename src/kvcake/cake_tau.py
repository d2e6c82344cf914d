"""CAKE's temperatures for the prompts of one cache: each prompt's own, at its own budget.

A calibration's temperatures depend on the budget per layer (``Calibration.at``: log-log
interpolation between its points), and with ``ratio=`` budgets prompts of different lengths in
one batch have different budgets. Each row's preferences take the temperatures it would take
alone (``SequenceBudgets.tau1``/``tau2``, (B,) float64, which follow the rows as beams and
selections do), so a prompt's layer budgets never depend on the batch it is in
(``tests/test_cake_batch.py``). The calibrated indicator is the scorer's, one per cache: where
the rows' calibration points chose different ones, the cache takes the one at the batch's mean
budget and says so once, naming the fix.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from transformers.cache_utils import Cache

from .temperatures import parse_indicator, resolve_tau

logger = logging.getLogger(__name__)

_warned: set[str] = set()  # fingerprints told that their batch shares an indicator


def choose_temperatures(cache: Cache) -> None:
    """Before the first layer is scored, for CAKE's layer allocation: resolve the rows'
    temperatures (:func:`row_temperatures`) and, where the scorer takes a calibrated indicator
    (``CakeScorer.takes_calibrated_indicator``), use the one its temperatures' calibration chose,
    so both come from the same calibration point (``cache.tau.indicator``)."""
    m = cache.method
    if not m.layers.needs_preferences:
        return
    row_temperatures(cache)
    if getattr(m.scorer, "takes_calibrated_indicator", False) and cache.tau.indicator is not None:
        pooling, kernel = parse_indicator(cache.tau.indicator)
        cache.method = dataclasses.replace(
            m, scorer=dataclasses.replace(m.scorer, pooling=pooling, kernel=kernel)
        )


def row_temperatures(cache: Cache) -> None:
    """Resolve every row's (tau1, tau2) at its own budget per layer into ``cache.seq`` and the
    batch's :class:`~kvcake.temperatures.TauChoice` into ``cache.tau`` (the rows' own where they
    agree; else the one at the batch's mean budget, its indicator the cache's, with each row's
    temperatures in ``rows``)."""
    lay, seq = cache.method.layers, cache.seq

    def at(budget: float):
        return resolve_tau(cache._fingerprint, cache._family, budget, lay.tau1, lay.tau2, lay.tau_from,
                           model_name=cache._model_name, scenario=cache.scenario)  # fmt: skip

    budgets = seq.per_layer.double().tolist()
    own = {b: at(b) for b in sorted(set(budgets))}
    rows = [own[b] for b in budgets]
    seq.tau1 = torch.tensor([c.tau1 for c in rows], dtype=torch.float64)  # host, as seq's other fields
    seq.tau2 = torch.tensor([c.tau2 for c in rows], dtype=torch.float64)  # host
    if len({(c.tau1, c.tau2, c.indicator) for c in rows}) == 1:
        cache.tau = rows[0]
        return
    mean = at(sum(budgets) / len(budgets))
    cache.tau = dataclasses.replace(mean, rows=tuple((c.tau1, c.tau2) for c in rows))
    if len({c.indicator for c in rows}) > 1 and cache._fingerprint not in _warned:
        _warned.add(cache._fingerprint)
        logger.warning(
            "CAKE's calibration chose different indicators for the budgets of this batch's prompts "
            "(%s entries per layer: %s); a cache scores with one, so every prompt takes %s, the one at "
            "the batch's mean budget (each prompt's temperatures are its own). For each prompt's own "
            "indicator, compress prompts whose budgets differ this much in separate calls, or give them "
            "one budget= (entries per layer)",
            "/".join(f"{b:.0f}" for b in own), "/".join(c.indicator or "avg5" for c in own.values()),
            mean.indicator or "avg5 (the paper's)",
        )  # fmt: skip


def temperatures(cache: Cache, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's (tau1, tau2), (B,) float64 on ``device`` (``preference``'s operands), as
    :func:`choose_temperatures` resolved them at the start of prefill."""
    return cache.seq.tau1.to(device), cache.seq.tau2.to(device)
