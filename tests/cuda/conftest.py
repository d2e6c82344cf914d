"""The device suite: the core invariants of kvcake on a GPU (marker ``cuda``).

Every test here takes its device from the ``device`` fixture: ``cuda`` by default (the whole
folder is skipped when no GPU is visible, so CI on a CPU passes), or whatever
``KVCAKE_TEST_DEVICE`` names, e.g. ``KVCAKE_TEST_DEVICE=cpu`` to run the same tests on the CPU
(the tests that measure CUDA memory then skip). ``make test-cuda`` runs it.
"""

from __future__ import annotations

import os

import pytest
import torch
from cuda_helpers import DEVICE
from transformers import LlamaForCausalLM


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(
        reason="no CUDA device visible (set KVCAKE_TEST_DEVICE=cpu to run these on the CPU)"
    )
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.cuda)
            if DEVICE.type == "cuda" and not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return DEVICE


@pytest.fixture(scope="session")
def on_device(make_tiny_llama):
    """``on_device(dtype, kv_heads=2)``: the shared tiny Llama of ``tests/conftest.py`` moved to
    the test device in ``dtype`` (one copy per combination, reused across tests)."""
    copies: dict[tuple, LlamaForCausalLM] = {}

    def get(dtype: torch.dtype = torch.float32, kv_heads: int = 2) -> LlamaForCausalLM:
        key = (dtype, kv_heads)
        if key not in copies:
            copies[key] = make_tiny_llama(num_key_value_heads=kv_heads).to(DEVICE, dtype)
        return copies[key]

    return get
