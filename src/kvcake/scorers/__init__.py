"""Token scorers, one file per published method."""

from .base import PrefillInputs, Scorer, group_reduce, pool1d, protect
from .cake import CakeScorer
from .defensive import DefensiveScorer
from .h2o import H2OScorer, accumulated_attention
from .snapkv import SnapKVScorer
from .streaming import StreamingScorer
from .tova import TOVAScorer

__all__ = [
    "CakeScorer",
    "DefensiveScorer",
    "H2OScorer",
    "PrefillInputs",
    "Scorer",
    "SnapKVScorer",
    "StreamingScorer",
    "TOVAScorer",
    "accumulated_attention",
    "group_reduce",
    "pool1d",
    "protect",
]
