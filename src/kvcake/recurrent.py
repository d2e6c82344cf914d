"""Linear-attention and recurrent layers of a hybrid model (Qwen3.5, Qwen3-Next, LFM2, Nemotron-H,
OLMo hybrid, Jamba, Bamba, Granite 4, ...): their state, never compressed.

These models interleave full-attention layers with layers that hold no per-token keys: a gated
DeltaNet, a Mamba block or a short convolution keeps a fixed-size state per sequence (a causal
convolution's last ``kernel`` inputs, ``(B, channels, kernel)``, and a recurrent state, e.g.
``(B, heads, d_k, d_v)``), updated by every token and the same size whatever the context. Only the
full-attention layers grow with the context, so they are all kvcake compresses (``info.recurrent``
lies outside ``info.compressed_layers``); budgets, allocation and the cascade count them alone.

A :class:`~kvcake.cache.KVCakeCache` holds a :class:`RecurrentLayer` at each such layer:
transformers' own ``LinearAttentionLayer`` (the model reads and writes it through the cache's
``get_conv_state``, ``update_conv_state``, ``update_recurrent_state``, as it would a
``DynamicCache``'s), plus kvcake's bookkeeping: the bytes it holds (counted in the cache's, as a
full cache holds the same), the batch operations of beam search, and a saved context's tensors.
It has no ``keys``: the loops over the key/value layers pass it by.

transformers builds these layers per state index (``state_idx``: Jamba-like blocks may hold
several); kvcake needs that form, which transformers 5.12 lacks (:func:`check_supported`).
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
import transformers

try:
    from transformers.cache_utils import DummyLayer, LinearAttentionLayer
except ImportError:  # transformers 5.0: each hybrid family brought its own cache class
    DummyLayer = LinearAttentionLayer = None

# transformers' layer types whose layers hold a fixed-size state instead of keys
RECURRENT_TYPES = ("linear_attention", "conv", "mamba")


def check_supported(mtype: str) -> None:
    """Raise ``ValueError`` where this transformers lacks the per-state ``LinearAttentionLayer``."""
    if (
        LinearAttentionLayer is None
        or "state_idx" not in inspect.signature(LinearAttentionLayer.update_conv_state).parameters
    ):
        raise ValueError(
            f"{mtype}: its linear-attention (recurrent) layers need transformers' per-state "
            f"LinearAttentionLayer, which transformers {transformers.__version__} lacks: upgrade "
            "transformers (5.24 is tested) to compress this model's full-attention layers with kvcake"
        )


class RecurrentStates:
    """The ``Cache`` methods a hybrid's recurrent layers write through, on a cache that counts its bytes
    (``KVCakeCache``): a state's first write adds its bytes to the running total and peak, and a
    prefill stage left for the next layer runs there, as at any layer's update (``cascade.py``)."""

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, *args, **kwargs) -> torch.Tensor:
        return self._track_state(
            layer_idx, super().update_conv_state(conv_states, layer_idx, *args, **kwargs)
        )

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> torch.Tensor:
        out = super().update_recurrent_state(recurrent_states, layer_idx, *args, **kwargs)
        return self._track_state(layer_idx, out)

    def _track_state(self, layer_idx: int, out: torch.Tensor) -> torch.Tensor:
        if self._waiting:
            self._run_stage()
        if not torch.compiler.is_compiling():  # a compiled step writes in place: the same bytes
            self._track_bytes(layer_idx)
        return out


def keyless_layer(number_of_states: int):
    """The cache layer of a layer holding no keys: its states' (``number_of_states``), or none at all."""
    return RecurrentLayer(number_of_states=number_of_states) if number_of_states else EmptyLayer()


def held_states(layer) -> list[torch.Tensor]:
    """Every state a linear-attention layer (``RecurrentLayer``, ``HybridLayer``) holds now: the
    initialised conv and recurrent states, in state order."""
    held = []
    for i in range(layer.number_of_states):
        if layer.is_conv_states_initialized[i]:
            held.append(layer.conv_states[i])
        if layer.is_recurrent_states_initialized[i]:
            held.append(layer.recurrent_states[i])
    return held


def state_bytes(layer) -> int:
    """Bytes of the states ``layer`` holds (a full cache holds the same: they are never compressed)."""
    return sum(t.numel() * t.element_size() for t in held_states(layer))


def select_state_rows(layer, rows: torch.Tensor) -> None:
    """Keep the sequences ``rows`` (B',) in that order, in every state of ``layer`` (dim 0: the batch).
    Copied into a state of the same shape in place, where the batch keeps its size (its address is
    what a CUDA graph holds, as transformers' layer keeps it)."""
    for i in range(layer.number_of_states):
        for name, ready in (("conv_states", layer.is_conv_states_initialized),
                            ("recurrent_states", layer.is_recurrent_states_initialized)):  # fmt: skip
            if not ready[i]:
                continue
            state = getattr(layer, name)[i]
            picked = state.index_select(0, rows.to(state.device))
            if picked.shape == state.shape:
                state.copy_(picked)
            else:
                getattr(layer, name)[i] = picked


_Base = LinearAttentionLayer if LinearAttentionLayer is not None else object


class RecurrentLayer(_Base):
    """transformers' ``LinearAttentionLayer`` plus kvcake's bookkeeping (module docstring)."""

    keys = values = None  # no per-token keys: the key/value loops pass this layer by
    is_croppable = False  # the cache as a whole cannot be cropped (its attention layers evicted)
    static = None  # its states are fixed-size already: nothing to lay out
    plan = False  # the kvcake attention never runs here

    def states(self) -> list[torch.Tensor]:
        return held_states(self)

    @property
    def held(self) -> bool:
        return bool(self.states())

    @property
    def batch(self) -> int:
        held = self.states()
        return held[0].shape[0] if held else 0

    counts = None  # no entries per KV head

    def kv_bytes(self) -> int:
        """Bytes of its states (the same in a full cache: nothing here is compressed)."""
        return state_bytes(self)

    def entries(self) -> int:
        return 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(torch.as_tensor(beam_idx).long(), None)  # host or device: moved where used

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select_rows(torch.arange(self.batch).repeat_interleave(repeats), None)  # host: moved below

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(torch.as_tensor(indices).long(), None)  # host or device: moved where used

    def select_rows(self, rows: torch.Tensor, host: np.ndarray | None) -> None:
        select_state_rows(self, rows)


class EmptyLayer(DummyLayer if DummyLayer is not None else object):
    """transformers' ``DummyLayer`` (a block without attention: Nemotron-H's MLP and MoE blocks, which
    hold nothing) with kvcake's bookkeeping."""

    static = None
    plan = False
    held = False
    batch = 0
    counts = None

    def kv_bytes(self) -> int:
        return 0

    def entries(self) -> int:
        return 0

    def select_rows(self, rows: torch.Tensor, host: np.ndarray | None) -> None:
        pass


def copy_states(source, target: RecurrentLayer | EmptyLayer) -> None:
    """Give ``target`` copies of the states the linear-attention layer ``source`` of a full
    ``DynamicCache`` holds (e.g. to replay a recorded full-cache forward into a KVCakeCache), and
    its count of tokens seen."""
    if isinstance(target, EmptyLayer):
        return
    for i in range(target.number_of_states):
        err = _put_state(target, i, source.conv_states[i], source.recurrent_states[i],
                         source.conv_kernel_size[i], source.has_previous_state[i])  # fmt: skip
        if err:
            raise ValueError(f"the full cache's layer does not fit: {err}")
    if hasattr(source, "cumulative_length_linear"):
        set_seen(target, int(source.cumulative_length_linear))


def set_seen(layer, length: int) -> None:
    """Set the tokens a linear-attention layer has seen, where it counts them itself: transformers
    5.25's ``cumulative_length_linear``, which its ``get_seq_length`` reads (``generate`` asks layer 0,
    a recurrent layer in Qwen3.5); earlier releases count at the attention layers alone. The states
    written by hand (a saved context read back, a replay) did not pass the model's updates that count."""
    counter = getattr(layer, "cumulative_length_linear", None)
    if counter is not None:
        counter.fill_(length)


def _put_state(layer: RecurrentLayer, i: int, conv, rec, kernel: int | None, seen: bool) -> str | None:
    """Give state ``i`` of ``layer`` copies of ``conv`` and ``rec`` (either may be None, as in a layer
    that never wrote it) and its seen flag; returns what does not fit, or None."""
    if conv is not None:
        layer.lazy_initialization(conv_states=conv, state_idx=i, conv_kernel_size=kernel)
        if layer.conv_states[i].shape != conv.shape:
            return f"conv state {i} {tuple(conv.shape)} does not fit {tuple(layer.conv_states[i].shape)}"
        layer.conv_states[i].copy_(conv)
    if rec is not None:
        layer.lazy_initialization(recurrent_states=rec, state_idx=i)
        layer.recurrent_states[i].copy_(rec)
    layer.has_previous_state[i] = bool(seen)
    return None


def recurrent_entry(layer: RecurrentLayer | EmptyLayer) -> dict:
    """The JSON facts a saved context keeps for a recurrent layer (its states go alongside)."""
    if isinstance(layer, EmptyLayer):
        return {"layout": "empty"}
    return {"layout": "recurrent", "states": state_entries(layer)}


def state_entries(layer) -> list[dict]:
    """The JSON facts of each state a linear-attention layer holds (its tensors: :func:`recurrent_tensors`)."""
    return [
        {
            "conv": bool(layer.is_conv_states_initialized[i]),
            "recurrent": bool(layer.is_recurrent_states_initialized[i]),
            "kernel": layer.conv_kernel_size[i],
            "seen": bool(layer.has_previous_state[i]),
        }  # fmt: skip
        for i in range(layer.number_of_states)
    ]


def recurrent_tensors(layer: RecurrentLayer | EmptyLayer, prefix: str) -> dict[str, torch.Tensor]:
    """A recurrent layer's states under their names in a saved context."""
    out = {}
    for i in range(getattr(layer, "number_of_states", 0)):
        if layer.is_conv_states_initialized[i]:
            out[f"{prefix}conv.{i}"] = layer.conv_states[i]
        if layer.is_recurrent_states_initialized[i]:
            out[f"{prefix}recurrent.{i}"] = layer.recurrent_states[i]
    return out


def restore_recurrent(layer, tensors: dict, prefix: str, entry: dict, device, seen: int) -> str | None:
    """Load a saved recurrent layer into ``layer``, which has seen the ``seen`` tokens of the context;
    returns what does not fit, or None."""
    saved_empty = entry.get("layout") == "empty"
    if saved_empty or isinstance(layer, EmptyLayer):
        return None if saved_empty and isinstance(layer, EmptyLayer) else "not a block without attention"
    if not isinstance(layer, RecurrentLayer):
        return f"a recurrent layer where the model has {type(layer).__name__}"
    return restore_states(layer, tensors, prefix, entry.get("states") or [], device, seen)


def restore_states(layer, tensors: dict, prefix: str, states: list, device, seen: int) -> str | None:
    """Load the saved states ``states`` (:func:`state_entries`) into a linear-attention layer (a
    ``RecurrentLayer`` or ``HybridLayer``) that has seen ``seen`` tokens; returns what does not fit,
    or None."""
    if len(states) != layer.number_of_states:
        return f"{len(states)} states where the model's layer holds {layer.number_of_states}"
    for i, saved in enumerate(states):
        conv, rec = tensors.get(f"{prefix}conv.{i}"), tensors.get(f"{prefix}recurrent.{i}")
        if saved["conv"] != (conv is not None) or saved["recurrent"] != (rec is not None):
            return f"state {i}'s tensors are missing"
        conv, rec = (None if t is None else t.to(device) for t in (conv, rec))
        err = _put_state(layer, i, conv, rec, saved["kernel"], saved["seen"])
        if err:
            return err
    set_seen(layer, seen)
    return None
