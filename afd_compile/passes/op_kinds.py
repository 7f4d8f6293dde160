"""Which ATen ops are what, for the passes that read a graph by structure: linear projections,
data movement looked through when a value is followed, a router's selection, attention and its
parts, residual adds. One place, so every pass agrees on them."""

from __future__ import annotations

import operator

import torch

aten = torch.ops.aten

# Ops that compute a linear projection, in any IR level we see (torch IR from export, ATen).
LINEAR_OPS = frozenset(
    {aten.linear.default, aten.mm.default, aten.addmm.default, aten.matmul.default, aten.bmm.default}
)
# Ops that only move/cast data: looked through when following a value.
PASSTHROUGH_OPS = frozenset(
    {
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.to.dtype,
        aten.to.dtype_layout,
        aten._to_copy.default,
        aten.contiguous.default,
        aten.clone.default,
        aten.alias.default,
    }
)
# (max over the experts: PhiMoE's sparsemixer picks its top expert by value before any softmax)
ROUTER_SELECT_OPS = frozenset(
    {aten.softmax.int, aten._softmax.default, aten.sigmoid.default, aten.topk.default, aten.max.dim,
     aten.argmax.default, aten.sort.default}
)
SDPA_OPS = frozenset(
    {
        aten.scaled_dot_product_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
    }
)
SOFTMAX_OPS = frozenset({aten.softmax.int, aten._softmax.default, aten._safe_softmax.default})
# (``baddbmm``: scores computed as ``bias + q @ k^T`` in one op, as BLOOM adds its ALiBi bias)
MATMUL_OPS = frozenset({aten.matmul.default, aten.bmm.default, aten.baddbmm.default, aten.einsum.default})
ADD_OPS = frozenset({aten.add.Tensor, aten.add_.Tensor, operator.add})
