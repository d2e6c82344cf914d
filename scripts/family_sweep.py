"""Every causal-LM family of the installed transformers as a tiny random model, through kvcake: where a
family is neither tested (``tests/test_families.py`` and the family test files) nor refused, this is how
one finds out what it does. One child process per family (a time limit, an address-space limit: some
default configs allocate gigabytes), one line each:

    PYTHONPATH=src python3 scripts/family_sweep.py [--only llama,gemma4_text] [--timeout 120]

``ok covering=EQUAL``: snapkv with a budget covering the prompt decoded the stock model's 4 greedy tokens
and cake at budget 8 ran; ``DIFFERS``: the covering budget changed the tokens (a bug to look at);
``refused``: ``describe_model`` said why; ``kvcake fails``: an error at run time (a refusal there, or a
bug); ``stock fails`` / ``config fails``: the tiny config below does not fit the family (not kvcake's).
The tiny config sets only the fields the family's config has (2 layers, 4 query and 2 KV heads,
hidden 64, vocabulary 128; latent attention's widths, ``LATENT``), and what ``FIT`` adds for a
family, so families whose configs need more say ``stock fails``."""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             max_position_embeddings=512, moe_intermediate_size=32, num_experts=4, num_local_experts=4,
             n_routed_experts=4, num_experts_per_tok=2)  # fmt: skip
# Latent attention (MLA: a config with ``kv_lora_rank``): its own widths, SMALL's head_dim does not fit it
LATENT = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
              num_key_value_heads=4, head_dim=8)  # fmt: skip
# Families whose tiny model needs more than SMALL (given as they are): a rotary width within the head,
# a dense first layer, for hybrids an attention layer among the two (their default patterns put the
# first one further down), Zamba's, Zamba2's and ZAYA's layer patterns, a window shorter than Gemma 4's
# positions (a window of all 512 is no window: its sliding layer would be compressed beside the global one),
# expert groups within the tiny expert count (AXK1), RoPE per layer type (Cohere Compass), Inkling 2's own
# vocabulary and sliding-attention widths, Qwen4-Exp's indexer and n-gram widths
LINEAR_HYBRID = dict(layer_types=["linear_attention", "full_attention"])
FIT = {
    "codegen": dict(rotary_dim=8), "gptj": dict(rotary_dim=8), "dots1": dict(first_k_dense_replace=1, n_shared_experts=1),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]), "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "bamba": dict(attn_layer_indices=[1]), "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=64, attention_window_size=16),
    "qwen3_next": LINEAR_HYBRID, "qwen3_5_text": LINEAR_HYBRID, "qwen3_5_moe_text": LINEAR_HYBRID,
    "bailing_hybrid": LINEAR_HYBRID, "kimi_linear": LINEAR_HYBRID,
    "qwen4_exp_text": dict(layer_types=["linear_attention", "indexed_attention"], indexer_n_heads=2, indexer_kv_heads=1,
                           indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4, ngram_vocab_size_base=1024,
                           split_ngram_parts=8, hc_lowrank=8, shared_expert_intermediate_size=32, linear_key_head_dim=16,
                           linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4),
    "zamba": dict(num_hidden_layers=6, attn_layer_period=3, attn_layer_offset=2, mamba_d_state=8, mamba_d_conv=4,
                  mamba_expand=1, mamba_dt_rank=4, attention_head_dim=16),
    "zamba2": dict(num_hidden_layers=4, mamba_d_state=8, n_mamba_heads=4,
                   layers_block_type=["mamba", "hybrid", "mamba", "hybrid"]),
    "gemma4_text": dict(sliding_window=8), "gemma4_unified_text": dict(sliding_window=8),
    "cohere_compass_text": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8, rope_parameters={
        kind: dict(rope_type="default", rope_theta=10000.0) for kind in ("sliding_attention", "full_attention")}),
    "axk1": dict(n_group=1, topk_group=1),
    **{name: dict(unpadded_vocab_size=128, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
                  sliding_window_size=8, rel_extent=16, moe_intermediate_size=32)
       for name in ("inkling2_text", "inkling2_loop_text")},
    "zaya": dict(num_hidden_layers=3, num_experts=2, num_experts_per_tok=1, router_hidden_size=16),
    "kolibri1_1": dict(num_hidden_layers=3, layer_types=["sliding_attention", "indexed_attention", "indexed_attention"],
                       kv_source_layers=[0, 1, 1], index_layers=[1], sliding_window=8, index_num_heads=2, index_topk=4,
                       index_pool_size=16, index_compression=4, index_num_local_tokens=4, index_num_sink_tokens=2),
}  # fmt: skip
GREEDY = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)


def one(mtype: str) -> str:
    """The sweep's line for one family (module docstring)."""
    import warnings

    import torch
    import transformers as tf
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    import kvcake
    from kvcake.adapters import describe_model

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    config_class = getattr(tf, CONFIG_MAPPING_NAMES.get(mtype, ""), None)
    if config_class is None:
        return "no config class"
    try:
        defaults = config_class()
        small = {**SMALL, **(LATENT if _has(defaults, "kv_lora_rank") else {})}
        config = config_class(
            **{**{k: v for k, v in small.items() if _has(defaults, k)}, **FIT.get(mtype, {})}
        )
    except Exception as e:
        return f"config fails: {_short(e, 100)}"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    torch.manual_seed(0)
    x = torch.randint(3, 100, (1, 24))
    try:
        model = tf.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            stock = model.generate(x, **GREEDY)
    except Exception as e:
        return f"stock fails: {_short(e, 100)}"
    try:
        describe_model(model)
    except ValueError as e:
        return f"refused: {_short(e, 160, name=False)}"
    try:
        out, _ = kvcake.generate(model, x, "snapkv", budget=64, window=4, **GREEDY)
        compressed, _ = kvcake.generate(model, x, "cake", budget=8, window=4, **GREEDY)
    except Exception as e:
        return f"kvcake fails: {_short(e, 160)}"
    return f"ok covering={'EQUAL' if torch.equal(out, stock) else 'DIFFERS'} compressed={tuple(compressed.shape)}"


def _short(error: Exception, chars: int, name: bool = True) -> str:
    """An error on one line: its type (``name``) and message, cut to ``chars``."""
    text = " ".join(str(error).split())[:chars]
    return f"{type(error).__name__}: {text}" if name else text


def _has(config, name: str) -> bool:
    """Whether ``config`` has the field ``name`` (a per-layer one, Gemma 4's ``head_dim``, raises on read)."""
    try:
        getattr(config, name)
    except AttributeError:
        return False
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError: there, but per layer
        return True
    return True


def _limit_memory(gib: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (gib << 30, gib << 30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated model types (default: every causal LM)")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per family")
    parser.add_argument("--memory-gib", type=int, default=8, help="address space per family")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child's family
    args = parser.parse_args()
    if args.one:
        print(one(args.one), flush=True)
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    families = args.only.split(",") if args.only else sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    for mtype in families:
        try:
            run = subprocess.run([sys.executable, __file__, "--one", mtype], capture_output=True, text=True,
                                 timeout=args.timeout, preexec_fn=lambda: _limit_memory(args.memory_gib))  # fmt: skip
            lines = run.stdout.strip().splitlines()
            result = lines[-1] if run.returncode == 0 and lines else f"crashed (exit {run.returncode})"
        except subprocess.TimeoutExpired:
            result = f"over {args.timeout} s"
        print(f"{mtype}: {result}", flush=True)


if __name__ == "__main__":
    main()
