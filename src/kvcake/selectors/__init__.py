"""Selectors: which entries each head keeps, given scores and per-head counts."""

from .critical import Critical, projected_value_norms
from .topk import SelectionInputs, Selector, TopK

__all__ = ["Critical", "SelectionInputs", "Selector", "TopK", "projected_value_norms"]
