"""Shared fixtures: the real default model, tiny random Llama models and a tiny hybrid Gemma 3.

Models are session-scoped and shared between tests: do not modify them in place (use
``make_tiny_llama`` for a private copy).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from transformers import Gemma3ForCausalLM, LlamaConfig, LlamaForCausalLM

from tiny_hybrid import _tiny_gemma3


def _cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_configure(config) -> None:
    """In a pytest-xdist worker (``make test``: one per core), torch gets the worker's share of the
    cores as threads: every worker using all of them left each waiting for the others' threads,
    and a suite in two workers took twice as long as in one process."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, _cores() // workers))


ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def _tiny_llama(*, num_key_value_heads: int = 2, attn_implementation: str = "sdpa") -> LlamaForCausalLM:
    """A 4-layer, 4-query-head random Llama (head_dim 16), float32, eval mode, seed 0."""
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=num_key_value_heads,
        head_dim=16,
        max_position_embeddings=4096,
        attn_implementation=attn_implementation,
    )
    with torch.random.fork_rng(devices=[]):  # same weights every time, global RNG untouched
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    return model.to(torch.float32).eval()


_cached_tiny_llama = functools.cache(_tiny_llama)


@pytest.fixture(scope="session")
def make_tiny_llama():
    """Factory for a fresh (unshared) tiny Llama: ``make_tiny_llama(num_key_value_heads=..., attn_implementation=...)``."""
    return _tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(request) -> LlamaForCausalLM:
    """Shared tiny GQA Llama (4 query heads, 2 KV heads).

    SDPA attention unless parametrised indirectly, e.g.
    ``@pytest.mark.parametrize("tiny_llama", ["sdpa", "eager"], indirect=True)``.
    """
    return _cached_tiny_llama(num_key_value_heads=2, attn_implementation=getattr(request, "param", "sdpa"))


@pytest.fixture(scope="session")
def tiny_mha(request) -> LlamaForCausalLM:
    """Shared tiny multi-head Llama (4 query heads, 4 KV heads); parametrisable like ``tiny_llama``."""
    return _cached_tiny_llama(num_key_value_heads=4, attn_implementation=getattr(request, "param", "sdpa"))


_cached_tiny_gemma3 = functools.cache(_tiny_gemma3)


@pytest.fixture(scope="session")
def tiny_gemma3(request) -> Gemma3ForCausalLM:
    """Shared tiny hybrid Gemma 3 (see ``_tiny_gemma3``); parametrisable like ``tiny_llama``."""
    return _cached_tiny_gemma3(getattr(request, "param", "sdpa"))


@pytest.fixture(scope="session")
def default_model():
    """``(model, tokenizer)`` of the real default model (SmolLM2-135M-Instruct), loaded once.

    Uses the normal conversion cache, so a test run converts the GGUF file at most once.
    """
    from kvcake.models import load_model

    return load_model()


def pytest_collection_modifyitems(config, items):
    """Mark every test that uses the real model as ``integration``, so ``-m "not integration"`` skips it."""
    for item in items:
        if "default_model" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)
