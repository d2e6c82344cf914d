"""``--add``: merge a run of some methods into the results already in ``--out``.

A bench run replaces ``<bench>.json``; a page that already holds many methods' rows would need
all of them measured again to gain one. With ``--add`` the new run's rows replace only the rows
of the same (method, length) and the targets are recomputed from the merged rows, so a new
preset's rows join the page by its own command (``kvcake bench memory --methods NEW --add``, then
``kvcake bench report``). The decode bench's rows are compared within one context length (the
full cache's step is each row's reference), so a decode run replaces every row at its lengths.
"""

from __future__ import annotations

from . import decode, memory, speed

MERGEABLE = ("memory", "prefill", "decode")


def _rows(old: list[dict], new: list[dict], keep_full: bool = True) -> list[dict]:
    """``old`` without the (method, length) cells of ``new``, then ``new``, in (length, method)
    order of first appearance (old methods first). ``keep_full``: the full cache's rows of
    ``old`` stay, since the old methods were compared with them (process memory is a noisy,
    per-run measure), and the new run's fill only lengths ``old`` lacks; else (bytes read off
    the caches, the same in every run) the new run's replace them, with any field added since."""
    have = {(r["method"], r["length"]) for r in old}
    new = [r for r in new if not keep_full or r["method"] != "full" or (r["method"], r["length"]) not in have]
    fresh = {(r["method"], r["length"]) for r in new}
    kept = [r for r in old if (r["method"], r["length"]) not in fresh]
    order = {m: i for i, m in enumerate(dict.fromkeys(r["method"] for r in [*old, *new]))}
    return sorted([*kept, *new], key=lambda r: (r["length"], order[r["method"]]))


def merge(bench: str, old: dict, new: dict) -> dict:
    """The merged result of ``bench`` (one of ``MERGEABLE``); settings must match."""
    if bench not in MERGEABLE:
        raise ValueError(f"--add merges the {', '.join(MERGEABLE)} benches, not {bench!r}")
    for key in ("budget", "window"):  # (decode results have budgets, not one budget: None == None)
        if old.get(key) != new.get(key):
            raise ValueError(
                f"--add: the {bench} results in --out have {key}={old.get(key)}, this run {new.get(key)}: "
                f"run with --{key} {old.get(key)} (or without --add to replace them)"
            )
    if bench == "decode":
        return _merge_decode(old, new)
    out = dict(old)
    out["methods"] = list(dict.fromkeys([*old["methods"], *new["methods"]]))
    out["lengths"] = sorted({*old["lengths"], *new["lengths"]})
    out["machine"] = new.get("machine") or old.get("machine")
    if bench == "memory":
        out["kv"] = _rows(old["kv"], new["kv"], keep_full=False)
        out["rss"] = _rows(old["rss"], new["rss"])
        out["targets"] = memory.targets(out["kv"])
    else:
        out["rows"] = _rows(_with_machine(old), _with_machine(new))
        fresh = {(r["method"], r["length"]) for r in new["runs"]}  # the runs behind the replaced rows
        out["runs"] = [r for r in old["runs"] if (r["method"], r["length"]) not in fresh] + new["runs"]
        out.pop("target_length", None)  # (pages before issue 23: one target length)
        out["targets"] = speed.prefill_targets(out["rows"])
    return out


def _with_machine(result: dict) -> list[dict]:
    """``result``'s prefill rows, each saying the machine it was measured on: rows written before
    rows did say it get their run's (``machine``), so merged runs of two machines stay apart."""
    label = speed.machine_label(result.get("machine"))
    return [r if r.get("machine") else {**r, "machine": label} for r in result["rows"]]


def _merge_decode(old: dict, new: dict) -> dict:
    """Every row of ``old`` at a length ``new`` measured is replaced by ``new``'s; each row keeps
    its own bound (from its run's bandwidth); the counts table is the newest run's."""
    out = dict(old)
    fresh = set(new["lengths"])
    out["rows"] = sorted(
        [r for r in old["rows"] if r["length"] not in fresh] + new["rows"], key=lambda r: r["length"]
    )
    for key in ("lengths", "budgets"):
        out[key] = sorted({*old[key], *new[key]})
    for key in ("methods", "policies"):
        out[key] = list(dict.fromkeys([*old[key], *new[key]]))
    out["bandwidth"], out["machine"] = new["bandwidth"], new.get("machine") or old.get("machine")
    out["compile"] = bool(new.get("compile") or old.get("compile"))
    if "counts" in new:
        out["counts"] = new["counts"]
    out["targets"] = decode.decode_targets(out["rows"])
    return out
