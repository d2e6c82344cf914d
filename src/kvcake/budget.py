"""How large the cache may be: one definition of a budget, used everywhere.

A *budget* is the number of KV entries kept for one (sequence, layer, KV head), the recent
window and any sink tokens included (the papers' ``128L`` is an average of 128 per layer, so
``B_total = 128 * L`` per sequence and KV head). The user gives either an average per-layer
budget (``budget=128``) or a kept fraction of each sequence's own prompt (``ratio=0.2``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from .defaults import DEFAULT_KEEP_RATIO

logger = logging.getLogger(__name__)

# Budgets beyond this many entries per layer are all "unbounded" (see BudgetSpec.per_layer).
MAX_BUDGET = 1 << 40

#: The method ``kvcake.answer`` uses when none is given, per scenario: the "Which method" pick of
#: README / docs/results.md on the default model: `layer-defensivekv` in both (question-aware KL
#: 0.0053 at 0.25 against SnapKV's 0.089; context-only score 53 and KL 0.026 at 0.5 against
#: CriticalKV's 42 and 0.085, H2O's 42 and 0.055), for added prefill work of 4-9% of the full
#: cache's prefill (docs/benchmarks.md).
DEFAULT_METHOD = {"question": "layer-defensivekv", "context": "layer-defensivekv"}

#: The protected recent window (``Sw``) where none is given: SnapKV's and CAKE's 32.
DEFAULT_WINDOW = 32

#: A run keeping less than this fraction of a prompt of at least STARVED_MIN_TOKENS gets a warning.
STARVED_FRACTION = 0.03
STARVED_MIN_TOKENS = 1024


def default_budget(
    scenario: str, prompt_tokens: int, window: int = DEFAULT_WINDOW
) -> dict[str, int | float | bool]:
    """:class:`BudgetSpec` keywords for prompts of at most ``prompt_tokens`` (a batch's padded
    length) when the user gave no size: ``DEFAULT_KEEP_RATIO[scenario]`` with ``keep_short``, so
    that a prompt of the batch too short for it keeps every entry as it would alone; or every
    entry (``budget=MAX_BUDGET``: the prompt's and those after it) when even ``prompt_tokens``
    are. A prompt that short needs no compression; a budget of its own length would have a
    ``decode=fixed`` preset evict one of its oldest entries at every step (the attention sink
    first under CAKE's average pooling, whose zero padding leaves the oldest entry three of its
    five terms), which garbled short answers."""
    if scenario not in DEFAULT_KEEP_RATIO:
        raise ValueError(f"scenario must be one of {', '.join(DEFAULT_KEEP_RATIO)}, got {scenario!r}")
    check_window(window)
    ratio = DEFAULT_KEEP_RATIO[scenario]
    if round(ratio * prompt_tokens) < window:
        logger.info("a %d-token prompt is too short for the default keep ratio %s (it would keep fewer than the "
                    "%d-token window): every entry is kept", prompt_tokens, ratio, window)  # fmt: skip
        return {"budget": MAX_BUDGET}
    return {"ratio": ratio, "keep_short": True}


def spell(key: str, value: object = None, names: dict[str, str] | None = None) -> str:
    """Option ``key`` as the caller spells it in a message: a keyword (``budget=128``, ``budget=``)
    or, where ``names`` maps it to a command-line flag, the flag (``--budget 128``, ``--budget``).
    One check then serves the Python API and every command line, each in its own words."""
    flag = (names or {}).get(key)
    if flag is None:
        return f"{key}=" if value is None else f"{key}={value!r}"
    return flag if value is None else f"{flag} {value}"


def check_window(window, names: dict[str, str] | None = None) -> None:
    """The protected recent window must be a positive int (bool is not one) within any prompt."""
    if isinstance(window, bool) or not isinstance(window, int):
        example = spell("window", DEFAULT_WINDOW, names)
        raise TypeError(f"window must be a positive int, got {type(window).__name__}: pass e.g. {example}")
    if window < 1:
        flag = spell("window", names=names)
        raise ValueError(f"{flag} must be at least 1 token, got {window!r} (default {DEFAULT_WINDOW})")
    if window > MAX_BUDGET:
        raise ValueError(f"{spell('window', window, names)} is beyond any prompt: pass at most {MAX_BUDGET}")


def check_sizes(
    budget=None, ratio=None, window: int = DEFAULT_WINDOW, names: dict[str, str] | None = None
) -> None:
    """The values of a size: ``budget`` a positive int of at least ``window``, ``ratio`` in
    ``(0, 1]``, ``window`` a positive int. Refused naming the fix in the caller's words: keywords by
    default (``budget=``, ``keep_ratio=``, ``window=``), or the flags ``names`` maps them to
    (``{"budget": "--budget", "keep_ratio": "--keep-ratio", "window": "--window"}``)."""
    check_window(window, names)
    if budget is not None:
        size, example = spell("budget", names=names), spell("budget", 128, names)
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise TypeError(f"budget must be an int, got {type(budget).__name__}: pass e.g. {example}")
        if budget <= 0:
            raise ValueError(
                f"{size} must be at least 1 entry per layer and KV head, got {budget}: pass e.g. {example}"
            )
        if window > budget:
            sw = spell("window", names=names)
            raise ValueError(
                f"{spell('window', window, names)} is larger than {spell('budget', budget, names)}: "
                f"the window is part of the budget, so lower {sw} or raise {size}"
            )
    if ratio is not None:
        kept, example = spell("keep_ratio", names=names), spell("keep_ratio", 0.25, names)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
            raise TypeError(f"keep_ratio must be a number, got {type(ratio).__name__}: pass e.g. {example}")
        if not math.isfinite(ratio) or not 0.0 < ratio <= 1.0:
            raise ValueError(
                f"{kept} must be in (0, 1], got {ratio} (the fraction of the prompt kept; kvpress's "
                f"compression_ratio=0.75 is {example})"
            )


@dataclass(frozen=True)
class BudgetSpec:
    """An average per-layer budget or a kept ratio, plus the protected recent window.

    Parameters
    ----------
    budget:
        Average KV entries kept per layer and KV head (window included). Mutually exclusive
        with ``ratio``.
    ratio:
        Kept fraction of each sequence's prompt, in ``(0, 1]``; the per-layer average is
        ``round(ratio * prompt_length)``, or the window for a prompt no longer than it.
    window:
        The observation window ``Sw`` (default 32, SnapKV and CAKE): the last ``window``
        prompt tokens are always kept and their queries drive the scores.
    keep_short:
        With ``ratio``: a prompt whose ratio of entries would be fewer than the window keeps
        every entry (``MAX_BUDGET``, as :func:`default_budget` gives a prompt that short alone)
        instead of being refused; the default sizes of ``kvcake.generate`` and
        ``kvcake.compress`` set it, so each prompt of a padded batch is sized as it is alone.
    """

    budget: int | None = None
    ratio: float | None = None
    window: int = 32
    keep_short: bool = False

    def __post_init__(self) -> None:
        if (self.budget is None) == (self.ratio is None):
            raise ValueError(
                "give exactly one of budget= (entries per layer) or keep_ratio= (the fraction kept)"
            )
        check_sizes(self.budget, self.ratio, self.window)
        check_flag("keep_short", self.keep_short)
        if self.keep_short and self.ratio is None:
            raise ValueError("keep_short applies to a keep ratio: give keep_ratio= with it, or drop it")

    def per_layer(self, lengths: torch.Tensor) -> torch.Tensor:
        """Average per-layer budget of each sequence. ``lengths``: (B,) int64 valid prompt lengths."""
        if self.budget is not None:
            # Any budget above the longest possible prompt means "keep everything"; capping it
            # keeps ``per_layer * L`` and Ada-KV's ``H_kv * B'`` far from int64 overflow.
            return torch.full_like(lengths, min(self.budget, MAX_BUDGET))
        avg = torch.clamp(torch.round(lengths.double() * self.ratio).long(), min=1)
        # The budget never falls below the window, as with budget= (window <= budget): a prompt
        # no longer than the window is all window and kept whole, and decoding with a fixed
        # budget keeps the newest ``window`` tokens. (A smaller budget would evict window
        # entries, and top-k among their equal +inf scores keeps the oldest, not the newest.)
        avg = torch.where(lengths <= self.window, torch.full_like(avg, self.window), avg)
        short = (avg < self.window) & (lengths > self.window)
        if self.keep_short:
            return torch.where(short, torch.full_like(avg, MAX_BUDGET), avg)
        if bool(short.any()):
            i = int(short.nonzero()[0, 0])
            raise ValueError(
                f"ratio {self.ratio} of a {int(lengths[i])}-token prompt gives a budget of {int(avg[i])}, "
                f"smaller than the window ({self.window}): raise keep_ratio= or lower window="
            )
        return avg

    @property
    def keeps_all(self) -> bool:
        """Whether the budget is beyond any prompt (``MAX_BUDGET``): nothing is ever evicted."""
        return self.budget is not None and self.budget >= MAX_BUDGET

    def describe(self) -> str:
        if self.keeps_all:
            return "budget=all"
        if self.budget is not None:
            return f"budget={self.budget}"
        return f"ratio={self.ratio}" + (" (a prompt too short for it kept whole)" if self.keep_short else "")


def check_capacity(max_cache_len: int | None) -> int | None:
    """``max_cache_len``, which must be None or a positive token count (bool is not one)."""
    if max_cache_len is not None and (type(max_cache_len) is not int or max_cache_len < 1):
        raise ValueError(
            f"max_cache_len must be a positive int, the prompt's tokens plus the tokens to generate "
            f"(or None when unknown), got {max_cache_len!r}"
        )
    return max_cache_len


def check_flag(name: str, value: object) -> bool:
    """A True/False argument, refused otherwise: ``bool("False")`` is True, so a string or a number
    passed for a flag would silently turn it on."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def check_int(what: str, value: object, minimum: int, example: str) -> None:
    """An int option of at least ``minimum``, refused otherwise naming ``what`` and ``example``
    (the fix): a bool is not one (``True`` would read as 1), nor a float or a string."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {value!r} ({type(value).__name__}): pass e.g. {example}")
    if value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value}: pass e.g. {example}")


def check_real(what: str, value: object, example: str, low: float = 0.0, high: float = math.inf,
               above: bool = False) -> None:  # fmt: skip
    """A finite number in ``[low, high]`` (``above``: greater than ``low``), refused otherwise
    naming ``what`` and ``example`` (the fix): a bool is not one, and NaN is in no range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{what} must be a number, got {value!r} ({type(value).__name__}): pass e.g. {example}"
        )
    if not (math.isfinite(value) and (value > low if above else value >= low) and value <= high):
        bounds = (
            f"in [{low:g}, {high:g}]"
            if math.isfinite(high)
            else f"a finite number {'>' if above else '>='} {low:g}"
        )
        raise ValueError(f"{what} must be {bounds}, got {value}: pass e.g. {example}")
