"""The haystacks of the synthetic tasks live in :mod:`kvcake.haystack` (below eval, which shares
them with CAKE calibration); this module keeps the old import path."""

from kvcake.haystack import (
    NOISE_TEXT,
    PAUL_GRAHAM_INSTALL_HINT,
    FileHaystack,
    Haystack,
    HaystackUnavailableError,
    NoiseHaystack,
    PaulGrahamHaystack,
    resolve_haystack,
)

__all__ = [
    "NOISE_TEXT",
    "PAUL_GRAHAM_INSTALL_HINT",
    "FileHaystack",
    "Haystack",
    "HaystackUnavailableError",
    "NoiseHaystack",
    "PaulGrahamHaystack",
    "resolve_haystack",
]
