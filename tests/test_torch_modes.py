"""A KVCakeCache under torch's modes. Gradients enabled (the default outside ``torch.no_grad``,
where a user calls the model directly): every preset runs as under ``no_grad``, its scores computed
without gradients (the fused ``out=`` kernels cannot record them), and the dynamic layout
backpropagates through the entries it keeps, as ``DynamicCache`` through all of them. Autocast:
every preset and layout runs. Inference mode: a cache prefilled inside it decodes outside it."""

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


def _kept_sets(cache) -> list[list[int]]:
    """Each KV head's kept positions, ascending, whatever the layout's order and padding."""
    return [sorted(row[row >= 0].tolist()) for p in _kept(cache) for row in p.reshape(-1, p.shape[-1])]


@pytest.mark.parametrize("method", COMPRESSING)
@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
def test_a_forward_with_gradients_runs_as_under_no_grad(tiny_llama, method, static):
    ids = _ids()
    runs = []
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            cache = kvcake.KVCakeCache(tiny_llama, method, budget=BUDGET, static=static)
            embeds = tiny_llama.get_input_embeddings()(ids[:, :PROMPT])
            runs.append((_decode(tiny_llama, cache, embeds, ids[:, PROMPT:]), _kept_sets(cache)))
            scores = [cache.layers[lid].scores for lid in cache.compressed]
            assert not any(x.requires_grad for x in scores if x is not None), "H2O's sums would grow a graph"
    (with_grad, kept), (without, kept_without) = runs
    assert with_grad[-1].requires_grad
    for a, b in zip(with_grad, without, strict=True):  # h2o: SDPA's prompt attention, not its own loop
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert kept == kept_without  # (static storage moves to the dynamic layout where autograd records)


@pytest.mark.parametrize("method", DENSE)
@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
def test_a_cache_backpropagates_through_its_kept_entries(tiny_llama, method, static):
    """The gradient of a decode step's logits with respect to the prompt's embeddings equals the one
    through a DynamicCache that holds the kept entries alone (gathered from a full prefill). Static
    storage, written in place, moves to the dynamic layout at the first step autograd records (its
    backward failed: "modified by an inplace operation")."""
    ids = _ids()
    step = ids[:, PROMPT : PROMPT + 1]
    embeds = tiny_llama.get_input_embeddings()(ids[:, :PROMPT]).detach()

    e = embeds.clone().requires_grad_(True)
    cache = kvcake.KVCakeCache(tiny_llama, method, budget=BUDGET, static=static)
    with kvcake.enable(tiny_llama):
        tiny_llama(inputs_embeds=e, **kvcake.with_cache(tiny_llama, cache))
        kept_positions = [p.sort(-1).values for p in _kept(cache)]  # static storage: slot order, empty slots
        kept_positions = [p[..., int((p < 0).sum(-1).max()) :] for p in kept_positions]
        logits = tiny_llama(step, **kvcake.with_cache(tiny_llama, cache)).logits
    assert not cache.static and all(cache.layers[lid].static is None for lid in cache.compressed)
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


@pytest.mark.parametrize("method", COMPRESSING)
def test_autocast_runs_every_preset(tiny_llama, method):
    """Under CPU autocast (bf16) the rotated keys come out float32 and the values bf16; the ragged
    reference's write of a bf16 einsum into its float32 logits failed. A covering budget decodes as
    DynamicCache does under the same autocast, and the layouts agree to bf16 rounding."""
    ids = _ids()

    def run(make):
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            embeds = tiny_llama.get_input_embeddings()(ids[:, :PROMPT])
            return torch.stack(_decode(tiny_llama, make(), embeds, ids[:, PROMPT:])).float()

    full = run(DynamicCache)
    covering = run(lambda: kvcake.KVCakeCache(tiny_llama, method, budget=PROMPT + 8))
    static, dynamic = (
        run(lambda s=s: kvcake.KVCakeCache(tiny_llama, method, budget=BUDGET, static=s))
        for s in (True, False)
    )
    assert torch.equal(covering, full)
    assert static.isfinite().all()
    torch.testing.assert_close(static, dynamic, rtol=0, atol=0.1)  # bf16 matmuls: near-ties may flip an entry


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_gemma3"])
@pytest.mark.parametrize("method", ["snapkv", "adakv", "cake", "h2o", "criticalkv"])
@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_a_cache_prefilled_in_inference_mode_decodes_outside_it(request, model_name, method, kv_dtype):
    """Static storage made inside ``torch.inference_mode`` could not be written outside it ("Inplace update
    to inference tensor"), as transformers' StaticCache cannot: it is moved back to the dynamic layout at
    the first step outside, and decodes as a cache prefilled under ``no_grad``."""
    if kv_dtype and model_name == "tiny_gemma3":
        pytest.skip("float8 storage is for models without sliding layers")
    model = request.getfixturevalue(model_name)
    ids = _ids().clamp(max=model.config.vocab_size - 1)
    runs = []
    for prefill in (torch.no_grad, torch.inference_mode):
        cache = kvcake.KVCakeCache(model, method, budget=BUDGET, max_cache_len=PROMPT + 8, kv_dtype=kv_dtype)
        with kvcake.enable(model):
            with prefill():
                model(ids[:, :PROMPT], **kvcake.with_cache(model, cache))
            with torch.no_grad():
                runs.append(
                    [model(ids[:, i : i + 1], **kvcake.with_cache(model, cache)).logits for i in range(STEPS)]
                )
        assert not any(
            lay.keys.is_inference()
            for lay in cache.layers
            if isinstance(getattr(lay, "keys", None), torch.Tensor)
        )
    for a, b in zip(*runs, strict=True):  # (Gemma 3's ring read back in the dynamic layout: float32 rounding)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_attention_dropout_in_training_mode_is_refused(make_tiny_llama):
    """A model in training mode asks its attention for dropout, which kvcake's own attention (the
    steps after the prompt) never applied: refused before the cache moves, with the fix."""
    model = make_tiny_llama()
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    ids = _ids()
    cache = kvcake.KVCakeCache(model, "snapkv", budget=BUDGET)
    with kvcake.enable(model), torch.no_grad():
        model.train()
        with pytest.raises(ValueError, match=r"dropout 0.1, which kvcake's attention .* call model.eval\(\)"):
            model(ids[:, :PROMPT], **kvcake.with_cache(model, cache))
        model.eval()  # the same model in eval mode: no dropout asked
        cache = kvcake.KVCakeCache(model, "snapkv", budget=BUDGET)
        model(ids[:, :PROMPT], **kvcake.with_cache(model, cache))
        assert cache.prefilled


def _dynamo_carries_messages() -> bool:
    """Whether fullgraph dynamo's error for an exception raised in an inlined call carries its message
    (torch 2.13 and 2.15 do; 2.7.1's says ``raised exception ExceptionVariable(<class 'ValueError'>)``)."""

    def inner(x):
        raise ValueError("the probe's own words")

    try:
        torch.compile(lambda x: inner(x) + 1, fullgraph=True, backend="eager")(torch.ones(1))  # host
    except Exception as error:  # dynamo's own type varies by release
        return "the probe's own words" in str(error)
    raise AssertionError("the probe raised nothing")


def test_a_compiled_step_with_gradients_names_the_fix(tiny_llama):
    """Compiled, a step cannot move the cache to the dynamic layout: with gradients enabled it failed
    inside inductor ("modified by an inplace operation ... Good luck!"); it names the fix now (fullgraph
    reports it as dynamo's observed exception, with this message; a torch whose dynamo drops the
    message of an exception raised in an inlined call, as 2.7.1's does, names the ValueError alone)."""
    words = r"gradients enabled.*decode under torch.no_grad\(\).*static=False"
    if not _dynamo_carries_messages():
        words = r"ValueError"
    ids = _ids()
    cache = kvcake.KVCakeCache(tiny_llama, "snapkv", budget=BUDGET, max_cache_len=PROMPT + 8)
    step = torch.compile(tiny_llama.forward, fullgraph=True)
    with kvcake.enable(tiny_llama):
        with torch.no_grad():
            tiny_llama(ids[:, :PROMPT], **kvcake.with_cache(tiny_llama, cache))
        with pytest.raises(Exception, match=words):
            step(
                ids[:, PROMPT : PROMPT + 1],
                position_ids=torch.tensor([[PROMPT]]),
                **kvcake.with_cache(tiny_llama, cache),
            )
