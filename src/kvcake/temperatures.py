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
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from .allocators.cake import FALLBACK_TAU, CakeAllocator, default_tau, family_key
from .models import default_cache_root, model_fingerprint

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

    def __post_init__(self) -> None:
        for name in ("budget", "tau1", "tau2"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"calibration point: {name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class Calibration:
    """A model's calibrated temperatures: ``points`` sorted by budget, plus free-form ``meta``
    (how it was found: objective values, samples, time)."""

    fingerprint: str
    points: tuple[TauPoint, ...]
    model: str = ""
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a calibration needs at least one (budget, tau1, tau2) point")
        object.__setattr__(self, "points", tuple(sorted(self.points, key=lambda p: p.budget)))

    def at(self, budget: float) -> tuple[float, float]:
        """(tau1, tau2) at ``budget`` entries per layer: log-log interpolation, clamped outside."""
        pts = self.points
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

    def to_json(self) -> str:
        points = [{"budget": p.budget, "tau1": p.tau1, "tau2": p.tau2} for p in self.points]
        body = {"fingerprint": self.fingerprint, "model": self.model, "points": points, "meta": self.meta}
        return json.dumps(body, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "calibration") -> Calibration:
        try:
            body = json.loads(text)
            points = tuple(
                TauPoint(float(p["budget"]), float(p["tau1"]), float(p["tau2"])) for p in body["points"]
            )
            return cls(
                str(body["fingerprint"]), points, str(body.get("model", "")), dict(body.get("meta", {}))
            )
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as err:
            raise ValueError(
                f"{source}: not a kvcake calibration ({err}); rerun `kvcake calibrate`"
            ) from None


@dataclass(frozen=True)
class TauChoice:
    """The temperatures in force and their source (one of :data:`SOURCES`, ``+``-joined when
    the user gave only one of the two)."""

    tau1: float
    tau2: float
    source: str

    def describe(self) -> str:
        return f"tau1={self.tau1:.3g} tau2={self.tau2:.3g} ({self.source})"


def local_dir() -> Path:
    """Where ``kvcake calibrate`` stores calibrations: beside the converted models."""
    return default_cache_root() / "calibrations"


def calibration_path(fingerprint: str, folder: Path | None = None) -> Path:
    return (folder or local_dir()) / f"{fingerprint}.json"


def save_calibration(cal: Calibration, folder: Path | None = None) -> Path:
    """Write ``cal`` to ``folder`` (default :func:`local_dir`) atomically; returns the path."""
    path = calibration_path(cal.fingerprint, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(cal.to_json(), encoding="utf-8")
    tmp.replace(path)
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


def resolve_tau(
    fingerprint: str,
    model_type: str,
    budget: float,
    tau1: float | None = None,
    tau2: float | None = None,
    tau_from: str = "auto",
    model_name: str | None = None,
) -> TauChoice:
    """The temperatures for a model at ``budget`` average entries per layer (see the module doc).
    ``model_name`` (what ``--model`` loads it by) is quoted in the warning's command.

    A user value wins for its own temperature; the other comes from the rest of the cascade.
    ``tau_from="family"`` or ``"fallback"`` skips the calibrations (and the warning): ablations."""
    if tau1 is not None and tau2 is not None:
        return TauChoice(tau1, tau2, "user")
    found = find_calibration(fingerprint) if tau_from == "auto" else None
    if tau_from == "fallback":
        (t1, t2), source = FALLBACK_TAU, "fallback"
    elif found is not None:
        (t1, t2), source = found[0].at(budget), found[1]
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
            "--model %s` (a few minutes) to fit them.", model_type, fingerprint, what, t1, t2,
            shlex.quote(model_name or "MODEL"),
        )  # fmt: skip
    if tau1 is not None or tau2 is not None:
        return TauChoice(tau1 or t1, tau2 or t2, f"user+{source}")
    return TauChoice(t1, t2, source)


def tau_source_label(
    fingerprint: str, model_type: str, tau1: float | None, tau2: float | None, tau_from: str = "auto"
) -> str:
    """A short identity of the temperatures a CAKE method will use on this model, at any budget
    (e.g. ``calibrated:<hash>``): part of an eval cell's key, so a new calibration reruns it."""
    if tau1 is not None and tau2 is not None:
        return f"user:{tau1:g}/{tau2:g}"
    found = find_calibration(fingerprint) if tau_from == "auto" else None
    if tau_from == "fallback":
        base = f"fallback:{FALLBACK_TAU[0]:g}/{FALLBACK_TAU[1]:g}"
    elif found is not None:
        digest = hashlib.sha256(json.dumps([p.__dict__ for p in found[0].points]).encode()).hexdigest()[:8]
        base = f"{found[1]}:{digest}"
    elif family_key(model_type) is not None:
        base = f"family:{family_key(model_type)}"
    else:
        base = f"fallback:{FALLBACK_TAU[0]:g}/{FALLBACK_TAU[1]:g}"
    partial = "".join(f",{n}={v:g}" for n, v in (("tau1", tau1), ("tau2", tau2)) if v is not None)
    return base + partial


def method_tau_label(model, method) -> str | None:
    """:func:`tau_source_label` of a method on ``model``; ``None`` when its layers are not CAKE's."""
    layers = method.layers
    if not isinstance(layers, CakeAllocator):
        return None
    model_type = getattr(model.config, "model_type", "")
    return tau_source_label(model_fingerprint(model), model_type, layers.tau1, layers.tau2, layers.tau_from)


def describe_resolution() -> str:
    """How CAKE presets choose their temperatures, and the calibrations shipped in the package."""
    shipped = []
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        cal = Calibration.from_json(path.read_text(encoding="utf-8"), str(path))
        pts = ", ".join(f"{p.tau1:g}/{p.tau2:g} at {p.budget:.0f}" for p in cal.points)
        shipped.append(f"{cal.model or cal.fingerprint} ({pts} entries/layer)")
    return (
        "CAKE temperatures (tau1/tau2), when a method leaves them 'auto': the model's own calibration "
        f"(`kvcake calibrate`, stored in {local_dir()}), else one shipped with kvcake "
        f"[{'; '.join(shipped) or 'none'}], else the model family's default, else the flat fallback "
        f"{FALLBACK_TAU[0]:g}/{FALLBACK_TAU[1]:g}. Caches report theirs as `cache.tau`."
    )
