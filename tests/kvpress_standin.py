"""A stand-in for the kvpress module, for the tests of kvcake's kvpress rows (the bench's and the
eval's): kvpress is not among the development requirements (0.5 requires transformers < 5.3).

Each press class of ``kvcake.bench.kvpress_rows.PRESSES`` is a ``StandinPress``: it keeps the keyword
arguments it was built with, and inside ``press(model)`` the prompt's forward (into an empty cache)
leaves the cache holding its last ``int(length * (1 - compression_ratio))`` entries, or all of them
where ``keep_all``.
"""

from __future__ import annotations

import contextlib
import sys
import types

from transformers import Cache

from kvcake.bench.kvpress_rows import PRESSES


class StandinPress:
    keep_all = False

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs

    @property
    def ratio(self) -> float:
        inner = self.kwargs.get("press")
        return inner.ratio if inner is not None else self.kwargs["compression_ratio"]

    @contextlib.contextmanager
    def __call__(self, model):
        def crop(module, args, kwargs, output):
            cache = next(
                v for v in kwargs.values() if isinstance(v, Cache)
            )  # (its keyword: adapters.with_cache)
            ids = kwargs.get("input_ids", args[0] if args else None)
            if (
                cache.get_seq_length() == ids.shape[1] and not self.keep_all
            ):  # the prompt, into an empty cache
                keep = int(ids.shape[1] * (1 - self.ratio))
                for layer in cache.layers:  # copies, as kvpress's gather(...).contiguous() makes
                    layer.keys, layer.values = (
                        layer.keys[:, :, -keep:].clone(),
                        layer.values[:, :, -keep:].clone(),
                    )
            return output

        handle = model.register_forward_hook(crop, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()


def install(monkeypatch) -> types.ModuleType:
    """Put the stand-in module in ``sys.modules`` as ``kvpress`` for one test (``monkeypatch``)."""
    module = types.ModuleType("kvpress")
    for press, scorer in PRESSES.values():
        for name in (press, scorer):
            if name:
                setattr(module, name, type(name, (StandinPress,), {}))
    monkeypatch.setitem(sys.modules, "kvpress", module)
    return module
