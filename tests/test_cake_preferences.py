"""CAKE's layer statistics against the stock model's attention matrix (METHODS.md, P2A).

``A_sub = A[..., -Sw:, :-Sw]`` (the window's rows over the prefix columns, rows not renormalised),
``H_l = -sum(A_sub * log(A_sub + 1e-10))`` over heads, rows and columns, ``V_l`` the unbiased
variance over the window's rows summed over heads and columns, ``P_l = H_l^(1/tau1) V_l^(1/tau2)``.
The reference reads ``A`` from the eager model's ``output_attentions`` over each prompt alone (no
cache), in float64; the cache computes them from the window's attention during prefill, in
float32 (tolerance 1e-4 relative). The GPU suite has its own check (tests/cuda).
"""

from __future__ import annotations

import pytest
import torch

from kvcake import make_method
from kvcake.allocators import preference
from shared_checks import left_padded, prefill, prompt

WINDOW = 8


def statistics(eager, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L,) float64 dispersion and shift of every layer for the prompt ``ids`` (1, S)."""
    with torch.no_grad():
        out = eager(ids, output_attentions=True, use_cache=False)
    entropy, shift = [], []
    for a in out.attentions:  # (1, H, S, S)
        sub = a[0, :, -WINDOW:, :-WINDOW].double()  # (H, Sw, S - Sw)
        entropy.append(-(sub * torch.log(sub + 1e-10)).sum())
        shift.append(sub.var(dim=1, unbiased=True).sum())
    return torch.stack(entropy), torch.stack(shift)


@pytest.mark.parametrize("tiny_llama", ["sdpa", "eager"], indirect=True)
def test_dispersion_shift_and_preference_are_the_papers(tiny_llama, make_tiny_llama):
    eager = make_tiny_llama(attn_implementation="eager")
    long, short = prompt(48, seed=11)[0], prompt(36, seed=12)[0]
    ids, mask = left_padded(long, short)
    cache, _ = prefill(tiny_llama, ids, make_method("cake", budget=20, window=WINDOW), mask, static=False)
    got_h, got_v = torch.stack(cache.entropy, dim=1), torch.stack(cache.variance, dim=1)  # (B, L)
    for row, seq in enumerate((long, short)):
        h, v = statistics(eager, seq[None])
        torch.testing.assert_close(got_h[row].double(), h, rtol=1e-4, atol=1e-8)
        torch.testing.assert_close(got_v[row].double(), v, rtol=1e-4, atol=1e-10)
        expected = preference(h, v, cache.tau.tau1, cache.tau.tau2)
        got_p = torch.stack([p[row] for p in cache.preferences]).double()
        torch.testing.assert_close(got_p, expected, rtol=1e-3, atol=1e-12)
