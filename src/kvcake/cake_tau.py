"""CAKE's temperatures for the prompts of one cache: each prompt's own, at its own budget.

A calibration's temperatures depend on the budget per layer (``Calibration.at``: log-log
interpolation between its points), and with ``ratio=`` budgets prompts of different lengths in
one batch have different budgets. Each row's preferences take the temperatures it would take
alone (``SequenceBudgets.tau1``/``tau2``, (B,) float64, which follow the rows as beams and
selections do), so a prompt's layer budgets never depend on the batch it is in
(``tests/test_cake_batch.py``). So does the indicator a calibration point chose with them: one
for the batch where the rows agree, else each row pooled with its own (``CakeScorer.row_indicators``).
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache

from .scorers.cake import CakeScorer
from .temperatures import parse_indicator, resolve_tau


def choose_temperatures(cache: Cache) -> None:
    """Before the first layer is scored, for CAKE's layer allocation: resolve the rows'
    temperatures (:func:`row_temperatures`) and, where the scorer takes a calibrated indicator
    (``CakeScorer.takes_calibrated_indicator``), use the one each row's calibration point chose,
    so both come from the same point (one for the batch, or ``row_indicators`` where they differ)."""
    m = cache.method
    if not m.layers.needs_preferences:
        return
    indicators = row_temperatures(cache)
    if not getattr(m.scorer, "takes_calibrated_indicator", False) or all(i is None for i in indicators):
        return
    if len(set(indicators)) == 1:
        pooling, kernel = parse_indicator(indicators[0])
        scorer = dataclasses.replace(m.scorer, pooling=pooling, kernel=kernel)
    else:  # each row pooled with its own (the paper's where its point has none)
        scorer = dataclasses.replace(m.scorer, row_indicators=_joined(indicators))
    cache.method = dataclasses.replace(m, scorer=scorer)


def _joined(indicators) -> str:
    return "/".join(i or f"{CakeScorer.pooling}{CakeScorer.kernel}" for i in indicators)


def row_temperatures(cache: Cache) -> list[str | None]:
    """Resolve every row's (tau1, tau2) at its own budget per layer into ``cache.seq`` and the
    batch's :class:`~kvcake.temperatures.TauChoice` into ``cache.tau`` (the rows' own where they
    agree; else the one at the batch's mean budget, with each row's temperatures in ``rows`` and
    each row's indicator, ``/``-joined, where those differ). Returns each row's indicator (None:
    its calibration point has none, the paper's)."""
    lay, seq = cache.method.layers, cache.seq

    def at(budget: float):
        return resolve_tau(cache._fingerprint, cache._family, budget, lay.tau1, lay.tau2, lay.tau_from,
                           model_name=cache._model_name, scenario=cache.scenario)  # fmt: skip

    budgets = seq.per_layer.double().tolist()
    own = {b: at(b) for b in sorted(set(budgets))}
    rows = [own[b] for b in budgets]
    seq.tau1 = torch.tensor([c.tau1 for c in rows], dtype=torch.float64)  # host, as seq's other fields
    seq.tau2 = torch.tensor([c.tau2 for c in rows], dtype=torch.float64)  # host
    indicators = [c.indicator for c in rows]
    if len({(c.tau1, c.tau2, c.indicator) for c in rows}) == 1:
        cache.tau = rows[0]
        return indicators
    mean = at(sum(budgets) / len(budgets))
    each = _joined(indicators) if len(set(indicators)) > 1 else mean.indicator
    cache.tau = dataclasses.replace(mean, rows=tuple((c.tau1, c.tau2) for c in rows), indicator=each)
    return indicators


def temperatures(cache: Cache, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's (tau1, tau2), (B,) float64 on ``device`` (``preference``'s operands), as
    :func:`choose_temperatures` resolved them at the start of prefill."""
    return cache.seq.tau1.to(device), cache.seq.tau2.to(device)
