"""Latent attention (MLA, ``kvcake.latent``) on the device: a compressed step equals the stock
model's attention over the kept latents, in float32 and bfloat16 (SDPA's kernels over keys wider
than the values), compiled decoding (CUDA graphs on CUDA) gives the eager tokens, and latents kept
in float8 decode as bfloat16's where every token is in the ring. Runs on the CPU too
(``KVCAKE_TEST_DEVICE=cpu``)."""

from __future__ import annotations

import functools

import pytest
import torch
from cuda_helpers import DEVICE, assert_compiled_generate_is_eager, ids
from test_cuda_fp8 import _decode

from kvcake import fp8
from shared_checks import kept_as_dynamic_cache, step_and_oracle_logits
from test_latent import _model

pytestmark = pytest.mark.cuda
# bf16: the absorbed query and output round where the stock expansion rounds the keys and values
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("spec", ["snapkv", "criticalkv"])
def test_a_compressed_step_is_the_models_attention_over_the_kept_latents(spec, static, dtype):
    model = _model().to(device=DEVICE, dtype=dtype)
    got, want, _ = step_and_oracle_logits(
        model, ids(40, seed=0), spec, static, functools.partial(kept_as_dynamic_cache, split=16)
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("spec", ["snapkv", "h2o", "adakv"])
def test_compiled_decoding_gives_the_eager_tokens(spec):
    """float32: dense and ragged layers of one latent head, compiled whole."""
    assert_compiled_generate_is_eager(_model().to(DEVICE), spec)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("spec", ["snapkv", "adakv"])
def test_float8_latents_decode_as_bfloat16_where_every_token_is_exact(spec, static, monkeypatch):
    """``kv_dtype="fp8"`` in bfloat16: within float8's rounding with the default ring; with a ring
    covering every token, the bfloat16 cache's logits bit for bit."""
    model = _model().to(device=DEVICE, dtype=torch.bfloat16)
    bf16, _ = _decode(model, spec, static, None)
    got, cache = _decode(model, spec, static, "fp8")
    assert all(cache.layers[lid].keys.dtype == torch.uint8 for lid in cache.compressed)
    assert float((got - bf16).abs().amax() / bf16.abs().amax()) < 0.1
    monkeypatch.setattr(fp8, "RECENT", 256)
    exact, _ = _decode(model, spec, static, "fp8")
    assert torch.equal(exact, bf16)
