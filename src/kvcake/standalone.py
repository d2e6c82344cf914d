"""What the subcommands that also run on their own (``python -m kvcake.bench``, ``python -m
kvcake.eval``) share: their ``main()``, their ``kvcake`` subparser, the ``1024,2k`` option type and
``-v`` logging.

A subcommand module defines ``add_arguments(parser)`` and ``run(args) -> int``;
``kvcake.cli`` adds it to the ``kvcake`` command (:func:`add_subcommand`), and
:func:`standalone_main` runs the same parser alone.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable


def standalone_main(
    prog: str,
    description: str | None,
    add_arguments: Callable[..., None],
    run: Callable[[argparse.Namespace], int],
    argv: list[str] | None = None,
) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) with the subcommand's own parser and run it.

    ``args.argv`` keeps the command line, so a run can record how it was started.
    """
    parser = argparse.ArgumentParser(
        prog=prog,
        description=user_description(description),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    # under `kvcake`, the top-level parser owns -v
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log progress on stderr")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.argv = argv
    return run(args)


def add_subcommand(
    subparsers,
    name: str,
    help: str,
    description: str | None,
    add_arguments: Callable[..., argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``name`` to ``kvcake``'s ``argparse`` subparsers, with the subcommand's own arguments."""
    p = subparsers.add_parser(
        name, help=help, description=user_description(description),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    return add_arguments(p)


def user_description(doc: str | None) -> str | None:
    """A module docstring as ``--help`` text: the paragraphs written for developers (those about
    how the module plugs into ``kvcake``: ``configure_parser``, ``EXTENSIONS``) left out."""
    if doc is None:
        return None
    paragraphs = [
        p for p in doc.strip().split("\n\n") if not any(w in p for w in ("configure_parser", "EXTENSIONS"))
    ]
    return "\n\n".join(paragraphs)


def model_placement(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype`` of the model, as ``kvcake generate`` takes them."""
    parser.add_argument("--device", default="cpu", help="torch device of the model (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="parameter dtype (default: float32)")  # fmt: skip


def comma_ints(text: str) -> tuple[int, ...]:
    """``"1024,2k,4096"`` -> (1024, 2048, 4096): ``k`` means 1024 (an ``argparse`` type)."""
    values = []
    for part in (x.strip().lower() for x in text.split(",") if x.strip()):
        try:
            values.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers (k = 1024: 2k,4096), got {text!r}"
            ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return tuple(values)


def threads(text: str) -> int:
    """``--threads``: a positive int (an ``argparse`` type; torch refuses 0 and negative counts)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of threads, got {text!r}")
    return value


def log_progress(args: argparse.Namespace) -> None:
    """With ``-v`` on a standalone run, send the ``kvcake`` loggers' INFO lines to stderr (under
    ``kvcake`` the top-level command has configured them already)."""
    package_logger = logging.getLogger("kvcake")
    if getattr(args, "verbose", 0) and not package_logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        package_logger.addHandler(handler)
        package_logger.setLevel(logging.INFO)
