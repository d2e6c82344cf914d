"""Layer allocators (how many entries each layer keeps) and head allocators (per KV head)."""

from .adakv import AdaKV, UniformHeads
from .base import AllocationRequest, LayerAllocator, round_exact, waterfill
from .cake import CakeAllocator, default_tau, preference
from .global_scores import GlobalAllocator
from .pyramid import Pyramid
from .random import RandomSplit
from .uniform import Uniform

__all__ = [
    "AdaKV",
    "AllocationRequest",
    "CakeAllocator",
    "GlobalAllocator",
    "LayerAllocator",
    "Pyramid",
    "RandomSplit",
    "Uniform",
    "UniformHeads",
    "default_tau",
    "preference",
    "round_exact",
    "waterfill",
]
