"""What the commands share once the options are parsed: reading inputs, laying out prompts,
compressing, streaming the answer and the one-line summaries on stderr."""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .options import _load, _method

if TYPE_CHECKING:  # imported where used: parsing the options and --help load no torch
    import torch

logger = logging.getLogger("kvcake.cli")


def _read_text(path: str) -> str:
    """The document at ``path``, or on standard input for ``-`` (``cat doc.txt | kvcake generate
    --context-file - ...``)."""
    if path == "-":
        text, p = sys.stdin.read(), "standard input"
    else:
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
    from ..prompts import build_prompt

    return build_prompt(tokenizer, document.strip() + "\n\n", "", chat=chat).context


def _question_ids(tokenizer, question: str, chat: bool) -> torch.Tensor:
    from ..prompts import build_prompt

    if not question.strip():
        raise ValueError("the question is empty")
    return build_prompt(tokenizer, "", question, chat=chat).question


def _prompt_ids(tokenizer, prompt: str, chat: bool) -> torch.Tensor:
    from ..prompts import build_prompt

    if not prompt.strip():
        raise ValueError("the prompt is empty")
    return build_prompt(tokenizer, prompt, "", chat=chat).full


def _check_generation(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    given = [
        f"--{n.replace('_', '-')}" for n in ("temperature", "top_p", "seed") if getattr(args, n) is not None
    ]
    if given and not args.sample:
        verb = "applies" if len(given) == 1 else "apply"
        raise ValueError(f"{', '.join(given)} only {verb} with --sample (greedy decoding has no randomness)")
    if args.temperature is not None and not (args.temperature > 0 and math.isfinite(args.temperature)):
        raise ValueError(f"--temperature must be positive, got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.num_beams < 1:
        raise ValueError(f"--num-beams must be at least 1, got {args.num_beams}")


def _gen_kwargs(args: argparse.Namespace, tokenizer) -> dict:
    """``generate`` keywords: greedy, or sampling with the temperature/top-p given (else the model's
    generation config's); the seed is set here."""
    gen = {"max_new_tokens": args.max_new_tokens, "do_sample": bool(args.sample),
           "num_beams": args.num_beams, "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    if args.sample:
        gen.update(
            {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p)) if v is not None}
        )
        if args.seed is not None:
            import torch

            torch.manual_seed(args.seed)
    return gen


class _Streamer:
    """Prints new tokens as whole words (transformers' ``TextStreamer``) and times them. With beams
    (``gen['num_beams'] > 1``: transformers streams no beam search) it prints the answer once
    ``finish`` is given it, and times nothing per token."""

    def __init__(self, tokenizer, gen: dict | None = None) -> None:
        from transformers import TextStreamer

        self.first: float | None = None
        self.last: float | None = None
        self.count = 0
        self.streams = (gen or {}).get("num_beams", 1) == 1
        self.tokenizer = tokenizer
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        streamer.on_finalized_text = self._write
        self._inner = streamer

    def kwargs(self) -> dict:
        """What ``generate`` takes to stream: this streamer, or nothing with beams."""
        return {"streamer": self} if self.streams else {}

    def finish(self, answer_ids: torch.Tensor) -> None:
        """With beams, print the first sequence's answer (B, n) ids; streamed, it is printed already."""
        if not self.streams:
            self._write(self.tokenizer.decode(answer_ids[0], skip_special_tokens=True), stream_end=True)

    def label(self, elapsed: float) -> str:
        """The time to the first token, or with beams to the whole answer (nothing streamed earlier)."""
        return f"first token {elapsed:.2f} s" if self.streams else f"answer (beam search) {elapsed:.2f} s"

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
    """One line: bytes kept against transformers' full cache holding the same tokens (sliding
    layers of a hybrid at their window in both), with and without the bookkeeping kvcake holds
    beside them (``KVBytes.index``), split into sliding and compressed layers."""
    p = cache.kv_bytes_parts()
    line = (f"{label}: {cache.method.name} kept {p.entries:,} of {p.full_entries:,} KV entries "
            f"({100 * p.entries / p.full_entries:.1f}%), {_fmt_bytes(p.total)} vs {_fmt_bytes(p.full)} full "
            f"({100 * p.fraction:.1f}%; {100 * p.held_fraction:.1f}% with kvcake's {_fmt_bytes(p.index)} of "
            "positions and indices)")  # fmt: skip
    if cache.kv_dtype:
        from ..fp8 import ring_length

        ring = ring_length(cache)
        line += f" (kept entries in {cache.kv_dtype}" + (
            f", the last {ring} tokens' also exact)" if ring else ")"
        )
    if p.sliding:
        line += (f"; sliding layers {_fmt_bytes(p.sliding)} (at most their window), "
                 f"{len(cache.compressed)} global layers {_fmt_bytes(p.compressed)}")  # fmt: skip
    return line + _tau_line(cache)


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f} tok/s" if seconds > 0 else "- tok/s"


def _report(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


# Prompts at least this long show a per-layer prefill bar on an interactive terminal.
_PROGRESS_MIN_TOKENS = 1024


def _compress(
    model, ids: torch.Tensor, method, scenario=None, static: bool = True, kv_dtype=None, kv_recent=None
):
    from ..api import compress

    start = time.perf_counter()
    ctx = compress(model, ids, method, progress=_PROGRESS_MIN_TOKENS <= ids.shape[1] and sys.stderr.isatty(),
                   scenario=scenario, static=static, kv_dtype=kv_dtype, kv_recent=kv_recent)  # fmt: skip
    seconds = time.perf_counter() - start
    logger.info("compressed %d tokens in %.2f s (%s) with %s", ids.shape[1], seconds,
                _rate(ids.shape[1], seconds), method.describe())  # fmt: skip
    return ctx, seconds


def _context_from_args(args: argparse.Namespace):
    """(model, tokenizer, compressed context, chat layout, prefill line) from --context-file or --load."""
    static = not getattr(args, "dynamic", False)  # --dynamic: the answers decode in the reference layout
    if args.load:
        from ..storage import load_context, read_context_info

        if (args.method or args.budget is not None or args.ratio is not None or args.window is not None
                or getattr(args, "scenario", None) is not None or getattr(args, "kv_dtype", None)
                or getattr(args, "kv_recent", None) is not None):  # fmt: skip
            raise ValueError(
                "--load uses the method saved with the context, and its storage: drop "
                "--method/--budget/--keep-ratio/--window/--scenario/--kv-dtype/--kv-recent"
            )
        info = read_context_info(args.load)
        extra = info.get("extra") or {}
        model, tokenizer = _load(args, extra.get("model"), info.get("kv_dtype"))
        start = time.perf_counter()
        ctx = load_context(model, args.load, static=static)
        _check_room(args, model, ctx.input_ids.shape[1])  # before the first question, not at it
        chat = extra.get("chat")
        if chat is None:
            chat = _use_chat(tokenizer, args.chat_template)
        elif args.chat_template is not None and args.chat_template != chat:
            logger.warning("%s was made %s the chat template: its questions are too", args.load,
                           "with" if chat else "without")  # fmt: skip
        line = f"loaded {ctx.input_ids.shape[1]} context tokens from {args.load} in {time.perf_counter() - start:.2f} s"
        return model, tokenizer, ctx, chat, line
    _method(args)  # bad input fails before the model loads
    document = _read_text(args.context_file)
    model, tokenizer = _load(args)
    chat = _use_chat(tokenizer, args.chat_template)
    ids = _context_ids(tokenizer, document, chat).to(args.device)
    method = _method(args, ids.shape[1], "context")
    _check_room(args, model, ids.shape[1])  # before compressing
    scenario = _scenario(args, "context", "--context-file: a document compressed before its questions")
    ctx, seconds = _compress(model, ids, method, scenario, static, getattr(args, "kv_dtype", None),
                             getattr(args, "kv_recent", None))  # fmt: skip
    line = f"prefill {ids.shape[1]} tokens in {seconds:.2f} s ({_rate(ids.shape[1], seconds)})"
    return model, tokenizer, ctx, chat, line


def _check_room(args: argparse.Namespace, model, context_tokens: int) -> None:
    """Refuse ``--max-new-tokens`` past the model's positions after a context of ``context_tokens``
    (the questions add to it; ``kvcake.context.check_positions``)."""
    if getattr(args, "max_new_tokens", None):
        from ..context import check_positions

        check_positions(model, context_tokens, {"max_new_tokens": args.max_new_tokens})


def _scenario(args: argparse.Namespace, default: str, why: str):
    """The :class:`~kvcake.temperatures.Scenario` of a command: ``--scenario`` if given, else
    ``default`` for the reason ``why``."""
    from ..temperatures import Scenario

    given = getattr(args, "scenario", None)
    return Scenario.pick(given, default, f"kvcake {args.command} {why}" if hasattr(args, "command") else why)


def _tau_line(cache) -> str:
    """`` | CAKE tau1=... (source; scenario: why)`` when the cache resolved CAKE temperatures."""
    return f" | CAKE {cache.tau.describe()}" if getattr(cache, "tau", None) is not None else ""


def _answer(
    ctx, tokenizer, question: str, chat: bool, gen: dict, compile: bool | None = None
) -> tuple[torch.Tensor, _Streamer, float]:
    q_ids = _question_ids(tokenizer, question, chat).to(ctx.input_ids.device)
    streamer = _Streamer(tokenizer, gen)
    start = time.perf_counter()
    out = ctx.generate(q_ids, **streamer.kwargs(), compile=compile, **gen)
    streamer.finish(out)
    return out, streamer, start


def _fmt_rate(streamer: _Streamer) -> str:
    rate = streamer.decode_rate()
    return "-" if rate is None else f"{rate:.1f} tok/s"
