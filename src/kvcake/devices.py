"""Where a model's tensors live: the device of each layer and of its inputs.

A model may sit on one device or be split across several with accelerate's ``device_map``
(some layers on a GPU, others on the CPU). Each cache layer lives on its attention layer's
device (transformers hands it that layer's keys), so anything rebuilt outside a forward (a
loaded context) must go to the same place. Host bookkeeping (budgets, counts, CAKE's per-layer
preferences) stays on the CPU and is moved explicitly where it meets a layer's tensors.

``check_device`` is the one place that turns "this device is not here" into one line a user can
act on (the device, what torch was built with, the fix), for the API and every command.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator

import torch

# Whether CPU tensors take the CPU-only fast paths (H2O's unshifted blocks, DefensiveKV's blocked
# aggregation, CriticalKV's small norm chunks: loops and host checks that a GPU would pay for in
# launches and waits). False sends them down the route a GPU takes, so that ATen ops and syncs
# counted on the CPU stand for a GPU's (scripts/prefill_counts.py, the sync-count tests).
CPU_ROUTES = True

# The widest decoding batch whose products a compiled CPU step fuses (``kvcake.row_products``,
# which reads it here; sixteen rows read no faster than MKL's product on the AMD host).
MOST_ROWS = 8


def cpu_route(device: torch.device) -> bool:
    """Whether a tensor on ``device`` takes a CPU-only fast path (see ``CPU_ROUTES``)."""
    return device.type == "cpu" and CPU_ROUTES


def fix_batch(states: torch.Tensor) -> None:
    """Inside a compiled step on the CPU, a batch of ``states`` (B, ...) of at most
    :data:`MOST_ROWS` sequences made a constant of the graph (dynamo's ``mark_static`` inside a
    trace: a guard on the size, a graph per batch size). Dynamo's automatic dynamic shapes make the
    batch symbolic once a process has compiled the step for another size (an eight-question
    ``kvcake.answer`` with ``batch_size=3`` ends on a batch of two), and its graph then serves
    every later batch of two or more, the sizes compiled before it included (dynamo keeps sizes 0
    and 1 apart): products of a symbolic row count are left to MKL (``kvcake.row_products``), a
    batch of two's compiled floor step 57.7 ms against 15.7 fused. Under
    ``torch.compile(dynamic=True)`` (dynamo does not assume static sizes) the batch stays as the
    caller asked; wider batches too (their products are MKL's either way)."""
    if (
        torch.compiler.is_compiling()
        and states.device.type == "cpu"
        and torch._dynamo.config.assume_static_by_default
        and states.shape[0] <= MOST_ROWS
    ):
        torch._dynamo.mark_static(states, 0)


def may_mask(mask: torch.Tensor) -> bool:
    """Whether a boolean mask has to be applied: always off the CPU route (checking would
    synchronise the device), else only if it holds a False (a host check, free on the CPU)."""
    return not cpu_route(mask.device) or not bool(mask.all())


def owned(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``, or a copy of it where it is a view into a larger storage, so that a cache holds
    what it counts (``kv_bytes``): a fused projection's keys or values (Phi-3's ``qkv_proj``
    output), the window transformers' sliding layer keeps as a slice of the whole prompt, the
    first rows of a buffer. Left as is while compiling (the static layouts own their storage)."""
    if t is None or torch.compiler.is_compiling():
        return t
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def cache_kv_bytes(cache, storage: bool = True) -> int:
    """Bytes of keys and values any transformers ``Cache`` holds now: each layer's ``kv_bytes()``
    where it counts its own (kvcake's layers: static storage and the ring's slots included, as
    ``KVCakeCache.kv_bytes``), else the storage behind its ``keys``/``values``, each storage once
    (a ``DynamicCache``'s: its sliding layer keeps the last ``window - 1`` entries as a slice of
    the whole prompt until its next update, so right after the prompt it holds the prompt's bytes);
    ``storage=False``: their elements' bytes (such a slice at its size, as held once decoding)."""
    total, held = 0, {}
    for layer in cache.layers:
        if callable(getattr(layer, "kv_bytes", None)):
            total += layer.kv_bytes()
            continue
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if not isinstance(t, torch.Tensor):
                continue
            at = t.untyped_storage().data_ptr()  # (0: a meta tensor's storage, counted by its elements)
            if storage and at:
                held[(t.device, at)] = t.untyped_storage().nbytes()
            else:
                total += t.numel() * t.element_size()
    return total + sum(held.values())


def storage_bytes(obj) -> int:
    """Bytes of the storages behind every tensor ``obj`` holds (its attributes' values: tensors,
    and tensors inside tuples, lists, dicts and dataclasses), each storage once however many
    tensors view it (a meta tensor's by its elements)."""
    held: dict = {}

    def visit(x) -> None:
        if isinstance(x, torch.Tensor):
            at = x.untyped_storage().data_ptr()
            key = (x.device, at) if at else ("elements", id(x))
            held[key] = x.untyped_storage().nbytes() if at else x.numel() * x.element_size()
        elif isinstance(x, tuple | list):
            for y in x:
                visit(y)
        elif isinstance(x, dict):
            for y in x.values():
                visit(y)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                visit(getattr(x, f.name))

    for value in vars(obj).values():
        visit(value)
    return sum(held.values())


class HostRead:
    """A small device tensor's copy to the host, started now and waited for at :meth:`wait`.

    On CUDA the copy goes into pinned memory behind the work queued so far and ``wait`` blocks
    only until the device gets there, not until the whole queue drains (as ``.cpu()`` does): the
    host can queue more work in between, and its work after ``wait`` overlaps what it queued.
    CAKE's per-layer statistics are read so, one layer later (``cascade.prefill_stage``).
    Elsewhere the copy is made at once (a CPU tensor is its own host copy)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event = None
        if tensor.device.type != "cuda":  # the CPU's own tensor as is; another device's copied now
            self.host = tensor if tensor.device.type == "cpu" else tensor.cpu()
            return
        with torch.cuda.device(tensor.device):
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)  # host
            self.host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> torch.Tensor:
        """The host copy, once the device has written it."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self.host


def read_through(steps: Generator, answer: int | None = None):
    """The result of ``steps``, a generator that yields device scalars for the host to read and is
    sent back each as an int, every read made at once (one drain each on a GPU). ``answer``: the
    int for the read it has already asked for (read later, e.g. through a :class:`HostRead`);
    None: it has not started."""
    try:
        ask = next(steps) if answer is None else steps.send(answer)
        while True:
            ask = steps.send(int(ask))
    except StopIteration as done:
        return done.value


_GET_TORCH = "https://pytorch.org/get-started/locally/"
_ON_CPU = "or run on the CPU (--device cpu, device='cpu')"


def _cuda_problem(device: torch.device) -> str | None:
    built = torch.version.cuda or getattr(torch.version, "hip", None)
    if built is None:
        return (f"this torch {torch.__version__} was built without CUDA: install a CUDA build of torch "
                f"({_GET_TORCH}) {_ON_CPU}")  # fmt: skip
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return (f"torch {torch.__version__} was built with CUDA {built} but sees no GPU: check the driver "
                f"(nvidia-smi) and CUDA_VISIBLE_DEVICES, {_ON_CPU}")  # fmt: skip
    if device.index is not None and device.index >= count:
        return (f"torch {torch.__version__} (CUDA {built}) sees {count} GPU(s), cuda:0 to cuda:{count - 1}: "
                f"pick one of them {_ON_CPU}")  # fmt: skip
    return None


def _mps_problem(device: torch.device) -> str | None:
    if torch.backends.mps.is_available():
        return None
    if not torch.backends.mps.is_built():
        return f"this torch {torch.__version__} was built without MPS (Apple GPUs only): {_ON_CPU[3:]}"
    return f"torch {torch.__version__} has MPS but this machine offers none (macOS 12.3+ on Apple silicon), {_ON_CPU}"


def _other_problem(device: torch.device) -> str | None:
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or available():
        return None
    return f"this torch {torch.__version__} has no usable {device.type} device: install a build with it {_ON_CPU}"


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, checked to exist in this process.

    Raises
    ------
    TypeError
        ``device`` is neither a str nor a ``torch.device``.
    ValueError
        The name is not a device, or the device is absent: one line naming the device, what this
        torch was built with and the fix (instead of torch's ``AssertionError: Torch not compiled
        with CUDA enabled`` on first use).
    """
    if not isinstance(device, str | torch.device):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"invalid device {device!r}: {' '.join(str(exc).split())}") from exc
    if dev.type in ("cpu", "meta"):
        return dev
    checks = {"cuda": _cuda_problem, "mps": _mps_problem}
    problem = checks.get(dev.type, _other_problem)(dev)
    if problem is not None:
        raise ValueError(f"device {str(dev)!r} is not available: {problem}")
    return dev


def _hook_device(module: torch.nn.Module) -> torch.device | None:
    """The device accelerate runs ``module`` on (its hook's ``execution_device``), if it has a hook:
    an offloaded module's weights sit on the meta device and are brought there for each call."""
    hook = getattr(module, "_hf_hook", None)
    for h in [hook, *getattr(hook, "hooks", ())]:  # a SequentialHook holds several
        dev = getattr(h, "execution_device", None)
        if dev is not None:
            return torch.device("cuda", dev) if isinstance(dev, int) else torch.device(dev)
    return None


def _first_device(module: torch.nn.Module) -> torch.device | None:
    dev = _hook_device(module)
    if dev is not None:
        return dev
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


def _text_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The module holding the text layers (``get_decoder``: a vision-language model's language
    model), or ``model`` itself where it names none."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):  # a plain module, or a bespoke wrapper
        return model
    return decoder if isinstance(decoder, torch.nn.Module) else model


def layer_devices(model: torch.nn.Module, num_layers: int) -> list[torch.device]:
    """(L,) the device of each attention layer, read off the modules that carry ``layer_idx``
    (transformers' attention modules): where accelerate runs it (the execution device of its
    nearest hooked ancestor: offloaded layers hold their weights on the meta device), else its
    weights' device. Layers not found fall back to the input device. Only the text decoder's
    modules count: a vision tower's layers carry a ``layer_idx`` of their own (Gemma 4's)."""
    found: dict[int, torch.device] = {}
    hooked: dict[str, torch.device] = {}  # accelerate's execution device of each hooked module
    text = {id(m) for m in _text_decoder(model).modules()}
    for name, module in model.named_modules():
        dev = _hook_device(module)
        if dev is not None:
            hooked[name] = dev
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and 0 <= idx < num_layers and idx not in found and id(module) in text:
            # the nearest hooked ancestor decides where the layer runs (its weights may be on meta)
            owners = [n for n in hooked if name == n or name.startswith(n + ".") or n == ""]
            dev = hooked[max(owners, key=len)] if owners else _first_device(module)
            if dev is not None:
                found[idx] = dev
    default = input_device(model)
    return [found.get(i, default) for i in range(num_layers)]
