"""What names a model without loading one: its fingerprint (a hash of its config) and where kvcake
keeps what it writes per model (converted models, calibrations).

Below the model loading (``kvcake.models``, which re-exports these) so that what reads shipped
calibrations (``kvcake.temperatures``, ``kvcake methods``) needs transformers' configs only, not
its modelling code.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

__all__ = ["VOLATILE_KEYS", "default_cache_root", "model_fingerprint", "strip_volatile"]


VOLATILE_KEYS = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "quantization_config",
        "architectures",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)


def strip_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: strip_volatile(v)
            for k, v in value.items()
            if k not in VOLATILE_KEYS and not str(k).startswith("_attn_implementation")
        }
    if isinstance(value, list | tuple):
        return [strip_volatile(v) for v in value]
    return value


def default_cache_root() -> Path:
    """Folder holding converted models when ``load_model`` gets no ``cache_dir``."""
    env = os.environ.get("KVCAKE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvcake" / "models"


def model_fingerprint(model: Any) -> str:
    """Short hash of a model's architecture, to refuse a saved KV cache from another model.

    A compressed context is only meaningful for the model that produced it. The hash covers
    the config (layers, heads, RoPE, vocabulary, the GGUF model name when there is one) and
    leaves out what does not change the keys and values a model computes: where it was loaded
    from, the transformers version, the dtype, the attention backend, quantisation metadata
    and runtime flags such as ``use_cache``. Two fine-tunes with identical configs share a
    fingerprint: it is a guard against mistakes, not an identity check of the weights.

    Parameters
    ----------
    model:
        A transformers model, or its config.

    Returns
    -------
    16 hexadecimal characters (the start of a SHA-256 digest).
    """
    config = getattr(model, "config", model)
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"expected a transformers model or config, got {type(model).__name__}")
    blob = json.dumps(strip_volatile(config.to_dict()), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
