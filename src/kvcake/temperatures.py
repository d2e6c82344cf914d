"""Which CAKE temperatures (tau1, tau2) a cache uses, and where they came from.

CAKE's layer preference ``P_l = H_l^(1/tau1) V_l^(1/tau2)`` needs two temperatures that the
paper grid-searches per model; they do not transfer, even within a family (METHODS.md). The
cache asks :func:`resolve_tau` once per prompt, and the first of these that exists wins:

1. ``user``: ``tau1``/``tau2`` given in the method (``cake,layers.tau1=1.0,layers.tau2=3.0``);
2. ``calibrated``: a calibration of this model (by :func:`kvcake.models.model_fingerprint`)
   written by ``kvcake calibrate`` to :func:`local_dir`;
3. ``shipped``: a calibration that comes inside the package (``kvcake/calibrations/``);
4. ``family``: the authors' values for the model family (``TAU_DEFAULTS``);
5. ``fallback``: :data:`FALLBACK_TAU`, flat enough to stay near a uniform allocation.

For 4 and 5 a warning names ``kvcake calibrate``, once per model fingerprint. A calibration
holds one point per calibrated budget (average entries per layer); between points the
temperatures are interpolated linearly in ``log(budget)`` (on ``log(tau)``), outside them the
nearest point is used.

A calibration holds one set of points per *scenario* (:data:`SCENARIOS`): ``question``
(question-aware: the compressed prompt ends with the question; ``kvcake.generate`` and a
``KVCakeCache`` passed to ``model.generate``) and ``context`` (context-only: a document
compressed alone and asked about later; ``kvcake.compress``). The cache's :class:`Scenario`
says which set it uses and why. Files written before the sets were split hold one set
(``"points"``): it serves both scenarios, and the cache says so.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .allocators.cake import FALLBACK_TAU, CakeAllocator, default_tau, family_key, tau_family
from .defaults import SCENARIOS
from .fingerprints import default_cache_root, kv_fingerprint, model_fingerprint
from .scenarios import QUESTION_DEFAULT, Scenario, check_scenario

logger = logging.getLogger(__name__)

SOURCES = ("user", "calibrated", "shipped", "family", "fallback")
SHIPPED_DIR = Path(__file__).parent / "calibrations"
_warned: set[str] = set()


@dataclass(frozen=True)
class TauPoint:
    """Calibrated temperatures at one budget (average KV entries per layer)."""

    budget: float
    tau1: float
    tau2: float
    indicator: str | None = None  # CAKE scorer's pooling and kernel, e.g. "max7"; None: the paper's

    def __post_init__(self) -> None:
        for name in ("budget", "tau1", "tau2"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"calibration point: {name} must be a positive number, got {value!r}")
        if self.indicator is not None:
            parse_indicator(self.indicator)


def parse_indicator(value: str | tuple[str, int]) -> tuple[str, int]:
    """``"max7"`` or ``("max", 7)`` -> ``("max", 7)``: a CAKE scorer indicator, a pooling (avg/max)
    and an odd kernel."""
    if isinstance(value, str):
        text = value.strip().lower()
        pooling, digits = text[:3], text[3:]
        if pooling not in ("avg", "max") or not digits.isdigit():
            raise ValueError(
                f"an indicator is avg or max and a kernel size, e.g. 'avg5' or 'max7'; got {value!r}"
            )
        value = (pooling, int(digits))
    if (not isinstance(value, tuple) or len(value) != 2 or value[0] not in ("avg", "max")
            or isinstance(value[1], bool) or not isinstance(value[1], int) or value[1] < 1 or value[1] % 2 == 0):  # fmt: skip
        raise ValueError(f"an indicator is ('avg'|'max', odd kernel >= 1), e.g. 'max7'; got {value!r}")
    return value


def _points(raw) -> tuple[TauPoint, ...]:
    return tuple(
        TauPoint(float(p["budget"]), float(p["tau1"]), float(p["tau2"]), p.get("indicator")) for p in raw
    )


@dataclass(frozen=True)
class Calibration:
    """A model's calibrated temperatures, plus free-form ``meta`` (how they were found:
    objective values, samples, time).

    ``points`` is either a mapping ``{scenario: points}`` with a set for each of
    :data:`SCENARIOS`, or one sequence of points that serves both (``shared``: files written
    before the sets were split). Each set is sorted by budget."""

    fingerprint: str
    points: tuple[TauPoint, ...] | dict[str, tuple[TauPoint, ...]]
    model: str = ""
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        raw = self.points
        if isinstance(raw, dict):
            if sorted(raw) != sorted(SCENARIOS):
                raise ValueError(f"a calibration's sets must be exactly {SCENARIOS}, got {sorted(raw)}")
            sets = {s: raw[s] for s in SCENARIOS}
        else:
            sets = {s: raw for s in SCENARIOS}
        for name, pts in sets.items():
            if not pts:
                raise ValueError(f"a calibration needs at least one (budget, tau1, tau2) point ({name} set)")
        sets = {k: tuple(sorted(v, key=lambda p: p.budget)) for k, v in sets.items()}
        object.__setattr__(self, "points", sets["question"] if not isinstance(raw, dict) else sets)
        object.__setattr__(self, "_sets", sets)

    @property
    def shared(self) -> bool:
        """One set for both scenarios (a file from before the split)."""
        return not isinstance(self.points, dict)

    def set(self, scenario: str = "question") -> tuple[TauPoint, ...]:
        """The points of ``scenario``'s set, sorted by budget."""
        return self._sets[check_scenario(scenario)]

    def at(self, budget: float, scenario: str = "question") -> tuple[float, float]:
        """(tau1, tau2) of ``scenario``'s set at ``budget`` entries per layer: log-log
        interpolation, clamped outside."""
        pts = self.set(scenario)
        if budget <= pts[0].budget:
            return pts[0].tau1, pts[0].tau2
        if budget >= pts[-1].budget:
            return pts[-1].tau1, pts[-1].tau2
        for lo, hi in zip(pts, pts[1:], strict=False):
            if lo.budget <= budget <= hi.budget:
                w = (math.log(budget) - math.log(lo.budget)) / (math.log(hi.budget) - math.log(lo.budget))
                return tuple(math.exp((1 - w) * math.log(a) + w * math.log(b))
                             for a, b in ((lo.tau1, hi.tau1), (lo.tau2, hi.tau2)))  # fmt: skip
        raise AssertionError("unreachable")  # pragma: no cover

    def indicator_at(self, budget: float, scenario: str = "question") -> str | None:
        """The CAKE indicator the calibration chose at the point of ``scenario``'s set nearest
        ``budget`` (in log budget; a discrete choice, not interpolated); None: the paper's."""
        pts = self.set(scenario)
        return min(pts, key=lambda p: abs(math.log(p.budget) - math.log(budget))).indicator

    def to_json(self) -> str:
        def dump(pts):
            return [{"budget": p.budget, "tau1": p.tau1, "tau2": p.tau2}
                    | ({"indicator": p.indicator} if p.indicator else {}) for p in pts]  # fmt: skip

        body = {"fingerprint": self.fingerprint, "model": self.model, "meta": self.meta}
        if self.shared:
            body["points"] = dump(self.points)
        else:
            body["scenarios"] = {s: {"points": dump(self.points[s])} for s in SCENARIOS}
        return json.dumps(body, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "calibration") -> Calibration:
        try:
            body = json.loads(text)
            if "scenarios" in body:
                points = {s: _points(body["scenarios"][s]["points"]) for s in body["scenarios"]}
            else:
                points = _points(body["points"])
            return cls(
                str(body["fingerprint"]), points, str(body.get("model", "")), dict(body.get("meta", {}))
            )
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as err:
            raise ValueError(
                f"{source}: not a kvcake calibration ({err}); rerun `kvcake calibrate`"
            ) from None

    def describe_sets(self) -> str:
        """The points of each set, e.g. ``question 2/3 at 205, ...; context ...``."""

        def fmt(pts):
            return ", ".join(f"{p.tau1:g}/{p.tau2:g}{f' {p.indicator}' if p.indicator else ''} at {p.budget:.0f}"
                             for p in pts)  # fmt: skip

        if self.shared:
            return f"one set for both scenarios: {fmt(self.points)}"
        return "; ".join(f"{s}: {fmt(self.points[s])}" for s in SCENARIOS)


@dataclass(frozen=True)
class TauChoice:
    """The temperatures in force and their source (one of :data:`SOURCES`, ``+``-joined when
    the user gave only one of the two)."""

    tau1: float
    tau2: float
    source: str
    scenario: Scenario | None = field(default=None, compare=False)
    set_used: str = field(default="", compare=False)  # "question", "context", "shared" or "" (none)
    indicator: str | None = field(default=None, compare=False)  # the calibration's, if not the paper's
    rows: tuple = field(default=(), compare=False)  # a batch's (tau1, tau2) per prompt where they differ

    def describe(self) -> str:
        text = f"tau1={self.tau1:.3g} tau2={self.tau2:.3g}"
        if self.rows:  # ``text``: the batch's mean budget's (its indicator each prompt's where they differ)
            each = ", ".join(f"{a:.3g}/{b:.3g}" for a, b in self.rows)
            text = f"per prompt {each} (tau1/tau2; {text} at the mean)"
        if self.indicator is not None:  # "max7/avg5": per prompt (cake_tau.py)
            text += f", indicator{'s per prompt' if '/' in self.indicator else ''} {self.indicator}"
        text += f" ({self.source}"
        if self.scenario is not None:
            used = {
                "": "",
                "shared": ", the calibration's one set for both scenarios",
            }.get(self.set_used, f", {self.set_used} set")
            aware = "question-aware" if self.scenario.name == "question" else "context-only"
            text += f"; {aware}{used}: {self.scenario.why}"
        return text + ")"


def local_dir() -> Path:
    """Where ``kvcake calibrate`` stores calibrations: beside the converted models."""
    return default_cache_root() / "calibrations"


def calibration_path(fingerprint: str, folder: Path | None = None) -> Path:
    return (folder or local_dir()) / f"{fingerprint}.json"


def save_calibration(cal: Calibration, folder: Path | None = None) -> Path:
    """Write ``cal`` to ``folder`` (default :func:`local_dir`) atomically; returns the path."""
    path = calibration_path(cal.fingerprint, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # its own: two writers never mix
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(cal.to_json())
    os.chmod(tmp, 0o644)  # (mkstemp's 0600: a calibration is as readable as any file written here)
    os.replace(tmp, path)
    return path


@functools.lru_cache(maxsize=32)
def _read(path: Path, mtime_ns: int) -> Calibration:
    """A calibration file, parsed once per version (every prompt of a CAKE cache asks)."""
    return Calibration.from_json(path.read_text(encoding="utf-8"), str(path))


def find_calibration(fingerprint: str) -> tuple[Calibration, str] | None:
    """The local calibration of ``fingerprint``, else the shipped one, with its source name."""
    for folder, source in ((local_dir(), "calibrated"), (SHIPPED_DIR, "shipped")):
        path = calibration_path(fingerprint, folder)
        if path.is_file():
            cal = _read(path, path.stat().st_mtime_ns)
            if cal.fingerprint != fingerprint:
                raise ValueError(f"{path} is for model {cal.fingerprint}, not {fingerprint}: delete it")
            return cal, source
    return None


def calibration_key(model) -> str:
    """The fingerprint ``model``'s calibration is filed under: its own, or, where none is filed
    under it, that of a calibration made for the same model with other special-token ids
    (``fingerprints.kv_fingerprint``, which calibrations keep in their ``meta``): a
    ``model.config.pad_token_id = ...`` before compressing must not lose the calibrated temperatures."""
    fingerprint = model_fingerprint(model)
    if find_calibration(fingerprint) is not None:
        return fingerprint
    kv = kv_fingerprint(model)
    for folder in (local_dir(), SHIPPED_DIR):
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
            try:  # another model's file, unreadable: that model's lookup says so, not this one's
                cal = _read(path, path.stat().st_mtime_ns)
            except (OSError, ValueError):
                continue
            if cal.meta.get("kv_fingerprint") == kv and path == calibration_path(cal.fingerprint, folder):
                return cal.fingerprint
    return fingerprint


def resolve_tau(
    fingerprint: str,
    model_type: str,
    budget: float,
    tau1: float | None = None,
    tau2: float | None = None,
    tau_from: str = "auto",
    model_name: str | None = None,
    scenario: Scenario | str | None = None,
) -> TauChoice:
    """The temperatures for a model at ``budget`` average entries per layer (see the module doc).
    ``model_name`` (what ``--model`` loads it by) is quoted in the warning's command.
    ``scenario`` picks a calibration's set (default: question-aware, what ``model.generate``
    with a ``KVCakeCache`` does); the family default and the fallback serve both.

    A user value wins for its own temperature; the other comes from the rest of the cascade.
    ``tau_from="family"`` or ``"fallback"`` skips the calibrations (and the warning): ablations."""
    scenario = Scenario.pick(scenario, QUESTION_DEFAULT.name, QUESTION_DEFAULT.why)
    if tau1 is not None and tau2 is not None:
        return TauChoice(tau1, tau2, "user", scenario)
    found = find_calibration(fingerprint) if tau_from == "auto" else None
    used, indicator = "", None
    if tau_from == "fallback":
        (t1, t2), source = FALLBACK_TAU, "fallback"
    elif found is not None:
        (t1, t2), source = found[0].at(budget, scenario.name), found[1]
        used = "shared" if found[0].shared else scenario.name
        indicator = found[0].indicator_at(budget, scenario.name)
    elif family_key(model_type) is not None:
        (t1, t2), source = default_tau(model_type, budget), "family"
    else:
        (t1, t2), source = FALLBACK_TAU, "fallback"
    if tau_from == "auto" and source in ("family", "fallback") and fingerprint not in _warned:
        _warned.add(fingerprint)
        what = f"the {model_type!r} family's default" if source == "family" else "a flat fallback"
        logger.warning(
            "CAKE temperatures are not calibrated for this model (%s, fingerprint %s): using %s "
            "tau1=%.3g tau2=%.3g, which may allocate layer budgets poorly. Run `kvcake calibrate "
            "--model %s` (about 30 min on one CPU core for a 135M-parameter model) to fit them.",
            model_type, fingerprint, what, t1, t2,
            shlex.quote(model_name or "MODEL"),
        )  # fmt: skip
    if tau1 is not None or tau2 is not None:
        return TauChoice(tau1 or t1, tau2 or t2, f"user+{source}", scenario, used, indicator)
    return TauChoice(t1, t2, source, scenario, used, indicator)


def tau_source_label(
    fingerprint: str, model_type: str, tau1: float | None, tau2: float | None, tau_from: str = "auto",
    scenario: str | None = None,
) -> str:  # fmt: skip
    """A short identity of the temperatures a CAKE method will use on this model, at any budget
    (e.g. ``calibrated:<hash>``): part of an eval cell's key, so a new calibration reruns it.

    ``scenario``: the identity of that scenario's set alone (a calibration that changes only the
    other set leaves the label, and the cells keyed by it, as they were); ``None``: of both sets."""
    if scenario is not None and scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {SCENARIOS} or None, got {scenario!r}")
    if tau1 is not None and tau2 is not None:
        return f"user:{tau1:g}/{tau2:g}"
    found = find_calibration(fingerprint) if tau_from == "auto" else None
    if tau_from == "fallback":
        base = f"fallback:{FALLBACK_TAU[0]:g}/{FALLBACK_TAU[1]:g}"
    elif found is not None:
        cal = found[0]  # a shared set keeps the digest it had before the sets were split

        def fields(p: TauPoint) -> dict:  # a point without an indicator keeps its older digest
            return {k: v for k, v in p.__dict__.items() if not (k == "indicator" and v is None)}

        sets = [fields(p) for p in cal.points] if cal.shared else {
            k: [fields(p) for p in v] for k, v in cal.points.items() if scenario in (None, k)
        }  # fmt: skip
        digest = hashlib.sha256(json.dumps(sets, sort_keys=True).encode()).hexdigest()[:8]
        base = f"{found[1]}:{digest}"
    elif family_key(model_type) is not None:
        base = f"family:{family_key(model_type)}"
    else:
        base = f"fallback:{FALLBACK_TAU[0]:g}/{FALLBACK_TAU[1]:g}"
    partial = "".join(f",{n}={v:g}" for n, v in (("tau1", tau1), ("tau2", tau2)) if v is not None)
    return base + partial


def method_tau_label(model, method, scenario: str | None = None) -> str | None:
    """:func:`tau_source_label` of a method on ``model`` (of the ``scenario``'s set, or of both);
    ``None`` when its layers are not CAKE's."""
    layers = method.layers
    if not isinstance(layers, CakeAllocator):
        return None
    return tau_source_label(
        calibration_key(model), tau_family(model), layers.tau1, layers.tau2, layers.tau_from, scenario
    )


def describe_resolution() -> str:
    """How CAKE presets choose their temperatures, and the calibrations shipped in the package."""
    shipped = []
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        cal = Calibration.from_json(path.read_text(encoding="utf-8"), str(path))
        shipped.append(f"{cal.model or cal.fingerprint} ({cal.describe_sets()}; entries/layer)")
    return (
        "CAKE temperatures (tau1/tau2), when a method leaves them 'auto': the model's own calibration "
        f"(`kvcake calibrate`, stored in {local_dir()}), else one shipped with kvcake "
        f"[{'; '.join(shipped) or 'none'}], else the model family's default, else the flat fallback "
        f"{FALLBACK_TAU[0]:g}/{FALLBACK_TAU[1]:g}. A calibration holds a set per scenario: 'question' "
        "(question-aware: kvcake generate --prompt, kvcake.generate, a KVCakeCache passed to "
        "model.generate) and 'context' (context-only: kvcake generate --context-file, kvcake.compress); "
        "--scenario / scenario= picks the other. Caches report theirs as `cache.tau`."
    )
