"""kvcake.gguf_tokenizer without a real model: the header reader against gguf's own reader, and
the check and alignment of a converted tokenizer on small byte-pair tokenizers."""

from __future__ import annotations

import dataclasses

import pytest
from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from kvcake.gguf_tokenizer import (
    FAITHFUL_FROM,
    GGUFTokenizerMeta,
    align_special_tokens,
    check_tokenizer,
    read_tokenizer_meta,
    read_tokenizer_meta_reference,
)

gguf = pytest.importorskip("gguf")

TOKENS = ["<unk>", "<bos>", "<eos>", "a", "b", "c", "d", "ab", "cd", "abcd", "ba", "dc"]
TYPES = [2, 3, 3] + [1] * (len(TOKENS) - 3)  # unknown, control, control, then ordinary tokens
MERGES = [("a", "b"), ("c", "d"), ("ab", "cd"), ("b", "a"), ("d", "c")]


def _write_gguf(path, endian=None, **keys):
    """A GGUF file with no tensors: the tokenizer keys given plus keys of every other kind, which
    the reader must step over."""
    kw = {} if endian is None else {"endianess": endian}
    w = gguf.GGUFWriter(str(path), "llama", **kw)
    w.add_string("general.name", "tiny")
    if "model" in keys:
        w.add_tokenizer_model(keys["model"])
    if "space" in keys:
        w.add_add_space_prefix(keys["space"])
    w.add_float32("general.some_float", 0.5)
    w.add_uint64("general.some_u64", 7)
    w.add_array("general.some_strings", ["x", "yz", ""])
    w.add_array("general.some_floats", [1.5, 2.5])
    if "tokens" in keys:
        w.add_token_list(keys["tokens"])
    if "types" in keys:
        w.add_token_types(keys["types"])
    if "merges" in keys:
        w.add_token_merges([f"{x} {y}" for x, y in keys["merges"]])
    if "bos" in keys:
        w.add_bos_token_id(keys["bos"])
    if "eos" in keys:
        w.add_eos_token_id(keys["eos"])
    if "add_bos" in keys:
        w.add_add_bos_token(keys["add_bos"])
    w.add_bool("general.some_flag", True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


FULL = dict(tokens=TOKENS, types=TYPES, merges=MERGES, bos=1, eos=2, add_bos=True, model="gpt2", space=False)


@pytest.mark.parametrize("endian", [None, "big"])
def test_header_reader_equals_gguf_reader(tmp_path, endian):
    e = None if endian is None else gguf.GGUFEndian.BIG
    path = _write_gguf(tmp_path / "t.gguf", endian=e, **FULL)
    meta = read_tokenizer_meta(path)
    assert meta == read_tokenizer_meta_reference(path)
    assert meta == GGUFTokenizerMeta(
        bos_id=1,
        eos_id=2,
        add_bos=True,
        normal_ids=tuple(range(3, len(TOKENS))),
        model="gpt2",
        add_space_prefix=False,
    )


def test_header_reader_without_tokenizer_keys(tmp_path):
    path = _write_gguf(tmp_path / "t.gguf")
    assert (
        read_tokenizer_meta(path)
        == read_tokenizer_meta_reference(path)
        == GGUFTokenizerMeta(None, None, None, ())
    )
    path = _write_gguf(tmp_path / "u.gguf", tokens=TOKENS, add_bos=False)
    assert read_tokenizer_meta(path) == read_tokenizer_meta_reference(path)
    assert read_tokenizer_meta(path).add_bos is False


def test_header_reader_refuses_other_files(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_tokenizer_meta(path)


def _tokenizer(merges=MERGES, add_bos=True, eos="<eos>") -> PreTrainedTokenizerFast:
    """A byte-pair tokenizer of TOKENS: with MERGES "abcd" is one token; without, four."""
    vocab = {t: i for i, t in enumerate(TOKENS)}
    backend = Tokenizer(BPE(vocab=vocab, merges=list(merges), unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.BPEDecoder()
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 1)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<bos>", eos_token=eos
    )


META = GGUFTokenizerMeta(
    bos_id=1, eos_id=2, add_bos=True, normal_ids=tuple(range(3, len(TOKENS))), model="gpt2"
)


def test_faithful_tokenizer_passes():
    tok = _tokenizer()
    assert tok("abcd")["input_ids"] == [1, TOKENS.index("abcd")]
    check_tokenizer(tok, META, "t.gguf")
    assert align_special_tokens(tok, META) == []


def test_vocabulary_without_merges_is_refused_naming_the_upgrade():
    tok = _tokenizer(merges=[])
    assert tok("abcd", add_special_tokens=False)["input_ids"] == [3, 4, 5, 6]
    with pytest.raises(ValueError, match="t.gguf unfaithfully") as err:
        check_tokenizer(tok, META, "t.gguf")
    msg = str(err.value)
    assert "of its vocabulary's ordinary tokens encode back" in msg and "'ab' -> ['a', 'b']" in msg
    with pytest.raises(ValueError, match="encode back"):
        check_tokenizer(tok, META, "t.gguf", special=False)
    assert f"pip install -U 'transformers>={FAITHFUL_FROM}'" in msg


@pytest.mark.parametrize(
    ("model", "space", "sampled"),
    [("gpt2", None, True), ("llama", False, True), ("llama", True, False), ("llama", None, False)],
)
def test_vocabulary_sampled_only_where_tokens_round_trip(model, space, sampled):
    """A SentencePiece vocabulary that adds a space before the text (or does not say) encodes a
    continuation piece as a word start, so only its special tokens are checked."""
    meta = dataclasses.replace(META, model=model, add_space_prefix=space)
    assert meta.round_trips is sampled
    if sampled:
        with pytest.raises(ValueError, match="encode back"):
            check_tokenizer(_tokenizer(merges=[]), meta, "t.gguf")
    else:
        check_tokenizer(_tokenizer(merges=[]), meta, "t.gguf")


def test_wrong_special_tokens_are_refused_then_set_from_the_file():
    tok = _tokenizer(add_bos=False, eos="<unk>")
    with pytest.raises(ValueError, match=r"EOS token is id 0, the file's is 2; it adds no BOS"):
        check_tokenizer(tok, META, "t.gguf")
    check_tokenizer(tok, META, "t.gguf", special=False)  # the vocabulary alone is the file's
    changed = align_special_tokens(tok, META)
    assert changed == ["eos_token '<unk>' -> '<eos>'", "add_bos_token -> True"]
    check_tokenizer(tok, META, "t.gguf")
    assert tok("ab")["input_ids"] == [1, 7] and tok.eos_token_id == 2


def test_a_bos_the_file_does_not_ask_for_is_removed():
    meta = dataclasses.replace(META, add_bos=False)
    tok = _tokenizer(add_bos=True)
    with pytest.raises(ValueError, match="it adds a BOS where the file says add_bos_token=False"):
        check_tokenizer(tok, meta, "t.gguf")
    assert align_special_tokens(tok, meta) == ["add_bos_token -> False"]
    check_tokenizer(tok, meta, "t.gguf")
    assert tok("ab")["input_ids"] == [7]


@pytest.mark.parametrize("keep", [0, 10, 60, 300])
def test_header_reader_on_a_cut_file_says_so(tmp_path, keep):
    whole = _write_gguf(tmp_path / "t.gguf", **FULL).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:keep])
    with pytest.raises(ValueError, match="not a GGUF file|cut short or corrupt"):
        read_tokenizer_meta(cut)
