"""The ``kvcake`` command: generate, chat, inspect, save and list methods from a shell.

Prompt layout (``kvcake.prompts.build_prompt``, the same for every command and for the eval):

* with the tokenizer's chat template (the default when it has one; ``--no-chat-template`` to
  turn it off) a document and a question form one user turn, ``<document>\\n\\n<question>``
  (the document stripped of surrounding whitespace); the *context* is the template up to the
  end of ``<document>\\n\\n``, the *question* is ``<question>`` plus the end of the turn and the
  assistant header. The two parts are tokenised separately, so the context-only and the
  question-aware runs of one document see the same ids;
* without a template the context is ``<document>\\n\\n`` (with the tokenizer's BOS token, if
  it adds one) and the question is ``<question>`` as written;
* ``--prompt TEXT`` is a single user turn (or the raw text) compressed as a whole.

Scenarios: ``generate --prompt`` is question-aware (the question is compressed with the rest);
``generate --context-file F --question Q``, ``chat`` and ``save`` are context-only (the
document is compressed once, questions come after it and never change it).

Exit codes: 0 on success, 2 for a usage error or a problem with the inputs (a missing file,
an unknown method, a bad budget, a context file for another model): one ``kvcake: error: ...``
line on stderr (``-vv`` also logs the traceback), 130 on Ctrl-C. The answer goes to stdout,
token by token; the summary (entries and bytes kept against a full cache, timings) to stderr.

Other subcommands plug in through ``EXTENSIONS`` (the hook point: command name -> module). A
module named there that exists is imported when the parser is built and must define
``configure_parser(subparsers) -> ArgumentParser`` (add its sub-parser, named after the command,
to ``kvcake``'s ``argparse`` subparsers) and ``run(args) -> int``; optionally ``EXAMPLES``, a
tuple of command lines shown by ``kvcake --help``. ``kvcake.eval.cli`` and ``kvcake.bench.cli``
are registered; errors they raise get the same one-line treatment as the built-in commands'.

One module per built-in command (``generate``, ``chat``, ``inspect``, ``methods``, ``save``); the
option groups they share are in ``options``, the helpers in ``common``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from .chat import _configure_chat, _run_chat
from .common import cache_summary
from .generate import _configure_generate, _run_generate
from .inspect import _configure_inspect, _run_inspect
from .methods import _configure_methods, _run_methods
from .options import DEFAULT_BUDGET, _common, _verbose
from .save import _configure_save, _run_save

logger = logging.getLogger("kvcake.cli")

# -- subcommand registry ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """A subcommand: its one-line help, ``configure(parser)``, ``run(args) -> int`` and example
    lines for ``kvcake --help``."""

    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    examples: tuple[str, ...] = ()


COMMANDS: dict[str, Command] = {}  # built-in subcommands, filled below

# Hook point for subcommands living in other modules (see the module docstring for the contract):
# name -> module imported when it exists. Add an entry here to add a command.
EXTENSIONS: dict[str, str] = {
    "eval": "kvcake.eval.cli",
    "bench": "kvcake.bench.cli",
    "calibrate": "kvcake.calibration.cli",
}


def _extension_modules() -> dict[str, object]:
    """The ``EXTENSIONS`` modules that exist and import, by command name."""
    found: dict[str, object] = {}
    for name, module_name in EXTENSIONS.items():
        try:
            module = sys.modules.get(module_name)
            if module is None:
                if importlib.util.find_spec(module_name) is None:
                    continue
                module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            continue  # its package is not there (yet)
        except ImportError as err:
            logger.warning("subcommand %r (%s) is unavailable: %s", name, module_name, err)
            continue
        if not (
            callable(getattr(module, "configure_parser", None)) and callable(getattr(module, "run", None))
        ):
            logger.warning(
                "subcommand %r: %s lacks configure_parser(subparsers) or run(args)", name, module_name
            )
            continue
        found[name] = module
    return found


COMMANDS.update({
    "generate": Command(
        "answer a prompt, or a question about a document, with a compressed cache",
        _configure_generate, _run_generate,
        ('kvcake generate --prompt "Name three colours." --method cake --budget 128',
         "kvcake generate --context-file doc.txt --question 'Who wrote it?' --method criticalkv --keep-ratio 0.5",
         "kvcake generate --context-file doc.txt --question 'Who wrote it?' --method full",
         "kvcake generate --load doc.kvc --question 'When?'"),
    ),
    "chat": Command(
        "compress a document once, then answer questions read from stdin",
        _configure_chat, _run_chat,
        ("kvcake chat --context-file doc.txt --method cake --budget 256",
         "printf 'Who?\\nWhen?\\n' | kvcake chat --load doc.kvc"),
    ),
    "inspect": Command(
        "draw the budgets and kept positions a method chose (PNG figures)",
        _configure_inspect, _run_inspect,
        ("kvcake inspect --context-file doc.txt --budget 128 --out figures/",),
    ),
    "methods": Command(
        "list the method presets with their parts and defaults",
        _configure_methods, _run_methods, ("kvcake methods --parts",),
    ),
    "save": Command(
        "compress a document and save the compressed context to a file",
        _configure_save, _run_save,
        ("kvcake save --context-file doc.txt --method cake --budget 128 --out doc.kvc",),
    ),
})  # fmt: skip


# -- entry point --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    extensions = _extension_modules()
    lines = [line for cmd in COMMANDS.values() for line in cmd.examples]
    lines += [line for module in extensions.values() for line in getattr(module, "EXAMPLES", ())]
    examples = "\n".join(f"  {line}" for line in lines)
    parser = argparse.ArgumentParser(
        prog="kvcake",
        description="Compress the KV cache of a Hugging Face causal LM (CAKE, Ada-KV, CriticalKV, baselines).",
        epilog=f"examples:\n{examples}\n\nRun 'kvcake COMMAND --help' for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _verbose(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in COMMANDS.items():
        epilog = "examples:\n" + "\n".join(f"  {line}" for line in cmd.examples) if cmd.examples else None
        p = sub.add_parser(name, help=cmd.help, description=cmd.help, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        _verbose(p)
        if name != "methods":  # the one built-in command that runs no model: no --model to ignore
            _common(p, load=name in ("generate", "chat"))
        cmd.configure(p)
        p.set_defaults(run=cmd.run)
    for name, module in extensions.items():
        p = module.configure_parser(sub) or sub.choices.get(name)
        if p is not None:
            if not any("-v" in action.option_strings for action in p._actions):
                _verbose(p)  # `kvcake eval -v` as well as `kvcake -v eval`
            p.set_defaults(run=module.run)
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (tests and callers may swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


_HANDLER = _StderrHandler()
_HANDLER.setFormatter(logging.Formatter("kvcake: %(message)s"))


def _configure_logging(verbose: int) -> None:
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    package = logging.getLogger("kvcake")
    if _HANDLER not in package.handlers:
        package.addHandler(_HANDLER)
    package.setLevel(level)
    try:
        import transformers

        transformers.logging.set_verbosity(logging.INFO if verbose >= 2 else logging.ERROR)
        if verbose >= 2:
            transformers.logging.enable_progress_bar()
        else:  # no "Loading weights" bars for a 0.3 s load
            transformers.logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


def main(argv: list[str] | None = None) -> int:
    """Run the ``kvcake`` command line; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error argparse already reported
        return exit_.code if isinstance(exit_.code, int) else 2
    verbose = getattr(args, "verbose", 0)
    _configure_logging(verbose)
    try:
        return int(args.run(args) or 0)
    except (ValueError, OSError, ModuleNotFoundError, NotImplementedError) as err:
        if verbose:
            logger.debug("%s", "".join(traceback.format_exception(err)).rstrip())
        sys.stderr.write(f"kvcake: error: {_one_line(err)}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("kvcake: interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["COMMANDS", "DEFAULT_BUDGET", "EXTENSIONS", "Command", "build_parser", "cache_summary", "main"]
