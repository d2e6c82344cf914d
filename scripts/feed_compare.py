"""The fidelity measures of the results page fed two ways: the page's cells (the question and the
continuation in one forward, ``--fidelity-feed chunk``) beside cells of the same prompts fed as
``generate`` feeds the cache (``--fidelity-feed steps``: the question in one forward, then a token
a forward, a ``decode=fixed`` preset evicting back to its budget after each).

    python -m kvcake.eval --suite results --threads 1 --no-progress --methods cake,cake-adakv,snapkv \\
        --ratios 0.25 --samples 6 --fidelity-feed steps --out docs/figures/eval_results_steps.jsonl
    python scripts/feed_compare.py

prints, per method, scenario and ratio, the mean KL over the prompts both files hold, fed each
way, and how many prompts' KL rose; then issue 24's comparisons (``cake`` against ``snapkv``,
``cake-adakv`` against ``adakv``) with each feeding, on the prompts all four cells hold."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

PROMPT = ("task", "length", "seed", "sample", "haystack", "task_options", "model_fp", "window")


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def key(r: dict) -> tuple:
    """(method, ratio, scenario, the prompt, CAKE's temperatures' label): a cell of a results file."""
    return r["method"], r["ratio"], r["scenario"], tuple(json.dumps(r.get(k)) for k in PROMPT), r.get("tau")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk", type=Path, default=Path("docs/figures/eval_results.jsonl"))
    parser.add_argument("--steps", type=Path, default=Path("docs/figures/eval_results_steps.jsonl"))
    args = parser.parse_args()
    chunk = {key(r): r["kl"] for r in load(args.chunk) if r.get("feed", "chunk") == "chunk" and r.get("kl") is not None}
    steps = {key(r): r["kl"] for r in load(args.steps) if r.get("feed") == "steps" and r.get("kl") is not None}
    cells: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for k, kl in steps.items():
        if k in chunk and k[0] != "full":
            cells[k[:3]].append((chunk[k], kl))
    print("| method | scenario | ratio | prompts | mean KL, chunk | mean KL, steps | steps / chunk | prompts whose KL rose |")
    print("|---|---|---|---|---|---|---|---|")
    for (method, ratio, sc), pairs in sorted(cells.items(), key=lambda x: (x[0][0], x[0][2], x[0][1])):
        c = sum(p[0] for p in pairs) / len(pairs)
        s = sum(p[1] for p in pairs) / len(pairs)
        rose = sum(p[1] > p[0] * (1 + 1e-4) for p in pairs)  # beyond the rounding of another feeding
        print(f"| `{method}` | {sc} | {ratio} | {len(pairs)} | {c:.4g} | {s:.4g} | {s / c:.3f} | {rose} |")
    print()
    print("| comparison | scenario | ratio | prompts | chunk: value vs reference | steps: value vs reference |")
    print("|---|---|---|---|---|---|")
    for value, ref in (("cake", "snapkv"), ("cake-adakv", "adakv")):
        for sc in ("question", "context"):
            for ratio in sorted({k[1] for k in steps}):
                both = [k for k in steps if k[:3] == (value, ratio, sc)]
                pairs = []
                for k in both:
                    r = (ref, *k[1:4], None)  # the reference's cell of the same prompt (no temperatures)
                    if k in chunk and r in chunk and r in steps:
                        pairs.append((chunk[k], chunk[r], steps[k], steps[r]))
                if not pairs:
                    continue
                m = [sum(p[i] for p in pairs) / len(pairs) for i in range(4)]
                print(f"| `{value}` vs `{ref}` | {sc} | {ratio} | {len(pairs)} | {m[0]:.4g} vs {m[1]:.4g} | "
                      f"{m[2]:.4g} vs {m[3]:.4g} |")  # fmt: skip


if __name__ == "__main__":
    main()
