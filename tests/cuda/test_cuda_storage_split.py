"""Saved contexts load onto the test device, and a model split across devices with accelerate's
``device_map`` (first half of the layers on the test device, the rest on the CPU) runs and
matches the same model on one device."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import DEVICE, ids

import kvcake
from kvcake.devices import layer_devices
from kvcake.storage import load_context, save_context

HOST = torch.device("cpu")


def _on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (t.device.index or 0) == (device.index or 0)


@pytest.mark.parametrize("name", ["cake", "cake-adakv", "h2o", "criticalkv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_saved_context_loads_on_the_device(on_device, tmp_path, name, dtype):
    model = on_device(dtype)
    ctx = kvcake.compress(model, ids(150, seed=1), name, budget=24, window=8)
    save_context(ctx, tmp_path / "ctx.kvc")
    loaded = load_context(model, tmp_path / "ctx.kvc")
    for layer in loaded.cache.layers:
        assert _on(layer.keys, DEVICE) and _on(layer.values, DEVICE) and _on(layer.positions, DEVICE)
    assert loaded.cache.budgets.device == HOST and all(p.device == HOST for p in loaded.cache.preferences)
    question = ids(6, seed=2)
    assert torch.equal(ctx.forward(question), loaded.forward(question))
    torch.testing.assert_close(
        ctx.generate(question, max_new_tokens=6, do_sample=False),
        loaded.generate(question, max_new_tokens=6, do_sample=False),
    )


def test_context_saved_on_the_cpu_loads_on_the_device(on_device, make_tiny_llama, tmp_path):
    cpu_model = make_tiny_llama()
    ctx = kvcake.compress(cpu_model, ids(150, seed=3).cpu(), "cake", budget=24, window=8)
    save_context(ctx, tmp_path / "ctx.kvc")
    model = on_device(torch.float32)
    loaded = load_context(model, tmp_path / "ctx.kvc")
    assert all(_on(layer.keys, DEVICE) for layer in loaded.cache.layers)
    question = ids(6, seed=4)
    # the same float32 weights on two devices: kernels differ, so close, not equal
    torch.testing.assert_close(
        loaded.forward(question).cpu(), ctx.forward(question.cpu()), atol=1e-4, rtol=1e-4
    )


@pytest.fixture(scope="module")
def split_model(make_tiny_llama):
    """The tiny Llama with embeddings and layers 0-1 on the test device, layers 2-3, the final
    norm and the head on the CPU (float32)."""
    accelerate = pytest.importorskip("accelerate")
    model = make_tiny_llama()
    dev = DEVICE.index if DEVICE.type == "cuda" else str(DEVICE)
    dev = 0 if dev is None else dev
    device_map = {
        "model.embed_tokens": dev, "model.rotary_emb": dev, "model.layers.0": dev, "model.layers.1": dev,
        "model.layers.2": "cpu", "model.layers.3": "cpu", "model.norm": "cpu", "lm_head": "cpu",
    }  # fmt: skip
    # main_device="cpu": the "cpu" layers run on the CPU. With a GPU main device accelerate would
    # offload them instead (weights on meta, run on the GPU: test_offloaded_layers_cache_where_they_run)
    return accelerate.dispatch_model(model, device_map=device_map, main_device="cpu")


def test_offloaded_layers_cache_where_they_run(make_tiny_llama):
    """accelerate's CPU offload (a "cpu" entry with a GPU main device): the layer's weights wait on the
    meta device and it runs on the GPU, so its cache lives on the GPU."""
    accelerate = pytest.importorskip("accelerate")
    if DEVICE.type != "cuda":
        pytest.skip("offloading needs a GPU main device")
    model = make_tiny_llama()
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                  "model.layers.2": "cpu", "model.layers.3": "cpu", "model.norm": 0, "lm_head": 0}  # fmt: skip
    model = accelerate.dispatch_model(model, device_map=device_map)
    assert model.model.layers[3].self_attn.q_proj.weight.device.type == "meta", "accelerate offloads"
    assert all(_on(torch.empty(0, device=d), DEVICE) for d in layer_devices(model, 4))
    prompt = ids(120, seed=7)
    out, cache = kvcake.generate(
        model, prompt, "cake", budget=40, window=8, max_new_tokens=6, do_sample=False
    )
    assert all(_on(layer.keys, DEVICE) for layer in cache.layers)
    ref, _ = kvcake.generate(make_tiny_llama(), prompt.cpu(), "cake", budget=40, window=8, max_new_tokens=6,
                             do_sample=False)  # fmt: skip
    assert out.shape == ref.shape


@pytest.mark.parametrize("name", ["cake", "snapkv", "cake-adakv", "criticalkv", "h2o"])
def test_split_model_runs_and_matches_one_device(split_model, make_tiny_llama, tmp_path, name):
    reference = make_tiny_llama()  # the same weights, all on the CPU
    prompt = ids(160, seed=5, batch=2)
    kw = dict(budget=40, window=8, max_new_tokens=10, do_sample=False)
    out, cache = kvcake.generate(split_model, prompt, name, **kw)
    ref_out, ref_cache = kvcake.generate(reference, prompt.cpu(), name, **kw)
    expected = layer_devices(split_model, 4)
    assert _on(torch.empty(0, device=expected[0]), DEVICE) and expected[2:] == [HOST, HOST]
    for layer, dev in zip(cache.layers, expected, strict=True):
        assert _on(layer.keys, dev), f"a layer's cache lives on its layer's device ({dev})"
    assert torch.equal(cache.budgets.sum(1), ref_cache.budgets.sum(1))
    # CAKE's budgets round float preferences computed by other kernels: one entry may move
    # between layers; every other allocation depends on integers only.
    slack = 1 if cache.method.layers.needs_preferences else 0
    assert int((cache.budgets - ref_cache.budgets).abs().max()) <= slack
    assert torch.equal(out.cpu(), ref_out)
    ctx = kvcake.compress(split_model, prompt, name, budget=40, window=8)
    save_context(ctx, tmp_path / "split.kvc")
    loaded = load_context(split_model, tmp_path / "split.kvc")
    for layer, dev in zip(loaded.cache.layers, expected, strict=True):
        assert _on(layer.keys, dev)
    question = ids(5, seed=6, batch=2)
    torch.testing.assert_close(loaded.forward(question), ctx.forward(question))
