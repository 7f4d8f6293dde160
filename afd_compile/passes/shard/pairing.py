"""Pairing each layer's column-parallel projections with the row-parallel one they feed, and
checking that what lies between the row-parallel output and the block output is linear in its
partial sum."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from .projections import projection
from .rules import (
    IGNORED,
)
from .types import (
    OnceOperand,
    ShardError,
)

aten = torch.ops.aten

# ops a pending partial sum may pass through unchanged in meaning (linear in the partial operand)
_LINEAR_IN_PARTIAL = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.to.dtype, aten._to_copy.default,
    aten.contiguous.default, aten.clone.default, aten.index.Tensor, aten.sum.dim_IntList, aten.unsqueeze.default,
    aten.squeeze.dim, aten.permute.default, aten.transpose.int, aten.index_select.default,
}


def column_row_pairs(projs: list[fx.Node], region: set[fx.Node],
                      where: str) -> list[tuple[list[fx.Node], fx.Node]]:
    """Group an MLP's projections into (column-parallel inputs, row-parallel output) pairs: a row
    reads a value computed from other projections, its columns are those projections. Others
    (a shared expert's gate: a linear to one sigmoid) stay replicated."""
    from ..roles import ancestors

    pset = set(projs)

    def act(n: fx.Node) -> fx.Node:  # the activation operand
        return projection(n).x

    def up(n: fx.Node) -> set[fx.Node]:  # ancestors inside the MLP region (a walk linear in its size)
        return ancestors([act(n)], within=region)

    rows = [n for n in projs if up(n) & pset]
    pairs = []
    for row in rows:
        cols = [c for c in projs if c in up(row) and c not in rows]
        if not cols:
            raise ShardError(f"{where}: {row.name} reads another down projection's output")
        pairs.append((cols, row))
    used = [c for cs, _ in pairs for c in cs]
    if len(used) != len(set(used)):
        raise ShardError(f"{where}: an up projection feeds two down projections ({[r.name for _, r in pairs]})")
    return pairs


def check_linear_path(rows: list[fx.Node], out: fx.Node, region: set[fx.Node], where: str,
                      once: list[OnceOperand] | None = None, group: str = "mlp",
                      cols: Sequence[fx.Node] = ()) -> None:
    """Everything between the row-parallel outputs and the block output must be linear in them
    (partial sums may be scaled, indexed, reshaped, summed, added to each other), so settling
    the sum once at the block output equals settling each at its row. With ``once``: a tensor
    added to a partial sum that comes neither from the partial sums nor from the split columns
    ``cols`` (a bias) is affine, kept on group rank 0 only (:class:`OnceOperand`, appended)."""
    from ..roles import ancestors, descendants

    up = ancestors([out], within=region) | {out}
    path = {n for r in rows for n in descendants(r, region) & up} - set(rows)
    partial = path | set(rows)
    split = set().union(*(descendants(c, region) for c in cols)) if once is not None else set()
    for n in path:
        if n.target in IGNORED:
            continue
        on = [a for a in n.all_input_nodes if a in partial]
        ok = n.target in _LINEAR_IN_PARTIAL and n.args[0] in on and len(on) == 1
        ok |= n.target in (aten.mul.Tensor, aten.div.Tensor) and len(on) == 1 and (
            n.target == aten.mul.Tensor or n.args[0] in on)
        ok |= n.target == aten.masked_fill.Scalar and len(on) == 1 and n.args[0] in on and n.args[2] == 0
        ok |= n.target == aten.dropout.default and n.args[0] in on and (n.args[1] == 0 or not n.args[2])  # identity
        ok |= n.target in (aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor) and \
            len(n.all_input_nodes) == 2 and len(on) == 2  # (Llama 4: the shared expert's sum added in place)
        bias = n.target in (aten.add.Tensor, aten.add_.Tensor) and len(n.args) == 2 and len(on) == 1 and \
            n.args[0] in on and isinstance(n.args[1], fx.Node) and n.args[1] not in split and \
            n.kwargs.get("alpha", 1) == 1
        if not ok and bias and once is not None:
            once.append(OnceOperand(n.name, 1, group))
            ok = True
        if not ok:
            raise ShardError(f"{where}: {n.name} ({n.target}) sits between the row-parallel "
                             f"{[r.name for r in rows]} and the block output {out.name} but is not linear in "
                             "their partial sums")
    if out not in partial:
        raise ShardError(f"{where}: the block output {out.name} does not come from {[r.name for r in rows]}")
