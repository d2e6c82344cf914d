"""CriticalKV's value norms computed only where they can matter (``Critical.value_norms``): the
bounds hold, and the kept sets equal those of the full computation (``projected_value_norms``),
on random inputs and through the cache, per-layer, head-wise and cascading; DefensiveKV's
head-normalised norms (``value_norm="heads"``) the same way."""

from __future__ import annotations

import pytest
import torch

from kvcake import make_method, pending_norms
from kvcake.scorers.defensive import MARK
from kvcake.selectors import SelectionInputs, TopK, projected_value_norms
from kvcake.selectors.critical import Critical
from kvcake.selectors.value_norms import projected_value_norm_bounds
from shared_checks import prefill, prompt


def _case(seed: int, b=2, h=6, hkv=2, s=300, d=16, hidden=48, window=8, pad=5):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(b, hkv, s, d, generator=g)
    o_weight = torch.randn(hidden, h * d, generator=g) / d**0.5
    scores = torch.exp(3 * torch.randn(b, hkv, s, generator=g))  # heavy-tailed, like attention
    scores[..., -window:] = float("inf")
    scores[1, :, :pad] = float("-inf")  # left padding in the second sequence
    counts = torch.randint(window, 80, (b, hkv), generator=g)  # ragged: every head its own count
    return values, o_weight, h, scores, counts


def test_bounds_hold():
    values, o_weight, h, _, _ = _case(0)
    exact = projected_value_norms(values, o_weight, h)
    low, high = projected_value_norm_bounds(values, o_weight, h)
    assert bool((low <= exact * (1 + 1e-5)).all()) and bool((exact <= high * (1 + 1e-5)).all())
    assert float((high / low).max()) == pytest.approx(48**0.5)
    # sign vectors from some of the values themselves: a tighter lower bound, still below the norm
    signed, high2 = projected_value_norm_bounds(values, o_weight, h, values[:, :, :16])
    assert torch.equal(high2, high)
    assert bool((signed >= low).all()) and bool((signed <= exact * (1 + 1e-5)).all())
    assert float((exact / signed).median()) < 0.5 * float((exact / low).median())


@pytest.mark.parametrize("first", ["ratio", "kvpress"])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("seed", range(6))
def test_same_kept_set_as_every_norm(seed, alpha, first):
    values, o_weight, h, scores, counts = _case(seed)
    sel = Critical(alpha=alpha, first=first)
    full = projected_value_norms(values, o_weight, h)
    pruned = sel.value_norms(values, o_weight, h, scores, counts)
    keep = sel.select(SelectionInputs(scores, counts, full))
    assert torch.equal(sel.select(SelectionInputs(scores, counts, pruned)), keep)
    pins = torch.tensor([30, 12])  # Ada-KV's safeguard (kvpress's first stage keeps them): within the top b
    pinned = sel.select(SelectionInputs(scores, counts, full, pins))
    assert torch.equal(sel.select(SelectionInputs(scores, counts, pruned, pins)), pinned)
    prefix_kept = keep & torch.isfinite(scores)
    assert torch.equal(pruned[prefix_kept], full[prefix_kept])  # what is kept has its exact norm
    # a cascade's later, smaller counts choose among the kept entries: still the same choice
    smaller = (counts * 2) // 3
    sub = torch.where(keep, scores, torch.full_like(scores, float("-inf")))
    assert torch.equal(
        sel.select(SelectionInputs(sub, smaller, pruned)), sel.select(SelectionInputs(sub, smaller, full))
    )


def _attention_like(scores: torch.Tensor, seed: int, marks: bool, floor: bool) -> torch.Tensor:
    """DefensiveKV-like scores: at most 1 on the prefix, optionally floored at the mean (a flat
    tail of equal scores, decided by the value norms alone) and with a marked first stage (+MARK,
    ``DefensiveScorer.critical_mass``)."""
    prefix = torch.isfinite(scores)
    probs = torch.where(prefix, scores / scores[prefix].max(), scores)
    if floor:
        probs = torch.where(prefix, probs.clamp(min=float(probs[prefix].mean())), probs)
    if not marks:
        return probs
    g = torch.Generator().manual_seed(seed)
    marked = prefix & (torch.rand(scores.shape, generator=g) < 0.03)
    return torch.where(marked, probs + MARK, probs)


@pytest.mark.parametrize("seed", range(8))
def test_head_normalised_norms_keep_the_same_set(seed, monkeypatch):
    """``value_norm="heads"`` (DefensiveKV): norms only where a head can keep the entry, each
    computed position exact for every head (so the shares are), the same kept sets, also for a
    cascade's later, smaller counts. The pruning runs whatever the first set's width (these
    prompts are short: their first sets are wide)."""
    from kvcake.selectors import critical

    monkeypatch.setattr(critical, "_ALL_NORMS_SHARE", 1.0)
    values, o_weight, h, scores, counts = _case(seed, s=600)
    scores = _attention_like(scores, seed, marks=seed % 2 == 1, floor=seed >= 4)
    sel = Critical(first="marked", value_norm="heads")
    full = sel.prepare_norms(projected_value_norms(values, o_weight, h))
    pruned = sel.prepare_norms(sel.value_norms(values, o_weight, h, scores, counts))
    keep = sel.select(SelectionInputs(scores, counts, full))
    assert torch.equal(sel.select(SelectionInputs(scores, counts, pruned)), keep)
    prefix_kept = keep & torch.isfinite(scores)
    assert torch.equal(pruned[prefix_kept], full[prefix_kept])
    smaller = (counts * 2) // 3
    sub = torch.where(keep, scores, torch.full_like(scores, float("-inf")))
    assert torch.equal(
        sel.select(SelectionInputs(sub, smaller, pruned)), sel.select(SelectionInputs(sub, smaller, full))
    )
    if seed < 4:  # a flat tail of random values is decided by nearly every norm
        assert float((pruned > 0).float().mean()) < 0.4, "most norms skipped"


@pytest.mark.parametrize("seed", range(4))
def test_a_wide_first_set_computes_every_norm_at_once(seed, monkeypatch):
    """``value_norm="heads"``: where the positions of every head's top ``2b`` cover a quarter of the
    prompt or more, the norms are computed once for every position (no bounds, no second set) and
    are the reference's; where they cover less, only the pruned sets are computed."""
    from kvcake.selectors import critical

    calls = []
    every = critical.projected_value_norms

    def counted(values, o_weight, num_heads):
        calls.append(values.shape[2])
        return every(values, o_weight, num_heads)

    monkeypatch.setattr(critical, "projected_value_norms", counted)
    sel = Critical(first="marked", value_norm="heads")
    values, o_weight, h, scores, counts = _case(seed, s=600)
    scores = _attention_like(scores, seed, marks=True, floor=False)
    got = sel.value_norms(values, o_weight, h, scores, counts)
    assert calls == [600] and torch.equal(got, every(values, o_weight, h))
    calls.clear()
    values, o_weight, h, scores, counts = _case(seed, s=3000)  # counts < 80: first sets of < 480
    scores = _attention_like(scores, seed, marks=True, floor=False)
    got = sel.value_norms(values, o_weight, h, scores, counts)
    assert calls and max(calls) < 750 and float((got > 0).float().mean()) < 0.25


@pytest.mark.parametrize("seed", range(4))
def test_one_kv_head_shares_need_no_norms(seed, monkeypatch):
    """``value_norm="heads"`` on a layer of one KV head (multi-query, as Gemma-3-270M's; a latent
    layer): each entry's norm over the heads' sum is 1, so none is computed (no projection, no
    bound), and the shares, kept sets and a cascade's later choices are the reference's, bit for bit;
    a zero value's share stays 0, as the reference's 0 / 0 guarded."""
    from kvcake.selectors import critical

    values, o_weight, h, scores, counts = _case(seed, hkv=1, s=600)
    values[0, 0, 10] = 0.0
    scores = _attention_like(scores, seed, marks=seed % 2 == 1, floor=seed >= 2)
    sel = Critical(first="marked", value_norm="heads")
    full = sel.prepare_norms(projected_value_norms(values, o_weight, h))

    def refused(*args, **kwargs):
        raise AssertionError("a norm was computed")

    monkeypatch.setattr(critical, "projected_value_norms", refused)
    monkeypatch.setattr(critical, "projected_value_norm_bounds", refused)
    got = sel.prepare_norms(sel.value_norms(values, o_weight, h, scores, counts))
    assert torch.equal(got, full) and float(full[0, 0, 10]) == 0.0
    keep = sel.select(SelectionInputs(scores, counts, full))
    assert torch.equal(sel.select(SelectionInputs(scores, counts, got)), keep)
    raw = Critical(first="marked").value_norms  # CriticalKV's own norms still differ by entry
    with pytest.raises(AssertionError, match="a norm was computed"):
        raw(values, o_weight, h, scores, counts)


def test_most_norms_are_skipped_on_heavy_tails():
    values, o_weight, h, scores, counts = _case(1, s=2000)
    pruned = Critical().value_norms(values, o_weight, h, scores, counts)
    computed = float((pruned > 0).float().mean())
    assert computed < 0.5, f"{computed:.0%} of the norms computed"


@pytest.mark.parametrize(
    ("spec", "pins"),
    [("critical-adakv,heads.safeguard=kvpress,select.first=kvpress", 8), ("critical-adakv,select.first=kvpress", 14),
     ("critical-adakv", None), ("criticalkv,select.first=kvpress", None)],
)  # fmt: skip
def test_the_cache_hands_the_pins_to_the_selection(tiny_llama, monkeypatch, spec, pins):
    """kvpress's first stage takes Ada-KV's pinned entries from the cache at each eviction's budget
    (80 entries, a window of 8: kvpress pins 16 - 8, the paper floor(0.2 x 72)); the paper's first
    stage and uniform heads take none."""
    seen, select = [], Critical.select

    def recording(self, inp):
        seen.append(inp.pinned)
        return select(self, inp)

    monkeypatch.setattr(Critical, "select", recording)
    prefill(tiny_llama, prompt(300, seed=3), make_method(spec, budget=80, window=8))
    assert seen and all((p is None) if pins is None else p.tolist() == [pins] for p in seen)


def test_a_cascade_refuses_pins_in_the_first_stage():
    """Pins follow the layer's budget, so with them a head's second stage can grow while its count
    shrinks: a cascade's kept sets would not nest (the property test found such a case), so
    ``select.first=kvpress`` over Ada-KV is refused there and taken one-shot or over uniform heads."""
    with pytest.raises(
        ValueError, match="cascade's stages would not keep nested sets.*layers.cascading=false"
    ):
        make_method("layers=cake,heads=adakv,score=cake,select=critical,select.first=kvpress", budget=64)
    with pytest.raises(ValueError, match="nested"):
        make_method("layer-defensivekv,select.first=kvpress", budget=64)
    for ok in ("layers=cake,heads=adakv,score=cake,select=critical,select.first=kvpress,layers.cascading=false",
               "layers=cake,score=cake,select=critical,select.first=kvpress", "critical-adakv,select.first=kvpress"):  # fmt: skip
        make_method(ok, budget=64)


@pytest.mark.parametrize(
    "spec",
    ["criticalkv", "critical-adakv", "critical-adakv,heads.safeguard=kvpress,select.first=kvpress",
     "layers=cake,heads=uniform,score=cake,select=critical",
     "layers=cake,heads=adakv,score=cake,select=critical", "layers=pyramid,heads=adakv,score=snapkv,select=critical",
     "defensivekv", "layer-defensivekv"],
)  # fmt: skip
@pytest.mark.parametrize("kv_heads", [2, 1])  # GQA, and multi-query (DefensiveKV's shares all 1)
def test_cache_keeps_the_same_entries(make_tiny_llama, monkeypatch, spec, kv_heads):
    model = make_tiny_llama(num_key_value_heads=kv_heads)
    ids = prompt(300, seed=3)
    method = make_method(spec, budget=40, window=8)
    monkeypatch.setattr(pending_norms, "PRUNED", False)
    ref, ref_logits = prefill(model, ids, method)
    monkeypatch.setattr(pending_norms, "PRUNED", True)
    got, logits = prefill(model, ids, method)
    assert torch.equal(logits, ref_logits)
    for a, b in zip(got.layers, ref.layers, strict=True):
        assert torch.equal(a.padded_positions(), b.padded_positions())
        assert torch.equal(a.keys, b.keys)


def test_half_inputs_on_the_float32_product_route(monkeypatch):
    """The CUDA route for bf16/fp16 values and weight (``kvcake.matmul``: the inputs multiplied as
    they are, float32 products) run here with its kernel emulated: the norms equal the float32
    route's on the same half-precision inputs up to summation order, in every chunk and with GQA
    groups and a batch of 2. tests/cuda runs the kernel."""
    from kvcake.selectors import value_norms

    values, o_weight, h, _, _ = _case(3, s=2 * value_norms._NORM_CHUNK + 50)
    values, o_weight = values.to(torch.bfloat16), o_weight.to(torch.bfloat16)
    ref = projected_value_norms(values, o_weight, h)  # the CPU: float32 copies
    calls = []

    def emulated(a, b, out, alpha=1.0):
        assert a.dtype == b.dtype == torch.bfloat16 and out.dtype == torch.float32
        calls.append(a.shape[1])
        return torch.mul(torch.bmm(a.float(), b.float()), alpha, out=out)

    monkeypatch.setattr(value_norms, "half_matmuls", lambda x: True)
    monkeypatch.setattr(value_norms, "matmul_f32", emulated)
    got = projected_value_norms(values, o_weight, h)
    assert calls == [value_norms._NORM_CHUNK, value_norms._NORM_CHUNK, 50]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "selector", [Critical(first="marked", value_norm="heads"), TopK()], ids=["marked", "topk"]
)
def test_rank_order_heads_every_smaller_selection(seed, selector):
    """``Selector.rank_order``: with ``keep`` what ``select`` keeps at ``counts``, the first ``c`` of
    each head's order are what ``select`` keeps of those entries with ``c <= counts`` per head (a
    cascade's later stage), ties, marks, a floored tail and left padding included."""
    values, o_weight, h, scores, counts = _case(seed, s=400)
    scores = _attention_like(scores, seed, marks=True, floor=seed % 2 == 0)
    norms = selector.prepare_norms(projected_value_norms(values, o_weight, h))
    keep = selector.select(SelectionInputs(scores, counts, norms))
    order = selector.rank_order(SelectionInputs(scores, counts, norms), keep)
    held = torch.where(keep, scores, torch.full_like(scores, float("-inf")))
    g = torch.Generator().manual_seed(seed)
    window = (scores == float("inf")).sum(-1)
    for _ in range(4):
        c = window + (torch.rand(counts.shape, generator=g) * (counts - window + 1)).long()
        again = selector.select(SelectionInputs(held, c, norms))
        first = torch.zeros_like(keep).scatter_(
            -1, order, torch.arange(keep.shape[-1]).expand_as(order) < c[..., None]
        )
        assert torch.equal(first, again)


def test_ratio_first_stage_has_no_rank_order():
    values, o_weight, h, scores, counts = _case(0)
    inp = SelectionInputs(scores, counts, projected_value_norms(values, o_weight, h))
    assert Critical().rank_order(inp, Critical().select(inp)) is None


@pytest.mark.parametrize(
    ("spec", "waits"),
    [("criticalkv", True), ("layers=pyramid,heads=uniform,score=snapkv,select=critical", True),
     ("critical-adakv", False), ("defensivekv", False), ("layer-defensivekv", False)],
)  # fmt: skip
def test_norms_read_a_layer_later_keep_the_same_entries(tiny_llama, monkeypatch, spec, waits):
    """The size of CriticalKV's second candidate set read at the next layer's update
    (``pending_norms.DEFERRED``) where the stage runs as its layer is scored, every layer but the
    last, on the route a GPU takes: the same entries at every stage, the same logits; the prefill
    peak one layer's prompt higher (the layer is evicted at the next update, once its keys and
    values exist). Stages that wait for the next update themselves read at once (left pending
    further, two full layers would be held). On a CPU nothing is left pending."""
    from kvcake import devices

    ids = prompt(300, seed=3)
    method = make_method(spec, budget=40, window=8)
    monkeypatch.setattr(devices, "CPU_ROUTES", False)
    monkeypatch.setattr(pending_norms, "DEFERRED", False)
    ref, ref_logits = prefill(tiny_llama, ids, method, record=True, static=False)
    monkeypatch.setattr(pending_norms, "DEFERRED", True)
    left, begin = [], pending_norms.begin

    def counted(cache, *args):
        out = begin(cache, *args)
        left.append(out is None)  # the eviction left pending
        return out

    monkeypatch.setattr(pending_norms, "begin", counted)
    got, logits = prefill(tiny_llama, ids, method, record=True, static=False)
    assert len(left) == len(got.compressed)
    assert sum(left) == (len(got.compressed) - 1 if waits else 0)
    assert torch.equal(logits, ref_logits)
    assert len(got.history) == len(ref.history)
    for (sa, la, pa), (sb, lb, pb) in zip(got.history, ref.history, strict=True):
        assert (sa, la) == (sb, lb) and torch.equal(pa, pb)
    if waits:
        assert got.prefill_peak_kv_bytes > ref.prefill_peak_kv_bytes
    else:
        assert got.prefill_peak_kv_bytes == ref.prefill_peak_kv_bytes
    assert got.pending_norms is None and all(got.layers[lid].norms is None for lid in got.compressed)
    monkeypatch.setattr(devices, "CPU_ROUTES", True)
    left.clear()
    on_cpu, cpu_logits = prefill(tiny_llama, ids, method, record=True, static=False)
    assert not any(left) and torch.equal(cpu_logits, ref_logits)
    assert [(s, lid) for s, lid, _ in on_cpu.history] == [(s, lid) for s, lid, _ in ref.history]
