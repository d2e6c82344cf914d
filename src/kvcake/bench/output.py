"""Statistics and output of the benchmarks: medians, number formats, markdown tables, JSON and
figures that touch no global matplotlib state."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def fmt(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return f"{x:.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(ok: bool | None) -> str:
    """A target's check: None where the run cannot judge it (``decode.decode_targets``)."""
    return "NOT JUDGED" if ok is None else "PASS" if ok else "MISS"


def kept_preamble(doc: Path) -> str:
    """The hand-written note of a page (a blockquote right under its title: what was run when, on
    what), which re-rendering it keeps; "" where the page or the note is absent."""
    try:
        lines = doc.read_text().splitlines()[1:]
    except OSError:
        return ""
    start = next((i for i, line in enumerate(lines) if line.strip()), len(lines))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith(">")), len(lines))
    return "\n".join(lines[start:end])


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=_jsonable) + "\n")
    return path


def emit(result: dict, name: str, tables: str, plot, out: str | Path | None, echo: bool) -> dict:
    """What every bench does with its result: print ``tables`` if ``echo``, and with ``out`` write
    ``out/<name>.json`` and draw ``out/<name>.png`` with ``plot(result, path)``."""
    if echo:
        print(tables, flush=True)
    if out is not None:
        write_json(Path(out) / f"{name}.json", result)
        plot(result, Path(out) / f"{name}.png")
    return result


def _jsonable(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "__dataclass_fields__"):
        return asdict(x)
    return str(x)


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.2):
    """A matplotlib figure that touches no global backend state (no pyplot)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def log_axes(ax, xticks=None) -> None:
    """Log-log axes with plain numbers at the given x ticks and no minor-tick labels."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_xscale("log")
    if xticks is not None:
        ax.set_xticks(list(xticks), [str(x) for x in xticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def save_figure(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
