"""Latent attention (MLA, ``kvcake.latent``) on the device: a compressed step equals the stock
model's attention over the kept latents, in float32 and bfloat16 (SDPA's kernels over keys wider
than the values), and compiled decoding (CUDA graphs on CUDA) gives the eager tokens. Runs on the
CPU too (``KVCAKE_TEST_DEVICE=cpu``)."""

from __future__ import annotations

import functools

import pytest
import torch
from cuda_helpers import DEVICE, assert_compiled_generate_is_eager, ids

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
