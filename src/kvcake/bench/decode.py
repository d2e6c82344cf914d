"""Decode time per token against its memory bound, eager and compiled.

For every context length one forward pass prefills the full cache and every (method, budget,
decoding policy) cache together (``caches.shared_prefill``); a transformers ``StaticCache``
receives a copy of the full cache (the full cache's compileable layout). Each is then decoded
alone, greedy, one token per step, in interleaved rounds after a warm-up, and, with ``compile``,
compiled one cache at a time (with inductor, on a CPU with ``row_products.compile_kwargs``'s fused
products, as ``kvcake.generate(compile=True)``). Decoding reads every weight and every
cached entry once per token, so ``time/token >= (weight bytes + cache bytes) / bandwidth``, with
the read bandwidth measured in the same run (``bandwidth.measure``, before the first round and
again after every round and after the compiled steps; the fastest probe sets every bound,
``bandwidth.fastest``). Compressing
the cache can therefore speed a step up by at most ``(W + C_full) / (W + C_method)``: the
"allowed" speed-up the achieved one is compared with.
The ``floor`` row is the model's own step with only :data:`FLOOR_TOKENS` tokens cached, decoded in
the same rounds (and compiled whenever ``compile`` is on): what a step costs on the device with next
to no cache to read. ``matmul_s`` times the weights' matrix products alone, eagerly
(:func:`matmul_probe`): how fast this device's matmul kernels read the weights, the part of the
floor no cache touches (a compiled step on a CPU reads them through fused products instead).
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import torch

from ..adapters import with_cache
from ..fp8 import SUFFIX, storage_spec
from .bandwidth import fastest, probes_words
from .bandwidth import measure as measure_bandwidth
from .caches import static_copy
from .common import (
    BenchCache,
    BenchModels,
    Clock,
    FullCache,
    MiB,
    build_cache,
    fmt,
    log_axes,
    markdown_table,
    median,
    new_figure,
    prompt_ids,
    save_figure,
    shared_prefill,
    verdict,
    weight_bytes,
)
from .decoder import Decoder, step_compile, time_compiled
from .floor import (
    FLOOR,
    FLOOR_TOKENS,
    best_s,
    fastest_matmul_ratio,
    floor_cache,
    floor_row,
    floor_words,
    matmul_probe,
    matmul_words,
    mode,
)
from .output import emit

logger = logging.getLogger(__name__)

DECODE_METHODS = ("snapkv", "pyramidkv", "cake", "adakv")  # cake-oneshot decodes exactly like cake
SPEEDUP_TARGET = 0.70  # achieved speed-up >= 70% of the allowed one, at the longest context
EVICT_TARGET = 0.10  # decoding-time eviction < 10% of a decode step
# issue 22, at the longest context: a preset's step (eager, or compiled where faster) <= 0.5 x the
# full cache at its best (DynamicCache or StaticCache, eager or compiled), <= 1.3 x its read bound
BEST_FULL_TARGET = 0.5
BOUND_TARGET = 1.3
FULL_STATIC = "full-static"  # the full cache in a transformers StaticCache (compileable)
REFERENCE_ROWS = ("full", FULL_STATIC, FLOOR)  # the rows that are not methods
POLICIES = ("fixed", "none", "preset")  # decoding policies: fixed, none, or each method's own


def _decode_configs(methods, budgets, policies, length: int) -> list[tuple[str, int, str]]:
    return [(m, b, p) for m in methods for b in budgets for p in policies if b < length]


def _spec(method: str, policy: str) -> str:
    """A decode config's method spec: ``preset`` keeps the method's own decoding policy (a ``+fp8``
    name keeps its suffix last: ``caches.storage_spec``)."""
    spec, kv_dtype = storage_spec(method)
    spec = spec if policy == "preset" else f"{spec},decode={policy}"
    return spec + (SUFFIX if kv_dtype else "")


def run_decode(
    models: BenchModels,
    *,
    lengths=(1024, 2048, 4096, 8192, 16384),
    methods=DECODE_METHODS,
    budgets=(128, 512),
    policies=("fixed", "none"),
    steps: int = 12,
    rounds: int = 3,
    warmup: int = 2,
    window: int = 32,
    bandwidth_bytes: int = 2**30,
    ragged_length: int = 4096,
    compile: bool | str = False,
    compile_only: tuple[str, ...] | None = None,
    counts: bool = False,
    out: str | Path | None = None,
    machine: dict | None = None,
    echo: bool = True,
) -> dict:
    """Decode time per token for the full cache (``DynamicCache``, and a ``StaticCache`` holding
    the same prompt) and every (method, budget, policy) at every context length, with the memory
    bound and the allowed speed-up. ``policies``: ``fixed``, ``none``, or ``preset`` (the
    method's own).

    ``steps`` timed steps per cache, spread over ``rounds`` interleaved rounds; with ``compile``,
    then as many compiled steps per cache in as many rounds (:func:`kvcake.bench.decoder.time_compiled`; a str: the
    ``torch.compile`` backend, ``inductor`` for True); ``compile_only``: the methods (``full``,
    ``full-static`` and presets) whose compiled step is measured, None for all (inductor compiles
    take minutes per cache on a CPU); the ``floor`` row's always is, whenever ``compile`` is on.
    ``counts``: also the CPU proxies of a static step per preset (``step_counts.table``: ATen ops,
    host syncs, compiled graphs; a tiny model, deterministic), for the page. Writes ``out/decode.json`` and ``out/decode.png``; returns
    the result dict."""
    if steps < rounds or rounds < 1:
        raise ValueError(
            f"steps ({steps}) are spread over rounds ({rounds}): need rounds >= 1 and steps >= rounds"
        )
    if bad := [p for p in policies if p not in POLICIES]:
        raise ValueError(f"unknown decoding policies {bad}: use fixed, none or preset (the method's own)")
    methods = tuple(m for m in methods if m != "full")
    clock = Clock(models.device)
    backend = compile if isinstance(compile, str) else "inductor"  # of the compiled steps, when compiling
    probes = [measure_bandwidth(models.device, bandwidth_bytes)]  # and after every round: fastest() below
    rows = []
    for length in lengths:
        model, label = models.for_length(length)
        w_bytes = weight_bytes(model)
        matmul_s, matmul_bytes = matmul_probe(model, clock)
        compiled_matmul_s = (
            matmul_probe(model, clock, compiled=step_compile(model, backend))[0] if compile else None
        )
        ids, source = prompt_ids(models.tokenizer if model is models.model else None, length,
                                 model.config.vocab_size, models.device)  # fmt: skip
        configs = _decode_configs(methods, budgets, policies, length)
        room = length + 2 * (warmup + steps) + 1  # the prompt, then every eager and compiled step
        caches = [build_cache(model, _spec(m, p), b, window, max_cache_len=room) for m, b, p in configs]
        full = FullCache(model.config)
        logger.info(
            "decode: prefill %d tokens once into the full cache and %d compressed caches", length, len(caches)
        )
        if caches:
            shared_prefill(model, ids, caches, full)
        else:
            with torch.no_grad():
                model(ids, **with_cache(model, full), logits_to_keep=1)
        full.tracking = False
        configs = [
            (m, b, p if p != "preset" else c.method.decode)
            for (m, b, p), c in zip(configs, caches, strict=True)
        ]
        entries = [(("full", 0, "-"), full), ((FULL_STATIC, 0, "-"), static_copy(full, model.config, room)),
                   ((FLOOR, 0, "-"), floor_cache(model, ids, room - length)), *zip(configs, caches, strict=True)]  # fmt: skip
        tok = ids[:, -1:]
        with torch.no_grad():
            state = {key: Decoder(model, c, tok, FLOOR_TOKENS if key[0] == FLOOR else length, clock)
                     for key, c in entries}  # fmt: skip
            for dec in state.values():
                dec.warm(warmup)
            per_round = steps // rounds
            for r in range(rounds):
                logger.info(
                    "decode at %d tokens: round %d/%d over %d caches", length, r + 1, rounds, len(state)
                )
                for dec in state.values():
                    dec.timed(per_round)
                probes.append(measure_bandwidth(models.device, bandwidth_bytes))
            if compile:
                chosen = {}
                for (m, b, _), dec in state.items():
                    if compile_only is not None and m not in (*compile_only, FLOOR):
                        dec.compiled = "not measured (--compile-only)"
                    else:
                        chosen[f"{m} {b or ''}".strip()] = dec
                time_compiled(chosen, backend, warmup, steps, rounds)
                probes.append(measure_bandwidth(models.device, bandwidth_bytes))
        full_s = median(state[("full", 0, "-")].times)
        full_bytes = sum(state[("full", 0, "-")].bytes) / len(state[("full", 0, "-")].bytes)
        for (m, b, p), dec in state.items():
            s = median(dec.times)
            c_bytes = sum(dec.bytes) / len(dec.bytes)
            hook = dec.cache.decode_hook_s / len(dec.times) if isinstance(dec.cache, BenchCache) else 0.0
            allowed = (w_bytes + full_bytes) / (w_bytes + c_bytes)
            compiled_s = dec.compiled
            rows.append(dict(
                length=length, model=label, prompt=source, method=m, budget=b, policy=p, s=s, times=dec.times,
                compiled_s=compiled_s, kv_bytes=c_bytes, weight_bytes=w_bytes, speedup=full_s / s, allowed=allowed,
                fraction=(full_s / s) / allowed, hook_s=hook, hook_share=hook / s, matmul_s=matmul_s,
                matmul_bytes=matmul_bytes, compiled_matmul_s=compiled_matmul_s,
            ))  # fmt: skip
        del state, entries, caches, full
        gc.collect()
    band = fastest(probes)
    for r in rows:  # the read bound, from the run's fastest probe
        r["bound_s"] = (r["weight_bytes"] + r["kv_bytes"]) / (band["read_gbps"] * 1e9)
    result = dict(bench="decode", machine=machine, bandwidth=band, lengths=list(lengths), methods=list(methods),
                  budgets=list(budgets), policies=list(policies), steps=steps, rounds=rounds, warmup=warmup,
                  window=window, rows=rows, ragged_length=ragged_length, compile=compile)  # fmt: skip
    result["targets"] = decode_targets(rows)
    if counts:
        from . import step_counts

        logger.info("decode: per-step counts of every preset (tiny model)")
        result["counts"] = dict(intro=step_counts.INTRO, table=step_counts.table())
    return emit(result, "decode", decode_tables(result) if echo else "", plot_decode, out, echo)


def decode_targets(rows: list[dict]) -> list[dict]:
    if not rows:
        return []
    longest = max(r["length"] for r in rows)
    fulls = [r for r in rows if r["length"] == longest and r["method"] in ("full", FULL_STATIC)]
    full_best = min(fulls, key=best_s) if fulls else None
    floor = floor_row(rows, longest)
    below = "" if floor is None else f"; {floor_words(floor)}"  # the model's own step, against its bound
    # the weights' own matmuls faster than the run's read probe allows: the probe understated the
    # bandwidth (a shared host's), so no step is judged against bounds drawn from it (ok None)
    unjudged = floor is not None and floor.get("matmul_s") is not None and fastest_matmul_ratio(floor) < 1
    out = []
    for r in rows:
        if r["length"] != longest or r["method"] in REFERENCE_ROWS:
            continue
        if full_best is not None and any(f["method"] == FULL_STATIC for f in fulls):
            mine, best = best_s(r), best_s(full_best)
            out.append(dict(target=f"step <= {BEST_FULL_TARGET} x the full cache at its best", length=longest,
                            method=r["method"], budget=r["budget"], policy=r["policy"], value=mine / best,
                            detail=f"{mine * 1e3:.1f} ms ({mode(r)}) vs {best * 1e3:.1f} ms ({full_best['method']}, "
                                   f"{mode(full_best)})",
                            ok=mine <= BEST_FULL_TARGET * best))  # fmt: skip
            out.append(dict(target=f"step <= {BOUND_TARGET} x its read bound", length=longest, method=r["method"],
                            budget=r["budget"], policy=r["policy"], value=mine / r["bound_s"],
                            detail=f"{mine * 1e3:.1f} of {r['bound_s'] * 1e3:.1f} ms{below}",
                            ok=None if unjudged else mine <= BOUND_TARGET * r["bound_s"]))  # fmt: skip
        out.append(dict(target=f"speed-up >= {SPEEDUP_TARGET:.0%} of allowed", length=longest, method=r["method"],
                        budget=r["budget"], policy=r["policy"], value=r["fraction"],
                        detail=f"{r['speedup']:.2f}x of {r['allowed']:.2f}x", ok=r["fraction"] >= SPEEDUP_TARGET))  # fmt: skip
        if r["policy"] == "fixed":
            out.append(dict(target=f"eviction < {EVICT_TARGET:.0%} of a step", length=longest, method=r["method"],
                            budget=r["budget"], policy=r["policy"], value=r["hook_share"],
                            detail=f"{r['hook_s'] * 1e3:.1f} of {r['s'] * 1e3:.1f} ms", ok=r["hook_share"] < EVICT_TARGET))  # fmt: skip
    return out


def _compiled_cell(r: dict) -> str:
    c = r.get("compiled_s")
    return "-" if c is None else c if isinstance(c, str) else fmt(c * 1e3)


def _row_cells(r: dict) -> tuple:
    return (r["length"], r["method"], r["budget"] or "-", r["policy"], fmt(r["s"] * 1e3), _compiled_cell(r),
            fmt(r["bound_s"] * 1e3),
            fmt(r["bound_s"] / r["s"], 2), fmt(r["kv_bytes"] / MiB, 1), fmt(r["speedup"], 2), fmt(r["allowed"], 2),
            fmt(r["fraction"], 2), fmt(r["hook_s"] * 1e3, 1) if r["policy"] == "fixed" else "-",
            fmt(100 * r["hook_share"], 1) if r["policy"] == "fixed" else "-")  # fmt: skip


_DECODE_HEADERS = ("context", "method", "budget", "decode", "ms/token", "compiled ms/token", "bound ms", "bound/actual", "KV MiB",
                   "speed-up", "allowed", "achieved/allowed", "eviction ms", "eviction %")  # fmt: skip


def ragged_table(result: dict) -> str:
    at = result["ragged_length"]
    rows = [r for r in result["rows"] if r["length"] == at and r["method"] in ("full", "snapkv", "adakv")]
    if not rows:
        return ""
    rows.sort(key=lambda r: (r["budget"], r["policy"], r["method"]))
    cells = [(r["method"], "ragged" if r["method"] == "adakv" else "uniform" if r["budget"] else "full",
              r["budget"] or "-", r["policy"], fmt(r["s"] * 1e3), fmt(r["kv_bytes"] / MiB, 2), fmt(r["speedup"], 2))
             for r in rows]  # fmt: skip
    return (f"Ragged (Ada-KV) vs uniform (SnapKV) vs full cache, decode at {at} tokens ({rows[0]['model']}):\n\n"
            + markdown_table(("method", "layout", "budget", "decode", "ms/token", "KV MiB", "speed-up vs full"), cells))  # fmt: skip


def row_bandwidths(rows: list[dict]) -> dict[float, list[int]]:
    """GB/s (1 decimal) -> the lengths whose rows' bounds used it: merged runs (``--add``) keep each
    row's bound, from its own run's measured bandwidth."""
    out: dict[float, list[int]] = {}
    for r in rows:
        gbps = round((r["weight_bytes"] + r["kv_bytes"]) / r["bound_s"] / 1e9, 1)
        if r["length"] not in out.setdefault(gbps, []):
            out[gbps].append(r["length"])
    return out


def _bandwidth_words(result: dict) -> str:
    b, used = result["bandwidth"], row_bandwidths(result["rows"])
    newest = f"{b['read_gbps']:.1f} GB/s read bandwidth measured in the newest run ({probes_words(b)})"
    if len(used) <= 1:
        return newest.replace("in the newest run", "in this run")
    older = "; ".join(f"{gbps} GB/s at {', '.join(map(str, lengths))} tokens" for gbps, lengths in used.items()
                      if gbps != round(b["read_gbps"], 1))  # fmt: skip
    return f"the read bandwidth measured in each row's run: {newest}; earlier runs' {older}"


def decode_tables(result: dict) -> str:
    head = (f"Decode time per token (median of {result['steps']} steps in {result['rounds']} rounds after "
            f"{result['warmup']} warm-up steps); bound = (weights + KV bytes) / {_bandwidth_words(result)}. "
            f"`{FLOOR}` is the model's own step with only the prompt's first "
            f"{FLOOR_TOKENS} tokens cached (a StaticCache, decoded in the same rounds, compiled whenever the run "
            f"compiles): no cache makes a step cheaper, so its bound/actual is what this device allows a step at all")  # fmt: skip
    floor = next((r for r in result["rows"] if r["method"] == FLOOR and r.get("matmul_s") is not None), None)
    if floor is not None:
        head += (f"; the weights' matmuls alone, one token (`matmul_probe`), take {matmul_words(floor)} x their "
                 f"read bound at {floor['length']} tokens")  # fmt: skip
    head += ":"
    parts = [head, "", markdown_table(_DECODE_HEADERS, [_row_cells(r) for r in result["rows"]])]
    rag = ragged_table(result)
    if rag:
        parts += ["", rag]
    checks = [(c["target"], c["length"], c["method"], c["budget"], c["policy"], fmt(c["value"], 3), c["detail"],
               verdict(c["ok"])) for c in result["targets"]]  # fmt: skip
    parts += ["", "Targets at the longest context:", "",
              markdown_table(("target", "context", "method", "budget", "decode", "value", "numbers", "verdict"), checks)]  # fmt: skip
    if "counts" in result:
        parts += ["", f"Per-step counts of a static decode step (`--counts`). {result['counts']['intro']}", "",
                  result["counts"]["table"]]  # fmt: skip
    return "\n".join(parts)


def plot_decode(result: dict, path: Path) -> Path:
    policies = result["policies"]
    fig, axes = new_figure(len(policies) + 1, width=5.2)
    rows = result["rows"]
    full = sorted((r for r in rows if r["method"] == "full"), key=lambda r: r["length"])  # DynamicCache
    styles = ["-", "--", ":", "-."]
    for ax, policy in zip(axes, policies, strict=False):
        ax.plot([r["length"] for r in full], [r["s"] * 1e3 for r in full], "ko-", label="full")
        ax.plot(
            [r["length"] for r in full],
            [r["bound_s"] * 1e3 for r in full],
            "k:",
            alpha=0.6,
            label="full: bound",
        )
        for i, m in enumerate(result["methods"]):
            for j, b in enumerate(result["budgets"]):
                rs = sorted((r for r in rows if r["method"] == m and r["budget"] == b and r["policy"] == policy),
                            key=lambda r: r["length"])  # fmt: skip
                if rs:
                    ax.plot([r["length"] for r in rs], [r["s"] * 1e3 for r in rs], marker="o", ms=3,
                            ls=styles[j % len(styles)], color=f"C{i}", label=f"{m} {b}")  # fmt: skip
        small = [r for r in rows if r["method"] not in REFERENCE_ROWS and r["policy"] == policy]
        if small:
            lo = min(small, key=lambda r: r["bound_s"])
            ax.axhline(lo["bound_s"] * 1e3, color="C7", ls=":", label="compressed: bound")
        ax.set(xlabel="context tokens", ylabel="ms per token", title=f"decode={policy}")
        log_axes(ax, sorted({r["length"] for r in rows}))
        ax.set_yscale("linear")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=6, ncol=2)
    ax = axes[-1]
    longest = max((r["length"] for r in rows), default=0)
    rs = [r for r in rows if r["length"] == longest and r["method"] not in REFERENCE_ROWS]
    xs = range(len(rs))
    ax.bar([x - 0.2 for x in xs], [r["allowed"] for r in rs], width=0.4, label="allowed by bytes", color="C7")
    ax.bar([x + 0.2 for x in xs], [r["speedup"] for r in rs], width=0.4, label="achieved", color="C0")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(
        list(xs), [f"{r['method']} {r['budget']}\n{r['policy']}" for r in rs], fontsize=6, rotation=60
    )
    ax.set(ylabel="speed-up over full cache", title=f"at {longest} tokens")
    ax.legend(fontsize=7)
    return save_figure(fig, path)
