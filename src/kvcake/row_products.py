"""A compiled CPU decode step's few-row products as fused reductions (an inductor graph pass).

A decode step multiplies one row per sequence (one token's hidden state) by every projection
weight: ``x @ w.T`` with ``x`` of shape (M, K), M the batch. On the CPU inductor hands those to
MKL, whose product read the default model's weights at 15-17 GB/s for one row, 9-11 for two and
10-13 for four to eight, on one thread or two, on the AMD host where ``x.sum()`` read 39-79
(``scripts/gemv_read.py --rows 1,2,4,8,16``, docs/benchmarks.md). Written as a multiply and a sum
over K per row instead, inductor generates one vectorised reduction that reads each weight row
once for all the rows: for one row 40-45 GB/s there, the output head included, against
``x.sum()``'s 44-80 in the same runs; on two threads 32-37 for two and four rows, 20-21 for
eight (MKL's 9-14), on one 21, 20 and 11 (MKL's 10-13); sixteen rows gain nothing, so the pass
stops at ``devices.MOST_ROWS``. The compiled floor step of the decode bench (SmolLM2, 16 tokens
cached, two threads) took 15.7 ms for a batch of two against 57.7 with MKL's products. torch's
own ``decompose_mm_pass`` handles one row, and only products up to 2048 wide (its limits are
read when inductor is imported), which leaves the output head (49152 wide for SmolLM2, 262144
for Gemma 3) to MKL; this pass has no width limit.

:data:`ROW_PRODUCTS` goes into ``torch.compile``'s options as inductor's
``post_grad_custom_pre_pass`` (:func:`compile_kwargs`), scoped to that compile. It
rewrites ``aten.mm(x, b)`` and ``aten.addmm(bias, x, b)`` where ``x`` is at most
``devices.MOST_ROWS`` rows on the CPU and ``b`` is a transposed weight (its K dimension
contiguous, so each output reads one weight row in order); every other product is left to MKL,
a batch whose size is symbolic among them (the step's batch is made static before that:
``devices.fix_batch``, except under ``torch.compile(dynamic=True)``).
"""

from __future__ import annotations

import torch
from torch._inductor import inductor_prims
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import devices

aten = torch.ops.aten


def _operands(node: torch.fx.Node) -> tuple | None:
    """(bias or None, rows, matrix) of a few-row product this pass rewrites, else None."""
    if node.kwargs:  # addmm's beta/alpha
        return None
    bias, row, mat = node.args if node.target is aten.addmm.default else (None, *node.args)
    rv, mv = row.meta.get("val"), mat.meta.get("val")
    if not isinstance(rv, torch.Tensor) or not isinstance(mv, torch.Tensor):
        return None
    if rv.device.type != "cpu" or rv.dim() != 2 or mv.dim() != 2:
        return None
    if not all(isinstance(n, int) for n in (*rv.shape, *mv.shape, *mv.stride())):
        return None
    if rv.shape[0] > devices.MOST_ROWS:
        return None
    if mv.shape[0] > 1 and mv.stride(0) != 1:  # K not contiguous: a reduction would read across rows
        return None
    return bias, row, mat


def _call(graph: torch.fx.Graph, target, *args) -> torch.fx.Node:
    """A new node of ``target`` on ``args``, with the metadata inductor's lowering reads (its value
    computed on the fake tensors of the nodes among ``args``, under their fake mode)."""
    node = graph.call_function(target, args)
    node.meta["val"] = target(*torch.fx.node.map_arg(args, lambda a: a.meta["val"]))
    return node


def _stored(graph: torch.fx.Graph, rows: torch.fx.Node) -> torch.fx.Node:
    """``rows`` computed once into a buffer of its own (inductor's ``force_stride_order`` with the
    strides it has: a copy where they are not yet fixed, fused into the op that makes them). Left
    to itself inductor inlines the pointwise ops that make a product's rows (an RMSNorm: add,
    scale by the root mean square, weight) into the reduction, which then computes them again for
    every output column (every weight row). On an AMD host with 8 MiB of L3 (``x.sum()`` 22 GB/s,
    two threads) the output head's reduction of a batch of four, the final norm inside its loop
    over 49152 columns, took 45 ms a step under the profiler (its 113 MB of weights take 5 at that
    rate); stored, the compiled floor step (16 tokens cached) took 56.6 ms for a batch of four
    against 116.9 inlined, 46.2 against 54.4 for two, 40.0 against 40.5 for one
    (``scripts/gemv_read.py --threads 2 --batches 1,2,4 --inlined`` compares them)."""
    return _call(graph, inductor_prims.force_stride_order, rows, list(rows.meta["val"].stride()))


class RowProducts(CustomGraphPass):
    """Rewrites each few-row product (see the module) as one reduction per row,
    ``sum(x[i:i+1, :, None] * b[None], 1)``, the rows' results concatenated (+ bias), in the graph
    inductor lowers after its post-grad passes begin. Inductor fuses the rows' reductions into one
    loop that reads each weight row once for all of them (one reduction over an (M, K, N) product
    reads the weights once per row instead: 18-20 GB/s for four rows on the AMD host against 29-33
    so). ``rewritten`` counts the products rewritten in this process, on the class (a diagnostic
    for tests: inductor runs a copy of the instance it is given)."""

    rewritten = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        nodes = [*graph.find_nodes(op="call_function", target=aten.mm.default),
                 *graph.find_nodes(op="call_function", target=aten.addmm.default)]  # fmt: skip
        for node in nodes:
            found = _operands(node)
            if found is None:
                continue
            bias, rows, mat = found
            with graph.inserting_before(node), rows.meta["val"].fake_mode:
                rows = _stored(graph, rows)
                wide = _call(graph, aten.unsqueeze.default, mat, 0)  # (1, K, N)
                outs = []
                for i in range(rows.meta["val"].shape[0]):
                    row = _call(graph, aten.slice.Tensor, rows, 0, i, i + 1)  # (1, K)
                    prod = _call(graph, aten.mul.Tensor, _call(graph, aten.unsqueeze.default, row, 2), wide)
                    outs.append(_call(graph, aten.sum.dim_IntList, prod, [1]))  # (1, N)
                done = outs[0] if len(outs) == 1 else _call(graph, aten.cat.default, outs)  # (M, N)
                if bias is not None:
                    done = _call(graph, aten.add.Tensor, done, bias)
            node.replace_all_uses_with(done)
            graph.erase_node(node)
            RowProducts.rewritten += 1

    def uuid(self) -> bytes:
        """Inductor's caches key on this: the pass's code and its reach (``devices.MOST_ROWS``, which a
        caller may change)."""
        return get_hash_for_files((__file__,)) + str(devices.MOST_ROWS).encode()


# One instance: compile configs that hold it compare equal (transformers compiles again when a
# call's CompileConfig differs from its last one).
ROW_PRODUCTS = RowProducts()


def compile_kwargs(model: torch.nn.Module) -> dict:
    """``torch.compile``'s ``mode`` and ``options`` for a decode step of ``model`` (beside
    ``fullgraph``): where all its weights are on the CPU, the step's products (every projection,
    one row per sequence of a batch of up to eight) as fused reductions (this module's pass:
    MKL's own read SmolLM2's weights at 15-17 GB/s for one row and 9-11 for two on the AMD host,
    the fused ones at 40-45 and 33), given to inductor as its custom post-grad pass; elsewhere
    nothing (the caller's defaults: CUDA graphs stay). Inductor takes options or a mode, not both."""
    if {p.device.type for p in model.parameters()} != {"cpu"}:
        return {}
    return dict(mode=None, options={"post_grad_custom_pre_pass": ROW_PRODUCTS})
