"""A hybrid model's sliding layers decode in their ring on the device (``kvcake.sliding``), and
``kvcake.generate(compile=True)`` compiles the decoding forward there (CUDA graphs through
``mode="reduce-overhead"`` on CUDA): the same tokens as eager decoding. Runs on the CPU too
(``KVCAKE_TEST_DEVICE=cpu``: inductor without CUDA graphs)."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import DEVICE, graphs_captured, ids
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import kvcake
from shared_checks import KWARGS_HANDOFF

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not KWARGS_HANDOFF, reason="this transformers' models do not hand kwargs to cache.update"
    ),
]


def _gemma3(dtype: torch.dtype) -> Gemma3ForCausalLM:
    """4 sliding layers (window 12) and 2 global ones, 4 query / 2 KV heads, head_dim 16, seed 0."""
    config = Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        max_position_embeddings=4096, attn_implementation="sdpa",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Gemma3ForCausalLM(config)
    return model.to(device=DEVICE, dtype=dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_hybrid_models_compiled_decode_gives_eager_tokens(dtype):
    model = _gemma3(dtype)
    prompt = ids(30, seed=5)
    torch._dynamo.reset()
    kw = dict(budget=8, window=4, max_new_tokens=24, do_sample=False)
    (out, cache), graphs = graphs_captured(
        lambda: kvcake.generate(model, prompt, "snapkv", compile=True, **kw)
    )
    ref, _ = kvcake.generate(model, prompt, "snapkv", compile=False, **kw)
    assert cache.is_compileable and graphs == 1  # the ring and generate's mask: one column each
    assert all(cache.layers[i].static == "ring" for i in (0, 1, 3, 4))
    assert all(cache.layers[i].cumulative_length == out.shape[1] - 1 for i in (0, 1, 3, 4))
    if dtype == torch.float32:  # bf16: inductor's fusions round differently, and near-tied greedy tokens flip
        assert torch.equal(out, ref)
