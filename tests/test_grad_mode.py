"""Autograd and a KVCakeCache: a forward with gradients enabled (the default outside
``torch.no_grad``, where a user calls the model directly) runs every preset as under ``no_grad``,
its scores computed without gradients (the fused ``out=`` kernels cannot record them); the dynamic
layout backpropagates through the entries it keeps, as ``DynamicCache`` through all of them."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvcake
from kvcake.method import PRESETS

PROMPT, BUDGET, STEPS = 64, 40, 3
COMPRESSING = sorted(name for name in PRESETS if name != "full")
# every head of a layer keeps as many entries: the kept keys fit a DynamicCache (the reference)
DENSE = ("snapkv", "pyramidkv", "streamingllm", "tova", "h2o", "criticalkv", "cake")


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))


def _decode(model, cache, embeds: torch.Tensor, steps: torch.Tensor) -> list[torch.Tensor]:
    """Prefill ``embeds`` into ``cache``, then one forward per token of ``steps`` (1, n): their logits."""
    with kvcake.enable(model):
        model(inputs_embeds=embeds, **kvcake.with_cache(model, cache))
        return [
            model(steps[:, i : i + 1], **kvcake.with_cache(model, cache)).logits
            for i in range(steps.shape[1])
        ]


def _kept(cache) -> list[torch.Tensor]:
    return [cache.layers[lid].padded_positions() for lid in cache.compressed]


@pytest.mark.parametrize("method", COMPRESSING)
@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
def test_a_forward_with_gradients_runs_as_under_no_grad(tiny_llama, method, static):
    ids = _ids()
    runs = []
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            cache = kvcake.KVCakeCache(tiny_llama, method, budget=BUDGET, static=static)
            embeds = tiny_llama.get_input_embeddings()(ids[:, :PROMPT])
            runs.append((_decode(tiny_llama, cache, embeds, ids[:, PROMPT:]), _kept(cache)))
            scores = [cache.layers[lid].scores for lid in cache.compressed]
            assert not any(x.requires_grad for x in scores if x is not None), "H2O's sums would grow a graph"
    (with_grad, kept), (without, kept_without) = runs
    assert with_grad[-1].requires_grad
    for a, b in zip(with_grad, without, strict=True):  # h2o: SDPA's prompt attention, not its own loop
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(kept, kept_without, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("method", DENSE)
def test_the_dynamic_layout_backpropagates_through_its_kept_entries(tiny_llama, method):
    """The gradient of a decode step's logits with respect to the prompt's embeddings equals the one
    through a DynamicCache that holds the kept entries alone (gathered from a full prefill)."""
    ids = _ids()
    step = ids[:, PROMPT : PROMPT + 1]
    embeds = tiny_llama.get_input_embeddings()(ids[:, :PROMPT]).detach()

    e = embeds.clone().requires_grad_(True)
    cache = kvcake.KVCakeCache(tiny_llama, method, budget=BUDGET, static=False)
    with kvcake.enable(tiny_llama):
        tiny_llama(inputs_embeds=e, **kvcake.with_cache(tiny_llama, cache))
        kept_positions = _kept(cache)
        logits = tiny_llama(step, **kvcake.with_cache(tiny_llama, cache)).logits
    (grad,) = torch.autograd.grad(logits.square().sum(), e)

    e_ref = embeds.clone().requires_grad_(True)
    full = DynamicCache()
    tiny_llama(inputs_embeds=e_ref, **kvcake.with_cache(tiny_llama, full))
    kept = DynamicCache()
    for lid, positions in zip(cache.compressed, kept_positions, strict=True):
        assert cache.layers[lid].layout == "dense" and bool((positions >= 0).all()), "one count per layer"
        assert positions.shape[-1] < PROMPT, "the reference should evict"
        index = positions[..., None].expand(-1, -1, -1, full.layers[lid].keys.shape[-1])
        kept.update(full.layers[lid].keys.gather(2, index), full.layers[lid].values.gather(2, index), lid)
    ref_logits = tiny_llama(
        step, **kvcake.with_cache(tiny_llama, kept), position_ids=torch.tensor([[PROMPT]])
    ).logits
    (ref_grad,) = torch.autograd.grad(ref_logits.square().sum(), e_ref)

    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-5)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("method", COMPRESSING)
def test_a_covering_budget_backpropagates_as_the_full_cache(tiny_llama, method):
    ids = _ids()
    embeds = tiny_llama.get_input_embeddings()(ids[:, :PROMPT]).detach()
    grads = []
    for make in (
        DynamicCache,
        lambda: kvcake.KVCakeCache(tiny_llama, method, budget=PROMPT + 8, static=False),
    ):
        e = embeds.clone().requires_grad_(True)
        logits = _decode(tiny_llama, make(), e, ids[:, PROMPT:])
        grads.append(torch.autograd.grad(sum(x.square().sum() for x in logits), e)[0])
    assert torch.equal(grads[0], grads[1])
