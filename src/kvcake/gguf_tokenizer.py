"""The tokenizer of a GGUF checkpoint as transformers converts it, checked against the file.

A GGUF file states its tokenizer: the vocabulary with each token's type, the BOS and EOS ids, and
whether a BOS starts every sequence. transformers' conversion has not always reproduced it within
kvcake's declared range. Measured on the built-in models (``tokenizer.ggml.*`` keys against what
``AutoTokenizer.from_pretrained(..., gguf_file=...)`` gives):

- Gemma-3-270M (a SentencePiece vocabulary): 5.0-5.17 lose the order of its merges ("hello" is
  "h e l l o" under 5.0, "hel lo" under 5.6-5.17; 5.18 on give "hello"), and 5.0-5.22 add no BOS
  where the file asks for one.
- SmolLM2-135M-Instruct (byte-level BPE): 5.0-5.17 name ``<|im_start|>`` (id 1) its EOS where the
  file says ``<|im_end|>`` (id 2), and 5.0 also starts every sequence with ``<|im_start|>``, which
  the file does not ask for.

The special tokens and the BOS flag are the file's to state, so :func:`align_special_tokens` sets
them from it. A vocabulary that does not encode its own tokens cannot be mended short of
rebuilding the tokenizer, so :func:`check_tokenizer` refuses it, naming the upgrade (where the
vocabulary's tokens can be encoded one at a time: ``GGUFTokenizerMeta.round_trips``).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import transformers

# Of the file's ordinary tokens (type 1), this many (evenly spaced) are decoded and encoded again
# (those that decode to whole characters): a faithful conversion gives each one back as itself
# (SmolLM2 and Gemma-3 under 5.18-5.24: 100%), a conversion without the merge order far fewer
# (Gemma-3 under 5.0: 32% in memory, 7% once saved and reloaded; 5.17 in memory: 31%).
_SAMPLE = 1000
_MIN_SHARE = 0.9
# The release from which both built-in models' vocabularies convert faithfully (measured above).
FAITHFUL_FROM = "5.18"


@dataclass(frozen=True)
class GGUFTokenizerMeta:
    """What a GGUF file says of its tokenizer (``None``: the file does not say)."""

    bos_id: int | None
    eos_id: int | None
    add_bos: bool | None
    normal_ids: tuple[int, ...]  # the vocabulary's ordinary tokens (type 1)
    model: str | None = None  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece), ...
    add_space_prefix: bool | None = None

    @property
    def round_trips(self) -> bool:
        """Whether each ordinary token, decoded alone, must encode back to itself: a byte-level
        BPE vocabulary, or a SentencePiece one that adds no space before the text (Gemma-3). One
        that does (Llama-2's) would encode a word's continuation ("ing") as a word start ("_ing"),
        so its vocabulary is not sampled (the special tokens still are)."""
        return self.model == "gpt2" or (self.model == "llama" and self.add_space_prefix is False)


def read_tokenizer_meta(path: str | os.PathLike[str]) -> GGUFTokenizerMeta:
    """The tokenizer keys of the GGUF file at ``path``, read off its header (no tensor is read).

    ``gguf.GGUFReader`` builds a view of every element of every array in the header, 18 s for
    Gemma-3's 262,144 tokens on two cores; this walks the header once and keeps only the keys it
    needs (:func:`read_tokenizer_meta_reference` is the reader's answer, which tests compare)."""
    wanted = {_BOS, _EOS, _ADD_BOS, _TYPES, _MODEL, _SPACE}
    found: dict[str, Any] = {}
    if os.path.getsize(path) < 24:
        raise ValueError(f"{os.fspath(path)} is not a GGUF file (shorter than a GGUF header)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{os.fspath(path)} is not a GGUF file (it does not start with b'GGUF')")
        end = "<" if struct.unpack_from("<I", buf, 4)[0] < 1 << 16 else ">"  # the version, read both ways
        if (version := struct.unpack_from(end + "I", buf, 4)[0]) < 2:
            raise ValueError(f"{os.fspath(path)} is GGUF version {version}; versions 2 and later are read")
        n_kv = struct.unpack_from(end + "Q", buf, 16)[0]
        at = 24
        try:
            for _ in range(n_kv):
                (n,) = struct.unpack_from(end + "Q", buf, at)
                key = bytes(buf[at + 8 : at + 8 + n]).decode("utf-8")
                (kind,) = struct.unpack_from(end + "I", buf, at + 8 + n)
                value, at = _value(buf, at + 12 + n, kind, end, keep=key in wanted)
                if key in wanted:
                    found[key] = value
        except (struct.error, ValueError) as exc:  # a length past the end, bytes that are no text, a bad type
            raise ValueError(
                f"{os.fspath(path)}: the GGUF header is cut short or corrupt near byte {at} ({exc}); "
                "download or copy the file again"
            ) from exc
    types = found.get(_TYPES)
    normal = () if types is None else tuple(int(i) for i in np.flatnonzero(np.asarray(types) == 1))
    return _meta(
        found.get(_BOS), found.get(_EOS), found.get(_ADD_BOS), normal, found.get(_MODEL), found.get(_SPACE)
    )


def read_tokenizer_meta_reference(path: str | os.PathLike[str]) -> GGUFTokenizerMeta:
    """:func:`read_tokenizer_meta` through ``gguf.GGUFReader`` (slow: the tests' oracle)."""
    from gguf import GGUFReader

    fields = GGUFReader(os.fspath(path)).fields

    def scalar(key: str):
        field = fields.get(key)
        return None if field is None or not field.data else field.parts[field.data[0]][0].item()

    def string(key: str):
        field = fields.get(key)
        return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8")

    types = fields.get(_TYPES)
    normal = () if types is None else tuple(i for i, p in enumerate(types.data) if types.parts[p][0] == 1)
    return _meta(scalar(_BOS), scalar(_EOS), scalar(_ADD_BOS), normal, string(_MODEL), scalar(_SPACE))


def _meta(bos, eos, add_bos, normal: tuple[int, ...], model, space) -> GGUFTokenizerMeta:
    return GGUFTokenizerMeta(
        bos_id=None if bos is None else int(bos), eos_id=None if eos is None else int(eos),
        add_bos=None if add_bos is None else bool(add_bos), normal_ids=normal, model=model,
        add_space_prefix=None if space is None else bool(space),
    )  # fmt: skip


_BOS, _EOS = "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"
_ADD_BOS, _TYPES = "tokenizer.ggml.add_bos_token", "tokenizer.ggml.token_type"
_MODEL, _SPACE = "tokenizer.ggml.model", "tokenizer.ggml.add_space_prefix"
# GGUF value types (the format's numbering): struct codes of the fixed-size ones; 8 string, 9 array.
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _value(buf, at: int, kind: int, end: str, keep: bool) -> tuple[Any, int]:
    """The value of GGUF type ``kind`` at offset ``at`` (None unless ``keep``) and the offset after it."""
    if kind in _FIXED:
        fmt = end + _FIXED[kind]
        return (struct.unpack_from(fmt, buf, at)[0] if keep else None), at + struct.calcsize(fmt)
    if kind == _STRING:
        (n,) = struct.unpack_from(end + "Q", buf, at)
        return (bytes(buf[at + 8 : at + 8 + n]).decode("utf-8") if keep else None), at + 8 + n
    if kind != _ARRAY:
        raise ValueError(f"unknown GGUF value type {kind} at byte {at}: not a GGUF file this reader knows")
    item, count = struct.unpack_from(end + "IQ", buf, at)
    at += 12
    if item in _FIXED:  # one block: read at once
        dtype = np.dtype(end + _FIXED[item])
        values = np.frombuffer(buf, dtype=dtype, count=count, offset=at).copy() if keep else None
        return values, at + count * dtype.itemsize
    values = [] if keep else None
    for _ in range(count):
        value, at = _value(buf, at, item, end, keep)
        if keep:
            values.append(value)
    return values, at


def align_special_tokens(tokenizer, meta: GGUFTokenizerMeta) -> list[str]:
    """Set ``tokenizer``'s BOS and EOS tokens and its BOS flag to what the file states; returns a
    description of each change (empty when the conversion already agreed)."""
    changed = []
    for what, _, want in _special_disagreements(tokenizer, meta):
        if what == "add_bos":
            tokenizer.add_bos_token = want
            changed.append(f"add_bos_token -> {want}")
        else:
            token = tokenizer.convert_ids_to_tokens(want)
            changed.append(f"{what}_token {getattr(tokenizer, f'{what}_token')!r} -> {token!r}")
            setattr(tokenizer, f"{what}_token", token)
    return changed


def check_tokenizer(tokenizer, meta: GGUFTokenizerMeta, source: str, special: bool = True) -> None:
    """Raise ``ValueError`` unless ``tokenizer`` is the one the file ``source`` states: its BOS and
    EOS ids, whether it starts a sequence with BOS (``special=False`` leaves these three out), and
    its vocabulary (sampled ordinary tokens encode back to themselves, where ``meta.round_trips``)."""
    wrong = []
    for what, got, want in _special_disagreements(tokenizer, meta) if special else ():
        if what == "add_bos":
            wrong.append(f"it {'adds no' if want else 'adds a'} BOS where the file says add_bos_token={want}")
        else:
            wrong.append(f"its {what.upper()} token is id {got}, the file's is {want}")
    if meta.normal_ids and meta.round_trips:
        step = max(len(meta.normal_ids) // _SAMPLE, 1)
        texts = {i: tokenizer.decode([i]) for i in meta.normal_ids[::step][:_SAMPLE]}
        # a byte-level token holding part of a character decodes alone to U+FFFD: not a text to encode
        sample = [i for i, text in texts.items() if "\ufffd" not in text]
        back = {i: tokenizer(texts[i], add_special_tokens=False)["input_ids"] for i in sample}
        missed = [i for i in sample if back[i] != [i]]
        if sample and (share := 1 - len(missed) / len(sample)) < _MIN_SHARE:
            token, pieces = (
                tokenizer.convert_ids_to_tokens(missed[0]),
                tokenizer.convert_ids_to_tokens(back[missed[0]]),
            )
            wrong.append(
                f"only {share:.0%} of {len(sample)} of its vocabulary's ordinary tokens encode back to "
                f"themselves (a faithful conversion: nearly all), e.g. {token!r} -> {pieces}"
            )
    if wrong:
        raise ValueError(
            f"transformers {transformers.__version__} converted the tokenizer of {source} unfaithfully: "
            + "; ".join(wrong)
            + f". transformers {FAITHFUL_FROM} and later convert kvcake's built-in models faithfully: "
            f"pip install -U 'transformers>={FAITHFUL_FROM}'"
        )


def _special_disagreements(tokenizer, meta: GGUFTokenizerMeta) -> list[tuple[str, Any, Any]]:
    """``(what, tokenizer's, file's)`` for each of ``"bos"``, ``"eos"`` (token ids) and
    ``"add_bos"`` (whether an encoded text starts with the BOS) where the two differ and the file
    says."""
    out = []
    for what, want in (("bos", meta.bos_id), ("eos", meta.eos_id)):
        if want is not None and (got := getattr(tokenizer, f"{what}_token_id")) != want:
            out.append((what, got, want))
    if meta.add_bos is not None and (adds := _adds_bos(tokenizer, meta)) != meta.add_bos:
        out.append(("add_bos", adds, meta.add_bos))
    return out


def _adds_bos(tokenizer, meta: GGUFTokenizerMeta) -> bool:
    """Whether ``tokenizer`` starts an encoded text with the file's BOS."""
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and meta.bos_id is not None and ids[0] == meta.bos_id
