"""Kept entries stored in float8 (``kv_dtype="fp8"``, ``kvcake.fp8``).

What must hold: the prompt is compressed exactly as without it (same kept positions, same
budgets); each stored entry is the model-dtype entry rounded to float8 with its layer's scale (bit
for bit, the scale a power of two); the bytes held are one per element, plus the last ``RECENT``
tokens' entries in the model's dtype, which the attention reads instead (with every token among
them, float8 storage decodes bit for bit as the model's dtype); decoding follows the model-dtype
cache within float8's rounding, static storage equals the dynamic reference, a compiled step is
one graph; saved contexts, beams and hybrid models keep it; bad values are refused naming the
choices.
"""

from __future__ import annotations

import pytest
import torch

import kvcake
from kvcake import PRESETS, KVCakeCache, make_method, varlen
from kvcake import fp8 as fp8_module
from kvcake.adapters import with_cache
from kvcake.bench.step_counts import GraphCounter
from kvcake.bench.step_counts import tiny_llama as counts_llama
from kvcake.fp8 import FP8, HEADROOM, RECENT, decode, encode, recent_bytes, store
from kvcake.sliding import SlidingLayer
from kvcake.step import ragged as ragged_step
from test_cli import call, model_args, tiny_dir  # noqa: F401 (tiny_dir: the CLI's tiny model folder)
from test_compile import needs_kwargs_handoff
from test_varlen import fake_kernel

STEPS = 8


def _prompt(length: int = 80, batch: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :12] = 0  # left padding on the second sequence
    return ids, mask


def _decode(model, spec, kv_dtype, static=True, batch=1, step=None, budget=24):
    """Prefill, then ``STEPS`` single-token steps of the same tokens whatever the logits (so that
    runs compare step by step); -> (logits (STEPS + 1, B, V), cache)."""
    ids, mask = _prompt(batch=batch)
    fed = torch.randint(3, 128, (batch, STEPS), generator=torch.Generator().manual_seed(7))
    cache = KVCakeCache(model, make_method(spec, budget=budget, window=4), static=static,
                        max_cache_len=ids.shape[1] + STEPS, kv_dtype=kv_dtype)  # fmt: skip
    step = step or model.forward
    with kvcake.enable(model), torch.no_grad():
        out = model(ids, attention_mask=mask, **with_cache(model, cache))
        logits = [out.logits[:, -1]]
        for i in range(STEPS):
            tok = fed[:, i : i + 1]
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            out = step(tok, attention_mask=mask, **with_cache(model, cache),
                       position_ids=mask.cumsum(-1)[:, -1:] - 1)  # fmt: skip
            logits.append(out.logits[:, -1])
    return torch.stack(logits), cache


def _prefilled(model, spec, kv_dtype, budget=24):
    ids, mask = _prompt(batch=2)
    cache = KVCakeCache(model, make_method(spec, budget=budget, window=4), static=False, kv_dtype=kv_dtype)
    with kvcake.enable(model), torch.no_grad():
        model(ids, attention_mask=mask, **with_cache(model, cache))
    return cache


@pytest.mark.parametrize("spec", list(PRESETS))
def test_the_prompt_is_compressed_alike_and_stored_as_its_entries_rounded_to_float8(tiny_llama, spec):
    ref, fp8 = _prefilled(tiny_llama, spec, None), _prefilled(tiny_llama, spec, "fp8")
    torch.testing.assert_close(fp8.budgets, ref.budgets, rtol=0, atol=0)
    for lid in ref.compressed:
        a, b = ref.layers[lid], fp8.layers[lid]
        assert torch.equal(a.positions, b.positions) and (a.counts == b.counts).all()
        assert b.keys.dtype == torch.uint8 and b.values.dtype == torch.uint8 and b.dtype == a.dtype
        pos = a.padded_positions()  # (B, H_kv, N), -1 on a ragged layer's padding
        latest = pos >= a.length - RECENT  # the last RECENT tokens' kept entries
        rings = (
            (a.keys, b.keys, b.kv_scales[0], b.recent_keys),
            (a.values, b.values, b.kv_scales[1], b.recent_values),
        )
        for held, stored, scale, ring in rings:
            # a power of two that maps the prompt's largest kept magnitude into (224, 448] / HEADROOM
            ratio = float(held.abs().amax() / scale)
            assert torch.finfo(FP8).max / HEADROOM / 2 < ratio <= torch.finfo(FP8).max / HEADROOM
            assert float(torch.log2(scale)).is_integer()
            assert torch.equal(stored, encode(held, scale))  # bit for bit
            rel = (decode(stored, scale) - held).abs() / held.abs().clamp_min(scale * 2**-6)
            assert float(rel.max()) <= 1 / 16 + 1e-6  # e4m3: 3 mantissa bits, round to nearest
            # the latest entries also exactly, unscaled, each in its head's ring slot position % RECENT
            slot = (pos % RECENT).unsqueeze(-1).expand(*pos.shape, ring.shape[-1])
            assert torch.equal(ring.gather(2, slot)[latest] * scale, a.padded(held, 0)[latest])
        assert torch.equal(b.recent_positions.gather(2, pos % RECENT)[latest], pos[latest])
        assert int((b.recent_positions >= 0).sum()) == int(latest.sum())  # and nothing else
        # one byte per element, where the model's float32 takes four, and the rings in float32
        assert recent_bytes(b) == 2 * b.batch * b.kv_heads * RECENT * b.keys.shape[-1] * 4
        assert (b.kv_bytes() - recent_bytes(b)) * 4 == a.kv_bytes()
    parts = fp8.kv_bytes_parts()
    assert parts.full == ref.kv_bytes_parts().full  # the full cache's bytes: the model's dtype
    rings = sum(recent_bytes(fp8.layers[lid]) for lid in fp8.compressed)
    assert (parts.compressed - rings) * 4 == ref.kv_bytes_parts().compressed


@pytest.mark.parametrize("spec", list(PRESETS))
def test_decoding_follows_the_model_dtype_cache_and_static_equals_the_reference(tiny_llama, spec):
    ref, _ = _decode(tiny_llama, spec, None, batch=2)
    static, cache = _decode(tiny_llama, spec, "fp8", batch=2)
    dynamic, _ = _decode(tiny_llama, spec, "fp8", static=False, batch=2)
    assert torch.equal(static[0], ref[0])  # the prompt's forward computes in the model's dtype
    # float8's rounding: over every step where nothing is evicted while decoding; with decode=fixed
    # the first step (a victim chosen by slightly different attention may differ afterwards)
    steps = STEPS + 1 if cache.method.decode == "none" else 2
    assert float((static - ref)[:steps].abs().amax() / ref.abs().amax()) < 0.05
    torch.testing.assert_close(static, dynamic, rtol=1e-5, atol=1e-5)
    for lid in cache.compressed:
        layer = cache.layers[lid]
        assert layer.keys.dtype == torch.uint8 and (layer.static is not None or layer.plain)


@pytest.mark.parametrize("spec", list(PRESETS))
@pytest.mark.parametrize("static", [True, False])
def test_with_every_token_held_exactly_float8_decodes_as_the_model_dtype(
    tiny_llama, spec, static, monkeypatch
):
    """A ring as long as the prompt and the steps: every entry the attention reads is its exact
    copy, and the power-of-two scales moved onto the query and the output round nothing."""
    monkeypatch.setattr(fp8_module, "RECENT", 128)
    ref, _ = _decode(tiny_llama, spec, None, static=static, batch=2)
    got, cache = _decode(tiny_llama, spec, "fp8", static=static, batch=2)
    assert all(cache.layers[lid].keys.dtype == torch.uint8 for lid in cache.compressed)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("spec", ["snapkv", "adakv"])
@pytest.mark.parametrize("static", [True, False])
def test_the_attention_reads_the_last_tokens_exactly_and_the_rest_in_float8(
    tiny_llama, spec, static, monkeypatch
):
    """A ring shorter than the steps (it wraps twice): after decoding, what the attention reads of
    each entry is the model-dtype cache's entry exactly for the last ``RECENT`` tokens and rounded
    to float8 for every older one (a token whose slot was reused is read in float8 again). The
    first layer: its entries are the tokens' own in both caches (later layers' differ by float8's
    effect on the layers below)."""
    monkeypatch.setattr(fp8_module, "RECENT", 3)
    _, ref = _decode(tiny_llama, spec, None, static=False)
    _, cache = _decode(tiny_llama, spec, "fp8", static=static)
    cache.compact()  # the dynamic layout, position order (static storage is laid out anew)
    a, b = ref.layers[0], cache.layers[0]
    assert 0 in cache.compressed and torch.equal(a.positions, b.positions)
    latest = b.positions >= b.length - 3
    assert int(latest.sum()) == 3 * b.batch * b.kv_heads  # decode=none: every new token is kept
    for held, stored, scale, pick in (
        (a.keys, b.keys, b.kv_scales[0], 0),
        (a.values, b.values, b.kv_scales[1], 1),
    ):
        unscaled = stored.view(FP8).to(b.dtype)
        read = (
            fp8_module.exact_recent(b, unscaled, unscaled, b.positions, fp8_module.ring_base(b))[pick] * scale
        )
        assert torch.equal(read[latest], held[latest])
        assert torch.equal(read[~latest], decode(encode(held, scale), scale)[~latest])


def test_without_a_ring_every_entry_is_read_in_float8(tiny_llama, monkeypatch, tmp_path):
    """``RECENT = 0``: no ring, one byte per element and nothing else; decoding as with the ring up
    to float8's rounding (static equals dynamic)."""
    monkeypatch.setattr(fp8_module, "RECENT", 0)
    ref, ref_cache = _decode(tiny_llama, "snapkv", None)
    got, cache = _decode(tiny_llama, "snapkv", "fp8")
    dynamic, _ = _decode(tiny_llama, "snapkv", "fp8", static=False)
    assert all(cache.layers[lid].recent_keys is None for lid in cache.compressed)
    assert cache.kv_bytes() * 4 == ref_cache.kv_bytes()
    assert float((got - ref).abs().amax() / ref.abs().amax()) < 0.05
    torch.testing.assert_close(got, dynamic, rtol=1e-5, atol=1e-5)
    ctx = kvcake.compress(tiny_llama, _prompt(length=60)[0], "adakv", budget=24, window=4, kv_dtype="fp8")
    ctx.save(tmp_path / "no_ring.kvc")  # a context without rings saves and loads as such
    loaded = kvcake.load_context(tiny_llama, tmp_path / "no_ring.kvc")
    assert all(loaded.cache.layers[lid].recent_keys is None for lid in loaded.cache.compressed)
    question = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(5))
    assert torch.equal(loaded.generate(question, max_new_tokens=6), ctx.generate(question, max_new_tokens=6))


@pytest.mark.parametrize("spec", ["adakv", "critical-adakv", "layer-defensivekv"])
def test_static_ragged_float8_through_the_varlen_kernel(tiny_llama, monkeypatch, spec):
    """The variable-length kernel's route (faked on the CPU as in ``tests/test_static.py``) reads
    each segment's slots in place, its recent entries found through the slots' segments: float8
    decodes as the dynamic reference, and with a ring covering every token bit for bit as the
    model's dtype through the same kernel."""
    calls: list = []
    monkeypatch.setattr(varlen, "_torch_varlen", lambda: fake_kernel(calls, torch_api=True))
    monkeypatch.setattr(ragged_step, "choose_route", lambda device, dtype, *, seqused=False: "torch-varlen")
    static, cache = _decode(tiny_llama, spec, "fp8", batch=2)
    dynamic, _ = _decode(tiny_llama, spec, "fp8", static=False, batch=2)
    layers = [cache.layers[lid] for lid in cache.compressed]
    assert all(layer.varlen_route == "torch-varlen" and layer.keys.dtype == torch.uint8 for layer in layers)
    assert len(calls) >= STEPS * len(layers)
    torch.testing.assert_close(static, dynamic, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(fp8_module, "RECENT", 128)
    assert torch.equal(
        _decode(tiny_llama, spec, "fp8", batch=2)[0], _decode(tiny_llama, spec, None, batch=2)[0]
    )


def test_a_covering_budget_stores_the_whole_prompt_in_float8(tiny_llama, monkeypatch):
    """Nothing evicted (plain layers, read by the model's own kernel): the entries are still held in
    float8 and handed to the kernel decoded."""
    ref, ref_cache = _decode(tiny_llama, "snapkv", None, budget=200)
    got, cache = _decode(tiny_llama, "snapkv", "fp8", budget=200)
    assert all(cache.layers[lid].plain for lid in cache.compressed)
    rings = sum(recent_bytes(cache.layers[lid]) for lid in cache.compressed)
    assert (cache.kv_bytes() - rings) * 4 == ref_cache.kv_bytes()
    assert torch.equal(got[0], ref[0]) and float((got - ref).abs().amax() / ref.abs().amax()) < 0.05
    monkeypatch.setattr(
        fp8_module, "RECENT", 128
    )  # every token held exactly too: decoded as the model's dtype
    assert torch.equal(_decode(tiny_llama, "snapkv", "fp8", budget=200)[0], ref)


def test_a_later_entry_past_the_range_saturates(tiny_llama):
    cache = _prefilled(tiny_llama, "snapkv", "fp8")
    layer = cache.layers[cache.compressed[0]]
    scale = layer.kv_scales[0]
    big = torch.full((2, layer.kv_heads, 1, layer.keys.shape[-1]), 1e4) * scale
    stored = encode(big, scale)
    assert torch.equal(decode(stored, scale), torch.full_like(big, 448.0) * scale)  # clamped, no nan/inf


@needs_kwargs_handoff
@pytest.mark.parametrize("spec", ["snapkv", "cake", "adakv", "cake-adakv"])
def test_a_float8_decode_step_compiles_whole(spec):
    model = counts_llama(2)
    torch._dynamo.reset()
    counter = GraphCounter()
    step = torch.compile(model.forward, backend=counter, fullgraph=True)
    compiled, _ = _decode(model, spec, "fp8", batch=2, step=step)
    eager, _ = _decode(model, spec, "fp8", batch=2)
    assert counter.graphs <= 2
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_generate_compress_and_answer_take_kv_dtype(tiny_llama, tmp_path):
    ids, _ = _prompt(length=60)
    out, cache = kvcake.generate(tiny_llama, ids, "snapkv", budget=24, window=4, max_new_tokens=5,
                                 kv_dtype="fp8")  # fmt: skip
    assert cache.kv_dtype == "fp8" and out.shape[0] == 1 and out.shape[1] > 60
    assert all(cache.layers[lid].keys.dtype == torch.uint8 for lid in cache.compressed)
    # beams reorder float8 storage like any other (sequences.py moves bytes)
    beams, _ = kvcake.generate(tiny_llama, ids, "cake", budget=24, window=4, max_new_tokens=5, num_beams=3,
                               kv_dtype="fp8")  # fmt: skip
    beams_dynamic, _ = kvcake.generate(tiny_llama, ids, "cake", budget=24, window=4, max_new_tokens=5,
                                       num_beams=3, kv_dtype="fp8", static=False)  # fmt: skip
    assert torch.equal(beams, beams_dynamic)
    # a compressed context keeps its float8 entries, saved and loaded as they are
    ctx = kvcake.compress(tiny_llama, ids, "adakv", budget=24, window=4, kv_dtype="fp8")
    question = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(5))
    answer = ctx.generate(question, max_new_tokens=6)
    ctx.save(tmp_path / "doc.kvc")
    loaded = kvcake.load_context(tiny_llama, tmp_path / "doc.kvc")
    assert loaded.cache.kv_dtype == "fp8" and loaded.cache.kv_bytes() == ctx.cache.kv_bytes()
    for lid in ctx.cache.compressed:
        a, b = ctx.cache.layers[lid], loaded.cache.layers[lid]
        assert torch.equal(a.keys, b.keys) and torch.equal(a.kv_scales[0], b.kv_scales[0])
    assert torch.equal(loaded.generate(question, max_new_tokens=6), answer)


def test_hybrid_models_store_their_global_layers_in_float8(tiny_gemma3, tmp_path):
    ctx = kvcake.compress(tiny_gemma3, _prompt(length=60)[0], "cake", budget=24, window=4, kv_dtype="fp8")
    question = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(5))
    ctx.save(tmp_path / "hybrid.kvc")
    loaded = kvcake.load_context(tiny_gemma3, tmp_path / "hybrid.kvc")
    assert torch.equal(loaded.generate(question, max_new_tokens=6), ctx.generate(question, max_new_tokens=6))
    ref, ref_cache = _decode(tiny_gemma3, "cake", None)
    got, cache = _decode(tiny_gemma3, "cake", "fp8")
    for layer in cache.layers:
        assert layer.keys.dtype == (torch.float32 if isinstance(layer, SlidingLayer) else torch.uint8)
    parts, ref_parts = cache.kv_bytes_parts(), ref_cache.kv_bytes_parts()
    rings = sum(recent_bytes(cache.layers[lid]) for lid in cache.compressed)
    assert parts.sliding == ref_parts.sliding and (parts.compressed - rings) * 4 == ref_parts.compressed
    assert float((got - ref)[:2].abs().amax() / ref.abs().amax()) < 0.05  # (cake: decode=fixed, as above)


@pytest.mark.parametrize("bad", ["int8", "fp16", torch.float16, 8])
def test_other_storage_types_are_refused_naming_the_choices(tiny_llama, bad):
    with pytest.raises(ValueError, match=r"kv_dtype must be None \(keep the model's dtype\) or 'fp8'"):
        KVCakeCache(tiny_llama, "snapkv", budget=24, window=4, kv_dtype=bad)
    with pytest.raises(ValueError, match="kv_dtype must be"):
        kvcake.generate(
            tiny_llama, _prompt()[0], "snapkv", budget=24, window=4, max_new_tokens=2, kv_dtype=bad
        )


@pytest.mark.parametrize("recent", [0, 5])
def test_the_ring_length_is_an_option_of_every_entry_point(tiny_llama, recent):
    """``kv_recent`` on the cache, ``generate``, ``compress`` and ``answer``'s path: rings of that
    many slots (0: none); the bytes follow."""
    ids = _prompt(length=60)[0]
    _, cache = kvcake.generate(tiny_llama, ids, "snapkv", budget=24, window=4, max_new_tokens=3,
                               kv_dtype="fp8", kv_recent=recent)  # fmt: skip
    ctx = kvcake.compress(tiny_llama, ids, "adakv", budget=24, window=4, kv_dtype="fp8", kv_recent=recent)
    for c in (cache, ctx.cache):
        rings = [c.layers[lid].recent_positions for lid in c.compressed]
        assert all(r is None for r in rings) if recent == 0 else all(r.shape[-1] == recent for r in rings)
        layer = c.layers[c.compressed[0]]
        assert (
            fp8_module.recent_bytes(layer)
            == 2 * layer.batch * layer.kv_heads * recent * layer.keys.shape[-1] * 4
        )
        assert fp8_module.ring_length(c) == recent


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_a_ring_length_that_is_not_a_count_is_refused(tiny_llama, bad):
    with pytest.raises(
        ValueError, match=r"kv_recent= must be a count of tokens >= 0 \(0: no ring; default 32\)"
    ):
        KVCakeCache(tiny_llama, "snapkv", budget=24, window=4, kv_dtype="fp8", kv_recent=bad)


def test_a_ring_length_without_float8_is_refused_naming_the_fix(tiny_llama):
    with pytest.raises(ValueError, match="pass kv_dtype=.fp8. with it, or drop kv_recent="):
        KVCakeCache(tiny_llama, "snapkv", budget=24, window=4, kv_recent=8)
    with pytest.raises(ValueError, match="pass kv_dtype='fp8' with it"):
        kvcake.compress(tiny_llama, _prompt()[0], "snapkv", budget=24, window=4, kv_recent=8)


def test_a_ring_longer_than_the_models_positions_is_refused(tiny_llama):
    """Rings are allocated whole: kv_recent=10**6 asked for gigabytes per layer (the process was
    killed); past the model's 4096 positions it holds nothing more than 4096 slots do."""
    limit = tiny_llama.config.max_position_embeddings
    KVCakeCache(tiny_llama, "snapkv", budget=24, window=4, kv_dtype="fp8", kv_recent=limit)
    with pytest.raises(
        ValueError, match=rf"kv_recent=1000000 is more tokens than the model has positions \({limit}\)"
    ):
        kvcake.generate(tiny_llama, _prompt()[0], "snapkv", budget=24, window=4, kv_dtype="fp8", kv_recent=10**6,
                        max_new_tokens=1)  # fmt: skip


def test_the_names_of_float8_are_taken(tiny_llama):
    for name in ("fp8", "float8_e4m3fn", torch.float8_e4m3fn):
        assert KVCakeCache(tiny_llama, "snapkv", budget=24, window=4, kv_dtype=name).kv_dtype == "fp8"


def test_the_command_line_stores_in_float8(tiny_dir, tmp_path, capsys, monkeypatch):  # noqa: F811
    small = [
        *model_args(tiny_dir),
        "--method",
        "snapkv",
        "--budget",
        "24",
        "--window",
        "8",
        "--max-new-tokens",
        "4",
    ]
    code, _, err = call(
        capsys, monkeypatch, ["generate", *small, "--prompt", "w1 w2 w3 " * 20, "--kv-dtype", "fp8"]
    )
    assert code == 0, err
    assert "(kept entries in fp8, the last 32 tokens' also exact)" in err
    kvc = str(tmp_path / "doc.kvc")
    code, _, err = call(capsys, monkeypatch, ["save", *small[:-2], "--context-file", str(tiny_dir / "doc.txt"),
                                              "--out", kvc, "--kv-dtype", "fp8", "--kv-recent", "0"])  # fmt: skip
    assert code == 0, err
    assert "(kept entries in fp8)" in err
    code, _, err = call(capsys, monkeypatch, ["generate", "--load", kvc, "--question", "w3"])
    assert code == 0 and "(kept entries in fp8)" in err, err  # the file's storage: no ring
    for extra in (["--kv-dtype", "fp8"], ["--kv-recent", "8"]):
        code, _, err = call(capsys, monkeypatch, ["generate", "--load", kvc, "--question", "w3", *extra])
        assert code == 2 and "--kv-dtype/--kv-recent" in err
    code, _, err = call(capsys, monkeypatch, ["generate", *small, "--prompt", "w1 w2", "--kv-recent", "8"])
    assert code == 2 and "pass --kv-dtype fp8 with it, or drop --kv-recent" in err
    code, _, err = call(capsys, monkeypatch, ["generate", *small, "--prompt", "w1", "--kv-dtype", "int8"])
    assert code == 2 and "invalid choice: 'int8'" in err


@pytest.mark.parametrize("spec", ["snapkv", "adakv", "cake"])
def test_storing_a_compressed_cache_afterwards_equals_storing_it_at_the_prompts_end(tiny_llama, spec):
    """``fp8.store`` (what the evaluation does after replaying a recorded prefill) holds the same
    bits, scales and positions as ``kv_dtype="fp8"``."""
    later = _prefilled(tiny_llama, spec, None)
    store(later)
    direct = _prefilled(tiny_llama, spec, "fp8")
    assert later.kv_dtype == "fp8" and later.kv_bytes() == direct.kv_bytes()
    for lid in direct.compressed:
        a, b = later.layers[lid], direct.layers[lid]
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(a.positions, b.positions)
        assert all(torch.equal(x, y) for x, y in zip(a.kv_scales, b.kv_scales, strict=True))
    with pytest.raises(ValueError, match="takes a cache whose prompt was compressed"):
        store(KVCakeCache(tiny_llama, "snapkv", budget=24, window=4))


def test_a_device_without_float8_conversions_is_refused_naming_the_fix(tiny_llama, monkeypatch):
    """torch's MPS backend has no float8 (pytorch#148420): a cache asking for it on such a device is
    refused at construction, naming the device and the fix, not at the end of the prompt."""
    from kvcake import fp8

    assert fp8._conversion_problem("cpu") is None  # the probe itself, on this machine's CPU
    said = "Trying to convert Float8_e4m3fn to the MPS backend but it does not have support for that dtype."
    monkeypatch.setattr(fp8, "_conversion_problem", lambda device: said)
    with pytest.raises(
        ValueError, match=r"cannot convert to on cpu \(Trying to convert .*\): leave kv_dtype unset"
    ):
        KVCakeCache(tiny_llama, "snapkv", budget=24, window=4, kv_dtype="fp8")
    cache = _prefilled(tiny_llama, "snapkv", None)  # not asked: not probed
    with pytest.raises(ValueError, match="cannot convert to on cpu"):
        fp8.store(cache)  # the evaluation's way, afterwards
    assert cache.kv_dtype is None


def test_a_float16_layer_of_tiny_magnitudes_keeps_a_nonzero_scale():
    """The power of two fitting magnitudes of 1e-6 is 2^-28, below float16's smallest normal: it
    rounded to a scale of 0 and every entry decoded as 0. Clamped to the smallest normal (2^-14),
    the entries keep their float8 precision."""
    keys = torch.full((1, 1, 4, 8), 1e-6, dtype=torch.float16)
    key_scale, _ = fp8_module.scales_of(keys, torch.randn(1, 1, 4, 8).half(), torch.float16)
    assert float(key_scale) == torch.finfo(torch.float16).tiny
    torch.testing.assert_close(decode(encode(keys, key_scale), key_scale), keys, rtol=0.07, atol=0)
