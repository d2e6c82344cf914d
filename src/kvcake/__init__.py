"""kvcake: compress the KV cache of any Hugging Face causal LM while it generates.

CAKE (cascading, preference-based layer budgets), Ada-KV (per-head budgets on a ragged
cache), CriticalKV (output-aware selection) and the baselines they compare with, as
composable parts: a layer allocator x a head allocator x a token scorer x a selector.
"""

from typing import TYPE_CHECKING

from .lazy import lazy_exports
from .version import __version__

# Each public name and the module that defines it, imported on first use: ``import kvcake`` and
# ``kvcake --help`` load no torch or transformers (about 6 s here).
_EXPORTS = {
    "with_cache": ".adapters",
    "answer": ".answers",
    "compress": ".api",
    "generate": ".api",
    "enable": ".attention",
    "BudgetSpec": ".budget",
    "KVCakeCache": ".cache",
    "calibrate": ".calibration",
    "CompressedContext": ".context",
    "PRESETS": ".method",
    "Method": ".method",
    "list_methods": ".method",
    "make_method": ".method",
    "method_spec": ".method",
    "DEFAULT_MODEL": ".defaults",
    "load_model": ".models",
    "PromptIds": ".prompts",
    "build_prompt": ".prompts",
    "ContextFileError": ".storage",
    "load_context": ".storage",
    "save_context": ".storage",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # the same names, for type checkers and editors (tests/test_architecture.py: equal)
    from .adapters import with_cache
    from .answers import answer
    from .api import compress, generate
    from .attention import enable
    from .budget import BudgetSpec
    from .cache import KVCakeCache
    from .calibration import calibrate
    from .context import CompressedContext
    from .defaults import DEFAULT_MODEL
    from .method import PRESETS, Method, list_methods, make_method, method_spec
    from .models import load_model
    from .prompts import PromptIds, build_prompt
    from .storage import ContextFileError, load_context, save_context

__all__ = [
    "DEFAULT_MODEL",
    "PRESETS",
    "BudgetSpec",
    "CompressedContext",
    "ContextFileError",
    "KVCakeCache",
    "Method",
    "PromptIds",
    "__version__",
    "answer",
    "build_prompt",
    "calibrate",
    "compress",
    "enable",
    "generate",
    "list_methods",
    "load_context",
    "load_model",
    "make_method",
    "method_spec",
    "with_cache",
    "save_context",
]
