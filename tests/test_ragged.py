"""Ragged attention against a dense masked float64 reference."""

import math

import numpy as np
import pytest
import torch

from kvcake.layer import KVCakeLayer, dense_attention
from kvcake.ragged import RaggedMeta, kept_indices, ragged_attention, ragged_attention_reference


def dense_reference(query, keys_list, values_list, pos_list, qpos, scaling):
    """Loop over (sequence, head): plain softmax attention over that head's own entries, float64."""
    b, h, q, d = query.shape
    hkv = len(keys_list) // b
    g = h // hkv
    out = torch.zeros(b, q, h, d, dtype=torch.float64)
    for bi in range(b):
        for kh in range(hkv):
            k, v, p = keys_list[bi * hkv + kh], values_list[bi * hkv + kh], pos_list[bi * hkv + kh]
            for j in range(g):
                for i in range(q):
                    vis = p <= qpos[bi, i]
                    logits = (k[vis].double() @ query[bi, kh * g + j, i].double()) * scaling
                    out[bi, i, kh * g + j] = torch.softmax(logits, 0) @ v[vis].double()
    return out


def assert_rel(out, ref, tol=1e-6):
    err = float((out.double() - ref).norm() / ref.norm())
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


def make_case(b, h, hkv, lengths, q, seed=0, d=16):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    meta = RaggedMeta.from_lengths(lengths)
    past = 500
    keys_list, values_list, pos_list = [], [], []
    for n in lengths.tolist():
        old = torch.sort(torch.randperm(past, generator=g)[: n - q]).values
        pos_list.append(torch.cat([old, torch.arange(past, past + q)]))
        keys_list.append(torch.randn(n, d, generator=g, dtype=torch.float64))
        values_list.append(torch.randn(n, d, generator=g, dtype=torch.float64))
    query = torch.randn(b, h, q, d, generator=g, dtype=torch.float64)
    qpos = torch.arange(past, past + q)[None].expand(b, q)
    return query, keys_list, values_list, pos_list, qpos, meta


@pytest.mark.parametrize("h,hkv", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("q", [1, 5])
@pytest.mark.parametrize("pattern", ["equal", "skewed", "window_only"])
def test_ragged_equals_dense_reference(h, hkv, q, pattern):
    b = 2
    n_seg = b * hkv
    if pattern == "equal":
        lengths = [40] * n_seg
    elif pattern == "skewed":
        lengths = [10 + 17 * i for i in range(n_seg)]
    else:  # one head holds only its window (8 entries) plus the new tokens
        lengths = [8 + q] + [30 + i for i in range(n_seg - 1)]
    query, ks, vs, ps, qpos, meta = make_case(b, h, hkv, lengths, q, seed=len(lengths) + q)
    scaling = 16**-0.5
    out, probs = ragged_attention_reference(
        query, torch.cat(ks), torch.cat(vs), torch.cat(ps), meta, qpos, scaling, return_probs=True
    )
    ref = dense_reference(query, ks, vs, ps, qpos, scaling)
    assert_rel(out, ref)
    seg_sum = torch.zeros(n_seg, probs.shape[1], q, dtype=probs.dtype).index_add_(0, meta.seg, probs)
    torch.testing.assert_close(seg_sum, torch.ones_like(seg_sum))
    out2, _ = ragged_attention(query, torch.cat(ks), torch.cat(vs), torch.cat(ps), meta, qpos, scaling)
    assert_rel(out2, ref)


@pytest.mark.parametrize("h,hkv", [(4, 4), (6, 2)])
def test_dense_layer_attention_with_empty_slots(h, hkv):
    """The dense path (empty slots on the left, logical positions) equals the same reference."""
    b, q, n, d = 2, 3, 30, 16
    lengths = [n if i < hkv else n - 7 for i in range(b * hkv)]
    query, ks, vs, ps, qpos, _ = make_case(b, h, hkv, lengths, q, seed=9)
    keys = torch.zeros(b, hkv, n, d, dtype=torch.float64)
    values = torch.zeros_like(keys)
    pos = torch.full((b, hkv, n), -1, dtype=torch.long)
    for s, (k, v, p) in enumerate(zip(ks, vs, ps, strict=True)):
        keys[s // hkv, s % hkv, n - len(k) :] = k
        values[s // hkv, s % hkv, n - len(k) :] = v
        pos[s // hkv, s % hkv, n - len(k) :] = p
    out, _ = dense_attention(query, keys, values, pos, qpos, 16**-0.5)
    assert_rel(out, dense_reference(query, ks, vs, ps, qpos, 16**-0.5))
    out_p, probs = dense_attention(query, keys, values, pos, qpos, 16**-0.5, return_probs=True)
    assert_rel(out_p, out.double())
    assert bool((probs[..., :7][(pos[:, :, None, :7] < 0).expand(b, hkv, 1, 7).repeat_interleave(h // hkv, 1)
                 .expand(b, h, q, 7)] == 0).all())  # fmt: skip


@pytest.mark.parametrize("shape", [(2, 3, 40), (1, 1, 7), (300,)])
@pytest.mark.parametrize("size", [0, 1, 5, "all"])
def test_kept_indices_are_nonzeros_without_the_read_back(shape, size):
    """Rows with exactly ``size`` True entries: the indices ``nonzero`` finds, in order."""
    n, rows = shape[-1], math.prod(shape[:-1])
    size = n if size == "all" else size
    g = torch.Generator().manual_seed(n + size)
    chosen = torch.stack([torch.randperm(n, generator=g)[:size] for _ in range(rows)])  # (rows, size)
    keep = torch.zeros(rows, n, dtype=torch.bool).scatter_(1, chosen, True).reshape(shape)
    expected = keep.reshape(rows, n).nonzero()[:, 1].reshape(*shape[:-1], size)
    assert torch.equal(kept_indices(keep, size), expected)


def test_keep_positions_takes_each_heads_entries_in_order():
    """A dense layer evicted by per-head positions holds, per head, what boolean indexing of its
    entries with the same kept set gives: keys, values, positions and scores, in order."""
    g = torch.Generator().manual_seed(3)
    b, hkv, n, d, size = 2, 3, 20, 4, 7
    layer = KVCakeLayer()
    layer.update(torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g))
    layer.scores = torch.rand(b, hkv, n, generator=g)
    keep = torch.zeros(b, hkv, n, dtype=torch.bool)
    for bi in range(b):
        for h in range(hkv):
            keep[bi, h, torch.randperm(n, generator=g)[:size]] = True
    before = {name: getattr(layer, name).clone() for name in ("keys", "values", "positions", "scores")}
    layer.keep_positions(kept_indices(keep, size), np.full((b, hkv), size))
    for name, full in before.items():
        expected = torch.stack(
            [torch.stack([full[bi, h][keep[bi, h]] for h in range(hkv)]) for bi in range(b)]
        )
        assert torch.equal(getattr(layer, name), expected), name
    assert not layer.plain and layer.counts.tolist() == [[size] * hkv] * b
