"""Per-architecture facts, in one place: which models the integration supports, where the
output projection is, and which CAKE temperatures fit the family.

Supported: decoder-only models whose attention modules call transformers' attention interface
after RoPE and after ``cache.update`` (``past_key_values.update`` before transformers 5.24) with
causal attention over plain per-head keys and values: Llama, Mistral (without sliding window),
Qwen2/Qwen3, Phi-3 (128k, 3.5: the 4k checkpoints slide on every layer), Gemma (1), Granite, OLMo
and similar; and hybrids whose ``config.layer_types`` mixes ``sliding_attention`` with
``full_attention`` (Gemma 3, ...): their sliding layers keep transformers' own sliding-window
cache and only the full-attention ("global") layers are compressed; and linear-attention hybrids
(Qwen3.5, Qwen3-Next, Nemotron-H, Jamba, ...), whose recurrent layers keep their states
(``layer_types.py``, ``recurrent.py``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import transformers
from accelerate.utils import align_module_device
from transformers.pytorch_utils import Conv1D

from .layer_types import (
    PerLayerAttributeError,
    attention_shape,
    chunked_layers,
    hybrid_layers,
    latent_dims,
    layer_windows,
    recurrent_layers,
)
from .logit_terms import model_terms
from .model_code import check_attention_calls, check_takes_cache, forward_cache_keyword, hands_kwargs_to_cache
from .recurrent import check_supported

_OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "c_proj", "wo")
# Attention that kvcake's attention over the kept entries cannot reproduce, read from the family's code
_REFUSED_FAMILIES = {
    "jetmoe": "its attention heads are experts: query head h reads KV head h mod H_kv (tiled), not h // group, and "
    "the output projection sits inside the experts",
    "doge": "its attention adds a learned bias per head and key to the mask (dynamic mask attention), which "
    "kvcake's attention over the kept entries would drop",
    "diffllama": "its attention calls the attention function twice per layer (differential attention), over values it "
    "rebuilds from the cached ones, where kvcake's attention answers one call per layer from the entries it keeps",
    "minimax": "its model takes no cache but its own class (MiniMaxCache, holding the lightning-attention layers' "
    "states), so it refuses a KVCakeCache",
    "hrm_text": "its layers run in cycles over the same modules, each cycle writing a cache layer of its own (the "
    "module's layer_idx plus the cycle's offset), which the attention module's layer_idx does not name",
    "dory": "its layers run in loops, each loop past the first on its own copy of a layer's cache or on the last "
    "loop's keys, which kvcake's per-layer budgets and attention do not follow",
}
# Families whose layers hold attention and a recurrent block's states side by side (``hybrid_layer.py``),
# which releases before transformers' per-state LinearAttentionLayer type "attention" (5.0) and hold in
# the family's own cache class: refused there with the fix (``recurrent.check_supported``).
_STATES_BESIDE = ("falcon_h1", "zamba", "zamba2")
# Models whose forward expands a 2-D padding mask itself and fails on the 4-D mask ``generate`` builds
# for a compileable cache (transformers' own StaticCache fails there too): their KVCakeCache decodes
# in static storage, eagerly, and is not compileable. Kosmos-2 (transformers 5.24: "too many values
# to unpack" in its ``_expand_mask``).
_OWN_MASKS = ("kosmos_2_text_model",)
# Models whose forward encodes an image at every call (its ``generate`` does not): a compressed
# context's generate answers text follow-ups, its teacher forcing (``forward``) cannot. Kosmos-2.
IMAGE_IN_EVERY_FORWARD = ("kosmos_2_text_model",)


@dataclass(frozen=True)
class ModelInfo:
    """Shapes the cache needs: ``L`` layers, ``H`` query heads, ``H_kv`` KV heads, head dim."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Per layer: the sliding window of a sliding layer, None for a full-attention layer (the
    # layers kvcake compresses). Empty means every layer is full attention.
    windows: tuple[int | None, ...] = ()
    # Whether the attention hands its kwargs to ``cache.update`` (:func:`hands_kwargs_to_cache`).
    hands_kwargs: bool = False
    # Cross-attention layers (Mllama): they hold the image's keys, never compressed (``cross.py``).
    cross: tuple[int, ...] = ()
    # Whether the model builds its masks from a 2-D padding mask only (``_OWN_MASKS``): ``generate``
    # hands a compileable cache's model a 4-D mask, which such a model cannot take.
    own_masks: bool = False
    # Layers holding no per-token keys (``recurrent.py``): (layer, number of states), 0 for a block
    # without attention. Never compressed.
    recurrent: tuple[tuple[int, int], ...] = ()
    # Layers attending within chunks (Llama 4), among those ``windows`` gives a window (the chunk).
    chunked: tuple[int, ...] = ()
    # Latent attention (MLA, ``kvcake.latent``): (kv_lora_rank, qk_rope_head_dim), the widths of the
    # latent c and the rotated key part its layers hold as one key (``head_dim``, their sum; values
    # zero-width), one KV head; None otherwise.
    latent: tuple[int, int] | None = None
    # Full-attention layers that also hold a recurrent block's states (layer type "hybrid": Falcon-H1's
    # Mamba beside its attention; ``hybrid_layer.py``): (layer, number of states). Compressed.
    beside: tuple[tuple[int, int], ...] = ()

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def compressed_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers, the only ones kvcake compresses."""
        return full_attention_layers(self.num_layers, self.windows, self.cross, self.recurrent)

    @property
    def hybrid(self) -> bool:
        return any(w is not None for w in self.windows)


def full_attention_layers(num_layers: int, windows, cross, recurrent) -> tuple[int, ...]:
    """The layers kvcake compresses: no window (``windows``: per layer, empty when none slides), not
    cross-attention, not holding recurrent states alone (``ModelInfo``'s fields)."""
    skipped = set(cross) | {i for i, _ in recurrent}
    return tuple(i for i, w in enumerate(windows or (None,) * num_layers) if w is None and i not in skipped)


def describe_model(model: torch.nn.Module) -> ModelInfo:
    """Check that kvcake can compress this model and return its shapes.

    Raises ``ValueError`` up front for what would otherwise give wrong answers: models whose every
    layer slides (nothing to compress), encoder-decoders, latent attention (MLA) not in the form
    ``kvcake.latent`` reads (:func:`check_latent`), models without attention (Mamba) or without a KV
    cache (RWKV), attention written out in a model's own code (Bloom, MPT: ``model_code.py``), KV
    sharing across layers (Gemma 3n),
    and the families of ``_REFUSED_FAMILIES`` (JetMoE's tiled heads, Doge's learned mask, DiffLlama's two
    attention calls per layer, Dory's loops, HRM's cycles); full-attention layers of different shapes
    (``layer_types.attention_shape``). Gemma 2's soft cap and GPT-OSS's sinks are handled (``kvcake.logit_terms``).
    Sliding and chunked layers of a hybrid are reported in ``windows`` (the chunked ones also in
    ``chunked``), cross-attention layers (Mllama, which attend to the image's states) in ``cross``,
    linear-attention layers in ``recurrent``: none is compressed. Full-attention layers holding a
    recurrent block's states beside (Falcon-H1) are in ``beside``, and compressed.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    mtype = getattr(text, "model_type", "unknown")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{mtype}: encoder-decoder models (cross-attention) are not supported by kvcake")
    if mtype in _REFUSED_FAMILIES:
        raise ValueError(
            f"{mtype}: {_REFUSED_FAMILIES[mtype]}, which kvcake does not support; use a DynamicCache for this model"
        )
    check_takes_cache(model, mtype)
    try:
        latent = latent_dims(text)
    except PerLayerAttributeError as e:  # latent attention in some layers only (dots.llm3)
        check_latent(model, mtype)  # an indexer beside the latents is refused for that first
        raise ValueError(
            f"{mtype}: its config sets latent attention (kv_lora_rank) per layer, latent in some layers and "
            "not in others, which kvcake does not support; use a DynamicCache"
        ) from e
    if latent is not None:
        check_latent(model, mtype)
    terms = model_terms(model)
    if terms and (config._attn_implementation or "").removeprefix("kvcake_") == "sdpa":
        raise ValueError(
            f"{mtype}: its attention {terms}, which SDPA leaves out (transformers "
            f"{transformers.__version__} runs it so with attn_implementation='sdpa'): kvcake's attention "
            "over the kept entries would not match the model's own. Load it with "
            "attn_implementation='eager' (or 'flex_attention'), which computes it"
        )
    if getattr(text, "num_kv_shared_layers", None):  # Gemma 3n; 5.24 also types those layers "dummy"
        raise ValueError(
            f"{mtype}: its last {text.num_kv_shared_layers} layers read earlier layers' keys and values (KV "
            "sharing, Gemma 3n), which kvcake does not support: evicting for one layer would evict for the "
            "layers that share it, whose attention kvcake does not see"
        )
    if mtype in _STATES_BESIDE:
        check_supported(mtype)
    recurrent = recurrent_layers(text, mtype)
    beside = hybrid_layers(text, mtype)
    windows = layer_windows(text, mtype)
    cross = tuple(sorted(int(i) for i in getattr(text, "cross_attention_layers", None) or ()))  # Mllama
    compressed = full_attention_layers(text.num_hidden_layers, windows, cross, recurrent)
    check_attention_calls(model, mtype)  # after the layer types: a model without attention says so first
    num_heads, num_kv, head_dim = attention_shape(text, compressed, mtype)
    if latent:  # MLA: one latent "head", [c; k_rot] wide
        num_kv, head_dim = 1, sum(latent)
    return ModelInfo(
        mtype,
        text.num_hidden_layers,
        num_heads,
        num_kv,
        head_dim,
        windows,
        hands_kwargs_to_cache(model),
        cross,
        mtype in _OWN_MASKS,
        recurrent,
        chunked_layers(text),
        latent,
        beside,
    )


def check_latent(model: torch.nn.Module, mtype: str) -> None:
    """Raise ``ValueError`` where a latent-attention model is not in the form kvcake reads
    (``kvcake.latent``): the latents cached and expanded after ``cache.update`` (``expand_kv``),
    through a float ``kv_b_proj`` without bias, and no sparse-attention indexer beside them."""
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("Indexer"):  # DeepSeek V3.2, GLM-5: the cache holds the indexer's keys too
            raise ValueError(
                f"{mtype}: its sparse attention keeps an indexer's keys in the cache beside the latents "
                f"({name}), which kvcake would have to evict alike and does not; use a DynamicCache"
            )
        proj = getattr(module, "kv_b_proj", None)
        if proj is None:
            continue
        if not callable(getattr(module, "expand_kv", None)):
            raise ValueError(
                f"{mtype}: transformers {transformers.__version__} caches latent attention's per-head keys "
                "and values, not its latents, which kvcake compresses: upgrade transformers (5.24 is tested)"
            )
        weight = getattr(proj, "weight", None)
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2:
            raise ValueError(
                f"{mtype}: kvcake reads latent attention through {name}.kv_b_proj's weight, which is not a "
                "float matrix here (quantized): load the model with kv_b_proj unquantized"
            )
        if getattr(proj, "bias", None) is not None:
            raise ValueError(
                f"{mtype}: {name}.kv_b_proj has a bias, which kvcake's latent attention leaves out"
            )


def projection_module(module: torch.nn.Module) -> torch.nn.Module | None:
    """The attention's output projection (``o_proj`` and the other usual names): ``nn.Linear`` (or a
    subclass: quantized ones), GPT-2's ``Conv1D``, or another linear module with ``in_features`` and
    ``out_features`` (GPTQ/AWQ kernels, PEFT's LoRA layers); or None."""
    for name in _OUTPUT_PROJECTIONS:
        proj = getattr(module, name, None)
        if isinstance(proj, (torch.nn.Linear, Conv1D)) or (
            isinstance(proj, torch.nn.Module)
            and isinstance(getattr(proj, "in_features", None), int)
            and isinstance(getattr(proj, "out_features", None), int)
        ):
            return proj
    return None


def projection_weight(module: torch.nn.Module, like: torch.Tensor | None = None) -> torch.Tensor | None:
    """The output projection's weight as ``(hidden, H * d)`` (``nn.Linear``'s layout), or None.
    ``Conv1D`` stores the transpose (it computes ``x @ W``): a transposed view is returned. A weight
    that accelerate offloaded (``device_map`` with ``"cpu"`` or ``"disk"``) is on the meta device until
    its module runs, after the attention: its hook loads it here, and the tensor returned outlives the
    hook's offloading the module again. A projection whose weight is not a plain matrix (quantized:
    bitsandbytes, torchao, quanto, GPTQ; PEFT's LoRA) gives the weight it applies
    (:func:`_applied_weight`), in ``like``'s dtype and on its device."""
    proj = projection_module(module)
    if proj is None:
        return None
    weight = getattr(proj, "weight", None)
    if not (_plain(weight) and type(proj).forward in (torch.nn.Linear.forward, Conv1D.forward)):
        return _applied_weight(proj, like)
    if weight.is_meta:
        with align_module_device(proj):
            weight = proj.weight
        if weight.is_meta:
            raise ValueError(
                f"the output projection of {type(module).__name__} is on the meta device and no accelerate "
                "hook loads it: load the model's weights before compressing"
            )
    return weight.t() if isinstance(proj, Conv1D) else weight


def _plain(weight) -> bool:
    """A float matrix as it is stored: a tensor or parameter, or a tensor-parallel shard of one (a
    quantized weight is a subclass holding codes and scales, or integers)."""
    kinds = (torch.Tensor, torch.nn.Parameter)
    sharded = callable(getattr(weight, "to_local", None))  # DTensor: tensor_parallel.local_weight reads it
    return (type(weight) in kinds or sharded) and weight.dtype.is_floating_point


def _applied_weight(proj: torch.nn.Module, like: torch.Tensor | None) -> torch.Tensor:
    """The ``(out, in)`` matrix a linear module applies, read off its output: the identity through it
    less its output at zero (its bias). What the module computes, dequantized or with its adapters
    added, up to its own rounding; one ``in x in`` batch through it, once per layer and prefill."""
    if like is None:  # float32, on the device of what the module stores
        stored = [t for t in (*proj.parameters(), *proj.buffers()) if not t.is_meta]
        like = torch.empty(0, device=stored[0].device if stored else "cpu")
    eye = torch.eye(proj.in_features, dtype=like.dtype, device=like.device)
    with torch.no_grad():
        applied = proj(eye) - proj(torch.zeros_like(eye[:1]))
    return applied.t().to(like.dtype)


def output_projection(module: torch.nn.Module, like: torch.Tensor | None = None) -> torch.Tensor:
    """The attention output projection's weight (hidden, H * d), for CriticalKV's value norms."""
    weight = projection_weight(module, like)
    if weight is None:
        raise ValueError(
            f"cannot find the output projection of {type(module).__name__} (looked for {_OUTPUT_PROJECTIONS} "
            "as a linear module: nn.Linear, Conv1D, or one with in_features and out_features); CriticalKV "
            "selection needs it"
        )
    return weight


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword under which ``model``'s forward and ``generate`` take a ``Cache``: ``cache``
    where the forward accepts it (transformers >= 5.24, which deprecates the old name for removal
    in 5.40), else ``past_key_values`` (the 5.0 floor and earlier 5.x). A forward that names
    neither (BLIP-2's: its ``generate`` hands the cache to its language model's) defers to the
    language model's."""
    keyword = forward_cache_keyword(type(model))
    inner = getattr(model, "language_model", None)
    if keyword is None and isinstance(inner, torch.nn.Module):
        keyword = forward_cache_keyword(type(inner))
    return keyword or "past_key_values"  # the name every 5.x release accepts


def with_cache(model: torch.nn.Module, cache) -> dict:
    """``{keyword: cache}`` for ``model(..., **with_cache(model, cache))`` and ``model.generate``,
    spelled the way the installed transformers wants it (see :func:`cache_keyword`)."""
    return {cache_keyword(model): cache}


def generation_config(model: torch.nn.Module, generate_kwargs: dict):
    """The generation config ``model.generate`` starts from: the one passed, else the model's."""
    return generate_kwargs.get("generation_config") or getattr(model, "generation_config", None)


def generation_setting(model: torch.nn.Module, generate_kwargs: dict, name: str):
    """``name`` as ``model.generate`` will see it: the keyword, else :func:`generation_config`'s."""
    if name in generate_kwargs:
        return generate_kwargs[name]
    return getattr(generation_config(model, generate_kwargs), name, None)


def generate_with_cache(model: torch.nn.Module, cache, generate_kwargs: dict) -> dict:
    """``generate_kwargs`` plus :func:`with_cache`, for ``model.generate`` with ``cache``. Settings of
    the generation config (the model's, or one passed) that would bypass the cache are overridden for
    the call: a ``cache_implementation`` (checkpoints ship them; transformers refuses a cache object
    beside one) and ``use_cache=False`` (saved by training with gradient checkpointing). Passed by
    keyword, a ``cache_implementation`` is refused: it asks for transformers' own cache instead."""
    if generate_kwargs.get("cache_implementation") is not None:
        raise ValueError(
            f"cache_implementation={generate_kwargs['cache_implementation']!r} asks transformers to build "
            "its own cache, but kvcake decodes with its KVCakeCache: drop cache_implementation"
        )
    config = generation_config(model, generate_kwargs)
    if getattr(config, "cache_implementation", None) is not None:
        generate_kwargs = {**generate_kwargs, "cache_implementation": None}
    if "use_cache" not in generate_kwargs and getattr(config, "use_cache", True) is False:
        generate_kwargs = {**generate_kwargs, "use_cache": True}
    return {**generate_kwargs, **with_cache(model, cache)}


def rope_delta_holders(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that keep multimodal RoPE's position offset between calls (``rope_deltas``, (B, 1):
    Qwen2-VL and its kin, set by a prefill with images): transformers reads it, not the cache, to
    place the tokens appended to a filled cache."""
    return [m for m in model.modules() if "rope_deltas" in vars(m)]


def padded_positions(model: torch.nn.Module, attention_mask: torch.Tensor) -> dict:
    """``{"position_ids": ...}`` for a forward of a left-padded batch, counted as ``generate`` counts
    them (each row from its first real token, 1 on the padding), where ``model``'s forward takes them
    and places no tokens itself (multimodal RoPE: :func:`rope_delta_holders`); else, and without
    padding (then the columns are those positions), nothing: the model's own."""
    if bool(attention_mask.bool().all()) or rope_delta_holders(model):
        return {}
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return {}
    positions = attention_mask.long().cumsum(-1) - 1
    return {"position_ids": positions.masked_fill(attention_mask == 0, 1)}


# Model inputs with a row per token (dim 1) that a model reads again for the tokens appended after
# them, extending it by repeating its last row (Mllama's generate does so for each new token): a
# compressed context keeps them for its follow-ups. Mllama's ``cross_attention_mask`` (B, S, images,
# tiles): which of the image's tiles each token attends.
TOKEN_INPUTS = ("cross_attention_mask",)


def extend_token_input(t: torch.Tensor, q: int) -> torch.Tensor:
    """A :data:`TOKEN_INPUTS` tensor (B, S, ...) for ``q`` more tokens: (B, S + q, ...), each new row
    the last one."""
    return torch.cat([t, t[:, -1:].expand(-1, q, *t.shape[2:])], dim=1)
