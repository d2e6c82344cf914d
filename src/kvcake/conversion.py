"""Converting a GGUF checkpoint once into a folder that reloads in about a second, and the
on-disk cache of those folders (validity check, atomic writes). Loading lives in ``models``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from .gguf_tokenizer import align_special_tokens, check_tokenizer, read_tokenizer_meta

logger = logging.getLogger("kvcake.models")

# Bump when the layout of a converted folder changes, to invalidate old caches. 2: the tokenizer's
# special tokens set from the GGUF file and the tokenizer checked (``gguf_tokenizer``).
_CACHE_FORMAT = 2
_CACHE_META = "kvcake-cache.json"


def convert_gguf(
    gguf_file: str | os.PathLike[str], out_dir: str | os.PathLike[str]
) -> tuple[PreTrainedModel, Any]:
    """De-quantise a GGUF file to float32 and write it as a folder ``from_pretrained`` loads fast.

    ``save_pretrained`` refuses a model loaded from GGUF, so this writes the three parts itself:
    the config without its ``quantization_config`` (the weights are no longer quantised), the
    weights with ``safetensors.torch.save_model`` (which stores tied tensors once) and the
    tokenizer, its special tokens and BOS flag set from the file's tokenizer keys and checked
    against them as the folder reloads it (:mod:`kvcake.gguf_tokenizer`). The folder is built
    next to ``out_dir`` and moved into place with one rename, so an interrupted conversion never
    leaves a half-written folder that later loads would trust.

    Parameters
    ----------
    gguf_file:
        Path of the ``.gguf`` file.
    out_dir:
        Folder to create. An existing folder there is replaced.

    Returns
    -------
    ``(model, tokenizer)`` as loaded from the GGUF file (float32, CPU), e.g. to compare with a
    reload of ``out_dir``.

    Raises
    ------
    ValueError
        The tokenizer transformers converted is not the file's (vocabulary, BOS or EOS); the
        message names the transformers release to upgrade to. Nothing is written.
    """
    gguf_path = Path(gguf_file).expanduser().resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"No such GGUF file: {gguf_path}")
    target = Path(out_dir).expanduser()
    meta = _source_meta(gguf_path)
    logger.info("Converting %s to %s (one-off; takes ~20-30 s on 2 CPU cores)", gguf_path.name, target)
    start = time.perf_counter()
    tokenizer, tokenizer_meta = _aligned_tokenizer(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="sdpa"
    )
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]

    def build(tmp: Path) -> None:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # what later loads read (the class a folder reloads as depends on its config): before the weights
        check_tokenizer(AutoTokenizer.from_pretrained(tmp), tokenizer_meta, gguf_path.name)
        safetensors.torch.save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        (tmp / _CACHE_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")

    _write_atomically(target, build)
    logger.info("Converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
    return model, tokenizer


def _aligned_tokenizer(gguf_path: Path):
    """The file's tokenizer as transformers converts it, its special tokens and BOS flag set from
    the file's own keys (:mod:`kvcake.gguf_tokenizer`), and those keys."""
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    meta = read_tokenizer_meta(gguf_path)
    # the vocabulary before the weights load (a refusal in seconds, not minutes); all of it on reload
    check_tokenizer(tokenizer, meta, gguf_path.name, special=False)
    if changed := align_special_tokens(tokenizer, meta):
        logger.info("%s: set from the file's tokenizer keys: %s", gguf_path.name, ", ".join(changed))
    return tokenizer, meta


def _source_meta(gguf_path: Path) -> dict[str, Any]:
    stat = gguf_path.stat()
    return {
        "format": _CACHE_FORMAT,
        "gguf_file": gguf_path.name,
        # two files of one name share a folder: neither is served the other's weights
        "gguf_path": str(gguf_path.resolve()),
        "gguf_size": stat.st_size,
        "gguf_mtime_ns": stat.st_mtime_ns,
        "transformers_version": transformers.__version__,
    }


def converted_from(folder: Path) -> str | None:
    """The GGUF file a converted ``folder`` was made from (its path), or None where it says none."""
    try:
        return str(json.loads((folder / _CACHE_META).read_text())["gguf_path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _cache_is_valid(folder: Path, expected: dict[str, Any]) -> bool:
    try:
        meta = json.loads((folder / _CACHE_META).read_text())
    except (OSError, ValueError):
        return False
    return meta == expected and (folder / "model.safetensors").is_file()


def converted_folder(root: Path, name: str) -> Path:
    """Where model ``name``'s conversion lives under ``root``: one folder per transformers
    version, since what a conversion holds (de-quantised weights, tokenizer files, config keys)
    is transformers' own GGUF reader's output. Environments with different transformers (the
    development venv and the floor one) then share ``root`` without reconverting at each switch."""
    return root / f"{name}@transformers-{transformers.__version__}"


def _ensure_converted(gguf_path: Path, folder: Path) -> Path:
    """Return ``folder``, converting ``gguf_path`` into it first unless a valid copy is there.
    Processes that load the same model for the first time at once convert it once: the others
    wait for the first one's copy (:func:`_conversion_lock`)."""
    expected = _source_meta(gguf_path)
    if _cache_is_valid(folder, expected):
        logger.debug("Using cached conversion %s", folder)
        return folder
    with _conversion_lock(folder):
        if _cache_is_valid(folder, expected):  # another process converted it while this one waited
            logger.info("Using the conversion another process just made in %s", folder)
            return folder
        if folder.exists():
            logger.info("Cached conversion %s is stale (GGUF file or transformers changed)", folder)
        model, tokenizer = convert_gguf(gguf_path, folder)
        del model, tokenizer  # reloaded from the folder, so every load returns the same objects
    return folder


@contextlib.contextmanager
def _conversion_lock(folder: Path) -> Iterator[None]:
    """Held while ``folder`` is checked and converted (an exclusive ``flock`` on a file beside it).
    Without it, two processes loading a model for the first time both converted it, and the later
    one's rename moved the first one's folder away while that process was reading its weights
    (FileNotFoundError). Where ``fcntl`` is missing (Windows) nothing is locked, and first loads at
    once can still fail so."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def process_umask() -> int:
    """The process's umask: Linux's /proc says it; elsewhere it is set and set back (Python has no
    reader, and the brief change could touch a file another thread creates meanwhile)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_atomically(target: Path, build: Callable[[Path], None]) -> None:
    """Run ``build`` on a fresh temporary folder beside ``target``, then rename it to ``target``.

    A folder already at ``target`` is moved aside and removed first; a copy another process renames
    into place between that and this rename wins, and ours is discarded. Loads that convert into
    the cache take :func:`_conversion_lock` around this, so that they never replace each other's
    folder.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o777 & ~process_umask())  # as mkdir makes it (mkdtemp's 0o700 hides a shared cache)
        if target.exists():
            # os.replace cannot overwrite a non-empty folder: move the stale one aside first.
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
            try:
                os.replace(target, stale / "old")
            except FileNotFoundError:
                pass  # another process removed it meanwhile
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
            logger.info("%s was written concurrently by another process; using that copy", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_tied_embeddings(model: PreTrainedModel, folder: Path) -> None:
    """Fail loudly if a model that ties its output head to its embeddings came back untied.

    The converted folder stores a tied matrix once; a loader that did not re-tie it would
    leave the head randomly initialised and the model silently broken.
    """
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embed is None or head.weight is embed.weight:
        return
    if head.weight.shape != embed.weight.shape or not torch.equal(head.weight, embed.weight):
        raise RuntimeError(
            f"{folder}: the config ties the output head to the input embeddings but the loaded "
            "weights differ. Delete this folder to rebuild it."
        )
