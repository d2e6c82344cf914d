"""Device correctness without a GPU: a mistake that would mix devices on a GPU fails here.

Two checks: a source scan (every tensor factory in ``src/kvcake`` names its ``device=``, or is
marked host-side on purpose with a ``# host`` comment), and the core functions run on inputs on
the ``meta`` device, which refuses to mix with CPU tensors just as CUDA does.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvcake.allocators import AllocationRequest
from kvcake.allocators.adakv import AdaKV
from kvcake.devices import input_device, layer_devices, output_device
from kvcake.method import SCORERS
from kvcake.ragged import RaggedMeta, ragged_attention_reference
from kvcake.scorers import PrefillInputs
from kvcake.selectors import SelectionInputs, TopK, projected_value_norms
from kvcake.selectors.critical import Critical

SRC = Path(__file__).resolve().parents[1] / "src" / "kvcake"
# Factories that create a tensor (or RNG) on the default device unless told otherwise.
FACTORIES = {
    "arange", "zeros", "ones", "full", "empty", "tensor", "as_tensor", "linspace", "logspace", "eye",
    "randperm", "rand", "randn", "randint", "Generator", "from_numpy",
}  # fmt: skip
HOST_MARK = "# host"


def unplaced_factories(root: Path) -> list[str]:
    """``file:line call`` for each ``torch.<factory>(...)`` under ``root`` with no ``device=``,
    not moved by an immediate ``.to(...)`` and not marked ``# host`` on one of its lines or the
    line above."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        moved = {
            id(node.func.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "to"
            and node.args  # fmt: skip
        }
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            f = node.func
            if not (isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES):
                continue
            if any(k.arg == "device" for k in node.keywords) or id(node) in moved:
                continue
            marked = lines[max(node.lineno - 2, 0) : node.end_lineno]  # its lines and the one above
            if any(HOST_MARK in line for line in marked):
                continue
            found.append(f"{path.relative_to(root.parent)}:{node.lineno} torch.{f.attr}")
    return found


def test_every_tensor_factory_names_its_device():
    bad = unplaced_factories(SRC)
    assert not bad, (
        "tensor factories without device= (they land on the CPU next to GPU tensors); pass the "
        "device of the tensors they meet, or mark host bookkeeping with a '# host' comment:\n"
        + "\n".join(bad)
    )


def test_the_scan_can_fail(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "import torch\n"
        "a = torch.arange(3)\n"
        "b = torch.arange(3, device=x.device)\n"
        "c = torch.zeros(2)  # host: a count\n"
        "d = torch.tensor([1]).to(x.device)\n"
        "e = torch.full(\n    (2,),\n    1,\n)\n"
        "# host: bookkeeping\n"
        "f = torch.ones(2)\n"
        "g = torch.ones(2)\n"
    )
    assert unplaced_factories(pkg) == [
        "pkg/m.py:2 torch.arange",
        "pkg/m.py:6 torch.full",
        "pkg/m.py:12 torch.ones",
    ]


# -- the core functions on the meta device -------------------------------------------------------
META = torch.device("meta")


def meta_inputs(b=2, h=4, hkv=2, s=40, d=16, window=8) -> PrefillInputs:
    return PrefillInputs(
        query=torch.empty(b, h, s, d, device=META),
        keys=torch.empty(b, hkv, s, d, device=META),
        values=torch.empty(b, hkv, s, d, device=META),
        key_valid=torch.ones(b, s, dtype=torch.bool, device=META),
        window=window,
        scaling=d**-0.5,
    )


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_scorers_stay_on_the_inputs_device(name):
    inp = meta_inputs()
    scorer = SCORERS[name]()
    scores = scorer.prefill(inp)
    assert scores.device == META and scores.shape == (2, 2, 40)
    probs = torch.empty(2, 4, 1, 30, device=META)
    positions = torch.empty(2, 2, 30, dtype=torch.long, device=META)
    assert scorer.decode(probs, positions, torch.empty(2, 2, 30, device=META)).device == META


def test_window_attention_on_the_inputs_device():
    probs, row_valid = meta_inputs().window_attention()
    assert probs.device == META and row_valid.device == META and probs.shape == (2, 4, 8, 40)


def test_selection_and_head_budgets_on_the_inputs_device():
    scores = torch.empty(2, 2, 40, device=META)
    counts = torch.empty(2, 2, dtype=torch.long, device=META)
    assert TopK().select(SelectionInputs(scores, counts)).device == META
    norms = torch.empty(2, 2, 40, device=META)
    assert Critical().select(SelectionInputs(scores, counts, norms)).device == META
    budget = torch.empty(2, dtype=torch.long, device=META)
    assert AdaKV().counts(scores, budget, budget).device == META
    values = torch.empty(2, 2, 40, 16, device=META)
    assert projected_value_norms(values, torch.empty(64, 4 * 16, device=META), 4).device == META


def test_ragged_attention_on_the_inputs_device():
    lengths = torch.tensor([5, 7, 6, 9])
    meta = RaggedMeta.from_lengths(lengths)  # built on the host (repeat_interleave needs values)
    total = int(lengths.sum())
    out, _ = ragged_attention_reference(
        torch.empty(2, 4, 1, 16, device=META), torch.empty(total, 16, device=META),
        torch.empty(total, 16, device=META), torch.empty(total, dtype=torch.long, device=META),
        _meta_on(meta, META), torch.empty(2, 1, dtype=torch.long, device=META), 0.25,
    )  # fmt: skip
    assert out.device == META


def _meta_on(meta: RaggedMeta, device: torch.device) -> RaggedMeta:
    import dataclasses

    return dataclasses.replace(
        meta,
        **{
            f.name: getattr(meta, f.name).to(device)
            for f in dataclasses.fields(meta)
            if isinstance(getattr(meta, f.name), torch.Tensor)
        },  # fmt: skip
    )


def test_allocation_refuses_device_tensors():
    host = torch.tensor([100, 100])
    with pytest.raises(ValueError, match="preferences.*CPU"):
        AllocationRequest(
            host, host, host, 4, preferences=torch.empty(2, 4, device=META, dtype=torch.float64)
        )


def test_layer_devices_follow_each_layer(make_tiny_llama):
    model = make_tiny_llama()
    assert layer_devices(model, 4) == [torch.device("cpu")] * 4
    model.model.layers[2].to(META)  # stands for a layer placed on another device by device_map
    assert layer_devices(model, 4) == [torch.device("cpu")] * 2 + [META, torch.device("cpu")]
    assert input_device(model) == output_device(model) == torch.device("cpu")


def test_layer_devices_follow_accelerate_execution_devices(make_tiny_llama):
    """An offloaded layer (accelerate's ``dispatch_model`` with "cpu" entries and a GPU main device)
    keeps its weights on the meta device and runs on its hook's execution device: its cache goes
    there. Hooks stand in for accelerate's (the attribute it sets); a SequentialHook holds several."""
    model = make_tiny_llama()
    model.model.layers[1].to(META)
    model.model.layers[1]._hf_hook = SimpleNamespace(execution_device="cpu")  # offloaded, runs on the CPU
    model.model.layers[3]._hf_hook = SimpleNamespace(
        hooks=[SimpleNamespace(), SimpleNamespace(execution_device=META)]
    )
    model.model.embed_tokens._hf_hook = SimpleNamespace(execution_device=META)
    assert layer_devices(model, 4) == [torch.device("cpu")] * 3 + [META]
    assert input_device(model) == META
