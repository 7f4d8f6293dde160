"""Which ATen ops are what, for the passes that read a graph by structure: linear projections,
data movement looked through when a value is followed, a router's selection, attention and its
parts, residual adds. One place, so every pass agrees on them."""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx as fx

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


#: ops that act on each element alone (and broadcast): a split dim, a batch dim or a token passes
_ELEMENTWISE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default,
    aten.silu.default, aten.gelu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
    aten.exp.default, aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.to.dtype, aten.to.dtype_layout,
    aten._to_copy.default, aten.contiguous.default, aten.clone.default, aten.alias.default,
    aten.dropout.default, aten.type_as.default, aten.where.self, aten.masked_fill.Scalar,
    aten.add.Scalar, aten.mul.Scalar, aten.div.Scalar, aten.sub.Scalar, aten.sqrt.default,
    aten.copy_.default, aten.square.default, aten.abs.default, aten.erf.default, aten.log.default,
    aten.pow.Tensor_Tensor,
    aten.clamp.default, aten.minimum.default, aten.maximum.default, aten.sin.default, aten.cos.default,
    aten.gelu_tanh.default if hasattr(aten, "gelu_tanh") else aten.gelu.default,
    # in place (a query scaled with ``q.mul_(scale)`` in hand-written attention): the split dim
    # passes the same way; the tensor written keeps its slice
    aten.mul_.Tensor, aten.mul_.Scalar, aten.add_.Tensor, aten.add_.Scalar, aten.sub_.Tensor, aten.div_.Tensor,
    aten.div_.Scalar,
}


def _ops(*names: str) -> set[object]:
    """ATen overloads by ``"op.overload"`` name, those this torch has."""
    out = set()
    for name in names:
        op, overload = name.split(".")
        packet = getattr(aten, op, None)
        if packet is not None and hasattr(packet, overload):
            out.add(getattr(packet, overload))
    return out


# more pointwise ops: comparisons and masks (xIELU's ``where(x > 0, ..)``), activations (softplus)
ELEMENTWISE_OPS = frozenset(_ELEMENTWISE | _ops(
    "gt.Scalar", "gt.Tensor", "lt.Scalar", "lt.Tensor", "ge.Scalar", "ge.Tensor", "le.Scalar", "le.Tensor",
    "eq.Scalar", "eq.Tensor", "ne.Scalar", "ne.Tensor", "logical_not.default", "logical_and.default",
    "logical_or.default", "where.ScalarSelf", "where.ScalarOther", "where.Scalar", "masked_fill.Tensor",
    "softplus.default", "expm1.default", "log1p.default", "exp2.default", "log2.default", "sign.default",
    "sgn.default", "reciprocal.default", "clamp_min.default", "clamp_max.default", "clamp.Tensor",
    "hardtanh.default", "leaky_relu.default", "elu.default", "mish.default", "hardswish.default",
    "hardsigmoid.default", "rsub.Scalar", "rsub.Tensor", "pow.Scalar", "floor.default", "round.default",
    "silu_.default", "relu_.default", "gelu_.default", "sigmoid_.default", "tanh_.default", "min.other",
    "max.other"))

def is_attention_op(node: fx.Node) -> bool:
    """SDPA, or a softmax fed by a matmul whose output feeds a matmul (explicit attention).
    A softmax feeding topk (an MoE router) is not attention."""
    if node.op != "call_function":
        return False
    if node.target in SDPA_OPS:
        return True
    if node.target not in SOFTMAX_OPS:
        return False

    def reaches(start: Iterable[fx.Node], targets: frozenset, forward: bool, depth: int = 6) -> bool:
        frontier = list(start)
        for _ in range(depth):
            nxt = []
            for n in frontier:
                if n.op == "call_function" and n.target in targets:
                    return True
                nxt.extend(n.users if forward else n.all_input_nodes)
            frontier = nxt
        return False

    return reaches(node.all_input_nodes, MATMUL_OPS, forward=False) and reaches(
        node.users, MATMUL_OPS, forward=True
    )
