"""Layer and head allocators: exact integer totals, caps, the published formulas."""

import numpy as np
import pytest
import torch

from kvcake.allocators import AdaKV, AllocationRequest, CakeAllocator, Pyramid, RandomSplit, Uniform
from kvcake.allocators.adakv import ranks_desc, top_ranked
from kvcake.allocators.cake import FALLBACK_TAU, default_tau, preference


def request(total, cap, window, n, prefs=None, final=True):
    return AllocationRequest(
        total=torch.tensor(total), cap=torch.tensor(cap), window=torch.tensor(window),
        num_layers=n, preferences=prefs, final=final,
    )  # fmt: skip


@pytest.mark.parametrize("alloc", [Uniform(), Pyramid(), RandomSplit(seed=3), CakeAllocator()])
@pytest.mark.parametrize("per_layer,cap", [(64, 500), (100, 120), (37, 37), (300, 200), (33, 4000)])
def test_budgets_are_exact_integers_within_caps(alloc, per_layer, cap):
    n = 7
    g = torch.Generator().manual_seed(per_layer)
    prefs = torch.rand(2, n, generator=g, dtype=torch.float64) ** 3
    req = request([per_layer * n, per_layer * n + 5], [cap, cap + 50], [min(32, cap)] * 2, n, prefs)
    b = alloc.allocate(req)
    assert b.dtype == torch.int64 and b.shape == (2, n)
    expected = torch.minimum(req.total, req.cap * n)
    assert torch.equal(b.sum(1), expected), (b, expected)
    assert bool((b <= req.cap[:, None]).all())
    assert bool((b >= torch.minimum(req.window, req.cap)[:, None]).all()), "every layer keeps its window"


def test_pyramid_follows_the_formula():
    n, avg, window, beta = 5, 132, 32, 20
    b = Pyramid(beta=beta).allocate(request([avg * n], [10_000], [window], n))[0]
    prefix = avg - window
    lo, hi = prefix // beta, 2 * prefix - prefix // beta
    expected = [window + lo + (hi - lo) * (n - 1 - i) / (n - 1) for i in range(n)]
    assert b.tolist() == [round(x) for x in expected]
    assert b[0] > b[-1]


def test_cake_budgets_follow_the_preference_ratio():
    prefs = torch.tensor([[1.0, 2.0, 4.0, 1.0]], dtype=torch.float64)
    window, n, avg = 16, 4, 116
    b = CakeAllocator().allocate(request([avg * n], [100_000], [window], n, prefs))[0]
    pool = avg * n - n * window
    expected = [window + pool * p / 8.0 for p in prefs[0].tolist()]
    assert b.tolist() == [int(x) for x in expected]  # 66, 116, 216, 66: exact here


def test_cake_caps_and_redistributes():
    prefs = torch.tensor([[100.0, 1.0, 1.0]], dtype=torch.float64)
    b = CakeAllocator().allocate(request([300], [150], [10], 3, prefs))[0]
    assert b[0] == 150 and b.sum() == 300 and b[1] == b[2] == 75


def test_cake_intermediate_stages_never_grow():
    g = torch.Generator().manual_seed(0)
    prefs = torch.rand(3, 12, generator=g, dtype=torch.float64)
    total, cap, window = [64 * 12, 50 * 12, 90 * 12], [400, 300, 95], [32, 32, 32]
    prev = None
    for m in range(12):
        b = CakeAllocator().allocate(request(total, cap, window, 12, prefs[:, : m + 1], final=(m == 11)))
        if prev is not None:
            assert bool((b[:, :-1] <= prev).all()), "Proposition 1: budgets only shrink"
        prev = b
    assert torch.equal(prev.sum(1), torch.minimum(torch.tensor(total), torch.tensor(cap) * 12))


def test_preference_and_tau_defaults():
    p = preference(torch.tensor([4.0]), torch.tensor([9.0]), 2.0, 0.5)
    assert torch.allclose(p, torch.tensor([2.0 * 81.0], dtype=torch.float64))
    assert default_tau("llama", 128) == (1.6, 0.6) and default_tau("llama", 1024) == (1.6, 0.4)
    assert default_tau("mistral", 128) == (1.0, 0.8) and default_tau("qwen3", 128) == (0.4, 0.6)
    assert default_tau("somethingelse", 128) == FALLBACK_TAU


def safeguard_pin(budget, window, alpha, safeguard):
    """The prefix entries Ada-KV pins in every head: ``floor(alpha * B')`` (the paper), or
    kvpress's ``max(1, floor(alpha * B))`` with the window among them."""
    if safeguard == "prefix":
        return int(alpha * (budget - window))
    whole = max(1, int(alpha * budget)) if alpha > 0 and budget > 0 else int(alpha * budget)
    return max(whole - window, 0)


def adakv_reference(scores, budget, window, alpha, safeguard="prefix"):
    """Direct, loop-based Ada-KV (Algorithm 1 with the safeguard) for one sequence."""
    h, s = scores.shape
    prefix_budget = budget - window
    pin = safeguard_pin(budget, window, alpha, safeguard)
    kept = [set(range(s - window, s)) for _ in range(h)]
    cands = []
    for head in range(h):
        order = sorted(range(s - window), key=lambda i: (-float(scores[head, i]), i))
        kept[head] |= set(order[:pin])
        cands += [(-float(scores[head, i]), head * s + i, head, i) for i in order[pin:]]
    cands.sort()
    for _, _, head, i in cands[: h * prefix_budget - h * pin]:
        kept[head].add(i)
    return kept


@pytest.mark.parametrize("safeguard", ["prefix", "kvpress"])
@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 1.0])
def test_adakv_equals_reference_and_keeps_safeguard(alpha, safeguard):
    g = torch.Generator().manual_seed(1)
    h, s, window, budget = 3, 60, 6, 20
    raw = torch.rand(2, h, s, generator=g) ** 4
    raw[1, 0] *= 10  # one head dominates in the second sequence
    scores = raw.clone()
    scores[..., -window:] = float("inf")
    ada = AdaKV(alpha=alpha, safeguard=safeguard)
    keep = ada.select(scores, torch.tensor([budget, budget]), torch.tensor([window, window]))
    pin = safeguard_pin(budget, window, alpha, safeguard)
    assert ada.pinned(torch.tensor([budget]), torch.tensor([window])).tolist() == [pin]
    for b in range(2):
        ref = adakv_reference(raw[b], budget, window, alpha, safeguard)
        got = [set(torch.nonzero(keep[b, head]).flatten().tolist()) for head in range(h)]
        assert got == ref
        assert int(keep[b].sum()) == h * budget, "the layer total is exact"
        for head in range(h):
            assert len(got[head]) >= window + pin
    if alpha < 1.0:
        counts = keep.sum(-1)
        assert len(set(counts[1].tolist())) > 1, "a dominant head wins more entries"


@pytest.mark.parametrize("safeguard", ["prefix", "kvpress"])
@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 1.0])
@pytest.mark.parametrize("seed", range(6))
def test_adakv_counts_on_the_host_equal_select(alpha, seed, safeguard):
    """``AdaKV.places`` once, then ``counts_on_host`` at many budgets (a cascade's stages) equals
    ``select``'s counts: many ties (scores from 3 values), left padding, a head of equal scores,
    budgets below the window and past the prompt, a different budget per sequence."""
    g = torch.Generator().manual_seed(seed)
    h, s, window = [(4, 80, 6), (3, 50, 4), (8, 33, 1)][seed % 3]
    scores = torch.randint(0, [3, 12, 1000][seed % 3], (3, h, s), generator=g).float()
    scores[..., -window:] = float("inf")
    scores[1, :, :9] = float("-inf")  # left padding
    scores[2, 0, :-window] = 0.5  # one head all ties
    ada = AdaKV(alpha=alpha, safeguard=safeguard)
    places = ada.host_places(ada.places(scores).numpy())
    win = torch.full((3,), window)
    for budget in [0, 1, 3, window, 7, 20, 41, s - 1, s, 200]:
        budgets = torch.tensor([budget, max(budget - 5, 0), budget + 3])
        expected = ada.select(scores, budgets, win).sum(-1)
        assert np.array_equal(ada.counts_on_host(places, budgets.numpy(), win.numpy()), expected.numpy())


@pytest.mark.parametrize("seed", range(6))
def test_top_ranked_equals_ranks_below_k(seed):
    """``top_ranked`` (one topk) keeps exactly ``ranks_desc(scores) < k``: ties by position,
    -inf entries, k of 0 and past the row."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 6 + 20 * (seed % 2), (2, 3, 50), generator=g).float()
    scores[0, 1, :7] = float("-inf")
    scores[1, 2, ::3] = float("inf")
    for kk in [0, 1, 5, 17, 49, 50, 60]:
        k = torch.randint(0, kk + 1, (2, 3), generator=g)
        k[0, 0] = kk
        assert torch.equal(top_ranked(scores, k), ranks_desc(scores) < k[..., None])
    flat = scores.reshape(2, -1)
    k = torch.tensor([0, 77])
    assert torch.equal(top_ranked(flat, k), ranks_desc(flat) < k[:, None])


def test_adakv_bad_alpha():
    with pytest.raises(ValueError, match="alpha"):
        AdaKV(alpha=1.5)
    with pytest.raises(ValueError, match="safeguard must be one of 'prefix', 'kvpress', got 'window'"):
        AdaKV(safeguard="window")


def test_kvpress_safeguard_counts_the_window_among_the_pins():
    """kvpress pins ``max(1, floor(alpha * B))`` entries, window included: 102 of 512 with a window
    of 32 leave 70 prefix pins where the paper's ``floor(0.2 * 480)`` gives 96; a pin of at least
    one entry of a nonzero budget, none of an empty one or with alpha 0."""
    b, w = torch.tensor([512, 40, 3, 0, 512]), torch.tensor([32, 32, 0, 0, 0])
    assert AdaKV().pinned(b, w).tolist() == [96, 1, 0, 0, 102]
    assert AdaKV(safeguard="kvpress").pinned(b, w).tolist() == [70, 0, 1, 0, 102]
    assert AdaKV(alpha=0.0, safeguard="kvpress").pinned(b, w).tolist() == [0, 0, 0, 0, 0]
    host = AdaKV(safeguard="kvpress").pinned(b.numpy(), w.numpy())
    assert isinstance(host, np.ndarray) and host.tolist() == [70, 0, 1, 0, 102]


KINDS = ["spread", "zeros", "equal", "all-zero row", "over-full", "orders of magnitude"]


@pytest.mark.parametrize("kind", KINDS)
def test_closed_form_waterfill_equals_the_bisection(kind):
    """The closed-form water-filling the cascade runs at every stage equals the bisection
    (``waterfill_reference``) to float64 rounding, and rounds to the same integer budgets, on
    random batches: spread-out weights, some zero weights, equal weights, a sequence whose weights
    are all zero, totals past what the layers can hold, and weights 48 orders of magnitude apart
    (CAKE's preferences are, and a weight of 1e-16 beside 1 must still count); and it dispatches a
    tenth of the ops."""
    from kvcake.allocators.base import round_exact, round_up, waterfill, waterfill_reference
    from kvcake.bench.step_counts import CountOps

    g = torch.Generator().manual_seed(KINDS.index(kind))
    for _ in range(300):
        b, n = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
        w = torch.exp(4 * torch.randn(b, n, generator=g, dtype=torch.float64))
        if kind == "zeros":
            w[torch.rand(b, n, generator=g) < 0.3] = 0
        elif kind == "equal":
            w = torch.ones(b, n, dtype=torch.float64)
        elif kind == "all-zero row":
            w[0] = 0
        elif kind == "orders of magnitude":
            w = 10.0 ** torch.randint(-40, 9, (b, n), generator=g).double()
            w[torch.rand(b, n, generator=g) < 0.4] = 0
        cap = torch.randint(10, 3000, (b,), generator=g)
        base = torch.minimum(torch.randint(0, 40, (b,), generator=g), cap)
        total = (torch.rand(b, generator=g, dtype=torch.float64) * 1.3 * n * cap).round().long()
        if kind == "over-full":
            total = torch.maximum(total, n * cap)
        fast, ref = waterfill(w, base, cap, total), waterfill_reference(w, base, cap, total)
        torch.testing.assert_close(fast, ref, rtol=0, atol=1e-9 * float(total.max().clamp(min=1)))
        assert torch.equal(round_exact(fast, cap, total), round_exact(ref, cap, total))
        assert torch.equal(round_up(fast, cap), round_up(ref, cap))
    counts = []
    for fn in (waterfill, waterfill_reference):
        with CountOps() as c:
            fn(
                torch.rand(1, 32, dtype=torch.float64),
                torch.tensor([8]),
                torch.tensor([600]),
                torch.tensor([2048]),
            )
        counts.append(sum(c.ops.values()))
    assert counts[0] * 5 < counts[1], counts
