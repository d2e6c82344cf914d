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
    heads are split where the attention's output projection is sharded and the keys are split with
    it; a plan that leaves the attention whole (DeepSeek-V3's in transformers 5.24 and GPT-OSS's
    split the MLP, the experts or the embeddings only), or gathers the keys on every rank (OLMo 2's),
    has every rank hold every head and compress alike: no split.
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
        if latent:
            return None, split
        return (split, None) if _keys_split(model, split.world) else (None, None)
    return None, None


#: The projections whose output holds a layer's keys, fused or not (transformers' own list, in
#: ``get_kv_heads_per_rank``), and the plan styles that give each rank a block of their heads.
KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value")
HEAD_BLOCKS = ("colwise", "packed_colwise", "unit_colwise")


def _keys_split(model: torch.nn.Module, world: int) -> bool:
    """Whether the plan gives each rank a block of the KV heads (``colwise`` keys), or every rank
    all of them: OLMo 2's plan gathers the keys (``colwise_gather_output``, its norms span every
    head) and splits only the output projection's input, so every rank caches every head and
    compresses alike. A plan that names no key projection is taken as splitting the heads, as the
    sharded output projection says. ``unit_colwise`` with fewer KV heads than ranks, or a count
    the ranks do not divide, repeats heads on several ranks: refused."""
    plan = getattr(model, "tp_plan", None) or {}
    styles = {style for key, style in plan.items() if key.rsplit(".", 1)[-1] in KEY_PROJECTIONS}
    if styles and not styles & set(HEAD_BLOCKS):
        return False
    if "unit_colwise" not in styles:
        return True
    text = model.config.get_text_config()
    views = getattr(text, "per_layer_config", None) or [text]  # (Gemma 4's layers have their own)
    kv_heads = {getattr(view, "num_key_value_heads", None) or view.num_attention_heads for view in views}
    if repeated := sorted(heads for heads in kv_heads if heads % world):
        raise ValueError(
            f"the tensor-parallel plan repeats KV heads over the ranks ('unit_colwise' keys, {repeated[0]} "
            f"KV heads on {world} ranks): each rank would compress its copy of a head apart from the others; "
            "run on a number of ranks that divides the KV heads, or load the model whole"
        )
    return True
