"""Each scorer against a slow, obviously-right float64 reference built from the full attention
matrix, on random post-RoPE tensors with left padding."""

import pytest
import torch

from kvcake.allocators import AdaKV
from kvcake.scorers import (
    CakeScorer,
    DefensiveScorer,
    H2OScorer,
    PrefillInputs,
    SnapKVScorer,
    StreamingScorer,
    TOVAScorer,
)
from kvcake.scorers.base import pool1d, pool1d_reference
from kvcake.selectors import Critical, SelectionInputs, projected_value_norms

B, H, HKV, S, D, W, PAD = 2, 4, 2, 48, 8, 8, 7
SCALE = D**-0.5


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=g) * 2
    k = torch.randn(B, HKV, S, D, generator=g) * 2
    v = torch.randn(B, HKV, S, D, generator=g)
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[1, :PAD] = False  # the second sequence is left-padded
    return q, k, v, valid


def full_attention(q, k, valid):
    """(B, H, S, S) float64 causal attention; rows of padding queries are zero."""
    qd, kd = q.double(), k.double().repeat_interleave(H // HKV, dim=1)
    a = torch.zeros(B, H, S, S, dtype=torch.float64)
    for b in range(B):
        for i in range(S):
            if not valid[b, i]:
                continue
            cols = [j for j in range(i + 1) if valid[b, j]]
            logits = torch.stack([(qd[b, :, i] * kd[b, :, j]).sum(-1) * SCALE for j in cols], -1)
            a[b, :, i, cols] = torch.softmax(logits, -1)
    return a


def pool_ref(x, kernel, kind):
    out = torch.empty_like(x)
    n = x.shape[-1]
    for i in range(n):
        lo, hi = i - kernel // 2, i + kernel // 2 + 1
        vals = [x[..., j] if 0 <= j < n else None for j in range(lo, hi)]
        if kind == "max":
            out[..., i] = torch.stack([t for t in vals if t is not None], -1).amax(-1)
        else:  # count_include_pad=True, as torch's avg_pool1d
            out[..., i] = sum(t for t in vals if t is not None) / kernel
    return out


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("kernel", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("length", [0, 1, 4, 300])
def test_avg_pool_fast_path_has_torch_bits(kernel, length, device):
    """``pool1d``'s shifted sum gives exactly torch's ``avg_pool1d`` (``pool1d_reference``)."""
    g = torch.Generator().manual_seed(kernel * 1000 + length)
    for dtype in (torch.float32, torch.float64):
        x = torch.rand(2, 5, length, generator=g) ** 8 * torch.rand(2, 5, 1, generator=g)
        x = x.to(device=device, dtype=dtype)
        assert torch.equal(pool1d(x, kernel, "avg"), pool1d_reference(x, kernel, "avg"))
    if kernel % 2:  # the scorers' kernels are odd (checked); pool_ref centres odd windows only
        x = torch.rand(2, 5, length, generator=g)
        assert torch.allclose(pool1d(x, kernel, "avg"), pool_ref(x, kernel, "avg"), atol=1e-7)


def finish(per_head, valid, reduce="mean"):
    x = per_head.reshape(B, HKV, H // HKV, S)
    x = x.mean(2) if reduce == "mean" else x.amax(2)
    x = x.clone()
    for b in range(B):
        idx = [j for j in range(S) if valid[b, j]]
        x[b, :, idx[-W:]] = float("inf")
        x[b, :, ~valid[b]] = float("-inf")
    return x


def window_stats(a, valid):
    rows = a[:, :, -W:, :]  # all window rows are real tokens here
    return rows.mean(2), rows.var(2, unbiased=True)


def check(got, ref):
    assert torch.equal(torch.isinf(got), torch.isinf(ref)) and torch.equal(
        got == float("inf"), ref == float("inf")
    )
    fin = torch.isfinite(ref)
    torch.testing.assert_close(got[fin].double(), ref[fin], atol=1e-6, rtol=1e-5)


def run(scorer, inputs):
    q, k, v, valid = inputs
    return scorer.prefill(PrefillInputs(q, k, v, valid, W, SCALE))


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_snapkv(inputs, pooling):
    a = full_attention(inputs[0], inputs[1], inputs[3])
    mean, _ = window_stats(a, inputs[3])
    pooled = torch.cat([pool_ref(mean[..., : S - W], 7, pooling), mean[..., S - W :]], -1)
    check(run(SnapKVScorer(pooling=pooling), inputs), finish(pooled, inputs[3]))


def test_snapkv_group_max(inputs):
    a = full_attention(inputs[0], inputs[1], inputs[3])
    mean, _ = window_stats(a, inputs[3])
    pooled = torch.cat([pool_ref(mean[..., : S - W], 7, "max"), mean[..., S - W :]], -1)
    check(run(SnapKVScorer(reduce="max"), inputs), finish(pooled, inputs[3], "max"))


def test_cake(inputs):
    a = full_attention(inputs[0], inputs[1], inputs[3])
    mean, var = window_stats(a, inputs[3])
    ind = mean + 200.0 * var
    pooled = torch.cat([pool_ref(ind[..., : S - W], 5, "avg"), ind[..., S - W :]], -1)
    check(run(CakeScorer(), inputs), finish(pooled, inputs[3]))


def test_tova(inputs):
    a = full_attention(inputs[0], inputs[1], inputs[3])
    last = a[:, :, -1, :].mean(1, keepdim=True).expand(B, H, S)
    check(run(TOVAScorer(), inputs), finish(last, inputs[3]))


def test_h2o_and_chunking(inputs):
    a = full_attention(inputs[0], inputs[1], inputs[3])
    acc = a.sum(2)
    ref = finish(acc, inputs[3])
    check(run(H2OScorer(chunk=7), inputs), ref)
    assert torch.allclose(run(H2OScorer(chunk=7), inputs), run(H2OScorer(chunk=4096), inputs), atol=1e-6)


def test_streaming(inputs):
    got = run(StreamingScorer(n_sink=4), inputs)
    for b, first in ((0, 0), (1, PAD)):
        kept_order = got[b, 0, first + 4 : S - W]
        assert bool((got[b, :, first : first + 4] > kept_order.max()).all()), "sinks score above the rest"
        assert bool((kept_order[1:] > kept_order[:-1]).all()), "recent tokens score higher"


def norms_ref(v, w):
    g = H // HKV
    out = torch.zeros(B, HKV, S, dtype=torch.float64)
    for hk in range(HKV):
        for j in range(g):
            h = hk * g + j
            wh = w.double()[:, h * D : (h + 1) * D]  # (hidden, d)
            out[:, hk] += (v.double()[:, hk] @ wh.T).abs().sum(-1) / g
    return out


def test_projected_value_norms(inputs):
    w = torch.randn(20, H * D, generator=torch.Generator().manual_seed(3))
    got = projected_value_norms(inputs[2], w, H)
    torch.testing.assert_close(got.double(), norms_ref(inputs[2], w), atol=1e-5, rtol=1e-5)


def critical_ref(scores, norms, count, alpha=0.5, eps=1e-4, first="ratio", pinned=0):
    """Direct two-stage selection for one head (stage 1: ``alpha`` of the prefix budget, or with
    ``first="kvpress"`` of the whole budget, the window counted in it, and at least the ``pinned``
    top prefix entries)."""
    n = scores.shape[0]
    window = {i for i in range(n) if scores[i] == float("inf")}
    prefix = [i for i in range(n) if torch.isfinite(scores[i])]
    b = count - len(window)
    b1 = int(alpha * b) if first == "ratio" else max(0, int(alpha * count) - len(window), min(pinned, b))
    stage1 = sorted(prefix, key=lambda i: (-float(scores[i]), i))[:b1]
    rest = [i for i in prefix if i not in stage1]
    stage2 = sorted(rest, key=lambda i: (-float((scores[i] + eps) * norms[i]), i))[: b - b1]
    return window | set(stage1) | set(stage2), set(stage1)


@pytest.mark.parametrize("first", ["ratio", "kvpress"])
def test_critical_equals_reference_and_keeps_stage_one(inputs, first):
    scores = run(SnapKVScorer(), inputs)
    w = torch.randn(20, H * D, generator=torch.Generator().manual_seed(4))
    norms = projected_value_norms(inputs[2], w, H)
    counts = torch.tensor([[20, 25], [18, 30]])
    keep = Critical(first=first).select(SelectionInputs(scores, counts, norms))
    topk_only = 0
    for b in range(B):
        for h in range(HKV):
            got = set(torch.nonzero(keep[b, h]).flatten().tolist())
            ref, stage1 = critical_ref(scores[b, h], norms[b, h], int(counts[b, h]), first=first)
            assert got == ref and stage1 <= got and len(got) == int(counts[b, h])
            top = set(
                torch.topk(torch.nan_to_num(scores[b, h], posinf=1e9), int(counts[b, h])).indices.tolist()
            )
            topk_only += got != top
    assert topk_only > 0, "the value norms changed some selection"
    paper = Critical().select(SelectionInputs(scores, counts, norms))
    assert torch.equal(keep, paper) == (first == "ratio"), "kvpress's smaller first stage changed some"


def test_critical_kvpress_keeps_the_pinned_entries(inputs):
    """``first="kvpress"`` with the allocator's pins: stage 1 is at least the pinned entries (each
    head's top by score), so a head whose count leaves fewer to stage 1 keeps them all; the paper's
    ``ratio`` ignores the pins."""
    scores = run(SnapKVScorer(), inputs)
    w = torch.randn(20, H * D, generator=torch.Generator().manual_seed(4))
    norms = projected_value_norms(inputs[2], w, H)
    counts = torch.tensor([[20, 25], [18, 30]])
    pinned = torch.tensor([9, 4])  # more than half of sequence 0's prefix counts
    keep = Critical(first="kvpress").select(SelectionInputs(scores, counts, norms, pinned))
    for b in range(B):
        for h in range(HKV):
            got = set(torch.nonzero(keep[b, h]).flatten().tolist())
            ref, stage1 = critical_ref(
                scores[b, h], norms[b, h], int(counts[b, h]), first="kvpress", pinned=int(pinned[b])
            )
            assert got == ref and len(stage1) >= int(pinned[b])
    alone = Critical(first="kvpress").select(SelectionInputs(scores, counts, norms))
    assert not torch.equal(keep[0], alone[0]), "the pins changed a head's selection"
    assert torch.equal(keep[1], alone[1]), "pins below kvpress's first stage change nothing"
    paper = Critical().select(SelectionInputs(scores, counts, norms))
    assert torch.equal(Critical().select(SelectionInputs(scores, counts, norms, pinned)), paper)


def kvpress_critical_adakv(raw, norms, n_kept, window, alpha_safe=0.2, first_ratio=0.5, eps=1e-4):
    """kvpress 0.5.5's ``CriticalAdaKVPress.compress`` on one sequence's scores, step for step on
    float64 (its code, rewritten): the window scored above every prefix entry, each head's top
    ``max(1, int(alpha * n_kept))`` raised to the largest float, the layer's top ``n_kept * H`` of
    those scores counted per head, stage 1 ``int(0.5 x`` a head's count``)`` raised too, then each
    head's top by ``(score + eps) * norm``. Returns the kept positions per head."""
    h, s = raw.shape
    fmax = torch.finfo(torch.float64).max
    scores = raw.double().clone()
    scores[:, s - window :] = scores[:, : s - window].max() + 1
    n_safe = max(1, int(n_kept * alpha_safe)) if n_kept > 0 else 0
    scores.scatter_(-1, scores.topk(n_safe, dim=-1).indices, fmax)
    won = scores.reshape(-1).topk(n_kept * h).indices // s
    head_budgets = torch.bincount(won, minlength=h)
    for head in range(h):
        first = int(head_budgets[head] * first_ratio)
        scores[head].scatter_(-1, scores[head].topk(first).indices, fmax)
    scores = (scores + eps) * norms.double()
    return [set(scores[head].topk(int(head_budgets[head])).indices.tolist()) for head in range(h)]


@pytest.mark.parametrize("seed", range(4))
def test_critical_adakv_alike_equals_kvpress_press(seed):
    """``heads=adakv,heads.safeguard=kvpress`` with ``select=critical,select.first=kvpress`` keeps
    what kvpress's CriticalAdaKVPress keeps from the same scores and value norms (distinct scores,
    one head ahead of all the others, so a head near its safeguard's count keeps more pins than
    its first stage holds)."""
    g = torch.Generator().manual_seed(seed)
    h, s, window, n_kept = 4, 600, 8, [64, 100, 151, 120][seed]
    raw = torch.rand(h, s, generator=g, dtype=torch.float64) ** 3
    raw[seed % h] += 1  # above every other head: the others keep little more than their pins
    raw[(seed + 1) % h] *= 5
    norms = torch.rand(h, s, generator=g, dtype=torch.float64) ** 4 * 30  # stage 2 goes by the norms
    scores = raw.clone()
    scores[:, s - window :] = float("inf")
    ada = AdaKV(safeguard="kvpress")
    budget, win = torch.tensor([n_kept]), torch.tensor([window])
    counts = ada.select(scores[None], budget, win).sum(-1)
    pinned = ada.pinned(budget, win)
    assert int(counts.min()) * 0.5 < window + int(pinned[0]), "a head's pins exceed its first stage"
    keep = Critical(first="kvpress").select(SelectionInputs(scores[None], counts, norms[None], pinned))
    got = [set(torch.nonzero(keep[0, head]).flatten().tolist()) for head in range(h)]
    assert got == kvpress_critical_adakv(raw, norms, n_kept, window)
    alone = Critical(first="kvpress").select(SelectionInputs(scores[None], counts, norms[None]))
    assert not torch.equal(keep, alone), "without the pins a head keeps other entries"


@pytest.mark.parametrize(
    "scorer",
    [CakeScorer(), CakeScorer(pooling="max", reduce="max"), H2OScorer(), TOVAScorer(), StreamingScorer(),
     StreamingScorer(n_sink=0), SnapKVScorer(), DefensiveScorer()],
    ids=lambda s: s.describe(),
)  # fmt: skip
def test_decode_step_equals_the_reference_decode(scorer):
    """``decode_step`` (one query row, the static decode step's form, entries newest first)
    returns ``decode``'s scores (entries in position order, empty slots first) on every stored
    entry. Exact, but for order-sensitive scorers (pooling): the window's sum runs in reverse
    order there, so float32 rounding may differ in the last bits (rtol 1e-6)."""
    g = torch.Generator().manual_seed(3)
    b, hkv, grp, n = 2, 2, 3, 12
    positions = torch.arange(n).repeat(b, hkv, 1) * 3  # (B, H_kv, N) ascending
    positions[1, 0, :4] = -1  # an under-budget head: empty slots first, as the reference keeps them
    probs = torch.softmax(torch.randn(b, hkv, grp, n, generator=g), -1).masked_fill(
        positions[:, :, None] < 0, 0.0
    )
    previous = torch.rand(b, hkv, n, generator=g).masked_fill(positions < 0, 0.0) if scorer.stateful else None
    ref = scorer.decode(probs.reshape(b, hkv * grp, 1, n), positions, previous)
    flipped = None if previous is None else previous.flip(-1)
    got = scorer.decode_step(probs.flip(-1), positions.flip(-1), flipped).flip(-1).expand_as(ref)
    stored = positions >= 0
    tol = {"rtol": 1e-6, "atol": 1e-9} if scorer.order_sensitive else {"rtol": 0.0, "atol": 0.0}
    torch.testing.assert_close(got[stored], ref[stored], **tol)
