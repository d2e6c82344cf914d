"""How far CAKE's temperatures alone can take it on the results page's own prompts (issue 14).

For every prompt of a suite, both scenarios and every ratio, this measures the fidelity (KL and
attention-output perturbation, :mod:`kvcake.eval.fidelity`, exactly as the page's cells) of
``snapkv``, ``pyramidkv`` and ``cake`` (the temperatures in force: the shipped calibration), and of
CAKE at every (tau1, tau2) of a grid. The grid's temperatures are chosen *on the evaluation
prompts themselves*, which no calibration may do, so the best of them is an oracle: it bounds what
any fixed pair of temperatures, calibrated or not, can reach on these prompts. Where even the
oracle misses a target, the target is out of reach of calibration.

Cost: one full-cache forward per prompt (:func:`~kvcake.eval.reference.full_reference`); CAKE's
dispersion and shift per layer come from one replay, every grid point turns them into a budget
vector by arithmetic (:func:`~kvcake.calibration.search.layer_budgets`), and each distinct vector
is replayed once (:class:`~kvcake.calibration.search.FixedLayers`, the cascade's final cache).
About 25 minutes per prompt length of the results suite on one CPU core.

``kvcake eval --tau-sweep`` runs it on the prompts of the evaluation it is given (``--suite
results``: the results page's); records go to ``<results stem>_tau_sweep.jsonl`` beside the
results file, one batch per prompt (a prompt already there is skipped, so a run resumes), and
:func:`sweep_markdown` renders the results page's section from them.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

TAU1_GRID = (0.2, 0.356, 0.632, 1.12, 2.0, 3.56)
TAU2_GRID = (0.4, 0.663, 1.1, 1.82, 3.0, 4.96, 8.0)
"""The CAKE paper's ranges (tau1 0.2-2, tau2 0.4-3), log-spaced, with one or two steps beyond."""
REFERENCES = ("snapkv", "pyramidkv", "cake")
COMMAND = "python -m kvcake.eval --suite results --tau-sweep --threads 1"


def sweep_path(results: str | Path) -> Path:
    """Where the sweep of a results file's prompts is kept: ``<stem>_tau_sweep.jsonl`` beside it."""
    path = Path(results)
    return path.with_name(f"{path.stem}_tau_sweep.jsonl")


def _prompt_key(r: dict[str, Any]) -> tuple:
    """A swept prompt. The grid and the references do not depend on the shipped calibration, so a
    new calibration does not sweep a prompt again; only its ``cake`` rows go stale (see
    :func:`with_shipped`)."""
    return (r["model_fp"], r["task"], r["length"], r["seed"])


def with_shipped(
    model, records: list[dict[str, Any]], results: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``records`` (a sweep's) with the shipped ``cake`` taken from ``results`` (the results page's
    own ``kvcake.eval`` records) for the prompts where the sweep has no ``cake`` row of the temperatures in force: a
    sweep made before the latest calibration is compared with today's ``cake``, measured exactly as
    the sweep's own ``cake`` rows are (the first test of ``tests/eval/test_tau_sweep.py``)."""
    from kvcake.method import make_method
    from kvcake.temperatures import SCENARIOS, method_tau_label

    label = method_tau_label(model, make_method("cake", ratio=0.5))
    # the results' cells are keyed by their scenario's set
    cells = {sc: method_tau_label(model, make_method("cake", ratio=0.5), sc) for sc in SCENARIOS}
    swept = {(r["model_fp"], r["task"], r["length"], r["seed"]) for r in records}
    swept -= {(r["model_fp"], r["task"], r["length"], r["seed"]) for r in records if r["method"] == "cake"}
    return records + [
        {"model_fp": r["model_fp"], "task": r["task"], "length": r["length"], "seed": r["seed"],
         "sample": r["sample"], "scenario": r["scenario"], "ratio": r["ratio"], "method": "cake",
         "kl": r["kl"], "attn": r["attn_rel_l1"], "cake_tau": label, "window": r["window"]}
        for r in results
        if r["method"] == "cake" and r.get("tau") == cells.get(r["scenario"])
        and (r["model_fp"], r["task"], r["length"], r["seed"]) in swept
    ]  # fmt: skip


def sweep_group(
    model, group, ratios: Sequence[float], window: int = 32, fidelity_tokens: int = 16,
    tau1s: Sequence[float] = TAU1_GRID, tau2s: Sequence[float] = TAU2_GRID,
) -> Iterator[dict[str, Any]]:  # fmt: skip
    """Records of one synthetic prompt (a context group with one question): per scenario and ratio,
    the references' and every grid point's ``kl`` and ``attn`` (mean attention perturbation)."""
    from kvcake.budget import BudgetSpec
    from kvcake.calibration.search import FixedLayers, layer_budgets
    from kvcake.eval.fidelity import replay_compress
    from kvcake.eval.reference import full_reference
    from kvcake.method import make_method
    from kvcake.replay import ScoreMemo

    if len(group.questions) != 1:
        raise ValueError(
            f"the sweep takes synthetic prompts (one question per context), got {len(group.questions)}"
        )
    ref = full_reference(model, group, True, True, fidelity_tokens, ("question", "context"))
    q = ref.questions[0]
    dev = model.device
    ctx_ids, q_ids = group.context.to(dev), q.question.ids.to(dev)
    n = q.tf["question"].logprobs.shape[0]
    cont = q.tokens[None, : n - 1]
    cases = {  # scenario -> (recording, full cache, prompt ids, last logits, chunks, appended, full teacher forcing)
        "question": (
            q.captured,
            q.cache,
            torch.cat([ctx_ids, q_ids], 1),
            q.logits,
            None,
            cont,
            q.tf["question"],
        ),
        "context": (
            ref.captured,
            ref.cache,
            ctx_ids,
            ref.logits,
            1,
            torch.cat([q_ids, cont], 1),
            q.tf["context"],
        ),
    }
    for scenario, case in cases.items():
        captured, cache, ids, logits, chunks = case[:5]
        memo = ScoreMemo()
        # each layer's dispersion and shift are the prompt's (window attention), whatever the budget
        stats = replay_compress(
            model, make_method("cake-oneshot,layers.tau1=1,layers.tau2=1", ratio=ratios[0], window=window),
            captured, cache, ids, logits, chunks=chunks, memo=memo,
        )  # fmt: skip
        h, v = torch.stack(stats.cache.entropy, 1)[0], torch.stack(stats.cache.variance, 1)[0]
        for ratio in ratios:
            base = {"scenario": scenario, "ratio": ratio}
            for name in REFERENCES:
                kl, attn = _measure(
                    model, case, memo, q.tokens[:n], make_method(name, ratio=ratio, window=window), scenario
                )
                yield {**base, "method": name, "kl": kl, "attn": attn}
            spec = BudgetSpec(ratio=ratio, window=window)
            fixed = make_method("layers=uniform,score=cake,decode=fixed", ratio=ratio, window=window)
            seen: dict[tuple[int, ...], tuple[float, float]] = {}
            for tau1, tau2 in itertools.product(tau1s, tau2s):
                budgets = tuple(layer_budgets(h, v, spec, ids.shape[1], tau1, tau2).tolist())
                if budgets not in seen:
                    seen[budgets] = _measure(
                        model, case, memo, q.tokens[:n], fixed.replace(layers=FixedLayers(budgets))
                    )
                kl, attn = seen[budgets]
                yield {**base, "method": "tau", "tau1": tau1, "tau2": tau2, "kl": kl, "attn": attn}


def _measure(
    model, case: tuple, memo, continuation: torch.Tensor, method, scenario: str | None = None
) -> tuple[float, float]:
    """(KL, mean attention perturbation) of ``method``'s cache for one scenario ``case``:
    (recording, full cache, prompt ids, last logits, chunks, appended ids, full teacher forcing)."""
    from kvcake.eval.fidelity import compare, replay_compress, teacher_force

    captured, cache, ids, logits, chunks, appended, full_tf = case
    ctx = replay_compress(
        model, method, captured, cache, ids, logits, chunks=chunks, memo=memo, scenario=scenario
    )
    tf = teacher_force(model, ctx.cache, ids.shape[1], ctx.logits, appended, continuation.numel())
    f = compare(full_tf, tf, continuation)
    return f.kl, f.attn_rel_l1


def run_sweep(
    model, tokenizer, *, tasks: Sequence[str], lengths: Sequence[int], samples: int, ratios: Sequence[float],
    out: str | Path, seed: int = 0, haystack: str = "paul_graham", needle_style: str = "restated",
    window: int = 32, fidelity_tokens: int = 16, compute: bool = True, progress: bool = True,
) -> list[dict[str, Any]]:  # fmt: skip
    """Sweep every prompt of ``tasks`` x ``lengths`` x ``samples`` not yet in ``out`` (appended to),
    and return the records of those prompts from ``out``."""
    from kvcake.eval.questions import groups_for, task_options_for
    from kvcake.eval.records import load_records
    from kvcake.method import make_method
    from kvcake.models import model_fingerprint
    from kvcake.temperatures import method_tau_label

    path = Path(out)
    fp = model_fingerprint(model)
    label = method_tau_label(model, make_method("cake", ratio=0.5))
    records = load_records(path)
    if compute:
        done = {_prompt_key(r) for r in records}
        for task in tasks:
            for length in lengths:
                opts = task_options_for(task, needle_style, None)
                for group in groups_for(task, tokenizer, samples, length, seed, haystack, opts, None, None):
                    q = group.questions[0]
                    base = {"model_fp": fp, "task": task, "length": length, "seed": q.seed, "sample": q.sample,
                            "cake_tau": label, "window": window}  # fmt: skip
                    if _prompt_key(base) in done:
                        continue
                    t0 = time.perf_counter()
                    batch = [
                        {**base, **r} for r in sweep_group(model, group, ratios, window, fidelity_tokens)
                    ]
                    path.parent.mkdir(parents=True, exist_ok=True)
                    with path.open("a", encoding="utf-8") as sink:
                        sink.writelines(json.dumps(r, sort_keys=True) + "\n" for r in batch)
                    records += batch
                    if progress:
                        print(f"tau sweep: {task} {length} seed {q.seed}: {len(batch)} records in "
                              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
    seeds = range(seed, seed + samples)  # sample i of a synthetic task is built from seed + i
    # cake rows only with the temperatures in force; the grid and references whatever they were swept with
    return [r for r in records if r["model_fp"] == fp and (r["method"] != "cake" or r["cake_tau"] == label)
            and r["task"] in tasks and r["length"] in lengths and r["seed"] in seeds]  # fmt: skip


def _means(records: Sequence[dict[str, Any]]) -> dict[tuple[str, float], dict[Any, tuple[float, float, int]]]:
    """(scenario, ratio) -> method or (tau1, tau2) -> (mean KL, mean attention perturbation, prompts),
    over the prompts that every entry of the cell has."""
    cells: dict[tuple[str, float], dict[Any, dict[tuple, tuple[float, float]]]] = {}
    for r in records:
        who = r["method"] if r["method"] != "tau" else (r["tau1"], r["tau2"])
        prompt = (r["task"], r["length"], r["seed"])
        cells.setdefault((r["scenario"], r["ratio"]), {}).setdefault(who, {})[prompt] = (r["kl"], r["attn"])
    out = {}
    for cell, by in cells.items():
        common = set.intersection(*(set(v) for v in by.values()))
        if not common:
            continue
        out[cell] = {
            who: (
                sum(v[p][0] for p in common) / len(common),
                sum(v[p][1] for p in common) / len(common),
                len(common),
            )  # fmt: skip
            for who, v in by.items()
        }
    return out


def targets_held(kl: float, attn: float, refs: dict[Any, tuple[float, float, int]]) -> int:
    """How many of issue 14's four fidelity targets a (KL, attention perturbation) pair meets in one
    cell: KL and perturbation at or below ``snapkv``'s and ``pyramidkv``'s."""
    return sum(x <= refs[m][i] for m in ("snapkv", "pyramidkv") for i, x in enumerate((kl, attn)))


def sweep_markdown(records: Sequence[dict[str, Any]]) -> str:
    """The results page's section: per scenario and ratio, the references, the grid's best point
    for the targets (ties: lower KL), its lowest KL and lowest perturbation; then the single pair
    of temperatures that meets the most targets over all cells, against the shipped calibration."""
    means = _means(records)
    if not means:
        return ""
    prompts = max(n for cell in means.values() for *_, n in cell.values())
    taus = sorted({k for cell in means.values() for k in cell if isinstance(k, tuple)})
    titles = {"question": "question-aware", "context": "context-only"}
    lines = [
        "## What CAKE's temperatures alone can reach (oracle sweep)",
        "",
        f"CAKE at each of {len(taus)} fixed temperature pairs (tau1 in {', '.join(f'{t:g}' for t in TAU1_GRID)}; "
        f"tau2 in {', '.join(f'{t:g}' for t in TAU2_GRID)}), measured on the same {prompts} prompts as the "
        "tables above (the same full-cache continuation, KL and attention-output perturbation, means over "
        "the prompts). The temperatures are picked on these evaluation prompts, which a calibration must "
        "not do: the best point is an upper bound on what any fixed temperatures can reach here, not a "
        "result CAKE could claim. *Targets* counts issue 14's four fidelity targets met in the cell (KL and "
        "perturbation at or below `snapkv`'s and `pyramidkv`'s). "
        f"Command: `{COMMAND}` (records in `{sweep_path('docs/figures/eval_results.jsonl')}`); the page shows "
        "this section once that file exists.",
        "",
        "| scenario | ratio | `snapkv` KL / attn | `pyramidkv` KL / attn | `cake` (shipped) KL / attn, targets "
        "| grid's best for the targets | grid's lowest KL (its attn) | grid's lowest attn (its KL) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    total = dict.fromkeys(taus, 0)
    shipped = 0

    def pair(t: tuple[float, float]) -> str:
        return f"{t[0]:g}/{t[1]:g}"

    for (sc, ratio), cell in sorted(means.items(), key=lambda kv: (kv[0][0] != "question", kv[0][1])):
        if not all(m in cell for m in REFERENCES):
            continue
        grid = {t: cell[t] for t in taus if t in cell}
        held_by = {t: targets_held(kl, attn, cell) for t, (kl, attn, _) in grid.items()}
        for t, n_held in held_by.items():
            total[t] += n_held
        c = cell["cake"]
        held = targets_held(c[0], c[1], cell)
        shipped += held
        best = min(grid, key=lambda t: (-held_by[t], grid[t][0]))
        low_kl = min(grid, key=lambda t: grid[t][0])
        low_attn = min(grid, key=lambda t: grid[t][1])
        lines.append(
            f"| {titles[sc]} | {ratio:g} | {cell['snapkv'][0]:.4f} / {cell['snapkv'][1]:.4f} | "
            f"{cell['pyramidkv'][0]:.4f} / {cell['pyramidkv'][1]:.4f} | {c[0]:.4f} / {c[1]:.4f}, {held}/4 | "
            f"{pair(best)}: {grid[best][0]:.4f} / {grid[best][1]:.4f}, "
            f"{held_by[best]}/4 | {pair(low_kl)}: {grid[low_kl][0]:.4f} "
            f"({grid[low_kl][1]:.4f}) | {pair(low_attn)}: {grid[low_attn][1]:.4f} ({grid[low_attn][0]:.4f}) |"
        )  # fmt: skip
    cells = sum(1 for cell in means.values() if all(m in cell for m in REFERENCES))
    top = max(total.values())
    winners = [t for t in taus if total[t] == top]
    lines += [
        "",
        f"Over the {cells} cells ({4 * cells} fidelity targets) the best single pair of temperatures meets "
        f"{top} ({', '.join(f'{a:g}/{b:g}' for a, b in winners)}); the shipped calibration meets {shipped}.",
    ]
    return "\n".join(lines)
