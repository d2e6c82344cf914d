"""The cascade's memory bound, measured with the CUDA allocator (not only the cache's counter).

CAKE's cascade keeps at most the total budget plus one full layer during prefill. On a GPU the
allocator also holds the forward's activations and the scoring buffers, so the bound checked is

    peak <= weights and ids                     (held before the prefill)
          + activations                         (measured: the same forward without any cache;
                                                  they include the current layer's full keys and values)
          + scoring                             (measured: one layer's window attention, CAKE scores
                                                  and preference terms on that layer's shapes)
          + 2 * total budget + L entries        (compressed layers, ceil slack of the intermediate
                                                  stages, and the kept copy an eviction writes
                                                  while the old entries are alive)
          + S * H_kv * 12 bytes                 (the current layer's positions int64 and scores float32)
          + 512 bytes * 16 * L                  (allocator rounding: 512-byte blocks, at most ~16 live
                                                  tensors per layer)

Activations and scoring never peak at the same time (scoring runs after the attention kernel,
the MLP after it), so the sum is an upper bound. The one-shot ablation keeps every full layer
until the end and must break the same bound: that is what makes the check able to fail.
"""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import DEVICE, deep_llama, ids, needs_cuda_memory

import kvcake
from kvcake.allocators.cake import preference
from kvcake.scorers import PrefillInputs
from kvcake.scorers.base import window_rows_mean_var
from kvcake.scorers.cake import CakeScorer

S, BUDGET, WINDOW = 4096, 64, 32


def _peak_above(fn) -> tuple[int, object]:
    """(peak bytes allocated while ``fn`` ran, above what was allocated before it), fn's result."""
    torch.cuda.synchronize(DEVICE)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(DEVICE)
    torch.cuda.reset_peak_memory_stats(DEVICE)
    with torch.no_grad():
        out = fn()
    torch.cuda.synchronize(DEVICE)
    return torch.cuda.max_memory_allocated(DEVICE) - before, out


def _scoring(h: int, hkv: int, d: int, dtype: torch.dtype) -> int:
    """Peak of one layer's CAKE scoring and preference terms, as the cache runs them."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(1, h, S, d, generator=g, device=DEVICE, dtype=dtype)
    k = torch.randn(1, hkv, S, d, generator=g, device=DEVICE, dtype=dtype)
    valid = torch.ones(1, S, dtype=torch.bool, device=DEVICE)

    def run():
        inp = PrefillInputs(query=q, keys=k, values=k, key_valid=valid, window=WINDOW, scaling=d**-0.5)
        scores = CakeScorer().prefill(inp)
        probs, row_valid = inp.window_attention()
        sub = probs[..., : S - WINDOW]
        entropy = -(sub * torch.log(sub + 1e-10)).sum((1, 2, 3))
        _, var = window_rows_mean_var(sub, row_valid)
        return scores, preference(entropy, var.sum((1, 2)), 1.6, 0.6)

    return _peak_above(run)[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cascade_peak_within_budget_plus_one_layer(dtype):
    needs_cuda_memory()
    model = deep_llama().to(DEVICE, dtype)
    cfg = model.config
    L, hkv, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    prompt = ids(S, seed=5, vocab=cfg.vocab_size)
    entry = 2 * hkv * d * torch.finfo(dtype).bits // 8  # K and V of one position in one layer
    activations, _ = _peak_above(lambda: model(prompt, use_cache=False, logits_to_keep=1))
    scoring = _scoring(cfg.num_attention_heads, hkv, d, dtype)
    bound = activations + scoring + (2 * BUDGET * L + L) * entry + S * hkv * 12 + 512 * 16 * L
    cascade, ctx = _peak_above(lambda: kvcake.compress(model, prompt, "cake", budget=BUDGET, window=WINDOW))
    assert ctx.cache.kv_bytes() == BUDGET * L * entry
    # the cache's own counter: a stage waits for the next layer's update on a GPU (cascade.PendingStage),
    # so the waiting layer's whole prompt and the next layer's keys and values are alive together
    assert ctx.cache.prefill_peak_kv_bytes <= (BUDGET * L + 2 * S + L) * entry, "the cache's own counter"
    del ctx
    once, ctx = _peak_above(
        lambda: kvcake.compress(model, prompt, "cake-oneshot", budget=BUDGET, window=WINDOW)
    )
    del ctx
    mib = 1 << 20
    report = (
        f"cascade {cascade / mib:.1f} MiB, one-shot {once / mib:.1f} MiB, bound {bound / mib:.1f} MiB "
        f"(activations {activations / mib:.1f}, scoring {scoring / mib:.1f}, full layer {S * entry / mib:.1f})"
    )
    assert cascade <= bound, report
    assert once > bound, "the bound must be tight enough to catch a cache that keeps every layer: " + report
