"""Writing a compressed context: its tensors and JSON into one safetensors file, atomically."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from ..adapters import describe_model
from ..cache import KVCakeCache
from ..cascade import SequenceBudgets
from ..conversion import process_umask
from ..cross import CrossLayer, cross_entry
from ..fp8 import RECENT_TENSORS
from ..hybrid_layer import HybridLayer
from ..method import method_spec
from ..recurrent import EmptyLayer, RecurrentLayer, recurrent_entry, recurrent_tensors, state_entries
from ..sliding import SlidingLayer, sliding_entry
from ..version import __version__
from .format import _CHUNK, _DIGEST_KEY, _META_KEY, FORMAT_NAME, FORMAT_VERSION, _digest

TOKEN_INPUTS_PREFIX = "context.token_inputs."  # + the input's name (CompressedContext.token_inputs)

logger = logging.getLogger("kvcake.storage")


def _host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor owning its storage (safetensors refuses shared storage)."""
    return t.detach().to("cpu").contiguous().clone()


def _model_meta(model: torch.nn.Module) -> dict[str, Any]:
    from ..fingerprints import config_digests, model_fingerprint

    info = describe_model(model)
    return {
        "fingerprint": model_fingerprint(model),
        # which fields differ, where another model's fingerprint does (storage.reader._check_model)
        "config_digests": config_digests(model),
        "name_or_path": str(getattr(model.config, "_name_or_path", "") or ""),
        "model_type": info.model_type,
        "num_layers": info.num_layers,
        "num_heads": info.num_heads,
        "num_kv_heads": info.num_kv_heads,
        "head_dim": info.head_dim,
        "dtype": str(model.dtype).removeprefix("torch."),
    }


def _tau_choice(tau) -> dict | None:
    """CAKE's temperatures' provenance (``temperatures.TauChoice`` but the two values), or None."""
    if tau is None:
        return None
    return {"source": tau.source, "set_used": tau.set_used, "indicator": tau.indicator,
            "rows": [list(row) for row in tau.rows]}  # fmt: skip


def _check_extra(extra) -> None:
    """``extra=`` as JSON keeps it: an object (str keys) of JSON values, or None."""
    if extra is None:
        return
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
        raise TypeError(
            f"extra= must be a dict with str keys, got {extra!r}: e.g. extra={{'source': 'doc.txt'}}"
        )
    try:
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise TypeError(f"extra= must hold JSON values (str, numbers, lists, dicts): {err}") from None


def save_context(ctx: Any, path: str | os.PathLike[str], *, extra: dict | None = None) -> Path:
    """Write ``ctx`` to ``path`` atomically (see the module docstring for the format).

    Parameters
    ----------
    ctx:
        A prefilled :class:`~kvcake.context.CompressedContext` (from :func:`kvcake.compress`); its type
        is not imported here, because ``CompressedContext.save`` calls this function.
    path:
        Target file; its folder is created if needed, an existing file is replaced.
    extra:
        JSON-serialisable facts to keep with the context (returned by ``read_context_info``).

    Returns the path written.
    """
    if isinstance(ctx, KVCakeCache):
        raise TypeError(
            "save_context takes a compressed context (kvcake.compress(model, ids, ...)), got a KVCakeCache: "
            "a file keeps the ids and the last logits beside the cache, so that questions can follow it"
        )
    _check_extra(extra)
    ctx.check_placement()  # the model's dtype and device, which the file records, are the cache's
    cache = ctx.cache
    if not isinstance(cache, KVCakeCache) or not cache.prefilled:
        raise ValueError("only a prefilled KVCakeCache can be saved (make it with kvcake.compress)")
    if any(getattr(layer, "static", None) is not None for layer in cache.layers):
        cache = copy.deepcopy(cache)  # a file keeps the kept entries, not the reserved capacity
        cache.compact()
    if cache.split is not None:
        raise ValueError(
            "a context compressed on a tensor-parallel model holds only this rank's KV heads and cannot be "
            "saved as a .kvc file: compress and save it with the model loaded whole (without tp_plan)"
        )
    method = cache.method
    tensors: dict[str, torch.Tensor] = {
        "context.input_ids": _host(ctx.input_ids),
        "context.attention_mask": _host(ctx.attention_mask),
        "context.logits": _host(ctx.logits),
        "cache.budgets": _host(cache.budgets),
        # host: saved from numpy
        "cache.decode_budget": torch.from_numpy(np.ascontiguousarray(cache.decode_budget, dtype=np.int64)),
    }
    if ctx.rope_deltas is not None:  # multimodal RoPE's offset after the context
        tensors["context.rope_deltas"] = _host(ctx.rope_deltas)
    for name, t in ctx.token_inputs.items():  # a row per token, which follow-ups extend (Mllama)
        tensors[TOKEN_INPUTS_PREFIX + name] = _host(t)
    for i, stage in enumerate(cache.stage_budgets):
        tensors[f"cache.stage_budgets.{i}"] = _host(stage)
    for name in ("entropy", "variance", "preferences"):
        values = getattr(cache, name)
        if values:
            tensors[f"cache.{name}"] = _host(torch.stack([v.to("cpu") for v in values]))  # (L, B)
    if cache.seq is not None:
        for f in dataclasses.fields(SequenceBudgets):
            if (value := getattr(cache.seq, f.name)) is not None:  # CAKE's temperatures: CAKE's caches only
                tensors[f"cache.seq.{f.name}"] = _host(value)
    layers_meta = []
    kv_dtype = None
    for lid, layer in enumerate(cache.layers):
        prefix = f"layers.{lid}."
        if isinstance(layer, CrossLayer):  # Mllama: the image's states, or nothing (a text-only prompt)
            layers_meta.append(cross_entry(layer))
            if layer.held:
                tensors[prefix + "keys"], tensors[prefix + "values"] = _host(layer.keys), _host(layer.values)
            continue
        if isinstance(layer, (RecurrentLayer, EmptyLayer)):  # a hybrid's linear-attention states, whole
            layers_meta.append(recurrent_entry(layer))
            tensors.update({name: _host(t) for name, t in recurrent_tensors(layer, prefix).items()})
            continue
        if layer.keys is None:
            raise ValueError(f"layer {lid} of the cache is empty: nothing to save")
        # the model's dtype (a compressed layer may store float8 bits: fp8.py)
        kv_dtype = layer.keys.dtype if isinstance(layer, SlidingLayer) else layer.dtype
        tensors[prefix + "keys"] = _host(layer.keys)
        tensors[prefix + "values"] = _host(layer.values)
        if isinstance(layer, SlidingLayer):  # hybrid models: kept as transformers holds it
            layers_meta.append(sliding_entry(layer))
            continue
        tensors[prefix + "positions"] = _host(layer.positions)
        # host: saved from numpy
        tensors[prefix + "counts"] = torch.from_numpy(np.ascontiguousarray(layer.counts, dtype=np.int64))
        if layer.scores is not None:
            tensors[prefix + "scores"] = _host(layer.scores)
        entry = {"layout": layer.layout, "plain": bool(layer.plain), "length": int(layer.length),
                 "has_scores": layer.scores is not None, "fp8": layer.kv_scales is not None}  # fmt: skip
        if layer.kv_scales is not None:
            tensors[prefix + "key_scale"], tensors[prefix + "value_scale"] = map(_host, layer.kv_scales)
            for name in RECENT_TENSORS if layer.recent_keys is not None else ():  # (fp8.remember)
                tensors[prefix + name] = _host(getattr(layer, name))
        if layer.layout == "ragged":
            tensors[prefix + "lengths"] = _host(layer.meta.lengths)
            entry["max_len"] = int(layer.meta.max_len)
        if isinstance(layer, HybridLayer):  # a recurrent block's states beside the entries, whole
            entry["states"] = state_entries(layer)
            tensors.update({name: _host(t) for name, t in recurrent_tensors(layer, prefix).items()})
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
            "keep_short": method.budget.keep_short,
        },
        "context": {"batch": int(ctx.input_ids.shape[0]), "length": int(ctx.input_ids.shape[1])},
        "cache": {
            "prefilled": True,
            "peak_kv_bytes": int(cache.peak_kv_bytes),
            "prefill_peak_kv_bytes": int(cache.prefill_peak_kv_bytes),
            "tau": list(cache._tau) if cache._tau is not None else None,
            "tau_choice": _tau_choice(cache.tau),  # where they came from, as `inspect` and the CLI say
            "scenario": {"name": cache.scenario.name, "why": cache.scenario.why},
            "num_stages": len(cache.stage_budgets),
            "kv_bytes": int(cache.kv_bytes()),
            "kept_entries": int(cache.kept_entries()),
            "kv_storage": cache.kv_dtype,  # None: the model's dtype; "fp8" (fp8.py)
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
    try:  # the permissions open(target, "wb") gives: the file's own, else 0o666 less the umask (mkstemp's are 0o600)
        os.chmod(tmp, stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o666 & ~process_umask())
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
