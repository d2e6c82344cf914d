"""Record what the attention function receives during a full-cache forward.

:func:`capture_queries` runs the model with its own attention kernel (registered under a
``kvcake_eval_capture_*`` name through ``AttentionInterface.register``), storing each layer's
post-RoPE queries (B, H, q, d) in a :class:`Captured`; the keys and values stay in the
``DynamicCache`` the forward fills. :func:`attention_outputs` hooks each layer's attention output
(after the output projection). Both undo themselves on exit.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvcake.adapters import describe_model, projection_module
from kvcake.logit_terms import PLAIN, LogitTerms

__all__ = ["Captured", "attention_modules", "attention_outputs", "capture_queries"]


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules, in layer order: modules with a ``layer_idx`` and an output
    projection (``o_proj`` and the other usual names). Found generically, no per-model code."""
    found = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and projection_module(module) is not None:
            _check_layer_idx(module, idx)
            found.setdefault(idx, module)
    if not found:
        raise ValueError(f"{type(model).__name__}: found no attention modules (layer_idx + o_proj)")
    return [found[i] for i in sorted(found)]


def _check_layer_idx(module: torch.nn.Module, idx) -> None:
    """Refuse an attention module without a layer of its own: Zamba2's one module serves several layers
    (layer_idx -1), Zamba's tied copies have none, and the eval's replay records queries and outputs
    per module's layer."""
    if not isinstance(idx, int) or idx < 0:
        raise ValueError(
            f"{type(module).__name__} (layer_idx {idx}) is not one decoder layer's attention (Zamba's shared "
            "block runs for several layers), and the eval's replay records queries and outputs by the module's "
            "layer: evaluate this model with kvcake.generate / kvcake.compress, which compress it"
        )


@contextlib.contextmanager
def attention_outputs(model: torch.nn.Module, join: bool = False) -> Iterator[dict[int, torch.Tensor]]:
    """Inside the block, each forward stores every layer's attention output (B, q, hidden), after
    the output projection, in the yielded dict (layer -> tensor); ``join=True`` appends a later
    forward's to the earlier ones' (dim 1: the tokens of several forwards in order). Hooks are
    removed on exit."""
    store: dict[int, torch.Tensor] = {}
    handles = []

    def hook(idx: int):
        def fn(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            out = out.detach()
            store[idx] = torch.cat([store[idx], out], dim=1) if join and idx in store else out

        return fn

    try:
        for i, module in enumerate(attention_modules(model)):
            handles.append(module.register_forward_hook(hook(i)))
        yield store
    finally:
        for h in handles:
            h.remove()


_RECORDER: contextvars.ContextVar[Captured | None] = contextvars.ContextVar(
    "kvcake_eval_capture", default=None
)
_CAPTURE_PREFIX = "kvcake_eval_capture_"


@dataclass
class Captured:
    """Per layer, what the attention function received during full-cache forwards.

    ``queries[l]``: list of (B, H, q, d) post-RoPE query chunks, one per forward, in order;
    ``modules[l]`` the attention module; ``scaling[l]`` its softmax scale; ``terms[l]`` its soft
    cap and sinks (``kvcake.logit_terms``). ``layers``: the layers recorded (``None``: every
    layer); :func:`capture_queries` sets it to the layers kvcake compresses, the only ones a
    replay reads (a sliding or recurrent layer is copied from the full cache), so a hybrid
    model's recording does not hold queries nothing scores (Gemma-3-270M: 15 of its 18 layers,
    about 120 MB per 2,048-token sample in float32)."""

    queries: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    modules: dict[int, torch.nn.Module] = field(default_factory=dict)
    scaling: dict[int, float] = field(default_factory=dict)
    terms: dict[int, LogitTerms] = field(default_factory=dict)
    layers: frozenset[int] | None = None
    _joined: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict, repr=False)

    def add(self, module: torch.nn.Module, query: torch.Tensor, scaling: float | None, terms=PLAIN) -> None:
        idx = getattr(module, "layer_idx", None)
        _check_layer_idx(module, idx)
        if self.layers is not None and idx not in self.layers:
            return
        self.queries.setdefault(idx, []).append(query.detach())
        self.modules[idx] = module
        self.scaling[idx] = scaling if scaling is not None else query.shape[-1] ** -0.5
        self.terms[idx] = terms

    def query(self, layer: int, chunks: int | None = None) -> torch.Tensor:
        """(B, H, S, d): the first ``chunks`` recorded chunks of ``layer`` (all by default), joined."""
        parts = self.queries[layer][:chunks] if chunks is not None else self.queries[layer]
        if len(parts) == 1:
            return parts[0]
        key = (layer, len(parts))
        if key not in self._joined:  # one tensor per (layer, chunks): ScoreMemo keys on it
            self._joined[key] = torch.cat(parts, dim=2)
        return self._joined[key]

    def snapshot(self) -> Captured:
        """A shallow copy whose chunk lists later forwards do not extend."""
        queries = {k: list(v) for k, v in self.queries.items()}
        return Captured(queries, dict(self.modules), dict(self.scaling), dict(self.terms), self.layers)


@functools.cache
def _register_capture(inner: str) -> str:
    name = _CAPTURE_PREFIX + inner
    if inner == "eager":
        from kvcake.attention import _eager as kernel  # the same math as the model's eager attention
    else:
        kernel = ALL_ATTENTION_FUNCTIONS[inner]

    def capture_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        recorder = _RECORDER.get()
        if recorder is not None:
            recorder.add(module, query, scaling, LogitTerms.of(kwargs))
        return kernel(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register(name, capture_attention)
    mask_fn = ALL_MASK_ATTENTION_FUNCTIONS.get(inner) or ALL_MASK_ATTENTION_FUNCTIONS["eager"]
    AttentionMaskInterface.register(name, mask_fn)
    return name


@contextlib.contextmanager
def capture_queries(model: torch.nn.Module, into: Captured) -> Iterator[Captured]:
    """Run ``model`` with its own attention kernel, recording each compressed layer's queries into
    ``into`` (``into.layers``, set here when ``None``: the layers ``describe_model`` says kvcake
    compresses).

    The model's attention implementation is switched for the block and restored in ``finally``."""
    if into.layers is None:
        into.layers = frozenset(describe_model(model).compressed_layers)
    configs = [
        (sub.config, sub.config._attn_implementation)
        for sub in model.modules()
        if getattr(sub, "config", None) is not None and hasattr(sub.config, "_attn_implementation")
    ]
    original = model.config._attn_implementation or "eager"
    if original.startswith(_CAPTURE_PREFIX) or original.startswith("kvcake_"):
        raise RuntimeError(f"cannot capture queries under attention implementation {original!r}")
    name = _register_capture(original)
    token = _RECORDER.set(into)
    try:
        for config, _ in configs:
            config._attn_implementation = name
        yield into
    finally:
        for config, impl in configs:
            config._attn_implementation = impl
        _RECORDER.reset(token)
