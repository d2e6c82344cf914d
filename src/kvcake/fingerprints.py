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

__all__ = [
    "RUNTIME_KEYS",
    "VOLATILE_KEYS",
    "config_digests",
    "default_cache_root",
    "kv_fingerprint",
    "model_fingerprint",
    "strip_volatile",
]


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


#: Config fields the fingerprint covers (changing them would change every shipped and saved
#: fingerprint) that change nothing a model computes for its keys and values: the special tokens'
#: ids (``model.config.pad_token_id = tokenizer.eos_token_id`` is a common line before generating),
#: a classification head's labels, the initialisation's spread, and the like. A context file or a
#: calibration made with other values of these serves the model (:func:`kv_fingerprint`).
RUNTIME_KEYS = frozenset(
    {
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "id2label",
        "label2id",
        "problem_type",
        "finetuning_task",
        "task_specific_params",
        "prefix",
        "tokenizer_class",
        "chunk_size_feed_forward",
        "output_router_logits",
        "initializer_range",
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
    return _digest(_config(model), 16)


def _digest(value: Any, digits: int) -> str:
    """The start of the SHA-256 of ``value`` as sorted JSON: every hash of a config here."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:digits]


def _config(model: Any) -> dict:
    config = getattr(model, "config", model)
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"expected a transformers model or config, got {type(model).__name__}")
    return strip_volatile(config.to_dict())


def _leaves(value: Any, path: str = "") -> dict[str, Any]:
    """``{"text_config.num_hidden_layers": 30, ...}``: every leaf of a config dict by its path."""
    if isinstance(value, dict) and value:
        return {
            k: v
            for key, sub in value.items()
            for k, v in _leaves(sub, f"{path}.{key}" if path else key).items()
        }
    return {path: value}


def config_digests(model: Any) -> dict[str, str]:
    """Each field the fingerprint covers, by its path in the config, hashed (8 hexadecimal digits):
    what a context file keeps to name the fields in which another model differs."""
    return {path: _digest(value, 8) for path, value in _leaves(_config(model)).items()}


def runtime_only(paths) -> bool:
    """Whether every config field in ``paths`` (dotted) is one of :data:`RUNTIME_KEYS`."""
    return all(path.rsplit(".", 1)[-1] in RUNTIME_KEYS for path in paths)


def kv_fingerprint(model: Any) -> str:
    """:func:`model_fingerprint` without :data:`RUNTIME_KEYS`, at any depth: equal for the same model
    with other special-token ids, under which a calibration made for it still holds."""
    return _digest({p: v for p, v in _leaves(_config(model)).items() if not runtime_only([p])}, 16)
