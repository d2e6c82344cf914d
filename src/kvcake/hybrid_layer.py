"""A layer that attends and holds a recurrent block's states side by side (transformers' layer type
``"hybrid"``): Falcon-H1 runs a Mamba block beside the attention in every decoder layer, and both
write one cache layer (transformers' ``LinearAttentionAndFullAttentionLayer``).

:class:`HybridLayer` is a :class:`~kvcake.layer.KVCakeLayer` (its keys and values compressed as any
full-attention layer's: budgets, the cascade, static storage) and a ``LinearAttentionLayer`` (its
conv and recurrent states kept whole, as a full cache keeps them: the model reads and writes them
through the cache's ``update_conv_state`` / ``get_conv_state`` / ``has_previous_state``, whose type
check it passes). Where both parents name an operation the key/value side's runs (it comes first:
sequence length, masks, cropping refused), except where this class runs both (initialisation, bytes,
batch selection, reset). The states' bytes are counted apart (``kv_bytes_parts().recurrent``), saved in a
context file beside the entries, and copied by the eval's replay (``recurrent.py``)."""

from __future__ import annotations

import numpy as np
import torch

from .layer import KVCakeLayer
from .recurrent import LinearAttentionLayer, select_state_rows, state_bytes

_States = LinearAttentionLayer if LinearAttentionLayer is not None else object


class HybridLayer(KVCakeLayer, _States):
    """Keys and values compressed (``KVCakeLayer``) beside a recurrent block's states kept whole
    (transformers' ``LinearAttentionLayer``; module docstring)."""

    takes_padding = False  # the recurrent block would read the pad tokens as text

    def __init__(self, number_of_states: int = 1) -> None:
        KVCakeLayer.__init__(self)
        _States.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        """``update``'s keys and values (positional), or a state's first write (keywords), as
        transformers' ``LinearAttentionAndFullAttentionLayer`` tells them apart."""
        if args:
            KVCakeLayer.lazy_initialization(self, *args, **kwargs)
        else:
            _States.lazy_initialization(self, **kwargs)

    def kv_bytes(self) -> int:
        """Keys and values held (``KVCakeLayer.kv_bytes``) plus the states (never compressed)."""
        return KVCakeLayer.kv_bytes(self) + state_bytes(self)

    def select_rows(self, rows: torch.Tensor, host: np.ndarray) -> None:
        if self.keys is not None:
            KVCakeLayer.select_rows(self, rows, host)
        select_state_rows(self, rows)

    def reset(self) -> None:
        self.__init__(self.number_of_states)
