"""Latent attention (MLA, ``kvcake.latent``) on the device: a compressed step equals the stock
model's attention over the kept latents, in float32 and bfloat16 (SDPA's kernels over keys wider
than the values), and compiled decoding (CUDA graphs on CUDA) gives the eager tokens. Runs on the
CPU too (``KVCAKE_TEST_DEVICE=cpu``)."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import DEVICE, ids

import kvcake
from kvcake.adapters import with_cache
from test_latent import _kept_as_dynamic_cache, _model

pytestmark = pytest.mark.cuda
# bf16: the absorbed query and output round where the stock expansion rounds the keys and values
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("spec", ["snapkv", "criticalkv"])
def test_a_compressed_step_is_the_models_attention_over_the_kept_latents(spec, static, dtype):
    model = _model().to(device=DEVICE, dtype=dtype)
    prompt = ids(40, seed=0)
    nxt, at = torch.tensor([[5]], device=DEVICE), torch.tensor([[40]], device=DEVICE)
    cache = kvcake.KVCakeCache(
        model, kvcake.make_method(spec, budget=16, window=4), static=static, max_cache_len=41
    )
    with kvcake.enable(model), torch.no_grad():
        model(prompt, **with_cache(model, cache))
    oracle = _kept_as_dynamic_cache(model, prompt, cache)
    with torch.no_grad():
        want = model(nxt, **with_cache(model, oracle), position_ids=at).logits.float()
        with kvcake.enable(model):
            got = model(nxt, **with_cache(model, cache), position_ids=at).logits.float()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("spec", ["snapkv", "h2o", "adakv"])
def test_compiled_decoding_gives_the_eager_tokens(spec):
    """float32: dense and ragged layers of one latent head, compiled whole."""
    model = _model().to(DEVICE)
    prompt = ids(30, seed=5)
    torch._dynamo.reset()
    kw = dict(budget=12, window=4, max_new_tokens=16, do_sample=False)
    out, cache = kvcake.generate(model, prompt, spec, compile=True, **kw)
    ref, _ = kvcake.generate(model, prompt, spec, compile=False, **kw)
    assert cache.is_compileable
    assert torch.equal(out, ref)
