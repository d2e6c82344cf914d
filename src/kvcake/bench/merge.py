"""``--add``: merge a run of some methods into the memory and prefill results already in ``--out``.

A bench run replaces ``<bench>.json``; a page that already holds many methods' rows would need
all of them measured again to gain one. With ``--add`` the new run's rows replace only the rows
of the same (method, length) and the targets are recomputed from the merged rows, so a new
preset's rows join the page by its own command (``kvcake bench memory --methods NEW --add``, then
``kvcake bench report``).
"""

from __future__ import annotations

from . import memory, speed

MERGEABLE = ("memory", "prefill")


def _rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` without the (method, length) cells of ``new``, then ``new``, in (length, method)
    order of first appearance (old methods first). The full cache's rows of ``old`` stay: the
    old methods were compared with them (process memory is a noisy, per-run measure); the new
    run's fill only lengths ``old`` lacks."""
    have = {(r["method"], r["length"]) for r in old}
    new = [r for r in new if r["method"] != "full" or (r["method"], r["length"]) not in have]
    fresh = {(r["method"], r["length"]) for r in new}
    kept = [r for r in old if (r["method"], r["length"]) not in fresh]
    order = {m: i for i, m in enumerate(dict.fromkeys(r["method"] for r in [*old, *new]))}
    return sorted([*kept, *new], key=lambda r: (r["length"], order[r["method"]]))


def merge(bench: str, old: dict, new: dict) -> dict:
    """The merged result of ``bench`` (``memory`` or ``prefill``); settings must match."""
    if bench not in MERGEABLE:
        raise ValueError(f"--add merges the {' and '.join(MERGEABLE)} benches, not {bench!r}")
    for key in ("budget", "window"):
        if old.get(key) != new.get(key):
            raise ValueError(
                f"--add: the {bench} results in --out have {key}={old.get(key)}, this run {new.get(key)}: "
                f"run with --{key} {old.get(key)} (or without --add to replace them)"
            )
    out = dict(old)
    out["methods"] = list(dict.fromkeys([*old["methods"], *new["methods"]]))
    out["lengths"] = sorted({*old["lengths"], *new["lengths"]})
    out["machine"] = new.get("machine") or old.get("machine")
    if bench == "memory":
        out["kv"] = _rows(old["kv"], new["kv"])
        out["rss"] = _rows(old["rss"], new["rss"])
        out["targets"] = memory.targets(out["kv"])
    else:
        out["rows"] = _rows(old["rows"], new["rows"])
        fresh = {r["method"] for r in new["runs"]}
        out["runs"] = [r for r in old["runs"] if r["method"] not in fresh] + new["runs"]
        out.pop("target_length", None)  # (pages before issue 23: one target length)
        out["targets"] = speed.prefill_targets(out["rows"])
    return out
