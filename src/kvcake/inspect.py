"""Figures of what a method did to one prompt: layer budgets, layer preferences, head budgets,
kept positions.

``inspect_prompt`` compresses the prompt twice, with the method asked for (default CAKE) and
with a head-adaptive method (default ``cake-adakv``), and writes four PNG files, each exactly
``FIGSIZE * DPI`` = 1200 x 800 pixels (no tight bounding box, so the size never depends on the
labels):

1. ``cake_slices.png``: the per-layer budgets the method chose (CAKE's "cake slices"), against
   the uniform split of the same total (CAKE paper, Figure 1/4);
2. ``layer_preferences.png``: each layer's spatial dispersion ``H_l`` (entropy of the window
   attention) and temporal shift ``V_l`` (variance over the window rows), the two factors of
   CAKE's preference ``P_l = H_l^(1/tau1) V_l^(1/tau2)`` (CAKE paper, Figure 3);
3. ``adakv_heads.png``: the Ada-KV per-head budgets, a layers x KV-heads heatmap;
4. ``kept_positions.png``: which prompt positions each layer kept (layers x positions, the
   shade is the fraction of the layer's KV heads that kept the position), for both runs.

Only sequence 0 of a batch is drawn. Figures are drawn on ``matplotlib.figure.Figure`` objects
with the Agg canvas, so nothing touches pyplot's global state or the display.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .api import compress
from .cache import KVCakeCache
from .context import CompressedContext
from .method import PRESETS, Method, make_method
from .temperatures import Scenario

logger = logging.getLogger(__name__)

FIGSIZE = (12.0, 8.0)  # inches
DPI = 100  # -> 1200 x 800 pixels
FIGURES = ("cake_slices.png", "layer_preferences.png", "adakv_heads.png", "kept_positions.png")


def _figure() -> Figure:
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, format="png")  # no bbox_inches="tight": the pixel size stays fixed
    return path


def _integer_ticks(axis) -> None:
    axis.set_major_locator(MaxNLocator(integer=True))


def _layer_axis(axis, layers: tuple[int, ...], *, rows: bool = False) -> None:
    """Label ``axis`` with the model's layer indices: ``layers`` are the compressed layers (every
    layer, or the global layers of a hybrid model such as Gemma 3: 5, 11, 17, not 0, 1, 2). ``rows``:
    the axis counts image rows 0..L_g-1 (a heatmap), labelled with the layer each row is."""
    step = max(1, -(-len(layers) // 16))  # at most 16 labels
    at = list(range(0, len(layers), step))
    axis.set_ticks(at if rows else [layers[i] for i in at])
    axis.set_ticklabels([str(layers[i]) for i in at])
    hybrid = list(layers) != list(range(len(layers)))
    axis.set_label_text("layer (the model's compressed layers)" if hybrid else "layer")


def _as_ids(tokenizer, text: str | torch.Tensor) -> torch.Tensor:
    if isinstance(text, torch.Tensor):
        return text if text.dim() == 2 else text[None]
    if not isinstance(text, str) or not text.strip():
        raise ValueError("the prompt to inspect is empty")
    return tokenizer(text, return_tensors="pt").input_ids


def kept_mask(cache: KVCakeCache | CompressedContext, length: int | None = None, row: int = 0) -> np.ndarray:
    """(L_g, H_kv, length) bool: which of the first ``length`` positions (None: every token the cache
    has seen) each compressed layer (every layer, or the global layers of a hybrid) and KV head of
    sequence ``row`` holds. ``cache``: a KVCakeCache, or a compressed context (its cache)."""
    cache = cache.cache if isinstance(cache, CompressedContext) else cache
    if not isinstance(cache, KVCakeCache):
        raise TypeError(f"kept_mask reads a KVCakeCache or a compressed context, got {type(cache).__name__}")
    if not cache.prefilled:
        raise ValueError(
            "this KVCakeCache holds no prompt yet: read its kept entries once the prompt has run"
        )
    length = cache.get_seq_length() if length is None else length
    rows = []
    for layer in (cache.layers[lid] for lid in cache.compressed):
        pos = layer.padded_positions()[row].cpu()  # (H_kv, N), -1 = empty
        mask = torch.zeros(pos.shape[0], length + 1, dtype=torch.bool)  # host: pos is on the CPU
        mask.scatter_(1, torch.where((pos >= 0) & (pos < length), pos, length), True)
        rows.append(mask[:, :length].numpy())
    return np.stack(rows)


def _plot_budgets(cache: KVCakeCache, method: Method, length: int, path: Path) -> Path:
    budgets = cache.budgets[0].cpu().numpy()  # (L_g,)
    layers = np.array(cache.compressed)
    uniform = budgets.sum() / len(budgets)
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    tau = f" ({cache.tau.describe()})" if cache.tau else ""  # CAKE's temperatures and their source
    ax.bar(layers, budgets, color="tab:orange", label=f"{method.name}: chosen budget{tau}")
    ax.axhline(uniform, color="tab:blue", linestyle="--", label=f"uniform split ({uniform:.1f} per layer)")
    if length <= 1.5 * budgets.max():  # the cap matters only when it is close to the bars
        ax.axhline(length, color="grey", linestyle=":", label=f"prompt length ({length})")
    ax.set_ylabel("KV entries kept per KV head")
    ax.set_title(f"Per-layer budgets ('cake slices'): total {int(budgets.sum())} for {len(budgets)} layers, "
                 f"{method.budget.describe()}, {length}-token prompt")  # fmt: skip
    _layer_axis(ax.xaxis, cache.compressed)
    ax.legend(loc="upper right")
    return _save(fig, path)


def _plot_preferences(cache: KVCakeCache, path: Path) -> Path:
    entropy = np.array([float(e[0]) for e in cache.entropy])
    variance = np.array([float(v[0]) for v in cache.variance])
    layers = np.array(cache.compressed)
    fig = _figure()
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    ax1.plot(layers, entropy, marker="o", color="tab:green")
    ax1.set_ylabel("spatial dispersion H_l")
    ax1.ticklabel_format(axis="y", useOffset=False)
    ax1.set_title(f"Layer preferences of {cache.method.name} (window attention, sequence 0)")
    ax2.plot(layers, variance, marker="o", color="tab:purple")
    ax2.set_ylabel("temporal shift V_l")
    _layer_axis(ax2.xaxis, cache.compressed)
    return _save(fig, path)


def _plot_heads(cache: KVCakeCache, path: Path) -> Path:
    counts = cache.layer_counts()[0]  # (L, H_kv)
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(counts, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="entries kept")
    if counts.size <= 400:
        for (layer, head), value in np.ndenumerate(counts):
            ax.text(head, layer, str(int(value)), ha="center", va="center", color="white", fontsize=7)
    _integer_ticks(ax.xaxis)
    _layer_axis(ax.yaxis, cache.compressed, rows=True)
    ax.set_xlabel("KV head")
    ax.set_title(f"Per-head budgets of {cache.method.name} ({cache.method.budget.describe()})")
    return _save(fig, path)


def _plot_positions(runs: list[tuple[KVCakeCache, np.ndarray]], length: int, path: Path) -> Path:
    fig = _figure()
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (cache, kept) in zip(axes, runs, strict=True):
        share = kept.mean(1)  # (L, S) fraction of KV heads keeping each position
        im = ax.imshow(share, aspect="auto", cmap="Greys", vmin=0.0, vmax=1.0, interpolation="nearest")
        _layer_axis(ax.yaxis, cache.compressed, rows=True)
        ax.set_title(f"{cache.method.name}: kept positions ({kept.sum(-1).mean() / length:.0%} on average)")
    axes[-1].set_xlabel("prompt position")
    fig.colorbar(im, ax=list(axes), label="share of KV heads keeping the position")
    return _save(fig, path)


def check_head_adaptive(method: Method, what: str = "ada_method") -> None:
    """Refuse, as the per-head figure's method (``what``: the keyword or flag that gave it), one
    whose KV heads of a layer all keep the layer's budget (figure 3 would show one count per
    layer), naming the presets that allocate per head."""
    if not method.heads.ragged:
        ragged = ", ".join(name for name, parts in PRESETS.items() if parts[1] == "adakv")
        raise ValueError(
            f"{what} {method.name!r} gives every KV head of a layer the same budget, so the per-head "
            f"figure would show one count per layer: pick a head-adaptive method (heads=adakv: {ragged})"
        )


def inspect_prompt(
    model: torch.nn.Module,
    tokenizer,
    text: str | torch.Tensor,
    method: Method | str = "cake",
    *,
    budget: int | None = None,
    ratio: float | None = None,
    window: int = 32,
    out_dir: str | os.PathLike[str] = ".",
    ada_method: Method | str = "cake-adakv",
    scenario: str | Scenario | None = None,
    report: Callable[[str], None] | None = None,
) -> list[Path]:
    """Compress ``text`` and draw what the methods kept; returns the four PNG paths.

    Parameters
    ----------
    model, tokenizer:
        A causal LM and its tokenizer (``kvcake.load_model``).
    text:
        The prompt, as text (tokenised as is, special tokens added) or ids (S,) / (1, S).
    method:
        The method whose layer budgets and kept positions are drawn (figures 1, 2 and 4).
    budget, ratio, window:
        The budget of both runs (one of ``budget``/``ratio``, see ``BudgetSpec``).
    out_dir:
        Folder for the PNG files (created if needed).
    ada_method:
        The head-adaptive method for figure 3 (and the second panel of figure 4); one whose
        heads all keep their layer's budget (no ``heads=adakv``) is refused.
    scenario:
        Which set of calibrated CAKE temperatures the runs use: ``"question"`` (default: a
        prompt that ends with its question) or ``"context"`` (a document alone).
    report:
        Called with one line per run that resolved CAKE temperatures (which set, and why).

    Figure 2 needs CAKE's preferences: it uses the first of the two runs whose layer allocator
    computes them, or a third run of ``cake`` at the same budget.
    """
    scenario = Scenario.pick(scenario, "question", "inspect_prompt: a prompt that ends with its question")
    ids = _as_ids(tokenizer, text).to(next(model.parameters()).device)
    m = (
        method
        if isinstance(method, Method)
        else make_method(method, budget=budget, ratio=ratio, window=window)
    )
    spec = {"budget": m.budget.budget, "ratio": m.budget.ratio, "window": m.budget.window}
    ada = ada_method if isinstance(ada_method, Method) else make_method(ada_method, **spec)
    check_head_adaptive(ada)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    length = ids.shape[1]
    main_ctx = compress(model, ids[:1], m, scenario=scenario)
    ada_ctx = compress(model, ids[:1], ada, scenario=scenario)
    caches = [main_ctx.cache, ada_ctx.cache]
    pref = next((c for c in caches if c.entropy), None)
    if pref is None:
        logger.info(
            "neither %s nor %s computes layer preferences: running cake for figure 2", m.name, ada.name
        )
        pref = compress(model, ids[:1], make_method("cake", **spec), scenario=scenario).cache
    paths = [
        _plot_budgets(main_ctx.cache, m, length, out / FIGURES[0]),
        _plot_preferences(pref, out / FIGURES[1]),
        _plot_heads(ada_ctx.cache, out / FIGURES[2]),
        _plot_positions([(c, kept_mask(c, length)) for c in caches], length, out / FIGURES[3]),
    ]
    for c in caches:
        if report is not None and c.tau is not None:
            report(f"{c.method.name}: CAKE {c.tau.describe()}")
    logger.info("wrote %d figures to %s", len(paths), out)
    return paths
