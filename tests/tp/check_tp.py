"""``make test-tp``: every preset on a tensor-parallel model equals the one-process run.

Run under ``torchrun --nproc-per-node 2`` (gloo, CPU). Rank 0 saves a tiny random Llama (4
layers, 8 query heads, 4 KV heads); every rank loads it twice, whole and with
``tp_plan="auto"`` (2 KV heads per rank), and runs each preset on both, on a batch of two
prompts (1024 tokens, and 724 left-padded to 1024), budget 64, 8 greedy tokens, with the dynamic
reference decoding path (``static=False``) and with static storage (the default). Then the same
for ``HYBRID_PRESETS`` on a tiny Gemma 3 of the same shape whose layers alternate sliding (a
64-token window, in the ring when static) and full attention, on a tiny Gemma 4 alike whose full
layers have a head dim and KV heads of their own (32 and 2 against 16 and 4; values from the keys'
projection, ``attention_k_eq_v``; ``GEMMA4_PRESETS``), and on a tiny Qwen3.5 whose layers
alternate linear attention (a gated DeltaNet: its states whole on every rank, transformers' plan
gathering those layers' outputs) and full attention, and on a tiny Llama 4 (8 layers: three
chunked, chunks of 64 tokens, then a full one, twice; MoE blocks whose experts the plan splits).
Checked per preset and path:

- greedy tokens equal the one-process run, logits within ``LOGIT_ATOL``;
- the layer budgets are identical on every rank and equal the one-process budgets;
- each rank's per-head budgets and kept entries are its heads' slice of the one-process ones
  (Ada-KV's head split decided over all heads), after prefill and after decoding;
- each rank's bytes are its heads' share of the one-process cache's bytes (``heads_bytes``; a
  ring's per-slot flags are whole on every rank);
- a compressed context (``kvcake.compress``) answers a question with the one-process tokens;
- beam search (three beams, static storage) gives the one-process tokens, for the
  ``HYBRID_PRESETS`` a model runs, on every model;
- with the kept entries in float8 (``kv_dtype="fp8"``, static storage), for the same presets:
  all of the above but the context, and every layer's key and value scales equal the
  one-process ones (taken over every rank's heads).

A tiny DeepSeek-V3 (latent attention, ``kvcake.latent``; MoE), a tiny Falcon-H1 (attention beside
a Mamba block in every layer, ``kvcake.hybrid_layer``), a tiny GPT-OSS (attention sinks, loaded
with the eager attention; sliding and full layers; MoE) and a tiny OLMo 2 last: transformers' plans
split DeepSeek-V3's MLP and experts (5.24; 5.25's splits its query heads too) and the others'
embeddings and leave their attention whole, or (OLMo 2's) gather the keys on every rank and split
only the output projection's input (CriticalKV reads it gathered), so every rank holds every head
and the whole cache and compresses alike with no split (``WHOLE_PRESETS``, both paths): tokens,
logits, budgets, kept positions and bytes as one process's. Then DeepSeek-V3 again with its query heads split (``MLA_HEADS_PLAN``, as 5.25's plan
does): every rank holds the latents whole and a share of the query group (``group_split``), and
pools what it scores over the group with the other ranks; every preset on both paths, float8 and
beam search for ``HYBRID_PRESETS``, compressed contexts (answers, and one saved by rank 0 loaded into
the whole and the split model), all as one process's. On the split Llama and that DeepSeek-V3, a
compiled decode step (``fullgraph=True``, graphs run as traced) gives the eager tokens for
``COMPILED_PRESETS``.

Exits non-zero with the failures listed; rank 0 logs one line per preset.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from transformers import (
    AutoModelForCausalLM,
    CompileConfig,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DistributedConfig,
    FalconH1Config,
    FalconH1ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
)

import kvcake
from kvcake.fp8 import recent_bytes
from kvcake.method import PRESETS
from kvcake.recurrent import RecurrentLayer
from kvcake.sliding import SlidingLayer

try:  # transformers 5.2x: a linear-attention hybrid
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
except ImportError:
    Qwen3_5ForCausalLM = Qwen3_5TextConfig = None
try:  # transformers 5.24 (5.12's Gemma 4 has no per-layer configs; the suite tests it alone)
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
except ImportError:
    Gemma4ForCausalLM = Gemma4TextConfig = None
try:  # chunked attention (three layers in four), a MoE block in every layer
    from transformers import Llama4ForCausalLM, Llama4TextConfig
except ImportError:
    Llama4ForCausalLM = Llama4TextConfig = None
from kvcake.tensor_parallel import HeadSplit

# The tensor-parallel forward sums o_proj's and down_proj's partial products over ranks, so its
# logits differ from the one-process forward by float32 rounding (measured ~1e-6 here).
LOGIT_ATOL = 1e-4
# With the kept entries in float8, an element whose tensor-parallel value differs by that rounding
# can round to the neighbouring float8 value (1/16 apart): measured up to 3.1e-4 on the logits.
# The scales (one per layer, from the largest magnitude over every rank) differ by the rounding.
FP8_LOGIT_ATOL, SCALE_RTOL = 1e-3, 1e-5
PROMPT, PADDED, BUDGET, NEW_TOKENS = 1024, 300, 64, 8
# one preset per layer allocator, head allocator and selector, to keep the run short
HYBRID_PRESETS = ("snapkv", "cake", "adakv", "cake-adakv", "layer-defensivekv")
# Gemma 4 without layer-defensivekv: on this tiny model its one ranking over the layers keeps one entry
# differently under the float32 rounding of the tensor-parallel sums in 2 of 3 batches (positions
# 575 and 579 of a head in this batch, seed 1), exactly as one process in float64 does; criticalkv,
# defensivekv and the other presets keep the same entries there (scripts/near_ties.py, 2026-12-01)
GEMMA4_PRESETS = ("snapkv", "cake", "adakv", "cake-adakv", "criticalkv", "defensivekv")
# the models, each with the presets run on it; Qwen3.5 where the installed transformers has it
MODELS = (
    (("llama", PRESETS), ("gemma3", HYBRID_PRESETS))
    + ((("gemma4", GEMMA4_PRESETS),) if Gemma4TextConfig is not None else ())
    + ((("qwen3_5", HYBRID_PRESETS),) if Qwen3_5TextConfig is not None else ())
    + ((("llama4", HYBRID_PRESETS),) if Llama4TextConfig is not None else ())
)
# the models whose attention the plan leaves whole (but for latents' query heads), with the presets
# run on them (``check_whole``): the last, DeepSeek-V3 with its query heads split, runs every preset
WHOLE = ("deepseek_v3", "falcon_h1", "gpt_oss", "olmo2", "deepseek_v3_heads")
# DeepSeek-V3's query heads split over the ranks, its latents whole on each (transformers 5.25's plan
# for its attention; 5.24 takes it as an override of its own plan)
MLA_HEADS_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.kv_b_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
}
# what a model loads with beyond the plan: GPT-OSS's sinks need the eager attention (SDPA has none)
LOAD_KWARGS = {
    "gpt_oss": {"attn_implementation": "eager"},
    "deepseek_v3_heads": {"distributed_config": DistributedConfig(tp_plan=MLA_HEADS_PLAN)},
}
COMPILED_PRESETS = ("tova", "snapkv", "adakv")  # TOVA's mean over ranks, a pooled score, Ada-KV's ragged step
WHOLE_PRESETS = ("snapkv", "cake", "adakv", "criticalkv", "h2o")
HEADINGS = {
    "gemma3": "Gemma 3 hybrid (sliding, full, sliding, full):",
    "gemma4": "Gemma 4 hybrid (sliding, full, sliding, full; full layers 2 KV heads of dim 32):",
    "deepseek_v3": "DeepSeek-V3 (latent attention; transformers 5.24's plan splits its MLP and experts, 5.25's its query heads too):",
    "deepseek_v3_heads": "DeepSeek-V3 with its query heads split (MLA_HEADS_PLAN; the latents whole on every rank):",
    "falcon_h1": "Falcon-H1 (attention beside Mamba in every layer; the plan splits its embeddings only):",
    "gpt_oss": "GPT-OSS (attention sinks, sliding and full layers, MoE; the plan splits its embeddings only):",
    "olmo2": "OLMo 2 (the plan gathers the keys on every rank and splits the output projection's input):",
    "qwen3_5": "Qwen3.5 hybrid (linear attention, full, linear attention, full):",
    "llama4": "Llama 4 (three chunked layers of 64 tokens, then a full one, twice; MoE in every layer):",
}
logger = logging.getLogger("check_tp")


def save_tiny(folder: str, kind: str) -> None:
    torch.manual_seed(0)
    shape = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
    )  # fmt: skip
    if kind == "qwen3_5":
        types = ["linear_attention", "full_attention"] * 2
        config = Qwen3_5TextConfig(**shape, head_dim=16, layer_types=types, linear_num_key_heads=2,
                                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)  # fmt: skip
        Qwen3_5ForCausalLM(config).save_pretrained(folder)
    elif kind == "gemma3":
        types = ["sliding_attention", "full_attention"] * 2
        config = Gemma3TextConfig(**shape, head_dim=16, sliding_window=64, layer_types=types)
        Gemma3ForCausalLM(config).save_pretrained(folder)
    elif kind == "gemma4":
        types = ["sliding_attention", "full_attention"] * 2
        config = Gemma4TextConfig(**shape, head_dim=16, global_head_dim=32, num_global_key_value_heads=2,
                                  attention_k_eq_v=True, sliding_window=64, layer_types=types,
                                  hidden_size_per_layer_input=8, vocab_size_per_layer_input=256)  # fmt: skip
        Gemma4ForCausalLM(config).save_pretrained(folder)
    elif kind == "llama4":
        config = Llama4TextConfig(**{**shape, "num_hidden_layers": 8}, head_dim=16, intermediate_size_mlp=128,
                                  attention_chunk_size=64, num_local_experts=2, num_experts_per_tok=1)  # fmt: skip
        Llama4ForCausalLM(config).save_pretrained(folder)
    elif kind == "falcon_h1":
        config = FalconH1Config(**shape, head_dim=16, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
                                mamba_d_state=8, mamba_d_conv=4, mamba_expand=1, mamba_d_ssm=64)  # fmt: skip
        FalconH1ForCausalLM(config).save_pretrained(folder)
    elif kind == "gpt_oss":  # sinks drawn large (N(0, 2)), so that they weigh in the softmax
        types = ["sliding_attention", "full_attention"] * 2
        config = GptOssConfig(**shape, head_dim=16, sliding_window=64, layer_types=types, num_local_experts=2,
                              num_experts_per_tok=1)  # fmt: skip
        model = GptOssForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
        model.save_pretrained(folder)
    elif kind.startswith("deepseek_v3"):
        mla = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                   n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                   n_group=1, topk_group=1)  # fmt: skip
        DeepseekV3ForCausalLM(DeepseekV3Config(**{**shape, "num_key_value_heads": 8}, **mla)).save_pretrained(
            folder
        )
    elif kind == "olmo2":  # q/k/v colwise_gather_output (norms over every head), o_proj rowwise_split_input
        Olmo2ForCausalLM(Olmo2Config(**shape)).save_pretrained(folder)
    else:
        LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(folder)


def batch(seed: int, length: int = PROMPT) -> tuple[torch.Tensor, torch.Tensor]:
    """Two random prompts, the second left-padded to the first's length (``PADDED`` padding tokens),
    and their attention mask."""
    ids = torch.randint(3, 256, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :PADDED], mask[1, :PADDED] = 0, 0
    return ids, mask


def run(model, ids, mask, preset, static, kv_dtype=None):
    method = kvcake.make_method(preset, budget=BUDGET)
    cache = kvcake.KVCakeCache(model, method, static=static, kv_dtype=kv_dtype)
    with kvcake.enable(model), torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, **kvcake.with_cache(model, cache), max_new_tokens=NEW_TOKENS, do_sample=False,
            output_scores=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
    return out, cache


def beam_search(model, ids, mask, preset) -> torch.Tensor:
    """Three beams a prompt, static storage (permuted in place at every step): the new tokens."""
    cache = kvcake.KVCakeCache(model, kvcake.make_method(preset, budget=BUDGET))
    with kvcake.enable(model), torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **kvcake.with_cache(model, cache), max_new_tokens=NEW_TOKENS,
                             num_beams=3, do_sample=False, pad_token_id=0)  # fmt: skip
    return out[:, ids.shape[1] :]


def compiled_differs(model, ids, mask, preset) -> list[str]:
    """Decoding compiled whole (``fullgraph=True``, graphs run as traced: no inductor on 2 cores) gives
    the eager tokens on the split model; its step reads each rank's weight shards and exchanges
    what TOVA's and the pooled scores need inside the graph."""
    tokens, graphs = [], []

    def backend(gm, example_inputs):  # the eager backend's, counting the graphs it is given
        graphs.append(gm)
        return gm.forward

    for compiled in (False, True):
        cache = kvcake.KVCakeCache(model, kvcake.make_method(preset, budget=BUDGET))
        config = CompileConfig(fullgraph=True, backend=backend, mode=None)
        config._compile_all_devices = True  # transformers compiles on accelerators only by default
        with kvcake.enable(model), torch.no_grad():
            out = model.generate(
                ids, attention_mask=mask, **kvcake.with_cache(model, cache), max_new_tokens=NEW_TOKENS,
                do_sample=False, pad_token_id=0, disable_compile=not compiled, compile_config=config,
            )  # fmt: skip
        tokens.append(out[:, ids.shape[1] :])
    torch._dynamo.reset()
    if not graphs:
        return ["generate decoded without compiling a step"]
    return [] if torch.equal(*tokens) else [f"compiled {tokens[1].tolist()} vs eager {tokens[0].tolist()}"]


def heads_bytes(layer, heads: slice, world: int) -> int:
    """What a one-process cache layer holds for ``heads``: a dense layer (B, H_kv, N, d) holds
    N slots per head; a ragged one its heads' segments (kept entries, or a static layer's
    capacities) of head_dim keys and values each."""
    if isinstance(layer, RecurrentLayer):  # a linear-attention layer's states: whole on every rank
        return layer.kv_bytes()
    if layer.keys is None:
        return 0
    if isinstance(layer, SlidingLayer):
        flags = 0 if layer.valid is None else layer.valid.numel()  # (B, window) bools, not per head
        return (layer.kv_bytes() - flags) // world + flags
    if layer.keys.dim() == 4:
        return layer.kv_bytes() // world
    segments = layer.capacity if layer.static is not None else layer.counts  # (B, H_kv)
    slots = int(segments[:, heads].sum()) + (layer.static is not None)  # + every static ragged
    # layer's one empty slot; float8: each head's ring of recent entries (B, H_kv, RECENT, d) too
    return slots * layer.keys.shape[-1] * 2 * layer.keys.element_size() + recent_bytes(layer) // world


def exchanged_in_prefill(model, ids, mask, preset) -> tuple[int, int]:
    """(all-gathers, bytes this rank sent) while kvcake compresses the prompts (prefill only)."""
    calls = []
    gather = HeadSplit.gather

    def counting(self, t):
        calls.append(t.numel() * t.element_size())
        return gather(self, t)

    HeadSplit.gather = counting
    try:
        kvcake.compress(model, ids, preset, attention_mask=mask, budget=BUDGET)
    finally:
        HeadSplit.gather = gather
    return len(calls), sum(calls)


def context_answer(model, ids, mask, preset) -> torch.Tensor:
    """Context-only use: compress the prompts, then answer a question on a fork of the context."""
    ctx = kvcake.compress(model, ids, preset, attention_mask=mask, budget=BUDGET)
    question = torch.arange(10, 26).expand(ids.shape[0], -1)
    return ctx.generate(question, max_new_tokens=4, do_sample=False, pad_token_id=0)


def compare_outputs(out, ref, atol: float, bad: list[str]) -> float:
    """Append to ``bad`` where ``generate``'s tokens differ or its logits differ by more than ``atol``;
    returns the largest logit difference."""
    if not torch.equal(out.sequences, ref.sequences):
        bad.append(
            f"tokens differ: {out.sequences[:, -NEW_TOKENS:].tolist()} vs {ref.sequences[:, -NEW_TOKENS:].tolist()}"
        )
    diff = max(float((a - b).abs().max()) for a, b in zip(out.scores, ref.scores, strict=True))
    if diff > atol:
        bad.append(f"logits differ by {diff:.2e} > {atol}")
    return diff


def check(preset: str, full, tp, ids, mask, static: bool, rank: int, world: int, kv_dtype=None) -> list[str]:
    bad = []
    ref, ref_cache = run(full, ids, mask, preset, static, kv_dtype)
    out, cache = run(tp, ids, mask, preset, static, kv_dtype)
    if cache.split is None or cache.split.world != world:
        bad.append(f"the split was not found from the model ({cache.split})")
    diff = compare_outputs(out, ref, LOGIT_ATOL if kv_dtype is None else FP8_LOGIT_ATOL, bad)
    budgets = cache.budgets
    every = [torch.empty_like(budgets) for _ in range(world)]
    dist.all_gather(every, budgets)  # its own collective, not kvcake's
    if not all(torch.equal(b, budgets) for b in every):
        bad.append(f"ranks hold different layer budgets: {[b.tolist() for b in every]}")
    if not torch.equal(budgets, ref_cache.budgets):
        bad.append(f"layer budgets {budgets.tolist()} != one process {ref_cache.budgets.tolist()}")
    h = cache.layer_counts().shape[-1]
    heads = slice(rank * h, (rank + 1) * h)
    if h * world != ref_cache.layer_counts().shape[-1]:
        bad.append(f"rank holds {h} KV heads, not 1/{world} of {ref_cache.layer_counts().shape[-1]}")
    if not (cache.decode_budget == ref_cache.decode_budget[..., heads]).all():
        bad.append(
            f"head budgets {cache.decode_budget.tolist()} != slice {ref_cache.decode_budget[..., heads].tolist()}"
        )
    counts, ref_counts = cache.layer_counts(), ref_cache.layer_counts()[..., heads]
    if not (counts == ref_counts).all():
        bad.append(f"kept entries per head {counts.tolist()} != slice {ref_counts.tolist()}")
    share = sum(heads_bytes(layer, heads, world) for layer in ref_cache.layers)
    if cache.kv_bytes() != share:
        bad.append(
            f"rank holds {cache.kv_bytes()} bytes, its heads' share of the one-process cache is {share}"
        )
    if kv_dtype is not None:
        missing = [lid for lid in cache.compressed if cache.layers[lid].kv_scales is None]
        if missing:
            bad.append(f"compressed layers {missing} are not stored in float8")
        differ = [
            lid for lid in cache.compressed if lid not in missing and not torch.allclose(
                torch.stack(cache.layers[lid].kv_scales), torch.stack(ref_cache.layers[lid].kv_scales), rtol=SCALE_RTOL, atol=0
            )
        ]  # fmt: skip
        if rank == 0:
            logger.info(
                "%-15s float8: logits %.1e | KV bytes/rank %d of %d",
                preset,
                diff,
                cache.kv_bytes(),
                ref_cache.kv_bytes(),
            )
        if differ:
            bad.append(
                f"float8 scales of layers {differ} differ from the one-process ones by more than {SCALE_RTOL}"
            )
    if not static:
        answer, ref_answer = context_answer(tp, ids, mask, preset), context_answer(full, ids, mask, preset)
        if not torch.equal(answer, ref_answer):
            bad.append(f"context answers differ: {answer.tolist()} vs {ref_answer.tolist()}")
        n, sent = exchanged_in_prefill(tp, ids, mask, preset)
        if rank == 0:
            logger.info(
                "%-15s budgets %s | rank 0 head budgets %s | logits %.1e | KV bytes/rank %d of %d"
                " | prefill: %d all-gathers, %d bytes sent/rank",
                preset, budgets[0].tolist(), cache.decode_budget[0].tolist(), diff, cache.kv_bytes(),
                ref_cache.kv_bytes(), n, sent,
            )  # fmt: skip
    return bad


def check_whole(preset: str, full, tp, ids, mask, static: bool, kv_dtype=None) -> list[str]:
    """A model whose attention the plan leaves whole, or whose latents it leaves whole (``group_split``:
    query heads split): no head split, and everything as one process's."""
    bad = []
    ref, ref_cache = run(full, ids, mask, preset, static, kv_dtype)
    out, cache = run(tp, ids, mask, preset, static, kv_dtype)
    if cache.split is not None:
        bad.append(f"a split was found where the attention is whole: {cache.split}")
    diff = compare_outputs(out, ref, LOGIT_ATOL if kv_dtype is None else FP8_LOGIT_ATOL, bad)
    if (
        not torch.equal(cache.budgets, ref_cache.budgets)
        or not (cache.layer_counts() == ref_cache.layer_counts()).all()
    ):
        bad.append(f"budgets {cache.budgets.tolist()} or kept entries differ from one process's")
    else:
        differ = [lid for lid in cache.compressed if not torch.equal(
            cache.layers[lid].padded_positions().sort(-1).values,
            ref_cache.layers[lid].padded_positions().sort(-1).values,
        )]  # fmt: skip
        if differ:
            bad.append(f"layers {differ} keep other positions than one process's")
    if cache.kv_bytes() != ref_cache.kv_bytes():
        bad.append(f"rank holds {cache.kv_bytes()} bytes, one process {ref_cache.kv_bytes()}")
    if dist.get_rank() == 0:
        logger.info("%-15s %sbudgets %s | logits %.1e | KV bytes/rank %d (one process: %d)", preset,
                    "float8: " if kv_dtype else "", cache.budgets[0].tolist(), diff, cache.kv_bytes(),
                    ref_cache.kv_bytes())  # fmt: skip
    return bad


def saved_whole(full, tp, ids, mask, rank: int) -> list[str]:
    """Every rank of a latent model whose query heads are split holds the latents whole: a context
    compressed there and saved by rank 0 loads into the whole model and into the split one, and
    answers as the one-process context."""
    question = torch.arange(10, 26).expand(ids.shape[0], -1)
    ask = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    ref = kvcake.compress(full, ids, "cake", attention_mask=mask, budget=BUDGET).generate(question, **ask)
    ctx = kvcake.compress(tp, ids, "cake", attention_mask=mask, budget=BUDGET)
    bad = []
    with tempfile.TemporaryDirectory() as tmp:
        path = [os.path.join(tmp, "ctx.kvc") if rank == 0 else None]
        if rank == 0:
            ctx.save(path[0])
        dist.broadcast_object_list(path, src=0)
        for name, model in (("the whole model", full), ("the split model", tp)):
            answer = kvcake.load_context(model, path[0]).generate(question, **ask)
            if not torch.equal(answer, ref):
                bad.append(f"loaded into {name}, it answers {answer.tolist()}, not {ref.tolist()}")
        dist.barrier()  # rank 0's file is read by every rank before it goes
    return bad


def group_split_of(tp) -> int | None:
    """How many ranks share each latent layer's query group (``KVCakeCache.group_split``), or None."""
    split = kvcake.KVCakeCache(tp, "snapkv", budget=BUDGET).group_split
    return None if split is None else split.world


def load_both(rank: int, kind: str):
    """The tiny model, whole and split with ``tp_plan="auto"`` (or its ``LOAD_KWARGS``' plan), on every
    rank (rank 0 saves it)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = [os.path.join(tmp, "tiny") if rank == 0 else None]
        if rank == 0:
            save_tiny(folder[0], kind)
        dist.broadcast_object_list(folder, src=0)
        dist.barrier()
        extra = LOAD_KWARGS.get(kind, {})
        plan = (
            {} if "distributed_config" in extra else {"tp_plan": "auto"}
        )  # an explicit plan, or the model's
        tp = AutoModelForCausalLM.from_pretrained(folder[0], **plan, **extra)
        whole = {k: v for k, v in extra.items() if k != "distributed_config"}
        full = AutoModelForCausalLM.from_pretrained(folder[0], **whole)
        dist.barrier()  # rank 0's folder is read by every rank before it goes
    return full, tp


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    logging.getLogger("kvcake").setLevel(logging.ERROR)  # the tiny model's tau fallback warning
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ids, mask = batch(1)
    failed = {}
    for kind, presets in MODELS:
        full, tp = load_both(rank, kind)
        hybrid = kind != "llama"
        shared = [p for p in HYBRID_PRESETS if p in presets]  # the float8 and beam checks run these
        if rank == 0 and hybrid:
            logger.info(HEADINGS[kind])
        for static in (False, True):  # the sort-and-copy decoding path and the preallocated one
            for preset in presets:
                bad = check(preset, full, tp, ids, mask, static, rank, world)
                if bad:
                    failed[f"{kind} {preset}{' static' if static else ''}"] = bad
        for preset in shared:  # float8 storage: the scales over every rank's heads
            bad = check(preset, full, tp, ids, mask, True, rank, world, kv_dtype="fp8")
            if bad:
                failed[f"{kind} {preset} fp8"] = bad
        for preset in shared:  # beam search: each rank reorders its heads' rows alike
            beams = [beam_search(model, ids, mask, preset) for model in (full, tp)]
            if not torch.equal(*beams):
                failed[f"{kind} {preset} beams"] = [f"{beams[1].tolist()} vs {beams[0].tolist()}"]
        if kind == "llama":  # a compiled step per preset that exchanges while decoding
            for preset in COMPILED_PRESETS:
                if bad := compiled_differs(tp, ids, mask, preset):
                    failed[f"{kind} {preset} compiled"] = bad
    ctx = kvcake.compress(tp, ids, "snapkv", attention_mask=mask, budget=BUDGET)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            ctx.save(os.path.join(tmp, "ctx.kvc"))
            failed["save"] = ["a rank's context was saved as if it held every head"]
        except ValueError as err:
            if "tensor-parallel" not in str(err):
                failed["save"] = [f"unexpected refusal: {err}"]
    for kind in WHOLE:
        full, tp = load_both(rank, kind)
        grouped = group_split_of(tp)
        if rank == 0:
            logger.info("%s%s", HEADINGS[kind], f" (query heads over {grouped} ranks)" if grouped else "")
        if kind == "deepseek_v3_heads" and grouped != world:
            failed[kind] = [f"the query heads' split over {world} ranks was not found ({grouped})"]
        presets = PRESETS if kind == "deepseek_v3_heads" else WHOLE_PRESETS
        for static in (False, True):
            for preset in presets:
                bad = check_whole(preset, full, tp, ids, mask, static)
                if bad:
                    failed[f"{kind} {preset}{' static' if static else ''}"] = bad
        if kind != "deepseek_v3_heads":
            continue
        for preset in WHOLE_PRESETS:  # a compressed context answers as one process's
            answer, ref_answer = (
                context_answer(tp, ids, mask, preset),
                context_answer(full, ids, mask, preset),
            )
            if not torch.equal(answer, ref_answer):
                failed[f"{kind} {preset} context"] = [f"{answer.tolist()} vs {ref_answer.tolist()}"]
        if bad := saved_whole(full, tp, ids, mask, rank):
            failed[f"{kind} save"] = bad
        for preset in HYBRID_PRESETS:  # float8 (the latents' one scale is the same on every rank), beams
            bad = check_whole(preset, full, tp, ids, mask, True, kv_dtype="fp8")
            if bad:
                failed[f"{kind} {preset} fp8"] = bad
            beams = [beam_search(model, ids, mask, preset) for model in (full, tp)]
            if not torch.equal(*beams):
                failed[f"{kind} {preset} beams"] = [f"{beams[1].tolist()} vs {beams[0].tolist()}"]
        for preset in COMPILED_PRESETS:  # the latents' up-projections read as shards in the graph
            if bad := compiled_differs(tp, ids, mask, preset):
                failed[f"{kind} {preset} compiled"] = bad
    every = [None] * world
    dist.all_gather_object(every, failed)
    dist.destroy_process_group()
    problems = [f"rank {r} {p}: {b}" for r, f in enumerate(every) for p, bs in f.items() for b in bs]
    if rank == 0:
        for line in problems:
            logger.error("FAIL %s", line)
        logger.info(
            "%s, %d on %s (attention whole), %d on DeepSeek-V3 (query heads split) x %d ranks: %s",
            ", ".join(f"{len(p)} presets on {kind}" for kind, p in MODELS), len(WHOLE_PRESETS),
            ", ".join(WHOLE[:-1]), len(PRESETS), world,
            "FAILED" if problems else "all equal",
        )  # fmt: skip
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
