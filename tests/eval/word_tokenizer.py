"""A deterministic word-level tokenizer shared by the eval tests (no model needed)."""

import re


class WordTokenizer:
    """Deterministic word-level tokenizer: one id per word or punctuation mark, id 0 is BOS."""

    _PIECE = re.compile(r"\w+|[^\w\s]")

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {"<s>": 0}
        self.inverse: list[str] = ["<s>"]

    def _id(self, piece: str) -> int:
        if piece not in self.vocab:
            self.vocab[piece] = len(self.inverse)
            self.inverse.append(piece)
        return self.vocab[piece]

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [self._id(p) for p in self._PIECE.findall(text)]
        return {"input_ids": ([0] if add_special_tokens else []) + ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(self.inverse[i] for i in ids if not (skip_special_tokens and i == 0))
