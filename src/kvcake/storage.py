"""Save a compressed context to disk and load it back, bit for bit.

File format (one file, conventionally ``*.kvc``): an ordinary safetensors file. The tensors
are the cache's exact state; the JSON description lives in the safetensors metadata header
under the key ``"kvcake"``, and a SHA-256 digest of that JSON plus every tensor (name, dtype,
shape, bytes) under ``"kvcake.sha256"``, so a corrupted file is refused instead of answering
wrongly (safetensors itself checks the header's structure, not the data).

Tensors (``l`` is a layer index, ``B`` the batch, ``L`` the layers, ``H_kv`` the KV heads):

* ``context.input_ids`` / ``context.attention_mask`` (B, S), ``context.logits`` (B, vocab);
* ``layers.l.keys`` / ``layers.l.values``: dense (B, H_kv, N, d) or ragged flattened (T, d);
  ``layers.l.positions`` (same layout, -1 = empty slot); ``layers.l.counts`` (B, H_kv);
  ``layers.l.lengths`` (B * H_kv,) for ragged layers; ``layers.l.scores`` when the cache keeps
  its eviction scores while decoding (H2O with the ``fixed`` policy);
* ``cache.budgets`` (B, L), ``cache.decode_budget`` (B, L, H_kv), ``cache.stage_budgets.i``
  (B, i + 1) for the cascade's stages, ``cache.entropy`` / ``cache.variance`` /
  ``cache.preferences`` (L, B) for CAKE allocation, ``cache.seq.*`` (B,) the per-sequence
  budget facts.

The JSON holds the format version, the library version, the model (fingerprint, type, shapes,
dtype), the method (``Method.describe()``, a composed ``spec`` string that ``make_method``
rebuilds exactly, and its budget, ratio and window), each layer's layout and logical length,
the final budgets, and a free ``extra`` dict for the caller (the CLI keeps its prompt layout
there).

Writing is atomic: the bytes go to a temporary file in the target's folder, which is fsynced
and renamed over the target with ``os.replace``; a crash leaves the old file (or none).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from .adapters import describe_model
from .api import CompressedContext
from .cache import KVCakeCache, SequenceBudgets
from .devices import input_device, layer_devices, output_device
from .method import HEAD_ALLOCATORS, LAYER_ALLOCATORS, SCORERS, SELECTORS, Method, make_method
from .ragged import RaggedMeta

logger = logging.getLogger(__name__)

FORMAT_NAME = "kvcake-context"
FORMAT_VERSION = 1
_META_KEY = "kvcake"
_DIGEST_KEY = "kvcake.sha256"
_CHUNK = 1 << 20  # bytes per write call
_MAX_HEADER = 100 << 20  # safetensors' own limit on the header size

__all__ = [
    "FORMAT_VERSION",
    "ContextFileError",
    "load_context",
    "method_spec",
    "read_context_info",
    "save_context",
]


class ContextFileError(ValueError):
    """A saved context cannot be used: wrong model, unknown format, truncated or corrupted."""


# -- the method as a string make_method rebuilds ----------------------------------------------------
def method_spec(method: Method) -> str:
    """A composed string that ``make_method(spec, budget=..., ratio=..., window=...)`` turns
    back into an equal method (same parts, same field values; the name is kept separately).

    Each part is named by its registry key and every field that differs from its default is
    written as ``part.field=value``. Raises ``ValueError`` for a part that is not in a registry
    or whose options cannot be written as text (the round trip is checked, never assumed).
    """
    tokens: list[str] = []
    for key, part, registry in (
        ("layers", method.layers, LAYER_ALLOCATORS),
        ("heads", method.heads, HEAD_ALLOCATORS),
        ("score", method.scorer, SCORERS),
        ("select", method.selector, SELECTORS),
    ):
        name = next((k for k, factory in registry.items() if factory is type(part)), None)
        if name is None:
            raise ValueError(f"cannot save a method whose {key} part {type(part).__name__} is not registered")
        tokens.append(f"{key}={name}")
        if dataclasses.is_dataclass(part):
            for f in dataclasses.fields(part):
                if not f.init:
                    continue
                value = getattr(part, f.name)
                default = f.default if f.default is not dataclasses.MISSING else None
                if value == default and type(value) is type(default):
                    continue
                tokens.append(f"{key}.{f.name}={_format_value(value)}")
    tokens.append(f"decode={method.decode}")
    spec = ",".join(tokens)
    rebuilt = _rebuild_method(
        spec, method.budget.budget, method.budget.ratio, method.budget.window, method.name
    )
    if rebuilt != method:
        raise ValueError(f"cannot save method {method.describe()}: it does not round-trip through {spec!r}")
    return spec


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str) and value and not any(c in value for c in ",="):
        return value
    raise ValueError(f"cannot write the method option {value!r} as text")


def _rebuild_method(spec: str, budget: int | None, ratio: float | None, window: int, name: str) -> Method:
    return make_method(spec, budget=budget, ratio=ratio, window=window).replace(name=name)


# -- saving -------------------------------------------------------------------------------------------
def _host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor owning its storage (safetensors refuses shared storage)."""
    return t.detach().to("cpu").contiguous().clone()


def _digest(meta_json: str, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(meta_json.encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        if t.numel():
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _model_meta(model: torch.nn.Module) -> dict[str, Any]:
    from .models import model_fingerprint

    info = describe_model(model)
    return {
        "fingerprint": model_fingerprint(model),
        "name_or_path": str(getattr(model.config, "_name_or_path", "") or ""),
        "model_type": info.model_type,
        "num_layers": info.num_layers,
        "num_heads": info.num_heads,
        "num_kv_heads": info.num_kv_heads,
        "head_dim": info.head_dim,
        "dtype": str(model.dtype).removeprefix("torch."),
    }


def save_context(ctx: CompressedContext, path: str | os.PathLike[str], *, extra: dict | None = None) -> Path:
    """Write ``ctx`` to ``path`` atomically (see the module docstring for the format).

    Parameters
    ----------
    ctx:
        A prefilled :class:`~kvcake.api.CompressedContext` (from :func:`kvcake.compress`).
    path:
        Target file; its folder is created if needed, an existing file is replaced.
    extra:
        JSON-serialisable facts to keep with the context (returned by ``read_context_info``).

    Returns the path written.
    """
    cache = ctx.cache
    if not isinstance(cache, KVCakeCache) or not cache.prefilled:
        raise ValueError("only a prefilled KVCakeCache can be saved (make it with kvcake.compress)")
    from . import __version__

    method = cache.method
    tensors: dict[str, torch.Tensor] = {
        "context.input_ids": _host(ctx.input_ids),
        "context.attention_mask": _host(ctx.attention_mask),
        "context.logits": _host(ctx.logits),
        "cache.budgets": _host(cache.budgets),
        # host: saved from numpy
        "cache.decode_budget": torch.from_numpy(np.ascontiguousarray(cache.decode_budget, dtype=np.int64)),
    }
    for i, stage in enumerate(cache.stage_budgets):
        tensors[f"cache.stage_budgets.{i}"] = _host(stage)
    for name in ("entropy", "variance", "preferences"):
        values = getattr(cache, name)
        if values:
            tensors[f"cache.{name}"] = _host(torch.stack([v.to("cpu") for v in values]))  # (L, B)
    if cache.seq is not None:
        for f in dataclasses.fields(SequenceBudgets):
            tensors[f"cache.seq.{f.name}"] = _host(getattr(cache.seq, f.name))
    layers_meta = []
    kv_dtype = None
    for lid, layer in enumerate(cache.layers):
        if layer.keys is None:
            raise ValueError(f"layer {lid} of the cache is empty: nothing to save")
        kv_dtype = layer.keys.dtype
        prefix = f"layers.{lid}."
        tensors[prefix + "keys"] = _host(layer.keys)
        tensors[prefix + "values"] = _host(layer.values)
        tensors[prefix + "positions"] = _host(layer.positions)
        # host: saved from numpy
        tensors[prefix + "counts"] = torch.from_numpy(np.ascontiguousarray(layer.counts, dtype=np.int64))
        if layer.scores is not None:
            tensors[prefix + "scores"] = _host(layer.scores)
        entry = {"layout": layer.layout, "plain": bool(layer.plain), "length": int(layer.length),
                 "has_scores": layer.scores is not None}  # fmt: skip
        if layer.layout == "ragged":
            tensors[prefix + "lengths"] = _host(layer.meta.lengths)
            entry["max_len"] = int(layer.meta.max_len)
        layers_meta.append(entry)
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "kvcake_version": __version__,
        "model": _model_meta(ctx.model),
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "method": {
            "describe": method.describe(),
            "name": method.name,
            "spec": method_spec(method),
            "budget": method.budget.budget,
            "ratio": method.budget.ratio,
            "window": method.budget.window,
        },
        "context": {"batch": int(ctx.input_ids.shape[0]), "length": int(ctx.input_ids.shape[1])},
        "cache": {
            "prefilled": True,
            "peak_kv_bytes": int(cache.peak_kv_bytes),
            "prefill_peak_kv_bytes": int(cache.prefill_peak_kv_bytes),
            "tau": list(cache._tau) if cache._tau is not None else None,
            "num_stages": len(cache.stage_budgets),
            "kv_bytes": int(cache.kv_bytes()),
            "kept_entries": int(cache.kept_entries()),
        },
        "budgets": cache.budgets.tolist(),
        "layers": layers_meta,
        "extra": extra or {},
    }
    meta_json = json.dumps(meta, sort_keys=True)
    blob = safetensors.torch.save(
        tensors, metadata={_META_KEY: meta_json, _DIGEST_KEY: _digest(meta_json, tensors)}
    )
    target = Path(path).expanduser()
    _write_atomically(target, blob)
    logger.info("saved %s (%d bytes, %s)", target, len(blob), method.describe())
    return target


def _write_chunks(fh, data: bytes) -> None:
    view = memoryview(data)
    for start in range(0, len(view), _CHUNK):
        fh.write(view[start : start + _CHUNK])


def _write_atomically(target: Path, data: bytes) -> None:
    """Temporary file in the target's folder, fsync, ``os.replace``; nothing left on failure."""
    if target.is_dir():
        raise IsADirectoryError(f"{target} is a directory: give a file name such as {target / 'context.kvc'}")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            _write_chunks(fh, data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable (not possible on every platform)
        dir_fd = os.open(target.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


# -- loading ------------------------------------------------------------------------------------------
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
    from . import __version__

    return __version__


def read_context_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON description of a saved context (model, method, budgets, ``extra``), read from
    its header only: cheap, and no model needed. Raises ``FileNotFoundError`` or
    ``ContextFileError``."""
    p = Path(path).expanduser()
    size = _file_size(p)
    with open(p, "rb") as fh:
        head = fh.read(8)
        if len(head) == 8:
            (n,) = struct.unpack("<Q", head)
            head += fh.read(min(n, _MAX_HEADER + 1))
    return _read_header(p, head, size)


def _file_size(p: Path) -> int:
    if not p.exists():
        raise FileNotFoundError(f"no such context file: {p}")
    if p.is_dir():
        raise ContextFileError(f"{p} is a directory, not a kvcake context file")
    return p.stat().st_size


def load_context(model: torch.nn.Module, path: str | os.PathLike[str]) -> CompressedContext:
    """Rebuild the :class:`~kvcake.api.CompressedContext` saved at ``path`` for ``model``.

    The cache gets exactly the saved state (entries, positions, layouts, budgets, decoding
    budgets, scores), so next-token logits and generations equal those of the saved context.
    Each layer's tensors go to its layer's device (models split with ``device_map`` too), the
    context's ids to the input device, budgets and preferences stay on the host.

    Raises
    ------
    FileNotFoundError
        No such file.
    ContextFileError
        The file was saved for another model (fingerprint), with another KV dtype, in an
        unknown format version, or it is truncated, corrupted or incomplete.
    """
    p = Path(path).expanduser()
    size = _file_size(p)
    data = p.read_bytes()
    meta = _read_header(p, data, size)
    try:
        tensors = safetensors.torch.load(data)
    except Exception as err:  # safetensors raises its own error type for any malformed file
        raise ContextFileError(f"{p} is corrupted or truncated: safetensors cannot read it ({err})") from None
    header_len = struct.unpack("<Q", data[:8])[0]
    stored = json.loads(data[8 : 8 + header_len])["__metadata__"]
    del data
    if stored.get(_DIGEST_KEY) != _digest(stored[_META_KEY], tensors):
        raise ContextFileError(f"{p} is corrupted: its checksum does not match its contents")
    _check_model(p, meta, model)
    try:
        return _rebuild(model, meta, tensors)
    except KeyError as err:
        raise ContextFileError(f"{p} is incomplete: {err.args[0]!r} is missing") from None
    except ContextFileError as err:
        raise ContextFileError(f"{p}: {err}") from None


def _describe_saved(m: dict[str, Any]) -> str:
    name = m.get("name_or_path") or "?"
    return (f"{name!r} ({m.get('model_type')}, {m.get('num_layers')} layers, {m.get('num_kv_heads')} KV heads "
            f"x {m.get('head_dim')}, fingerprint {m.get('fingerprint')})")  # fmt: skip


def _check_model(path: Path, meta: dict[str, Any], model: torch.nn.Module) -> None:
    saved = meta.get("model") or {}
    here = _model_meta(model)
    if saved.get("fingerprint") != here["fingerprint"] or any(
        saved.get(k) != here[k] for k in ("model_type", "num_layers", "num_kv_heads", "head_dim")
    ):
        raise ContextFileError(
            f"{path} was saved for model {_describe_saved(saved)}; this is {_describe_saved(here)}"
        )
    if meta.get("kv_dtype") != here["dtype"]:
        raise ContextFileError(
            f"{path} holds {meta.get('kv_dtype')} keys and values but the model runs in {here['dtype']}: "
            f"load the model with dtype=torch.{meta.get('kv_dtype')}"
        )


def _rebuild(
    model: torch.nn.Module, meta: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> CompressedContext:
    m = meta["method"]
    try:
        method = _rebuild_method(m["spec"], m["budget"], m["ratio"], m["window"], m["name"])
    except ValueError as err:
        raise ContextFileError(f"its method {m.get('describe')!r} cannot be rebuilt: {err}") from None
    if method.describe() != m["describe"]:
        raise ContextFileError(
            f"its method rebuilds as {method.describe()!r}, not the saved {m['describe']!r}"
        )
    cache = KVCakeCache(model, method)
    info = cache.info
    devices = layer_devices(model, info.num_layers)
    batch = meta["context"]["batch"]
    layers_meta = meta["layers"]
    if len(layers_meta) != info.num_layers:
        raise ContextFileError(f"it has {len(layers_meta)} layers, the model {info.num_layers}")
    for lid, (layer, lm) in enumerate(zip(cache.layers, layers_meta, strict=True)):
        prefix, device = f"layers.{lid}.", devices[lid]
        keys, values = tensors[prefix + "keys"], tensors[prefix + "values"]
        positions, counts = tensors[prefix + "positions"], tensors[prefix + "counts"]
        if tuple(counts.shape) != (batch, info.num_kv_heads) or keys.shape != values.shape:
            raise ContextFileError(f"layer {lid} has inconsistent shapes")
        if lm["layout"] == "dense":
            n = keys.shape[2] if keys.dim() == 4 else -1
            if (
                tuple(keys.shape) != (batch, info.num_kv_heads, n, info.head_dim)
                or positions.shape != keys.shape[:3]
            ):
                raise ContextFileError(f"layer {lid}: dense keys {tuple(keys.shape)} do not fit the model")
            layer.meta = None
        elif lm["layout"] == "ragged":
            lengths = tensors[prefix + "lengths"]
            total = int(lengths.sum())
            if (tuple(keys.shape) != (total, info.head_dim) or tuple(positions.shape) != (total,)
                    or not torch.equal(lengths, counts.reshape(-1))):  # fmt: skip
                raise ContextFileError(f"layer {lid}: ragged keys {tuple(keys.shape)} do not fit its lengths")
            layer.meta = RaggedMeta.from_lengths(lengths.to(device), int(lm["max_len"]))
        else:
            raise ContextFileError(f"layer {lid} has an unknown layout {lm['layout']!r}")
        layer.keys, layer.values = keys.to(device), values.to(device)
        layer.positions = positions.to(device)
        layer.scores = tensors[prefix + "scores"].to(device) if lm["has_scores"] else None
        layer.norms = None
        layer.counts = counts.numpy().astype(np.int64)
        layer.layout, layer.plain, layer.length = lm["layout"], bool(lm["plain"]), int(lm["length"])
        layer.batch, layer.kv_heads = batch, info.num_kv_heads
        layer.dtype, layer.device = layer.keys.dtype, layer.keys.device
        layer.is_initialized = True
    c = meta["cache"]
    cache.budgets = tensors["cache.budgets"]
    cache.decode_budget = tensors["cache.decode_budget"].numpy().astype(np.int64)
    cache.stage_budgets = [tensors[f"cache.stage_budgets.{i}"] for i in range(c["num_stages"])]
    for name in ("entropy", "variance", "preferences"):
        key = f"cache.{name}"
        setattr(cache, name, list(tensors[key]) if key in tensors else [])  # host, as when compressed
    if "cache.seq.lengths" in tensors:
        cache.seq = SequenceBudgets(**{f.name: tensors[f"cache.seq.{f.name}"]
                                       for f in dataclasses.fields(SequenceBudgets)})  # fmt: skip
    cache._tau = tuple(c["tau"]) if c["tau"] is not None else None
    cache.peak_kv_bytes = int(c["peak_kv_bytes"])
    cache.prefill_peak_kv_bytes = int(c["prefill_peak_kv_bytes"])
    cache.prefilled = True
    if cache.kept_entries() != c["kept_entries"] or cache.kv_bytes() != c["kv_bytes"]:
        raise ContextFileError("the rebuilt cache does not hold what was saved")
    ctx = CompressedContext(
        model,
        cache,
        tensors["context.input_ids"].to(input_device(model)),
        tensors["context.attention_mask"].to(input_device(model)),
        tensors["context.logits"].to(output_device(model)),
    )
    if tuple(ctx.input_ids.shape) != (batch, meta["context"]["length"]):
        raise ContextFileError("its context ids do not match its description")
    return ctx
