"""Grid search of CAKE's temperatures (tau1, tau2) for one model, at one or more budgets.

CAKE's layer budgets depend on the temperatures only through ``P_l = H_l^(1/tau1) V_l^(1/tau2)``
(CAKE Eq. 7), and ``H_l``, ``V_l`` only on the prompt. So one full forward per sample serves the
whole search: its ``H_l``/``V_l`` turn any (tau1, tau2) into a budget vector by arithmetic
(:func:`layer_budgets`, the allocator the cache runs at its last stage); candidates that give the
same vector share one evaluation; an evaluation replays the recorded forward into a fresh cache
(:func:`~kvcake.replay.replay_compress`, prefill scores memoised) and teacher-forces the
sample's scored tokens.

The loss is what users feel and the results page targets: the mean over the scenario's samples
of ``KL(full || compressed)`` of the next-token distributions (per sample, the mean over its
scored positions), divided by uniform layer budgets' mean KL over the same samples (with the
paper's indicator, so candidate indicators compare on one scale): 1.0 is "as good as uniform
budgets", lower is better. A calibration searches one scenario at a time; the context-only
samples are of two parts (``text``, a passage continued, and ``asked-after``, a passage asked
about after its compression; :mod:`kvcake.calibration.samples`), pooled as they come: a document
asked about, whose KL is 12-38 times a continued passage's, weighs that much more. (Until
2026-11-28 each part was divided by uniform budgets' KL on its own samples and the parts
averaged; on held-out folds of calibration samples, ``scripts/calibration_folds.py``, points
kept by the pooled mean did as well at 205 entries per layer, 1-2% worse at 512 (better when kept
on 32 samples) and 12-14% better at 1024; docs/calibration.md.) The
attention-output perturbation
(relative L1 of every layer's attention output at the teacher-forced tokens, mean over layers,
the CriticalKV paper's measure) is measured beside it and reported, not optimised: an earlier
objective that averaged both gave up KL to it (issue 24). What keeps a starved layer out is the
one-standard-error rule below, not the perturbation.

The grid is log-spaced over the paper's ranges (tau1 in 0.2-2, tau2 in 0.4-3); where the best
point sits on an edge, the grid grows by one step past that edge (up to ``max_extend`` times per
side). With a handful of samples the grid's best point is partly noise (the first shipped
calibration jumped between tau1 = 0.36 and 6.3 from one budget to the next), so :func:`choose`
keeps the best point only where it is better than a flatter candidate by more than the noise:
among the candidates whose mean per-sample loss exceeds the best's by at most one standard error
of the per-sample differences, it takes the one whose budgets are closest to uniform (the
"one-standard-error rule" of model selection). The cascade ends at the one-shot cache (CAKE
Theorem 1), so each replay evicts every layer once to its final budget (:class:`FixedLayers`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvcake.allocators import AllocationRequest, CakeAllocator, LayerAllocator, preference
from kvcake.budget import BudgetSpec
from kvcake.method import Method, make_method
from kvcake.replay import ScoreMemo, kl_per_token, perturbation, replay_compress, teacher_force

from .samples import Sample

logger = logging.getLogger(__name__)

TAU_LIMITS = (0.02, 50.0)  # how far an edge may be extended


def tau_grid(lo: float, hi: float, n: int) -> list[float]:
    """``n`` log-spaced values from ``lo`` to ``hi``, rounded to 3 significant digits."""
    if not 0 < lo < hi or n < 2:
        raise ValueError(f"a temperature range needs 0 < lo < hi and n >= 2, got {lo}, {hi}, {n}")
    return [float(f"{lo * (hi / lo) ** (i / (n - 1)):.3g}") for i in range(n)]


@dataclass(frozen=True)
class GridResult:
    """``best`` (tau1, tau2), its ``loss``, and every evaluated ``(tau1, tau2) -> loss``."""

    best: tuple[float, float]
    loss: float
    table: dict[tuple[float, float], float]


def search_grid(
    loss: Callable[[float, float], float], tau1s: Sequence[float], tau2s: Sequence[float], max_extend: int = 3
) -> GridResult:
    """The grid point of least ``loss``; a grid edge holding the best point is extended by one
    log step past it, at most ``max_extend`` times per side. Ties go to the first point found."""
    t1, t2 = sorted(tau1s), sorted(tau2s)
    table: dict[tuple[float, float], float] = {}
    grown = {"t1lo": 0, "t1hi": 0, "t2lo": 0, "t2hi": 0}
    while True:
        for a in t1:
            for b in t2:
                if (a, b) not in table:
                    table[(a, b)] = float(loss(a, b))
        best = min(table, key=table.__getitem__)
        moved = False
        for axis, values in (("t1", t1), ("t2", t2)):
            v = best[0] if axis == "t1" else best[1]
            step = (values[-1] / values[0]) ** (1 / (len(values) - 1)) if len(values) > 1 else 2.0
            for side, edge, new in (
                ("lo", values[0], values[0] / step),
                ("hi", values[-1], values[-1] * step),
            ):
                key = axis + side
                if v == edge and grown[key] < max_extend and TAU_LIMITS[0] <= new <= TAU_LIMITS[1]:
                    values.insert(0 if side == "lo" else len(values), float(f"{new:.3g}"))
                    grown[key] += 1
                    moved = True
        if not moved:
            return GridResult(best, table[best], table)


def layer_budgets(
    entropy: torch.Tensor, variance: torch.Tensor, spec: BudgetSpec, length: int, tau1: float, tau2: float
) -> torch.Tensor:
    """(L,) int64 final CAKE budgets of a ``length``-token prompt with per-layer ``entropy`` and
    ``variance`` (L,): the allocation the cache makes at its last stage."""
    lengths = torch.tensor([length], device=entropy.device)
    per_layer = spec.per_layer(lengths)
    n = entropy.shape[0]
    req = AllocationRequest(
        total=per_layer * n, cap=lengths, window=torch.clamp(lengths, max=spec.window), num_layers=n,
        preferences=preference(entropy, variance, tau1, tau2)[None], final=True,
    )  # fmt: skip
    return CakeAllocator(tau1, tau2, cascading=False).allocate(req)[0]


@dataclass(frozen=True)
class FixedLayers(LayerAllocator):
    """Layer budgets given in advance, (L,) entries per layer: replays a CAKE allocation without
    recomputing the window attention behind ``H_l``/``V_l``. Evicting each layer once to CAKE's
    final budgets gives CAKE's cache (the cascade ends at the one-shot cache, Theorem 1);
    ``tests/test_calibration.py`` checks it entry for entry."""

    budgets: tuple[int, ...]
    name = "fixed"

    def allocate(self, req: AllocationRequest) -> torch.Tensor:
        if len(self.budgets) != req.num_layers:
            raise ValueError(f"{len(self.budgets)} fixed budgets for {req.num_layers} layers")
        return (
            torch.tensor(self.budgets, dtype=torch.long, device=req.total.device)[None]
            .expand(req.total.shape[0], -1)
            .clone()
        )


@dataclass(frozen=True)
class Measures:
    """One compressed replay against the full cache: ``kl`` (nats per scored token) and ``attn``,
    the attention-output perturbation (mean over layers; ``None`` with nothing teacher-forced)."""

    kl: float
    attn: float | None


class Evaluator:
    """KL and attention-output perturbation of compressed caches against the full one on
    calibration samples, memoised by the layer-budget vector (so temperatures with the same
    allocation cost one evaluation)."""

    def __init__(
        self,
        model,
        samples: Sequence[Sample],
        spec: BudgetSpec,
        score: str = "cake",
        indicator: tuple[str, int] | None = None,
        baseline: dict[str, dict[str, float]] | None = None,
        gamma: float | None = None,
    ) -> None:
        """``indicator``: (pooling, kernel) of the scorer (``None``: the scorer's own); ``gamma``:
        CAKE's variance weight (``None``: the scorer's own, the paper's 200); ``baseline``: uniform
        budgets' means to divide by (another evaluator's :attr:`uniform`, so that losses under
        different indicators compare), else this evaluator's own."""
        self.model, self.samples, self.spec, self.score = model, list(samples), spec, score
        self.indicator = indicator
        if indicator is not None:
            self.score += f",score.pooling={indicator[0]},score.kernel={int(indicator[1])}"
        if gamma is not None:
            self.score += f",score.gamma={float(gamma)!r}"
        if baseline is not None:
            self.__dict__["uniform"] = baseline  # the cached_property's slot
        self.memos = [ScoreMemo() for _ in self.samples]
        self.done: dict[tuple[int, tuple[int, ...]], Measures] = {}
        # each sample's (entropy, variance), measured at its first budgets (an evaluator built for its
        # uniform baseline alone never needs them)
        self.stats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.evaluations = 0

    def _method(self, layers: str) -> Method:
        return make_method(f"layers={layers},score={self.score},decode=fixed", budget=self.spec.budget,
                           ratio=self.spec.ratio, window=self.spec.window)  # fmt: skip

    def _preference_stats(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.samples[i]
        ctx = replay_compress(self.model, self._method("cake-oneshot,layers.tau1=1,layers.tau2=1"), s.captured,
                              s.cache, s.ids, s.logits, chunks=1, memo=self.memos[i])  # fmt: skip
        return torch.stack(ctx.cache.entropy, 1)[0], torch.stack(ctx.cache.variance, 1)[0]

    def measure(self, i: int, method: Method) -> Measures:
        s = self.samples[i]
        ctx = replay_compress(
            self.model, method, s.captured, s.cache, s.ids, s.logits, chunks=1, memo=self.memos[i]
        )
        n = s.full_logprobs.shape[0]
        tf = teacher_force(self.model, ctx.cache, s.ids.shape[1], ctx.logits, s.appended, n)
        self.evaluations += 1
        return Measures(kl_per_token(s.full_logprobs, tf.logprobs), perturbation(tf.attn, s.full_attn)[1])

    def budgets(self, i: int, tau1: float, tau2: float) -> torch.Tensor:
        if i not in self.stats:
            self.stats[i] = self._preference_stats(i)
        h, v = self.stats[i]
        return layer_budgets(h, v, self.spec, self.samples[i].ids.shape[1], tau1, tau2)

    def sample_measures(self, i: int, tau1: float, tau2: float) -> Measures:
        key = (i, tuple(self.budgets(i, tau1, tau2).tolist()))
        if key not in self.done:
            self.done[key] = self.measure(i, self._method("uniform").replace(layers=FixedLayers(key[1])))
        return self.done[key]

    def part_means(self, per_sample: Sequence[float]) -> dict[str, float]:
        parts: dict[str, list[float]] = {}
        for s, x in zip(self.samples, per_sample, strict=True):
            parts.setdefault(s.part, []).append(x)
        return {k: sum(v) / len(v) for k, v in parts.items()}

    @functools.cached_property
    def uniform(self) -> dict[str, dict[str, float]]:
        """Uniform layer budgets with the same scorer (CAKE's indicator alone): mean KL and mean
        attention perturbation per part, ``{"kl": {part: x}, "attn": {part: x}}`` (unless a
        ``baseline`` was given)."""
        method = self._method("uniform")
        measured = [self.measure(i, method) for i in range(len(self.samples))]
        out = {"kl": self.part_means([m.kl for m in measured])}
        if all(m.attn is not None for m in measured):
            out["attn"] = self.part_means([m.attn for m in measured])
        return out

    def pooled(self, measure: str) -> float:
        """Uniform budgets' mean ``measure`` (``"kl"`` or ``"attn"``) over all the samples, from
        the means per part (:attr:`uniform`) weighted by the samples of each part."""
        per_part = self.uniform[measure]
        return sum(per_part[s.part] for s in self.samples) / len(self.samples)

    def relative(self, i: int, m: Measures) -> float:
        """Sample ``i``'s loss: its KL over uniform budgets' mean KL over all the samples."""
        return m.kl / max(self.pooled("kl"), 1e-12)

    def perturbation(self, tau1: float, tau2: float) -> float | None:
        """The mean attention-output perturbation over the samples, over uniform budgets'
        (reported beside the loss, not optimised); ``None`` when nothing was teacher-forced."""
        measured = [self.sample_measures(i, tau1, tau2) for i in range(len(self.samples))]
        if "attn" not in self.uniform or any(m.attn is None for m in measured):
            return None
        return sum(m.attn for m in measured) / len(measured) / max(self.pooled("attn"), 1e-12)

    def per_sample(self, tau1: float, tau2: float) -> list[float]:
        """Each sample's loss (:meth:`relative`) at these temperatures."""
        return [self.relative(i, self.sample_measures(i, tau1, tau2)) for i in range(len(self.samples))]

    def loss(self, tau1: float, tau2: float) -> float:
        """The mean per-sample loss: the mean KL over uniform budgets' (1.0: as good as uniform
        layer budgets)."""
        per = self.per_sample(tau1, tau2)
        return sum(per) / len(per)

    def unevenness(self, tau1: float, tau2: float) -> float:
        """How far the allocation is from uniform: mean over samples and layers of
        ``|b_l / mean(b) - 1|`` (0 for uniform budgets)."""
        total = 0.0
        for i in range(len(self.samples)):
            b = self.budgets(i, tau1, tau2).double()
            total += float((b / b.mean() - 1).abs().mean())
        return total / len(self.samples)

    def mean_budget(self) -> float:
        """Average entries per layer over the samples (the budget a calibration point is stored at)."""
        # host: a float per sample
        per = [float(self.spec.per_layer(torch.tensor([s.ids.shape[1]]))[0]) for s in self.samples]
        return sum(per) / len(per)


@dataclass(frozen=True)
class Choice:
    """The temperatures :func:`choose` kept: ``tau``, its ``loss``, its margin ``se`` (one
    standard error of the per-sample differences to the grid's best), and the grid's ``best``."""

    tau: tuple[float, float]
    loss: float
    se: float
    best: tuple[float, float]


def choose(
    table: dict[tuple[float, float], float],
    per_sample: Callable[[float, float], Sequence[float]],
    unevenness: Callable[[float, float], float],
) -> Choice:
    """The flattest candidate whose loss is within one standard error of the best's.

    ``table`` maps candidates to their loss; ``per_sample(tau)`` gives a candidate's per-sample
    losses (their mean is comparable across candidates); ``unevenness(tau)`` how far its budgets
    are from uniform. For each candidate ``c``, ``d_i = l_c,i - l_best,i`` over the samples; ``c`` is
    as good as the best within noise when ``mean(d) <= std(d) / sqrt(n)``. Among those the least
    uneven wins, ties broken by loss. With a single sample there is no noise estimate and the
    best point is kept."""
    best = min(table, key=table.__getitem__)
    ref = list(per_sample(*best))
    n = len(ref)
    eligible: list[tuple[float, float, tuple[float, float], float]] = []
    for tau in table:
        d = [a - b for a, b in zip(per_sample(*tau), ref, strict=True)]
        mean = sum(d) / n
        se = (sum((x - mean) ** 2 for x in d) / (n - 1) / n) ** 0.5 if n > 1 else 0.0
        if tau == best or (n > 1 and mean <= se):
            eligible.append((unevenness(*tau), table[tau], tau, se))
    _, loss, tau, se = min(eligible)
    return Choice(tau, loss, se, best)


def choose_indicator(per_sample: Mapping[Hashable, Sequence[float]], paper: Hashable) -> Hashable:
    """The indicator kept across indicators, each given by its kept point's per-sample losses (on
    one scale): the paper's unless another's is better by more than one standard error
    (:func:`choose`, the paper's counted the flattest)."""
    return choose({(ind,): sum(v) / len(v) for ind, v in per_sample.items()}, lambda ind: per_sample[ind],
                  lambda ind: 0.0 if ind == paper else 1.0).tau[0]  # fmt: skip
