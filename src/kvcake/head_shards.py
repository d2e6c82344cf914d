"""Which KV heads this process holds under tensor parallelism, read from the model: transformers
shards the attention projections as ``DTensor``s on its device mesh, whose ``"tp"`` dimension is
the group of ranks sharing heads. The collectives over that group are in ``kvcake.tensor_parallel``,
which the allocators and scorers import and which so loads no model code; this module reads the
model, through the adapters (where its attention's output projection is)."""

from __future__ import annotations

import torch

from .adapters import projection_module
from .layer_types import latent_dims
from .tensor_parallel import HeadSplit


def find_splits(model: torch.nn.Module) -> tuple[HeadSplit | None, HeadSplit | None]:
    """The tensor-parallel split of ``model``'s heads: ``(split, group_split)``, both ``None`` where
    one process holds them all. ``split``: the ranks hold blocks of the KV heads; ``group_split``:
    a latent-attention model (``kvcake.latent``) whose plan splits the query heads, every rank
    holding the one KV head's latents whole and a share of its query group.

    transformers' tensor parallelism stores sharded weights as ``DTensor``s on its device mesh;
    the mesh's ``"tp"`` dimension (or its only dimension) is the group of ranks sharing heads. The
    heads are split where the attention's output projection is sharded; a plan that leaves the
    attention whole (DeepSeek-V3's in transformers 5.24 and GPT-OSS's split the MLP, the experts or
    the embeddings only) has every rank hold every head and compress alike: no split.
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return None, None
    for module in model.modules():
        if not isinstance(getattr(module, "layer_idx", None), int):
            continue
        weight = getattr(projection_module(module), "weight", None)
        if not isinstance(weight, DTensor):
            continue
        mesh = weight.device_mesh
        names = mesh.mesh_dim_names or ()
        dim = names.index("tp") if "tp" in names else (0 if mesh.ndim == 1 else None)
        if dim is None:
            raise ValueError(
                f"the model is sharded on a device mesh with dimensions {names}, none named 'tp': "
                "kvcake supports transformers' tensor parallelism (from_pretrained(..., tp_plan='auto'))"
            )
        if mesh.size(dim) == 1:
            return None, None
        split = HeadSplit(mesh.get_group(dim), mesh.get_local_rank(dim), mesh.size(dim))
        latent = latent_dims(model.config.get_text_config()) is not None
        return (None, split) if latent else (split, None)
    return None, None
