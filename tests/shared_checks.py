"""Checks that more than one test file runs (tiny Llama, tiny hybrid Gemma 3, the device suite).
A plain module, like ``tiny_hybrid``: test files import it by name."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention
from transformers.models.llama.modeling_llama import LlamaAttention

import kvcake
from kvcake import KVCakeCache
from kvcake.adapters import with_cache
from kvcake.model_code import forward_hands_kwargs
from kvcake.recurrent import LinearAttentionLayer, held_states
from kvcake.replay import Captured, capture_queries, replay_compress
from kvcake.storage import load_context

# Whether the installed transformers' own models (the tiny Llama's and Gemma 3's attention) hand their
# attention kwargs to cache.update (from 5.24), which compiled kvcake steps and sliding rings need.
KWARGS_HANDOFF = all(forward_hands_kwargs(c) for c in (LlamaAttention, Gemma3Attention))


def graph_recorder() -> tuple:
    """(backend, graphs): a ``torch.compile`` backend that records each graph it is given into
    ``graphs`` and runs it as traced (inductor takes minutes on this CPU). A plain function, so a
    ``CompileConfig`` holding it survives ``generate``'s deep copy as itself."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend, graphs


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


def full_and_compressed(model, ids, method, **kw) -> tuple[transformers.DynamicCache, KVCakeCache]:
    """The prompt ``ids`` through transformers' ``DynamicCache`` and through ``method``'s KVCakeCache."""
    full = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **with_cache(model, full))
    return full, prefill(model, ids, method, **kw)[0]


def single_step_logits(model, cache, follow: torch.Tensor) -> torch.Tensor:
    """(n, vocab) last-token logits of feeding ``follow`` (1, n) one token at a time."""
    steps = []
    with kvcake.enable(model), torch.no_grad():
        for i in range(follow.shape[1]):
            steps.append(model(follow[:, i : i + 1], **with_cache(model, cache)).logits[0, -1])
    return torch.stack(steps)


def left_padded(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D ``a`` and a shorter ``b`` as a left-padded batch (pad id 0): ids and attention mask (2, len(a))."""
    pad = torch.zeros(a.shape[0] - b.shape[0], dtype=torch.long, device=a.device)
    ids = torch.stack([a, torch.cat([pad, b])])
    return ids, torch.stack([torch.ones_like(a), torch.cat([pad, torch.ones_like(b)])])


def assert_batch_matches_each_alone(model, name: str, a: torch.Tensor, b: torch.Tensor, n_pad: int, **kw):
    """``a`` and ``b`` (1-D, ``len(a) == n_pad + len(b)``) generated as one left-padded batch
    give each the tokens, per-head counts and kept positions it gets alone; padding is never
    kept. ``kw`` goes to ``kvcake.generate`` (greedy, so the tokens must match exactly)."""
    batch, mask = left_padded(a, b)
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


def compiled_and_eager_decoding(
    model, spec: str, ids: torch.Tensor, mask: torch.Tensor, steps: int, **cache_kw
):
    """Prefill ``ids`` (B, S) with its left-padding ``mask`` eagerly, then ``steps`` greedy single-token
    steps through ``model.forward`` compiled with ``fullgraph=True`` (a backend that counts the graphs
    and runs them eagerly), and again eagerly: (graphs, compiled logits, eager logits), (steps, B, V)
    each. ``cache_kw``: the ``KVCakeCache``'s budget and options (``max_cache_len`` set here)."""
    runs = []
    for compiled in (True, False):
        torch._dynamo.reset()
        graphs = []

        def count(gm, example_inputs, graphs=graphs):
            graphs.append(gm)
            return gm.forward

        step = torch.compile(model.forward, backend=count, fullgraph=True) if compiled else model.forward
        cache = KVCakeCache(model, spec, max_cache_len=ids.shape[1] + steps, **cache_kw)
        m, logits = mask, []
        with kvcake.enable(model), torch.no_grad():
            out = model(ids, attention_mask=m, **with_cache(model, cache))
            tok = out.logits[:, -1:].argmax(-1)
            for _ in range(steps):
                m = torch.cat([m, torch.ones_like(tok)], 1)
                out = step(
                    tok, attention_mask=m, **with_cache(model, cache), position_ids=m.cumsum(-1)[:, -1:] - 1
                )
                tok = out.logits[:, -1:].argmax(-1)
                logits.append(out.logits[:, -1])
        runs.append((len(graphs), torch.stack(logits)))
    return runs[0][0], runs[0][1], runs[1][1]


def kept_as_dynamic_cache(model, ids, cache, split: int | None = None) -> transformers.DynamicCache:
    """The stock model's cache of ``ids`` (its sliding layers and states as they are), each compressed
    layer's keys and values exactly ``cache``'s kept entries, in position order; ``split``: a latent
    layer's one key is ``[c; k_rot]``, handed to the stock layer as keys ``[:split]``, values the rest."""
    with torch.no_grad():
        stock = model(ids, use_cache=True).past_key_values
    for lid in cache.compressed:
        layer = cache.layers[lid]
        held = int((layer.positions >= 0).sum(-1).max())  # static storage: empty slots at -1
        order = layer.positions.argsort(-1)[..., -held:, None]  # (B, H_kv, held, 1): in position order
        keys, values = (
            t.gather(2, order.expand(*order.shape[:-1], t.shape[-1])) for t in (layer.keys, layer.values)
        )
        if split is not None:
            keys, values = keys[..., :split], keys[..., split:]
        stock.layers[lid].keys, stock.layers[lid].values = keys, values
    return stock


def step_and_oracle_logits(model, prompt, spec: str, static: bool, oracle_cache, new=None, at=None):
    """``spec`` (budget 16, window 4) compresses ``prompt`` (1, S) in a KVCakeCache; then the logits of
    ``new`` (1, q) at positions ``at`` (default: token 5 at S) through it, and the stock model's over the
    cache ``oracle_cache(model, prompt, cache)`` builds (:func:`kept_as_dynamic_cache`), holding exactly the kept entries:
    (kvcake's, the oracle's) float32, and the oracle cache (the new tokens appended)."""
    n, dev = prompt.shape[1], prompt.device
    new = torch.tensor([[5]], device=dev) if new is None else new
    at = torch.arange(n, n + new.shape[1], device=dev)[None] if at is None else at
    method = kvcake.make_method(spec, budget=16, window=4)
    cache = KVCakeCache(model, method, static=static, max_cache_len=n + new.shape[1])
    with kvcake.enable(model), torch.no_grad():
        model(prompt, **with_cache(model, cache))
    oracle = oracle_cache(model, prompt, cache)
    with torch.no_grad():
        want = model(new, **with_cache(model, oracle), position_ids=at).logits.float()
        with kvcake.enable(model):
            got = model(new, **with_cache(model, cache), position_ids=at).logits.float()
    return got, want, oracle


# greedy decoding that returns every step's logits (``assert_same_decoding``)
GREEDY = {"do_sample": False, "pad_token_id": 0, "output_logits": True, "return_dict_in_generate": True}


def assert_same_decoding(out, ref, label: str = "") -> None:
    """The same greedy tokens, and every step's logits equal to float rounding (1e-5)."""
    assert torch.equal(out.sequences, ref.sequences), label
    for a, b in zip(out.logits, ref.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def tiny_model(config_name: str, kwargs: dict) -> torch.nn.Module:
    """A tiny random causal LM of transformers' config class ``config_name`` (seed 0, the global
    generator left alone); the test is skipped where the installed release lacks the class. A model
    type the auto class does not map (Mistral 4 in 5.24) is built by its own ``...ForCausalLM``."""
    config_class = getattr(transformers, config_name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        config = config_class(**kwargs)
        if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return transformers.AutoModelForCausalLM.from_config(config).eval()
        return getattr(transformers, config_name.removesuffix("Config") + "ForCausalLM")(config).eval()


def assert_a_covering_budget_decodes_the_stock_models(model: torch.nn.Module) -> KVCakeCache:
    """``cake-adakv`` with a budget (64) covering a 40-token prompt and 5 new tokens decodes the stock
    model's greedy tokens and logits, alone and in a left-padded batch of two (kvcake's own attention
    over the stored entries there, which pairs each query head with its KV head by itself). Returns
    the cache of the unpadded run."""
    x = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    kw = {"max_new_tokens": 5, **GREEDY}
    with torch.no_grad():
        stock = model.generate(x, **kw)
    out, cache = kvcake.generate(model, x, "cake-adakv", budget=64, window=8, **kw)
    assert_same_decoding(out, stock)
    batch = torch.cat([x, torch.cat([torch.zeros(1, 3, dtype=torch.long), x[:, :-3]], 1)])
    mask = (torch.arange(40) >= torch.tensor([[0], [3]])).long()
    with torch.no_grad():
        stock = model.generate(batch, attention_mask=mask, **kw)
    out, _ = kvcake.generate(model, batch, "cake-adakv", budget=64, window=8, attention_mask=mask, **kw)
    assert_same_decoding(out, stock, "left-padded")
    return cache


def cache_states(cache) -> list[torch.Tensor]:
    """Every linear-attention state ``cache`` holds (a ``DynamicCache``'s or kvcake's ``RecurrentLayer``s and
    ``HybridLayer``s), in layer order; none on releases without transformers' per-state layer."""
    if LinearAttentionLayer is None:
        return []
    return [
        t for layer in cache.layers if isinstance(layer, LinearAttentionLayer) for t in held_states(layer)
    ]


def assert_a_saved_context_answers_as_before(model, ids, question, tmp_path, budget: int):
    """``cake`` (``budget``, window 4) compresses ``ids``: asking ``question`` twice gives one answer and
    leaves the context's states alone (a fork copies them); saved and read back, its states, bytes,
    teacher-forced logits and answer are the same. Returns the context."""
    ctx = kvcake.compress(model, ids, "cake", budget=budget, window=4)
    before = [t.clone() for t in cache_states(ctx.cache)]
    gen = {"max_new_tokens": 6, "do_sample": False}
    answer = ctx.generate(question, **gen)
    assert torch.equal(ctx.generate(question, **gen), answer)
    assert all(torch.equal(a, b) for a, b in zip(before, cache_states(ctx.cache), strict=True))
    ctx.save(tmp_path / "ctx.kvc")
    loaded = load_context(model, tmp_path / "ctx.kvc")
    got = cache_states(loaded.cache)
    assert len(got) == len(before) and all(torch.equal(a, b) for a, b in zip(before, got, strict=True))
    assert loaded.cache.kv_bytes() == ctx.cache.kv_bytes()
    # what generate asks layer 0 (a recurrent layer counts for itself in transformers 5.25)
    assert int(loaded.cache.get_seq_length()) == int(ctx.cache.get_seq_length()) == ids.shape[1]
    assert torch.equal(loaded.forward(question), ctx.forward(question))
    assert torch.equal(loaded.generate(question, **gen), answer)
    return ctx


def assert_the_replay_equals_compress(model, ids, question, budget: int) -> None:
    """The eval's replay of one recorded full-cache forward into ``cake`` (``budget``, window 4) keeps what
    ``kvcake.compress`` keeps: counts, every layer's keys (1e-6) and states (the full cache's, bit for
    bit), and the logits of ``question`` after it (1e-5)."""
    captured, full = Captured(), transformers.DynamicCache(config=model.config)
    with capture_queries(model, captured), torch.no_grad():
        logits = model(ids, **with_cache(model, full), logits_to_keep=1).logits[:, -1]
    method = kvcake.make_method("cake", budget=budget, window=4)
    got = replay_compress(model, method, captured, full, ids, logits)
    ref = kvcake.compress(model, ids, method)
    assert (got.cache.layer_counts() == ref.cache.layer_counts()).all()
    for a, b in zip(got.cache.layers, ref.cache.layers, strict=True):
        if a.keys is not None:
            torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=1e-6)
    assert all(
        torch.equal(x, y) for x, y in zip(cache_states(got.cache), cache_states(ref.cache), strict=True)
    )
    assert cache_states(got.cache)
    assert int(got.cache.get_seq_length()) == int(ref.cache.get_seq_length()) == ids.shape[1]
    torch.testing.assert_close(got.forward(question), ref.forward(question), rtol=0, atol=1e-5)


def beams_as_the_stock_models(model, ids, budget: int) -> KVCakeCache:
    """Beam search (3 beams, 6 tokens) with ``snapkv`` whose budget covers ``ids`` gives the stock model's
    beams; compressed to ``budget`` (window 4) it runs: its cache, which then holds the 3 beams."""
    kw = {"max_new_tokens": 6, "num_beams": 3, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        stock = model.generate(ids, **kw)
    out, _ = kvcake.generate(model, ids, "snapkv", budget=64, window=4, **kw)
    assert torch.equal(out, stock)
    out, cache = kvcake.generate(model, ids, "snapkv", budget=budget, window=4, **kw)
    assert out.shape[0] == ids.shape[0]
    return cache
