"""Package attributes imported on first use (PEP 562), so that ``import kvcake`` and the
command line's parser load neither torch nor transformers until something runs a model."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__``: ``exports`` maps each public name to the
    module that defines it (relative to ``package``), or to ``"module:name"`` where the module
    calls it otherwise; a submodule's name imports the submodule, as an eager package
    ``__init__`` had. Each value is imported once, then stored on the package.
    """

    def __getattr__(name: str) -> object:
        spec = exports.get(name)
        if spec is not None:
            module, _, attr = spec.partition(":")
            value = getattr(importlib.import_module(module, package), attr or name)
        elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
