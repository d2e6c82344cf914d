"""``kvcake generate``: answer a prompt, or a question about a document."""

from __future__ import annotations

import argparse
import sys
import time

from .common import (
    _PROGRESS_MIN_TOKENS,
    _answer,
    _check_generation,
    _context_from_args,
    _fmt_rate,
    _gen_kwargs,
    _prompt_ids,
    _rate,
    _report,
    _scenario,
    _Streamer,
    _use_chat,
    cache_summary,
)
from .options import _generation_args, _layout_args, _load, _method, _method_args, _storage_args


def _configure_generate(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the whole prompt, compressed with the question (question-aware)")
    src.add_argument(
        "--context-file",
        help="a document to compress ('-': standard input); --question is asked after it (context-only)",
    )
    src.add_argument(
        "--load", metavar="FILE", help="a context saved with 'kvcake save'; --question is asked after it"
    )
    p.add_argument("--question", help="the question asked after --context-file or --load")
    p.add_argument(
        "--compile", action="store_true",
        help="compile the static decode step on any device (torch.compile, fullgraph; kvcake.generate's or a "
        "compressed context's generate(compile=True)); without it transformers compiles on CUDA only. The first "
        "tokens pay for the compilation (minutes on a small CPU, where the compiled step fuses its projections' products)",
    )  # fmt: skip
    _method_args(p)
    _layout_args(p)
    _generation_args(p)
    _storage_args(p)


def _run_generate(args: argparse.Namespace) -> int:
    _check_generation(args)
    if args.prompt is not None and args.question is not None:
        raise ValueError("--question goes with --context-file or --load; put it inside --prompt instead")
    if args.prompt is None and args.question is None:
        raise ValueError("--context-file and --load need --question")
    if args.compile and args.dynamic:
        raise ValueError("--compile compiles the static decode step: drop --dynamic (or --compile)")
    if args.compile and args.num_beams > 1:
        raise ValueError(
            "--compile compiles greedy and sampled decoding; beam search runs eagerly: drop --compile"
        )
    if args.prompt is None:
        model, tokenizer, ctx, chat, prefill = _context_from_args(args)
        gen = _gen_kwargs(args, tokenizer)
        out, streamer, start = _answer(ctx, tokenizer, args.question, chat, gen, compile=args.compile or None)
        first = (streamer.first or time.perf_counter()) - start
        _report(f"{cache_summary(ctx.cache, 'context')} | {prefill} | question + {streamer.label(first)} | "
                f"{out.shape[1]} new tokens, decode {_fmt_rate(streamer)}")  # fmt: skip
        return 0
    import torch

    from ..api import generate

    _method(args)  # bad input fails before the model loads
    model, tokenizer = _load(args)
    gen = _gen_kwargs(args, tokenizer)
    ids = _prompt_ids(tokenizer, args.prompt, _use_chat(tokenizer, args.chat_template)).to(args.device)
    method = _method(args, ids.shape[1], "question")
    streamer = _Streamer(tokenizer, gen)
    start = time.perf_counter()
    scenario = _scenario(args, "question", "--prompt: the prompt is compressed with its question")
    out, cache = generate(model, ids, method, attention_mask=torch.ones_like(ids), **streamer.kwargs(),
                          progress=_PROGRESS_MIN_TOKENS <= ids.shape[1] and sys.stderr.isatty(),
                          scenario=scenario, static=not args.dynamic, compile=True if args.compile else None,
                          kv_dtype=args.kv_dtype, kv_recent=args.kv_recent,
                          **gen)  # fmt: skip
    streamer.finish(out[:, ids.shape[1] :])
    first = (streamer.first or time.perf_counter()) - start
    _report(f"{cache_summary(cache, 'cache')} | prefill {ids.shape[1]} tokens + {streamer.label(first)} "
            f"({_rate(ids.shape[1], first)}) | {out.shape[1] - ids.shape[1]} new tokens, decode "
            f"{_fmt_rate(streamer)}")  # fmt: skip
    return 0
