"""How far a compressed cache moves the model from the full cache, measured on the full cache's own text.

A small model fails many long-context tasks even with its full cache, so task scores alone say
little about a compression method there. These measures compare the compressed cache with the
full one on the *same* token ids, whether or not the answer is right:

1. the full cache (a transformers ``DynamicCache``) greedily continues the prompt for ``N``
   tokens (``c_1 .. c_N``; not stopped at EOS, so every sample is measured on ``N`` tokens: the
   answer and whatever the model writes after it);
2. both caches are teacher-forced on the tokens that follow their prefix: in the context-only
   scenario the prefix is the context and the appended tokens are ``question + c_1..c_{N-1}``; in
   the question-aware scenario the prefix is context + question and the appended tokens are
   ``c_1..c_{N-1}``. The prediction of ``c_1`` comes from the prefix's last logits;
3. from the two runs:

   - ``kl``: mean over the ``N`` continuation positions of ``KL(p_full || p_compressed)`` of the
     next-token distributions (nats);
   - ``nll`` / ``nll_full``: mean negative log-likelihood (nats per token) of ``c_1..c_N`` under
     the compressed and the full cache;
   - ``attn_rel_l1``: per layer, ``||o_c - o_f||_1 / ||o_f||_1`` of the attention output (after
     the output projection) over the appended positions: the output perturbation the CriticalKV
     paper (Feng et al., 2025, https://arxiv.org/abs/2502.03805) bounds; and its mean over layers;
   - ``hidden_rel_l1``: the same ratio for the final hidden state (``output_hidden_states``' last
     element, after the final norm).

   In the question-aware scenario the prefill itself runs on full keys and values, so its last
   logits equal the full cache's: the first KL term is 0 and the perturbations cover ``N - 1``
   positions (``None`` when ``N == 1``).

With a budget that covers the whole prompt every measure is 0 up to float error: the compressed
cache then keeps everything (exactly 0 with the stock kernel; ~1e-7 for methods that evict while
decoding, whose later steps attend through kvcake's own kernel).

This module also provides the *shared prefill* the runner uses: the full-cache forward records,
per layer, the post-RoPE queries given to the attention function (keys and values are in the
``DynamicCache``), and :func:`replay_compress` feeds them to a fresh
:class:`~kvcake.cache.KVCakeCache` exactly as the kvcake attention function does during a real
prefill. A prefill's forward does not depend on the method (every layer attends over its full
keys and values; eviction only changes what is kept), so one forward serves every method and
budget, instead of one prefill each. The replay follows the protocol between ``KVCakeCache`` and
the kvcake attention function (``update``, ``consume``, ``after_prefill_attention``);
``tests/eval/test_fidelity.py`` checks that a replayed cache equals ``kvcake.compress``'s, entry
for entry, for every preset, so a change of that protocol shows up there.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvcake.api import CompressedContext
from kvcake.attention import enable
from kvcake.cache import PENDING, KVCakeCache, cache_kv_bytes
from kvcake.method import Method
from kvcake.scorers import PrefillInputs, Scorer
from kvcake.sliding import SlidingLayer, copy_sliding_state

__all__ = [
    "Captured",
    "Fidelity",
    "ScoreMemo",
    "TeacherForced",
    "attention_modules",
    "capture_queries",
    "compare",
    "replay_compress",
    "teacher_force",
    "cache_bytes",
]

_OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "c_proj", "wo")


# --------------------------------------------------------------------------------------------
# Attention modules and their outputs
# --------------------------------------------------------------------------------------------


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules, in layer order: modules with a ``layer_idx`` and an output
    projection (``o_proj`` and the other usual names). Found generically, no per-model code."""
    found = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and any(
            isinstance(getattr(module, n, None), torch.nn.Linear) for n in _OUTPUT_PROJECTIONS
        ):
            found.setdefault(idx, module)
    if not found:
        raise ValueError(f"{type(model).__name__}: found no attention modules (layer_idx + o_proj)")
    return [found[i] for i in sorted(found)]


@contextlib.contextmanager
def attention_outputs(model: torch.nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Inside the block, each forward stores every layer's attention output (B, q, hidden), after
    the output projection, in the yielded dict (layer -> tensor). Hooks are removed on exit."""
    store: dict[int, torch.Tensor] = {}
    handles = []

    def hook(idx: int):
        def fn(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            store[idx] = out.detach()

        return fn

    try:
        for i, module in enumerate(attention_modules(model)):
            handles.append(module.register_forward_hook(hook(i)))
        yield store
    finally:
        for h in handles:
            h.remove()


# --------------------------------------------------------------------------------------------
# Capturing the queries of a full-cache forward
# --------------------------------------------------------------------------------------------

_RECORDER: contextvars.ContextVar[Captured | None] = contextvars.ContextVar(
    "kvcake_eval_capture", default=None
)
_CAPTURE_PREFIX = "kvcake_eval_capture_"


@dataclass
class Captured:
    """Per layer, what the attention function received during full-cache forwards.

    ``queries[l]``: list of (B, H, q, d) post-RoPE query chunks, one per forward, in order;
    ``modules[l]`` the attention module; ``scaling[l]`` its softmax scale."""

    queries: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    modules: dict[int, torch.nn.Module] = field(default_factory=dict)
    scaling: dict[int, float] = field(default_factory=dict)
    _joined: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict, repr=False)

    def add(self, module: torch.nn.Module, query: torch.Tensor, scaling: float | None) -> None:
        idx = module.layer_idx
        self.queries.setdefault(idx, []).append(query.detach())
        self.modules[idx] = module
        self.scaling[idx] = scaling if scaling is not None else query.shape[-1] ** -0.5

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
        return Captured({k: list(v) for k, v in self.queries.items()}, dict(self.modules), dict(self.scaling))


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
            recorder.add(module, query, scaling)
        return kernel(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register(name, capture_attention)
    mask_fn = ALL_MASK_ATTENTION_FUNCTIONS.get(inner) or ALL_MASK_ATTENTION_FUNCTIONS["eager"]
    AttentionMaskInterface.register(name, mask_fn)
    return name


@contextlib.contextmanager
def capture_queries(model: torch.nn.Module, into: Captured) -> Iterator[Captured]:
    """Run ``model`` with its own attention kernel, recording each layer's queries into ``into``.

    The model's attention implementation is switched for the block and restored in ``finally``."""
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


class ScoreMemo:
    """Prefill scores already computed for a layer's recorded inputs, to reuse across budgets.

    A scorer's prefill scores depend on the layer's queries, keys and the window, never on the
    budget, so replaying one prompt at several budgets needs them once. Entries are keyed on the
    identity of the recorded tensors (kept alive here, so an id is never reused) and on the
    scorer's configuration; a hit returns a copy."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def scores(self, scorer: Scorer, inp: PrefillInputs) -> torch.Tensor:
        key = (id(inp.query), id(inp.keys), inp.window, float(inp.scaling), type(scorer), repr(scorer))
        hit = self._entries.get(key)
        if hit is None or hit[0] is not inp.query or hit[1] is not inp.keys:
            hit = (inp.query, inp.keys, scorer.prefill(inp))
            self._entries[key] = hit
        return hit[2].clone()


class _MemoScorer(Scorer):
    """``inner`` with its prefill scores looked up in a :class:`ScoreMemo` (decoding unchanged)."""

    def __init__(self, inner: Scorer, memo: ScoreMemo) -> None:
        self.inner, self.memo = inner, memo
        self.name, self.stateful, self.reduce = inner.name, inner.stateful, inner.reduce

    def prefill(self, inp: PrefillInputs) -> torch.Tensor:
        return self.memo.scores(self.inner, inp)

    def decode(
        self, probs: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor | None
    ) -> torch.Tensor:
        return self.inner.decode(probs, positions, previous)

    def describe(self) -> str:
        return self.inner.describe()


def replay_compress(
    model: torch.nn.Module,
    method: Method,
    captured: Captured,
    cache: DynamicCache,
    input_ids: torch.Tensor,
    logits: torch.Tensor,
    chunks: int | None = None,
    memo: ScoreMemo | None = None,
) -> CompressedContext:
    """Compress a prompt whose full-cache forward was recorded, without running the model again.

    Parameters
    ----------
    captured:
        Queries recorded by :func:`capture_queries` during the forward(s) that filled ``cache``.
    cache:
        The full ``DynamicCache`` holding the prompt's keys and values (B, H_kv, S, d) per layer;
        it is not modified.
    input_ids:
        (B, S) the prompt's ids; ``logits``: (B, vocab) of its last token.
    chunks:
        Use the first ``chunks`` recorded forwards' queries (their total length must be ``S``).
    memo:
        Reuse prefill scores across calls on the same recording (e.g. several budgets).

    Returns the same :class:`~kvcake.api.CompressedContext` ``kvcake.compress`` builds: each layer
    is stored in full, then scored and evicted by the cache's prefill hook, in layer order (so the
    CAKE cascade runs as in a real prefill).
    """
    if memo is not None:
        method = method.replace(scorer=_MemoScorer(method.scorer, memo))
    kv = KVCakeCache(model, method)
    valid = torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    with torch.no_grad():
        for layer in range(len(kv.layers)):
            if isinstance(kv.layers[layer], SlidingLayer):  # left as the full cache holds it
                copy_sliding_state(cache.layers[layer], kv.layers[layer])
                continue
            query = captured.query(layer, chunks)
            keys, values = cache.layers[layer].keys, cache.layers[layer].values
            if query.shape[2] != keys.shape[2] or keys.shape[2] != input_ids.shape[1]:
                raise ValueError(
                    f"layer {layer}: {query.shape[2]} recorded queries, {keys.shape[2]} cached keys, "
                    f"{input_ids.shape[1]} prompt ids: they must match"
                )
            kv.update(keys, values, layer)
            PENDING.set(None)  # what the kvcake attention function does before its hooks
            kv.consume(layer)
            kv.after_prefill_attention(layer, captured.modules[layer], query, valid, captured.scaling[layer])
    return CompressedContext(model, kv, input_ids, torch.ones_like(input_ids), logits)


def cache_bytes(cache) -> int:
    """Bytes of keys and values a cache holds (``kv_bytes()`` for a KVCakeCache)."""
    return cache_kv_bytes(cache)


# --------------------------------------------------------------------------------------------
# Teacher forcing and the measures
# --------------------------------------------------------------------------------------------


@dataclass
class TeacherForced:
    """One run's view of the continuation.

    ``logprobs``: (n, vocab) float64 log-probabilities of the ``n`` continuation predictions;
    ``attn``: per layer (a, hidden) attention outputs of the ``a`` appended tokens;
    ``hidden``: (a, hidden) final hidden states of the appended tokens (``a`` may be 0)."""

    logprobs: torch.Tensor
    attn: list[torch.Tensor]
    hidden: torch.Tensor | None


def teacher_force(
    model: torch.nn.Module,
    cache,
    prefix_len: int,
    prefix_logits: torch.Tensor,
    appended: torch.Tensor,
    n_predictions: int,
) -> TeacherForced:
    """Teacher-force ``appended`` (1, a) after a cache holding ``prefix_len`` tokens.

    ``cache`` is consumed (pass a fork). ``prefix_logits`` (1, vocab) are the logits of the prefix's
    last token. The last ``n_predictions`` of the ``1 + a`` next-token predictions are kept: the
    continuation's."""
    preds = [prefix_logits.float()]
    attn: list[torch.Tensor] = []
    hidden = None
    if appended.shape[1] > 0:
        mask = torch.ones(1, prefix_len + appended.shape[1], dtype=torch.long, device=appended.device)
        with attention_outputs(model) as outputs, enable(model), torch.no_grad():
            out = model(appended, attention_mask=mask, past_key_values=cache, output_hidden_states=True)
        preds.append(out.logits[0].float())
        attn = [outputs[i][0] for i in sorted(outputs)]
        hidden = out.hidden_states[-1][0]
    logits = torch.cat([p.reshape(-1, p.shape[-1]) for p in preds])[-n_predictions:]
    return TeacherForced(torch.log_softmax(logits.double(), dim=-1), attn, hidden)


@dataclass(frozen=True)
class Fidelity:
    """Measures of one compressed run against the full cache (see the module docstring).

    ``kl`` nats per token; ``nll``/``nll_full`` nats per token; ``attn_rel_l1_layers`` one value
    per layer (empty when nothing was appended); ``tokens`` the continuation's length ``N``."""

    kl: float
    nll: float
    nll_full: float
    attn_rel_l1: float | None
    attn_rel_l1_layers: list[float]
    hidden_rel_l1: float | None
    tokens: int

    def as_record(self) -> dict[str, object]:
        return {
            "kl": self.kl,
            "nll": self.nll,
            "nll_full": self.nll_full,
            "attn_rel_l1": self.attn_rel_l1,
            "attn_rel_l1_layers": [float(f"{x:.4g}") for x in self.attn_rel_l1_layers],
            "hidden_rel_l1": self.hidden_rel_l1,
            "fidelity_tokens": self.tokens,
        }

    @classmethod
    def identical(cls, nll_full: float, layers: int, tokens: int, appended: bool) -> Fidelity:
        """The full cache compared with itself."""
        return cls(0.0, nll_full, nll_full, 0.0 if appended else None, [0.0] * layers if appended else [],
                   0.0 if appended else None, tokens)  # fmt: skip


def _rel_l1(compressed: torch.Tensor, full: torch.Tensor) -> float:
    num = (compressed.double() - full.double()).abs().sum()
    den = full.double().abs().sum().clamp_min(1e-30)
    return float(num / den)


def compare(full: TeacherForced, compressed: TeacherForced, continuation: torch.Tensor) -> Fidelity:
    """The measures of ``compressed`` against ``full``; ``continuation`` (n,) the full cache's tokens."""
    n = continuation.numel()
    if full.logprobs.shape[0] != n or compressed.logprobs.shape[0] != n:
        raise ValueError(
            f"expected {n} predictions, got {full.logprobs.shape[0]} and {compressed.logprobs.shape[0]}"
        )
    p_full = full.logprobs.exp()
    kl = (p_full * (full.logprobs - compressed.logprobs)).sum(-1).clamp_min(0.0).mean()
    idx = continuation.reshape(n, 1).to(full.logprobs.device)
    nll = -compressed.logprobs.gather(1, idx).mean()
    nll_full = -full.logprobs.gather(1, idx).mean()
    layers = [_rel_l1(c, f) for c, f in zip(compressed.attn, full.attn, strict=True)]
    hidden = None
    if full.hidden is not None and compressed.hidden is not None:
        hidden = _rel_l1(compressed.hidden, full.hidden)
    return Fidelity(
        kl=float(kl),
        nll=float(nll),
        nll_full=float(nll_full),
        attn_rel_l1=sum(layers) / len(layers) if layers else None,
        attn_rel_l1_layers=layers,
        hidden_rel_l1=hidden,
        tokens=n,
    )
