"""KVCakeCache on tiny random models: the guarantees of the foundation issue."""

import inspect

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import kvcake
from kvcake import KVCakeCache, make_method
from kvcake.adapters import with_cache
from kvcake.step import GROWTH
from shared_checks import assert_batch_matches_each_alone, prefill, prompt, single_step_logits


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize(
    "name", ["cake", "snapkv", "adakv", "cake-adakv", "h2o", "criticalkv", "layer-defensivekv"]
)
def test_budget_covering_prompt_is_bit_identical(make_tiny_llama, impl, kv_heads, name):
    model = make_tiny_llama(num_key_value_heads=kv_heads, attn_implementation=impl)
    ids = prompt(90)
    with torch.no_grad():
        full_logits = model(ids).logits
        full_out = model.generate(ids, max_new_tokens=12, do_sample=False)
    cache, logits = prefill(model, ids, make_method(name, budget=90))
    assert torch.equal(logits, full_logits)
    out, cache = kvcake.generate(model, ids, name, budget=200, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, full_out)
    assert all(layer.plain for layer in cache.layers)


@pytest.mark.parametrize("select", ["topk", "critical"])
@pytest.mark.parametrize("heads", ["uniform", "adakv"])
def test_cascade_equals_one_shot_and_only_shrinks(tiny_llama, heads, select):
    """Theorem 1 and Proposition 1 of CAKE, for every head allocator and selector."""
    ids = prompt(300, seed=1)
    spec = f"layers=cake,heads={heads},score=cake,select={select}"
    casc, _ = prefill(tiny_llama, ids, make_method(spec, budget=64, window=8), record=True)
    once, _ = prefill(tiny_llama, ids, make_method(spec + ",layers.cascading=false", budget=64, window=8))
    assert torch.equal(casc.budgets, once.budgets)
    for a, b in zip(casc.layers, once.layers, strict=False):
        assert torch.equal(a.padded_positions(), b.padded_positions()), "Theorem 1"
        assert torch.equal(a.keys, b.keys)
    # Proposition 1: a layer's kept set at stage m+1 is a subset of the one at stage m
    by_layer: dict[int, list[torch.Tensor]] = {}
    for _, lid, pos in casc.history:
        by_layer.setdefault(lid, []).append(pos)
    assert max(len(v) for v in by_layer.values()) > 1, "the cascade re-evicted some layer"
    for seq in by_layer.values():
        for before, after in zip(seq, seq[1:], strict=False):
            for h in range(before.shape[1]):
                a = set(after[0, h][after[0, h] >= 0].tolist())
                assert a <= set(before[0, h][before[0, h] >= 0].tolist())


def test_budgets_sum_exactly_and_window_kept(tiny_llama):
    ids = prompt(257, seed=2)
    cache, _ = prefill(tiny_llama, ids, make_method("cake", budget=50, window=16))
    counts = cache.layer_counts()  # (B, L, H_kv)
    assert int(counts[0, :, 0].sum()) == 50 * 4
    assert torch.equal(cache.budgets[0], torch.as_tensor(counts[0, :, 0]))
    for layer in cache.layers:
        pos = layer.padded_positions()[0]
        for h in range(pos.shape[0]):
            assert set(range(257 - 16, 257)) <= set(pos[h].tolist())


def test_cascade_peak_bound(tiny_llama):
    s, budget, window = 400, 48, 8
    ids = prompt(s, seed=3)
    casc, _ = prefill(tiny_llama, ids, make_method("cake", budget=budget, window=window))
    once, _ = prefill(tiny_llama, ids, make_method("cake-oneshot", budget=budget, window=window))
    entry = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head_dim 16, float32
    layers = 4
    bound = (budget * layers + s + layers) * entry  # total budget + one full layer (+ ceil slack)
    assert casc.prefill_peak_kv_bytes <= bound
    assert once.prefill_peak_kv_bytes == s * layers * entry > bound
    # the kept entries, plus the spare slot per head that static decode=fixed storage reserves
    assert casc.kv_bytes() == once.kv_bytes() == (budget + 1) * layers * entry


@pytest.mark.parametrize("cpu_routes", [True, False], ids=["cpu", "gpu-route"])
@pytest.mark.parametrize("preset", ["cake", "adakv", "criticalkv", "layer-defensivekv", "snapkv"])
def test_the_prefill_peak_is_the_live_peak(tiny_llama, monkeypatch, preset, cpu_routes):
    """The counter against a slow reference: at each update, what the layers hold plus the keys and
    values just computed (alive, about to be stored). A stage or eviction that waits for the next
    layer's update (cascade.PendingStage, pending_norms) holds its layer's whole prompt beside them:
    the counter, updated when a layer stored or evicted, missed that moment (about one layer's
    prompt under the live peak), and on a CPU, where the host does not fall behind the device,
    nothing waits any more, so the cascade's peak is the total budget plus one layer's prompt. The
    route a GPU takes (``devices.CPU_ROUTES`` off) still waits, and its counter says what that costs."""
    from kvcake import devices

    monkeypatch.setattr(devices, "CPU_ROUTES", cpu_routes)
    s, budget, layers = 400, 48, 4
    entry = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head_dim 16, float32
    cache = KVCakeCache(tiny_llama, make_method(preset, budget=budget, window=8))
    live, update = [], cache.update

    def counted(keys, values, layer_idx, *args, **kwargs):
        live.append(
            cache.kv_bytes() + keys.numel() * keys.element_size() + values.numel() * values.element_size()
        )
        return update(keys, values, layer_idx, *args, **kwargs)

    cache.update = counted
    with kvcake.enable(tiny_llama), torch.no_grad():
        tiny_llama(prompt(s, seed=3), **with_cache(tiny_llama, cache))
    assert cache.prefill_peak_kv_bytes == max(live)
    if cpu_routes or preset == "snapkv":  # nothing waits: the cascade's bound (+ ceil slack per head)
        assert cache.prefill_peak_kv_bytes <= (budget * layers + s + 2 * layers) * entry
    else:  # a layer's whole prompt more
        assert cache.prefill_peak_kv_bytes > (budget * layers + s + 2 * layers) * entry


@pytest.mark.parametrize("name", ["cake", "h2o", "tova", "streamingllm", "cake-adakv"])
def test_decoding_keeps_every_layer_at_its_budget(tiny_llama, name):
    ids = prompt(200, seed=4)
    ctx = kvcake.compress(tiny_llama, ids, name, budget=40, window=8)
    cache = ctx.fork()
    budget = cache.decode_budget.copy()
    tok = ctx.logits.argmax(-1, keepdim=True)
    with kvcake.enable(tiny_llama), torch.no_grad():
        for _ in range(50):
            out = tiny_llama(tok, **with_cache(tiny_llama, cache))
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            assert np.array_equal(cache.layer_counts(), budget)
    assert cache.get_seq_length() == 250
    assert all(cache.layers[lid].static == "fixed" for lid in cache.compressed)
    # the budgets, plus the spare slot per head of static storage (capacity is memory) and the one
    # always-empty slot a static ragged layer keeps for its padded view
    ragged = sum(cache.layers[lid].layout == "ragged" for lid in cache.compressed)
    assert cache.kv_bytes() == (int(budget.sum()) + budget.size + ragged) * 2 * 16 * 4


@pytest.mark.parametrize("name", ["snapkv", "cake,decode=none", "adakv", "critical-adakv"])
def test_chunk_equals_one_token_at_a_time(tiny_llama, name):
    ids = prompt(160, seed=5)
    follow = prompt(12, seed=6)
    ctx = kvcake.compress(tiny_llama, ids, name, budget=48, window=8)
    chunk_logits = ctx.forward(follow)[0]  # (12, vocab)
    steps = single_step_logits(tiny_llama, ctx.fork(), follow)
    torch.testing.assert_close(steps, chunk_logits, atol=1e-5, rtol=1e-5)
    # through generate: the continuation of the compressed context with the follow-up as prompt
    gen = ctx.generate(follow, max_new_tokens=5, do_sample=False)
    cache = ctx.fork()
    tok_ids = []
    with kvcake.enable(tiny_llama), torch.no_grad():
        logits = tiny_llama(follow, **with_cache(tiny_llama, cache)).logits[:, -1]
        for _ in range(5):
            tok = logits.argmax(-1, keepdim=True)
            tok_ids.append(tok)
            logits = tiny_llama(tok, **with_cache(tiny_llama, cache)).logits[:, -1]
    assert torch.equal(gen, torch.cat(tok_ids, 1))


def test_positions_stay_logical(tiny_llama):
    """After compression, the next token is rotated at the prompt's length: its logits equal a
    forward with explicit position_ids = S (and differ from the physical length)."""
    ids = prompt(150, seed=7)
    ctx = kvcake.compress(tiny_llama, ids, "snapkv", budget=40, window=8)
    nxt = torch.tensor([[5]])
    implicit = ctx.forward(nxt)
    with kvcake.enable(tiny_llama), torch.no_grad():
        explicit = tiny_llama(
            nxt, position_ids=torch.tensor([[150]]), **with_cache(tiny_llama, ctx.fork())
        ).logits
        physical = tiny_llama(
            nxt, position_ids=torch.tensor([[40]]), **with_cache(tiny_llama, ctx.fork())
        ).logits
    assert ctx.cache.get_seq_length() == 150
    assert torch.equal(implicit, explicit)
    assert not torch.allclose(implicit, physical)


@pytest.mark.parametrize("name", ["cake", "snapkv", "adakv", "cake-adakv", "h2o"])
def test_batch_matches_each_sequence_alone(tiny_llama, name):
    a, b = prompt(180, seed=8)[0], prompt(130, seed=9)[0]
    assert_batch_matches_each_alone(
        tiny_llama, name, a, b, 50, ratio=0.3, window=8, max_new_tokens=8, do_sample=False, pad_token_id=0
    )


def test_kvcake_attention_without_our_cache_is_stock(tiny_llama):
    ids = prompt(64, seed=10)
    with torch.no_grad():
        ref = tiny_llama(ids).logits
        with kvcake.enable(tiny_llama):
            got = tiny_llama(ids).logits
    assert torch.equal(ref, got)
    assert tiny_llama.config._attn_implementation == "sdpa"


def test_cache_without_kvcake_attention_raises(tiny_llama):
    cache = KVCakeCache(tiny_llama, "cake", budget=32)
    with pytest.raises(RuntimeError, match="kvcake.enable"), torch.no_grad():
        tiny_llama(prompt(64), **with_cache(tiny_llama, cache))


def test_attention_restored_after_error(tiny_llama):
    cache = KVCakeCache(tiny_llama, "cake", budget=32)
    with pytest.raises(ValueError), kvcake.enable(tiny_llama):
        raise ValueError("boom")
    assert tiny_llama.config._attn_implementation == "sdpa"
    del cache


def test_ragged_bytes_are_the_sum_of_head_budgets(tiny_mha):
    """Ada-KV's heads hold different counts; the ragged layer (dynamic layout) stores exactly their sum, less than
    a layout that pads every head to the longest one (what masking-based libraries hold)."""
    ids = prompt(300, seed=11)
    cache, _ = prefill(tiny_mha, ids, make_method("adakv", budget=48, window=8), static=False)
    counts = cache.layer_counts()[0]  # (L, H_kv)
    assert (counts.max(1) > counts.min(1)).any(), "heads differ"
    assert (counts.sum(1) == 48 * 4).all(), "each layer's total is exact"
    entry = 2 * 16 * 4
    assert cache.kv_bytes() == int(counts.sum()) * entry
    padded = int(counts.max(1).sum()) * 4 * entry
    assert cache.kv_bytes() < padded
    for layer in cache.layers:
        assert layer.layout == "ragged" and layer.keys.shape == (int(layer.counts.sum()), 16)
    # static storage (the default) reserves room per head on top (capacity is memory): adakv decodes
    # with decode=none, so GROWTH slots per head for the tokens to come
    method = make_method("adakv", budget=48, window=8)
    static, _ = prefill(tiny_mha, ids, method)
    assert (static.layer_counts() == cache.layer_counts()).all()
    reserve = 1 if method.decode == "fixed" else GROWTH
    empty = len(static.layers)  # the one always-empty slot per static ragged layer (its padded view)
    assert static.kv_bytes() == (int(counts.sum()) + reserve * counts.size + empty) * entry


@pytest.mark.parametrize("name", ["h2o", "tova", "cake", "criticalkv", "adakv"])
def test_plain_layers_decode_through_the_model_kernel(make_tiny_llama, name):
    """While nothing is evicted, every decoding step's logits equal a DynamicCache's bit for bit,
    in bfloat16 too, also for the presets whose scorer reads each step's attention (h2o, tova,
    cake): the output comes from the model's own kernel and the probabilities are computed beside
    it. (A float32 attention in their place rounded otherwise and flipped a near-tied greedy token
    of h2o on an H100, 2026-11-26.)"""
    model = make_tiny_llama(num_key_value_heads=2).to(torch.bfloat16)
    ids, follow = prompt(60, seed=5), prompt(6, seed=6)
    cache, logits = prefill(model, ids, make_method(name, budget=80, window=8))
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        ref = model(ids, **with_cache(model, full)).logits
        ref_steps = torch.stack(
            [
                model(follow[:, i : i + 1], **with_cache(model, full)).logits[0, -1]
                for i in range(follow.shape[1])
            ]
        )
    assert torch.equal(logits, ref)
    assert torch.equal(single_step_logits(model, cache, follow), ref_steps)
    assert all(layer.plain for layer in cache.layers)


@pytest.mark.parametrize("name", [p for p in kvcake.PRESETS if not make_method(p, budget=64).heads.ragged])
def test_host_counts_equal_the_scores_counts(tiny_llama, name, monkeypatch):
    """Uniform heads' counts come from the host (``head_counts.dense_counts``: no read of the
    device per cascade stage); at every eviction of a left-padded batch's cascade they equal the
    count of entries scored above -inf, capped by the budget (``dense_counts_reference``)."""
    from kvcake import cascade, head_counts

    checked, host_counts = [], cascade.dense_counts

    def both(layer, budget, lengths):
        host = host_counts(layer, budget, lengths)
        ref = head_counts.dense_counts_reference(layer.padded(layer.scores, float("-inf")), budget)
        assert np.array_equal(host, ref.numpy()), (host, ref)
        checked.append(host)
        return host

    monkeypatch.setattr(cascade, "dense_counts", both)
    a, b = prompt(200, seed=7)[0], prompt(150, seed=8)[0]
    assert_batch_matches_each_alone(tiny_llama, name, a, b, 50, budget=40, window=8, max_new_tokens=3,
                                    do_sample=False)  # fmt: skip
    assert len(checked) >= 3 * 4, "every layer of both runs and the batch counted on the host"


@pytest.mark.parametrize(
    ("name", "per_layer"),
    [
        ("cake", 0),
        ("cake-adakv", 0),
        ("snapkv", 0),
        ("adakv", 0),
        ("h2o", 1),
        ("criticalkv", 1),
        ("defensivekv", 3),
        ("layer-defensivekv", 1),
    ],
)
def test_prefill_synchronises_a_few_times_per_prompt(name, per_layer, monkeypatch):
    """ATen ops that wait for a GPU (a value read, ``nonzero``, indexing with a boolean mask),
    counted over one 16-layer prefill on the route a GPU takes (``devices.CPU_ROUTES`` off: the
    CPU-only paths check host values where a GPU would wait): a few per prompt (the sequences'
    lengths and budgets), none per eviction (kept entries are gathered by indices whose number
    the host knows, ``kept_indices``); CriticalKV sizes a candidate set once a layer, DefensiveKV
    three times, Layer-DefensiveKV once in most layers here (up to three, as DefensiveKV; its
    large early budgets compute every norm after the first), and h2o's once a layer is a host
    tensor's. The
    evictions indexed with boolean masks before: cake synchronised 800 times here (1645 at 32
    layers, ``scripts/prefill_counts.py``)."""
    from kvcake import devices
    from kvcake.bench.step_counts import SYNCING, CountOps, tiny_llama

    monkeypatch.setattr(devices, "CPU_ROUTES", False)
    layers = 16
    model = tiny_llama(layers)
    cache = KVCakeCache(model, make_method(name, budget=32, window=8))
    with kvcake.enable(model), torch.no_grad(), CountOps() as counter:
        model(prompt(300, seed=3), **with_cache(model, cache))
    syncs = {k: v for k, v in counter.ops.items() if k in SYNCING}
    assert sum(syncs.values()) <= per_layer * layers + 5, syncs


@pytest.mark.parametrize(
    ("name", "per_layer"),
    [
        ("cake", 0),
        ("cake-oneshot", 0),
        ("criticalkv", 0),
        ("pyramidkv", 0),
        ("snapkv", 0),
        ("adakv", 0),
        ("cake-adakv", 0),
        ("critical-adakv", 1),
        ("defensivekv", 1),
        ("layer-defensivekv", 1),
    ],
)
def test_prefill_reads_the_device_a_few_times_per_layer(monkeypatch, name, per_layer):
    """On a GPU each read of a device value into Python drains the queue. A cascade re-evicts
    every layer seen so far at each stage (136 evictions at 16 layers): uniform heads' counts are
    host arithmetic there (``dense_counts``, on host tensors), head-wise ones are read back once a
    stage for all layers (``stage_head_counts``) on the device, and Ada-KV's are host arithmetic
    on each layer's score places (``AdaKV.places``), so the reads are a few per prompt plus, where
    a stage waits for the next update itself, CriticalKV's candidate-set sizes (one a layer);
    CAKE's statistics, Ada-KV's places, the global allocator's winners per layer
    (``GlobalAllocator.count_winners``, run when a layer is scored) and the candidate-set size of a
    stage run as its layer is scored are none (``devices.HostRead``, a copy waited for a layer
    later: cascade.PendingStage, pending_norms.PendingNorms), so ``cake``, ``adakv``,
    ``cake-adakv``, ``snapkv`` and ``criticalkv`` read a few times per prompt only. Counted
    with ``host_reads``, which sees every tensor's reads (``dense_counts`` reads host tensors only,
    so it is left out); the code before these changes read 3-10 times as often. The CPU-only
    routes' host checks (``devices.CPU_ROUTES``, free on a CPU) are off: the counts are a GPU's."""
    from kvcake import devices
    from kvcake.bench.step_counts import host_reads, tiny_llama

    monkeypatch.setattr(devices, "CPU_ROUTES", False)
    layers = 16
    model = tiny_llama(layers)
    cache = KVCakeCache(model, make_method(name, budget=32, window=8))
    with kvcake.enable(model), torch.no_grad(), host_reads() as reads:
        model(prompt(300, seed=3), **with_cache(model, cache))
    device = [(read, site) for read, site in reads if "(dense_counts)" not in site and read != "numpy"]
    assert len(device) <= per_layer * layers + 8, sorted(set(device))
    if not make_method(name, budget=32).heads.ragged:
        assert any("(dense_counts)" in site for _, site in reads), "the cascade's counts came from the host"


@pytest.mark.parametrize("host", [True, False])
@pytest.mark.parametrize("name", ["cake-adakv", "adakv"])
def test_head_wise_cascade_selects_a_stage_together(monkeypatch, name, host):
    """A stage of a head-wise cascade re-evicts every layer seen so far. Counted on the host
    (``head_counts.HOST_COUNTS``), Ada-KV's kept sets are never built: each layer's first eviction
    selects its heads' counts with the selector, and the later ones keep each head's first.
    Counted on the device (the reference, and tensor parallelism's route), with a top-k selector
    the Ada-KV kept set is the selection, and the layers of a stage are selected in one call
    (``head_counts._kept_together``, by layout: the stage's new layer is still dense): on a GPU
    its ~40 launches twice a stage, not once a layer; 31 calls for 16 layers where it was 136
    (and then a second ranking by the selector in each eviction). One-shot Ada-KV selects each
    layer once either way."""
    from kvcake import head_counts
    from kvcake.allocators import AdaKV
    from kvcake.bench.step_counts import tiny_llama

    monkeypatch.setattr(head_counts, "HOST_COUNTS", host)
    calls = []
    select = AdaKV.select

    def counted(self, scores, *args, **kwargs):
        calls.append(scores.shape[0])
        return select(self, scores, *args, **kwargs)

    monkeypatch.setattr(AdaKV, "select", counted)
    layers = 16
    model = tiny_llama(layers)
    cache = KVCakeCache(model, make_method(name, budget=32, window=8))
    with kvcake.enable(model), torch.no_grad():
        model(prompt(300, seed=3), **with_cache(model, cache))
    if host:
        assert calls == []
    elif name == "cake-adakv":  # stage g: its g evicted (ragged) layers together, its new one alone
        assert sum(calls) == layers * (layers + 1) // 2 and len(calls) <= 2 * layers, calls
    else:
        assert calls == [1] * layers


@pytest.mark.parametrize("name", ["cake", "snapkv"])
def test_uniform_eviction_takes_the_kept_positions(name):
    """A dense layer whose heads keep one count is evicted by the positions the selector ranks
    first (``Selector.select_indices``, one sort and its first n sorted back) and gathered
    (``KVCakeLayer.keep_positions``): about 20 ATen ops, where building the kept mask and then its
    indices took 35 (a cascade evicts every layer seen at every stage: 136 times at 16 layers, all
    but a layer's first by a copy of its ranked entries, next test)."""
    from kvcake import cascade
    from kvcake.bench.step_counts import CountOps, tiny_llama

    model = tiny_llama(16)
    cache = KVCakeCache(model, make_method(name, budget=32, window=8))
    per_eviction = []
    evict = cascade.evict_layer

    def counted(layer_idx, budget):
        with CountOps() as counter:
            evict(cache, layer_idx, budget)
        per_eviction.append(sum(counter.ops.values()))

    cache._evict_layer = counted
    with kvcake.enable(model), torch.no_grad():
        model(prompt(300, seed=3), **with_cache(model, cache))
    assert len(per_eviction) == (136 if name == "cake" else 16)
    assert max(per_eviction) <= 24, per_eviction


def test_cascade_keeps_a_layer_in_rank_order_between_stages():
    """After its first eviction a cascade keeps a dense layer in descending score order
    (``KVCakeLayer.ranked``), so each later stage keeps a copy of its first entries: no sort and
    no gather, 10 ATen ops (was 19; 119 of the 136 evictions of a 16-layer prefill). The end of
    prefill puts every layer back in position order, bit for bit what one-shot eviction keeps."""
    from kvcake import cascade
    from kvcake.bench.step_counts import CountOps, tiny_llama

    model = tiny_llama(16)
    ids = prompt(300, seed=3)
    cache = KVCakeCache(model, make_method("cake", budget=32, window=8))
    later = []
    evict = cascade.evict_layer

    def counted(layer_idx, budget):
        ranked = cache.layers[layer_idx].ranked
        with CountOps() as counter:
            evict(cache, layer_idx, budget)
        if ranked:
            later.append(counter.ops)

    cache._evict_layer = counted
    with kvcake.enable(model), torch.no_grad():
        model(ids, **with_cache(model, cache))
    assert len(later) == 119
    assert not any("aten.sort.stable" in ops or "aten.gather.default" in ops for ops in later)
    # .numpy() of the host counts dispatches aten.detach (one on torch 2.13, two on 2.7): not counted
    assert max(sum(n for op, n in ops.items() if op != "aten.detach.default") for ops in later) <= 10, later
    once, _ = prefill(model, ids, make_method("cake-oneshot", budget=32, window=8))
    for a, b in zip(cache.layers, once.layers, strict=True):
        assert not a.ranked
        assert torch.equal(a.positions, b.positions) and torch.equal(a.keys, b.keys)
        assert torch.equal(a.values, b.values)


def test_ranked_layer_takes_the_mask_path_in_position_order(tiny_llama, monkeypatch):
    """A left-padded batch whose sequences keep different counts at some stage leaves the ranked
    copies for the kept mask (heads of a layer then keep different numbers): the layer goes back
    to position order first, and the cascade still equals one-shot eviction."""
    from kvcake import cascade

    ids = prompt(300, seed=4, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :60] = 0  # the second sequence left-padded: its own budgets
    spec = "layers=cake,heads=uniform,score=cake,select=topk"
    calls = []  # where each layer went back to position order
    real = cascade.in_position_order

    def spy(layer):
        calls.append(inspect.stack()[1].function)
        real(layer)

    monkeypatch.setattr(cascade, "in_position_order", spy)
    casc, _ = prefill(tiny_llama, ids, make_method(spec, budget=40, window=8), mask=mask)
    once, _ = prefill(
        tiny_llama, ids, make_method(spec + ",layers.cascading=false", budget=40, window=8), mask=mask
    )
    assert "evict_layer" in calls, "a ranked layer met heads keeping different counts"
    assert torch.equal(casc.budgets, once.budgets)
    for a, b in zip(casc.layers, once.layers, strict=True):
        assert not a.ranked
        assert torch.equal(a.padded_positions(), b.padded_positions())
        assert torch.equal(a.keys, b.keys)


@pytest.mark.parametrize(
    ("spec", "ranked"),
    [("layer-defensivekv", True), ("cake-adakv", True), ("layers=cake,heads=adakv,score=snapkv,select=topk", True),
     ("layers=cake,heads=adakv,score=cake,select=critical", False)],
)  # fmt: skip
@pytest.mark.parametrize("padded", [False, True])
def test_ranked_ragged_layers_keep_what_selecting_again_keeps(tiny_llama, monkeypatch, spec, ranked, padded):
    """A cascade keeps a ragged layer in its selector's order after the first eviction
    (``Selector.rank_order``) and evicts it at later stages by keeping each head's first entries
    (``KVCakeLayer.keep_first``): the same kept sets at every stage as selecting again
    (``RANKED_RAGGED = False``), the same layers and logits at the end, back in position order.
    CriticalKV's ratio first stage has no such order (its kept sets are not nested): it selects."""
    from kvcake import cascade
    from kvcake.layer import KVCakeLayer

    ids = prompt(300, seed=5, batch=2 if padded else 1)
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[1, :70] = 0
    method = make_method(spec, budget=40, window=8)
    monkeypatch.setattr(cascade, "RANKED_RAGGED", False)
    ref, ref_logits = prefill(tiny_llama, ids, method, mask=mask, record=True)
    monkeypatch.setattr(cascade, "RANKED_RAGGED", True)
    firsts = []
    keep_first = KVCakeLayer.keep_first
    monkeypatch.setattr(KVCakeLayer, "keep_first", lambda self, c: firsts.append(1) or keep_first(self, c))
    got, logits = prefill(tiny_llama, ids, method, mask=mask, record=True)
    assert (len(firsts) > 0) == ranked
    assert torch.equal(logits, ref_logits)
    assert len(got.history) == len(ref.history) > len(got.compressed), "the cascade re-evicted layers"
    for (sa, la, pa), (sb, lb, pb) in zip(got.history, ref.history, strict=True):
        assert (sa, la) == (sb, lb)
        assert torch.equal(pa.sort(-1).values, pb.sort(-1).values), "the same kept set at every stage"
    for a, b in zip(got.layers, ref.layers, strict=True):
        assert not a.ranked and a.layout == b.layout
        for name in ("keys", "values", "positions"):
            assert torch.equal(getattr(a, name), getattr(b, name))


def test_keep_first_refuses_what_a_head_does_not_hold(tiny_llama):
    cache, _ = prefill(tiny_llama, prompt(200, seed=1), make_method("cake-adakv", budget=40, window=8))
    layer = cache.layers[0]
    with pytest.raises(ValueError, match="ranked ragged layer"):
        layer.keep_first(layer.counts)  # back in position order after prefill: not ranked


@pytest.mark.parametrize("name", ["cake", "cake-oneshot", "cake-adakv", "adakv"])
def test_cake_stage_runs_at_the_next_layers_update_before_its_keys(tiny_llama, name, monkeypatch):
    # the statistics' read (CAKE) and the score places' (Ada-KV's head counts on the host) are
    # waited for one layer later on the route a GPU takes, so that the host's stage overlaps work
    # it has queued (cascade.prefill_stage), at the cost of one layer's prompt held beside the
    # next layer's keys (test_the_prefill_peak_is_the_live_peak); the last layer's runs at once
    from kvcake import devices
    from kvcake.cache import KVCakeCache

    monkeypatch.setattr(devices, "CPU_ROUTES", False)  # on a CPU every stage runs as its layer is scored
    events = []
    update, wait = KVCakeCache.update, devices.HostRead.wait

    def recording_update(self, key_states, value_states, layer_idx, *args, **kwargs):
        events.append(("update", layer_idx, self.layers[layer_idx].is_initialized))
        return update(self, key_states, value_states, layer_idx, *args, **kwargs)

    def recording_wait(self):
        events.append(("read",))
        return wait(self)

    monkeypatch.setattr(KVCakeCache, "update", recording_update)
    monkeypatch.setattr(devices.HostRead, "wait", recording_wait)
    casc, _ = prefill(tiny_llama, prompt(300, seed=3), make_method(name, budget=48, window=8))
    updates = [e for e in events if e[0] == "update"]
    assert len(updates) == 4 and not any(e[2] for e in updates)  # one prompt, 4 layers
    # layer l's reads (l < 3) right after layer l+1's update began, before it appended; layer 3's
    # in its own stage, after its update
    method = make_method(name, budget=48)
    per = (method.layers.needs_preferences) + (method.heads.ragged)
    expected = [("update", 0)]
    for layer in range(1, 4):
        expected += [("update", layer)] + [("read",)] * per
    assert [e[:2] for e in events] == expected + [("read",)] * per
    assert casc.pending_stage is None and casc.prefilled
    assert len(casc.preferences) == (4 if method.layers.needs_preferences else 0)


@pytest.mark.parametrize("name", ["snapkv", "cake", "adakv", "critical-adakv"])
def test_a_context_compressed_alone_answers_a_batch_of_follow_ups(tiny_llama, name):
    """A document compressed once (batch 1) answers several follow-ups in one batch, each row what
    that follow-up alone gets; the context is unchanged. More follow-ups than a context of several
    sequences has are refused with the fix."""
    ctx = kvcake.compress(tiny_llama, prompt(160, seed=5), name, budget=48, window=8)
    kept = [layer.padded_positions().clone() for layer in ctx.cache.layers]
    a, b, c = prompt(12, seed=6), prompt(12, seed=7), prompt(8, seed=8)
    alone = [ctx.generate(q, max_new_tokens=5, do_sample=False) for q in (a, b)]
    both = ctx.generate(torch.cat([a, b]), max_new_tokens=5, do_sample=False)
    assert torch.equal(both, torch.cat(alone[:2]))
    ones = torch.ones(2, 12, dtype=torch.long)  # a tokenizer's mask of follow-ups of one length
    assert torch.equal(
        ctx.generate(torch.cat([b, a]), attention_mask=ones, max_new_tokens=5), torch.cat(alone[1::-1])
    )
    torch.testing.assert_close(ctx.forward(torch.cat([a, b])), torch.cat([ctx.forward(a), ctx.forward(b)]))
    assert all(
        torch.equal(layer.padded_positions(), k) for layer, k in zip(ctx.cache.layers, kept, strict=True)
    )
    padded, mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), c], 1), ones.clone()
    mask[1, :4] = 0  # a shorter follow-up, left-padded: each row still its own (test_padded_follow_ups.py)
    mixed = ctx.generate(torch.cat([a, padded]), attention_mask=mask, max_new_tokens=5, min_new_tokens=5)
    assert torch.equal(mixed, torch.cat([alone[0], ctx.generate(c, max_new_tokens=5, min_new_tokens=5)]))
    with pytest.raises(
        ValueError, match=r"attention_mask is the follow-ups' own, shaped like them \(2, 12\)"
    ):
        ctx.generate(torch.cat([a, b]), attention_mask=torch.ones(2, 172), max_new_tokens=1)
    pair = kvcake.compress(tiny_llama, prompt(160, seed=5, batch=2), name, budget=48, window=8)
    with pytest.raises(ValueError, match="3 follow-ups for a context of 2 sequences: give one per sequence"):
        pair.generate(torch.cat([a, b, a]), max_new_tokens=1)


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_gemma3"])
@pytest.mark.parametrize("name", ["cake", "snapkv", "adakv", "h2o", "criticalkv"])
@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
def test_reset_forgets_the_prompt(request, model_name, name, static):
    """``cache.reset()`` (transformers' Cache API; its docs reset a StaticCache between prompts) then a
    new prompt decodes as a new cache would: it reset the layers alone, and the budgets, temperatures
    and prefill state the first prompt left made the second decode otherwise (cake, adakv, h2o).
    Past ``max_cache_len`` the first prompt's decode grows the storage (which forgets the capacity),
    and a step with gradients moves a static cache to the dynamic layout: reset forgets those too."""
    model = request.getfixturevalue(model_name)
    first, second = prompt(80, seed=3), prompt(70, seed=4)
    kw = {"budget": 32, "window": 8, "static": static, "max_cache_len": 83}
    cache = KVCakeCache(model, name, **kw)
    with kvcake.enable(model):
        with torch.no_grad():
            model.generate(first, **with_cache(model, cache), max_new_tokens=6, do_sample=False)
        model(first[:, :1], **with_cache(model, cache))  # gradients on: the dynamic layout from here
        assert not cache.static and cache.max_cache_len is None
        cache.reset()
        assert cache.static == static and cache.max_cache_len == 83 and not cache.prefilled
        with torch.no_grad():
            out = model.generate(second, **with_cache(model, cache), max_new_tokens=6, do_sample=False)
            new = KVCakeCache(model, name, **kw)
            ref = model.generate(second, **with_cache(model, new), max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref)
    assert torch.equal(cache.budgets, new.budgets) and cache.kv_bytes() == new.kv_bytes()
    assert cache.peak_kv_bytes == new.peak_kv_bytes


@pytest.mark.parametrize("name", ["cake", "snapkv", "adakv", "h2o", "criticalkv", "streamingllm"])
@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
def test_a_deep_copy_serves_each_follow_up_as_a_compressed_context(tiny_llama, name, static):
    """transformers' docs re-use a prefilled cache for several prompts by ``copy.deepcopy``: a
    KVCakeCache's copy, given the document plus a question, answers as ``kvcake.compress`` then
    ``ctx.generate`` does, and the original is left as it was for the next copy."""
    import copy

    document = prompt(80, seed=5)
    cache = KVCakeCache(tiny_llama, name, budget=32, window=8, static=static, scenario="context")
    with kvcake.enable(tiny_llama), torch.no_grad():
        tiny_llama(document, **with_cache(tiny_llama, cache))
    held = cache.kv_bytes()
    ctx = kvcake.compress(tiny_llama, document, name, budget=32, window=8)
    for seed, n in ((6, 5), (7, 9)):
        question = prompt(n, seed=seed)
        ids = torch.cat([document, question], 1)
        with kvcake.enable(tiny_llama), torch.no_grad():
            out = tiny_llama.generate(
                ids, **with_cache(tiny_llama, copy.deepcopy(cache)), max_new_tokens=6, do_sample=False
            )
        assert torch.equal(out[:, ids.shape[1] :], ctx.generate(question, max_new_tokens=6, do_sample=False))
        assert cache.kv_bytes() == held and cache.get_seq_length() == 80
