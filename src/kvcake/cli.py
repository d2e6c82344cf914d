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
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("kvcake.cli")

DEFAULT_BUDGET = 128  # the papers' "128L" when neither --budget nor --ratio is given

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


# -- shared arguments ---------------------------------------------------------------------------------


def _common(parser: argparse.ArgumentParser) -> None:
    """--model and friends, accepted by every command that runs a model."""
    from .models import DEFAULT_MODEL

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


# -- helpers ------------------------------------------------------------------------------------------


def _method(args: argparse.Namespace):
    """Build (and so validate) the method before the model is loaded: bad input fails fast."""
    from .method import make_method

    budget, ratio = args.budget, args.ratio
    if budget is None and ratio is None:
        budget = DEFAULT_BUDGET
    return make_method(args.method or args.default_method, budget=budget, ratio=ratio,
                       window=32 if args.window is None else args.window)  # fmt: skip


def _load(args: argparse.Namespace, saved_model: str | None = None):
    from .models import DEFAULT_MODEL, load_model

    name = args.model or saved_model or DEFAULT_MODEL
    start = time.perf_counter()
    model, tokenizer = load_model(name, dtype=getattr(torch, args.dtype), device=args.device,
                                  local_files_only=args.offline)  # fmt: skip
    logger.info("loaded model %s in %.1f s", name, time.perf_counter() - start)
    return model, tokenizer


def _read_text(path: str) -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"no such file: {p}" if not p.exists() else f"{p} is not a file")
    text = p.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"{p} is empty")
    return text


def _use_chat(tokenizer, flag: bool | None) -> bool:
    has = bool(getattr(tokenizer, "chat_template", None))
    if flag and not has:
        raise ValueError("--chat-template: this tokenizer has no chat template (use --no-chat-template)")
    return has if flag is None else flag


def _context_ids(tokenizer, document: str, chat: bool) -> torch.Tensor:
    from .prompts import build_prompt

    return build_prompt(tokenizer, document.strip() + "\n\n", "", chat=chat).context


def _question_ids(tokenizer, question: str, chat: bool) -> torch.Tensor:
    from .prompts import build_prompt

    if not question.strip():
        raise ValueError("the question is empty")
    return build_prompt(tokenizer, "", question, chat=chat).question


def _prompt_ids(tokenizer, prompt: str, chat: bool) -> torch.Tensor:
    from .prompts import build_prompt

    if not prompt.strip():
        raise ValueError("the prompt is empty")
    return build_prompt(tokenizer, prompt, "", chat=chat).full


def _check_generation(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")


def _gen_kwargs(args: argparse.Namespace, tokenizer) -> dict:
    return {"max_new_tokens": args.max_new_tokens, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}


class _Streamer:
    """Prints new tokens as whole words (transformers' ``TextStreamer``) and times them."""

    def __init__(self, tokenizer) -> None:
        from transformers import TextStreamer

        self.first: float | None = None
        self.last: float | None = None
        self.count = 0
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        streamer.on_finalized_text = self._write
        self._inner = streamer

    @staticmethod
    def _write(text: str, stream_end: bool = False) -> None:
        sys.stdout.write(text + ("\n" if stream_end else ""))
        sys.stdout.flush()

    def put(self, value: torch.Tensor) -> None:
        if not self._inner.next_tokens_are_prompt:
            self.last = time.perf_counter()
            self.first = self.first or self.last
            self.count += value.numel()
        self._inner.put(value)

    def end(self) -> None:
        self._inner.end()

    def decode_rate(self) -> float | None:
        if self.count < 2 or self.first is None or self.last <= self.first:
            return None
        return (self.count - 1) / (self.last - self.first)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def cache_summary(cache, label: str) -> str:
    """One line: entries and bytes kept against a full cache holding the same tokens."""
    info = cache.info
    tokens = cache.layers[0].length
    batch = cache.layers[0].batch
    kept = cache.kept_entries()
    full = batch * tokens * info.num_layers * info.num_kv_heads
    element = cache.layers[0].keys.element_size()
    full_bytes = full * 2 * info.head_dim * element
    return (f"{label}: {cache.method.name} kept {kept:,} of {full:,} KV entries ({100 * kept / full:.1f}%), "
            f"{_fmt_bytes(cache.kv_bytes())} vs {_fmt_bytes(full_bytes)} full "
            f"({100 * cache.kv_bytes() / full_bytes:.1f}%)")  # fmt: skip


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f} tok/s" if seconds > 0 else "- tok/s"


def _report(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


# Prompts at least this long show a per-layer prefill bar on an interactive terminal.
_PROGRESS_MIN_TOKENS = 1024


def _compress(model, ids: torch.Tensor, method):
    from .api import compress

    start = time.perf_counter()
    ctx = compress(model, ids, method, progress=_PROGRESS_MIN_TOKENS <= ids.shape[1] and sys.stderr.isatty())
    seconds = time.perf_counter() - start
    logger.info("compressed %d tokens in %.2f s (%s) with %s", ids.shape[1], seconds,
                _rate(ids.shape[1], seconds), method.describe())  # fmt: skip
    return ctx, seconds


def _context_from_args(args: argparse.Namespace):
    """(model, tokenizer, compressed context, chat layout, prefill line) from --context-file or --load."""
    if args.load:
        from .storage import load_context, read_context_info

        if args.method or args.budget is not None or args.ratio is not None or args.window is not None:
            raise ValueError(
                "--load uses the method saved with the context: drop --method/--budget/--ratio/--window"
            )
        info = read_context_info(args.load)
        extra = info.get("extra") or {}
        model, tokenizer = _load(args, extra.get("model"))
        start = time.perf_counter()
        ctx = load_context(model, args.load)
        chat = extra.get("chat")
        if chat is None:
            chat = _use_chat(tokenizer, args.chat_template)
        elif args.chat_template is not None and args.chat_template != chat:
            logger.warning("%s was made %s the chat template: its questions are too", args.load,
                           "with" if chat else "without")  # fmt: skip
        line = f"loaded {ctx.input_ids.shape[1]} context tokens from {args.load} in {time.perf_counter() - start:.2f} s"
        return model, tokenizer, ctx, chat, line
    method = _method(args)
    document = _read_text(args.context_file)
    model, tokenizer = _load(args)
    chat = _use_chat(tokenizer, args.chat_template)
    ids = _context_ids(tokenizer, document, chat).to(args.device)
    ctx, seconds = _compress(model, ids, method)
    line = f"prefill {ids.shape[1]} tokens in {seconds:.2f} s ({_rate(ids.shape[1], seconds)})"
    return model, tokenizer, ctx, chat, line


def _answer(ctx, tokenizer, question: str, chat: bool, gen: dict) -> tuple[torch.Tensor, _Streamer, float]:
    q_ids = _question_ids(tokenizer, question, chat).to(ctx.input_ids.device)
    streamer = _Streamer(tokenizer)
    start = time.perf_counter()
    out = ctx.generate(q_ids, streamer=streamer, **gen)
    return out, streamer, start


# -- commands -----------------------------------------------------------------------------------------


def _configure_generate(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the whole prompt, compressed with the question (question-aware)")
    src.add_argument(
        "--context-file", help="a document to compress; --question is asked after it (context-only)"
    )
    src.add_argument(
        "--load", metavar="FILE", help="a context saved with 'kvcake save'; --question is asked after it"
    )
    p.add_argument("--question", help="the question asked after --context-file or --load")
    _method_args(p)
    _layout_args(p)
    _generation_args(p)


def _run_generate(args: argparse.Namespace) -> int:
    _check_generation(args)
    if args.prompt is not None and args.question is not None:
        raise ValueError("--question goes with --context-file or --load; put it inside --prompt instead")
    if args.prompt is None and args.question is None:
        raise ValueError("--context-file and --load need --question")
    if args.prompt is None:
        model, tokenizer, ctx, chat, prefill = _context_from_args(args)
        gen = _gen_kwargs(args, tokenizer)
        out, streamer, start = _answer(ctx, tokenizer, args.question, chat, gen)
        first = (streamer.first or time.perf_counter()) - start
        _report(f"{cache_summary(ctx.cache, 'context')} | {prefill} | question + first token {first:.2f} s | "
                f"{out.shape[1]} new tokens, decode {_fmt_rate(streamer)}")  # fmt: skip
        return 0
    from .api import generate

    method = _method(args)
    model, tokenizer = _load(args)
    gen = _gen_kwargs(args, tokenizer)
    ids = _prompt_ids(tokenizer, args.prompt, _use_chat(tokenizer, args.chat_template)).to(args.device)
    streamer = _Streamer(tokenizer)
    start = time.perf_counter()
    out, cache = generate(model, ids, method, attention_mask=torch.ones_like(ids), streamer=streamer,
                          progress=_PROGRESS_MIN_TOKENS <= ids.shape[1] and sys.stderr.isatty(), **gen)  # fmt: skip
    first = (streamer.first or time.perf_counter()) - start
    _report(f"{cache_summary(cache, 'cache')} | prefill {ids.shape[1]} tokens + first token {first:.2f} s "
            f"({_rate(ids.shape[1], first)}) | {out.shape[1] - ids.shape[1]} new tokens, decode "
            f"{_fmt_rate(streamer)}")  # fmt: skip
    return 0


def _fmt_rate(streamer: _Streamer) -> str:
    rate = streamer.decode_rate()
    return "-" if rate is None else f"{rate:.1f} tok/s"


def _configure_chat(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--context-file", help="the document to compress once")
    src.add_argument("--load", metavar="FILE", help="a context saved with 'kvcake save'")
    _method_args(p)
    _layout_args(p)
    _generation_args(p)


def _run_chat(args: argparse.Namespace) -> int:
    _check_generation(args)
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
        if not line.strip():
            break
        out, streamer, start = _answer(ctx, tokenizer, line.strip(), chat, gen)  # a fork of ctx each time
        asked += 1
        logger.info("answer %d: %d tokens in %.2f s, decode %s", asked, out.shape[1],
                    time.perf_counter() - start, _fmt_rate(streamer))  # fmt: skip
    logger.info("answered %d question(s)", asked)
    return 0


def _configure_inspect(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt to compress")
    src.add_argument("--context-file", help="a document to compress (laid out as a context)")
    p.add_argument("--out", required=True, help="folder for the PNG files")
    p.add_argument("--ada-method", default="cake-adakv", help="head-adaptive method for the per-head figure")
    _method_args(p)
    _layout_args(p)


def _run_inspect(args: argparse.Namespace) -> int:
    from .inspect import inspect_prompt
    from .method import make_method

    method = _method(args)
    ada = make_method(args.ada_method, budget=method.budget.budget, ratio=method.budget.ratio,
                      window=method.budget.window)  # fmt: skip
    document = _read_text(args.context_file) if args.context_file else None
    model, tokenizer = _load(args)
    chat = _use_chat(tokenizer, args.chat_template)
    if document is not None:
        ids = _context_ids(tokenizer, document, chat)
    else:
        ids = _prompt_ids(tokenizer, args.prompt, chat)
    for path in inspect_prompt(model, tokenizer, ids, method, ada_method=ada, out_dir=args.out):
        print(path)
    return 0


def _configure_methods(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", action="store_true", help="also list the parts a spec can combine")


def _part_defaults(method) -> str:
    import dataclasses

    out = []
    for key, part in (("layers", method.layers), ("heads", method.heads), ("score", method.scorer),
                      ("select", method.selector)):  # fmt: skip
        fields = [f for f in dataclasses.fields(part) if f.init] if dataclasses.is_dataclass(part) else []
        if fields:
            values = ", ".join(f"{f.name}={'auto' if getattr(part, f.name) is None else getattr(part, f.name)}"
                               for f in fields)  # fmt: skip
            out.append(f"{key}({values})")
    return " ".join(out)


def _run_methods(args: argparse.Namespace) -> int:
    from .method import HEAD_ALLOCATORS, LAYER_ALLOCATORS, SCORERS, SELECTORS, list_methods, make_method
    from .temperatures import describe_resolution

    rows = list_methods()
    width = max(len(name) for name, _ in rows)
    for name, desc in rows:
        defaults = _part_defaults(make_method(name, budget=DEFAULT_BUDGET))
        print(f"{name:<{width}}  {desc}" + (f"  defaults: {defaults}" if defaults else ""))
    print(f"\n{describe_resolution()}")
    if args.parts:
        for key, registry in (("layers", LAYER_ALLOCATORS), ("heads", HEAD_ALLOCATORS), ("score", SCORERS),
                              ("select", SELECTORS)):  # fmt: skip
            print(f"{key}=: {', '.join(registry)}")
        print("decode=: none, fixed")
    return 0


def _configure_save(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context-file", required=True, help="the document to compress")
    p.add_argument("--out", required=True, help="the file to write (e.g. doc.kvc), replaced atomically")
    _method_args(p)
    _layout_args(p)


def _run_save(args: argparse.Namespace) -> int:
    from .storage import save_context

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


COMMANDS.update({
    "generate": Command(
        "answer a prompt, or a question about a document, with a compressed cache",
        _configure_generate, _run_generate,
        ('kvcake generate --prompt "Name three colours." --method cake --budget 128',
         "kvcake generate --context-file doc.txt --question 'Who wrote it?' --method cake-adakv --ratio 0.2",
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
        _common(p)
        cmd.configure(p)
        p.set_defaults(run=cmd.run)
    for name, module in extensions.items():
        p = module.configure_parser(sub) or sub.choices.get(name)
        if p is not None:
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
