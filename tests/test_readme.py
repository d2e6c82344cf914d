"""The README's Python code runs verbatim: on a tiny random model in the fast suite (the
default model's loader swapped for it), and on the real default model in the integration suite.

A snippet that uses an undefined name, an argument that does not exist or a return value the
wrong way round fails here."""

import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import kvcake

README = Path(__file__).resolve().parents[1] / "README.md"
TEMPLATE = (
    "{% for m in messages %}<|user|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


SKIP = "<!-- not run by tests/test_readme.py:"  # a block that needs what no test has (torchrun, the Hub)


def python_blocks() -> list[str]:
    found = re.findall(
        r"([^\n]*)\n```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S | re.M
    )
    blocks = [code for before, code in found if not before.startswith(SKIP)]
    assert blocks, "the README has no Python code"
    return blocks


def test_only_marked_blocks_are_skipped():
    text = README.read_text(encoding="utf-8")
    marked = text.count(SKIP)
    assert len(python_blocks()) == text.count("```python\n") - marked
    assert marked <= 1, "skip a README block only when it cannot run anywhere tests run"


def _tiny_tokenizer():
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|end|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(128 - len(specials))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>", pad_token="<pad>", additional_special_tokens=specials[4:])  # fmt: skip
    tok.chat_template = TEMPLATE
    return tok


def run_blocks(tmp_path, monkeypatch, capsys) -> str:
    monkeypatch.chdir(tmp_path)  # the snippets write doc.kvc
    for i, code in enumerate(python_blocks()):
        exec(compile(code, f"README.md python block {i + 1}", "exec"), {"__name__": "__readme__"})
    assert (tmp_path / "doc.kvc").is_file()
    return capsys.readouterr().out


def test_readme_python_runs_verbatim_on_a_tiny_model(make_tiny_llama, tmp_path, monkeypatch, capsys):
    model, tok = make_tiny_llama(), _tiny_tokenizer()
    monkeypatch.setattr(kvcake, "load_model", lambda *a, **k: (model, tok))
    out = run_blocks(tmp_path, monkeypatch, capsys)
    assert out.count("\n") >= 6


@pytest.mark.integration
def test_readme_python_runs_verbatim_on_the_default_model(default_model, tmp_path, monkeypatch, capsys):
    out = run_blocks(tmp_path, monkeypatch, capsys)
    lines = out.splitlines()
    assert lines[1] == "The secret code is 4417."  # the full cache finds it, as the README says
    assert lines[0] == "The secret code is 4417."  # and so does the recommended method
