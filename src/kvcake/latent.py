"""Latent attention (MLA: DeepSeek-V2/V3, Kimi Linear, MiniCPM3, GLM-4 MoE lite, Youtu, ...).

Such a model keeps one latent per token instead of per-head keys and values: ``c`` (``kv_lora_rank``
wide, after ``kv_a_layernorm``) and a rotated key part ``k_rot`` (``qk_rope_head_dim``) shared by
every head. transformers (5.24) stores them in the cache as a one-head layer, ``keys`` (B, 1, S, r)
= c and ``values`` (B, 1, S, d_rot) = k_rot, and expands them into per-head keys and values after
``cache.update`` (the attention module's ``expand_kv``, through ``kv_b_proj``). Head ``h``'s key is
``[W_UK^h c; k_rot]`` and its value ``W_UV^h c``, with ``kv_b_proj.weight`` (H * (d_nope + d_v), r)
stacking ``[W_UK^h; W_UV^h]`` per head.

kvcake scores, evicts and attends over the latents themselves, in the *absorbed* form, which is the
same attention: head h's logit ``q_h . k_h = [W_UK^h^T q_nope; q_rot] . [c; k_rot]`` and its output
``sum_j p_j W_UV^h c_j = W_UV^h (sum_j p_j c_j)``. So a :class:`LatentLayer` is a layer of one KV
head (every query head in its group) holding keys ``[c; k_rot]`` (B, 1, N, r + d_rot), whose
attention reads ``c`` as its values (:meth:`LatentLayer.operands`), a query :func:`absorb`-ed to
(B, H, q, r + d_rot), and an output :func:`expand_output`-ed back to (B, q, H, d_v); CriticalKV's
value norm of head h reads the composite projection ``W_O^h W_UV^h`` (:func:`output_weight`). Every
scorer, allocator, selector and layout then runs unchanged, and the memory is the model's own: c
and k_rot of each kept token. Eviction is per token (one head): Ada-KV's per-head budgets are the
layer's.

Where a layer has evicted, ``update`` hands the model the new tokens' latents alone to expand: its
attention call is then the kvcake attention's, over the layer, and expanding every kept entry
through ``kv_b_proj`` at every step (what the model does over a full cache) would be spent for
nothing (none at all: transformers' ``expand_kv`` cannot reshape zero entries).
"""

from __future__ import annotations

import torch

from .adapters import ModelInfo
from .layer import KVCakeLayer
from .tensor_parallel import local_weight


def _up_projections(module: torch.nn.Module, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W_UK (H, d_nope, r) and W_UV (H, d_v, r), views of ``kv_b_proj.weight`` in ``like``'s dtype."""
    d_nope, d_v = module.qk_nope_head_dim, module.v_head_dim
    weight = local_weight(module.kv_b_proj.weight).to(like.dtype)  # (H * (d_nope + d_v), r): this rank's H
    weight = weight.view(-1, d_nope + d_v, weight.shape[-1])  # (H, d_nope + d_v, r)
    return weight[:, :d_nope], weight[:, d_nope:]


def absorb(module: torch.nn.Module, query: torch.Tensor) -> torch.Tensor:
    """The model's query (B, H, q, d_nope + d_rot) in the absorbed form (B, H, q, r + d_rot):
    ``[W_UK^h^T q_nope; q_rot]``, whose dot product with ``[c; k_rot]`` is the model's logit."""
    w_uk, _ = _up_projections(module, query)
    d_nope = module.qk_nope_head_dim
    nope = torch.einsum("bhqd,hdr->bhqr", query[..., :d_nope], w_uk)  # (B, H, q, r)
    return torch.cat([nope, query[..., d_nope:]], dim=-1)


def query_over(layer: KVCakeLayer, module: torch.nn.Module, query: torch.Tensor) -> torch.Tensor:
    """The query a layer's own attention and scores read: a latent layer's absorbed, else as it is."""
    return absorb(module, query) if layer.latent else query


def expand_output(module: torch.nn.Module, out: torch.Tensor) -> torch.Tensor:
    """The attention's output over the latents, (B, q, H, r), as the model's: (B, q, H, d_v)."""
    _, w_uv = _up_projections(module, out)
    return torch.einsum("bqhr,hvr->bqhv", out, w_uv)


def output_weight(module: torch.nn.Module, o_weight: torch.Tensor) -> torch.Tensor:
    """CriticalKV's output projection over the latents: ``W_O^h W_UV^h`` for each head,
    (hidden, H * r) in ``nn.Linear``'s layout, from the model's ``o_weight`` (hidden, H * d_v)."""
    _, w_uv = _up_projections(module, o_weight)
    heads, d_v, rank = w_uv.shape
    per_head = o_weight.reshape(o_weight.shape[0], heads, d_v)  # (hidden, H, d_v)
    return torch.einsum("ohv,hvr->ohr", per_head, w_uv).reshape(o_weight.shape[0], heads * rank)


class LatentLayer(KVCakeLayer):
    """A latent-attention layer. It holds each token's ``[c; k_rot]`` as one key (B, 1, N, r + d_rot)
    (ragged: (T, r + d_rot)) and zero-width values (B, 1, N, 0): the attention reads ``c`` as a view of
    the keys (``operands``), so a step copies nothing and the bytes are the model's (r + d_rot per
    token). ``rank``: r, the width of ``c``."""

    latent = True

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def reset(self) -> None:
        self.__init__(self.rank)

    def operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[c; k_rot]`` (..., r + d_rot) and values ``c`` (..., r), a view of them."""
        return self.keys, self.keys[..., : self.rank]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store ``c`` (B, 1, q, r) and ``k_rot`` (B, 1, q, d_rot) as one key; return what the model
        expands: every latent while the model's own attention reads them (the prompt, a plain layer),
        else the new tokens' alone."""
        prompt = self.keys is None
        joined = torch.cat([key_states, value_states], dim=-1)  # (B, 1, q, r + d_rot)
        keys, _ = super().update(joined, joined[..., :0], *args, **kwargs)
        if self.plain or prompt:  # the model's own attention over every latent, as a full cache's
            return keys[..., : self.rank], keys[..., self.rank :]
        return key_states, value_states  # the kvcake attention reads the layer


def attention_layer(info: ModelInfo) -> KVCakeLayer:
    """A new layer for one of ``info``'s full-attention layers: latent where the model's attention is."""
    return LatentLayer(info.latent[0]) if info.latent else KVCakeLayer()
