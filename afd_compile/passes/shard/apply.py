"""Applying a shard plan to a copy of the graph for one rank: slicing weights (each once, however
many layers read it), fixing head counts and cut sizes, narrowing state (:func:`apply_shards`)."""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx as fx

from ..graph_utils import get_attr_path
from ..symbolic import sym_expr
from .follow import STATE_WRITES, WholeBlocks, block_fixes, follow_split
from .operands import Track
from .projections import projection, projection_weight
from .types import (
    ArgFix,
    ShardedState,
    ShardedWeight,
    ShardError,
    ShardPlan,
    SlicedOperand,
)

aten = torch.ops.aten

def shard_pair(gm: fx.GraphModule, cols: list[fx.Node], row: fx.Node, parts: int, group: str,
                weights: list[ShardedWeight], fixes: list[ArgFix], where: str,
                means: list[fx.Node] | None = None, states: list[ShardedState] | None = None,
                operands: list[SlicedOperand] | None = None) -> None:
    names = ", ".join(projection_weight(gm, c, True)[0] for c in cols)
    for c in cols:
        target, dim, size = projection_weight(gm, c, True)
        if size % parts:
            raise ShardError(f"{where}: {parts} ranks do not divide dim {dim} (size {size}) of column-parallel "
                             f"weight {target}")
    target, dim, size = projection_weight(gm, row, False)
    if size % parts:
        raise ShardError(f"{where}: {parts} ranks do not divide dim {dim} (size {size}) of "
                         f"row-parallel weight {target}")
    whole: frozenset = frozenset()
    mark = len(fixes)
    try:
        for _ in range(3):
            try:
                track = follow_split(gm, cols, {row}, parts, group, fixes, where, whole)
                break
            except WholeBlocks as w:  # multi-query K/V: retry with those blocks replicated whole
                del fixes[mark:]
                whole = whole | frozenset(w.blocks)
        else:
            raise ShardError(f"attention inputs still split along head_dim with {sorted(map(str, whole))} whole")
    except ShardError as e:
        msg = str(e)
        if not msg.startswith(where):
            msg = f"{where} ({names}): {msg}"
        raise ShardError(msg) from None
    for a in track.attrs:  # sliced for this path: nothing else may read it whole
        other = [u.name for u in a.users if u not in track.dim]
        if other:
            raise ShardError(f"{where}: {a.target} is applied along the split dim of {names} and would be sliced, "
                             f"but {other} also read it whole")
    for c in cols:
        target, dim, size = projection_weight(gm, c, True)
        blocks, rep = block_fixes(c, track, parts, fixes)
        weights.append(ShardedWeight(target, dim, parts, group, "column", blocks, rep))
        bias = projection(c).bias
        if bias is not None:
            weights.append(ShardedWeight(str(bias.target), 0, parts, group, "column", blocks, rep))
        for a in track.attrs:
            if track.origin.get(a) == (c, None):
                weights.append(ShardedWeight(str(a.target), track.dim[a], parts, group, "column", blocks, rep))
            elif track.origin.get(a) is not None and track.origin[a][0] is c:
                raise ShardError(f"{where}: {a.target} spans the split dim of {c.name} but not its whole output")
    _slice_joins(track, parts, group, weights, fixes, where)
    for a in track.attrs:
        # on a tensor computed from several projections' slices (the attention output: BitNet's
        # sub-norm over all heads before o_proj): a rank holds one contiguous block of its heads
        if track.origin.get(a) is None:
            size = int(get_attr_path(gm, a.target).shape[track.dim[a]])
            if track.factor[a] != parts or size % parts:
                raise ShardError(f"{where}: {a.target} (size {size} along the split dim) is applied to "
                                 f"{parts // track.factor[a]}x replicated heads or does not divide by {parts}")
            weights.append(ShardedWeight(str(a.target), track.dim[a], parts, group, "column"))
    for node, d, slices in track.states:
        if states is None:
            raise ShardError(f"{where}: {node.name} is written in place with a value split over {group}")
        states.append(ShardedState(node.name, d, int(sym_expr(node.meta["val"].shape[d])), slices, parts, group))
    for user, a, d, slices, origin, fold in track.operands:
        if operands is None:
            raise ShardError(f"{where}: {user.name} applies {a.name}, a tensor not split over {group}, along the "
                             "split dim")
        if origin is not None and origin[1] is None and len(block_fixes(origin[0], track, parts, [])[0]) > 1:
            raise ShardError(f"{where}: {user.name} applies {a.name} along the split dim of the fused projection "
                             f"{origin[0].name} before it is cut: a rank's slice of it is not one block of {a.name}")
        size = fold or int(sym_expr(a.meta["val"].shape[d]))
        operands.append(SlicedOperand(user.name, a.name, d, size, slices, parts, group, fold=bool(fold)))
    if means is not None:
        means.extend(track.means)
    elif track.means:
        raise ShardError(f"{where}: {track.means[0].name} averages over a split dim")
    target, dim, size = projection_weight(gm, row, False)
    weights.append(ShardedWeight(target, dim, parts, group, "row", (size,)))
    bias = projection(row).bias
    if bias is not None:  # added once: kept on group rank 0, zeros elsewhere
        weights.append(ShardedWeight(str(bias.target), -1, parts, group, "row_bias"))


def _slice_joins(track: Track, parts: int, group: str, weights: list[ShardedWeight], fixes: list[ArgFix],
                 where: str) -> None:
    """A cat of split pieces along the split dim (``operands.join_pieces``), read as a column of
    blocks: its cuts' sizes fixed and the weights applied along it (a convolution's) sliced block
    by block."""
    for join in track.joins:
        blocks, rep = block_fixes(join, track, parts, fixes)
        if rep:
            raise ShardError(f"{where}: {join.name} joins pieces whose heads are replicated over ranks")
        for a in track.attrs:
            if track.origin.get(a) == (join, None):
                weights.append(ShardedWeight(str(a.target), track.dim[a], parts, group, "column", blocks))
            elif track.origin.get(a) is not None and track.origin[a][0] is join:
                raise ShardError(f"{where}: {a.target} spans the split dim of {join.name} but not its whole width")


def shard_tensor(t: torch.Tensor, w: ShardedWeight, rank: int) -> torch.Tensor:
    """This rank's slice of ``t`` (the full weight) under ``w``."""
    if w.kind == "row_bias":
        return t.detach().clone() if rank == 0 else torch.zeros_like(t)
    pieces, off = [], 0
    blocks = w.blocks or (t.shape[w.dim],)
    for i, b in enumerate(blocks):
        k = w.replicate[i] if w.replicate else 1
        n = b // (w.parts // k)
        pieces.append(t.detach().narrow(w.dim, off + (rank // k) * n, n))
        off += b
    return torch.cat(pieces, dim=w.dim).clone() if len(pieces) > 1 else pieces[0].clone()


def one_slice_per_weight(weights: Iterable[ShardedWeight]) -> tuple[ShardedWeight, ...]:
    """Each weight once, in first-read order: a weight several layers read (one block applied as
    every layer, ALBERT-style sharing) is sliced once; readers that would split it differently
    are refused, naming the weight and both splits."""
    seen: dict[str, ShardedWeight] = {}
    for w in weights:
        first = seen.setdefault(w.target, w)
        if first != w:
            raise ShardError(f"weight {w.target} is read by layers that split it differently: {first} / {w}; "
                             "a weight shared by several layers must be split the same way in each")
    return tuple(seen.values())


def apply_shards(gm: fx.GraphModule, plan: ShardPlan, rank_of_group: dict[str, int]) -> None:
    """Slice weights in place for this rank (``rank_of_group``: group name -> rank within it) and
    divide the head counts and fused-projection bounds the plan found. A row-parallel bias stays
    on group rank 0 only. A weight the plan lists for several readers is sliced once."""
    for w in one_slice_per_weight(plan.weights):
        t = get_attr_path(gm, w.target)
        new = shard_tensor(t, w, rank_of_group[w.group])
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
        args = list(node.args)
        new: object = f.new
        if f.div:  # a symbolic size: divided by a node inserted before its reader
            size = args[f.arg][f.index]
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(operator.floordiv, (size, f.new))
            if "val" in size.meta:
                new.meta["val"] = size.meta["val"] // f.new
        if f.index is None:
            args[f.arg] = new
        else:
            sizes = list(args[f.arg])
            sizes[f.index] = new
            args[f.arg] = sizes
        node.args = tuple(args)
    _narrow_states(gm, plan, rank_of_group, by_name)
    for o in plan.operands:  # each reader of an unsplit tensor along the split dim: its slice
        user, operand = by_name[o.user], by_name[o.operand]
        start, n = o.local(rank_of_group[o.group])
        with gm.graph.inserting_before(user):
            if o.fold:  # [batch * heads, ..] -> [batch, heads, ..] -> this rank's heads -> folded again
                heads = gm.graph.call_function(aten.unflatten.int, (operand, o.dim, [-1, o.size]))
                _meta_like(heads, user, lambda v, o=o: v.unflatten(o.dim, (-1, o.size)), operand)
                mine = gm.graph.call_function(aten.narrow.default, (heads, o.dim + 1, start, n))
                _meta_like(mine, user, lambda v, o=o, start=start, n=n: v.narrow(o.dim + 1, start, n), heads)
                view = gm.graph.call_function(aten.flatten.using_ints, (mine, o.dim, o.dim + 1))
                _meta_like(view, user, lambda v, o=o: v.flatten(o.dim, o.dim + 1), mine)
            else:
                view = gm.graph.call_function(aten.narrow.default, (operand, o.dim, start, n))
                _meta_like(view, user, lambda v, o=o, start=start, n=n: v.narrow(o.dim, start, n), operand)
        taken, name, i = {x.name for x in gm.graph.nodes}, f"{operand.name}_local", 0
        while name in taken:  # (one operand read by several layers)
            i += 1
            name = f"{operand.name}_local_{i}"
        view.name = name
        user.replace_input_with(operand, view)
    for o in plan.once:  # a bias added to partial sums: once over the group
        if rank_of_group[o.group] != 0:
            user = by_name[o.user]
            with gm.graph.inserting_before(user):
                zero = gm.graph.call_function(aten.zeros_like.default, (user.args[o.arg],))
            _meta_like(zero, user, torch.zeros_like, user.args[o.arg])
            user.args = (*user.args[:o.arg], zero, *user.args[o.arg + 1:])
    gm.recompile()


def _meta_like(new: fx.Node, user: fx.Node, fn: object, src: object) -> None:
    """``new`` (inserted for ``user``) gets ``user``'s metadata but its own value: ``fn`` of
    ``src``'s (fake) value, when it has one; later passes read both."""
    new.meta.update({k: v for k, v in user.meta.items() if k not in ("val", "tensor_meta")})
    val = src.meta.get("val") if isinstance(src, fx.Node) else None
    if isinstance(val, torch.Tensor):
        new.meta["val"] = fn(val)


def _narrow_states(gm: fx.GraphModule, plan: ShardPlan, rank_of_group: dict[str, int],
                   by_name: dict[str, fx.Node]) -> None:
    """Each rank's slice of every state tensor (KV cache): a cache attribute is sliced (the rank
    holds only its heads); a cache the program receives or allocates is narrowed where it is
    written and read (``narrow(cache, dim, start, n)``, a view: writes land in the caller's
    tensor), and returned whole."""
    for s in plan.states:
        node = by_name[s.node]
        start, n = s.local(rank_of_group[s.group])
        if node.op == "get_attr":
            t = get_attr_path(gm, node.target)
            *path, leaf = str(node.target).split(".")
            mod: object = gm
            for p in path:
                mod = getattr(mod, p)
            setattr(mod, leaf, t.detach().narrow(s.dim, start, n).clone())
            continue
        users = [u for u in node.users if u.op == "call_function"]  # (not the output, not export's guards)
        with gm.graph.inserting_after(node):
            view = gm.graph.call_function(aten.narrow.default, (node, s.dim, start, n))
        view.name = f"{node.name}_local"
        for u in users:
            u.replace_input_with(node, view)
        for w in [u for u in view.users if u.target in STATE_WRITES and u.args[0] is view]:
            for out in [u for u in w.users if u.op == "output"]:  # the write returns the cache: whole
                out.replace_input_with(w, node)
