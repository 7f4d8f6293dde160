"""Unpack a projection whose output is packed per group (:func:`unpack_grouped_projections`).

Some models fuse q, k and v into one projection laid out **per KV group**: Falcon's new decoder
architecture writes, for each of ``G`` groups, its ``Q`` query heads then its K head then its V
head, and takes them apart by slicing a ``[..., G, Q + 2, D]`` view of the output. Sharding that
view over whole groups works while the layout divides ``G``; with fewer groups than ranks (one
group: multi-query attention) a rank would have to take some query heads of a group and the K/V of
that group, which no contiguous slice of the packed features is.

This pass rewrites such a projection into the block form every TP engine shards: the weight's
output rows permuted so that each slot range the model slices becomes one contiguous block
(``[all query heads | all K heads | all V heads]``, group-major inside each block), and each slice
read back from its block. The sharding rules then treat it like any ``[q | k | v]`` projection:
the query heads split over the ranks, the K/V heads split or (fewer than ranks) replicated and
repeated to the query heads. The rewrite is exact (the same numbers on one process): a
permutation of the weight's rows and views of the same values.

Before (``G`` groups, ``Q`` query heads per group, head dim ``D``)::

    y = matmul(x, numpy_T(W))                   # [b, s, G (Q + 2) D]
    v = view(y, [b, s, G, Q + 2, D])
    q = flatten(slice(v, 3, 0, Q), 2, 3)        # [b, s, G Q, D]
    k = select(v, 3, Q); v_ = select(v, 3, Q + 1)

After (``W'`` = ``W``'s rows reordered, a new attribute ``afd_unpacked_<W>``)::

    y = matmul(x, numpy_T(W'))
    qs, ks, vs = split_with_sizes(y, [G Q D, G D, G D], -1)
    q = unflatten(qs, -1, [G Q, D]); k = unflatten(ks, -1, [G, D]); v_ = unflatten(vs, -1, [G, D])

Found by structure only: a projection by a weight attribute (``linear``, or ``matmul`` / ``mm``
by a transposed or plain 2-D weight), reshapes of its last dim alone, and a view every user of
which is a unit-step ``slice`` or a ``select`` of one dim of those features, the slot ranges
disjoint. Anything else is left as it is.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from .. import meta_keys
from .graph_utils import del_attr_path, get_attr_path, set_attr_path

aten = torch.ops.aten

#: ``gm.meta`` key of the records of the projections this pass unpacked
RECORDS_KEY = meta_keys.UNPACKED_PROJECTIONS
_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int)
_TRANSPOSES = (aten.numpy_T.default, aten.t.default)
_MERGES = (aten.flatten.using_ints, aten.view.default, aten.reshape.default, aten._unsafe_view.default)


@dataclass(frozen=True)
class UnpackedProjection:
    """One rewritten projection: its node, the weight it read, and the slot ranges it now holds
    as blocks (``(start, stop)`` in the packed slot dim, ``groups`` of them each)."""

    node: str
    weight: str
    groups: int
    ranges: tuple[tuple[int, int], ...]

    def __str__(self) -> str:
        return (f"{self.node}: {self.weight} packed per group ({self.groups} group{'s' * (self.groups != 1)}, "
                f"slots {list(self.ranges)}) unpacked into {len(self.ranges)} blocks")


def _shape(n: fx.Node) -> tuple | None:
    v = n.meta.get("val")
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _weight_of(p: fx.Node) -> tuple[fx.Node, int] | None:
    """(the get_attr node, the weight dim of the output features) of a projection ``p``, or None."""
    if p.target == aten.linear.default and len(p.args) >= 2 and isinstance(p.args[1], fx.Node):
        w = p.args[1]
        return (w, 0) if w.op == "get_attr" else None
    if p.target not in (aten.matmul.default, aten.mm.default) or not isinstance(p.args[1], fx.Node):
        return None
    w = p.args[1]
    if w.op == "get_attr":
        return w, 1
    plain_t = w.target in _TRANSPOSES or (w.target == aten.transpose.int and sorted(w.args[1:]) in ([0, 1], [-2, -1]))
    if plain_t and isinstance(w.args[0], fx.Node) and w.args[0].op == "get_attr" and len(w.users) == 1:
        return w.args[0], 0
    return None


def _identity(n: fx.Node) -> bool:
    """A slice that keeps every element (``x[:, :, ...]`` indexing emits them)."""
    if n.target != aten.slice.Tensor or _shape(n.args[0]) is None:
        return False
    size = _shape(n.args[0])[n.args[1] % len(_shape(n.args[0]))]
    start, end, step = (list(n.args[2:5]) + [None, None, None])[:3]
    if step not in (None, 1) or start not in (None, 0):
        return False
    return end is None or (isinstance(end, int) and end >= 2 ** 62) or (isinstance(size, int) and end == size)


def _readers(view: fx.Node) -> list[fx.Node]:
    """``view``'s users, seen through slices that keep everything."""
    out = []
    for u in view.users:
        out.extend(_readers(u) if _identity(u) else [u])
    return out


_SPLITS = (aten.split_with_sizes.default, aten.split.Tensor)


def _ranges(gm: fx.GraphModule, view: fx.Node, dim: int) -> list[tuple[int, int, fx.Node, bool]] | None:
    """The slot ranges ``view``'s users read along ``dim``: ``(start, stop, node, keeps the dim)``
    per slice of step 1, select, piece of a split or of an unbind; None if any user reads
    otherwise, or the ranges do not tile the dim."""
    size, rank = _shape(view)[dim], len(_shape(view))
    out = []
    for u in _readers(view):
        if _dim_of(u) is None or _dim_of(u) % rank != dim:
            return None
        if u.target == aten.slice.Tensor:
            start, end = (list(u.args[2:4]) + [None, None])[:2]
            if (u.args[4] if len(u.args) > 4 else 1) != 1:
                return None
            out.append((*slice(start, end).indices(size)[:2], u, True))
        elif u.target == aten.select.int:
            out.append((u.args[2] % size, u.args[2] % size + 1, u, False))
        elif u.target == aten.index.Tensor:
            at = [i % size for i in _constant_index(gm, u) or []]
            if not at or at != list(range(at[0], at[0] + len(at))):
                return None  # (an index computed in the graph, or not one run of slots)
            out.append((at[0], at[-1] + 1, u, True))
        elif all(g.target == operator.getitem for g in u.users):  # a split or an unbind
            sizes = [1] * size if u.target == aten.unbind.int else \
                list(u.args[1]) if isinstance(u.args[1], (list, tuple)) else [u.args[1]] * -(-size // u.args[1])
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            out.extend((starts[g.args[1]], min(starts[g.args[1]] + sizes[g.args[1]], size), g,
                        u.target != aten.unbind.int) for g in u.users)
        else:
            return None
    out.sort(key=lambda r: r[0])
    if len(out) < 2 or [r[0] for r in out] != [0, *(r[1] for r in out[:-1])] or out[-1][1] != size:
        return None  # (one range, or ranges that overlap or leave slots unread)
    return out


def _packed_view(p: fx.Node, lead: int) -> tuple[fx.Node, int] | None:
    """The view of ``p`` whose users slice one feature dim (and that dim), following reshapes of
    the last dim alone (the leading ``lead`` dims kept)."""
    n = p
    while len(n.users) == 1:
        (u,) = n.users
        shape = _shape(u)
        if u.target not in _RESHAPES or shape is None or shape[:lead] != _shape(p)[:lead]:
            return None
        n = u
        if all(isinstance(s, int) for s in shape[lead:]) and len(shape) - lead >= 2:
            dims = {_dim_of(a) % len(shape) for a in _readers(n) if _dim_of(a) is not None}
            if len(dims) == 1 and lead <= min(dims) < len(shape) - 1:
                return n, dims.pop()
    return None


def _dim_of(n: fx.Node) -> int | None:
    """The dim a slice, select, split or unbind reads along (None: another op)."""
    if n.target in (aten.slice.Tensor, aten.select.int):
        return n.args[1]
    if n.target in _SPLITS:
        return n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
    if n.target == aten.unbind.int:
        return n.args[1] if len(n.args) > 1 else 0
    if n.target == aten.index.Tensor:  # x[..., [i, i + 1, ...]]: one index tensor, the other dims whole
        at = [i for i, a in enumerate(n.args[1]) if a is not None]
        return at[0] if len(at) == 1 else None
    return None


def _constant_index(gm: fx.GraphModule, n: fx.Node) -> list[int] | None:
    """The values of ``n``'s one index tensor when it is a constant of the graph."""
    (a,) = [a for a in n.args[1] if a is not None]
    if isinstance(a, fx.Node) and a.target == aten.lift_fresh_copy.default:
        a = a.args[0]
    if not (isinstance(a, fx.Node) and a.op == "get_attr"):
        return None
    value = get_attr_path(gm, str(a.target))
    return [int(v) for v in value.tolist()] if value.dim() == 1 and not value.is_floating_point() else None


def _fake(gm: fx.GraphModule):
    return detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if "val" in n.meta])


def _call(graph: fx.Graph, mode, target, args: tuple, like: fx.Node) -> fx.Node:
    """A new node computing ``target(*args)``, with ``like``'s meta (module stack, source) and
    its own fake value."""
    node = graph.call_function(target, args)
    node.meta.update({k: v for k, v in like.meta.items() if k != "val"})
    with mode:
        node.meta["val"] = target(*fx.node.map_arg(args, lambda a: a.meta["val"]))
    return node


def unpack_grouped_projections(gm: fx.GraphModule) -> list[UnpackedProjection]:
    """Rewrite every projection packed per group (module docstring), in place; the records (also
    added to ``gm.meta[RECORDS_KEY]``)."""
    mode = _fake(gm)
    done: list[UnpackedProjection] = []
    for p in list(gm.graph.nodes):
        found = _weight_of(p) if p.op == "call_function" else None
        if found is None or mode is None or _shape(p) is None:
            continue
        lead = len(_shape(p)) - 1
        packed = _packed_view(p, lead)
        if packed is None:
            continue
        view, dim = packed
        ranges = _ranges(gm, view, dim)
        if ranges is None:
            continue
        record = _rewrite(gm, mode, p, found, view, dim, ranges)
        if record is not None:
            done.append(record)
    if done:
        gm.graph.lint()
        gm.recompile()
        gm.meta[RECORDS_KEY] = gm.meta.get(RECORDS_KEY, ()) + tuple(done)
    return done


def _rewrite(gm: fx.GraphModule, mode, p: fx.Node, found: tuple[fx.Node, int], view: fx.Node, dim: int,
             ranges: list[tuple[int, int, fx.Node, bool]]) -> UnpackedProjection | None:
    w_node, wdim = found
    shape = _shape(view)
    lead = len(_shape(p)) - 1
    outer, slots, inner = shape[lead:dim], shape[dim], shape[dim + 1:]
    n_outer, n_inner = math.prod(outer), math.prod(inner)
    bias = p.args[2] if p.target == aten.linear.default and len(p.args) > 2 else None
    if not _read_once(gm, w_node) or (bias is not None and not _read_once(gm, bias)):
        return None  # (read elsewhere too, or a bias computed in the graph: left as it is)
    weight = get_attr_path(gm, str(w_node.target))
    if weight.dim() != 2 or weight.shape[wdim] != n_outer * slots * n_inner:
        return None
    rows = torch.arange(n_outer * slots * n_inner).view(n_outer, slots, n_inner)
    perm = torch.cat([rows[:, a:b].reshape(-1) for a, b, _, _ in ranges])
    old = str(w_node.target)
    _replace_attr(gm, w_node, _new_name(old), perm, wdim)  # (same shapes: every meta value stands)
    if bias is not None:
        _replace_attr(gm, bias, _new_name(str(bias.target)), perm, 0)
    sizes = [n_outer * (b - a) * n_inner for a, b, _, _ in ranges]
    g = gm.graph
    with g.inserting_after(p):
        split = _call(g, mode, aten.split_with_sizes.default, (p, sizes, -1), p)
    at = split
    for i, (a, b, user, keep) in enumerate(ranges):
        with g.inserting_after(at):
            piece = _call(g, mode, operator.getitem, (split, i), p)
        block = [*outer, b - a, *inner] if keep else [*outer, *inner]
        merged = _merged_user(user, keep, lead, n_outer * (b - a), inner)
        with g.inserting_after(piece):
            at = _call(g, mode, aten.unflatten.int,
                       (piece, -1, [n_outer * (b - a), *inner] if merged is not None else block), user)
        (merged or user).replace_all_uses_with(at)
        index = [a for a in user.all_input_nodes if a is not view] if user.target == aten.index.Tensor else []
        for n in (merged, user, *index, *(a.all_input_nodes[0] for a in index if a.all_input_nodes)):
            if n is not None and not n.users:
                g.erase_node(n)
    dead, n = [], view
    while n is not p:  # the view chain, and the slices keeping everything between it and the ranges
        dead.append(n)
        n = n.args[0]
    frontier = list(view.users)
    while frontier:
        u = frontier.pop()
        if _identity(u) or u.target in (*_SPLITS, aten.unbind.int):
            dead.insert(0, u)
            frontier.extend(u.users)
    for n in sorted(dead, key=_position(g), reverse=True):  # (users before what they read)
        if not n.users:
            g.erase_node(n)
    return UnpackedProjection(p.name, old, n_outer, tuple((a, b) for a, b, _, _ in ranges))


def _position(g: fx.Graph):
    order = {n: i for i, n in enumerate(g.nodes)}
    return order.__getitem__


def _new_name(old: str) -> str:
    return "afd_unpacked_" + old.replace(".", "_")


def _read_once(gm: fx.GraphModule, n: object) -> bool:
    """``n`` is a get_attr node with one user and the only node reading its attribute."""
    return isinstance(n, fx.Node) and n.op == "get_attr" and len(n.users) == 1 and \
        sum(m.op == "get_attr" and m.target == n.target for m in gm.graph.nodes) == 1


def _replace_attr(gm: fx.GraphModule, n: fx.Node, target: str, perm: torch.Tensor, dim: int) -> None:
    """Point get_attr ``n`` at a new attribute ``target``: its old value permuted along
    ``dim``; the old attribute deleted (``n`` was its only reader)."""
    old = str(n.target)
    value = get_attr_path(gm, old)
    set_attr_path(gm, target, torch.nn.Parameter(value.detach().index_select(dim, perm).contiguous(),
                                                 requires_grad=False))
    n.target = target
    del_attr_path(gm, old)


def _merged_user(user: fx.Node, keep: bool, lead: int, heads: int, inner: tuple) -> fx.Node | None:
    """``user``'s one user when it merges the groups and the slot range into one heads dim
    (``flatten`` / ``view`` to ``[..., groups x slots, *inner]``): replaced by the block's own
    view of that shape."""
    if not keep or len(user.users) != 1:
        return None
    (u,) = user.users
    shape = _shape(u)
    if u.target in _MERGES and shape is not None and tuple(shape[lead:]) == (heads, *inner):
        return u
    return None
