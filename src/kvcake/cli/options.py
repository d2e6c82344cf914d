"""The option groups the commands share (model, compression, layout, generation, verbosity), and
the method and model they name."""

from __future__ import annotations

import argparse
import logging
import time

import torch

logger = logging.getLogger("kvcake.cli")

DEFAULT_BUDGET = 128  # the papers' "128L" when neither --budget nor --ratio is given


def _common(parser: argparse.ArgumentParser) -> None:
    """--model and friends, accepted by every command that runs a model."""
    from ..models import DEFAULT_MODEL

    g = parser.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help=f"built-in name, model folder, .gguf file or Hub id (default: {DEFAULT_MODEL}; with "
                        "--load, the model the context was saved with)")  # fmt: skip
    g.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="parameter dtype (default: float32)")  # fmt: skip
    g.add_argument("--offline", action="store_true", help="never contact the Hugging Face Hub for a Hub id")


def _method_args(parser: argparse.ArgumentParser, default_method: str = "cake") -> None:
    g = parser.add_argument_group("compression")
    g.add_argument("--method", default=None,
                   help=f"preset ('kvcake methods') or composed spec such as "
                        f"'layers=cake,heads=adakv,score=cake,select=critical' (default: {default_method})")  # fmt: skip
    size = g.add_mutually_exclusive_group()
    size.add_argument("--budget", type=int, default=None,
                      help=f"average KV entries kept per layer and KV head (default: {DEFAULT_BUDGET})")  # fmt: skip
    size.add_argument("--ratio", type=float, default=None, help="kept fraction of the prompt, in (0, 1]")
    g.add_argument("--window", type=int, default=None, help="observation window, always kept (default: 32)")
    parser.set_defaults(default_method=default_method)


def _layout_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                        help="wrap the text in the tokenizer's chat template (default: when it has one)")  # fmt: skip


def _generation_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=64, help="answer length limit (default: 64)")


def _verbose(parser: argparse.ArgumentParser, top: bool = False) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=0 if top else argparse.SUPPRESS,
                        help="more logging (-v: steps and timings, -vv: debug and tracebacks)")  # fmt: skip


def _method(args: argparse.Namespace):
    """Build (and so validate) the method before the model is loaded: bad input fails fast."""
    from ..method import make_method

    budget, ratio = args.budget, args.ratio
    if budget is None and ratio is None:
        budget = DEFAULT_BUDGET
    return make_method(args.method or args.default_method, budget=budget, ratio=ratio,
                       window=32 if args.window is None else args.window)  # fmt: skip


def _load(args: argparse.Namespace, saved_model: str | None = None):
    from ..models import DEFAULT_MODEL, load_model

    name = args.model or saved_model or DEFAULT_MODEL
    start = time.perf_counter()
    model, tokenizer = load_model(name, dtype=getattr(torch, args.dtype), device=args.device,
                                  local_files_only=args.offline)  # fmt: skip
    logger.info("loaded model %s in %.1f s", name, time.perf_counter() - start)
    return model, tokenizer
