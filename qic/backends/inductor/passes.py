"""Graph passes qic adds to inductor's post-grad pipeline (CPU graphs).

Why: on the CPU an `addmm(bias, x, w)` is computed by copying the bias, broadcast to the whole [M, N]
output, into the result and then running the GEMM with beta = 1, which reads that result back. At the real
width that copy is 1.6% of a 1024x1024 denoise step (qic.bench.step_profile). Inductor itself rewrites
addmm into mm + add, so that the add rides along in the kernel that consumes the product, but only for
GPU graphs (torch/_inductor/fx_passes/post_grad.py, should_prefer_unfused_addmm). This pass does the same
for CPU graphs: every consumer here is one of inductor's fused kernels (a norm, GELU, the residual), or
else the add becomes a kernel of its own that moves what the copy moved. The result differs from addmm's
only in the order of one fp32 addition per element (bias + sum vs. sum + bias).
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten


class UnfuseCpuBiasAddmm(CustomGraphPass):
    """addmm(bias, x, w) with default alpha and beta, on the CPU  ->  mm(x, w) + bias."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if not (node.op == "call_function" and node.target is aten.addmm.default
                    and len(node.args) == 3 and not node.kwargs):
                continue
            out = node.meta.get("val")
            if out is None or out.device.type != "cpu":
                continue
            bias, x, w = node.args
            with graph.inserting_before(node):
                product = graph.call_function(aten.mm.default, (x, w))
                total = graph.call_function(aten.add.Tensor, (product, bias))
            # mm's result has the addmm's shape, dtype and (contiguous) layout; so has the sum.
            product.meta.update(node.meta)
            total.meta.update(node.meta)
            node.replace_all_uses_with(total)
            graph.erase_node(node)

    def uuid(self) -> bytes:
        # Part of inductor's own cache key; the same digest of this file is in qic's (identity()).
        from qic.backends.inductor import passes_digest
        return passes_digest().encode()
