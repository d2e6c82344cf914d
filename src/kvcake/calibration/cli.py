"""``kvcake calibrate``: fit CAKE's temperatures to a model and store them (``kvcake.calibrate``).

Plugged into ``kvcake`` through ``kvcake.cli.EXTENSIONS`` (``configure_parser`` + ``run``). The
result goes beside the converted models (``kvcake.temperatures.local_dir()``, or ``--out``),
named by the model's fingerprint, and every CAKE preset picks it up from then on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..standalone import model_placement, user_description

EXAMPLES = (
    "kvcake calibrate                      # CAKE temperatures for the default model (a few minutes)",
    "kvcake calibrate --model ./my-model --text notes.txt --ratios 0.1,0.25,0.5",
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
    p.add_argument("--text", default="paul_graham",
                   help="calibration text: paul_graham (default), noise, or a text file/folder")  # fmt: skip
    p.add_argument(
        "--ratios", type=_floats, default=None, help="kept ratios to calibrate at (default 0.1,0.25)"
    )
    p.add_argument("--budgets", type=_ints, default=(), help="average entries per layer to calibrate at")
    p.add_argument("--samples", type=int, default=4, help="samples per kind (context-only, needle question)")
    p.add_argument("--length", type=int, default=2048, help="prompt length in tokens")
    p.add_argument("--grid", type=int, default=5, help="grid points per temperature axis")
    p.add_argument(
        "--out", default=None, help="folder to write the calibration to (default: beside the models)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    import kvcake
    from kvcake.calibration.api import calibrate
    from kvcake.temperatures import calibration_path, local_dir

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer = kvcake.load_model(args.model or kvcake.DEFAULT_MODEL, device=args.device,
                                         dtype=getattr(torch, args.dtype))  # fmt: skip
    cal = calibrate(model, tokenizer, ratios=args.ratios, budgets=args.budgets, text=args.text,
                    samples=args.samples, length=args.length, grid=args.grid,
                    save=args.out if args.out else True)  # fmt: skip
    out = sys.stdout
    out.write(f"model {cal.model} (fingerprint {cal.fingerprint}), {cal.meta['seconds']} s\n")
    out.write(
        "loss: KL and attention-output perturbation relative to uniform layer budgets (1.0), both "
        "scenarios; kept: the flattest allocation within one standard error (se) of the grid's best\n"
    )
    out.write("setting      entries/layer  tau1   tau2   loss    se      grid best      family  fallback\n")
    for p in cal.meta["points"]:
        best = f"{p['grid_best'][0]:g}/{p['grid_best'][1]:g} {p['grid_best_loss']:.4f}"
        out.write(
            f"{p['setting']:<12} {p['budget']:>13.0f}  {p['tau1']:<6g} {p['tau2']:<6g} {p['loss']:.4f}  "
            f"{p['standard_error']:.4f}  {best:<14} {p['family_loss']:.4f}  {p['fallback_loss']:.4f}\n"
        )
    out.write(f"saved to {calibration_path(cal.fingerprint, Path(args.out) if args.out else local_dir())}\n")
    return 0
