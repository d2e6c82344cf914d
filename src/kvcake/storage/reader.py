"""Reading a compressed context back: header checks, digest, model match, the exact cache state."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from ..cache import KVCakeCache
from ..cascade import SequenceBudgets
from ..context import CompressedContext
from ..cross import CrossLayer, restore_cross
from ..devices import input_device, layer_devices, output_device
from ..fingerprints import runtime_only
from ..fp8 import RECENT_TENSORS, hold_recent
from ..hybrid_layer import HybridLayer
from ..method import _rebuild_method
from ..prompts import check_model
from ..ragged import RaggedMeta
from ..recurrent import EmptyLayer, RecurrentLayer, restore_recurrent, restore_states
from ..sliding import SlidingLayer, restore_sliding
from ..temperatures import Scenario
from .format import _DIGEST_KEY, _MAX_HEADER, _META_KEY, ContextFileError, _digest, _read_header
from .writer import TOKEN_INPUTS_PREFIX, _model_meta

logger = logging.getLogger("kvcake.storage")


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


def load_context(
    model: torch.nn.Module, path: str | os.PathLike[str], *, static: bool = True
) -> CompressedContext:
    """Rebuild the :class:`~kvcake.api.CompressedContext` saved at ``path`` for ``model``.

    The cache gets exactly the saved state (entries, positions, layouts, budgets, decoding
    budgets, scores), so next-token logits and generations equal those of the saved context.
    ``static`` as in :func:`kvcake.compress`: the context holds the saved entries, and (True,
    the default) its answers decode in static storage, or (False) in the dynamic layout.
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
    if not isinstance(model, torch.nn.Module) or isinstance(path, torch.nn.Module):
        raise TypeError(
            f"load_context(model, path) takes the model first, then the file, got ({type(model).__name__}, "
            f"{type(path).__name__}): kvcake.load_context(model, 'doc.kvc')"
        )
    check_model(model, "load_context")  # (a base model: its context could not answer)
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
        _check_tensors(tensors, meta)
        return _rebuild(model, meta, tensors, static)
    except KeyError as err:
        raise ContextFileError(f"{p} is incomplete: {err.args[0]!r} is missing") from None
    except ContextFileError as err:
        raise ContextFileError(f"{p}: {err}") from None
    except (IndexError, RuntimeError, TypeError, ValueError) as err:  # a tensor of another shape
        raise ContextFileError(f"{p} does not hold a context this model can rebuild: {err}") from None


#: The integer tensors of a file, by the last part of their names (the stages' budgets too).
_INTEGERS = {"budgets", "decode_budget", "lengths", "per_layer", "total", "window", "counts", "positions",
             "recent_positions", "input_ids", "attention_mask", "rope_deltas"}  # fmt: skip
_FLOATS = {"logits", "scores", "entropy", "variance", "preferences", "tau1", "tau2", "key_scale", "value_scale",
           "recent_keys", "recent_values"}  # fmt: skip


def _check_tensors(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """What the writer writes, where a file whose checksum holds was edited by hand: ids, counts and
    positions int64 (positions within the context, -1 a free slot), scores, logits and scales floating
    point (keys and values in the model's dtype, or float8 bits), the float8 scales positive."""
    length = int(meta["context"]["length"])
    ids, mask = tensors["context.input_ids"], tensors["context.attention_mask"]
    if ids.shape != mask.shape:
        raise ContextFileError(
            f"its attention mask {tuple(mask.shape)} does not fit its ids {tuple(ids.shape)}"
        )
    for name, t in tensors.items():
        last = name.rsplit(".", 1)[-1]
        if last in _INTEGERS or name.startswith("cache.stage_budgets."):
            if t.dtype != torch.int64:
                raise ContextFileError(f"{name} holds {t.dtype}, not torch.int64")
            if (
                last in ("positions", "recent_positions")
                and t.numel()
                and not -1 <= int(t.min()) <= int(t.max()) < length
            ):
                raise ContextFileError(f"{name} holds positions outside the {length}-token context")
        elif last in ("keys", "values") and t.dtype not in (getattr(torch, meta["kv_dtype"]), torch.uint8):
            raise ContextFileError(f"{name} holds {t.dtype}, not the model's {meta['kv_dtype']}")
        elif last in _FLOATS and not t.dtype.is_floating_point:
            raise ContextFileError(f"{name} holds {t.dtype}, not floating point numbers")
        elif last in ("key_scale", "value_scale") and (
            t.dim() != 0 or not bool(t > 0) or not bool(t.isfinite())
        ):
            raise ContextFileError(f"{name} must be one positive scale, got {t.tolist()}")


def _describe_saved(m: dict[str, Any]) -> str:
    name = m.get("name_or_path") or "?"
    return (f"{name!r} ({m.get('model_type')}, {m.get('num_layers')} layers, {m.get('num_kv_heads')} KV heads "
            f"x {m.get('head_dim')}, fingerprint {m.get('fingerprint')})")  # fmt: skip


def _check_model(path: Path, meta: dict[str, Any], model: torch.nn.Module) -> None:
    """The model the file was saved for: its fingerprint, or (files that keep the config's digests)
    a config that differs from it only in fields that change no key or value (``RUNTIME_KEYS``:
    a ``pad_token_id`` set before generating), named in the refusal otherwise."""
    saved = meta.get("model") or {}
    here = _model_meta(model)
    shape = ("model_type", "num_layers", "num_kv_heads", "head_dim")
    differ = _differing_fields(saved.get("config_digests"), here["config_digests"])
    if any(saved.get(k) != here[k] for k in shape) or (
        saved.get("fingerprint") != here["fingerprint"] and (differ is None or not runtime_only(differ))
    ):
        fields = (
            f" (its config differs in {', '.join(differ[:6])}{', ...' if len(differ) > 6 else ''})"
            if differ
            else ""
        )
        raise ContextFileError(
            f"{path} was saved for model {_describe_saved(saved)}; this is {_describe_saved(here)}{fields}: "
            "load it with the model it was saved for, or compress the document again with this one"
        )
    if differ:
        logger.info("%s was saved with other %s: fields that change no key or value", path, ", ".join(differ))
    if meta.get("kv_dtype") != here["dtype"]:
        raise ContextFileError(
            f"{path} holds {meta.get('kv_dtype')} keys and values"
            f"{' (in float8, scaled in it)' if meta.get('cache', {}).get('kv_storage') == 'fp8' else ''} "
            f"but the model runs in {here['dtype']}: "
            f"load the model with dtype=torch.{meta.get('kv_dtype')} (the command line: --dtype {meta.get('kv_dtype')})"
        )


def _differing_fields(saved: dict | None, here: dict[str, str]) -> list[str] | None:
    """The config fields whose digests differ (either side's own included), or None where the file
    keeps no digests (saved before they were kept)."""
    if not isinstance(saved, dict):
        return None
    return sorted(k for k in saved.keys() | here.keys() if saved.get(k) != here.get(k))


def _rebuild(
    model: torch.nn.Module, meta: dict[str, Any], tensors: dict[str, torch.Tensor], static: bool
) -> CompressedContext:
    m = meta["method"]
    try:
        method = _rebuild_method(
            m["spec"], m["budget"], m["ratio"], m["window"], m["name"], m.get("keep_short", False)
        )
    except (ValueError, TypeError) as err:  # a field of the wrong type too
        raise ContextFileError(f"its method {m.get('describe')!r} cannot be rebuilt: {err}") from None
    if method.describe() != m["describe"]:
        raise ContextFileError(
            f"its method rebuilds as {method.describe()!r}, not the saved {m['describe']!r}"
        )
    try:
        saved = meta["cache"].get("scenario")  # (older files: the cache's default, question-aware)
        scenario = Scenario(saved["name"], saved["why"]) if saved else None
        cache = KVCakeCache(
            model, method, static=False, kv_dtype=meta["cache"].get("kv_storage"), scenario=scenario
        )
    except ValueError as err:
        raise ContextFileError(f"its storage cannot be rebuilt: {err}") from None
    if cache.split is not None:
        raise ValueError(
            "a .kvc file holds every KV head; this model is split over tensor-parallel ranks: load the "
            "context with the model loaded whole (without tp_plan)"
        )
    info = cache.info
    batch, seen = meta["context"]["batch"], meta["context"]["length"]
    devices = layer_devices(model, info.num_layers)
    layers_meta = meta["layers"]
    if len(layers_meta) != info.num_layers:
        raise ContextFileError(f"it has {len(layers_meta)} layers, the model {info.num_layers}")
    for lid, (layer, lm) in enumerate(zip(cache.layers, layers_meta, strict=True)):
        prefix, device = f"layers.{lid}.", devices[lid]
        if lm["layout"] == "cross" or isinstance(layer, CrossLayer):  # Mllama: the image's states, whole
            keys, values = tensors.get(prefix + "keys"), tensors.get(prefix + "values")
            if lm["layout"] != "cross":
                err = "not cross-attention"
            elif not lm.get("empty") and (keys is None or values is None):
                err = "its keys are missing"
            else:
                err = restore_cross(layer, keys, values, lm, device)
            if err:
                raise ContextFileError(f"layer {lid}: {err} (saved with another model?)")
            continue
        if lm["layout"] in ("recurrent", "empty") or isinstance(layer, (RecurrentLayer, EmptyLayer)):
            err = restore_recurrent(layer, tensors, prefix, lm, device, seen)
            if err:
                raise ContextFileError(f"layer {lid}: {err} (saved with another model?)")
            continue
        keys, values = tensors[prefix + "keys"], tensors[prefix + "values"]
        if lm["layout"] == "sliding" or isinstance(layer, SlidingLayer):
            err = (
                restore_sliding(layer, keys, values, lm, device)
                if lm["layout"] == "sliding"
                else "not sliding"
            )
            if err:
                raise ContextFileError(f"layer {lid}: {err} (saved with another model?)")
            continue
        positions, counts = tensors[prefix + "positions"], tensors[prefix + "counts"]
        # the values' width (a latent attention layer holds none: kvcake.latent)
        width = 0 if info.latent else info.head_dim
        if tuple(counts.shape) != (batch, info.num_kv_heads) or values.shape != (*keys.shape[:-1], width):
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
                    or not torch.equal(lengths, counts.reshape(-1))
                    or int(lm["max_len"]) < (int(lengths.max()) if lengths.numel() else 0)):  # fmt: skip
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
        layer.dtype, layer.device = model.dtype, layer.keys.device
        fp8 = bool(lm.get("fp8"))
        if fp8 != (cache.kv_dtype == "fp8") or fp8 != (keys.dtype == torch.uint8):
            raise ContextFileError(
                f"layer {lid}: its float8 storage does not match the cache's ({cache.kv_dtype})"
            )
        layer.kv_scales = None
        if fp8:
            layer.kv_scales = tuple(
                tensors[prefix + n].to(device, layer.dtype) for n in ("key_scale", "value_scale")
            )
            recent = [tensors.get(prefix + n) for n in RECENT_TENSORS]
            if recent[0] is not None:  # (older files hold none: every entry is read in float8)
                ring = recent[2].shape[-1]
                if any(tuple(t.shape[:3]) != (batch, info.num_kv_heads, ring) for t in recent):
                    raise ContextFileError(f"layer {lid}: its recent entries do not fit the model")
                hold_recent(layer, *(t.to(device) for t in recent))
        if ("states" in lm) != isinstance(layer, HybridLayer):  # a recurrent block's states beside
            raise ContextFileError(
                f"layer {lid}: its recurrent states {'do not fit' if 'states' in lm else 'are missing'}"
            )
        err = restore_states(layer, tensors, prefix, lm["states"], device, seen) if "states" in lm else None
        if err:
            raise ContextFileError(f"layer {lid}: {err} (saved with another model?)")
        layer.is_initialized = True
    c = meta["cache"]
    cache.budgets = tensors["cache.budgets"]
    cache.decode_budget = tensors["cache.decode_budget"].numpy().astype(np.int64)
    cache.stage_budgets = [tensors[f"cache.stage_budgets.{i}"] for i in range(c["num_stages"])]
    for name in ("entropy", "variance", "preferences"):
        key = f"cache.{name}"
        setattr(cache, name, list(tensors[key]) if key in tensors else [])  # host, as when compressed
    if "cache.seq.lengths" in tensors:
        cache.seq = SequenceBudgets(**{f.name: tensors.get(f"cache.seq.{f.name}")
                                       for f in dataclasses.fields(SequenceBudgets)})  # fmt: skip
    cache._tau = tuple(c["tau"]) if c["tau"] is not None else None  # (source "saved": older files)
    if cache.tau is not None and c.get("tau_choice"):
        how = c["tau_choice"]
        rows = tuple(tuple(r) for r in how["rows"])
        cache.tau = dataclasses.replace(cache.tau, source=how["source"], scenario=cache.scenario,
                                        set_used=how["set_used"], indicator=how["indicator"], rows=rows)  # fmt: skip
    cache.peak_kv_bytes = int(c["peak_kv_bytes"])
    cache.prefill_peak_kv_bytes = int(c["prefill_peak_kv_bytes"])
    cache.prefilled = True
    if cache.kept_entries() != c["kept_entries"] or cache.kv_bytes() != c["kv_bytes"]:
        raise ContextFileError("the rebuilt cache does not hold what was saved")
    cache.serve(static)  # as kvcake.compress leaves it: the forks move into static storage
    ctx = CompressedContext(
        model,
        cache,
        tensors["context.input_ids"].to(input_device(model)),
        tensors["context.attention_mask"].to(input_device(model)),
        tensors["context.logits"].to(output_device(model)),
        tensors["context.rope_deltas"].to(input_device(model)) if "context.rope_deltas" in tensors else None,
        {name.removeprefix(TOKEN_INPUTS_PREFIX): t.to(input_device(model))
         for name, t in tensors.items() if name.startswith(TOKEN_INPUTS_PREFIX)},
    )  # fmt: skip
    if tuple(ctx.input_ids.shape) != (batch, meta["context"]["length"]):
        raise ContextFileError("its context ids do not match its description")
    return ctx
