"""The projections TP splits: linears (column- or row-parallel) and which weight dim a split
cuts; and the one rule for MoE experts, the recognised ``afd::moe_experts`` op (``passes/moe``
turns every expert form into it first: no per-form rule here)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ... import meta_keys
from ... import moe as _moe  # noqa: F401  (registers afd::moe_experts)
from ..graph_utils import get_attr_path
from .rules import (
    ndim,
)
from .types import (
    ShardedWeight,
    ShardError,
)

aten = torch.ops.aten


META_KEY = meta_keys.SHARD


@dataclass(frozen=True)
class Projection:
    """A projection's operands: activation ``x``, the weight attribute, which weight dim holds the
    output features (0: ``linear``'s ``[out, in]``; 1: ``[in, out]`` as GPT-2's Conv1D ``addmm``
    or a plain ``x @ W``), and the bias attribute if any."""

    x: fx.Node
    weight: fx.Node
    out_dim: int
    bias: fx.Node | None


def projection(n: fx.Node) -> Projection:
    """``linear(x, W[out, in], b)``, ``addmm(b, x, W[in, out])``, ``mm/matmul(x, W[in, out])``, or
    ``mm/matmul(x, W.t())`` with ``W[out, in]``."""
    bias = None
    if n.target == aten.linear.default:
        x, w = n.args[:2]
        bias, out_dim = (n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")), 0
    elif n.target == aten.addmm.default:
        if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1:
            raise ShardError(f"{n.name}: addmm with beta/alpha other than 1 cannot be tensor-sharded")
        bias, x, w = n.args[:3]
        out_dim = 1
    elif n.target in (aten.mm.default, aten.matmul.default):
        x, w = n.args[:2]
        out_dim = 1
    else:
        raise ShardError(f"{n.name}: {n.target} is not a projection afd-compile can tensor-shard (linear, addmm, "
                         "mm or matmul with a 2-D weight attribute)")
    if isinstance(w, fx.Node) and n.target != aten.linear.default and (
            w.target in (aten.t.default, aten.numpy_T.default)
            or (w.target == aten.transpose.int and {a % 2 for a in w.args[1:3]} == {0, 1})):
        w, out_dim = w.args[0], 1 - out_dim  # x @ W.t(): W is stored [out, in]
    if not (isinstance(w, fx.Node) and w.op == "get_attr" and ndim(w) in (0, 2)):
        raise ShardError(f"{n.name}: projection weight is not a 2-D graph attribute ({w})")
    if bias is not None and not (isinstance(bias, fx.Node) and bias.op == "get_attr"):
        raise ShardError(f"{n.name}: projection bias is not a graph attribute ({bias})")
    return Projection(x, w, out_dim, bias)


def out_features(col: fx.Node) -> int:
    return int(col.meta["val"].shape[-1])


Block = tuple[fx.Node, int | None]  # (column, start of a block of its output features | None: all of it)


def projection_weight(gm: fx.GraphModule, proj: fx.Node, column: bool) -> tuple[str, int, int]:
    """(target, dim, size) of the weight dim a column (out features) / row (in features) split cuts."""
    p = projection(proj)
    dim = p.out_dim if column else 1 - p.out_dim
    return str(p.weight.target), dim, int(get_attr_path(gm, p.weight.target).shape[dim])


# --- the MoE op ---------------------------------------------------------------------------------

def is_moe_op(node: fx.Node) -> bool:
    """An ``afd::moe_experts`` node (``passes/moe`` made it from the model's experts)."""
    return node.op == "call_function" and node.target == torch.ops.afd.moe_experts.default


def moe_op_shards(op: fx.Node, parts: int, group: str, where: str) -> list[ShardedWeight]:
    """TP of the MoE op, the one rule for every expert form: each rank keeps every expert's
    slice of the intermediate size (the gate and up halves sliced alike, the down projection's
    input dim), so its output is a partial sum over the group; the down bias, added per
    (token, expert) before the routing weight, counts once (group rank 0, zeros elsewhere)."""
    x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, _act, gated, _first = op.args[:10]
    n = int(w_gate_up.meta["val"].shape[1])
    inter = n // 2 if gated else n
    if inter % parts:
        raise ShardError(f"{where}: {op.name}'s experts have intermediate size {inter}, which {parts} TP ranks "
                         "cannot divide")
    blocks = (inter, inter) if gated else (inter,)
    out = [ShardedWeight(str(w_gate_up.target), 1, parts, group, "column", blocks),
           ShardedWeight(str(w_down.target), 2, parts, group, "row", (inter,))]
    if b_gate_up is not None:
        out.append(ShardedWeight(str(b_gate_up.target), 1, parts, group, "column", blocks))
    if b_down is not None:
        out.append(ShardedWeight(str(b_down.target), -1, parts, group, "row_bias"))
    return out
