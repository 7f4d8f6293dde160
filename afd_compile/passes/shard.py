"""Tensor-parallel sharding: find column- and row-parallel linears, follow the split dimension
through the graph, fix head counts in reshapes, and slice the weights per rank.

Megatron style. In each layer's attention the projections that feed the attention op (q/k/v or a
fused qkv) are column-parallel over the attention TP group and the projection after it (o_proj)
is row-parallel; in a dense MLP the linears feeding the last one (gate/up or fused gate_up) are
column-parallel over the TP group and the last (down) is row-parallel. A row-parallel output is a
partial sum: the collective that settles it is inserted by the TP rewrite (tp_rewrite.py).

The split dimension is followed node by node (:data:`RULES`, a registry keyed by op) from each
column-parallel output to the row-parallel input. Reshapes with a constant head count get the
count divided (``view(q, [b, s, 4, 16]) -> view(q, [b, s, 2, 16])`` at tp=2); ``-1`` entries are
left alone. Before / after, one attention at tp=2 (heads 4 -> 2)::

    linear(x, q_proj.weight[64, 64])              linear(x, q_proj.weight[32, 64])     # rows r*32..
    view(q, [s0, s1, -1, 16])                     view(q, [s0, s1, -1, 16])
    expand(k, [s0, 2, 2, s1, 16])                 expand(k, [s0, 1, 2, s1, 16])
    reshape(k, [s0, 4, s1, 16])                   reshape(k, [s0, 2, s1, 16])
    linear(attn, o_proj.weight[64, 64])           linear(attn, o_proj.weight[64, 32])  # partial sum

Anything the rules do not know that touches a split tensor is an error naming the node.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from .roles import LINEAR_OPS, Role, is_attention_op, role_of
from .symbolic import sym_expr

aten = torch.ops.aten
META_KEY = "afd.shard"


class ShardError(ValueError):
    """A layout that does not divide a dimension, or a graph the sharding rules cannot follow."""


@dataclass(frozen=True)
class ShardedWeight:
    """``target`` is split along ``dim`` into ``parts`` equal slices over the ``group`` (attn|mlp)."""

    target: str
    dim: int
    parts: int
    group: str
    kind: str  # column | row

    def __str__(self) -> str:
        return f"{self.kind}-parallel {self.target} dim {self.dim} / {self.parts} over {self.group}"


@dataclass(frozen=True)
class ArgFix:
    """Divide the int at ``node.args[1][index]`` by ``parts`` (a head count in a reshape)."""

    node: str
    index: int
    old: int
    parts: int


@dataclass(frozen=True)
class ShardPlan:
    weights: tuple[ShardedWeight, ...]
    arg_fixes: tuple[ArgFix, ...]
    row_outputs: tuple[tuple[str, str, int], ...]  # (node, group, layer): partial sums to settle

    def __str__(self) -> str:
        return "\n".join([*(str(w) for w in self.weights),
                          *(f"reshape {f.node}[{f.index}]: {f.old} -> {f.old // f.parts}" for f in self.arg_fixes)])


# --- following the split dimension -----------------------------------------------------------

_ELEMENTWISE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default,
    aten.silu.default, aten.gelu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
    aten.exp.default, aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.to.dtype, aten.to.dtype_layout,
    aten._to_copy.default, aten.contiguous.default, aten.clone.default, aten.alias.default,
    aten.dropout.default, aten.type_as.default, aten.where.self, aten.masked_fill.Scalar,
    aten.add.Scalar, aten.mul.Scalar, aten.div.Scalar, aten.sub.Scalar, aten.sqrt.default,
    aten.gelu_tanh.default if hasattr(aten, "gelu_tanh") else aten.gelu.default,
}


def _ndim(n: object) -> int:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v.dim() if isinstance(v, torch.Tensor) else 0


def _shape(n: fx.Node) -> list:
    return [sym_expr(s) for s in n.meta["val"].shape]


Rule = Callable[[fx.Node, dict, int], int | None]


def _elementwise(node: fx.Node, sdim: dict, parts: int) -> int | None:
    out = _ndim(node)
    dims = set()
    for a in node.all_input_nodes:
        if a in sdim:
            dims.add(sdim[a] + out - _ndim(a))
    if len(dims) != 1:
        raise ShardError(f"{node.name} ({node.target}) combines tensors split along different dims {sorted(dims)}")
    d = dims.pop()
    for a in node.all_input_nodes:  # an unsplit operand must broadcast along the split dim
        if a not in sdim and isinstance(a.meta.get("val"), torch.Tensor) and _ndim(a) > 0:
            ad = d - (out - _ndim(a))
            if ad >= 0 and sym_expr(a.meta["val"].shape[ad]) != 1:
                raise ShardError(f"{node.name}: operand {a.name} is not split but spans the split dim {d}")
    return d


def _reduce_over(node: fx.Node, sdim: dict, parts: int) -> int | None:
    (src,) = [a for a in node.all_input_nodes if a in sdim]
    d = sdim[src]
    dims = node.args[1] if len(node.args) > 1 else list(range(_ndim(src)))
    dims = [x % _ndim(src) for x in (dims if isinstance(dims, (list, tuple)) else [dims])]
    if d in dims:
        raise ShardError(f"{node.name} ({node.target}) reduces over the split dim {d}")
    keep = node.target in (aten.softmax.int, aten._softmax.default, aten._safe_softmax.default) or (
        len(node.args) > 2 and node.args[2])
    return d if keep else d - sum(1 for x in dims if x < d)


def _transpose(node: fx.Node, sdim: dict, parts: int) -> int | None:
    d = sdim[node.args[0]]
    a, b = (x % _ndim(node) for x in node.args[1:3])
    return b if d == a else a if d == b else d


def _permute(node: fx.Node, sdim: dict, parts: int) -> int | None:
    perm = [x % _ndim(node) for x in node.args[1]]
    return perm.index(sdim[node.args[0]])


def _unsqueeze(node: fx.Node, sdim: dict, parts: int) -> int | None:
    d, at = sdim[node.args[0]], node.args[1] % _ndim(node)
    return d + 1 if at <= d else d


def _along_other_dim(node: fx.Node, sdim: dict, parts: int) -> int | None:
    src = node.args[0][0] if isinstance(node.args[0], (list, tuple)) else node.args[0]
    srcs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
    split = {sdim[s] for s in srcs if s in sdim}
    if len(split) != 1 or any(s not in sdim for s in srcs):
        raise ShardError(f"{node.name} ({node.target}) mixes split and unsplit inputs")
    d = split.pop()
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % _ndim(src)
    if dim == d:
        raise ShardError(f"{node.name} ({node.target}) works along the split dim {d}")
    return d


def _getitem(node: fx.Node, sdim: dict, parts: int) -> int | None:
    return sdim[node.args[0]]


def _sdpa(node: fx.Node, sdim: dict, parts: int) -> int | None:
    q, k, v = node.args[:3]
    if not all(x in sdim for x in (q, k, v)):
        raise ShardError(f"{node.name}: attention with q/k/v not all split over heads")
    return sdim[q]


def _matmul(node: fx.Node, sdim: dict, parts: int) -> int | None:
    a, b = node.args[:2]
    out = _ndim(node)
    dims = {sdim[x] + out - _ndim(x) for x in (a, b) if x in sdim}
    if len(dims) != 1 or not all(x in sdim for x in (a, b)) or dims.pop() >= out - 2:
        raise ShardError(f"{node.name}: matmul must have both operands split along the same batch (head) dim")
    return sdim[a] + out - _ndim(a)


def _reshape(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    src = node.args[0]
    d = sdim[src]
    ishape, oshape = _shape(src), _shape(node)
    prefix = sympy.Integer(1)
    for x in ishape[:d]:
        prefix *= x
    acc = sympy.Integer(1)
    for j, size in enumerate(oshape):
        if sympy.simplify(acc - prefix) == 0:
            if not (size.is_Integer and int(size) % parts == 0 and int(size) >= parts):
                raise ShardError(
                    f"{node.name}: split dim {d} (size {ishape[d]}) of {src.name} maps to output dim {j} of "
                    f"size {size}, which {parts} ranks cannot divide (a head count: the layout must divide the "
                    "attention and KV head counts; replicating KV heads when attn_tp exceeds them is not "
                    "supported yet)"
                )
            arg = node.args[1][j]
            if isinstance(arg, int) and arg != -1 and fixes is not None:
                fixes.append(ArgFix(node.name, j, arg, parts))
            elif not isinstance(arg, int):
                raise ShardError(f"{node.name}: output dim {j} is split but its size is symbolic ({arg})")
            return j
        acc *= size
    raise ShardError(f"{node.name}: cannot follow split dim {d} of {tuple(ishape)} into {tuple(oshape)}")


def _expand(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    src = node.args[0]
    d = sdim[src] + _ndim(node) - _ndim(src)
    arg = node.args[1][d]
    if isinstance(arg, int) and arg != -1 and fixes is not None:
        if arg % parts:
            raise ShardError(f"{node.name}: expand size {arg} at split dim {d} does not divide by {parts}")
        fixes.append(ArgFix(node.name, d, arg, parts))
    return d


RULES: dict[object, Rule] = {op: _elementwise for op in _ELEMENTWISE}
RULES.update({
    aten.mean.dim: _reduce_over, aten.sum.dim_IntList: _reduce_over, aten.amax.default: _reduce_over,
    aten.softmax.int: _reduce_over, aten._softmax.default: _reduce_over, aten._safe_softmax.default: _reduce_over,
    aten.transpose.int: _transpose, aten.permute.default: _permute, aten.unsqueeze.default: _unsqueeze,
    aten.slice.Tensor: _along_other_dim, aten.cat.default: _along_other_dim, aten.chunk.default: _along_other_dim,
    aten.split.Tensor: _along_other_dim, aten.select.int: _along_other_dim,
    operator.getitem: _getitem,
    aten.scaled_dot_product_attention.default: _sdpa,
    aten.matmul.default: _matmul, aten.bmm.default: _matmul,
})
RESHAPE_RULES = {aten.view.default: _reshape, aten.reshape.default: _reshape, aten._unsafe_view.default: _reshape,
                 aten.expand.default: _expand}
IGNORED = {aten._assert_tensor_metadata.default}


def _weight_of(linear: fx.Node) -> fx.Node:
    if linear.target != aten.linear.default:
        raise ShardError(f"{linear.name}: {linear.target} projections (e.g. GPT-2's Conv1D, weight [in, out]) "
                         "cannot be tensor-sharded yet; only aten.linear(x, weight[out, in]) is")
    w = linear.args[1]
    if not (isinstance(w, fx.Node) and w.op == "get_attr"):
        raise ShardError(f"{linear.name}: linear weight is not a graph attribute ({w})")
    return w


def _follow(gm: fx.GraphModule, columns: list[fx.Node], rows: set[fx.Node], parts: int, group: str,
            fixes: list[ArgFix], where: str) -> None:
    sdim: dict[fx.Node, int] = {c: _ndim(c) - 1 for c in columns}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    frontier = sorted({u for c in columns for u in c.users}, key=order.__getitem__)
    seen: set[fx.Node] = set()
    while frontier:
        n = frontier.pop(0)
        if n in seen or n in sdim:
            continue
        seen.add(n)
        if n in rows:
            if sdim.get(n.args[0]) != _ndim(n.args[0]) - 1:
                raise ShardError(f"{where}: row-parallel {n.name} gets an input not split along its last dim")
            continue
        if n.op == "output":
            raise ShardError(f"{where}: a tensor split over the {group} group reaches the graph output via {n.args}")
        target = n.target
        if target in IGNORED:
            continue
        if target in RESHAPE_RULES:
            sdim[n] = RESHAPE_RULES[target](n, sdim, parts, fixes)
        elif target in RULES:
            sdim[n] = RULES[target](n, sdim, parts)
        elif target in LINEAR_OPS:
            raise ShardError(f"{where}: linear {n.name} reads a split tensor but is not the row-parallel projection")
        else:
            raise ShardError(f"{where}: no sharding rule for {n.name} ({target}) on a tensor split over {group}")
        frontier.extend(sorted(n.users, key=order.__getitem__))
        frontier.sort(key=order.__getitem__)


def plan_shards(gm: fx.GraphModule, attn_parts: int, mlp_parts: int) -> ShardPlan:
    """Find the linears of every layer and follow their splits. Needs ``afd.role``."""
    weights: list[ShardedWeight] = []
    fixes: list[ArgFix] = []
    rows_out: list[tuple[str, str, int]] = []
    by_layer: dict[int, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        r = role_of(n)
        if r.layer is not None:
            by_layer.setdefault(r.layer, []).append(n)
    for layer, members in sorted(by_layer.items()):
        where = f"layer {layer}"
        attn_ops = [n for n in members if role_of(n).role is Role.ATTENTION and is_attention_op(n)]
        ffn = [n for n in members if role_of(n).role is Role.FFN]
        if len(attn_ops) != 1:
            raise ShardError(f"{where}: expected one attention op, found {[n.name for n in attn_ops]}")
        attn = attn_ops[0]
        lin = [n for n in members if n.target in LINEAR_OPS and role_of(n).role is Role.ATTENTION
               and not role_of(n).router]
        from .roles import _ancestors, _descendants

        before, after = _ancestors([attn]), _descendants(attn)
        cols = [n for n in lin if n in before]
        rows = [n for n in lin if n in after]
        if not cols or len(rows) != 1:
            raise ShardError(f"{where}: expected q/k/v projections before {attn.name} and one output projection after "
                             f"it, found {[n.name for n in cols]} / {[n.name for n in rows]}")
        if attn_parts > 1:
            _shard_pair(gm, cols, rows[0], attn_parts, "attn", weights, fixes, where)
            rows_out.append((rows[0].name, "attn", layer))
        custom = [n for n in ffn if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace != "aten"]
        if any(n.target == aten.topk.default for n in ffn) or custom:
            raise ShardError(f"{where}: tensor-parallel MoE experts are not supported yet (the layer routes with topk)")
        ffn_set = set(ffn)
        out = next(n for n in reversed(ffn) if any(u not in ffn_set for u in n.users))
        mlp_lin = [n for n in ffn if n.target in LINEAR_OPS]
        row = _producer_linear(out, ffn_set)
        if row is None:
            raise ShardError(f"{where}: the MLP output {out.name} is not produced by a linear (down projection)")
        mcols = [n for n in mlp_lin if n is not row]
        if mlp_parts > 1:
            _shard_pair(gm, mcols, row, mlp_parts, "mlp", weights, fixes, where)
            rows_out.append((row.name, "mlp", layer))
    return ShardPlan(tuple(weights), tuple(fixes), tuple(rows_out))


def _producer_linear(out: fx.Node, members: set) -> fx.Node | None:
    from .roles import PASSTHROUGH_OPS

    n = out
    while n in members:
        if n.target in LINEAR_OPS:
            return n
        if n.target in PASSTHROUGH_OPS:
            n = n.args[0]
            continue
        return None
    return None


def _shard_pair(gm: fx.GraphModule, cols: list[fx.Node], row: fx.Node, parts: int, group: str,
                weights: list[ShardedWeight], fixes: list[ArgFix], where: str) -> None:
    for c in cols:
        w = _weight_of(c)
        size = int(w.meta["val"].shape[0]) if "val" in w.meta else int(_get(gm, w.target).shape[0])
        if size % parts:
            raise ShardError(f"{where}: {parts} ranks do not divide dim 0 (size {size}) of column-parallel weight {w.target}")
        weights.append(ShardedWeight(str(w.target), 0, parts, group, "column"))
        if len(c.args) > 2 and isinstance(c.args[2], fx.Node):
            weights.append(ShardedWeight(str(c.args[2].target), 0, parts, group, "column"))
    w = _weight_of(row)
    size = int(_get(gm, w.target).shape[1])
    if size % parts:
        raise ShardError(f"{where}: {parts} ranks do not divide dim 1 (size {size}) of row-parallel weight {w.target}")
    weights.append(ShardedWeight(str(w.target), 1, parts, group, "row"))
    if len(row.args) > 2 and isinstance(row.args[2], fx.Node):
        weights.append(ShardedWeight(str(row.args[2].target), -1, parts, group, "row_bias"))
    try:
        _follow(gm, cols, {row}, parts, group, fixes, where)
    except ShardError as e:
        msg = str(e)
        if not msg.startswith(where):
            msg = f"{where} ({', '.join(str(_weight_of(c).target) for c in cols)}): {msg}"
        raise ShardError(msg) from None


def _get(gm: fx.GraphModule, target: str) -> torch.Tensor:
    obj: object = gm
    for p in target.split("."):
        obj = getattr(obj, p)
    return obj  # type: ignore[return-value]


def apply_shards(gm: fx.GraphModule, plan: ShardPlan, rank_of_group: dict[str, int]) -> None:
    """Slice weights in place for this rank (``rank_of_group``: group name -> rank within it) and
    divide the head counts the plan found. A row-parallel bias stays on group rank 0 only."""
    for w in plan.weights:
        t = _get(gm, w.target)
        r = rank_of_group[w.group]
        if w.kind == "row_bias":
            new = t.detach().clone() if r == 0 else torch.zeros_like(t)
        else:
            n = t.shape[w.dim] // w.parts
            new = t.detach().narrow(w.dim, r * n, n).clone()
        *path, leaf = w.target.split(".")
        mod: object = gm
        for p in path:
            mod = getattr(mod, p)
        if isinstance(t, torch.nn.Parameter):
            setattr(mod, leaf, torch.nn.Parameter(new, requires_grad=False))
        else:
            setattr(mod, leaf, new)
    by_name = {n.name: n for n in gm.graph.nodes}
    for f in plan.arg_fixes:
        node = by_name[f.node]
        sizes = list(node.args[1])
        sizes[f.index] = f.old // f.parts
        node.args = (node.args[0], sizes, *node.args[2:])
    gm.recompile()
