"""The static decode step: preallocated storage, appends and decode-time eviction in place.

After the prompt, a compressed layer's first decode step moves it into buffers with capacity
(``to_static``); from then on a single-token step allocates nothing whose size depends on how
many tokens were generated, and reads nothing back from the device: host counts advance
deterministically (``min(count + 1, budget)``), device indices alongside them.

One module per layout, each the whole step read top to bottom: ``dense.py`` (every head of a
sequence the same width) and ``ragged.py`` (every head its own segment). In both, ``to_static``
lays the layer out, ``append`` writes the new token's entry (one in-place write per stored
tensor), ``attend`` runs the new token's attention over what the layer holds (the fused kernel,
or two batched matmuls around a softmax where the policy scores the entries), ``evict``
(``decode=fixed``) scores the entries and frees one victim slot per head, ``permute`` reorders
the batch in place (beam search, ``kvcake.sequences``), and ``to_dynamic`` turns the layer back
into the reference layout (multi-token appends, a batch resized).
``common.py`` holds what does not depend on the layout. A layer's calls go through ``layer.step``
(``KVCakeLayer.step``: ``LAYOUTS[layer.layout]``, fixed while the layer is static): no step
branches on the layout.

Per entry, the convention of ``layer.py``: a key, a value and a logical position, -1 on an
empty slot. The attention's visibility mask (``bias``, additive: 0 on a stored entry, -inf on
an empty slot) is kept alongside the writes, so no layer rebuilds it from the positions; a
``full`` fixed layer (every head at its budget, every slot but the free one used: decided once
in ``to_static``) has no empty slot when it attends, and needs none (ragged: a constant one for
the padding).

The slow reference is the dynamic path of ``layer.py`` (sort + masked copy, ``dense_attention``,
the segment softmax, ``Scorer.decode``, ``decoding.evict_step``); ``tests/test_static.py``
decodes against it.
"""

from __future__ import annotations

from . import dense, ragged
from .common import GROWTH, MAX_PREALLOCATED

LAYOUTS = {"dense": dense, "ragged": ragged}

__all__ = ["GROWTH", "LAYOUTS", "MAX_PREALLOCATED", "dense", "ragged"]
