"""Per-model calibration of CAKE's temperatures (``kvcake.calibrate``, ``kvcake calibrate``).

The temperatures in force are resolved by :mod:`kvcake.temperatures` (user > local
calibration > shipped calibration > family default > flat fallback), one set per scenario
(question-aware, context-only); this package finds them, by the KL of the next-token distributions:
:mod:`.samples` builds calibration prompts and their full-cache reference, :mod:`.search` runs
the grid search, :mod:`.api` ties them together and stores the result, :mod:`.cli` is the command.
"""

from typing import TYPE_CHECKING

from kvcake.lazy import lazy_exports

# Each public name and the module that defines it, imported on first use: ``kvcake --help``
# builds ``kvcake calibrate``'s parser without loading torch.
_EXPORTS = {
    "calibrate": ".api",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from .api import calibrate

__all__ = ["calibrate"]
