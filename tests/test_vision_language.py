"""Vision-language models with an image in the prompt, each a tiny random model of the installed
transformers: the language model's cache holds the image's tokens like any others. A budget covering
the prompt decodes the stock model's tokens and logits, with the prompt compressed whole
(``kvcake.generate``) or a context with the image compressed before its question
(``kvcake.compress``); a small budget runs with the budgets summing exactly. Families whose classes
the installed release lacks are skipped. Mllama's cross-attention layers hold the image's states
uncompressed (``kvcake.cross``)."""

from __future__ import annotations

import inspect
import tempfile

import pytest
import torch
import transformers as tf
from packaging.version import Version

import kvcake
from kvcake.adapters import TOKEN_INPUTS
from kvcake.cross import CrossLayer
from kvcake.devices import layer_devices
from shared_checks import GREEDY, assert_same_decoding
from test_families import HEAD16

IMAGE = 299  # the image token of every model here (vocabulary 300)


def _ids_with_an_image(start: int, tokens: int) -> torch.Tensor:
    x = torch.randint(3, 290, (1, 40), generator=torch.Generator().manual_seed(1))
    x[0, start : start + tokens] = IMAGE
    return x


def _text(model_type: str) -> dict:
    return {**HEAD16, "model_type": model_type, "vocab_size": 300, "num_hidden_layers": 4}


VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 56,
    "patch_size": 14,
}  # fmt: skip  (4 x 4 patches, merged 2 x 2 into 4 tokens)


def _paligemma_with_an_image():
    """The image first, then the text; a two-way prefix over the image and the context, the question
    causal (``token_type_ids`` 1), as a compressed context asks it."""
    vision = {**VISION, "image_size": 28}
    config = tf.PaliGemmaConfig(text_config={**HEAD16, "vocab_size": 300, "num_hidden_layers": 4},
                                vision_config=vision, image_token_index=IMAGE, projection_dim=64, hidden_size=64,
                                vocab_size=300)  # fmt: skip
    x = _ids_with_an_image(0, 4)
    x[0, 4] = 1  # BOS after the image, as the processor lays it out
    types = torch.zeros_like(x)
    types[0, 36:] = 1
    return tf.PaliGemmaForConditionalGeneration(config), x, {"pixel_values": torch.randn(1, 3, 28, 28) * 3,
                                                             "token_type_ids": types}  # fmt: skip


def _smolvlm_with_an_image():
    config = tf.SmolVLMConfig(
        text_config=_text("llama"), vision_config=VISION, image_token_id=IMAGE, scale_factor=2
    )
    return (
        tf.SmolVLMForConditionalGeneration(config),
        _ids_with_an_image(21, 4),
        {"pixel_values": torch.randn(1, 1, 3, 56, 56)},
    )


def _grid_image(patch: int) -> tuple[torch.Tensor, dict]:
    """Ids with a 4-token image between its start and end tokens (297, 296), and its patches as the
    Qwen2-VL family's processors give them: a 4 x 4 grid of ``patch``-pixel patches, two frames
    deep, merged 2 x 2 into the 4 tokens (3-D positions)."""
    x = _ids_with_an_image(21, 4)
    x[0, 20], x[0, 25] = 297, 296
    return x, {
        "pixel_values": torch.randn(16, 3 * 2 * patch * patch),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
    }


def _qwen2_5_vl_with_an_image():
    text = {**_text("qwen2_5_vl_text"), "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    text.pop("model_type")
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3, "window_size": 56,
              "fullatt_block_indexes": [0]}  # fmt: skip
    config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=298,
                                 vision_start_token_id=297, vision_end_token_id=296)  # fmt: skip
    x, image = _grid_image(14)
    return tf.Qwen2_5_VLForConditionalGeneration(config), x, image


def _mistral3_with_an_image():
    text = {**_text("mistral"), "sliding_window": None}  # Mistral's default slides every layer (refused)
    vision = {**VISION, "model_type": "pixtral"}
    config = tf.Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=IMAGE, spatial_merge_size=2
    )
    return (
        tf.Mistral3ForConditionalGeneration(config),
        _ids_with_an_image(21, 4),
        {
            "pixel_values": torch.randn(1, 3, 56, 56),
            "image_sizes": torch.tensor([[56, 56]]),
        },
    )


def _internvl_with_an_image():
    vision = {**VISION, "image_size": [56, 56], "patch_size": [14, 14]}
    config = tf.InternVLConfig(text_config=_text("qwen2"), vision_config=vision, image_token_id=IMAGE,
                               image_seq_length=4, downsample_ratio=0.5)  # fmt: skip
    return (
        tf.InternVLForConditionalGeneration(config),
        _ids_with_an_image(21, 4),
        {"pixel_values": torch.randn(1, 3, 56, 56)},
    )


def _llava_next_with_an_image():
    """Any-resolution: the base image and one tile, 10 tokens."""
    vision = {**VISION, "model_type": "clip_vision_model", "projection_dim": 32, "image_size": 28}
    config = tf.LlavaNextConfig(text_config=_text("llama"), vision_config=vision, image_token_index=IMAGE,
                                image_grid_pinpoints=[[28, 28], [28, 56]])  # fmt: skip
    return (
        tf.LlavaNextForConditionalGeneration(config),
        _ids_with_an_image(20, 10),
        {
            "pixel_values": torch.randn(1, 2, 3, 28, 28),
            "image_sizes": torch.tensor([[28, 28]]),
        },
    )


def _gemma3_with_an_image():
    """A tiny Gemma 3 vision-language model (sliding, full, sliding, full) and a prompt with a
    4-token image block, which the model's mask lets attend to itself both ways."""
    text = {**HEAD16, "vocab_size": 300, "num_hidden_layers": 4, "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"] * 2}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}  # fmt: skip
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
                             boi_token_index=297, eoi_token_index=298)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tf.Gemma3ForConditionalGeneration(config).eval()
        pixels = torch.randn(1, 3, 28, 28) * 3
    x = torch.randint(3, 290, (1, 40), generator=torch.Generator().manual_seed(1))
    x[0, 30], x[0, 31:35], x[0, 35] = 297, 299, 298
    return model, x, {"pixel_values": pixels, "token_type_ids": (x == 299).long()}


def _gemma4_with_an_image():
    """A tiny Gemma 4 (sliding, full, sliding, full; the global layers' head dim 32, the sliding ones' 16)
    and a prompt with a 4-token image block (16 patches of 4 x 4 pooled 2 x 2)."""
    text = {**HEAD16, "vocab_size": 300, "num_hidden_layers": 4, "sliding_window": 8, "global_head_dim": 32,
            "layer_types": ["sliding_attention", "full_attention"] * 2, "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": 300}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4, "pooling_kernel_size": 2,
              "position_embedding_size": 64}  # fmt: skip
    config = tf.Gemma4Config(text_config=text, vision_config=vision, audio_config=None, boi_token_id=297,
                             eoi_token_id=298, image_token_id=299, video_token_id=296, boa_token_id=295,
                             eoa_token_index=294, audio_token_id=293)  # fmt: skip
    x = torch.randint(3, 290, (1, 40), generator=torch.Generator().manual_seed(1))
    x[0, 30], x[0, 31:35], x[0, 35] = 297, 299, 298
    grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1).reshape(1, 16, 2)
    image = {
        "pixel_values": torch.randn(1, 16, 48),
        "image_position_ids": grid,
        "mm_token_type_ids": (x == 299).long(),
    }
    return tf.Gemma4ForConditionalGeneration(config), x, image


def test_gemma3_with_an_image_decodes_in_the_ring():
    """The default (static) cache decoded no image prompt: transformers builds the sliding layers' mask
    with the image blocks' ids padded to the mask's columns and indexed by position, and the ring's
    one column sat at position 0 (IndexError). The prefill keeps the image block's two-way mask: the
    first token's logits are the stock model's for every method; later steps equal dynamic storage's."""
    model, x, image = _gemma3_with_an_image()
    kw = {"max_new_tokens": 4, **GREEDY}
    with torch.no_grad():
        stock = model.generate(input_ids=x, **kw, **image)
        causal = model.generate(input_ids=x, **kw, pixel_values=image["pixel_values"])
    assert (stock.logits[0] - causal.logits[0]).abs().max() > 1e-3  # the two-way block matters here
    out, _ = kvcake.generate(model, x, "snapkv", budget=64, window=4, **kw, **image)
    assert torch.equal(out.sequences, stock.sequences)
    for preset in ("snapkv", "h2o", "cake-adakv", "critical-adakv"):
        out, cache = kvcake.generate(model, x, preset, budget=12, window=4, **kw, **image)
        assert cache.static and (cache.budgets.sum(dim=1) == 24).all(), preset
        torch.testing.assert_close(out.logits[0], stock.logits[0], atol=1e-5, rtol=1e-5)
        dynamic, _ = kvcake.generate(model, x, preset, budget=12, window=4, static=False, **kw, **image)
        assert_same_decoding(out, dynamic, preset)


def _llava_with_an_image():
    text = {**HEAD16, "model_type": "llama", "vocab_size": 300, "num_hidden_layers": 4}
    vision = {"model_type": "clip_vision_model", "projection_dim": 32, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14}  # fmt: skip
    model = tf.LlavaForConditionalGeneration(
        tf.LlavaConfig(text_config=text, vision_config=vision, image_token_index=299)
    )
    x = torch.randint(3, 290, (1, 40), generator=torch.Generator().manual_seed(1))
    x[0, 21:25] = 299  # a 2 x 2-patch image
    return model, x, {"pixel_values": torch.randn(1, 3, 28, 28)}


def _qwen2_vl_with_an_image():
    text = {**HEAD16, "vocab_size": 300, "num_hidden_layers": 4,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}  # fmt: skip
    vision = {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "in_chans": 3}  # fmt: skip
    config = tf.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=299, video_token_id=298,
                              vision_start_token_id=297, vision_end_token_id=296)  # fmt: skip
    model = tf.Qwen2VLForConditionalGeneration(config)
    return model, *_grid_image(14)


def _qwen3_vl_with_an_image():
    """Interleaved multimodal RoPE, and the image's features also added into layer 0 ("deepstack")."""
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    }
    text = {k: v for k, v in _text("qwen3_vl_text").items() if k != "model_type"} | {"rope_parameters": rope}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
              "num_position_embeddings": 16, "deepstack_visual_indexes": [0]}  # fmt: skip
    config = tf.Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=298,
                              vision_start_token_id=297, vision_end_token_id=296)  # fmt: skip
    x, image = _grid_image(16)
    return tf.Qwen3VLForConditionalGeneration(config), x, image


def _glm4v_with_an_image():
    """Multimodal RoPE over half of each head (partial rotary), with rope_deltas like Qwen2-VL."""
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 1, 1],
        "partial_rotary_factor": 0.5,
    }
    text = {k: v for k, v in _text("glm4v_text").items() if k not in ("model_type", "head_dim")}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "patch_size": 14, "image_size": 56, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}  # fmt: skip
    config = tf.Glm4vConfig(text_config=text | {"rope_parameters": rope}, vision_config=vision, image_token_id=IMAGE,
                            video_token_id=298, image_start_token_id=297, image_end_token_id=296,
                            video_start_token_id=295, video_end_token_id=294)  # fmt: skip
    x, image = _grid_image(14)
    return tf.Glm4vForConditionalGeneration(config), x, image


def _idefics2_with_an_image():
    text = {**_text("mistral"), "sliding_window": None}
    perceiver = {"hidden_size": 64, "resampler_n_latents": 4, "resampler_depth": 1, "resampler_n_heads": 2,
                 "resampler_head_dim": 16, "num_key_value_heads": 1}  # fmt: skip
    config = tf.Idefics2Config(
        text_config=text, vision_config=VISION, perceiver_config=perceiver, image_token_id=IMAGE
    )
    return (
        tf.Idefics2ForConditionalGeneration(config),
        _ids_with_an_image(21, 4),
        {"pixel_values": torch.randn(1, 1, 3, 56, 56)},
    )


def _chameleon_with_an_image():
    """Images as the tokens of a VQ codebook (16 codes), 4 for a 32 x 32 image."""
    codes = {
        "IMGIMG" + "".join(chr(ord("A") + int(c)) for c in str(code)) + "Z": 200 + code for code in range(16)
    }
    vq = {"embed_dim": 32, "num_embeddings": 16, "latent_channels": 32, "resolution": 32, "base_channels": 32,
          "channel_multiplier": [1, 1, 1, 1, 1], "num_res_blocks": 1}  # fmt: skip
    text = {k: v for k, v in _text("chameleon").items() if k != "model_type"}
    config = tf.ChameleonConfig(**text, vq_config=vq, vocabulary_map={"<image>": IMAGE, **codes})
    return (
        tf.ChameleonForConditionalGeneration(config),
        _ids_with_an_image(21, 4),
        {"pixel_values": torch.randn(1, 3, 32, 32)},
    )


def _emu3_with_an_image():
    """Images as the tokens of a VQ codebook (16 codes, ``<|visual token N|>``): an 8 x 8 image is 4
    rows of 4 codes, each row ended by an end-of-line token, 20 tokens; ``image_sizes`` beside it."""
    codes = {f"<|visual token {code:06d}|>": 200 + code for code in range(16)}
    vq = {"codebook_size": 16, "embed_dim": 8, "latent_channels": 32, "base_channels": 32, "channel_multiplier": [1, 1],
          "num_res_blocks": 1, "attn_resolutions": [], "hidden_size": 32, "num_attention_heads": 1}  # fmt: skip
    text = {k: v for k, v in _text("emu3").items() if k != "model_type"}
    config = tf.Emu3Config(
        vq_config=vq, text_config=text, vocabulary_map={"<image>": IMAGE, "<|extra_200|>": 298, **codes}
    )
    return (
        tf.Emu3ForConditionalGeneration(config),
        _ids_with_an_image(12, 20),
        {"pixel_values": torch.randn(1, 3, 8, 8), "image_sizes": torch.tensor([[8, 8]])},
    )


def _fuyu_with_an_image():
    """Patches straight into a Persimmon language model (partial rotary, q/k norms)."""
    text = {"model_type": "persimmon", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
    config = tf.FuyuConfig(text_config=text, image_token_id=IMAGE, patch_size=14, image_size=28)
    return (
        tf.FuyuForCausalLM(config),
        _ids_with_an_image(21, 4),
        {"pixel_values": torch.randn(1, 4, 3 * 14 * 14)},
    )


def _janus_with_an_image():
    vision = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
              "projection_dim": 64, "depth": 2, "num_image_tokens": 4, "mlp_ratio": 2.0}  # fmt: skip
    vq = {"embed_dim": 8, "num_embeddings": 16, "latent_channels": 32, "base_channels": 32, "channel_multiplier": [1, 1],
          "num_res_blocks": 1, "num_patches": 2, "projection_dim": 64, "image_token_embed_dim": 64}  # fmt: skip
    config = tf.JanusConfig(
        text_config=_text("llama"), vision_config=vision, vq_config=vq, image_token_id=IMAGE
    )
    return (
        tf.JanusForConditionalGeneration(config),
        _ids_with_an_image(21, 4),
        {"pixel_values": torch.randn(1, 3, 28, 28)},
    )


def _ovis2_with_an_image():
    vision = {**VISION, "vocab_size": 64, "hidden_stride": 2, "num_visual_indicator_tokens": 5}
    config = tf.Ovis2Config(text_config=_text("qwen2"), vision_config=vision, image_token_id=IMAGE,
                            visual_indicator_token_ids=[290, 291, 292, 293, 294], hidden_size=64, vocab_size=300)  # fmt: skip
    x = _ids_with_an_image(21, 4)
    x[0, 20], x[0, 25] = 290, 291
    return tf.Ovis2ForConditionalGeneration(config), x, {"pixel_values": torch.randn(1, 3, 56, 56)}


def _aria_with_an_image():
    text = {k: v for k, v in _text("aria_text").items() if k != "model_type"}
    text |= {"moe_num_experts": 4, "moe_topk": 2, "moe_num_shared_experts": 1}
    config = tf.AriaConfig(text_config=text, vision_config={**VISION, "model_type": "idefics3_vision"},
                           image_token_index=IMAGE, projector_patch_to_query_dict={16: 4})  # fmt: skip
    return (
        tf.AriaForConditionalGeneration(config),
        _ids_with_an_image(21, 4),
        {"pixel_values": torch.randn(1, 3, 56, 56)},
    )


def _deepseek_vl_with_an_image():
    vision = {**VISION, "model_type": "siglip_vision_model", "image_size": 28}
    config = tf.DeepseekVLConfig(text_config=_text("llama"), vision_config=vision, image_token_id=IMAGE)
    return (
        tf.DeepseekVLForConditionalGeneration(config),
        _ids_with_an_image(21, 4),
        {"pixel_values": torch.randn(1, 3, 28, 28)},
    )


def _cohere2_vision_with_an_image():
    """A hybrid language model (sliding, full, sliding, full): only the full layers are compressed."""
    text = {
        **_text("cohere2"),
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    }
    config = tf.Cohere2VisionConfig(text_config=text, vision_config={**VISION, "model_type": "siglip_vision_model"},
                                    image_token_id=IMAGE, downsample_factor=2, alignment_intermediate_size=64)  # fmt: skip
    return (
        tf.Cohere2VisionForConditionalGeneration(config),
        _ids_with_an_image(21, 4),
        {"pixel_values": torch.randn(1, 3, 56, 56)},
    )


def _blip2_with_an_image():
    """BLIP-2 (an OPT language model): the image's 4 query tokens first. Its ``forward`` and
    ``generate`` take ``pixel_values`` first, and its ``generate`` requires them at every call."""
    text = {"vocab_size": 300, "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "word_embed_proj_dim": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "model_type": "opt"}  # fmt: skip
    qformer = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
               "encoder_hidden_size": 32, "vocab_size": 100, "cross_attention_frequency": 1}  # fmt: skip
    config = tf.Blip2Config(text_config=text, vision_config={**VISION, "image_size": 28}, qformer_config=qformer,
                            num_query_tokens=4, image_token_index=IMAGE)  # fmt: skip
    x = _ids_with_an_image(0, 4)
    x[0, 4] = 1
    return tf.Blip2ForConditionalGeneration(config), x, {"pixel_values": torch.randn(1, 3, 28, 28)}


def _mllama_with_an_image():
    """Mllama (Llama 3.2 Vision): layers 1 and 3 attend to the image's states (cross-attention, their
    cache the image's tokens, never compressed), the others to the prompt. One image of two tiles, the
    second padding; ``cross_attention_mask`` (B, S, images, tiles) has a row per token: the text before
    the image token sees no tile, the rest the first. The gates of the cross layers are 1 (0 at
    initialisation: the image would change nothing)."""
    text = {**HEAD16, "vocab_size": 300, "num_hidden_layers": 5, "cross_attention_layers": [1, 3]}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_global_layers": 1,
              "attention_heads": 2, "image_size": 28, "patch_size": 14, "max_num_tiles": 2,
              "supported_aspect_ratios": [[1, 1], [1, 2]], "intermediate_layers_indices": [0],
              "vision_output_dim": 64}  # fmt: skip
    model = tf.MllamaForConditionalGeneration(tf.MllamaConfig(text_config=text, vision_config=vision,
                                                              image_token_index=IMAGE))  # fmt: skip
    for name, p in model.named_parameters():
        if name.endswith("_gate"):
            p.data.fill_(1.0)
    x = _ids_with_an_image(5, 1)
    tiles = torch.zeros(1, 40, 1, 2, dtype=torch.long)
    tiles[:, 5:, 0, 0] = 1
    return model, x, {"pixel_values": torch.randn(1, 1, 2, 3, 28, 28), "aspect_ratio_ids": torch.tensor([[1]]),
                      "aspect_ratio_mask": torch.tensor([[[1, 0]]]), "cross_attention_mask": tiles}  # fmt: skip


def _kosmos2_with_an_image():
    """Kosmos-2: the image's 4 latent queries at positions 1-4 (``image_embeds_position_mask``, a row per
    token). Its forward expands a 2-D padding mask itself: no compiled decode (``info.own_masks``)."""
    text = {"vocab_size": 300, "embed_dim": 64, "layers": 4, "attention_heads": 4, "ffn_dim": 128,
            "max_position_embeddings": 512}  # fmt: skip
    config = tf.Kosmos2Config(
        text_config=text, vision_config={**VISION, "image_size": 28}, latent_query_num=4
    )
    x = _ids_with_an_image(1, 4)
    places = torch.zeros_like(x)
    places[0, 1:5] = 1
    return tf.Kosmos2ForConditionalGeneration(config), x, {"pixel_values": torch.randn(1, 3, 28, 28),
                                                          "image_embeds_position_mask": places}  # fmt: skip


# name -> (builder, the transformers class it needs[, the first release its inputs fit]); MULTIMODAL_ROPE's
# keep rope_deltas
BUILDERS = {
    "gemma3": (_gemma3_with_an_image, "Gemma3ForConditionalGeneration"),
    "gemma4": (_gemma4_with_an_image, "Gemma4ForConditionalGeneration"),
    "llava": (_llava_with_an_image, "LlavaForConditionalGeneration"),
    "qwen2_vl": (_qwen2_vl_with_an_image, "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": (_qwen2_5_vl_with_an_image, "Qwen2_5_VLForConditionalGeneration"),
    "paligemma": (_paligemma_with_an_image, "PaliGemmaForConditionalGeneration"),
    "smolvlm": (_smolvlm_with_an_image, "SmolVLMForConditionalGeneration"),
    "mistral3": (_mistral3_with_an_image, "Mistral3ForConditionalGeneration"),
    "internvl": (_internvl_with_an_image, "InternVLForConditionalGeneration"),
    "llava_next": (_llava_next_with_an_image, "LlavaNextForConditionalGeneration"),
    "qwen3_vl": (_qwen3_vl_with_an_image, "Qwen3VLForConditionalGeneration"),
    "glm4v": (_glm4v_with_an_image, "Glm4vForConditionalGeneration"),
    "idefics2": (_idefics2_with_an_image, "Idefics2ForConditionalGeneration"),
    "chameleon": (_chameleon_with_an_image, "ChameleonForConditionalGeneration"),
    "emu3": (_emu3_with_an_image, "Emu3ForConditionalGeneration"),
    "fuyu": (_fuyu_with_an_image, "FuyuForCausalLM", "5.24"),  # before: patches as image_patches
    "janus": (_janus_with_an_image, "JanusForConditionalGeneration"),
    "ovis2": (_ovis2_with_an_image, "Ovis2ForConditionalGeneration"),
    "aria": (_aria_with_an_image, "AriaForConditionalGeneration", "5.24"),  # before: its vision config a dict
    "deepseek_vl": (_deepseek_vl_with_an_image, "DeepseekVLForConditionalGeneration"),
    "cohere2_vision": (_cohere2_vision_with_an_image, "Cohere2VisionForConditionalGeneration"),
    "blip2": (_blip2_with_an_image, "Blip2ForConditionalGeneration"),  # kvcake.generate only
    "mllama": (_mllama_with_an_image, "MllamaForConditionalGeneration"),
    "kosmos2": (_kosmos2_with_an_image, "Kosmos2ForConditionalGeneration"),
}
MULTIMODAL_ROPE = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v")


def _build(name: str):
    """``(model, ids, image inputs)`` of a family, seeded, in eval mode; skipped where the installed
    release lacks its class."""
    build, cls, *since = BUILDERS[name]
    if not hasattr(tf, cls):
        pytest.skip(f"transformers {tf.__version__} has no {cls}")
    if since and Version(tf.__version__) < Version(since[0]):
        pytest.skip(f"these inputs fit {cls} from transformers {since[0]}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, x, image = build()
    return model.eval(), x, image


@pytest.mark.parametrize("name", [name for name in BUILDERS if name != "gemma3"])
def test_vision_language_models_with_an_image(name):
    """The language model's cache holds the image's tokens like any others: a covering budget decodes
    the stock model's tokens (Qwen2-VL's multimodal RoPE positions included), a small one runs."""
    model, x, image = _build(name)
    kw = {"max_new_tokens": 4, **GREEDY}
    image = _image_inputs(model, x, image, x.shape[1])
    with torch.no_grad():
        stock = model.generate(input_ids=x, **kw, **image)
    out, _ = kvcake.generate(model, x, "cake-adakv", budget=64, window=4, **kw, **image)
    assert_same_decoding(out, stock)
    out, cache = kvcake.generate(model, x, "critical-adakv", budget=12, window=4, **kw, **image)
    assert out.sequences.shape == (1, 44) and int(cache.budgets.sum()) == 12 * cache.budgets.shape[1]
    torch.testing.assert_close(out.logits[0], stock.logits[0], atol=1e-5, rtol=1e-5)  # the prefill's own


def _image_inputs(model, x, image, length: int) -> dict:
    """``image`` as a processor returns it for ``x[:, :length]``: per-token ids cut to the prompt, and
    Qwen2-VL's ``mm_token_type_ids`` (1 on an image's tokens) where the model's forward takes them."""
    if "mm_token_type_ids" in inspect.signature(type(model).forward).parameters and "image_grid_thw" in image:
        image = {**image, "mm_token_type_ids": (x == 299).long()}
    per_token = (*TOKEN_INPUTS, "image_embeds_position_mask")
    return {
        k: v[:, :length] if k.endswith("token_type_ids") or k in per_token else v for k, v in image.items()
    }


@pytest.mark.parametrize("name", [name for name in BUILDERS if name not in ("blip2", "kosmos2")])
def test_a_compressed_context_with_an_image(name, tmp_path):
    """``kvcake.compress`` takes the model's image inputs (it took none). With a covering budget its
    follow-ups decode the stock model's tokens for the whole prompt, and teacher-forced logits match.
    Qwen2-VL places tokens after an image by an offset the model keeps between calls (``rope_deltas``),
    the last prefill's: the context keeps its own, so a context compressed after it (here a text
    prompt) does not move its positions, and a saved context keeps it."""
    model, x, image = _build(name)
    n = 36  # the image lies in the context; the question is the last 4 tokens
    with torch.no_grad():
        stock = model.generate(
            input_ids=x, max_new_tokens=4, **GREEDY, **_image_inputs(model, x, image, x.shape[1])
        )
    answer = stock.sequences[:, x.shape[1] :]
    ctx = kvcake.compress(model, x[:, :n], "snapkv", budget=64, window=4, **_image_inputs(model, x, image, n))
    if name in MULTIMODAL_ROPE:  # another prompt, no image (Kosmos-2's forward takes none without one)
        kvcake.compress(model, x[:, 10:30], "snapkv", budget=64, window=4)
    ctx.save(tmp_path / "ctx.kvc")
    loaded = kvcake.load_context(model, tmp_path / "ctx.kvc")
    for context in (ctx, loaded):
        out = context.generate(x[:, n:], max_new_tokens=4, **GREEDY)
        assert torch.equal(out.sequences, answer)
        torch.testing.assert_close(torch.stack(out.logits), torch.stack(stock.logits), atol=1e-5, rtol=1e-5)
        logits = context.forward(torch.cat([x[:, n:], answer[:, :3]], 1))[0, -4:]
        torch.testing.assert_close(logits, torch.stack(stock.logits)[:, 0], atol=1e-5, rtol=1e-5)
    assert (ctx.rope_deltas is not None) == (name in MULTIMODAL_ROPE)
    small = kvcake.compress(
        model, x[:, :n], "cake-adakv", budget=12, window=4, **_image_inputs(model, x, image, n)
    )
    assert int(small.cache.budgets.sum()) == 12 * small.cache.budgets.shape[1]  # per compressed layer
    assert small.cache.kept_entries() < ctx.cache.kept_entries()
    small.generate(x[:, n:], max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_a_padded_batch_of_contexts_with_images_and_multimodal_positions():
    """Qwen2-VL, two contexts with an image, one left-padded: follow-ups decode the stock model's
    tokens and logits for the whole prompts (each row's own offset). Teacher forcing is refused
    there: releases define the offset after padding differently (5.0 over the padded length, 5.24
    over the tokens), and the model's forward fails on 5.24."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, x, image = _qwen2_vl_with_an_image()
        model.eval()
    x = torch.cat([x, torch.cat([torch.zeros(1, 2, dtype=torch.long), x[:, :-2]], 1)])
    mask = torch.ones_like(x)
    mask[1, :2] = 0
    image = {
        "pixel_values": torch.cat([image["pixel_values"]] * 2),
        "image_grid_thw": torch.tensor([[1, 4, 4]] * 2),
    }
    with torch.no_grad():
        stock = model.generate(
            x, attention_mask=mask, max_new_tokens=4, **GREEDY, **_image_inputs(model, x, image, 40)
        )
    n = 36
    ctx = kvcake.compress(model, x[:, :n], "snapkv", budget=64, window=4, attention_mask=mask[:, :n],
                          **_image_inputs(model, x, image, n))  # fmt: skip
    out = ctx.generate(x[:, n:], max_new_tokens=4, **GREEDY)
    assert torch.equal(out.sequences, stock.sequences[:, 40:])
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(stock.logits), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="padded batch of contexts with multimodal RoPE"):
        ctx.forward(x[:, n:])


def test_a_context_is_refused_where_generate_needs_the_image_at_every_call():
    """BLIP-2's ``generate`` requires ``pixel_values`` and encodes them again into the language
    model's inputs: a compressed context's text follow-ups could not be answered (it failed inside
    BLIP-2's generate). Refused before any compute; the whole prompt compresses with
    ``kvcake.generate`` (``test_vision_language_models_with_an_image``)."""
    model, x, image = _build("blip2")
    with pytest.raises(ValueError, match=r"Blip2ForConditionalGeneration.generate encodes its image again"):
        kvcake.compress(model, x[:, :36], "snapkv", budget=64, window=4, **image)


def test_mllama_keeps_the_image_states_of_its_cross_attention_layers_whole():
    """Mllama was refused. Its cross-attention layers (1 and 3) hold the image's keys and values as a
    DynamicCache holds them, bit for bit, counted apart (``KVBytes.cross``); only the self-attention
    layers are compressed (budgets summing exactly over 3 layers), static storage decoding as the
    dynamic reference, the prefill's logits the stock model's."""
    model, x, image = _build("mllama")
    kw = {"max_new_tokens": 4, **GREEDY}
    with torch.no_grad():
        stock = model.generate(input_ids=x, **kw, **image)
        full = tf.DynamicCache(config=model.config)
        model(input_ids=x, **image, **kvcake.with_cache(model, full))
    for preset in ("snapkv", "h2o", "cake", "critical-adakv"):
        out, cache = kvcake.generate(model, x, preset, budget=12, window=4, **kw, **image)
        assert cache.compressed == (0, 2, 4) and cache.budgets.tolist() == [[12, 12, 12]], preset
        torch.testing.assert_close(out.logits[0], stock.logits[0], atol=1e-5, rtol=1e-5)
        dynamic, _ = kvcake.generate(model, x, preset, budget=12, window=4, static=False, **kw, **image)
        assert_same_decoding(out, dynamic, preset)
        for i in (1, 3):
            assert isinstance(cache.layers[i], CrossLayer)
            assert torch.equal(cache.layers[i].keys, full.layers[i].keys)
            assert torch.equal(cache.layers[i].values, full.layers[i].values)
        parts = cache.kv_bytes_parts()
        assert parts.cross == sum(cache.layers[i].kv_bytes() for i in (1, 3)) > 0
        assert parts.total == cache.kv_bytes()


def test_mllama_without_an_image_and_with_beams(tmp_path):
    """A text-only prompt leaves the cross-attention layers empty (the model skips them): covering,
    the stock tokens, and a context of it saves and loads. Beam search reorders the image's states
    with the rest."""
    model, x, image = _build("mllama")
    kw = {"max_new_tokens": 4, **GREEDY}
    text = x[:, 10:]
    with torch.no_grad():
        stock = model.generate(input_ids=text, **kw)
    out, cache = kvcake.generate(model, text, "snapkv", budget=64, window=4, **kw)
    assert_same_decoding(out, stock)
    assert cache.kv_bytes_parts().cross == 0
    ctx = kvcake.compress(model, text[:, :26], "snapkv", budget=12, window=4)
    ctx.save(tmp_path / "text.kvc")
    loaded = kvcake.load_context(model, tmp_path / "text.kvc")
    assert torch.equal(
        loaded.generate(text[:, 26:], **kw).sequences, ctx.generate(text[:, 26:], **kw).sequences
    )
    beams = {"max_new_tokens": 4, "num_beams": 3, "do_sample": False}
    with torch.no_grad():
        stock = model.generate(input_ids=x, **beams, **image)
    out, _ = kvcake.generate(model, x, "cake", budget=64, window=4, **beams, **image)
    assert torch.equal(out, stock)


def test_kosmos2_decodes_in_static_storage_and_answers_a_context():
    """Kosmos-2 needed static=False: its forward expands a 2-D padding mask itself and failed on the
    4-D mask generate builds for a compileable cache (as with transformers' StaticCache). Its cache now
    decodes in static storage eagerly (``info.own_masks``: not compileable; compile=True refused). A
    context's follow-ups: its generate takes the cache alone from transformers 5.24 (before, it encodes
    the image at every call); its forward always wants an image, so teacher forcing is refused."""
    model, x, image = _build("kosmos2")
    kw = {"max_new_tokens": 4, **GREEDY}
    with torch.no_grad():
        stock = model.generate(input_ids=x, **kw, **image)
    out, cache = kvcake.generate(model, x, "snapkv", budget=64, window=4, **kw, **image)
    assert_same_decoding(out, stock)
    assert cache.static and not cache.is_compileable
    small, _ = kvcake.generate(model, x, "cake-adakv", budget=12, window=4, **kw, **image)
    dynamic, _ = kvcake.generate(model, x, "cake-adakv", budget=12, window=4, static=False, **kw, **image)
    assert_same_decoding(small, dynamic)
    with pytest.raises(ValueError, match="kosmos_2_text_model builds its masks from a 2-D padding mask"):
        kvcake.generate(model, x, "snapkv", budget=12, window=4, max_new_tokens=2, compile=True, **image)
    n = 36
    ctx = kvcake.compress(model, x[:, :n], "snapkv", budget=64, window=4, **_image_inputs(model, x, image, n))
    with pytest.raises(ValueError, match="kosmos_2_text_model's forward encodes an image at every call"):
        ctx.forward(x[:, n:])
    if Version(tf.__version__) >= Version("5.24"):
        answer = ctx.generate(x[:, n:], **kw)
        assert torch.equal(answer.sequences, stock.sequences[:, x.shape[1] :])


@pytest.mark.parametrize("name", ["gemma3", "qwen2_vl", "paligemma", "mllama"])
def test_beam_search_with_an_image(name):
    """Beams over a prompt with an image (generate repeats the image's inputs per beam): covering, the
    stock beams (Gemma 3's ring, Qwen2-VL's positions, PaliGemma's prefix, Mllama's image states);
    small budgets, static storage as the dynamic reference."""
    model, x, image = _build(name)
    image = _image_inputs(model, x, image, x.shape[1])
    kw = {"max_new_tokens": 4, "num_beams": 3, "do_sample": False}
    with torch.no_grad():
        stock = model.generate(input_ids=x, **kw, **image)
    out, _ = kvcake.generate(model, x, "cake", budget=64, window=4, **kw, **image)
    assert torch.equal(out, stock)
    small = [kvcake.generate(model, x, "cake-adakv", budget=12, window=4, static=s, **kw, **image)[0]
             for s in (True, False)]  # fmt: skip
    assert torch.equal(*small)


def test_the_text_layers_devices_skip_the_vision_towers_layers():
    """Gemma 4's vision tower's encoder layers carry a ``layer_idx`` too and come first: the text
    layer 0 was placed on the vision tower's device (the meta device stands for another GPU of a
    device map here), and a context loaded there failed at its first question."""
    model, _, _ = _build("gemma4")
    model.model.vision_tower.to("meta")
    assert layer_devices(model, 4) == [torch.device("cpu")] * 4
    text = torch.randint(3, 290, (1, 30), generator=torch.Generator().manual_seed(0))
    ctx = kvcake.compress(model, text, "snapkv", budget=16, window=4)
    with tempfile.TemporaryDirectory() as tmp:
        ctx.save(f"{tmp}/ctx.kvc")
        loaded = kvcake.load_context(model, f"{tmp}/ctx.kvc")
    question = torch.tensor([[5, 6, 7]])
    assert torch.equal(loaded.generate(question, max_new_tokens=3), ctx.generate(question, max_new_tokens=3))
