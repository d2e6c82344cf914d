"""The ``main()`` of a subcommand run on its own (``python -m kvcake.bench``, ``python -m kvcake.eval``).

A subcommand module defines ``add_arguments(parser, standalone=...)`` and ``run(args) -> int``;
``kvcake.cli`` adds it to the ``kvcake`` command, and this runs the same parser alone.
"""

from __future__ import annotations

import argparse
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
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser, standalone=True)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.argv = argv
    return run(args)
