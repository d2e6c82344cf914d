"""A compression method = layer allocation x head allocation x token scoring x selection.

Each published method is a named preset of the same four parts plus a decoding policy, and
any sensible combination works (``layers=cake,heads=adakv,score=cake,select=critical``).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .allocators import (
    AdaKV,
    CakeAllocator,
    GlobalAllocator,
    LayerAllocator,
    Pyramid,
    RandomSplit,
    Uniform,
    UniformHeads,
)
from .allocators.adakv import HeadAllocator
from .budget import MAX_BUDGET, BudgetSpec
from .scorers import CakeScorer, DefensiveScorer, H2OScorer, Scorer, SnapKVScorer, StreamingScorer, TOVAScorer
from .selectors import Critical, Selector, TopK

LAYER_ALLOCATORS: dict[str, Callable[..., LayerAllocator]] = {
    "uniform": Uniform,
    "pyramid": Pyramid,
    "random": RandomSplit,
    "cake": CakeAllocator,
    "cake-oneshot": lambda **kw: CakeAllocator(cascading=False, **kw),
    "global": GlobalAllocator,
}
HEAD_ALLOCATORS: dict[str, Callable[..., HeadAllocator]] = {"uniform": UniformHeads, "adakv": AdaKV}
SCORERS: dict[str, Callable[..., Scorer]] = {
    "streamingllm": StreamingScorer,
    "h2o": H2OScorer,
    "tova": TOVAScorer,
    "snapkv": SnapKVScorer,
    "cake": CakeScorer,
    "defensive": DefensiveScorer,
}
SELECTORS: dict[str, Callable[..., Selector]] = {"topk": TopK, "critical": Critical}
DECODE_POLICIES = ("none", "fixed")
FULL = "full"  # the uncompressed baseline: every entry kept


@dataclass(frozen=True)
class Method:
    """A configured compression method.

    Parameters
    ----------
    budget:
        How much to keep (``BudgetSpec``: ``budget=`` or ``ratio=``, and the window).
    layers:
        Layer allocator: uniform, pyramid, random, CAKE's preference allocation, or one ranking
        of every layer's scores (Layer-DefensiveKV's ``global``).
    heads:
        Head allocator: uniform, or Ada-KV (ragged cache).
    scorer:
        Token scores: StreamingLLM, H2O, TOVA, SnapKV, CAKE, DefensiveKV.
    selector:
        Top-k, or CriticalKV's two-stage selection.
    decode:
        ``"fixed"`` keeps every layer (and head) at its budget while decoding, evicting by the
        scorer's per-step scores; ``"none"`` lets the cache grow by one entry per step.
    name:
        The preset's name, or ``"custom"``.
    """

    budget: BudgetSpec
    layers: LayerAllocator = field(default_factory=Uniform)
    heads: HeadAllocator = field(default_factory=UniformHeads)
    scorer: Scorer = field(default_factory=SnapKVScorer)
    selector: Selector = field(default_factory=TopK)
    decode: str = "none"
    name: str = "custom"

    def __post_init__(self) -> None:
        if not isinstance(self.budget, BudgetSpec):
            raise TypeError(f"budget must be a BudgetSpec, got {type(self.budget).__name__}")
        _check_decode(self.decode)
        for part, base in ((self.layers, LayerAllocator), (self.heads, HeadAllocator), (self.scorer, Scorer),
                           (self.selector, Selector)):  # fmt: skip
            if not isinstance(part, base):
                raise TypeError(f"expected a {base.__name__}, got {type(part).__name__}")
        if self.selector.needs_marks and not self.scorer.marks_critical:
            raise ValueError(
                f"select.first=marked needs a scorer that marks the first stage (score=defensive with "
                f"critical_mass > 0), got score={self.scorer.describe()}: use select.first=ratio"
            )
        if self.selector.keeps_pinned and self.heads.ragged and self.layers.cascading:
            raise ValueError(
                "select.first=kvpress keeps Ada-KV's pinned entries in CriticalKV's first stage, and their count "
                "follows the layer's budget, so a cascade's stages would not keep nested sets (its final ones "
                "would differ from one-shot eviction's): add layers.cascading=false, or use select.first=ratio"
            )

    def describe(self) -> str:
        """The preset name and the full composed spec (every non-default option), with the budget."""
        if self.name == FULL:
            return "full (every entry kept)"
        return f"{self.name}[{method_spec(self)}] {self.budget.describe()} window={self.budget.window}"

    def replace(self, **changes) -> Method:
        return dataclasses.replace(self, **changes)


# One row per preset: name, then its layers, heads, score, select and decode parts, then a
# one-line description (the rest of the row).
_PRESET_TABLE = """
streamingllm   uniform       uniform  streamingllm  topk      fixed  4 attention sinks + recent tokens
h2o            uniform       uniform  h2o           topk      fixed  accumulated attention (heavy hitters)
tova           uniform       uniform  tova          topk      fixed  last token's attention
snapkv         uniform       uniform  snapkv        topk      none   observation-window attention, max-pooled
pyramidkv      pyramid       uniform  snapkv        topk      none   SnapKV scores, pyramid layer budgets
cake           cake          uniform  cake          topk      fixed  CAKE: preference layer budgets, cascade, mean+var
cake-oneshot   cake-oneshot  uniform  cake          topk      fixed  CAKE without cascading (ablation)
criticalkv     uniform       uniform  snapkv        critical  none   SnapKV + CriticalKV two-stage selection
adakv          uniform       adakv    snapkv        topk      none   Ada-SnapKV: per-head budgets, ragged cache
ada-pyramidkv  pyramid       adakv    snapkv        topk      none   PyramidKV layers x Ada-KV heads
critical-adakv uniform       adakv    snapkv        critical  none   Ada-KV heads + CriticalKV selection
cake-adakv     cake          adakv    cake          topk      fixed  CAKE layers x Ada-KV heads (ragged)
defensivekv    uniform       adakv    defensive     critical  none   DefensiveKV: worst-case window attention, Ada-KV
layer-defensivekv global     adakv    defensive     critical  none   Layer-DefensiveKV: one ranking over all layers, cascade
"""
# Part options a preset sets beyond its parts' defaults (written like a composed string's).
PRESET_OPTIONS: dict[str, str] = {
    "defensivekv": "select.first=marked,select.value_norm=heads",
    "layer-defensivekv": "select.first=marked,select.value_norm=heads",
}
# name -> (layers, heads, score, select, decode, one-line description)
PRESETS: dict[str, tuple[str, str, str, str, str, str]] = {
    name: tuple(rest) for name, *rest in (row.split(maxsplit=6) for row in _PRESET_TABLE.strip().splitlines())
}
_KEYS = {"layers": LAYER_ALLOCATORS, "heads": HEAD_ALLOCATORS, "score": SCORERS, "select": SELECTORS}


def _build(kind: str, name: str, options: dict[str, object]):
    """The part ``kind=name`` built with ``options``; unknown options and values of the wrong
    type are refused naming the valid options and the expected type."""
    registry = _KEYS[kind]
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(registry))}")
    factory = registry[name]
    cls = factory if isinstance(factory, type) else type(factory())
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init} if dataclasses.is_dataclass(cls) else {}
    if name == "cake-oneshot":
        fields.pop("cascading", None)  # fixed by the name
    where = f"bad option for {kind}={name}"
    for opt in options:
        if opt not in fields:
            valid = f"valid: {', '.join(fields)}" if fields else "it takes no options"
            raise ValueError(f"{where}: unknown option {opt!r}; {valid}")
    try:
        part = factory(**options)
    except TypeError as err:
        for opt, value in options.items():
            _check_type(where, opt, value, fields[opt].type)
        raise ValueError(f"{where}: {err}") from None
    for opt, value in options.items():
        _check_type(where, opt, value, fields[opt].type)
    return part


def _check_type(where: str, opt: str, value: object, annotation: object) -> None:
    """Refuse ``value`` for a field annotated ``annotation`` (a string under postponed
    annotations) when its type cannot be right: text for a number, a number for a switch."""
    ann = str(annotation)
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    if "bool" in ann:
        ok, expected = isinstance(value, bool), "true or false"
    elif "float" in ann:
        ok, expected = numeric, "a number"
    elif "int" in ann:
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif "str" in ann:
        ok, expected = isinstance(value, str), "a name"
    else:
        return
    if not ok:
        shown = str(value).lower() if isinstance(value, bool) else value
        raise ValueError(f"{where}: {opt} must be {expected}, got {shown!r}")


def _parse_value(text: str) -> object:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def make_method(
    spec: str | Method = "cake",
    *,
    budget: int | None = None,
    ratio: float | None = None,
    window: int = 32,
    keep_ratio: float | None = None,
) -> Method:
    """Build a method from a preset name or a composed string.

    Examples: ``"cake"``, ``"snapkv"``, ``"layers=cake,heads=adakv,score=cake,select=critical"``,
    ``"cake,select=critical,decode=none"`` (a preset with overrides), and part options with a dot:
    ``"cake,layers.tau1=1.0,score.gamma=100"``. ``"full"`` keeps every entry (the uncompressed
    baseline, with the same summaries); it takes no budget.

    ``keep_ratio`` is ``ratio`` under a name that says what it means: the fraction of the prompt
    *kept* (kvpress's ``compression_ratio`` is the fraction removed: its 0.2 is our 0.8).
    Unknown names, options and values of the wrong type are refused, listing the valid ones;
    so are a key given twice and an empty part (``"cake,,select=critical"``).
    """
    if isinstance(spec, Method):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"method must be a preset name or a composed string, got {type(spec).__name__}: {spec!r}"
        )
    if not spec.strip():
        raise ValueError(f"method must be a preset name or a composed string, got {spec!r}")
    ratio = resolve_ratio(ratio, keep_ratio)
    if spec.strip().lower() == FULL:
        if budget is not None or ratio is not None:
            raise ValueError("method 'full' keeps every entry: drop budget=/keep_ratio=")
        return Method(budget=BudgetSpec(budget=MAX_BUDGET, window=window), name=FULL)
    tokens = [t.strip() for t in spec.split(",")]
    if "" in tokens:
        raise ValueError(f"empty part in method {spec!r}: remove the extra comma")
    choice = {"layers": "uniform", "heads": "uniform", "score": "snapkv", "select": "topk", "decode": "none"}
    name = "custom"
    if "=" not in tokens[0]:
        name = tokens.pop(0).lower()
        if name == FULL:
            raise ValueError(f"method 'full' keeps every entry and takes no parts or options, got {spec!r}: "
                             "write 'full'")  # fmt: skip
        if name not in PRESETS:
            close = difflib.get_close_matches(name, [*PRESETS, FULL], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown method {name!r}; presets: {', '.join(PRESETS)}, full; or compose "
                             f"e.g. 'layers=cake,heads=adakv,score=cake,select=critical'{hint}")  # fmt: skip
        choice.update(zip(("layers", "heads", "score", "select", "decode"), PRESETS[name][:5], strict=False))
    options: dict[str, dict[str, object]] = {k: {} for k in _KEYS}
    preset_tokens = [t for t in PRESET_OPTIONS.get(name, "").split(",") if t]
    seen: set[str] = set()
    for i, tok in enumerate([*preset_tokens, *tokens]):
        if "=" not in tok:
            raise ValueError(
                f"bad method part {tok!r}: expected key=value (keys: {', '.join([*_KEYS, 'decode'])})"
            )
        key, value = (s.strip() for s in tok.split("=", 1))
        if i >= len(preset_tokens):  # the caller's own parts override the preset's options
            if key in seen:
                raise ValueError(f"{key!r} is given twice in method {spec!r}: keep one")
            seen.add(key)
        if not value:
            raise ValueError(f"{key!r} has no value in method {spec!r}: write {key}=VALUE")
        if "." in key:
            part, opt = key.split(".", 1)
            if part not in options:
                raise ValueError(f"unknown method part {part!r} in {tok!r}; valid: {', '.join(options)}")
            options[part][opt] = _parse_value(value)
        elif key in choice:
            choice[key] = value.lower()
        else:
            raise ValueError(f"unknown method key {key!r}; valid: {', '.join([*_KEYS, 'decode'])}")
    for tok in preset_tokens:  # a preset's option is dropped with its part (e.g. ``select=topk``)
        part, opt = tok.split("=", 1)[0].split(".", 1)
        if choice[part] != PRESETS[name][list(_KEYS).index(part)] and not any(
            t.split("=", 1)[0].strip() == f"{part}.{opt}" for t in tokens
        ):
            options[part].pop(opt, None)
    if tokens and name != "custom":
        name = f"{name}+"  # a preset with overrides
    parts = {key: _build(key, choice[key], options[key]) for key in ("layers", "heads", "score", "select")}
    _check_decode(choice["decode"])
    return Method(  # the budget checked last: a bad spec is named first, whatever the budget
        budget=BudgetSpec(budget=budget, ratio=ratio, window=window),
        layers=parts["layers"],
        heads=parts["heads"],
        scorer=parts["score"],
        selector=parts["select"],
        decode=choice["decode"],
        name=name,
    )


def _check_decode(policy: str) -> None:
    if policy not in DECODE_POLICIES:
        raise ValueError(f"decode policy must be one of {DECODE_POLICIES}, got {policy!r}")


def resolve_ratio(ratio: float | None, keep_ratio: float | None) -> float | None:
    """``keep_ratio`` and its older name ``ratio`` are one setting: give at most one."""
    if keep_ratio is not None and ratio is not None:
        raise ValueError("give keep_ratio= or its older name ratio=, not both")
    return ratio if keep_ratio is None else keep_ratio


def list_methods() -> list[tuple[str, str]]:
    """(preset, one-line description with its parts) for every registered preset."""
    return [
        (
            name,
            f"{desc} [layers={p[0]}, heads={p[1]}, score={p[2]}, select={p[3]}, decode={p[4]}"
            + "".join(f", {o}" for o in PRESET_OPTIONS.get(name, "").split(",") if o)
            + "]",
        )
        for name, (*p, desc) in PRESETS.items()
    ]


# -- the method as a string make_method rebuilds ----------------------------------------------------
def method_spec(method: Method) -> str:
    """A composed string that ``make_method(spec, budget=..., ratio=..., window=...)`` turns
    back into an equal method (same parts, same field values; the name is kept separately).

    Each part is named by its registry key and every field that differs from its default is
    written as ``part.field=value``. Raises ``ValueError`` for a part that is not in a registry
    or whose options cannot be written as text (the round trip is checked, never assumed).
    """
    tokens: list[str] = []
    for key, part, registry in (
        ("layers", method.layers, LAYER_ALLOCATORS),
        ("heads", method.heads, HEAD_ALLOCATORS),
        ("score", method.scorer, SCORERS),
        ("select", method.selector, SELECTORS),
    ):
        name = next((k for k, factory in registry.items() if factory is type(part)), None)
        if name is None:
            raise ValueError(f"cannot save a method whose {key} part {type(part).__name__} is not registered")
        tokens.append(f"{key}={name}")
        if dataclasses.is_dataclass(part):
            for f in dataclasses.fields(part):
                if not f.init:
                    continue
                value = getattr(part, f.name)
                default = f.default if f.default is not dataclasses.MISSING else None
                if value == default and type(value) is type(default):
                    continue
                tokens.append(f"{key}.{f.name}={_format_value(value)}")
    tokens.append(f"decode={method.decode}")
    spec = ",".join(tokens)
    b = method.budget
    rebuilt = _rebuild_method(spec, b.budget, b.ratio, b.window, method.name, b.keep_short)
    if rebuilt != method:
        raise ValueError(f"cannot save method {method.describe()}: it does not round-trip through {spec!r}")
    return spec


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str) and value and not any(c in value for c in ",="):
        return value
    raise ValueError(f"cannot write the method option {value!r} as text")


def _rebuild_method(
    spec: str, budget: int | None, ratio: float | None, window: int, name: str, keep_short: bool = False
) -> Method:
    m = make_method(spec, budget=budget, ratio=ratio, window=window)
    return m.replace(name=name, budget=dataclasses.replace(m.budget, keep_short=keep_short))
