"""The option groups the commands share (model, compression, layout, generation, verbosity), and
the method and model they name."""

from __future__ import annotations

import argparse
import logging
import time

from ..defaults import DEFAULT_KEEP_RATIO, DEFAULT_MODEL, KV_FORMATS, SCENARIOS

logger = logging.getLogger("kvcake.cli")

DEFAULT_BUDGET = 128  # the papers' "128L": what 'kvcake methods' shows defaults at


def _common(parser: argparse.ArgumentParser, load: bool = False) -> None:
    """--model and friends, accepted by every command that runs a model (``load``: the command
    has ``--load``, whose saved model is the default)."""
    g = parser.add_argument_group("model")
    saved = "; with --load, the model the context was saved with" if load else ""
    g.add_argument("--model", default=None,
                   help=f"built-in name, model folder, .gguf file or Hub id (default: {DEFAULT_MODEL}{saved})")  # fmt: skip
    g.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    saved_dtype = "; with --load, the dtype the context was saved with" if load else ""
    g.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help=f"parameter dtype (default: float32{saved_dtype})")  # fmt: skip
    g.add_argument("--offline", action="store_true", help="never contact the Hugging Face Hub for a Hub id")


def _method_args(
    parser: argparse.ArgumentParser, default_method: str = "cake", scenario_for_cake: bool = True
) -> None:
    """The compression options; ``scenario_for_cake``: ``--scenario`` changes only CAKE's
    temperatures, so it is refused with a method without CAKE's layer allocation (``inspect``
    passes False: its figure of layer preferences runs CAKE whatever the method)."""
    g = parser.add_argument_group("compression")
    g.add_argument("--method", default=None,
                   help=f"preset ('kvcake methods') or composed spec such as "
                        f"'layers=cake,heads=adakv,score=cake,select=critical' (default: {default_method})")  # fmt: skip
    size = g.add_mutually_exclusive_group()
    size.add_argument("--budget", type=int, default=None,
                      help="average KV entries kept per layer and KV head (default: --keep-ratio "
                           f"{DEFAULT_KEEP_RATIO['context']} of a document, {DEFAULT_KEEP_RATIO['question']} of "
                           "a --prompt; the whole prompt when that is under the window)")  # fmt: skip
    size.add_argument("--keep-ratio", "--ratio", dest="ratio", type=float, default=None,
                      help="fraction of the prompt KEPT, in (0, 1] (kvpress's compression_ratio=0.2 is "
                           "--keep-ratio 0.8); --ratio is its older name")  # fmt: skip
    g.add_argument("--window", type=int, default=None, help="observation window, always kept (default: 32)")
    g.add_argument("--scenario", choices=SCENARIOS, default=None,
                   help="which set of calibrated CAKE temperatures to use (default: question where the "
                        "prompt ends with its question, as generate --prompt; context for a document asked "
                        "after it)")  # fmt: skip
    parser.set_defaults(default_method=default_method, scenario_for_cake=scenario_for_cake)


def _storage_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-dtype", choices=KV_FORMATS, default=None,
                        help="store the kept entries in float8 from the end of the prompt, one byte per element "
                             "(kvcake.fp8; default: the model's dtype)")  # fmt: skip
    parser.add_argument("--kv-recent", type=int, default=None, metavar="N",
                        help="with --kv-dtype fp8: the last N tokens' entries also in the model's dtype, "
                             "read instead of their float8 bits (default 32; 0: none)")  # fmt: skip


def _layout_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                        help="wrap the text in the tokenizer's chat template (default: when it has one)")  # fmt: skip


def _generation_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=64, help="answer length limit (default: 64)")
    g.add_argument("--sample", action="store_true",
                   help="sample the answer instead of greedy decoding (with --temperature, --top-p, --seed)")  # fmt: skip
    g.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature (default: the model's generation config)",
    )
    g.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="nucleus sampling threshold (default: the model's generation config)",
    )
    g.add_argument("--seed", type=int, default=None, help="random seed for --sample (default: not seeded)")
    g.add_argument("--num-beams", type=int, default=1,
                   help="beam search over this many beams (default: 1, no beams); the answer is printed "
                        "once found, not streamed")  # fmt: skip
    g.add_argument("--dynamic", action="store_true",
                   help="decode in the dynamic reference layout, which reallocates as it goes "
                        "(KVCakeCache(static=False)), not in storage preallocated for the answer (default)")  # fmt: skip


def _verbose(parser: argparse.ArgumentParser, top: bool = False) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=0 if top else argparse.SUPPRESS,
                        help="more logging (-v: steps and timings, -vv: debug and tracebacks)")  # fmt: skip


def _method(args: argparse.Namespace, prompt_tokens: int | None = None, scenario: str = "context"):
    """The method the options name. Called once before the model is loaded (bad input fails
    fast) and again with the prompt's length, for the scenario's default keep ratio."""
    if prompt_tokens is None:
        _check_flags(args)
    method = _sized(args, prompt_tokens, scenario)
    if prompt_tokens is None and args.scenario is not None and getattr(args, "scenario_for_cake", False):
        check_scenario_takes(method, args.method or args.default_method)
    return method


def check_scenario_takes(method, spec: str) -> None:
    """Refuse ``--scenario`` with ``method`` (named ``spec`` on the command line) where it would
    change nothing: it picks CAKE's calibrated temperatures, which only CAKE's layer allocation uses."""
    from ..allocators.cake import CakeAllocator

    if not isinstance(method.layers, CakeAllocator):
        raise ValueError(
            f"--scenario picks CAKE's calibrated temperatures, and --method {spec!r} has no CAKE layer "
            "allocation (layers=cake): drop --scenario"
        )


#: The command line's flags for the library's keywords, so that its checks name what the user typed.
FLAGS = {"budget": "--budget", "keep_ratio": "--keep-ratio", "window": "--window",
         "kv_recent": "--kv-recent", "kv_dtype": "--kv-dtype"}  # fmt: skip


def _check_flags(args: argparse.Namespace) -> None:
    """The size and storage options' values, refused by the library's checks in the flags' words."""
    from ..budget import DEFAULT_WINDOW, check_sizes
    from ..fp8 import check_kv_recent

    window = DEFAULT_WINDOW if args.window is None else args.window
    check_sizes(args.budget, args.ratio, window, names=FLAGS)
    check_kv_recent(getattr(args, "kv_recent", None), getattr(args, "kv_dtype", None), names=FLAGS)


def _sized(args: argparse.Namespace, prompt_tokens: int | None, scenario: str):
    from ..api import sized_method
    from ..method import FULL, make_method

    spec = args.method or args.default_method
    window = 32 if args.window is None else args.window
    budget, ratio = args.budget, args.ratio
    if isinstance(spec, str) and spec.strip().lower() == FULL:
        given = [
            f
            for f, v in (("--budget", budget), ("--keep-ratio", ratio), ("--window", args.window))
            if v is not None
        ]
        if given:
            raise ValueError(f"--method full keeps every entry: drop {'/'.join(given)}")
    elif budget is None and ratio is None:
        if prompt_tokens is not None:  # the scenario's default keep ratio, or all of a short prompt
            return sized_method(spec, None, None, window, scenario, prompt_tokens)
        budget = max(window, DEFAULT_BUDGET)
    return make_method(spec, budget=budget, ratio=ratio, window=window)


def _load(args: argparse.Namespace, saved_model: str | None = None, saved_dtype: str | None = None):
    import torch

    from ..models import load_model

    name = args.model or saved_model or DEFAULT_MODEL
    dtype = args.dtype or saved_dtype or "float32"  # (--load: the dtype its keys and values were saved in)
    start = time.perf_counter()
    model, tokenizer = load_model(name, dtype=getattr(torch, dtype), device=args.device,
                                  local_files_only=args.offline)  # fmt: skip
    logger.info("loaded model %s in %.1f s", name, time.perf_counter() - start)
    return model, tokenizer
