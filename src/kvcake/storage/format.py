"""The context file format shared by the writer and the reader: its name and version, the
error for an unusable file, the digest over JSON and tensors, and the header parser."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import torch

from ..version import __version__

FORMAT_NAME = "kvcake-context"
FORMAT_VERSION = 1
_META_KEY = "kvcake"
_DIGEST_KEY = "kvcake.sha256"
_CHUNK = 1 << 20  # bytes per write call
_MAX_HEADER = 100 << 20  # safetensors' own limit on the header size


class ContextFileError(ValueError):
    """A saved context cannot be used: wrong model, unknown format, truncated or corrupted."""


def _digest(meta_json: str, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(meta_json.encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        if t.numel():
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _read_header(path: Path, head: bytes, size: int) -> dict[str, Any]:
    """The kvcake JSON of a file, from its first bytes; raises ContextFileError."""
    if size < 8 or len(head) < 8:
        raise ContextFileError(
            f"{path} is not a kvcake context file: it is empty or truncated ({size} bytes)"
        )
    (n,) = struct.unpack("<Q", head[:8])
    if n > _MAX_HEADER or 8 + n > size:
        raise ContextFileError(
            f"{path} is truncated or not a kvcake context file (its header claims {n} bytes, the file has {size})"
        )
    try:
        header = json.loads(head[8 : 8 + n])
        meta = json.loads(header["__metadata__"][_META_KEY])
    except (ValueError, KeyError, TypeError) as err:
        raise ContextFileError(
            f"{path} is not a kvcake context file or its header is corrupted ({type(err).__name__}: {err})"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise ContextFileError(f"{path} is a safetensors file but not a kvcake context file")
    version = meta.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ContextFileError(
            f"{path} has no valid format version ({version!r}): corrupted or not written by kvcake"
        )
    if version > FORMAT_VERSION:
        raise ContextFileError(
            f"{path} uses context format version {version}, newer than this kvcake "
            f"({_library_version()}) reads (up to {FORMAT_VERSION}): upgrade kvcake"
        )
    if version < 1:
        raise ContextFileError(f"{path} has an unknown context format version {version}")
    return meta


def _library_version() -> str:
    return __version__
