"""The decode step is something ``torch.compile`` can trace: a stock transformers StaticCache inside
``kvcake.enable(model)`` compiles to the same graphs as outside it (no Python-side state, such as
a ContextVar, read in the attention call).

Compiling costs tens of seconds on a CPU: the model is tiny (2 layers) and the tests few, marked slow.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

import kvcake

pytestmark = pytest.mark.slow


def _two_layer_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        attn_implementation="sdpa",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    return model.eval()


class _GraphCounter:
    """A torch.compile backend that runs each captured graph eagerly and counts them."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def _decode_static_cache(model, inside: bool, steps: int = 6):
    torch._dynamo.reset()
    counter = _GraphCounter()
    step = torch.compile(model.forward, backend=counter, fullgraph=True)
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    cache = StaticCache(config=model.config, max_cache_len=64)
    logits = []
    with kvcake.enable(model) if inside else contextlib.nullcontext(), torch.no_grad():
        out = model(ids, cache=cache, cache_position=torch.arange(16))
        tok = out.logits[:, -1:].argmax(-1)
        for i in range(steps):
            out = step(tok, cache=cache, cache_position=torch.tensor([16 + i]))
            tok = out.logits[:, -1:].argmax(-1)
            logits.append(out.logits[:, -1])
    return counter.graphs, torch.cat(logits)


def test_a_stock_static_cache_compiles_inside_enable_exactly_as_outside():
    model = _two_layer_llama()
    graphs_out, logits_out = _decode_static_cache(model, inside=False)
    graphs_in, logits_in = _decode_static_cache(model, inside=True)
    assert graphs_out <= 2
    assert graphs_in == graphs_out
    torch.testing.assert_close(logits_in, logits_out, rtol=0, atol=0)
