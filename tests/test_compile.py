"""The decode step is something ``torch.compile`` can trace: a stock transformers StaticCache inside
``kvcake.enable(model)`` compiles to the same graphs as outside it (no Python-side state, such as
a ContextVar, read in the attention call).

Compiling costs tens of seconds on a CPU: the model is tiny (2 layers) and the tests few, marked slow.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from transformers import (
    CompileConfig,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    StaticCache,
)

import kvcake
from kvcake.adapters import with_cache
from kvcake.bench.step_counts import GraphCounter
from kvcake.bench.step_counts import tiny_llama as counts_llama
from kvcake.cache import KVCakeCache
from kvcake.layer import KVCakeLayer
from kvcake.method import DECODE_POLICIES, HEAD_ALLOCATORS, LAYER_ALLOCATORS, SCORERS, SELECTORS
from kvcake.model_code import hands_kwargs_to_cache
from shared_checks import GREEDY, KWARGS_HANDOFF, calls_while_tracing, graph_recorder
from tiny_hybrid import _tiny_gemma3

pytestmark = pytest.mark.slow
# transformers 5.0-5.23's models hand cache.update no kwargs (5.0-5.3 a cache_kwargs dict of their own):
# the cache reaches the kvcake attention through a ContextVar there (eager only), so a KVCakeCache is
# not compileable
needs_kwargs_handoff = pytest.mark.skipif(
    not KWARGS_HANDOFF, reason="this transformers' models do not hand their attention kwargs to cache.update"
)


def _decode_static_cache(model, inside: bool, steps: int = 6):
    torch._dynamo.reset()
    counter = GraphCounter()
    step = torch.compile(model.forward, backend=counter, fullgraph=True)
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    cache = StaticCache(config=model.config, max_cache_len=64)
    logits = []
    with kvcake.enable(model) if inside else contextlib.nullcontext(), torch.no_grad():
        out = model(ids, **with_cache(model, cache), cache_position=torch.arange(16))
        tok = out.logits[:, -1:].argmax(-1)
        for i in range(steps):
            out = step(tok, **with_cache(model, cache), cache_position=torch.tensor([16 + i]))
            tok = out.logits[:, -1:].argmax(-1)
            logits.append(out.logits[:, -1])
    return counter.graphs, torch.cat(logits)


def test_a_stock_static_cache_compiles_inside_enable_exactly_as_outside():
    model = counts_llama(2)
    graphs_out, logits_out = _decode_static_cache(model, inside=False)
    graphs_in, logits_in = _decode_static_cache(model, inside=True)
    assert graphs_out <= 2
    assert graphs_in == graphs_out
    torch.testing.assert_close(logits_in, logits_out, rtol=0, atol=0)


STEPS = 64
COMPOSITIONS = int(os.environ.get("KVCAKE_COMPILE_CASES", "10"))  # random compositions compiled


def _decode_kvcake(
    model,
    spec: str,
    batch: int,
    compiled: bool,
    dynamic: bool | None = None,
    budget=24,
    window=4,
    plain: list | None = None,
    **cache_kw,
):
    """Prefill eagerly, then 64 single-token steps through ``model.forward`` (compiled with
    ``fullgraph=True`` and a graph-counting backend, or eager); left padding on sequence 1.
    ``cache_kw``: more of the ``KVCakeCache``'s options (float8 storage); ``plain``: a list that
    gets whether a layer decoded plain (the model's own kernel over every token)."""
    torch._dynamo.reset()
    counter = GraphCounter()
    step = (
        torch.compile(model.forward, backend=counter, fullgraph=True, dynamic=dynamic)
        if compiled
        else model.forward
    )
    ids = torch.randint(3, 128, (batch, 60), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1:, :10] = 0
    cache = kvcake.KVCakeCache(
        model,
        kvcake.make_method(spec, budget=budget, window=window),
        static=True,
        max_cache_len=60 + STEPS,
        **cache_kw,
    )
    logits = []
    with kvcake.enable(model), torch.no_grad():
        out = model(ids, attention_mask=mask, **with_cache(model, cache))
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(STEPS):
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            out = step(
                tok, attention_mask=mask, **with_cache(model, cache), position_ids=mask.cumsum(-1)[:, -1:] - 1
            )
            tok = out.logits[:, -1:].argmax(-1)
            logits.append(out.logits[:, -1])
    if plain is not None:
        plain.append(any(getattr(layer, "plain", False) for layer in cache.layers))  # (sliding: never)
    return counter.graphs, torch.stack(logits)


# a dense cache appending (decode=none), dense ones evicting every step with an order-sensitive
# scorer (CAKE) and a stateful one (H2O), a ragged one appending (Ada-KV) and one evicting (CAKE
# x Ada-KV); the probe over every preset is in docs/step_counts.md
@needs_kwargs_handoff
@pytest.mark.parametrize("spec", ["snapkv", "cake", "h2o", "adakv", "cake-adakv"])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_kvcake_decode_step_compiles_whole_into_at_most_two_graphs(spec, batch):
    """fullgraph=True raises on any graph break; the second graph is the one with the growing 2-D
    attention mask's length symbolic (without a mask passed in, one graph: the ``dynamic=False``
    test below)."""
    model = counts_llama(2)
    graphs, compiled = _decode_kvcake(model, spec, batch, compiled=True)
    _, eager = _decode_kvcake(model, spec, batch, compiled=False)
    assert graphs <= 2
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)  # the same ATen ops, run eagerly


def _composition(case: int) -> tuple[str, dict, int, dict]:
    """A random composition of the method's parts (every registry of ``method.py``), its budget
    and window, a batch of 1 or 2, and float8 storage (rings of 0, 4 or 32 tokens) in 3 of 5."""
    rng = random.Random(case)
    parts = {
        "layers": rng.choice(sorted(LAYER_ALLOCATORS)),
        "heads": rng.choice(sorted(HEAD_ALLOCATORS)),
        "score": rng.choice(sorted(SCORERS)),
        "select": rng.choice(sorted(SELECTORS)),
        "decode": rng.choice(DECODE_POLICIES),
    }
    window = rng.randint(1, 8)
    budget = {"budget": rng.randint(max(window, 8), 40), "window": window}
    recent = rng.choice([None, None, 0, 4, 32])
    storage = {} if recent is None else {"kv_dtype": "fp8", "kv_recent": recent}
    return ",".join(f"{k}={v}" for k, v in parts.items()), budget, rng.choice([1, 2]), storage


@needs_kwargs_handoff
@pytest.mark.parametrize("case", range(COMPOSITIONS))
def test_random_compositions_compile_whole_and_decode_as_eager(case):
    """Beyond the presets: any composition of allocators, scorer, selector and decoding policy,
    in float8 or not, compiles each step whole into at most two graphs over 64 steps, and its
    logits equal the eager steps' exactly (``KVCAKE_COMPILE_CASES=200``: a deeper search)."""
    spec, budget, batch, storage = _composition(case)
    model = counts_llama(2)
    plain = []
    graphs, compiled = _decode_kvcake(model, spec, batch, compiled=True, plain=plain, **budget, **storage)
    _, eager = _decode_kvcake(model, spec, batch, compiled=False, **budget, **storage)
    assert graphs <= 2, (spec, budget, batch, storage)
    tol = PLAIN_TOLERANCE if plain[0] else 0.0
    torch.testing.assert_close(
        compiled, eager, rtol=tol, atol=tol, msg=lambda m: f"{spec} {budget} {storage}: {m}"
    )


# A layer whose budget covers the prompt and that evicts nothing while decoding stays *plain*: the
# model's own kernel reads every token, as a full cache holds them. Compiled, its logits differed
# from the eager ones by one float32 rounding (1.2e-7; a stock DynamicCache compiled on the same
# steps: none). Every other layer: exactly.
PLAIN_TOLERANCE = 1e-6


@needs_kwargs_handoff
@pytest.mark.parametrize(
    ("spec", "budget"), [("h2o", 60), ("cake", 100), ("streamingllm", 200), ("snapkv", 100)]
)
def test_a_budget_covering_the_prompt_compiles(spec, budget):
    """A 60-token prompt, batch 1, 64 steps (capacity 124): with ``decode=fixed`` and a budget the
    decoding reaches (60, 100), a layer that evicted nothing from the prompt is laid out in static
    storage at its end (``decoding.evicts_ahead``) and evicts in place, compiled as eagerly and
    exactly so; with a budget covering the capacity (200), or ``decode=none`` (snapkv), it stays
    plain, and a compiled step neither reads its counts nor evicts. Before, the first three failed
    to trace (the dynamic path's budget check is data-dependent)."""
    model = counts_llama(2)
    plain = []
    graphs, compiled = _decode_kvcake(model, spec, 1, compiled=True, budget=budget, plain=plain)
    _, eager = _decode_kvcake(model, spec, 1, compiled=False, budget=budget)
    assert graphs <= 2
    assert plain == [budget > 124 or spec == "snapkv"]
    tol = PLAIN_TOLERANCE if plain[0] else 0.0
    torch.testing.assert_close(compiled, eager, rtol=tol, atol=tol)


@needs_kwargs_handoff
@pytest.mark.parametrize(("spec", "budget"), [("h2o", 60), ("streamingllm", 200)])
def test_a_budget_covering_the_prompt_compiles_on_a_hybrid(spec, budget):
    """The same on the tiny hybrid Gemma 3, whose sliding layers decode in their rings."""
    model = _tiny_gemma3()
    plain = []
    graphs, compiled = _decode_kvcake(model, spec, 1, compiled=True, budget=budget, plain=plain)
    _, eager = _decode_kvcake(model, spec, 1, compiled=False, budget=budget)
    assert graphs <= 2
    assert plain == [budget > 124]
    tol = PLAIN_TOLERANCE if plain[0] else 0.0
    torch.testing.assert_close(compiled, eager, rtol=tol, atol=tol)


@needs_kwargs_handoff
@pytest.mark.parametrize("spec", ["cake", "cake-adakv", "h2o"])
def test_a_decode_step_traces_with_symbolic_shapes(spec):
    """``dynamic=True``: every size symbolic, as after a recompile with automatic dynamic shapes.
    The step writes its state by copies, not through ops' ``out=`` (fake tensors refuse ``out=``
    where an input has a symbolic size: transformers' compiled generate failed so on an H200)."""
    model = counts_llama(2)
    graphs, compiled = _decode_kvcake(model, spec, 2, compiled=True, dynamic=True)
    _, eager = _decode_kvcake(model, spec, 2, compiled=False)
    assert graphs <= 2
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def _decode_without_mask(model, spec: str, steps: int, step, max_cache_len: int):
    """Prefill 60 tokens eagerly, then ``steps`` single-token steps through ``step``, batch 1 and
    no mask, as ``generate`` calls a compileable cache's forward. Returns the cache and logits."""
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    cache = kvcake.KVCakeCache(
        model, kvcake.make_method(spec, budget=24, window=4), max_cache_len=max_cache_len
    )
    logits = []
    with kvcake.enable(model), torch.no_grad():
        tok = model(ids, **with_cache(model, cache)).logits[:, -1:].argmax(-1)
        for i in range(steps):
            out = step(tok, **with_cache(model, cache), position_ids=torch.tensor([[60 + i]]))
            tok = out.logits[:, -1:].argmax(-1)
            logits.append(out.logits[:, -1])
    return cache, torch.cat(logits)


@needs_kwargs_handoff
@pytest.mark.parametrize("spec", ["snapkv", "cake", "adakv", "cake-adakv"])
def test_a_decode_step_compiles_into_one_graph_even_with_dynamic_false(spec):
    """As a ``StaticCache``: the step reads no host count that changes every step (a layer's
    length is counted on the device while compiling and read back once when asked; the mask's
    size is fixed where no layer reads the mask; ``decode=none`` counts no room when
    ``max_cache_len`` reserved it), so ``dynamic=False`` (no symbolic sizes, every changed int a
    recompile) captures one graph, past dynamo's recompile limit (8) of steps. Before, each step
    recompiled on ``layers[i].length`` and ``layers[i].room``."""
    model = counts_llama(2)
    torch._dynamo.reset()
    counter = GraphCounter()
    step = torch.compile(model.forward, backend=counter, fullgraph=True, dynamic=False)
    cache, compiled = _decode_without_mask(model, spec, 10, step, 60 + 10)
    assert counter.graphs == 1
    assert cache.get_seq_length() == 70 and all(cache.layers[i].length == 70 for i in cache.compressed)
    _, eager = _decode_without_mask(model, spec, 10, model.forward, 60 + 10)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    # eager steps after compiled ones count from the length read back (5 compiled, then 5 eager)
    torch._dynamo.reset()
    step = torch.compile(model.forward, backend=GraphCounter(), fullgraph=True, dynamic=False)
    calls = iter([step] * 5 + [model.forward] * 5)
    cache, mixed = _decode_without_mask(model, spec, 10, lambda *a, **k: next(calls)(*a, **k), 60 + 10)
    assert [cache.layers[i].length for i in cache.compressed] == [70] * len(cache.compressed)
    torch.testing.assert_close(mixed, eager, rtol=0, atol=0)


@needs_kwargs_handoff
@pytest.mark.parametrize("spec", ["snapkv", "cake", "adakv", "cake-adakv"])
def test_a_compiled_step_reads_no_host_array_and_the_counts_catch_up(spec):
    """The layers' host counts (numpy) stay out of the compiled step: dynamo would turn each numpy
    array the step reads into a tensor built from host data at every call, and its update into
    CPU ops in the graph. The step counts on the device (``step.common.count_step``); read after
    compiled steps, and after eager ones that follow, the counts equal an eager decode's, for
    decode=none and decode=fixed, dense and ragged (each head's entries, window included)."""
    model = counts_llama(2)
    torch._dynamo.reset()
    inputs = []

    def backend(gm, example_inputs):
        inputs.extend(n.name for n in gm.graph.nodes if n.op == "placeholder")
        return gm.forward

    step = torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=False)
    compiled, _ = _decode_without_mask(model, spec, 6, step, 60 + 10)
    assert inputs and not [n for n in inputs if n.endswith(("_counts", "_static_budget_host"))]
    eager, _ = _decode_without_mask(model, spec, 6, model.forward, 60 + 10)
    layers = [(compiled.layers[i], eager.layers[i]) for i in compiled.compressed]
    assert all(c.counts_lag for c, _ in layers)  # counted on the device so far
    for c, e in layers:
        assert c.counts.tolist() == e.counts.tolist() and not c.counts_lag
    torch._dynamo.reset()
    step = torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=False)
    calls = iter([step] * 3 + [model.forward] * 3)
    mixed, _ = _decode_without_mask(model, spec, 6, lambda *a, **k: next(calls)(*a, **k), 60 + 10)
    for i in mixed.compressed:
        assert mixed.layers[i].counts.tolist() == eager.layers[i].counts.tolist()


@needs_kwargs_handoff
@pytest.mark.parametrize("spec", ["snapkv", "cake-adakv"])
def test_a_compiled_step_leaves_the_byte_counters_alone(spec, monkeypatch):
    """A static step writes into its buffers, so it holds as many bytes as before: the cache's
    byte counting (``KVCakeCache._track_bytes``: each layer's bytes, one int per layer and their
    total) stays out of the step. Traced, each was guarded and written back after every call by the step's Python
    around the graph. The bytes and the peak the cache reports after compiled steps are an eager
    decode's."""
    traced = calls_while_tracing(monkeypatch, KVCakeLayer, "kv_bytes")
    model = counts_llama(2)
    torch._dynamo.reset()
    step = torch.compile(model.forward, backend=GraphCounter(), fullgraph=True)
    compiled, _ = _decode_without_mask(model, spec, 4, step, 60 + 4)
    assert traced and not any(traced)  # the prefill's, eager; none while tracing a step
    eager, _ = _decode_without_mask(model, spec, 4, model.forward, 60 + 4)
    assert (compiled.peak_kv_bytes, compiled.kv_bytes()) == (eager.peak_kv_bytes, eager.kv_bytes())


@needs_kwargs_handoff
@pytest.mark.parametrize("spec", ["snapkv", "adakv"])
def test_a_compiled_step_past_max_cache_len_stops_with_a_clear_error(spec):
    """decode=none reserves room up to ``max_cache_len``; a compiled step counts nothing on the
    host, so past it a device-side check stops it (a ragged segment's next slot is its
    neighbour's first: without the check that write would land there). Eagerly the storage
    grows instead (``test_static.py``)."""
    from kvcake.step.common import PAST_CAPACITY

    model = counts_llama(2)
    torch._dynamo.reset()
    step = torch.compile(model.forward, backend=GraphCounter(), fullgraph=True)
    with pytest.raises(RuntimeError, match=re.escape(PAST_CAPACITY[:60])):
        _decode_without_mask(model, spec, 4, step, 60 + 2)


def _decode_past(
    spec: str, budget: int, max_cache_len: int | None, step_for, padding: int = 25
) -> tuple[list, Exception | None]:
    """A batch of 2 (120 tokens, ``padding`` of them on the left of the second), prefilled eagerly,
    then up to 8 steps through ``step_for(model)``; returns each step's logits and the error that
    stopped it."""
    model = counts_llama(2)
    ids = torch.randint(3, 128, (2, 120), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :padding] = 0
    method = kvcake.make_method(spec, budget=budget, window=4)
    cache = KVCakeCache(model, method, static=True, max_cache_len=max_cache_len)
    step, logits = step_for(model), []
    with kvcake.enable(model), torch.no_grad():
        tok = model(ids, attention_mask=mask, **with_cache(model, cache)).logits[:, -1:].argmax(-1)
        for _ in range(8):
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            try:
                out = step(tok, attention_mask=mask, **with_cache(model, cache))
            except (RuntimeError, ValueError) as error:
                return logits, error
            tok = out.logits[:, -1:].argmax(-1)
            logits.append(out.logits[:, -1])
    return logits, None


def _compiled(model):
    torch._dynamo.reset()
    return torch.compile(model.forward, backend=GraphCounter(), fullgraph=True)


@needs_kwargs_handoff
@pytest.mark.parametrize("spec", ["h2o", "cake"])
def test_a_compiled_step_decodes_a_plain_layer_up_to_its_budget_then_stops_clearly(spec):
    """A budget (122) above the prompt (120, no padding) and no ``max_cache_len``: the layers
    evict nothing from the prompt and stay plain (the model's own kernel reads them). A compiled step reads a
    plain layer's length against its smallest budget, a host int of its plan, not its counts
    (traced as data-dependent: the first compiled step failed to trace); at the step that would
    evict from it, which lays it out anew, it stops with ``PAST_BUDGET`` (in the error's cause
    with fullgraph; without, the step breaks the graph and evicts eagerly)."""
    from kvcake.decoding import PAST_BUDGET

    eager, _ = _decode_past(spec, 122, None, lambda model: model.forward, padding=0)
    compiled, error = _decode_past(spec, 122, None, _compiled, padding=0)
    assert 1 <= len(compiled) < 8 and error is not None
    assert PAST_BUDGET in f"{error} {error.__cause__}"
    tol = PLAIN_TOLERANCE  # the model's own kernel, compiled
    torch.testing.assert_close(torch.stack(compiled), torch.stack(eager[: len(compiled)]), rtol=tol, atol=tol)


@needs_kwargs_handoff
def test_transformers_default_compile_evicts_a_plain_layer_eagerly_at_its_budget():
    """The README's ``model.generate`` with a ``KVCakeCache`` (no ``max_cache_len``), compiled as
    transformers compiles a compileable cache's decoding on CUDA: its default ``CompileConfig``
    (``fullgraph=False``). A budget (48) above the prompt (40) keeps the layers plain for 8 steps;
    the step that evicts breaks the graph (``PAST_BUDGET`` while tracing) and evicts eagerly, and
    30 tokens are eager's."""
    backend, graphs = graph_recorder()

    model = counts_llama(2)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    outs = []
    for compiled in (False, True):
        cache = KVCakeCache(model, kvcake.make_method("h2o", budget=48, window=4))
        config = CompileConfig(backend=backend, mode=None)
        config._compile_all_devices = True  # as on CUDA
        kw = {"compile_config": config} if compiled else {"disable_compile": True}
        torch._dynamo.reset()
        with kvcake.enable(model):
            outs.append(
                model.generate(ids, **with_cache(model, cache), max_new_tokens=30, do_sample=False, **kw)
            )
    assert graphs and torch.equal(outs[0], outs[1])
    assert cache.layer_counts().max() == 48  # it evicted


@needs_kwargs_handoff
@pytest.mark.parametrize("spec", ["cake", "streamingllm", "cake-adakv"])
def test_a_compiled_decode_fixed_step_past_max_cache_len_stops_with_a_clear_error(spec):
    """A budget (140) above the prompt and room for 5 tokens (``max_cache_len=125``): each head's
    static storage holds its entries plus those 5, less than its budget. An eager step past it
    lays the cache out anew (``test_static.py``); a compiled one evicted below the budget, in
    silence, and now stops at a device-side check (``PAST_CAPACITY``) after the 5 steps, which
    decode as eager's."""
    from kvcake.step.common import PAST_CAPACITY

    eager, _ = _decode_past(spec, 140, 125, lambda model: model.forward)
    compiled, error = _decode_past(spec, 140, 125, _compiled)
    assert len(compiled) == 5 and isinstance(error, RuntimeError)
    assert PAST_CAPACITY[:80] in str(error)
    torch.testing.assert_close(torch.stack(compiled), torch.stack(eager[:5]), rtol=1e-5, atol=1e-5)


@needs_kwargs_handoff
@pytest.mark.parametrize("dynamic", [None, False])
def test_kvcake_generate_with_compile_compiles_the_decoding_forward(dynamic):
    """``compile=`` makes the cache static (``is_compileable``) and hands transformers' generate a
    CompileConfig: its decoding forward is captured whole (fullgraph) into one graph, even with
    ``dynamic=False`` (the step's 4-D mask, which ``generate`` builds, is one column wide: it grew a
    column a step, a recompile each), and the tokens are eager's."""
    backend, graphs = graph_recorder()

    model = counts_llama(2)
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    config = CompileConfig(fullgraph=True, dynamic=dynamic, backend=backend, mode=None)
    out, cache = kvcake.generate(model, ids, "snapkv", budget=24, window=4, max_new_tokens=40, compile=config)
    ref, _ = kvcake.generate(model, ids, "snapkv", budget=24, window=4, max_new_tokens=40, do_sample=False)
    assert cache.is_compileable and len(graphs) == 1
    assert torch.equal(out, ref)


@needs_kwargs_handoff
def test_compile_true_on_a_cpu_fuses_the_step_products():
    """On a CPU ``compile=True`` hands ``generate`` kvcake's inductor pass that computes the step's
    products (every projection of a decode step, the output head included, for one sequence and for
    a batch) as fused reductions (``kvcake.row_products`` and its ``compile_kwargs``: MKL's own read
    the weights at a third of the memory's rate on the AMD host, a fourth for two rows): the pass
    rewrites them (inductor's graph cache off, which would skip it), and the tokens are eager's, for
    one prompt and for a compressed context's left-padded batch of three follow-ups. A user's own
    ``CompileConfig`` is passed as given."""
    from kvcake.row_products import ROW_PRODUCTS, RowProducts

    model = counts_llama(2)
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    kw = dict(budget=24, window=4, max_new_tokens=6, do_sample=False)
    ref, _ = kvcake.generate(model, ids, "snapkv", **kw)
    torch._dynamo.reset()
    before = RowProducts.rewritten
    with torch._inductor.config.patch(fx_graph_cache=False):
        out, _ = kvcake.generate(model, ids, "snapkv", compile=True, **kw)
    assert RowProducts.rewritten - before >= 7 * 2 + 1  # q, k, v, o, gate, up, down a layer; the head
    assert torch.equal(out, ref)
    assert model._last_compile_config.options == {"post_grad_custom_pre_pass": ROW_PRODUCTS}
    questions, mask = _padded_questions()
    ctx = kvcake.compress(model, ids, "snapkv", budget=24, window=4)
    batch = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    eager = ctx.generate(questions, compile=False, **batch)
    torch._dynamo.reset()
    before = RowProducts.rewritten
    with torch._inductor.config.patch(fx_graph_cache=False):
        compiled = ctx.generate(questions, compile=True, **batch)
    assert RowProducts.rewritten - before >= 7 * 2 + 1
    assert torch.equal(compiled, eager)
    own = CompileConfig(fullgraph=True, backend="eager")
    torch._dynamo.reset()
    kvcake.generate(model, ids, "snapkv", compile=own, **kw)
    assert model._last_compile_config is own and own.options is None


@needs_kwargs_handoff
@pytest.mark.parametrize("dynamic", [None, True])
def test_a_compiled_cpu_step_has_a_graph_per_batch_size(dynamic):
    """A compiled CPU step makes its batch (of up to ``devices.MOST_ROWS`` sequences) a constant of
    its graph (``devices.fix_batch``). Without it, follow-ups of two questions then three made the
    batch symbolic (dynamo's automatic dynamic shapes), and that graph, whose products the CPU pass
    cannot fuse (their row count unknown), served every later batch of two or more, the first
    size's included. Now the second size gets a graph of static shapes and a batch of two goes back
    to its own graph; the tokens are eager's. Under ``dynamic=True`` the second size's graph is
    symbolic, as asked (the first is specialised by the cache's check of its batch), and serves the
    batch of two after it. (Symbolic here: the row count of some product.)"""
    symbolic, calls = [], []

    def backend(gm, example_inputs):
        rows = [
            n.args[0].meta["example_value"].shape[0]
            for n in gm.graph.find_nodes(op="call_function", target=F.linear)
        ]
        symbolic.append(not all(is_concrete_int(n) for n in rows))  # the products' row counts
        calls.append(0)
        graph = len(calls) - 1

        def run(*args):
            calls[graph] += 1
            return gm.forward(*args)

        return run

    model = counts_llama(2)
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    ctx = kvcake.compress(model, ids, "snapkv", budget=24, window=4)
    config = CompileConfig(fullgraph=True, dynamic=dynamic, backend=backend, mode=None)
    torch._dynamo.reset()
    for batch in (2, 3, 2):
        questions = torch.randint(3, 128, (batch, 6), generator=torch.Generator().manual_seed(batch))
        kw = dict(
            attention_mask=torch.ones_like(questions), max_new_tokens=4, do_sample=False, pad_token_id=0
        )
        before = list(calls)
        out = ctx.generate(questions, compile=config, **kw)
        assert torch.equal(out, ctx.generate(questions, compile=False, **kw))
    ran = [n - (before[i] if i < len(before) else 0) for i, n in enumerate(calls)]  # the last call's steps
    if dynamic:
        assert symbolic == [False, True] and ran == [0, 3]  # (the first new token is the eager prefill's)
    else:
        assert symbolic == [False, False] and ran == [3, 0]


def test_compile_kwargs_add_the_cpu_pass_only_where_every_weight_is_on_the_cpu():
    """The fused products are a CPU pass: a model with a weight elsewhere (here the meta
    device, as an offloaded one) keeps ``torch.compile``'s defaults (on CUDA, the graphs of
    ``mode="reduce-overhead"``, which inductor would refuse beside options)."""
    from kvcake.row_products import ROW_PRODUCTS, compile_kwargs

    model = counts_llama(1)
    assert compile_kwargs(model) == dict(mode=None, options={"post_grad_custom_pre_pass": ROW_PRODUCTS})
    model.lm_head.to("meta")
    assert compile_kwargs(model) == {}


def test_the_row_pass_rewrites_only_products_of_a_few_rows_by_transposed_weights():
    """``kvcake.row_products``: ``x @ w.T`` and ``F.linear`` with a bias for one row, at a width past
    torch's own pass's 2048, and for two and ``MOST_ROWS`` rows (a decoding batch) compile to
    eager's values (fp32, 1e-5: the sum's order differs) and are rewritten; one row more than that,
    and a matrix whose K dimension is not contiguous, are left to MKL."""
    from kvcake.devices import MOST_ROWS
    from kvcake.row_products import RowProducts

    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(3000, 64, generator=g), torch.randn(3000, generator=g)
    plain = torch.randn(64, 300, generator=g)  # (K, N) contiguous: K strided

    def step(x, two, most, past):
        return (
            torch.nn.functional.linear(x, w),
            torch.nn.functional.linear(x, w, bias),
            two @ w.t(),
            torch.nn.functional.linear(most, w, bias),
            past @ w.t(),
            x @ plain,
        )

    rows = [torch.randn(n, 64, generator=g) for n in (1, 2, MOST_ROWS, MOST_ROWS + 1)]
    before = RowProducts.rewritten
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        options = {"post_grad_custom_pre_pass": RowProducts()}
        compiled = torch.compile(step, fullgraph=True, options=options)(*rows)
    assert RowProducts.rewritten - before == 4
    for got, want in zip(compiled, step(*rows), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_row_pass_computes_a_products_rows_once():
    """The rows of a rewritten product (here an RMSNorm's output, as every projection of a decoder
    layer gets) are stored once before the per-row reductions read them (inductor's
    ``force_stride_order``), not left for inductor to inline into the reduction, which would compute
    the norm again for every output column; compiled, eager's values (fp32, 1e-5)."""
    from torch._inductor import inductor_prims
    from torch.fx.experimental.proxy_tensor import make_fx

    from kvcake.row_products import RowProducts

    g = torch.Generator().manual_seed(0)
    h, r = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
    norm, w = torch.randn(64, generator=g), torch.randn(300, 64, generator=g)

    def step(h, r, norm, w):
        x = h + r
        return torch.nn.functional.linear(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm, w)

    graph = make_fx(step, tracing_mode="fake")(h, r, norm, w).graph
    RowProducts()(graph)
    stored = graph.find_nodes(op="call_function", target=inductor_prims.force_stride_order)
    rows = graph.find_nodes(op="call_function", target=torch.ops.aten.slice.Tensor)
    assert len(stored) == 1 and len(rows) == 4 and all(row.args[0] is stored[0] for row in rows)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        options = {"post_grad_custom_pre_pass": RowProducts()}
        compiled = torch.compile(step, fullgraph=True, options=options)(h, r, norm, w)
    torch.testing.assert_close(compiled, step(h, r, norm, w), rtol=1e-5, atol=1e-5)


def _padded_questions() -> tuple[torch.Tensor, torch.Tensor]:
    """Three follow-ups of 6, 3 and 5 tokens (3, 6) and their left padding's mask."""
    questions = torch.randint(3, 128, (3, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(questions)
    mask[1, :3], mask[2, :1] = 0, 0
    return questions, mask


@needs_kwargs_handoff
@pytest.mark.parametrize("spec", ["layer-defensivekv", "cake", "h2o"])
@pytest.mark.parametrize("padded", [False, True])
def test_a_compressed_contexts_generate_with_compile_compiles_its_decoding(spec, padded):
    """``CompressedContext.generate(compile=...)``, as ``kvcake.generate``'s (it was not taken:
    transformers refused the unknown kwarg, and ``kvcake --compile`` refused a context): three
    follow-ups of 6 tokens in one batch (``padded``: of 6, 3 and 5, left-padded), the fork laid out
    in static storage after the question, its decoding forward captured whole, the tokens eager's."""
    backend, graphs = graph_recorder()

    model = counts_llama(2)
    ids = torch.randint(3, 128, (1, 80), generator=torch.Generator().manual_seed(1))
    questions, mask = _padded_questions()
    if not padded:
        mask = torch.ones_like(questions)
    ctx = kvcake.compress(model, ids, spec, budget=24, window=4)
    kw = {"attention_mask": mask, "max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    eager = ctx.generate(questions, compile=False, **kw)
    torch._dynamo.reset()
    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    compiled = ctx.generate(questions, compile=config, **kw)
    assert len(graphs) == 1 and torch.equal(compiled, eager)


@needs_kwargs_handoff
def test_padded_follow_ups_on_sliding_layers_compile_their_decoding(tiny_gemma3):
    """The same on Gemma 3: the settled sliding layers decode in their rings, one graph for every
    step, the tokens eager's."""
    backend, graphs = graph_recorder()
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(1))
    questions, mask = _padded_questions()
    ctx = kvcake.compress(tiny_gemma3, ids, "cake", budget=16, window=4)
    kw = {"attention_mask": mask, "max_new_tokens": 20, "do_sample": False, "pad_token_id": 0}
    eager = ctx.generate(questions, compile=False, **kw)
    torch._dynamo.reset()
    compiled = ctx.generate(
        questions, compile=CompileConfig(fullgraph=True, backend=backend, mode=None), **kw
    )
    assert len(graphs) == 1 and torch.equal(compiled, eager)


def test_compile_refusals_name_the_fix():
    """A context compressed with ``static=False`` decodes in the dynamic layout, which compile=True
    cannot compile; a value that is not a switch or a ``CompileConfig`` is refused, not read as True."""
    model = counts_llama(2)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    questions = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(2))
    dynamic = kvcake.compress(model, ids, "snapkv", budget=16, window=4, static=False)
    with pytest.raises(ValueError, match="drop static=False"):
        dynamic.generate(questions, max_new_tokens=2, compile=True)
    with pytest.raises(TypeError, match="compile must be None, True, False or a transformers CompileConfig"):
        kvcake.generate(model, ids, "snapkv", budget=16, window=4, max_new_tokens=2, compile="yes")


def _two_layer_neox() -> GPTNeoXForCausalLM:
    config = GPTNeoXConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=512, attn_implementation="sdpa",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPTNeoXForCausalLM(config)
    return model.eval()


@pytest.mark.parametrize("build", [lambda: counts_llama(2), _two_layer_neox], ids=["llama", "neox"])
def test_compile_is_refused_where_the_model_does_not_hand_off_kwargs(build):
    """Where the model's attention hands cache.update nothing (every model of 5.0-5.23; GPT-NeoX's
    even in 5.24, which the check before 2026-11-29, read off ``Cache.update``'s signature, did not
    see: its static cache claimed to be compileable and compiled decoding failed inside dynamo on
    the ContextVar) the cache reads back eagerly only: not compileable, ``compile=True``
    says what to do instead of failing inside transformers' generate, and eager decoding with a
    covering budget is the full cache's."""
    model = build()
    if hands_kwargs_to_cache(model):
        pytest.skip("under this transformers the model hands its attention kwargs to cache.update")
    assert not KVCakeCache(model, "snapkv", budget=24, window=4, static=True).is_compileable
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="upgrade transformers or use compile=False"):
        kvcake.generate(model, ids, "snapkv", budget=24, window=4, max_new_tokens=4, compile=True)
    full = model.generate(ids, max_new_tokens=4, do_sample=False)
    out, _ = kvcake.generate(model, ids, "snapkv", budget=60, window=4, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, full)


@needs_kwargs_handoff
@pytest.mark.parametrize(
    ("spec", "budget"),
    [("cake", 24), ("cake-adakv", 24), ("h2o", 24), ("h2o", 70), ("cake", 60), ("streamingllm", 200)],
)
def test_a_compressed_contexts_question_then_a_compiled_decode(spec, budget):
    """A compressed context keeps its kept entries in the dynamic layout; a fork appends the
    question (several tokens) and goes back into static storage right after that append's
    attention, so the compiled decoding forward is captured whole (fullgraph) and converts no
    layer: the code before converted at the first compiled step, a graph break (fullgraph raised
    on it here; on an H100 the CUDA-graph compile of that step crashed, 2026-11-26). So do the
    layers of a context that evicted nothing (budgets 60 and 70 for 60 tokens) where decoding will
    evict from them (``decoding.plan``; before, their step failed to trace); with a budget covering
    the capacity (200) they stay plain. One graph where the layers are in static storage: ``generate``
    builds the step's 4-D mask eagerly, one column wide (``KVCakeCache.get_mask_sizes``); it grew by
    a column a step before, and the second step recompiled to a symbolic size."""
    backend, graphs = graph_recorder()

    model = counts_llama(2)
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    question = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    ctx = kvcake.compress(model, ids, spec, budget=budget, window=4)
    assert all(layer.static is None for layer in ctx.cache.layers)  # the context holds exactly its entries
    eager = ctx.generate(question, max_new_tokens=12, do_sample=False, disable_compile=True)
    torch._dynamo.reset()
    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True  # transformers compiles on accelerators only by default
    compiled = ctx.generate(question, max_new_tokens=12, do_sample=False, compile_config=config)
    plain = budget >= ids.shape[1] + question.shape[1] + 12  # never evicts: the model's kernel reads its mask
    assert len(graphs) == (2 if plain else 1)  # plain: one recompile, to a symbolic mask size
    assert torch.equal(compiled, eager)


def test_a_forks_layers_are_in_static_storage_after_a_multi_token_append(tiny_llama):
    """The step that follows a question's append (several tokens at once) finds every compressed
    layer laid out already, holding the entries a fork kept in the dynamic layout holds."""
    ids = torch.randint(3, 128, (1, 80), generator=torch.Generator().manual_seed(0))
    question = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    ctx = kvcake.compress(tiny_llama, ids, "cake", budget=24, window=4)
    laid_out, dynamic = ctx.fork(), ctx.fork()
    for cache in (laid_out, dynamic):
        cache.reserve(85 + 4)
    for layer in dynamic.layers:
        layer.static_plan = None  # stays in the dynamic layout
    mask = torch.ones(1, 85, dtype=torch.long)
    with kvcake.enable(tiny_llama), torch.no_grad():
        for cache in (laid_out, dynamic):
            tiny_llama(question, attention_mask=mask, **with_cache(tiny_llama, cache))
    compressed = [lid for lid in laid_out.compressed if not laid_out.layers[lid].plain]
    assert compressed and all(laid_out.layers[lid].static is not None for lid in compressed)
    assert all(dynamic.layers[lid].static is None for lid in compressed)
    laid_out.compact()  # back to exactly the kept entries, to compare
    for lid in compressed:
        a, b = laid_out.layers[lid].padded_positions(), dynamic.layers[lid].padded_positions()
        assert torch.equal(a.sort(-1).values, b.sort(-1).values), lid


@pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="inductor needs a C++ compiler"
)
@needs_kwargs_handoff
@pytest.mark.parametrize("spec", ["streamingllm", "snapkv"])
def test_a_compiled_step_writes_the_new_entry_in_place(spec):
    """Inductor's code for one decode step allocates no buffer the size of a stored tensor: the new
    entry is written where it is held (``step.dense.append``: ``index_put_`` / ``index_copy_``). A
    ``scatter_`` there compiled into a copy of the whole tensor, the scatter into it and a copy back
    at every step of every layer (SmolLM2, ``cake``: 34 against 29 ms a compiled CPU step). One layer,
    a capacity of 1025 columns (decode=fixed) or 1600 (decode=none)."""
    from torch._inductor.utils import run_and_get_code

    model = counts_llama(layers=1)  # the per-step counts' model (4096 positions)
    ids = torch.randint(3, 128, (1, 1500), generator=torch.Generator().manual_seed(0))
    cache = KVCakeCache(model, kvcake.make_method(spec, budget=1024, window=4), max_cache_len=1600)
    step = torch.compile(model.forward, fullgraph=True)
    with kvcake.enable(model), torch.no_grad():
        tok = model(ids, **with_cache(model, cache)).logits[:, -1:].argmax(-1)
        _, code = run_and_get_code(step, tok, position_ids=torch.tensor([[1500]]), **with_cache(model, cache))
    layer = cache.layers[0]
    assert layer.static == ("fixed" if spec == "streamingllm" else "none")
    stored = f"({', '.join(str(n) for n in layer.keys.shape)})"  # e.g. (1, 2, 1025, 16)
    assert stored in code[0]  # the step's code names the stored tensor (its size check) ...
    assert f"empty_strided_cpu({stored}" not in code[0]  # ... and allocates no copy of it


@needs_kwargs_handoff
@pytest.mark.parametrize("spec", ["adakv", "layer-defensivekv"])
def test_a_head_wise_method_outgrowing_its_segments_grows_eagerly_or_is_refused_up_front(spec):
    """Per-head budgets, every new token kept, no length known: past the 64 slots each segment
    reserved, the step must lay the segments out anew, which only an eager step can (the counts are
    on the host). A compiled step whole failed inside dynamo ("Could not guard on data-dependent
    expression"): ``kvcake.generate(compile=True)`` now refuses it up front naming the fix, a step
    compiled whole says why when it gets there, and transformers' default (``fullgraph=False``)
    breaks the graph and grows eagerly, decoding eager's tokens."""
    model = counts_llama(2)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    model.generation_config.max_length = 120  # the model's own: not read as a capacity
    try:
        with pytest.raises(ValueError, match="needs the generation's length up front.*pass max_new_tokens="):
            kvcake.generate(model, ids, spec, budget=12, window=4, compile=True, do_sample=False)
    finally:
        model.generation_config.max_length = 20
    outs = []
    for fullgraph in (None, False, True):
        cache = KVCakeCache(model, kvcake.make_method(spec, budget=12, window=4))  # no max_cache_len
        kw = {"disable_compile": True}
        if fullgraph is not None:
            config = CompileConfig(fullgraph=fullgraph, backend="eager", mode=None)
            config._compile_all_devices = True
            kw = {"compile_config": config}
        torch._dynamo.reset()
        with kvcake.enable(model), contextlib.ExitStack() as stack:
            if fullgraph:
                stack.enter_context(pytest.raises(Exception, match="only an eager step can lay out anew"))
            outs.append(
                model.generate(
                    ids, **with_cache(model, cache), min_new_tokens=80, max_new_tokens=80, **GREEDY, **kw
                )
            )
    assert torch.equal(outs[0].sequences, outs[1].sequences) and outs[0].sequences.shape[1] == 120
