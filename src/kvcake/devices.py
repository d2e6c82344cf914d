"""Where a model's tensors live: the device of each layer and of its inputs.

A model may sit on one device or be split across several with accelerate's ``device_map``
(some layers on a GPU, others on the CPU). Each cache layer lives on its attention layer's
device (transformers hands it that layer's keys), so anything rebuilt outside a forward (a
loaded context) must go to the same place. Host bookkeeping (budgets, counts, CAKE's per-layer
preferences) stays on the CPU and is moved explicitly where it meets a layer's tensors.
"""

from __future__ import annotations

import torch


def _first_device(module: torch.nn.Module) -> torch.device | None:
    for t in module.parameters(recurse=True):
        return t.device
    for t in module.buffers(recurse=True):
        return t.device
    return None


def input_device(model: torch.nn.Module) -> torch.device:
    """The device the model's input ids go to: its input embedding's (the first layer of a split
    model), else its first parameter's."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    dev = _first_device(embed) if isinstance(embed, torch.nn.Module) else None
    return dev or _first_device(model) or torch.device("cpu")


def output_device(model: torch.nn.Module) -> torch.device:
    """The device the model's logits come out on: its output embedding's (the last layer of a
    split model), else the input device."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    dev = _first_device(head) if isinstance(head, torch.nn.Module) else None
    return dev or input_device(model)


def layer_devices(model: torch.nn.Module, num_layers: int) -> list[torch.device]:
    """(L,) the device of each attention layer, read off the modules that carry ``layer_idx``
    (transformers' attention modules). Layers not found fall back to the input device."""
    found: dict[int, torch.device] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and 0 <= idx < num_layers and idx not in found:
            dev = _first_device(module)
            if dev is not None:
                found[idx] = dev
    default = input_device(model)
    return [found.get(i, default) for i in range(num_layers)]
