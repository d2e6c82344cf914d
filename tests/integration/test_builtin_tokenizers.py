"""The built-in models' tokenizers are their GGUF files' (kvcake.gguf_tokenizer): as loaded, with
the transformers this environment has. On releases that convert Gemma-3's vocabulary unfaithfully
(before ``FAITHFUL_FROM``) loading it is refused, naming the upgrade. ``make test-floor`` runs this
file on the floor's transformers (5.0.0) with a fresh converted-model cache."""

from __future__ import annotations

import pytest
import transformers
from packaging.version import Version

from kvcake.gguf_tokenizer import FAITHFUL_FROM, check_tokenizer, read_tokenizer_meta
from kvcake.models import load_model, resolve_builtin

pytestmark = pytest.mark.integration

BEFORE_FAITHFUL = Version(transformers.__version__) < Version(FAITHFUL_FROM)


def test_default_model_tokenizer_is_its_files():
    """On every release in range: transformers before 5.18 name <|im_start|> SmolLM2's EOS (5.0
    also adds it as BOS); the conversion sets both from the file."""
    name = "smollm2-135m-instruct"
    meta = read_tokenizer_meta(resolve_builtin(name).gguf_path())
    _, tok = load_model(name)
    check_tokenizer(tok, meta, name)
    assert tok.eos_token == "<|im_end|>" and not meta.add_bos
    assert tok("hello world")["input_ids"] == tok("hello world", add_special_tokens=False)["input_ids"]


@pytest.mark.skipif(BEFORE_FAITHFUL, reason=f"transformers before {FAITHFUL_FROM}: the refusal is tested")
def test_gemma3_tokenizer_is_its_files():
    name = "gemma3-270m"
    meta = read_tokenizer_meta(resolve_builtin(name).gguf_path())
    _, tok = load_model(name)
    check_tokenizer(tok, meta, name)
    ids = tok("hello")["input_ids"]
    assert meta.add_bos and ids[0] == meta.bos_id and tok.convert_ids_to_tokens(ids[1:]) == ["hello"]


@pytest.mark.skipif(
    not BEFORE_FAITHFUL, reason=f"transformers {FAITHFUL_FROM} or later converts it faithfully"
)
def test_gemma3_refused_where_transformers_converts_its_vocabulary_unfaithfully():
    with pytest.raises(ValueError, match=r"vocabulary's ordinary tokens encode back") as err:
        load_model("gemma3-270m")
    assert f"pip install -U 'transformers>={FAITHFUL_FROM}'" in str(err.value)
