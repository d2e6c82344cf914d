"""The inspection figures: four PNGs of a fixed pixel size, drawn from the cache's real state."""

from types import SimpleNamespace

import matplotlib.image
import numpy as np
import pytest
import torch

import kvcake
from kvcake.inspect import DPI, FIGSIZE, FIGURES, inspect_prompt, kept_mask

WIDTH, HEIGHT = int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI)


def ids(n, seed=0):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


class WordTokenizer:
    """Just enough tokenizer for ``inspect_prompt``: word ``wN`` is token N."""

    def __call__(self, text, return_tensors=None):
        return SimpleNamespace(input_ids=torch.tensor([[int(w[1:]) for w in text.split()]]))


def check_pngs(paths, folder):
    assert [p.name for p in paths] == list(FIGURES)
    for p in paths:
        assert p.parent == folder and p.stat().st_size > 1000
        image = matplotlib.image.imread(p)
        assert image.shape[:2] == (HEIGHT, WIDTH), p.name
        assert image[..., :3].std() > 0.01, f"{p.name} is blank"


def test_figures_from_text(tiny_llama, tmp_path):
    text = " ".join(f"w{i}" for i in ids(180)[0].tolist())
    paths = inspect_prompt(
        tiny_llama, WordTokenizer(), text, "cake", budget=24, window=8, out_dir=tmp_path / "figs"
    )
    check_pngs(paths, tmp_path / "figs")
    assert (WIDTH, HEIGHT) == (1200, 800)


def test_figures_for_methods_without_preferences(tiny_llama, tmp_path):
    """snapkv + adakv compute no CAKE preferences: figure 2 comes from an extra cake run."""
    paths = inspect_prompt(tiny_llama, None, ids(150, seed=1)[0], "snapkv", ratio=0.3, window=8, out_dir=tmp_path,
                           ada_method="adakv")  # fmt: skip
    check_pngs(paths, tmp_path)


def test_the_per_head_figure_needs_a_head_adaptive_method(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match=r"ada_method 'snapkv' gives every KV head.*heads=adakv: adakv, "):
        inspect_prompt(tiny_llama, None, ids(60)[0], "cake", budget=24, window=8, out_dir=tmp_path / "figs",
                       ada_method="snapkv")  # fmt: skip
    assert not (tmp_path / "figs").exists()  # refused before any run


@pytest.mark.parametrize("name", ["cake", "cake-adakv"])
def test_kept_mask_matches_cache(tiny_llama, name):
    cache = kvcake.compress(tiny_llama, ids(120, seed=2), name, budget=20, window=8).cache
    mask = kept_mask(cache, 120)  # (L, H_kv, S)
    assert np.array_equal(mask.sum(-1), cache.layer_counts()[0])
    assert mask[:, :, -8:].all(), "the window is always kept"


def test_kept_mask_of_a_context_and_its_refusals(tiny_llama):
    """A compressed context reads as its cache, and the length defaults to the tokens seen (the
    function the output_attentions warning names took only a cache and a length: a context failed
    with an AttributeError); a cache without its prompt, or another object, is refused."""
    ctx = kvcake.compress(tiny_llama, ids(120, seed=2), "adakv", budget=20, window=8)
    assert np.array_equal(kept_mask(ctx), kept_mask(ctx.cache, 120))
    with pytest.raises(ValueError, match="holds no prompt yet"):
        kept_mask(kvcake.KVCakeCache(tiny_llama, "snapkv", budget=20, window=8))
    with pytest.raises(
        TypeError, match="kept_mask reads a KVCakeCache or a compressed context, got NoneType"
    ):
        kept_mask(None)


def test_empty_prompt_is_an_error(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="empty"):
        inspect_prompt(tiny_llama, WordTokenizer(), "  ", budget=24, out_dir=tmp_path)


def test_hybrid_figures_name_the_models_layers(tiny_gemma3, tmp_path, monkeypatch):
    """Gemma 3 compresses its global layers only: every figure's layer axis reads their indices in
    the model (were 0, 1, ... for the compressed layers' order, naming sliding layers)."""
    from kvcake import inspect

    drawn = []
    monkeypatch.setattr(inspect, "_save", lambda fig, path: (drawn.append(fig), inspect.Path(path))[1])
    layers = kvcake.compress(tiny_gemma3, ids(120), "cake", budget=24, window=8).cache.compressed
    assert list(layers) != list(range(len(layers)))
    inspect_prompt(tiny_gemma3, None, ids(120)[0], "cake", budget=24, window=8, out_dir=tmp_path)
    axes = [
        axis
        for fig in drawn
        for ax in fig.axes
        for axis in (ax.xaxis, ax.yaxis)
        if axis.get_label_text().startswith("layer")
    ]
    assert len(axes) == 5  # budgets, preferences, heads, and both runs' kept positions
    for axis in axes:
        assert [t.get_text() for t in axis.get_ticklabels()] == [str(i) for i in layers]
