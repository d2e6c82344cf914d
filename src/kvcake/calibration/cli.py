"""``kvcake calibrate``: fit CAKE's temperatures to a model and store them (``kvcake.calibrate``).

One set per scenario: ``question`` (the compressed prompt ends with the question) and
``context`` (a document compressed alone), each chosen by the mean KL of the next-token
distributions to the full cache's, relative to uniform layer budgets.

Plugged into ``kvcake`` through ``kvcake.cli.EXTENSIONS`` (``configure_parser`` + ``run``). The
result goes beside the converted models (``kvcake.temperatures.local_dir()``), named by the
model's fingerprint, and every CAKE preset picks it up from then on; ``--out`` writes it to
another folder instead, which nothing reads until the file is copied into ``local_dir()``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..defaults import (
    CALIBRATION_GRID,
    CALIBRATION_LENGTH,
    CALIBRATION_RATIOS,
    CALIBRATION_SAMPLES,
    CALIBRATION_TEXT,
)
from ..standalone import model_placement, threads, user_description

EXAMPLES = (
    "kvcake calibrate                      # CAKE temperatures for the default model (~30 min on one core)",
    "kvcake calibrate --model ./my-model --text notes.txt --ratios 0.1,0.25,0.5",
    "kvcake calibrate --indicators avg5           # the paper's indicator pooling alone",
)


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def configure_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``calibrate`` subcommand to ``kvcake``'s ``argparse`` subparsers."""
    p = subparsers.add_parser("calibrate", help="fit CAKE's temperatures (tau1, tau2) to a model",
                              description=user_description(__doc__),
                              formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="model name or folder (default: kvcake's default model)")
    model_placement(p)
    p.add_argument("--text", default=CALIBRATION_TEXT,
                   help="calibration text: paul_graham, noise, or a text file/folder (default: %(default)s)")  # fmt: skip
    p.add_argument("--ratios", type=_floats, default=None,
                   help=f"kept ratios to calibrate at (default {','.join(f'{r:g}' for r in CALIBRATION_RATIOS)}, "
                        "none where --budgets is given)")  # fmt: skip
    p.add_argument("--budgets", type=_ints, default=(), help="average entries per layer to calibrate at")
    p.add_argument("--samples", type=int, default=CALIBRATION_SAMPLES,
                   help="samples per scenario (context-only: passages continued and passages asked about after compression, alternately; question-aware: questions cycling through six forms; kvcake.calibration.samples; default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--length",
        type=int,
        default=CALIBRATION_LENGTH,
        help="prompt length in tokens (default: %(default)s)",
    )
    p.add_argument("--grid", type=int, default=CALIBRATION_GRID,
                   help="grid points per temperature axis (default: %(default)s)")  # fmt: skip
    p.add_argument("--indicators", type=lambda t: tuple(x for x in t.split(",") if x.strip()), default=None,
                   help="CAKE indicators to search in both scenarios, e.g. avg5,max7; avg5 (the paper's) "
                        "alone turns the search off (default: max7 beside avg5 in both)")  # fmt: skip
    p.add_argument(
        "--out",
        default=None,
        help="folder to write the calibration to (default: beside the models, where CAKE reads it)",
    )
    p.add_argument("--threads", type=threads, default=None, help="torch.set_num_threads")
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    import kvcake
    from kvcake.calibration.api import calibrate, check_settings
    from kvcake.temperatures import calibration_path, local_dir

    flags = {"keep_ratio": "--ratios", "budget": "--budgets", "window": "the window"}
    check_settings(args.ratios, args.budgets, args.samples, args.length, grid=args.grid,
                   indicators=args.indicators, names=flags)  # before the model loads  # fmt: skip
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer = kvcake.load_model(args.model or kvcake.DEFAULT_MODEL, device=args.device,
                                         dtype=getattr(torch, args.dtype))  # fmt: skip
    cal = calibrate(model, tokenizer, ratios=args.ratios, budgets=args.budgets, text=args.text,
                    samples=args.samples, length=args.length, grid=args.grid, indicators=args.indicators,
                    save=args.out if args.out else True)  # fmt: skip
    out = sys.stdout
    out.write(f"model {cal.model} (fingerprint {cal.fingerprint}), {cal.meta['seconds']} s\n")
    out.write(
        "loss: mean KL to the full cache relative to uniform layer budgets (1.0), per scenario; kept: the "
        "flattest allocation within one standard error (se) of the grid's best; attn: attention-output "
        "perturbation relative to uniform (reported, not optimised)\n"
    )
    out.write("scenario setting      entries/layer  tau1   tau2   loss    se      KL nats  attn    indicator  "
              "grid best      family  fallback\n")  # fmt: skip
    for p in cal.meta["points"]:
        best = f"{p['grid_best'][0]:g}/{p['grid_best'][1]:g} {p['grid_best_loss']:.4f}"
        attn = "-" if p["perturbation"] is None else f"{p['perturbation']:.4f}"
        out.write(
            f"{p['scenario']:<8} {p['setting']:<12} {p['budget']:>13.0f}  {p['tau1']:<6g} {p['tau2']:<6g} "
            f"{p['loss']:.4f}  {p['standard_error']:.4f}  {p['kl']:<8.4g} {attn:<7} {p['indicator']:<10} "
            f"{best:<14} {p['family_loss']:.4f}  {p['fallback_loss']:.4f}\n"
        )
    out.write(f"saved to {calibration_path(cal.fingerprint, Path(args.out) if args.out else local_dir())}\n")
    return 0
