"""Where a preset's prefill spends its time: torch.profiler over one prefill of a random model.

    PYTHONPATH=src python3 scripts/gpu_profile.py --length 32k --methods criticalkv,h2o,cake
    PYTHONPATH=src python3 scripts/gpu_profile.py --device cpu --shape tiny --length 2k --methods cake

For each cache (the full DynamicCache first), one warm-up prefill, then one profiled prefill; prints
the wall time and the operators with the most self device time (self CPU time on the CPU). Written
for the rare GPU session (issue 23: which kernels make criticalkv, h2o and the cascade slower than
the full cache at 32k and 128k tokens); runs on the CPU at a tiny shape as well.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from kvcake.adapters import with_cache
from kvcake.attention import enable
from kvcake.bench.shapes import random_model
from kvcake.cache import KVCakeCache
from kvcake.method import make_method
from kvcake.sdpa import POLICIES, sdpa_policy
from kvcake.standalone import comma_ints


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--length", default="32k")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--methods", default="criticalkv,h2o,cake")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=14)
    p.add_argument("--full-sdpa", default="auto", choices=POLICIES,
                   help="the full cache's SDPA policy (auto: kvcake's, flash first on CUDA; an H100 run "
                        "with SDPA's own pick, cuDNN, compared its 486 ms of attention with the presets' 865 ms)")  # fmt: skip
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    (n,) = comma_ints(a.length)
    model = random_model(a.shape, n + 16, device=device, dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0)).to(
        device
    )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for name in ["full", *a.methods.split(",")]:

        def prefill(name=name) -> None:
            if name == "full":  # under kvcake's SDPA policy, as the presets' prompts run (``--full-sdpa``)
                cache = DynamicCache(config=model.config)
                with sdpa_policy(a.full_sdpa, device):
                    model(ids, logits_to_keep=1, **with_cache(model, cache))
            else:
                cache = KVCakeCache(model, make_method(name, budget=a.budget), max_cache_len=n + 8)
                with enable(model):
                    model(ids, logits_to_keep=1, **with_cache(model, cache))

        with torch.no_grad():
            prefill()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with profile(activities=activities) as prof:
                prefill()
                if device.type == "cuda":
                    torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        print(f"\n=== {name} at {n} tokens: {wall:.3f} s (profiled)")
        print(prof.key_averages().table(sort_by=sort, row_limit=a.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
