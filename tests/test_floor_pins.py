"""The versions `make test-floor` installs are the lowest ones pyproject.toml declares, so the
tested floor and the claimed floor cannot drift apart."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def declared_floors() -> dict[str, str]:
    """``name -> lowest version`` for every ``name>=x`` runtime dependency in pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    return dict(re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9][^,"]*)', deps))


def floor_pins() -> dict[str, str]:
    """What `make test-floor` pins, and torch's floor from `make test-torch-floor`."""
    makefile = (ROOT / "Makefile").read_text()
    line = re.search(r"^FLOOR_PINS := (.*)$", makefile, re.M).group(1)
    torch_floor = re.search(r"^TORCH_FLOOR := (.*)$", makefile, re.M).group(1)
    return dict(pin.split("==") for pin in [*line.split(), torch_floor])


def _same(a: str, b: str) -> bool:
    pad = lambda v: (v.split(".") + ["0", "0"])[:3]  # noqa: E731  "5.0" == "5.0.0"
    return pad(a) == pad(b)


def test_floor_pins_are_the_declared_floors():
    declared, pinned = declared_floors(), floor_pins()
    assert set(declared) == set(pinned), (declared, pinned)
    for name, version in pinned.items():
        assert _same(version, declared[name]), (
            f"{name}: make test-floor (torch: test-torch-floor) installs {version}, pyproject declares "
            f">={declared[name]}"
        )


def test_layer_serves_both_transformers_5_layer_apis():
    """transformers 5.0 asks a layer for ``get_max_cache_shape`` and passes ``cache_position`` to
    ``get_mask_sizes``; later 5.x ask for ``get_max_length`` and pass the query length."""
    import torch

    from kvcake.layer import KVCakeLayer

    layer = KVCakeLayer()
    kv = torch.zeros(1, 2, 3, 4)
    layer.update(kv, kv)
    assert layer.get_max_cache_shape() == layer.get_max_length() == -1
    assert layer.get_mask_sizes(torch.arange(3, 5)) == layer.get_mask_sizes(2) == (5, 0)
