"""``kvcake inspect``: draw the budgets and kept positions a method chose."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import _context_ids, _prompt_ids, _read_text, _scenario, _use_chat
from .options import _layout_args, _load, _method, _method_args


def _configure_inspect(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt to compress")
    src.add_argument("--context-file", help="a document to compress (laid out as a context)")
    p.add_argument("--out", required=True, help="folder for the PNG files")
    p.add_argument("--ada-method", default="cake-adakv", help="head-adaptive method for the per-head figure")
    _method_args(p, scenario_for_cake=False)
    _layout_args(p)


def _run_inspect(args: argparse.Namespace) -> int:
    from ..inspect import check_head_adaptive, inspect_prompt
    from ..method import make_method

    method = _method(args)  # bad input fails before the model loads
    check_head_adaptive(make_method(args.ada_method, budget=method.budget.budget, ratio=method.budget.ratio,
                                    window=method.budget.window), "--ada-method")  # fmt: skip
    document = _read_text(args.context_file) if args.context_file else None
    if Path(args.out).expanduser().exists() and not Path(args.out).expanduser().is_dir():
        raise NotADirectoryError(f"--out {args.out} is a file: give a folder for the PNG files")
    model, tokenizer = _load(args)
    chat = _use_chat(tokenizer, args.chat_template)
    if document is not None:
        ids = _context_ids(tokenizer, document, chat)
    else:
        ids = _prompt_ids(tokenizer, args.prompt, chat)
    method = _method(args, ids.shape[1], "context" if document is not None else "question")
    ada = make_method(args.ada_method, budget=method.budget.budget, ratio=method.budget.ratio,
                      window=method.budget.window)  # fmt: skip
    scenario = (
        _scenario(args, "context", "--context-file: a document compressed alone")
        if document is not None
        else _scenario(args, "question", "--prompt: a prompt that ends with its question")
    )
    for path in inspect_prompt(model, tokenizer, ids, method, ada_method=ada, out_dir=args.out, scenario=scenario,
                               report=lambda line: print(line, file=sys.stderr)):  # fmt: skip
        print(path)
    return 0
