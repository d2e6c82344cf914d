"""``kvcake chat``: compress a document once, then answer questions read from stdin (one per
line; at a terminal an empty line ends, piped input is read to its end)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from .common import (
    _answer,
    _check_generation,
    _context_from_args,
    _fmt_rate,
    _gen_kwargs,
    _report,
    cache_summary,
)
from .options import _generation_args, _layout_args, _method_args, _storage_args

logger = logging.getLogger("kvcake.cli")


def _configure_chat(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--context-file", help="the document to compress once (a file: the questions come on stdin)"
    )
    src.add_argument("--load", metavar="FILE", help="a context saved with 'kvcake save'")
    _method_args(p)
    _layout_args(p)
    _generation_args(p)
    _storage_args(p)


def _run_chat(args: argparse.Namespace) -> int:
    _check_generation(args)
    if args.context_file == "-":
        raise ValueError("chat reads its questions from standard input: give the document as a file, not -")
    model, tokenizer, ctx, chat, prefill = _context_from_args(args)
    gen = _gen_kwargs(args, tokenizer)
    _report(f"{cache_summary(ctx.cache, 'context')} | {prefill}")
    interactive = sys.stdin.isatty()
    if interactive:
        _report("ask questions about the document; an empty line or Ctrl-D ends")
    asked = 0
    while True:
        if interactive:
            sys.stderr.write("question> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:  # end of input
            break
        if not line.strip():
            if interactive:
                break
            continue  # piped input: blank lines separate questions, only the end of input stops
        out, streamer, start = _answer(ctx, tokenizer, line.strip(), chat, gen)  # a fork of ctx each time
        asked += 1
        logger.info("answer %d: %d tokens in %.2f s, decode %s", asked, out.shape[1],
                    time.perf_counter() - start, _fmt_rate(streamer))  # fmt: skip
    logger.info("answered %d question(s)", asked)
    return 0
