"""Helpers of the device suite (imported by its tests; the fixtures are in conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM

import kvcake

DEVICE = torch.device(os.environ.get("KVCAKE_TEST_DEVICE", "cuda"))
# Half precisions every preset must run in; float32 where a check needs exactness.
HALF = (torch.bfloat16, torch.float16)


def deep_llama(num_layers: int = 16) -> LlamaForCausalLM:
    """A deeper random Llama (head_dim 64, 4 KV heads) whose full KV cache outweighs its
    activations at a few thousand tokens: the case the cascade exists for. float32, seed 0."""
    config = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=8192,
        attn_implementation="sdpa",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    return model.eval()


def ids(n: int, seed: int = 0, batch: int = 1, vocab: int = 128) -> torch.Tensor:
    """Random token ids (batch, n), made on the host (same ids on every machine), on the device."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, n), generator=g).to(DEVICE)


def graphs_captured(call):
    """``(call(), graphs dynamo captured during it)``, with whichever backend compiles them (dynamo's
    ``unique_graphs`` counter, which ``torch._dynamo.reset`` leaves as it was: the difference)."""
    before = counters["stats"]["unique_graphs"]
    out = call()
    return out, counters["stats"]["unique_graphs"] - before


def assert_compiled_generate_is_eager(model, spec: str) -> None:
    """``kvcake.generate`` of 16 greedy tokens (budget 12, window 4) on a 30-token prompt: the cache
    is compileable and the compiled decoding (CUDA graphs on CUDA) is one graph, no recompile (the
    4-D mask ``generate`` builds is one column wide), and gives the eager tokens."""
    prompt = ids(30, seed=5)
    torch._dynamo.reset()
    kw = dict(budget=12, window=4, max_new_tokens=16, do_sample=False)
    (out, cache), graphs = graphs_captured(lambda: kvcake.generate(model, prompt, spec, compile=True, **kw))
    ref, _ = kvcake.generate(model, prompt, spec, compile=False, **kw)
    assert cache.is_compileable and graphs == 1
    assert torch.equal(out, ref)


def needs_cuda_memory() -> None:
    if DEVICE.type != "cuda":
        pytest.skip(f"measures torch.cuda memory; the suite runs on {DEVICE}")
