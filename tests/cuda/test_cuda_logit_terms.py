"""GPT-OSS's sinks and Gemma 2's soft cap (``kvcake.logit_terms``) on the device: a compressed
step equals the stock model's eager attention over the kept entries, in float32 and bfloat16, and
compiled decoding (CUDA graphs on CUDA) gives the eager tokens. Runs on the CPU too
(``KVCAKE_TEST_DEVICE=cpu``)."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import DEVICE, assert_compiled_generate_is_eager, ids

from shared_checks import KWARGS_HANDOFF, kept_as_dynamic_cache, step_and_oracle_logits
from test_logit_terms import HYBRID, _gemma2, _gpt_oss

pytestmark = pytest.mark.cuda
MODELS = {"gpt_oss": _gpt_oss, "gemma2": _gemma2}
# the stock eager kernel rounds its probabilities to the model's dtype before the values; kvcake's
# explicit softmax keeps them in float32: in bf16 the two logits differed by up to 0.0045 on the CPU
# (float32: 2.5e-7), and the tolerance leaves a factor of ten for a GPU's kernels
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "static",
    [False, pytest.param(True, marks=pytest.mark.skipif(not KWARGS_HANDOFF, reason="kwargs hand-off"))],
)
@pytest.mark.parametrize("kind", list(MODELS))
def test_a_compressed_step_is_the_models_attention_over_the_kept_entries(kind, static, dtype):
    model = MODELS[kind](HYBRID).to(device=DEVICE, dtype=dtype)
    got, want, _ = step_and_oracle_logits(model, ids(40, seed=0), "snapkv", static, kept_as_dynamic_cache)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.skipif(not KWARGS_HANDOFF, reason="this transformers' models do not hand kwargs to cache.update")
@pytest.mark.parametrize("spec", ["snapkv", "h2o", "adakv"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_compiled_decoding_gives_the_eager_tokens(kind, spec):
    """float32: dense and ragged layers (the ragged ones take the reference softmax, as the
    variable-length kernels have no cap or sink), the sliding layer in its ring."""
    assert_compiled_generate_is_eager(MODELS[kind]().to(DEVICE), spec)
