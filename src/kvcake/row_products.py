"""A compiled CPU decode step's one-row products as fused reductions (an inductor graph pass).

A decode step multiplies one row (one token's hidden state) by every projection weight: ``x @
w.T`` with ``x`` of shape (1, K). On the CPU inductor hands those to MKL, whose one-row product read
the default model's weights at 15-17 GB/s on one thread or two on the AMD host where ``x.sum()``
read 44-79 (``scripts/gemv_read.py``, docs/benchmarks.md). Written as a multiply and a sum over K
instead, inductor generates one vectorised reduction that reads each weight row once: 41-45 GB/s
there for all of them, the output head included, against ``x.sum()``'s 44-52 in the same runs.
torch's own ``decompose_mm_pass`` does this only for products up to 2048 wide (its limits are read
when inductor is imported), which leaves the output head (49152 wide for SmolLM2, 262144 for
Gemma 3) to MKL; this pass has no width limit.

:data:`ONE_ROW_PRODUCTS` goes into ``torch.compile``'s options as inductor's
``post_grad_custom_pre_pass`` (``kvcake.devices.compile_kwargs``), scoped to that compile. It
rewrites ``aten.mm(x, b)`` and ``aten.addmm(bias, x, b)`` where ``x`` is one row on the CPU and
``b`` is a transposed weight (its K dimension contiguous, so each output reads one weight row in
order); every other product is left to MKL.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

aten = torch.ops.aten


def _operands(node: torch.fx.Node) -> tuple | None:
    """(bias or None, row, matrix) of a one-row product this pass rewrites, else None."""
    if node.kwargs:  # addmm's beta/alpha
        return None
    bias, row, mat = node.args if node.target is aten.addmm.default else (None, *node.args)
    rv, mv = row.meta.get("val"), mat.meta.get("val")
    if not isinstance(rv, torch.Tensor) or not isinstance(mv, torch.Tensor):
        return None
    if rv.device.type != "cpu" or rv.dim() != 2 or mv.dim() != 2:
        return None
    if not all(isinstance(n, int) for n in (*rv.shape, *mv.shape, *mv.stride())) or rv.shape[0] != 1:
        return None
    if mv.shape[0] > 1 and mv.stride(0) != 1:  # K not contiguous: a reduction would read across rows
        return None
    return bias, row, mat


class OneRowProducts(CustomGraphPass):
    """Rewrites each one-row product (see the module) as ``sum(x[:, :, None] * b[None], 1)`` (+
    bias), in the graph inductor lowers after its post-grad passes begin. ``rewritten`` counts the
    products rewritten in this process, on the class (a diagnostic for tests: inductor runs a copy
    of the instance it is given)."""

    rewritten = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        nodes = [*graph.find_nodes(op="call_function", target=aten.mm.default),
                 *graph.find_nodes(op="call_function", target=aten.addmm.default)]  # fmt: skip
        for node in nodes:
            found = _operands(node)
            if found is None:
                continue
            bias, row, mat = found
            rv, mv = row.meta["val"], mat.meta["val"]
            with graph.inserting_before(node):
                r3 = graph.call_function(aten.unsqueeze.default, (row, 2))  # (1, K, 1)
                m3 = graph.call_function(aten.unsqueeze.default, (mat, 0))  # (1, K, N)
                prod = graph.call_function(aten.mul.Tensor, (r3, m3))
                out = graph.call_function(aten.sum.dim_IntList, (prod, [1]))  # (1, N)
                done = out if bias is None else graph.call_function(aten.add.Tensor, (out, bias))
            with rv.fake_mode:  # the new nodes' metadata, as inductor's lowering reads it
                r3.meta["val"], m3.meta["val"] = rv.unsqueeze(2), mv.unsqueeze(0)
                prod.meta["val"] = r3.meta["val"] * m3.meta["val"]
                out.meta["val"] = prod.meta["val"].sum(1)
                if bias is not None:
                    done.meta["val"] = out.meta["val"] + bias.meta["val"]
            node.replace_all_uses_with(done)
            graph.erase_node(node)
            OneRowProducts.rewritten += 1

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


# One instance: compile configs that hold it compare equal (transformers compiles again when a
# call's CompileConfig differs from its last one).
ONE_ROW_PRODUCTS = OneRowProducts()
