"""kvcake: compress the KV cache of any Hugging Face causal LM while it generates.

CAKE (cascading, preference-based layer budgets), Ada-KV (per-head budgets on a ragged
cache), CriticalKV (output-aware selection) and the baselines they compare with, as
composable parts: a layer allocator x a head allocator x a token scorer x a selector.
"""

from .adapters import with_cache
from .answers import answer
from .api import compress, generate
from .attention import enable
from .budget import BudgetSpec
from .cache import KVCakeCache
from .calibration import calibrate
from .context import CompressedContext
from .method import PRESETS, Method, list_methods, make_method, method_spec
from .models import DEFAULT_MODEL, load_model
from .prompts import PromptIds, build_prompt
from .storage import ContextFileError, load_context, save_context
from .version import __version__

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
