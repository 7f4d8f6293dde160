"""Per-head modules written over the heads split apart, merged into one computation over all heads
(a normalisation before TP, which shards the heads' dim of one tensor, not a list of pieces).

Some models give each attention head its own module: the heads split into one-head pieces, a
module per piece (a LayerNorm of its own), the pieces concatenated back. Every piece runs the same
ops with its own weights, so the pieces merge into one computation whose weights are the pieces'
stacked along the heads (``[H, D]``, as a per-head norm written with one weight has them). Before::

    split = aten.split(q, 1, 2)                                    # [B, S, H, D] -> H x [B, S, 1, D]
    ln_0 = aten.layer_norm(split[0], [D], q_norms_0_weight, q_norms_0_bias, eps)
    ...                                                            # one module per head
    cat = aten.cat([ln_0, ..., ln_{H-1}], 2)

After (``afd_heads_*``: the heads' weights stacked, one row per head)::

    ln = aten.layer_norm(q, [D], None, None, eps)
    cat = aten.add(aten.mul(ln, afd_heads_q_norms_0_weight), afd_heads_q_norms_0_bias)

Merged only where it is the same computation: every piece's chain of ops is the same, each op
acts on each position of the heads' dim alone (elementwise, a norm or a reduction over later
dims), and the pieces' weights differ only in value. Anything else is left as written (TP then
names what it cannot shard).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .graph_utils import del_attr_path, get_attr_path

aten = torch.ops.aten

#: ops acting on each element alone (broadcasting their other operands)
_ELEMENTWISE = frozenset({
    aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.add.Scalar,
    aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.sqrt.default, aten.neg.default, aten.to.dtype,
    aten._to_copy.default, aten.silu.default, aten.gelu.default, aten.tanh.default, aten.sigmoid.default,
    aten.exp.default, aten.clone.default, aten.contiguous.default})
#: norms over the last ``len(normalized_shape)`` dims: (input, shape, weight, bias, eps)
_NORMS = frozenset({aten.layer_norm.default, aten.rms_norm.default})
#: reductions over given dims (input, dims, keepdim)
_REDUCTIONS = frozenset({aten.mean.dim, aten.sum.dim_IntList, aten.amax.default})


@dataclass(frozen=True)
class MergedPieces:
    """One split-into-heads whose per-piece modules were merged."""

    split: str
    cat: str
    pieces: int
    weights: tuple[str, ...]  # the stacked weights registered

    def __str__(self) -> str:
        return (f"{self.split} -> {self.cat}: {self.pieces} per-head pieces merged, weights stacked as "
                f"{', '.join(self.weights) or 'none'}")


def merge_head_pieces(gm: fx.GraphModule) -> list[MergedPieces]:
    """Merge every split-into-heads whose pieces run the same per-head modules (module
    docstring), in place; the records."""
    done = []
    for split in [n for n in gm.graph.nodes if n.target == aten.split.Tensor]:
        found = _pieces(split)
        if found is not None:
            done.append(_merge(gm, split, *found))
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _val(n: object) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _pieces(split: fx.Node) -> tuple[int, list[list[fx.Node]], fx.Node] | None:
    """(dim, each piece's chain of ops, the cat joining them) when ``split``'s pieces each run a
    chain of the same ops into one cat along the split dim, in order; else None."""
    x, size = split.args[0], split.args[1]
    v = _val(x)
    if v is None or not isinstance(size, int) or not isinstance(v.shape[-1], int):
        return None
    dim = (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) % v.dim()
    items = sorted(split.users, key=lambda u: u.args[1] if u.target is operator.getitem else -1)
    if not items or any(u.target is not operator.getitem for u in items) or \
            [u.args[1] for u in items] != list(range(len(items))) or len(items) < 2:
        return None
    chains, ends = [], []
    for item in items:
        chain, node = [], item
        while len(node.users) == 1 and (u := next(iter(node.users))).target != aten.cat.default:
            chain.append(u)
            node = u
        if len(node.users) != 1 or not chain:
            return None
        chains.append(chain)
        ends.append(node)
    cat = next(iter(ends[0].users))
    if cat.target != aten.cat.default or list(cat.args[0]) != ends or \
            (cat.args[1] if len(cat.args) > 1 else 0) % v.dim() != dim:
        return None
    if any(len(c) != len(chains[0]) for c in chains) or not all(_same_step(dim, v.dim(), [c[j] for c in chains])
                                                               for j in range(len(chains[0]))):
        return None
    return dim, chains, cat


def _same_step(dim: int, ndim: int, nodes: list[fx.Node]) -> bool:
    """The j-th op of every piece: one target acting on each head position alone, the same
    arguments but for the previous op (its own) and weights of one shape (its own)."""
    first = nodes[0]
    if any(n.target != first.target or len(n.args) != len(first.args) or n.kwargs != first.kwargs for n in nodes):
        return False
    if first.target in _NORMS:
        if ndim - len(first.args[1]) <= dim:
            return False
    elif first.target in _REDUCTIONS:
        dims = first.args[1] if len(first.args) > 1 else None
        keep = first.args[2] if len(first.args) > 2 else first.kwargs.get("keepdim", False)
        if not keep or not dims or any(d % ndim <= dim for d in dims):
            return False
    elif first.target not in _ELEMENTWISE:
        return False
    for i in range(1, len(first.args)):
        args = [n.args[i] for n in nodes]
        if all(isinstance(a, fx.Node) and a.op == "get_attr" for a in args):
            if len({tuple(_val(a).shape) if _val(a) is not None else None for a in args}) != 1 or _val(args[0]) is None:
                return False
            if _val(args[0]).dim() >= ndim - dim and first.target not in _NORMS:
                return False  # (a weight reaching the heads' dim: not one row per piece)
        elif any(a is not args[0] and a != args[0] for a in args):
            return False
    return True


def _merge(gm: fx.GraphModule, split: fx.Node, dim: int, chains: list[list[fx.Node]], cat: fx.Node) -> MergedPieces:
    x, size = split.args[0], int(split.args[1])
    ndim, graph = _val(x).dim(), gm.graph
    mode = _val(x).fake_mode
    made: list[str] = []

    def emit(target: object, args: tuple, like: fx.Node) -> fx.Node:
        with graph.inserting_before(cat):
            n = graph.call_function(target, args)
        with mode:
            n.meta["val"] = target(*fx.node.map_arg(args, lambda a: a.meta["val"]))
        n.meta.update({k: like.meta[k] for k in ("nn_module_stack", "stack_trace") if k in like.meta})
        return n

    def stacked(params: list[fx.Node], trailing: int) -> fx.Node:
        """The pieces' weights as one, a row per head along the heads' dim (``trailing`` dims after it)."""
        rows = torch.stack([get_attr_path(gm, str(p.target)).detach() for p in params])
        rows = rows.reshape(len(params), *([1] * (trailing - (rows.dim() - 1))), *rows.shape[1:])
        rows = rows.repeat_interleave(size, dim=0) if size > 1 else rows
        name = "afd_heads_" + str(params[0].target).replace(".", "_")
        while hasattr(gm, name):
            name += "_"
        gm.register_parameter(name, torch.nn.Parameter(rows.contiguous(), requires_grad=False))
        made.append(name)
        with graph.inserting_before(cat):
            node = graph.get_attr(name)
        node.meta["val"] = mode.from_tensor(rows, static_shapes=True)
        return node

    prev = x
    for j, first in enumerate(chains[0]):
        step = [c[j] for c in chains]
        args = [prev]
        affine: list[tuple[object, fx.Node]] = []
        for i in range(1, len(first.args)):
            a = first.args[i]
            if isinstance(a, fx.Node) and a.op == "get_attr":
                w = stacked([n.args[i] for n in step], ndim - dim - 1)
                if first.target in _NORMS:  # (a norm's weight / bias: applied after it, per head)
                    affine.append((aten.mul.Tensor if i == 2 else aten.add.Tensor, w))
                    a = None
                else:
                    a = w
            args.append(a)
        prev = emit(first.target, tuple(args), first)
        for op, w in sorted(affine, key=lambda t: t[0] is aten.add.Tensor):  # (scale, then shift)
            prev = emit(op, (prev, w), first)
    record = MergedPieces(split.name, cat.name, len(chains), tuple(made))
    cat.replace_all_uses_with(prev)
    params = {a for c in chains for n in c for a in n.args if isinstance(a, fx.Node) and a.op == "get_attr"}
    for n in [cat, *(n for c in reversed(chains) for n in reversed(c)), *sorted(split.users, key=str), split]:
        if not n.users:
            graph.erase_node(n)
    for p in params:  # (each piece's own weights, now stacked: not kept twice)
        if not p.users:
            graph.erase_node(p)
            if not any(n.op == "get_attr" and n.target == p.target for n in graph.nodes):
                del_attr_path(gm, str(p.target))
    return record
