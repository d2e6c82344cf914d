"""Per-step counts of a static decode step, the CPU proxies of issue 22 for a GPU step.

For every preset on a tiny random Llama (4 layers, 4 query / 2 KV heads, head dim 16; a
160-token prompt, budget 24): ATen ops per layer per step above transformers' DynamicCache,
host-synchronising ops per step beyond DynamicCache's, and the graphs
``torch.compile(model.forward, fullgraph=True)`` captures over ``steps`` single-token steps
(batch 1 and a left-padded batch of 2; a counting backend, so no inductor time).

    python -m kvcake.bench.step_counts [--steps 64] [--doc docs/step_counts.md]

Prints a Markdown table, or writes it as a page with the command that made it (``--doc``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import traceback
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from .. import PRESETS, KVCakeCache, enable, make_method
from ..adapters import with_cache

INTRO = (
    "Tiny random Llama (4 layers, 4 query / 2 KV heads, head dim 16), a 160-token prompt (20 tokens of "
    "left padding on row 2 of the batch of 2), budget 24, window 4, `KVCakeCache(..., static=True)`. "
    "ATen ops counted with `TorchDispatchMode` on the third single-token step; host-synchronising ops "
    "are `_local_scalar_dense`, `nonzero`, `masked_select` and indexing with a boolean mask, counted per step (DynamicCache's step has "
    "one: transformers reads the 2-D padding mask back to decide whether it may skip the mask, which "
    "it does not try for a compileable cache). Graphs: `torch.compile(model.forward, fullgraph=True)` with a "
    "counting backend over the decode steps, `max_cache_len` = prompt + steps (dynamo's default, "
    "`dynamic=None`), the 2-D padding mask passed in and grown by one column a step; the second graph "
    "is the recompile that makes that mask's length symbolic (transformers' StaticCache takes three "
    "graphs here; with the 4-D mask `generate` builds for a compileable cache instead, one column "
    "wide over static storage (`KVCakeCache.get_mask_sizes`), a kvcake step is one graph even with "
    "`dynamic=False`: `tests/test_compile.py`). Target (issue 22): 0 syncs, <= 30 extra "
    "ops per layer, <= 2 graphs."
)
# ``BOOLEAN_INDEX``: indexing with a boolean mask (``t[mask]``, ``t[mask] = v``), which dispatches
# one ``aten.index`` / ``aten.index_put_`` op that on a GPU runs ``nonzero`` inside (its output's
# size is read back); ``CountOps`` counts it under this name, so that it is not missed.
BOOLEAN_INDEX = "aten.index (boolean mask)"
SYNCING = frozenset(
    {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default", BOOLEAN_INDEX}
)
_INDEXING = (
    "aten.index.Tensor",
    "aten.index_put.default",
    "aten.index_put_.default",
    "aten._index_put_impl_.default",
)
PROMPT, BUDGET, WINDOW = 160, 24, 4


READS = ("item", "tolist", "__bool__", "cpu", "numpy", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def host_reads() -> Iterator[list[tuple[str, str]]]:
    """Reads of tensor values into Python inside the block (``READS``: ``.cpu()``, ``int(t)``, ...),
    as (method, call site) pairs, the site being the innermost kvcake frame (``file:line (function)``,
    or "" outside kvcake). On the CPU such a read dispatches no ATen op, so ``CountOps`` misses it; on a
    GPU each read of a device tensor drains the queue (reads of host tensors cost nothing there)."""
    calls: list[tuple[str, str]] = []
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, fn):
        def counted(t, *args, **kwargs):
            site = next((f"{f.filename.split('/kvcake/')[-1]}:{f.lineno} ({f.name})"
                         for f in reversed(traceback.extract_stack()[:-1]) if "/kvcake/" in f.filename), "")  # fmt: skip
            calls.append((name, site))
            return fn(t, *args, **kwargs)

        return counted

    try:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, wrap(name, fn))
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


class CountOps(TorchDispatchMode):
    """Counts the ATen ops dispatched inside the block, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in _INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        ):
            name = BOOLEAN_INDEX
        self.ops[name] += 1
        return func(*args, **(kwargs or {}))


class GraphCounter:
    """A torch.compile backend that runs each captured graph as is and counts them."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def tiny_llama(layers: int = 4) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        attn_implementation="sdpa",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    return model.eval()


def _prompt(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (batch, PROMPT), generator=torch.Generator().manual_seed(2))  # host
    mask = torch.ones_like(ids)
    mask[1:, :20] = 0  # left padding on every row but the first
    return ids, mask


def _cache(model, spec: str, max_cache_len: int | None = None) -> KVCakeCache:
    method = make_method(spec, budget=BUDGET, window=WINDOW)
    return KVCakeCache(model, method, static=True, max_cache_len=max_cache_len)


def step_ops(model, cache, batch: int = 1) -> Counter[str]:
    """ATen ops of the third single-token step after the prompt."""
    ids, mask = _prompt(batch)
    with enable(model), torch.no_grad():
        tok = model(ids, attention_mask=mask, **with_cache(model, cache)).logits[:, -1:].argmax(-1)
        for _ in range(3):
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            with CountOps() as counter:
                model(tok, attention_mask=mask, **with_cache(model, cache))
    return counter.ops


def compiled_graphs(model, spec: str, batch: int, steps: int) -> int:
    """Graphs captured over ``steps`` compiled single-token steps (fullgraph: a break raises)."""
    torch._dynamo.reset()
    counter = GraphCounter()
    step = torch.compile(model.forward, backend=counter, fullgraph=True)
    ids, mask = _prompt(batch)
    cache = _cache(model, spec, PROMPT + steps)
    with enable(model), torch.no_grad():
        tok = model(ids, attention_mask=mask, **with_cache(model, cache)).logits[:, -1:].argmax(-1)
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            out = step(
                tok, attention_mask=mask, **with_cache(model, cache), position_ids=mask.cumsum(-1)[:, -1:] - 1
            )
            tok = out.logits[:, -1:].argmax(-1)
    return counter.graphs


def table(steps: int = 64, specs: list[str] | None = None) -> str:
    model = tiny_llama()
    layers = model.config.num_hidden_layers

    def syncs(ops):
        return sum(v for k, v in ops.items() if k in SYNCING)

    base = {b: step_ops(model, DynamicCache(), b) for b in (1, 2)}
    rows = [
        "| preset | extra ATen ops per layer per step over DynamicCache (batch 1) | host-synchronising ops per step "
        f"(batch 1 / 2; DynamicCache: {syncs(base[1])} / {syncs(base[2])}) | graphs over {steps} compiled steps, fullgraph (batch 1 / 2) |",
        "| --- | --- | --- | --- |",
    ]
    for spec in specs or list(PRESETS):
        ops = {b: step_ops(model, _cache(model, spec), b) for b in (1, 2)}
        extra = (sum(ops[1].values()) - sum(base[1].values())) / layers
        sync = " / ".join(str(syncs(ops[b])) for b in (1, 2))
        graphs = " / ".join(str(compiled_graphs(model, spec, b, steps)) for b in (1, 2))
        rows.append(f"| {spec} | {extra:+.0f} | {sync} | {graphs} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--doc", help="write the table as a Markdown page here")
    parser.add_argument("specs", nargs="*", help="presets (default: all)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("kvcake").setLevel(logging.ERROR)
    text = table(args.steps, args.specs or None)
    if args.doc is None:
        print(text)  # noqa: T201 - the command's output
        return
    command = f"python -m kvcake.bench.step_counts --steps {args.steps} --doc {args.doc}"
    with open(args.doc, "w") as f:
        f.write(f"# Per-step counts of a static decode step\n\nGenerated by `{command}`. {INTRO}\n\n{text}\n")


if __name__ == "__main__":
    main()
