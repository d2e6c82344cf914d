"""Padding among tokens appended to a sliding-window layer, settled so that each row attends as alone.

Follow-ups of different lengths after a compressed context go in one batch left-padded: the pads
land between the context and each row's follow-up. transformers' sliding mask counts columns, so a
row padded by ``p`` would see ``p`` fewer of the context's tokens within its window than alone, and
its layer would keep ``p`` fewer of them (the last ``window - 1`` columns, pads included). Here the
window counts each row's own tokens instead:

- :func:`appended_validity` / :func:`held_validity` read which keys are tokens off the model's mask
  (a pad's column is hidden in every row, its own included; a token sees itself);
- :func:`own_mask` builds the layer's mask from each row's token positions (the model's
  ``kv_idx > q_idx - window`` with positions for columns), in the model's mask format;
- :func:`settle` keeps each row's last ``window - 1`` tokens, its pads dropped, tokens in order.

A layer that went through this is ``settled``: the model's mask no longer describes what it holds,
so from then on its validity is its own (``held_valid``; the ring's ``valid`` while decoding in
place, ``kvcake.sliding``) and every later call builds its mask here (tests/test_padded_follow_ups.py).
"""

from __future__ import annotations

import torch


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """Bool of a mask that is bool (True: attend) or additive (0: attend, the dtype's lowest: not)."""
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2 if mask.is_floating_point() else mask != 0


def visible_keys(mask, batch: int, n_keys: int) -> torch.Tensor | None:
    """(B, n_keys) bool: which keys the last query row of the model's attention mask attends (the
    4-D mask of SDPA, bool, or of the eager kernel, additive; a 2-D padding mask); None: all. What
    the ring is laid out from (``SlidingLayer.to_ring``)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() not in (2, 4):
        raise ValueError(
            f"kvcake's sliding-window ring reads the model's attention mask as a tensor, got "
            f"{type(mask).__name__}: use attn_implementation='sdpa' or 'eager', or KVCakeCache(static=False)"
        )
    return _visible(mask[:, 0, -1, -n_keys:] if mask.dim() == 4 else mask[:, -n_keys:]).expand(batch, -1)


def _readable(mask: torch.Tensor | None, n_keys: int) -> None:
    if mask is not None and not (
        isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-1] == n_keys
    ):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"follow-ups with padding on a sliding-window layer need the model's 4-D attention mask over its "
            f"{n_keys} keys, got {shape}: load the model with attn_implementation='sdpa' or 'eager', or "
            "append follow-ups of one length a batch (kvcake.answer groups them so for other kernels)"
        )


def appended_validity(mask: torch.Tensor | None, batch: int, q: int, n_keys: int, device) -> torch.Tensor:
    """(B, q) bool: which of the last ``q`` keys (the appended ones) are tokens, each read in its
    own query row of the 4-D ``mask`` (B or 1, 1, q, n_keys); None: all of them."""
    if mask is None:
        return torch.ones(batch, q, dtype=torch.bool, device=device)
    _readable(mask, n_keys)
    own = mask[:, 0, :, n_keys - q :].diagonal(dim1=-2, dim2=-1)  # (B, q): key i in row i
    return _visible(own).expand(batch, q)


def held_validity(mask: torch.Tensor | None, batch: int, q: int, n_keys: int, device) -> torch.Tensor:
    """(B, n_keys - q) bool: which keys held before the append are tokens (the first query row sees
    every one of them: at most ``window - 1`` behind it)."""
    if mask is None:
        return torch.ones(batch, n_keys - q, dtype=torch.bool, device=device)
    _readable(mask, n_keys)
    return _visible(mask[:, 0, 0, : n_keys - q]).expand(batch, n_keys - q)


def own_mask(valid: torch.Tensor, q: int, window: int, like: torch.Tensor | None) -> torch.Tensor:
    """The mask (B, 1, q, K) of the last ``q`` keys' queries over keys whose validity is ``valid``
    (B, K): a token sees the tokens at most ``window - 1`` positions behind it, counted in its row's
    tokens (pads have none); a pad's query sees what the token before it sees and itself (its
    output is never read; no row is empty). In ``like``'s format: bool, or additive in its dtype."""
    pos = valid.cumsum(1)  # (B, K): a token's position in its row, plus one (a pad: its previous token's)
    pos_q = pos[:, -q:, None]  # (B, q, 1)
    seen = valid[:, None, :] & (pos[:, None, :] <= pos_q) & (pos_q - pos[:, None, :] < window)
    own = torch.eye(q, dtype=torch.bool, device=valid.device)  # each query row its own column
    seen[:, :, -q:] |= own & ~valid[:, -q:, None]
    seen = seen[:, None]
    if like is None or like.dtype == torch.bool:
        return seen
    return torch.zeros(seen.shape, dtype=like.dtype, device=seen.device).masked_fill_(
        ~seen, torch.finfo(like.dtype).min
    )


def settle(layer, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
    """Keep in ``layer`` (a ``SlidingLayer``) each row's last ``window - 1`` tokens of ``keys`` /
    ``values`` (B, H_kv, K, d), in order, right-aligned: its pads dropped where it has more tokens,
    else its first columns empty (``held_valid`` False there); the layer is ``settled``."""
    b, hkv, k = keys.shape[:3]
    keep = min(k, layer.sliding_window - 1)
    # a stable sort of the flags puts each row's pads (and empty columns) first, its tokens in order
    order = torch.sort(valid.to(torch.uint8), dim=1, stable=True).indices[:, k - keep :]  # (B, keep)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.gather(2, order[:, None, :, None].expand(b, hkv, keep, t.shape[-1]))

    layer.keys, layer.values = pick(keys), pick(values)
    layer.held_valid, layer.settled = valid.gather(1, order), True
