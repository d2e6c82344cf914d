"""Checks that more than one test file runs (tiny Llama, tiny hybrid Gemma 3, the device suite).
A plain module, like ``tiny_hybrid``: test files import it by name."""

from __future__ import annotations

import numpy as np
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention
from transformers.models.llama.modeling_llama import LlamaAttention

import kvcake
from kvcake import KVCakeCache
from kvcake.adapters import forward_hands_kwargs, with_cache

# Whether the installed transformers' own models (the tiny Llama's and Gemma 3's attention) hand their
# attention kwargs to cache.update (from 5.24), which compiled kvcake steps and sliding rings need.
KWARGS_HANDOFF = all(forward_hands_kwargs(c) for c in (LlamaAttention, Gemma3Attention))


def calls_while_tracing(monkeypatch, cls, name: str) -> list[bool]:
    """Wrap ``cls.name`` (a method) so that each call records whether it ran while a compiled
    step was being traced (``torch.compiler.is_compiling``); the calls go through unchanged.
    Returns the list the calls append to."""
    traced: list[bool] = []
    method = getattr(cls, name)

    def spy(*args, **kwargs):
        traced.append(torch.compiler.is_compiling())
        return method(*args, **kwargs)

    monkeypatch.setattr(cls, name, spy)
    return traced


def prompt(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    """Random token ids (batch, n) in [3, 128), on the host."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, n), generator=g)


def prefill(model, ids, method, mask=None, **kw) -> tuple[KVCakeCache, torch.Tensor]:
    """One compressing forward of ``ids``: the cache and the logits."""
    cache = KVCakeCache(model, method, **kw)
    with kvcake.enable(model), torch.no_grad():
        out = model(ids, attention_mask=mask, **with_cache(model, cache))
    return cache, out.logits


def single_step_logits(model, cache, follow: torch.Tensor) -> torch.Tensor:
    """(n, vocab) last-token logits of feeding ``follow`` (1, n) one token at a time."""
    steps = []
    with kvcake.enable(model), torch.no_grad():
        for i in range(follow.shape[1]):
            steps.append(model(follow[:, i : i + 1], **with_cache(model, cache)).logits[0, -1])
    return torch.stack(steps)


def assert_batch_matches_each_alone(model, name: str, a: torch.Tensor, b: torch.Tensor, n_pad: int, **kw):
    """``a`` and ``b`` (1-D, ``len(a) == n_pad + len(b)``) generated as one left-padded batch
    give each the tokens, per-head counts and kept positions it gets alone; padding is never
    kept. ``kw`` goes to ``kvcake.generate`` (greedy, so the tokens must match exactly)."""
    pad = torch.zeros(n_pad, dtype=torch.long, device=a.device)
    batch = torch.stack([a, torch.cat([pad, b])])
    mask = torch.stack([torch.ones_like(a), torch.cat([pad, torch.ones_like(b)])])
    new = kw["max_new_tokens"]
    out, cache = kvcake.generate(model, batch, name, attention_mask=mask, **kw)
    for i, (seq, shift) in enumerate(((a, 0), (b, n_pad))):
        alone, solo = kvcake.generate(model, seq[None], name, **kw)
        assert torch.equal(out[i, -new:], alone[0, -new:])
        assert np.array_equal(cache.layer_counts()[i], solo.layer_counts()[0])
        for lid in cache.compressed:
            pb = cache.layers[lid].padded_positions()[i].cpu()
            ps = solo.layers[lid].padded_positions()[0].cpu()
            for h in range(pb.shape[0]):
                kept = sorted((pb[h][pb[h] >= 0] - shift).tolist())
                assert kept == sorted(ps[h][ps[h] >= 0].tolist())
                assert min(kept) >= 0, "padding is never kept"
