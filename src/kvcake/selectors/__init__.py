"""Selectors: which entries each head keeps, given scores and per-head counts."""

from .critical import Critical
from .topk import SelectionInputs, Selector, TopK
from .value_norms import projected_value_norms

__all__ = ["Critical", "SelectionInputs", "Selector", "TopK", "projected_value_norms"]
