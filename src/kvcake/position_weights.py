"""``output_attentions=True`` after the prompt: a compressed layer's attention weights laid out by
position, as a full cache's eager attention returns them.

A compressed layer holds some of the positions, in an order of its own (per KV head, dense or
ragged, static storage with empty slots). Its probabilities over the held entries are scattered
to the positions the entries hold: (B, H, q, P) over the ``P`` positions the layer has seen, 0
where a head's entry was evicted (or never held), each row summing to what the kept entries' do
(1 without attention sinks). ``kvcake.inspect.kept_mask`` says which positions each head holds.
A hybrid model's sliding layer decoding in its ring returns what transformers' sliding layers do:
the weights over the window's tokens, oldest first (:func:`ring_weights`).
"""

from __future__ import annotations

import torch

__all__ = ["by_position", "ring_weights"]


def by_position(layer, probs: torch.Tensor, heads: int, length: int) -> torch.Tensor:
    """``probs`` of ``layer`` over its held entries, as (B, heads, q, length) by position.

    probs: (B, H, q, N) from ``layer.attend`` (a ragged layer's over its padded view), or static
    storage's one row (B, H_kv, G, N); N is ``layer.padded_positions()``'s width, whose empty
    slots (-1) and any position past ``length`` are dropped."""
    b = probs.shape[0]
    probs = probs.reshape(b, heads, -1, probs.shape[-1]).float()  # static: (B, H_kv, G, N) -> (B, H, 1, N)
    pos = layer.padded_positions()  # (B, H_kv, N), -1 = empty
    if pos.shape[-1] != probs.shape[-1]:
        raise RuntimeError(
            f"layer holds {pos.shape[-1]} entry slots per head but its attention gave {probs.shape[-1]} "
            "probabilities: report this with the method and model"
        )
    group = heads // pos.shape[1]
    slots = pos.repeat_interleave(group, dim=1)[:, :, None, :].expand_as(probs)  # (B, H, q, N)
    slots = torch.where((slots >= 0) & (slots < length), slots, length)  # the rest into a dropped column
    out = torch.zeros(*probs.shape[:3], length + 1, dtype=probs.dtype, device=probs.device)
    return out.scatter_add_(3, slots.long(), probs)[..., :length]


def ring_weights(layer, probs: torch.Tensor) -> torch.Tensor:
    """A sliding layer's ring: one token's probabilities (B, H, 1, slots) from
    ``SlidingLayer.attend``, as weights (B, H, 1, n) over the last ``n = min(seen, slots)`` tokens,
    oldest first, as transformers' sliding layers hold them."""
    return probs[..., layer.ring_slots(min(layer.length, probs.shape[-1]))]
