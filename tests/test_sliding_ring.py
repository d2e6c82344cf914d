"""Hybrid models' sliding layers decode in a ring of ``window`` slots, or of the cache's capacity
where that is less (``kvcake.sliding``): the same tokens as transformers' own layer (up to float
rounding: the ring sums in slot order), the same compiled and eager, and one compiled graph per
step even with ``dynamic=False``, where transformers' own ``StaticCache`` recompiles at every
step on a hybrid model (its sliding layer's host count and mask offset)."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import CompileConfig, StaticCache

import kvcake
from kvcake.adapters import with_cache
from kvcake.bench.step_counts import SYNCING, GraphCounter, step_ops
from kvcake.cache import KVCakeCache
from kvcake.sliding import SlidingLayer
from shared_checks import KWARGS_HANDOFF, calls_while_tracing, graph_recorder
from tiny_hybrid import TINY_GEMMA3_WINDOW, _tiny_gemma3

needs_kwargs_handoff = pytest.mark.skipif(
    not KWARGS_HANDOFF, reason="this transformers' models do not hand their attention kwargs to cache.update"
)
SLIDING = (0, 1, 3, 4)


def _decode(
    model, step, *, prompt: int, steps: int, batch: int = 1, static: bool = True, spec: str = "snapkv",
    capacity: int | None = None,
):  # fmt: skip
    """Prefill ``prompt`` tokens (left padding of 3 on sequence 1 when ``batch`` is 2), then
    ``steps`` single-token steps through ``step``; returns the cache and the (steps, B, vocab) logits.
    ``capacity``: the cache's ``max_cache_len`` (default ``prompt + steps``)."""
    ids = torch.randint(3, 128, (batch, prompt), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1:, :3] = 0
    cache = KVCakeCache(model, kvcake.make_method(spec, budget=8, window=4), static=static,
                        max_cache_len=capacity or prompt + steps)  # fmt: skip
    logits = []
    with kvcake.enable(model), torch.no_grad():
        out = model(ids, attention_mask=mask if batch > 1 else None, **with_cache(model, cache))
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            kw = {}
            if batch > 1:  # a padded batch passes its growing mask and positions, as generate does
                mask = torch.cat([mask, torch.ones_like(tok)], 1)
                kw = dict(attention_mask=mask, position_ids=mask.cumsum(-1)[:, -1:] - 1)
            else:
                kw = dict(position_ids=torch.full((1, 1), cache.get_seq_length()))
            out = step(tok, **with_cache(model, cache), **kw)
            tok = out.logits[:, -1:].argmax(-1)
            logits.append(out.logits[:, -1])
    return cache, torch.stack(logits)


@pytest.mark.parametrize("prompt", [7, 30])  # shorter than the window (12), longer
@pytest.mark.parametrize("batch", [1, 2])
def test_the_ring_decodes_as_transformers_sliding_layer(prompt, batch):
    """Eager: the ring (static, the default) against transformers' dynamic sliding layer
    (``static=False``), across the window's edge, with and without left padding."""
    model = _tiny_gemma3()
    ring, got = _decode(model, model.forward, prompt=prompt, steps=20, batch=batch)
    ref_cache, ref = _decode(model, model.forward, prompt=prompt, steps=20, batch=batch, static=False)
    assert all(ring.layers[i].static == "ring" for i in SLIDING) == KWARGS_HANDOFF
    assert all(ref_cache.layers[i].static is None for i in SLIDING)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for i in SLIDING:
        assert ring.layers[i].cumulative_length == prompt + 20
        keys, values = ring.layers[i].window()
        torch.testing.assert_close(keys, ref_cache.layers[i].keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(values, ref_cache.layers[i].values, rtol=1e-5, atol=1e-5)


@needs_kwargs_handoff
@pytest.mark.parametrize("batch", [1, 2])
def test_a_ring_holds_no_more_slots_than_the_capacity_and_grows_past_it_eagerly(batch):
    """As transformers' static sliding layers (``min(window, max_cache_len)``): a capacity shorter
    than the window lays the ring out with that many slots (a 5-token prompt on Gemma-3-270M held
    a 512-slot ring per sliding layer, 20 x a DynamicCache's bytes). Eager steps past it grow the
    ring to the window, every token in its slot; the logits are the dynamic layer's throughout."""
    model = _tiny_gemma3()
    for capacity, slots in [(9, 9), (6, TINY_GEMMA3_WINDOW)]:  # 4 + 5 tokens; 4 + 5 past 6: grown
        ring, got = _decode(model, model.forward, prompt=4, steps=5, batch=batch, capacity=capacity)
        _, ref = _decode(model, model.forward, prompt=4, steps=5, batch=batch, static=False)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        for i in SLIDING:
            assert ring.layers[i].static == "ring" and ring.layers[i].keys.shape[2] == slots
            assert ring.layers[i].valid.shape == (batch, slots) and ring.layers[i].cumulative_length == 9


@needs_kwargs_handoff
def test_a_compiled_ring_step_past_its_capacity_stops_with_a_clear_error():
    """A compiled step counts the ring's tokens on the device only: past the capacity it was laid
    out for, a device-side check stops it instead of writing past the ring."""
    from kvcake.step.common import PAST_CAPACITY

    model = _tiny_gemma3()
    torch._dynamo.reset()
    step = torch.compile(model.forward, backend=GraphCounter(), fullgraph=True)
    with pytest.raises(RuntimeError, match=re.escape(PAST_CAPACITY[60:120])):
        _decode(model, step, prompt=4, steps=5, capacity=6)


def test_a_multi_token_append_leaves_the_ring_and_comes_back():
    """A question appended to a compressed context (several tokens) goes through transformers'
    layer and the model's mask, and the layer is back in its ring after that append: the same
    logits as the dynamic reference's."""
    model = _tiny_gemma3()
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    follow = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(3))
    results = []
    for static in (True, False):
        ctx = kvcake.compress(model, ids, "snapkv", budget=8, window=4, static=static)
        cache = ctx.fork()
        with kvcake.enable(model), torch.no_grad():
            steps = [model(follow[:, i : i + 1], **with_cache(model, cache)).logits[0, -1] for i in range(4)]
            steps.append(model(follow[:, 4:], **with_cache(model, cache)).logits[0, -1])  # 5 tokens at once
            assert all((cache.layers[i].static == "ring") == (static and KWARGS_HANDOFF) for i in SLIDING)
            steps += [model(follow[:, i : i + 1], **with_cache(model, cache)).logits[0, -1] for i in range(3)]
        results.append(torch.stack(steps))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)


def test_saving_a_context_after_ring_steps_keeps_transformers_layout(tmp_path):
    """A file keeps a sliding layer as transformers holds it (the last window - 1 tokens), not the ring."""
    model = _tiny_gemma3()
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(4))
    ctx = kvcake.compress(model, ids, "snapkv", budget=8, window=4)
    cache = ctx.fork()
    with kvcake.enable(model), torch.no_grad():
        for t in (5, 6, 7):
            model(torch.tensor([[t]]), **with_cache(model, cache))
    cache.compact()
    for i in SLIDING:
        layer = cache.layers[i]
        assert layer.static is None and layer.keys.shape[2] == TINY_GEMMA3_WINDOW - 1
        assert layer.kv_bytes() == layer.dynamic_bytes()
    ring = ctx.fork()
    with kvcake.enable(model), torch.no_grad():
        model(torch.tensor([[5]]), **with_cache(model, ring))
    layer = ring.layers[SLIDING[0]]
    assert (layer.static == "ring") == KWARGS_HANDOFF  # (5.0: no ring)
    layer.reset()  # nothing of the ring survives a reset
    assert (
        layer.static is None and layer.seen is None and layer.valid is None and layer.cumulative_length == 0
    )


@needs_kwargs_handoff
def test_a_compiled_ring_step_leaves_the_byte_counters_alone(monkeypatch):
    """The ring writes into its slots, as a static compressed layer does into its buffers: no byte
    counting while a hybrid model's step is traced (``test_compile.py`` for the compressed layers),
    and the bytes and peak after compiled steps are an eager decode's."""
    traced = calls_while_tracing(monkeypatch, SlidingLayer, "kv_bytes")
    model = _tiny_gemma3()
    torch._dynamo.reset()
    step = torch.compile(model.forward, backend=GraphCounter(), fullgraph=True)
    compiled, _ = _decode(model, step, prompt=10, steps=4)
    assert traced and not any(traced)
    eager, _ = _decode(model, model.forward, prompt=10, steps=4)
    assert (compiled.peak_kv_bytes, compiled.kv_bytes()) == (eager.peak_kv_bytes, eager.kv_bytes())


@needs_kwargs_handoff
@pytest.mark.slow
@pytest.mark.parametrize("spec", ["snapkv", "cake", "adakv"])
def test_a_hybrid_decode_step_compiles_into_one_graph_even_with_dynamic_false(spec):
    """The ring counts its tokens on the device while compiling and reads no mask, so a Gemma 3
    step is one graph over 20 steps across the window's edge, bit-equal to eager ring steps."""
    model = _tiny_gemma3()
    torch._dynamo.reset()
    counter = GraphCounter()
    step = torch.compile(model.forward, backend=counter, fullgraph=True, dynamic=False)
    cache, compiled = _decode(model, step, prompt=10, steps=20, spec=spec)  # fills the window at step 2
    assert counter.graphs == 1
    assert all(cache.layers[i].cumulative_length == 30 for i in SLIDING)  # read back from the device
    _, eager = _decode(model, model.forward, prompt=10, steps=20, spec=spec)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


@needs_kwargs_handoff
@pytest.mark.slow
def test_transformers_static_cache_recompiles_on_a_hybrid_model_where_the_ring_does_not():
    """What the ring is measured against: transformers' own StaticCache on the same model and
    steps, compiled with ``dynamic=False``, recompiles at every step until dynamo's limit fails
    ``fullgraph``. If a release fixes that, this test says so (and the docs' claim is stale)."""
    model = _tiny_gemma3()
    torch._dynamo.reset()
    step = torch.compile(model.forward, backend=GraphCounter(), fullgraph=True, dynamic=False)
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(1))
    cache = StaticCache(config=model.config, max_cache_len=40)
    with torch.no_grad(), pytest.raises(Exception) as failed:
        tok = model(ids, **with_cache(model, cache)).logits[:, -1:].argmax(-1)
        for i in range(20):
            tok = (
                step(tok, **with_cache(model, cache), position_ids=torch.tensor([[7 + i]]))
                .logits[:, -1:]
                .argmax(-1)
            )
    assert "ecompile" in type(failed.value).__name__ + str(failed.value)  # FailOnRecompileLimitHit


@needs_kwargs_handoff
@pytest.mark.slow
def test_kvcake_generate_compiles_a_hybrid_models_decoding_forward():
    """``kvcake.generate(compile=...)`` on Gemma 3: the cache is compileable, the decoding forward
    is captured whole, and the tokens are the eager ring's."""
    backend, graphs = graph_recorder()

    model = _tiny_gemma3()
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(5))
    torch._dynamo.reset()
    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    out, cache = kvcake.generate(model, ids, "snapkv", budget=8, window=4, max_new_tokens=20, compile=config)
    ref, _ = kvcake.generate(model, ids, "snapkv", budget=8, window=4, max_new_tokens=20, do_sample=False)
    assert cache.is_compileable and len(graphs) == 1
    assert all(
        isinstance(cache.layers[i], SlidingLayer) and cache.layers[i].static == "ring" for i in SLIDING
    )
    assert torch.equal(out, ref)


@needs_kwargs_handoff
@pytest.mark.parametrize("batch", [1, 2])
def test_a_hybrid_static_decode_step_has_no_host_synchronising_op(batch):
    """The ring's step reads nothing back from the device (issue 22's proxy for a GPU step), a
    left-padded batch included: its slot is a device remainder, its tokens a device count."""
    model = _tiny_gemma3()
    cache = KVCakeCache(model, kvcake.make_method("snapkv", budget=24, window=4))
    ops = step_ops(model, cache, batch)
    assert all(cache.layers[i].static == "ring" for i in SLIDING)
    assert {k: v for k, v in ops.items() if k in SYNCING} == {}


@needs_kwargs_handoff
def test_a_fork_of_a_cache_in_its_ring_keeps_static_addresses_and_decodes_on_its_own():
    """``copy.deepcopy`` (a fork, as ``kvcake.compress``' contexts are forked per question) of a
    cache already in its ring: the copy's ring buffers are its own and keep dynamo's static-address
    marks (CUDA graphs would otherwise record them as inputs, copied at every replay), and its
    steps equal the original's while leaving the original where it was."""
    import copy

    model = _tiny_gemma3()
    cache, _ = _decode(model, model.forward, prompt=30, steps=3)
    fork = copy.deepcopy(cache)
    for i in SLIDING:
        ring, copied = cache.layers[i], fork.layers[i]
        assert copied.static == "ring"
        for name in ("keys", "values", "valid", "seen"):
            t, c = getattr(ring, name), getattr(copied, name)
            assert c.data_ptr() != t.data_ptr()
            assert getattr(c, "_dynamo_static_input_type", None) == "unguarded", name
    tok = torch.tensor([[5]])
    seen = cache.get_seq_length()
    with kvcake.enable(model), torch.no_grad():
        pos = torch.full((1, 1), seen)
        a = model(tok, position_ids=pos, **with_cache(model, fork)).logits
        assert cache.get_seq_length() == seen and fork.get_seq_length() == seen + 1
        b = model(tok, position_ids=pos, **with_cache(model, cache)).logits
    assert torch.equal(a, b)
