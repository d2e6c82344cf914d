"""``kvcake methods``: list the presets with their parts and defaults."""

from __future__ import annotations

import argparse

from .options import DEFAULT_BUDGET


def _configure_methods(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", action="store_true", help="also list the parts a spec can combine")


def _part_defaults(method) -> str:
    import dataclasses

    out = []
    for key, part in (("layers", method.layers), ("heads", method.heads), ("score", method.scorer),
                      ("select", method.selector)):  # fmt: skip
        fields = [f for f in dataclasses.fields(part) if f.init] if dataclasses.is_dataclass(part) else []
        if fields:
            values = ", ".join(f"{f.name}={'auto' if getattr(part, f.name) is None else getattr(part, f.name)}"
                               for f in fields)  # fmt: skip
            out.append(f"{key}({values})")
    return " ".join(out)


def _run_methods(args: argparse.Namespace) -> int:
    from ..method import HEAD_ALLOCATORS, LAYER_ALLOCATORS, SCORERS, SELECTORS, list_methods, make_method
    from ..temperatures import describe_resolution

    rows = list_methods()
    width = max(len(name) for name, _ in rows)
    for name, desc in rows:
        defaults = _part_defaults(make_method(name, budget=DEFAULT_BUDGET))
        print(f"{name:<{width}}  {desc}" + (f"  defaults: {defaults}" if defaults else ""))
    print(f"{'full':<{width}}  every entry kept: the uncompressed baseline, to compare answers with")
    print(f"\n{describe_resolution()}")
    if args.parts:
        for key, registry in (("layers", LAYER_ALLOCATORS), ("heads", HEAD_ALLOCATORS), ("score", SCORERS),
                              ("select", SELECTORS)):  # fmt: skip
            print(f"{key}=: {', '.join(registry)}")
        print("decode=: none, fixed")
    return 0
