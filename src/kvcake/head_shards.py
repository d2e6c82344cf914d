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


def find_split(model: torch.nn.Module) -> HeadSplit | None:
    """The tensor-parallel split of ``model``'s heads, or ``None`` where one process holds them all.

    transformers' tensor parallelism stores sharded weights as ``DTensor``s on its device mesh;
    the mesh's ``"tp"`` dimension (or its only dimension) is the group of ranks sharing heads. The
    heads are split where the attention's output projection is sharded; a plan that leaves the
    attention whole (DeepSeek-V3's and GPT-OSS's in transformers 5.24 split the MLP, the experts or
    the embeddings only) has every rank hold every head and compress alike: no split.
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
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
            return None
        text = model.config.get_text_config()
        if latent_dims(text) is not None:  # every rank would hold the whole latent (kvcake.latent)
            raise ValueError(
                f"{text.model_type}: kvcake does not compress latent attention (MLA) whose heads are split "
                "over ranks (each rank's heads would score the shared latents apart); load it on one process"
            )
        return HeadSplit(mesh.get_group(dim), mesh.get_local_rank(dim), mesh.size(dim))
    return None
