"""Saving and loading compressed contexts: exact round trips, clear refusals, atomic writes."""

import json
import os
import re
import stat
import struct

import numpy as np
import pytest
import safetensors.torch
import torch

import kvcake
from kvcake import storage
from kvcake.method import PRESETS
from kvcake.storage import ContextFileError, load_context, method_spec, read_context_info, save_context


def ids(n, seed=0):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def saved(tiny_llama, tmp_path_factory):
    """(context, path) of a CAKE-compressed context saved once for the refusal tests."""
    ctx = kvcake.compress(tiny_llama, ids(160), "cake", budget=24, window=8)
    path = tmp_path_factory.mktemp("ctx") / "cake.kvc"
    save_context(ctx, path, extra={"note": "hello"})
    return ctx, path


def assert_same_state(a: kvcake.KVCakeCache, b: kvcake.KVCakeCache) -> None:
    assert a.method == b.method
    assert np.array_equal(a.layer_counts(), b.layer_counts())
    assert np.array_equal(a.decode_budget, b.decode_budget)
    assert torch.equal(a.budgets, b.budgets)
    assert a.kv_bytes() == b.kv_bytes() and a.peak_kv_bytes == b.peak_kv_bytes
    for x, y in zip(
        a.entropy + a.variance + a.preferences, b.entropy + b.variance + b.preferences, strict=True
    ):
        assert torch.equal(x, y)
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert (la.layout, la.plain, la.length) == (lb.layout, lb.plain, lb.length)
        for name in ("keys", "values", "positions", "scores"):
            ta, tb = getattr(la, name), getattr(lb, name)
            assert (ta is None and tb is None) or torch.equal(ta, tb), name
        if la.layout == "ragged":
            assert torch.equal(la.meta.offsets, lb.meta.offsets) and la.meta.max_len == lb.meta.max_len


# h2o keeps its scores for decoding-time eviction; cake-adakv is ragged; criticalkv grows (decode=none)
@pytest.mark.parametrize("name", ["cake", "cake-adakv", "h2o", "criticalkv"])
def test_round_trip_is_exact(tiny_llama, tmp_path, name):
    ctx = kvcake.compress(tiny_llama, ids(150, seed=1), name, budget=24, window=8)
    assert any(layer.layout == "ragged" for layer in ctx.cache.layers) == (name == "cake-adakv")
    path = tmp_path / "ctx.kvc"
    ctx.save(path)  # CompressedContext.save -> storage.save_context
    loaded = load_context(tiny_llama, path)
    assert_same_state(ctx.cache, loaded.cache)
    assert torch.equal(loaded.input_ids, ctx.input_ids) and torch.equal(loaded.logits, ctx.logits)
    question = ids(6, seed=2)
    assert torch.equal(ctx.forward(question), loaded.forward(question)), "next-token logits differ"
    gen = {"max_new_tokens": 12, "do_sample": False}
    assert torch.equal(ctx.generate(question, **gen), loaded.generate(question, **gen))
    assert_same_state(ctx.cache, loaded.cache)  # answering changed neither


@pytest.mark.parametrize(
    "spec", [*PRESETS, "cake,layers.tau1=1.0,score.gamma=100", "layers=random,layers.seed=3,heads=adakv,heads.alpha=0.5",
             "snapkv,score.pooling=avg,score.kernel=3,select=critical,select.alpha=0.25,decode=fixed"],
)  # fmt: skip
def test_method_spec_round_trips(spec):
    for size in ({"budget": 64, "window": 16}, {"ratio": 0.3}):
        method = kvcake.make_method(spec, **size)
        text = method_spec(method)
        rebuilt = kvcake.make_method(text, **size).replace(name=method.name)
        assert rebuilt == method and rebuilt.describe() == method.describe()


def test_info_is_readable_without_a_model(saved):
    ctx, path = saved
    info = read_context_info(path)
    assert info["format_version"] == storage.FORMAT_VERSION
    assert info["method"]["describe"] == ctx.cache.method.describe()
    assert info["model"]["num_layers"] == 4 and info["model"]["num_kv_heads"] == 2
    assert info["budgets"] == ctx.cache.budgets.tolist()
    assert info["extra"] == {"note": "hello"}


def test_other_model_is_refused(saved, tiny_mha):
    _, path = saved
    with pytest.raises(
        ContextFileError,
        match=r"was saved for model .*2 KV heads.*; this is .*4 KV heads.*: load it with the model it was saved for",
    ):
        load_context(tiny_mha, path)


def test_other_dtype_is_refused(saved, make_tiny_llama):
    _, path = saved
    with pytest.raises(ContextFileError, match="bfloat16"):
        load_context(make_tiny_llama().to(torch.bfloat16), path)


def test_missing_file(tiny_llama, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such context file"):
        load_context(tiny_llama, tmp_path / "nope.kvc")


def test_arguments_the_wrong_way_round(saved, tiny_llama):
    _, path = saved
    fix = r"takes the model first, then the file, got \({}, {}\): kvcake.load_context\(model, 'doc.kvc'\)"
    with pytest.raises(TypeError, match=fix.format(type(path).__name__, "LlamaForCausalLM")):
        load_context(path, tiny_llama)
    with pytest.raises(TypeError, match=fix.format("str", "str")):
        load_context(str(path), str(path))


@pytest.mark.parametrize("keep", [0, 5, 8, 100, "header", "half", "all-but-one"])
def test_truncated_file_is_refused(saved, tiny_llama, tmp_path, keep):
    _, path = saved
    data = path.read_bytes()
    n = {"header": 8 + struct.unpack("<Q", data[:8])[0], "half": len(data) // 2, "all-but-one": len(data) - 1}
    cut = tmp_path / "cut.kvc"
    cut.write_bytes(data[: n.get(keep, keep)])
    with pytest.raises(ContextFileError, match="truncated|corrupted|not a kvcake"):
        load_context(tiny_llama, cut)


def test_any_flipped_byte_is_refused(saved, tiny_llama, tmp_path):
    """A flip anywhere (length prefix, JSON header, tensor data) fails loudly, never loads."""
    ctx, path = saved
    data = path.read_bytes()
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    where = {0, 3, 9, header_end // 2, header_end - 1, header_end, len(data) - 1}
    where |= set(np.linspace(0, len(data) - 1, 25).astype(int).tolist())
    bad = tmp_path / "bad.kvc"
    for i in sorted(where):
        flipped = bytearray(data)
        flipped[i] ^= 0x5A
        bad.write_bytes(bytes(flipped))
        with pytest.raises(ContextFileError):
            load_context(tiny_llama, bad)
    assert torch.equal(load_context(tiny_llama, path).logits, ctx.logits)  # the original still loads


def _rewrite(path, out, edit_meta=None, drop=None, edit_tensors=None):
    """Re-encode a saved file with its metadata edited, a tensor removed or tensors edited (valid checksum)."""
    tensors = safetensors.torch.load(path.read_bytes())
    with safetensors.safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["kvcake"])
    if edit_meta:
        edit_meta(meta)
    if drop:
        del tensors[drop]
    if edit_tensors:
        edit_tensors(tensors)
    text = json.dumps(meta, sort_keys=True)
    safetensors.torch.save_file(
        tensors, str(out), metadata={"kvcake": text, "kvcake.sha256": storage.format._digest(text, tensors)}
    )
    return out


def test_newer_format_version_is_refused(saved, tiny_llama, tmp_path):
    _, path = saved
    out = _rewrite(path, tmp_path / "v99.kvc", edit_meta=lambda m: m.update(format_version=99))
    with pytest.raises(ContextFileError, match="format version 99.*upgrade kvcake"):
        load_context(tiny_llama, out)
    out = _rewrite(path, tmp_path / "v0.kvc", edit_meta=lambda m: m.update(format_version="1"))
    with pytest.raises(ContextFileError, match="format version"):
        load_context(tiny_llama, out)


def test_missing_tensor_is_refused(saved, tiny_llama, tmp_path):
    _, path = saved
    out = _rewrite(path, tmp_path / "partial.kvc", drop="layers.2.values")
    with pytest.raises(ContextFileError, match=r"incomplete: 'layers.2.values' is missing"):
        load_context(tiny_llama, out)


def _set(section, key, value):
    return lambda meta: meta[section].update({key: value})


def _layer0(key, value):
    return lambda meta: meta["layers"][0].update({key: value})


def _retype(name, dtype):
    return lambda tensors: tensors.update({name: tensors[name].to(dtype)})


def _shift(name, by):
    return lambda tensors: tensors.update({name: tensors[name] + by})


def _cut(name, dim):  # one entry fewer along ``dim``
    return lambda tensors: tensors.update(
        {name: tensors[name].narrow(dim, 0, tensors[name].shape[dim] - 1).contiguous()}
    )


# A file whose checksum holds but whose description contradicts itself or its tensors (written by
# hand, or by another tool): each is refused with what does not fit, never loaded half-way.
INCONSISTENT = {
    "unbuildable method": ({"edit_meta": _set("method", "spec", "layers=nope")}, "its method .* cannot be rebuilt"),
    "method rebuilt otherwise": ({"edit_meta": _set("method", "window", 9)}, "its method rebuilds as .* not the saved"),
    "method field's type": ({"edit_meta": _set("method", "window", "8")}, "its method .* cannot be rebuilt: window"),
    "storage": ({"edit_meta": _set("cache", "kv_storage", "fp4")}, "its storage cannot be rebuilt"),
    "layer count": ({"edit_meta": lambda m: m["layers"].pop()}, r"it has \d+ layers, the model \d+"),
    "layout": ({"edit_meta": _layer0("layout", "sparse")}, "layer 0 has an unknown layout 'sparse'"),
    "float8 flag": ({"edit_meta": _layer0("fp8", True)}, "layer 0: its float8 storage does not match"),
    "kept entries": ({"edit_meta": lambda m: m["cache"].update(kept_entries=m["cache"]["kept_entries"] + 1)},
                     "the rebuilt cache does not hold what was saved"),
    "context length": ({"edit_meta": lambda m: m["context"].update(length=m["context"]["length"] + 1)},
                       "its context ids do not match its description"),
    "counts": ({"edit_tensors": _cut("layers.0.counts", 1)}, "layer 0 has inconsistent shapes"),
    "positions": ({"edit_tensors": _cut("layers.0.positions", 2)}, r"layer 0: dense keys \(.*\) do not fit the model"),
    # each of these loaded, then answered otherwise or failed at the first question
    "positions' dtype": ({"edit_tensors": _retype("layers.0.positions", torch.float32)},
                         "layers.0.positions holds torch.float32, not torch.int64"),
    "positions past the context": ({"edit_tensors": _shift("layers.0.positions", 1000)},
                                   "layers.0.positions holds positions outside the 160-token context"),
    "ids' dtype": ({"edit_tensors": _retype("context.input_ids", torch.float32)}, "context.input_ids holds torch.float32"),
    "keys' dtype": ({"edit_tensors": _retype("layers.1.keys", torch.float16)},
                    "layers.1.keys holds torch.float16, not the model's float32"),
    "mask": ({"edit_tensors": _cut("context.attention_mask", 1)}, r"its attention mask \(1, 159\) does not fit its ids"),
    "decoding budgets": ({"edit_tensors": _cut("cache.decode_budget", 1)}, "does not hold a context this model can rebuild"),
}  # fmt: skip


def test_float8_scales_must_be_one_positive_number():
    meta = {"context": {"length": 4}, "kv_dtype": "float32"}
    ids = {
        "context.input_ids": torch.zeros(1, 4, dtype=torch.long),
        "context.attention_mask": torch.ones(1, 4, dtype=torch.long),
    }
    for scale in (torch.tensor(0.0), torch.tensor(float("inf")), torch.ones(3)):
        with pytest.raises(ContextFileError, match="layers.0.key_scale must be one positive scale"):
            storage.reader._check_tensors({**ids, "layers.0.key_scale": scale}, meta)


@pytest.mark.parametrize("case", sorted(INCONSISTENT))
def test_inconsistent_file_is_refused(saved, tiny_llama, tmp_path, case):
    _, path = saved
    edits, message = INCONSISTENT[case]
    out = _rewrite(path, tmp_path / "edited.kvc", **edits)
    with pytest.raises(ContextFileError, match=message):
        load_context(tiny_llama, out)


def test_directory_is_refused(tiny_llama, tmp_path):
    with pytest.raises(ContextFileError, match="is a directory, not a kvcake context file"):
        load_context(tiny_llama, tmp_path)


def test_foreign_files_are_refused(tiny_llama, tmp_path):
    plain = tmp_path / "weights.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(3)}, str(plain))
    text = tmp_path / "notes.kvc"
    text.write_text("just some text, long enough to have a header length\n" * 4)
    for path in (plain, text):
        with pytest.raises(ContextFileError, match="not a kvcake context file|truncated"):
            load_context(tiny_llama, path)


def test_save_is_atomic(saved, monkeypatch, tmp_path):
    ctx, _ = saved
    target = tmp_path / "ctx.kvc"

    def crash(fh, data):  # half the bytes reach the disk, then the process "dies"
        fh.write(data[: len(data) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(storage.writer, "_write_chunks", crash)
    with pytest.raises(OSError, match="disk full"):
        save_context(ctx, target)
    assert not target.exists() and list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    save_context(ctx, target)
    before = target.read_bytes()
    monkeypatch.setattr(storage.writer, "_write_chunks", crash)
    with pytest.raises(OSError):
        save_context(ctx, target)
    assert target.read_bytes() == before and list(tmp_path.iterdir()) == [target]  # the old file survives


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_saved_file_has_the_permissions_open_gives(saved, tmp_path):
    """A new file gets 0o666 less the umask, as ``open(path, "wb")`` and safetensors give (it was the
    temporary file's 0o600: a server running as another user could not read a context saved for it);
    a file written over keeps its own mode."""
    ctx, _ = saved
    mask = os.umask(0o027)
    try:
        save_context(ctx, tmp_path / "new.kvc")
        open(tmp_path / "plain", "wb").close()
    finally:
        os.umask(mask)
    assert (
        stat.S_IMODE((tmp_path / "new.kvc").stat().st_mode)
        == stat.S_IMODE((tmp_path / "plain").stat().st_mode)
        == 0o640
    )
    (tmp_path / "new.kvc").chmod(0o604)
    save_context(ctx, tmp_path / "new.kvc")
    assert stat.S_IMODE((tmp_path / "new.kvc").stat().st_mode) == 0o604


def test_unprefilled_cache_is_refused(tiny_llama, saved, tmp_path):
    ctx, _ = saved
    empty = kvcake.CompressedContext(tiny_llama, kvcake.KVCakeCache(tiny_llama, "cake", budget=24, window=8),
                                     ctx.input_ids, ctx.attention_mask, ctx.logits)  # fmt: skip
    with pytest.raises(ValueError, match="prefilled"):
        save_context(empty, tmp_path / "x.kvc")
    with pytest.raises(TypeError, match="save_context takes a compressed context .*, got a KVCakeCache"):
        save_context(ctx.cache, tmp_path / "x.kvc")  # generate's cache, say (was an AttributeError)
    assert not (tmp_path / "x.kvc").exists()


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({1: "a"}, "extra= must be a dict with str keys, got {1: 'a'}"),  # JSON would read it back as '1'
        ([1, 2], "extra= must be a dict with str keys"),
        (0, "extra= must be a dict with str keys"),  # (was saved as {})
        ({"when": object()}, "extra= must hold JSON values"),
        ({"x": float("nan")}, "extra= must hold JSON values"),
    ],
)
def test_extra_that_json_would_not_keep_is_refused(tiny_llama, tmp_path, extra, words):
    ctx = kvcake.compress(tiny_llama, torch.arange(3, 40)[None], "snapkv", budget=16, window=4)
    with pytest.raises(TypeError, match=re.escape(words)):
        save_context(ctx, tmp_path / "ctx.kvc", extra=extra)
    assert not (tmp_path / "ctx.kvc").exists()


def test_a_base_model_is_refused_at_the_load(saved, tiny_llama):
    """``compress`` refuses a model without its language-model head; ``load_context`` took it, and
    its context failed at the first question (no ``generate``)."""
    with pytest.raises(
        TypeError, match="LlamaModel has no generate .a base model without its language-model"
    ):
        load_context(tiny_llama.model, saved[1])


def test_the_scenario_and_the_temperatures_provenance_survive_the_file(tiny_llama, tmp_path):
    """A context compressed for later questions came back question-aware, its temperatures' source
    "saved" with their set, indicator and rows gone: what ``inspect`` and the CLI print of it."""
    for scenario in ("context", "question"):
        ctx = kvcake.compress(tiny_llama, ids(90, 1), "cake", budget=24, window=8, scenario=scenario)
        save_context(ctx, tmp_path / "ctx.kvc")
        loaded = load_context(tiny_llama, tmp_path / "ctx.kvc")
        assert loaded.cache.scenario == ctx.cache.scenario
        assert loaded.cache.tau.describe() == ctx.cache.tau.describe() and loaded.cache.tau == ctx.cache.tau


def test_a_special_token_id_set_after_saving_still_loads_and_a_real_difference_is_named(
    make_tiny_llama, tmp_path
):
    """``model.config.pad_token_id = tokenizer.eos_token_id`` changes the fingerprint, not a key or
    a value: the same model was refused, by a message whose two descriptions read alike."""
    model = make_tiny_llama()
    ctx = kvcake.compress(model, ids(60, 1), "snapkv", budget=16, window=4)
    save_context(ctx, tmp_path / "ctx.kvc")
    question = torch.tensor([[5, 6, 7]])
    before = ctx.generate(question, max_new_tokens=3)
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    assert torch.equal(load_context(model, tmp_path / "ctx.kvc").generate(question, max_new_tokens=3), before)
    model.config.rms_norm_eps *= 2  # a field the keys depend on
    with pytest.raises(
        ContextFileError, match=r"its config differs in eos_token_id, pad_token_id, rms_norm_eps\)"
    ):
        load_context(model, tmp_path / "ctx.kvc")


def test_a_ragged_layer_whose_longest_segment_is_understated_is_refused(tiny_llama, tmp_path):
    """Loaded, then the first forward failed with an IndexError inside the attention."""
    ctx = kvcake.compress(tiny_llama, ids(90, 1), "adakv", budget=16, window=4)
    save_context(ctx, tmp_path / "ctx.kvc")
    ragged = next(i for i, layer in enumerate(ctx.cache.layers) if layer.layout == "ragged")
    out = _rewrite(tmp_path / "ctx.kvc", tmp_path / "edited.kvc", edit_meta=_layer(ragged, "max_len", 2))
    with pytest.raises(ContextFileError, match=f"layer {ragged}: ragged keys .* do not fit its lengths"):
        load_context(tiny_llama, out)


def _layer(lid, key, value):
    return lambda meta: meta["layers"][lid].update({key: value})
