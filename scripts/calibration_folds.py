"""How well a calibration design carries to prompts it never saw: CAKE's temperatures chosen on
one fold of calibration samples, measured on the others (issue 24).

Choosing between calibration designs by the results page's prompts is fitting to them; this
compares designs on calibration samples alone. ``record`` builds one fold (``--samples`` samples
of a scenario from ``--seed`` on, held out from the shipped calibrations, which use seeds 0-15) and
measures, per sample, the KL of every candidate of a fixed grid of (tau1, tau2) (the paper's
5 x 5 grid, tau1 = 3.56 past its edge, the near-uniform point), of uniform layer budgets and of
SnapKV. ``compare`` picks the kept point on some folds, as ``kvcake calibrate`` does (one
standard error rule, :func:`kvcake.calibration.search.choose`), under each objective, and
prints its mean KL on the other folds beside near-uniform budgets' and SnapKV's, one row per split,
then those figures over near-uniform budgets' averaged over the splits (the README's held-out
figures):

- ``parts``: the shipped objective, each part's KL over uniform budgets' on that part, the
  parts averaged (a continued passage weighs what a document asked about weighs);
- ``nats``: the mean KL itself over the samples (the document questions' KL, 10-40 x the
  passages', decides).

``record --indicator max7`` measures the same grid with another CAKE indicator (its losses on
the paper's scale); given such folds for every seed, ``compare`` also keeps an indicator as
``kvcake calibrate --indicators avg5,max7`` does (the paper's unless another's is better by more
than one standard error) and prints those rows beside the paper's indicator alone.
``record --gamma 0`` does the same for another weight of CAKE's variance term (the paper's 200),
the fold named ``avg5-gamma0``; ``compare`` keeps it as an indicator (``export`` refuses it: a
calibration holds no gamma).

    PYTHONPATH=src python3 scripts/calibration_folds.py record --seed 1000 --out /tmp/folds
    PYTHONPATH=src python3 scripts/calibration_folds.py record --seed 1000 --indicator max7 --out /tmp/folds
    PYTHONPATH=src python3 scripts/calibration_folds.py record --seed 1000 --gamma 0 --out /tmp/folds
    PYTHONPATH=src python3 scripts/calibration_folds.py compare /tmp/folds/context-*.json

``export`` writes the points kept on all the given folds together into a copy of a calibration
(the default model's shipped one by default) under ``OUT/calibrations``, so that
``KVCAKE_CACHE_DIR=OUT python -m kvcake.eval ...`` measures a design on the results page's
prompts without shipping it (the folds of seeds 0 and 16 together are the 32 samples
``kvcake calibrate --samples 32`` draws; seed 0 alone reproduces the shipped points). The models
are converted again into OUT on first use.

    PYTHONPATH=src python3 scripts/calibration_folds.py export /tmp/folds/context-0*.json \
        /tmp/folds/context-16*.json --out /tmp/cal32

About 10 minutes per fold of 16 context-only samples on one core of this 2-core CPU (default model);
25-28 minutes on the slower AMD host (8 MiB L3), two folds at once (2026-12-06).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

import kvcake
from kvcake.budget import BudgetSpec
from kvcake.calibration.api import FLAT_TAU, PAPER_INDICATOR, indicator_name
from kvcake.calibration.samples import build_texts, sample_reference
from kvcake.calibration.search import Evaluator, choose, choose_indicator
from kvcake.haystack import resolve_haystack
from kvcake.method import make_method
from kvcake.temperatures import (
    SCENARIOS,
    SHIPPED_DIR,
    Calibration,
    TauPoint,
    parse_indicator,
    save_calibration,
)

TAU1 = (0.2, 0.356, 0.632, 1.12, 2.0, 3.56)
TAU2 = (0.4, 0.662, 1.1, 1.81, 3.0)
RATIOS = (0.1, 0.25, 0.5)
_FLAT = f"{FLAT_TAU[0]}/{FLAT_TAU[1]}"
_PAPER = indicator_name(PAPER_INDICATOR)
_GAMMA = "-gamma"  # a fold recorded with --gamma G is named <indicator>-gamma<G>


def record(args) -> None:
    torch.set_num_threads(args.threads)
    model, tok = kvcake.load_model(args.model or kvcake.DEFAULT_MODEL)
    haystack = resolve_haystack(args.text)
    t0 = time.perf_counter()
    refs = [
        sample_reference(model, build_texts(tok, haystack, args.scenario, args.length, 16, args.seed + i),
                         args.scenario, 16)
        for i in range(args.samples)
    ]  # fmt: skip
    indicator = parse_indicator(args.indicator)
    label = indicator_name(indicator) + ("" if args.gamma is None else f"{_GAMMA}{args.gamma:g}")
    fold = {"scenario": args.scenario, "seed": args.seed, "indicator": label,
            "parts": [s.part for s in refs], "ratios": {}}  # fmt: skip
    for ratio in RATIOS:
        spec = BudgetSpec(ratio=ratio, window=args.window)
        ev = Evaluator(model, refs, spec)
        if label != _PAPER:  # losses on the paper's scale: its uniform budgets' KL
            ev = Evaluator(model, refs, spec, indicator=indicator, baseline=ev.uniform, gamma=args.gamma)
        snapkv = make_method("layers=uniform,score=snapkv,decode=fixed", ratio=ratio, window=args.window)
        taus = [(a, b) for a in TAU1 for b in TAU2] + [FLAT_TAU]
        fold["ratios"][str(ratio)] = {
            "uniform": ev.uniform["kl"],
            "kl": {f"{a}/{b}": [ev.sample_measures(i, a, b).kl for i in range(len(refs))] for a, b in taus},
            "unevenness": {f"{a}/{b}": ev.unevenness(a, b) for a, b in taus},
            "snapkv": [ev.measure(i, snapkv).kl for i in range(len(refs))],
        }
        print(f"ratio {ratio}: {time.perf_counter() - t0:.0f} s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "" if label == _PAPER else f"-{label}"
    path = out / f"{args.scenario}-{args.seed}{name}.json"
    path.write_text(json.dumps(fold))
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")


def _merge(folds: list[dict], ratio: str) -> dict:
    parts = [p for f in folds for p in f["parts"]]
    kl = {t: [x for f in folds for x in f["ratios"][ratio]["kl"][t]] for t in folds[0]["ratios"][ratio]["kl"]}
    snap = [x for f in folds for x in f["ratios"][ratio]["snapkv"]]
    uniform = {  # uniform budgets' mean KL per part over the folds, each fold weighted by its samples
        p: sum(f["ratios"][ratio]["uniform"][p] * f["parts"].count(p) for f in folds) / parts.count(p)
        for p in set(parts)
    }
    unev = {t: _mean([f["ratios"][ratio]["unevenness"][t] for f in folds]) for t in kl}
    return {"parts": parts, "kl": kl, "snapkv": snap, "uniform": uniform, "unevenness": unev}


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def _part_mean(values: list[float], parts: list[str], part: str) -> float:
    """The mean of ``values`` over the samples of ``part``."""
    return _mean(x for x, q in zip(values, parts, strict=True) if q == part)


def _kept(train: dict, objective: str) -> tuple[str, list[float]]:
    """The kept candidate on ``train`` under ``objective`` and its per-sample losses."""
    parts = train["parts"]
    if objective == "parts":
        per = {
            t: [x / train["uniform"][p] for x, p in zip(v, parts, strict=True)]
            for t, v in train["kl"].items()
        }

        def loss(v):
            return _mean(_part_mean(v, parts, p) for p in set(parts))
    else:
        scale = _mean(train["uniform"][p] for p in parts)
        per = {t: [x / scale for x in v] for t, v in train["kl"].items()}
        loss = _mean
    table = {tuple(map(float, t.split("/"))): loss(v) for t, v in per.items()}
    kept = choose(table, lambda a, b: per[f"{a}/{b}"], lambda a, b: train["unevenness"][f"{a}/{b}"])
    t = f"{kept.tau[0]}/{kept.tau[1]}"
    return t, per[t]


def pick(train: dict, objective: str) -> str:
    """The kept candidate on ``train`` under ``objective`` (see the module's docstring)."""
    return _kept(train, objective)[0]


def pick_indicator(trains: dict[str, dict], objective: str) -> tuple[str, str]:
    """(indicator, candidate) kept on ``trains`` (one merged train set per indicator, each on the
    paper's uniform scale) as ``kvcake calibrate --indicators`` keeps them: each indicator's point,
    then the paper's indicator unless another's is better by more than one standard error."""
    kept = {ind: _kept(train, objective) for ind, train in trains.items()}
    ind = choose_indicator({i: per for i, (_, per) in kept.items()}, _PAPER)
    return ind, kept[ind][0]


def _groups(paths) -> tuple[dict[int, dict[str, dict]], list[str]]:
    """The folds read from ``paths`` by seed and indicator, and the indicators other than the
    paper's that every seed has."""
    groups: dict[int, dict[str, dict]] = {}  # seed -> indicator -> fold
    for path in paths:
        fold = json.loads(Path(path).read_text())
        groups.setdefault(fold["seed"], {})[fold.get("indicator", _PAPER)] = fold
    if any(_PAPER not in g for g in groups.values()):
        raise ValueError(
            f"every seed needs its fold with the paper's indicator {_PAPER} (record without --indicator)"
        )
    if len({f["scenario"] for g in groups.values() for f in g.values()}) > 1:
        raise ValueError("the folds are of different scenarios; give the folds of one scenario")
    others = sorted({i for g in groups.values() for i in g} - {_PAPER})
    return groups, [i for i in others if all(i in g for g in groups.values())]  # only what every seed has


def compare(args) -> None:
    groups, others = _groups(args.folds)
    seeds = sorted(groups)
    # the paper's indicator alone, beside each other one, and (given several) beside all of them
    sets = [[_PAPER]] + [[_PAPER, o] for o in others] + ([[_PAPER, *others]] if len(others) > 1 else [])
    names = [str(s) for s in seeds]
    print(f"{len(seeds)} folds ({', '.join(names)}), {groups[seeds[0]][_PAPER]['scenario']}: kept on the train "
          "folds, mean KL on the others (nats/token, and per part), against near-uniform budgets and SnapKV; "
          f"indicators {', '.join([_PAPER, *others])}")  # fmt: skip
    print(
        "| ratio | train | objective | indicators | kept | KL | KL per part | near-uniform | SnapKV | <= SnapKV |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for ratio in map(str, RATIOS):
        for size in (1, 2):
            for train_idx in itertools.combinations(range(len(seeds)), size):
                test_idx = [i for i in range(len(seeds)) if i not in train_idx]
                if not test_idx:
                    continue
                train, test = (
                    {i: _merge([groups[seeds[k]][i] for k in idx], ratio) for i in sets[-1]}
                    for idx in (train_idx, test_idx)
                )  # per indicator, merged once for every row of this split
                paper = test[_PAPER]
                for objective, inds in itertools.product(("parts", "nats"), sets):
                    ind, t = pick_indicator({i: train[i] for i in inds}, objective)
                    kl, parts = test[ind]["kl"][t], paper["parts"]
                    by_part = ", ".join(f"{p} {_part_mean(kl, parts, p):.4f}" for p in sorted(set(parts)))
                    wins = sum(a <= b for a, b in zip(kl, paper["snapkv"], strict=True))
                    train_name = "+".join(names[i] for i in train_idx)
                    flat, snapkv = _mean(paper["kl"][_FLAT]), _mean(paper["snapkv"])
                    print(f"| {ratio} | {train_name} | {objective} | {'+'.join(inds)} | {ind} {t} | {_mean(kl):.4f} | "
                          f"{by_part} | {flat:.4f} | {snapkv:.4f} | {wins}/{len(kl)} |")  # fmt: skip
                    rows.append({"key": (ratio, size, objective, "+".join(inds)), "indicator": ind,
                                 "kl": _mean(kl) / flat, "snapkv": snapkv / flat})  # fmt: skip
    _summary(rows)


def _shipped(model: str) -> Path:
    """The shipped calibration file of ``model`` (its name as the file records it)."""
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        if Calibration.from_json(path.read_text(), str(path)).model == model:
            return path
    raise ValueError(f"no calibration of {model!r} is shipped in {SHIPPED_DIR}; give one with --base")


def export(args) -> None:
    """Write a calibration whose points for the folds' scenario are those kept on all the given
    folds together (as ``kvcake calibrate`` keeps them on the same samples, here on this script's
    fixed grid), the other scenario's as in ``--base``, to ``OUT/calibrations`` (where
    ``KVCAKE_CACHE_DIR=OUT`` makes the library use it): a design's points on the results page's
    prompts without shipping them."""
    groups, others = _groups(args.folds)
    base = Path(args.base) if args.base else _shipped(kvcake.DEFAULT_MODEL)
    cal = Calibration.from_json(base.read_text(), str(base))
    scenario = groups[min(groups)][_PAPER]["scenario"]  # one for all the folds (_groups)
    points = cal.set(scenario)
    budgets = [round(r * args.length) for r in RATIOS]
    if [p.budget for p in points] != budgets:
        raise ValueError(f"{base} has {scenario} points at {[p.budget for p in points]} entries per layer; "
                         f"the folds are at ratios {RATIOS} of {args.length} tokens ({budgets})")  # fmt: skip
    kept = []
    for ratio, point in zip(map(str, RATIOS), points, strict=True):
        merged = {i: _merge([g[i] for g in groups.values()], ratio) for i in [_PAPER, *others]}
        ind, t = pick_indicator(merged, args.objective)
        if _GAMMA in ind:
            raise ValueError(f"{scenario} ratio {ratio} keeps {ind}, and a calibration holds a pooling and "
                             "a kernel but not CAKE's gamma: export folds recorded without --gamma")  # fmt: skip
        tau1, tau2 = map(float, t.split("/"))
        kept.append(TauPoint(point.budget, tau1, tau2, None if ind == _PAPER else ind))
        print(f"{scenario} ratio {ratio} ({point.budget:g} entries per layer): {ind} {t}")
    exported = {"from": str(base), "folds": sorted(map(str, args.folds)), "objective": args.objective,
                "scenario": scenario}  # fmt: skip
    sets = {s: tuple(kept) if s == scenario else cal.set(s) for s in SCENARIOS}
    out = replace(cal, points=sets, meta=cal.meta | {"exported": exported})
    path = save_calibration(out, Path(args.out) / "calibrations")
    print(f"wrote {path}; use it with KVCAKE_CACHE_DIR={args.out}")


def summarise(rows: list[dict]) -> list[dict]:
    """The rows of ``compare`` averaged over the splits of each (ratio, number of train folds,
    objective, indicators): held-out KL and SnapKV's, each over near-uniform budgets' on the same
    held-out folds, and how often each indicator was kept."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["key"], []).append(r)
    return [{"key": key, "splits": len(group), "kl": _mean(r["kl"] for r in group),
             "snapkv": _mean(r["snapkv"] for r in group), "kept": Counter(r["indicator"] for r in group)}
            for key, group in groups.items()]  # fmt: skip


def _summary(rows: list[dict]) -> None:
    print("\nAveraged over the splits, each held-out mean KL over near-uniform budgets' on the same folds:")
    print(
        "| ratio | train folds | objective | indicators | splits | KL / near-uniform | SnapKV / near-uniform | kept |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in summarise(rows):
        ratio, size, objective, inds = s["key"]
        kept = ", ".join(f"{i} {n}/{s['splits']}" for i, n in s["kept"].items())
        print(
            f"| {ratio} | {size} | {objective} | {inds} | {s['splits']} | {s['kl']:.3f} | {s['snapkv']:.3f} | {kept} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="measure one fold of calibration samples")
    r.add_argument("--seed", type=int, required=True, help="first sample's seed (the shipped files use 0-15)")
    r.add_argument("--samples", type=int, default=16)
    r.add_argument("--scenario", default="context", choices=("context", "question"))
    r.add_argument("--model", default=None)
    r.add_argument("--text", default="paul_graham")
    r.add_argument("--length", type=int, default=2048)
    r.add_argument("--window", type=int, default=32)
    r.add_argument(
        "--indicator", default=_PAPER, help="CAKE's indicator, e.g. max7 (default: the paper's avg5)"
    )
    r.add_argument(
        "--gamma",
        type=float,
        default=None,
        help="CAKE's variance weight (default: the paper's 200); the fold is named after it, "
        "its losses on the paper's scale",
    )
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--out", default="calibration-folds")
    c = sub.add_parser("compare", help="keep a point on some folds, measure it on the others")
    c.add_argument("folds", nargs="+")
    e = sub.add_parser("export", help="write a calibration with the points kept on all the given folds")
    e.add_argument("folds", nargs="+")
    e.add_argument(
        "--base",
        default=None,
        help="calibration whose other scenario is kept (default: the default model's shipped one)",
    )
    e.add_argument(
        "--objective",
        default="nats",
        choices=("parts", "nats"),
        help="nats: the shipped objective (the samples pooled)",
    )
    e.add_argument("--length", type=int, default=2048, help="the folds' prompt length")
    e.add_argument("--out", required=True, help="a folder to give as KVCAKE_CACHE_DIR")
    args = ap.parse_args()
    {"record": record, "compare": compare, "export": export}[args.command](args)


if __name__ == "__main__":
    main()
