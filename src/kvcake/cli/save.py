"""``kvcake save``: compress a document and save the compressed context to a file."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import _context_from_args, _report, cache_summary
from .options import _layout_args, _method_args, _storage_args


def _configure_save(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context-file", required=True, help="the document to compress ('-': standard input)")
    p.add_argument("--out", required=True, help="the file to write (e.g. doc.kvc), replaced atomically")
    _method_args(p)
    _storage_args(p)
    _layout_args(p)


def _run_save(args: argparse.Namespace) -> int:
    from ..storage import save_context

    args.load = None
    if Path(args.out).expanduser().is_dir():
        raise IsADirectoryError(f"--out {args.out} is a directory: give a file name such as doc.kvc")
    model, tokenizer, ctx, chat, prefill = _context_from_args(args)
    name = args.model
    if name is not None and Path(name).expanduser().exists():  # a folder or file: usable from anywhere
        name = str(Path(name).expanduser().resolve())
    extra = {"model": name, "chat": chat, "document": Path(args.context_file).name}
    path = save_context(ctx, args.out, extra=extra)
    _report(f"{cache_summary(ctx.cache, 'context')} | {prefill} | {path.stat().st_size:,} bytes written")
    print(path)
    return 0
