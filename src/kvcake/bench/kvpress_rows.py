"""kvpress's presses beside kvcake's presets in ``kvcake bench gpu`` (``--kvpress``).

kvpress (NVIDIA's library) compresses the prompt's cache inside a context manager that hooks
the model's attention layers: ``with press(model): model(ids, past_key_values=DynamicCache())``.
A row ``kvpress:<preset>`` is the press that implements ``<preset>`` (:data:`PRESSES`), prefilled
that way into a ``DynamicCache`` and decoded with it, timed and measured as every other row of
the run: the same random model, prompt, rounds, memory probe and decode loop.

The press is told the same budget: kvpress's ``compression_ratio`` is the fraction of the prompt
*removed* and it keeps ``int(length * (1 - ratio))`` entries, so the ratio is
``1 - (budget + 0.25) / length``: exactly ``budget`` kept whatever the float rounding, by the
presses that truncate (``int``) and by PyramidKV's, which rounds (``round``) where it falls back to
uniform budgets (with ``+ 0.5`` it kept one more entry at odd budgets: ``round(519.5)`` is 520); its
SnapKV-family presses observe the run's ``window`` last queries (kvpress's ``window_size``).
What differs, and the page says: kvpress compresses the prompt only (a preset with
``decode=fixed`` also evicts while decoding, a press's cache grows by one entry a step); its
Ada-KV presses keep the whole prompt in the cache and mask the entries they drop (kvpress: "does
not reduce peak memory"); importing kvpress wraps every attention function transformers has
registered (``kvpress.attention_patch``), the other rows of the run included (so kvpress is
imported when the settings are made, before kvcake registers its attention: wrapped, kvcake's
would be called with dropout where it takes scaling), and leaves the entries to mask on the
model's modules after a row (:func:`forget_masks`). kvpress 0.5
requires transformers < 5.3: install it in an environment of its own (``pip install kvpress==0.5.5``)
and run the bench there with this repository on ``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib

PREFIX = "kvpress:"

# kvcake preset -> (kvpress press, the scorer press it wraps or None)
PRESSES: dict[str, tuple[str, str | None]] = {
    "streamingllm": ("StreamingLLMPress", None),
    "snapkv": ("SnapKVPress", None),
    "pyramidkv": ("PyramidKVPress", None),
    "tova": ("TOVAPress", None),
    "criticalkv": ("CriticalKVPress", "SnapKVPress"),
    "adakv": ("AdaKVPress", "SnapKVPress"),
    "critical-adakv": ("CriticalAdaKVPress", "SnapKVPress"),
}
WINDOWED = ("SnapKVPress", "PyramidKVPress")  # the presses that take a ``window_size``


def check_presets(presets) -> tuple[str, ...]:
    """``presets`` (names of kvcake presets) as a tuple, each one kvpress implements, and kvpress
    importable where there are any: refused before any model is built."""
    presets = tuple(presets)
    unknown = [p for p in presets if p not in PRESSES]
    if unknown:
        raise ValueError(
            f"--kvpress: no kvpress press implements {', '.join(unknown)}; choose among {', '.join(PRESSES)}"
        )
    if presets:
        _kvpress()
    return presets


def row_name(preset: str) -> str:
    return PREFIX + preset


def is_press_row(name: str) -> bool:
    return name.startswith(PREFIX)


def _kvpress():
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ..attention import PREFIX as KVCAKE_ATTENTION

    registered = [name for name, _ in ALL_ATTENTION_FUNCTIONS.items()]  # (as kvpress reads them)
    if "kvpress" not in sys.modules and any(n.startswith(KVCAKE_ATTENTION) for n in registered):
        # kvpress's import wraps every registered attention function with one that passes dropout
        # where kvcake's (transformers' eager order) takes scaling: kvcake's rows would fail
        raise ValueError(
            "kvpress must be imported before kvcake enables a model (its import wraps the attention functions "
            "registered then, kvcake's included, with a call kvcake's does not take): import kvpress first, as "
            "kvcake bench gpu --kvpress does"
        )
    try:
        import kvpress
    except ImportError as err:
        raise ValueError(
            "kvpress's presses (bench --kvpress, eval's kvpress: methods) need the kvpress package, which is "
            "not installed here: kvpress 0.5 requires transformers < 5.3, so install it in an environment of "
            "its own (python -m venv; pip install kvpress) and run from there with PYTHONPATH=src "
            "(README: kvcake beside kvpress)"
        ) from err
    return kvpress


def make_press(name: str, *, budget: int, length: int, window: int):
    """The kvpress press of row ``name`` (``kvpress:<preset>``) keeping ``budget`` of ``length``
    prompt entries per head (per layer on average, for PyramidKV's and Ada-KV's allocations)."""
    kvpress = _kvpress()
    press_name, scorer_name = PRESSES[name[len(PREFIX) :]]
    ratio = 1 - (budget + 0.25) / length  # int() and round() of length * (1 - ratio): exactly budget

    def build(cls_name: str, **kwargs):
        if cls_name in WINDOWED:
            kwargs["window_size"] = window
        return getattr(kvpress, cls_name)(**kwargs)

    if scorer_name is None:
        return build(press_name, compression_ratio=ratio)
    return build(press_name, press=build(scorer_name, compression_ratio=ratio))


@contextlib.contextmanager
def press_context(model, name: str, *, budget: int, length: int, window: int):
    """Row ``name``'s press on ``model`` (:func:`make_press`), its masks forgotten before and after."""
    press = make_press(name, budget=budget, length=length, window=window)
    forget_masks(model)
    try:
        with press(model):
            yield
    finally:
        forget_masks(model)


def forget_masks(model) -> None:
    """kvpress's Ada-KV presses leave the entries to mask on each attention module
    (``masked_key_indices``), and its patch applies them to any later call with fewer queries than
    keys: another row's decode steps, with another cache (measured: kvcake's ``adakv`` after
    ``kvpress:adakv`` failed in kvpress's ``search_hyperplane``)."""
    for module in model.modules():
        if getattr(module, "masked_key_indices", None) is not None:
            module.masked_key_indices = None


def release() -> str | None:
    """The release of the kvpress module in use, recorded with the runs that used it (the bench's
    machine, each eval cell); None where that module was not loaded from a package (the tests'
    stand-in, even beside an installed kvpress) or the package has no metadata."""
    import sys
    from importlib.metadata import PackageNotFoundError, version

    if getattr(sys.modules.get("kvpress"), "__file__", None) is None:
        return None
    try:
        return version("kvpress")
    except PackageNotFoundError:
        return None


def describe(presets, version: str | None) -> str:
    """The page's paragraph on the ``kvpress:`` rows of a run (``render_page`` adds it only when it had
    some); ``version``: the run's kvpress (:func:`release`, kept in the run's machine)."""
    named = f"kvpress {version}" if version else "kvpress (version unknown)"
    pairs = ", ".join(
        f"`{row_name(p)}` {PRESSES[p][0]}" + (f"({PRESSES[p][1]})" if PRESSES[p][1] else "") for p in presets
    )
    return (
        f"Rows `kvpress:<preset>` are {named}'s press for that preset ({pairs}), told the same budget "
        "(`compression_ratio` = 1 - (budget + 0.25) / length, so that it keeps exactly the budget; the "
        "SnapKV-family presses' `window_size` = the window), "
        "prefilled inside the press into a DynamicCache (the full cache's SDPA backend) and decoded with that "
        "cache, never compiled. kvpress compresses the prompt only: its caches grow by one entry a decode step "
        "where a `decode=fixed` preset evicts back to its budget; its Ada-KV presses keep the whole prompt "
        "in the cache and mask what they drop. Importing kvpress wrapped every attention function "
        "transformers had registered, for every row of this run (`kvcake.bench.kvpress_rows`)."
    )
