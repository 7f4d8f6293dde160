"""Following the split dimension from a column-parallel output to its row-parallel input, op by
op (the per-op rules are ``rules.py``'s ``RULES``; this walker handles what spans several nodes:
blocked weights cut by chunk / split / slice, reshapes that fold or unfold heads, broadcasts of
replicated KV heads, in-place writes into state)."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from ..op_kinds import LINEAR_OPS, SDPA_OPS
from ..symbolic import sym_expr
from .operands import (
    CHANNEL_OPS,
    Track,
    depthwise_conv,
    join_pieces,
    slice_operands,
    split_attrs,
    split_broadcasts,
    split_factories,
)
from .projections import projection
from .rules import (
    BLOCK_OPS,
    IGNORED,
    RULES,
    VIEW_OPS,
    Replicate,
    ShardRule,
    expands_single_head,
    folded_view,
    ndim,
    one_head_broadcast,
    repeat_replicated,
    shape_of,
)
from .types import ArgFix, ShardError

aten = torch.ops.aten
EXPANDS = (aten.expand.default, aten.broadcast_to.default)

#: in-place writes into a state tensor (a KV cache update): op -> position of the value written
STATE_WRITES = {aten.index_copy_.default: 3, aten.index_put_.default: 2}


def _write_into_state(n: fx.Node, t: Track, where: str) -> bool:
    """``n`` writes a split value into an unsplit tensor in place (``cache.index_copy_(2, pos,
    k)``, a KV cache update): the cache becomes split like the value (each rank keeps its heads,
    :class:`ShardedState`), and so does every read of it. False when ``n`` is not such a write."""
    pos = STATE_WRITES.get(n.target)
    if pos is None or len(n.args) <= pos or not isinstance(n.args[pos], fx.Node) or n.args[pos] not in t.dim:
        return False
    dest, value = n.args[0], n.args[pos]
    if dest in t.dim:
        return False  # already split: the op's own rule follows it
    if ndim(dest) != ndim(value):
        raise ShardError(f"{where}: {n.name} ({n.target}) writes a {ndim(value)}-d split value into a "
                         f"{ndim(dest)}-d tensor; only same-rank cache writes are understood")
    d = t.dim[value]
    if n.target == aten.index_copy_.default and n.args[1] % ndim(dest) == d:
        raise ShardError(f"{where}: {n.name} indexes the split dim {d} of {dest.name}")
    size = sym_expr(dest.meta["val"].shape[d])
    if not size.is_Integer or int(size) % t.factor[value]:
        raise ShardError(f"{where}: {n.name} writes {t.factor[value]} slices of dim {d} into {dest.name}, whose "
                         f"dim {d} has size {size}")
    for x in (dest, n):
        t.dim[x], t.factor[x], t.origin[x] = d, t.factor[value], t.origin.get(value)
    t.states.append((dest, d, t.factor[value]))
    return True


def _cut_into_blocks(n: fx.Node, src: fx.Node, t: Track) -> None:
    """``n`` cuts ``src`` along its split dim: ``src`` must be one column's whole output; the
    cut's boundaries become weight blocks. Its sizes and bounds are fixed once every block's
    per-rank size is known (:func:`block_fixes`)."""
    key = t.origin.get(src)
    d = t.dim[src]
    size = sym_expr(src.meta["val"].shape[d])
    if key is None or key[1] is not None or not size.is_Integer or int(size) != t.width(key[0]):
        raise ShardError(f"{n.name} ({n.target}) cuts along the split dim a tensor that is not one projection's "
                         "whole output")
    col, full = key[0], int(size)
    if n.target == aten.chunk.default:
        k = n.args[1]
        if full % k:
            raise ShardError(f"{n.name}: chunk of {full} features into {k} pieces is uneven")
        starts = list(range(0, full, full // k))
        t.cuts.extend((col, n, -1, None, a, a + full // k) for a in starts)  # arg -1: check equal pieces only
    elif n.target == aten.tensor_split.indices:  # (Qwen3-Next's q | k | v after their convolution)
        bounds = list(n.args[1])
        if any(not isinstance(x, int) or not 0 < x < full for x in bounds):
            raise ShardError(f"{n.name}: tensor_split bounds along the split dim must be constants inside it")
        starts = [0, *bounds]
        t.cuts.extend((col, n, 1, i, v, v) for i, v in enumerate(bounds))  # bounds: per-rank offsets
    elif n.target in (aten.split.Tensor, aten.split_with_sizes.default):
        sizes = n.args[1]
        if isinstance(sizes, int):
            sizes = [sizes] * (full // sizes) + ([full % sizes] if full % sizes else [])
            t.cuts.extend((col, n, 1, None, a, a + sizes[0]) for a in range(0, full - full % sizes[0], sizes[0]))
        elif any(not isinstance(x, int) for x in sizes):
            raise ShardError(f"{n.name}: split sizes along the split dim must be constants")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        if n.target == aten.split_with_sizes.default:
            t.cuts.extend((col, n, 1, i, a, a + sizes[i]) for i, a in enumerate(starts))
    else:  # slice(src, dim, start, end, step)
        start, end = (list(n.args[2:4]) + [None, None])[:2]
        start, end = start or 0, full if end is None else min(end, full)
        step = n.args[4] if len(n.args) > 4 else 1
        if isinstance(step, int) and step > 1 and 0 <= start < step and end == full:
            # every step-th feature from start (GPT-OSS's interleaved gate_up: [..., ::2], [..., 1::2]):
            # a rank's contiguous slice holds whole groups of step features when step divides it,
            # and the same slice of it picks that rank's share of each interleaved piece. Not a block
            # of the column (no starts): the piece's origin is no block either
            if full % (t.factor[src] * step):
                raise ShardError(f"{n.name}: every {step}th feature of {full}, interleaved, over {t.factor[src]} "
                                 f"ranks: a rank's slice must hold whole groups of {step}")
            t.pieces[n] = (col, [])
            return
        if step != 1 or start < 0 or end < 0:
            raise ShardError(f"{n.name}: only forward unit-step slices with non-negative bounds cut a fused projection")
        starts = [start]
        for i, v in ((2, start), (3, end)):
            if len(n.args) > i and n.args[i] not in (None, 0) and v < full:
                t.cuts.append((col, n, i, None, v, v))  # a bound: its new value is the per-rank offset of v
        t.blocks.setdefault(col, set()).add(end)
    t.blocks.setdefault(col, set()).update(starts)
    t.pieces[n] = (col, starts)


# ops a block dim passes unchanged in meaning, and those that take a fused projection's blocks apart
_MOVES = {aten.permute.default, aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim,
          aten.contiguous.default, aten.clone.default, aten._to_copy.default, aten.alias.default}


_TAKE_APART = {aten.select.int, aten.unbind.int, aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default,
               aten.tensor_split.indices}


def _taken_apart(n: fx.Node, dim: int) -> bool:
    """Some later op selects / unbinds / chunks dim ``dim`` of ``n`` (followed through permutes, transposes,
    (un)squeezes and copies, by their own shard rules): that dim enumerates the blocks of a fused projection."""
    stack = [(n, dim)]
    while stack:
        x, d = stack.pop()
        for u in x.users:
            if u.op != "call_function" or u.args[0] is not x:
                continue
            if u.target in _TAKE_APART:
                pos = 2 if u.target in (aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default) else 1
                if (u.args[pos] if len(u.args) > pos else u.kwargs.get("dim", 0)) % ndim(x) == d:
                    return True
            elif u.target in _MOVES:
                try:
                    stack.append((u, RULES[u.target].fn(u, {x: d}, 1, None)))
                except ShardError:
                    continue  # (a squeeze of that very dim: not taken apart)
    return False


def _fused_reshape(n: fx.Node, src: fx.Node, t: Track) -> int | None:
    """``n`` views one column's whole output ``[.., F]`` as ``[.., k, H, ..]`` and a later op takes
    the ``k`` pieces apart (``qkv.reshape(B, S, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)`` as timm
    and many hand-written models write it; PyTorch's MultiheadAttention ``unflatten(-1, (3, E))``):
    the output dim of the blocks, else None."""
    if t.origin.get(src) is None or t.origin[src][1] is not None:
        return None
    d, ishape, oshape = t.dim[src], shape_of(src), shape_of(n)
    if n.target == aten.unflatten.int:
        j = n.args[1] % ndim(src)
        if j != d:
            return None
    else:
        if len(oshape) < d + 2 or any(sympy.simplify(a - b) != 0 for a, b in zip(ishape[:d], oshape[:d], strict=False)):
            return None
        j = d
    k, rest = oshape[j], sympy.Integer(1)
    for x in oshape[j + 1 :]:
        rest *= x
        if sympy.simplify(k * rest - ishape[d]) == 0:
            break
    else:
        return None
    if not (k.is_Integer and int(k) > 1 and j + 1 < len(oshape)) or int(ishape[d]) != t.width(t.origin[src][0]):
        return None
    return j if _taken_apart(n, j) else None


def _follow_folded(n: fx.Node, src: fx.Node, rule: ShardRule | None, t: Track, f: int, parts: int,
                   fixes: list[ArgFix]) -> int:
    """The split dim of ``n``, reading a tensor whose heads are folded into its split dim (``t.inner``):
    a view folds or unfolds them (:func:`~.rules.folded_view`); any other op with a rule keeps the folded
    dim (a ``bmm`` over batch x heads, a softmax, a transpose), refusing an unsplit operand spanning it."""
    if rule is None:
        raise ShardError(f"no sharding rule for {n.name} ({n.target}) on a tensor split over its heads")
    if f != parts:
        raise ShardError(f"{n.name}: replicated KV heads folded into another dim")
    if n.target in VIEW_OPS:
        d, outer = folded_view(n, t.dim[src], t.inner[src], parts, fixes)
        if outer is not None:
            t.inner[n] = outer
        return d
    if rule.kind == "reshape" or n.target in BLOCK_OPS or (
            n.target == aten.mean.dim and t.dim[src] in _reduced_dims(n, src)):
        raise ShardError(f"{n.name} ({n.target}) on heads folded into another dim is not understood")
    sliced: dict[fx.Node, int] = {}
    if rule.kind == "elementwise" or n.target == aten.baddbmm.default:
        # an unsplit tensor over the whole folded dim (BLOOM's ALiBi bias [batch * heads, 1, keys]):
        # read per rank as its heads of each batch entry
        d = t.dim[src] + ndim(n) - ndim(src)
        full = sym_expr(n.meta["val"].shape[d])
        heads = sympy.simplify(full / t.inner[src])
        for a in n.all_input_nodes:
            if a in t.dim or a.op == "get_attr" or not isinstance(a.meta.get("val"), torch.Tensor):
                continue
            ad = d - (ndim(n) - ndim(a))
            if ad >= 0 and sympy.simplify(sym_expr(a.meta["val"].shape[ad]) - full) == 0 and heads.is_Integer:
                t.operands.append((n, a, ad, f, None, int(heads)))
                sliced[a] = ad
    d = rule.fn(n, {**t.dim, **sliced} if sliced else t.dim, f, fixes)
    t.inner[n] = t.inner[src]
    return d


def _cut_reshape_into_blocks(n: fx.Node, src: fx.Node, t: Track, j: int, parts: int, fixes: list[ArgFix],
                             where: str) -> int:
    """The fused view :func:`_fused_reshape` found: the column is cut into ``k`` equal blocks (each
    rank its slice of every block) and the dim after the blocks (the heads) is the split dim, its
    constant size divided."""
    col, full = t.origin[src][0], t.width(t.origin[src][0])
    k = int(shape_of(n)[j])
    if full % k:
        raise ShardError(f"{where}: {n.name} views {full} features as {k} blocks unevenly")
    starts = list(range(0, full, full // k))
    t.cuts.extend((col, n, -1, None, a, a + full // k) for a in starts)
    t.blocks.setdefault(col, set()).update(starts)
    arg, index = (2, 1) if n.target == aten.unflatten.int else (1, j + 1)
    size = n.args[arg][index]
    heads = shape_of(n)[j + 1]
    if not heads.is_Integer or int(heads) % parts or int(heads) < parts:
        raise ShardError(f"{where}: {n.name} views {col.name}'s output as {k} blocks of {heads} along dim {j + 1}, "
                         f"which {parts} ranks cannot divide")
    if isinstance(size, int) and size != -1:
        fixes.append(ArgFix(n.name, index, size, size // parts, arg=arg))
    elif not isinstance(size, int):
        raise ShardError(f"{where}: {n.name}: the split dim {j + 1} has a symbolic size ({size})")
    return j + 1


def block_fixes(col: fx.Node, t: Track, parts: int, fixes: list[ArgFix]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-block sizes and replication of a column, and the fixed sizes/bounds of its cuts."""
    full = t.width(col)
    bounds = sorted({0, full} | {b for b in t.blocks.get(col, set()) if 0 < b < full})
    blocks = [(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    whole = t.replicate.get((col, None), 1)
    rep = [t.replicate.get((col, a), whole) for a, _ in blocks]
    local = []  # per-rank size of each block
    for (a, b), k in zip(blocks, rep, strict=True):
        if (b - a) % (parts // k):
            raise ShardError(f"{col.name}: block [{a}:{b}] of its output does not divide into {parts // k} slices")
        local.append((b - a) // (parts // k))

    def offset(x: int) -> int:
        return sum(sz for (a, _), sz in zip(blocks, local, strict=True) if a < x)

    chunks: dict[fx.Node, set[int]] = {}
    for c, n, arg, index, start, end in t.cuts:
        if c is not col:
            continue
        if arg == -1:
            chunks.setdefault(n, set()).add(offset(end) - offset(start))
        elif start == end:  # a slice bound (a tensor_split's: index in its list)
            fixes.append(ArgFix(n.name, index, start, offset(start), arg=arg))
        else:
            fixes.append(ArgFix(n.name, index, end - start, offset(end) - offset(start), arg=arg))
    for n, sizes in chunks.items():
        if len(sizes) != 1:
            raise ShardError(f"{n.name}: chunk pieces get unequal per-rank sizes {sorted(sizes)} (replicated heads)")
    if len(blocks) == 1:
        return (), (whole,) if whole > 1 else ()
    return tuple(b - a for a, b in blocks), tuple(rep) if any(k > 1 for k in rep) else ()


def _reduced_dims(n: fx.Node, src: fx.Node) -> list[int]:
    dims = n.args[1] if len(n.args) > 1 else list(range(ndim(src)))
    return [x % ndim(src) for x in (dims if isinstance(dims, (list, tuple)) else [dims])]


class WholeBlocks(Exception):
    """Blocks of a fused projection that are one head with no head dim (multi-query K and V): replicate whole."""

    def __init__(self, blocks: set) -> None:
        super().__init__(blocks)
        self.blocks = blocks


def _broadcast_heads(x: fx.Node, heads: int, f: int, fixes: list[ArgFix], where: str) -> None:
    """An unsplit K/V (one head, replicated whole) repeated to every query head by
    ``reshape(expand(k, [.., heads, ..]), [b, heads, s, d])``: repeat it to this rank's heads."""
    d = ndim(x) - 3
    if x.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default) and len(x.users) == 1:
        arg = x.args[1][d] if d < len(x.args[1]) else None
        if arg == heads:
            fixes.append(ArgFix(x.name, d, heads, heads // f))
            x = x.args[0]
    if x.target in (aten.expand.default, aten.broadcast_to.default) and len(x.users) == 1:
        inner = x.args[0]
        hits = [j for j, a in enumerate(x.args[1]) if a == heads and sym_expr(inner.meta["val"].shape[j]) == 1]
        if len(hits) == 1:
            fixes.append(ArgFix(x.name, hits[0], heads, heads // f))
            return
    raise ShardError(f"{where}: {x.name} ({x.target}) reaches attention unsplit and is not a single head "
                     f"expanded to the {heads} query heads")


@dataclass
class _Walk:
    """The context of one follow: what is tracked, the group, and where argument fixes go."""

    gm: fx.GraphModule
    t: Track
    rows: set[fx.Node]
    parts: int
    group: str
    fixes: list[ArgFix]
    where: str
    whole: frozenset  # blocks replicated whole: every rank computes the same, not followed
    merged: dict[fx.Node, int] = field(default_factory=dict)  # expands whose split spans dims d, d+1 (KV)
    pending: list[fx.Node] = field(default_factory=list)  # nodes to follow besides a step's own


def follow_split(gm: fx.GraphModule, columns: list[fx.Node], rows: set[fx.Node], parts: int, group: str,
                 fixes: list[ArgFix], where: str, whole: frozenset = frozenset()) -> Track:
    """Follow the split dim from ``columns`` (split along their last dim) through their users in
    graph order, one :func:`_step` per node, until every path ends at a row-parallel input in
    ``rows``, a mean over the split dim, a state write returned whole, or a refusal."""
    t = Track({c: ndim(c) - 1 for c in columns}, {c: parts for c in columns}, {c: (c, None) for c in columns},
               {}, {}, {}, [])
    for key in whole:
        t.replicate[key] = parts
    w = _Walk(gm, t, rows, parts, group, fixes, where, whole)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    frontier = sorted({u for c in columns for u in c.users}, key=order.__getitem__)
    seen: set[fx.Node] = set()
    while frontier:
        n = frontier.pop(0)
        if n in seen or n in t.dim:
            continue
        seen.add(n)
        frontier.extend(_step(n, w))
        frontier.extend(w.pending)
        w.pending.clear()
        frontier.sort(key=order.__getitem__)
    return t


def _step(n: fx.Node, w: _Walk) -> Iterable[fx.Node]:
    """Settle ``n``'s split dim (or refuse it); returns the nodes to follow next."""
    t, sdim, where = w.t, w.t.dim, w.where
    split_in = [a for a in n.all_input_nodes if a in sdim]
    if _ends_here(n, split_in, w):
        return ()
    folded = [a for a in split_in if a in t.inner]
    if folded and n.target in STATE_WRITES:
        raise ShardError(f"{where}: {n.name} ({n.target}) reads {folded[0].name}, whose heads are folded into "
                         "another dim")
    if _write_into_state(n, t, where):
        return set(n.args[0].users) | set(n.users)
    factors = {t.factor[a] for a in split_in}
    gqa = n.target == aten.scaled_dot_product_attention.default and n.kwargs.get("enable_gqa")
    if len(factors) > 1 and not gqa and not one_head_broadcast(n, split_in, t.factor, t.dim):
        raise ShardError(f"{where}: {n.name} ({n.target}) combines tensors split into different numbers of "
                         f"heads per rank ({sorted(factors)}): heads replicated over ranks (fewer KV heads or "
                         f"groups than the {w.parts} ranks) meet heads split over all of them; the layout must "
                         "divide the KV head count, or repeat the KV heads to the query heads before they meet")
    src0 = n.args[0] if n.args and isinstance(n.args[0], fx.Node) and n.args[0] in sdim else split_in[0]
    f = t.factor[src0]
    origins = {t.origin[a] for a in split_in}
    if _cut_by_block_op(n, src0, t, f):
        return n.users
    w.pending.extend(split_factories(n, src0, t, w.fixes))  # (their other readers are followed too)
    if n.target == aten.repeat_interleave.self_int and f < w.parts:  # (replicated KV heads to the queries')
        f = repeat_replicated(n, sdim[src0], f, w.parts, w.fixes)
    if join_pieces(n, src0, t, w.parts):
        return n.users
    if n.target in CHANNEL_OPS:  # (a depthwise convolution over the split channels: its weight sliced)
        sdim[n], t.factor[n] = depthwise_conv(w.gm, n, src0, t, w.parts, w.fixes), f
        return _settle_origin(n, t, origins, w.whole)
    rule = RULES.get(n.target)
    if folded:  # no per-rank slice of an unsplit operand along folded heads: the rules refuse it
        try:
            sdim[n] = _follow_folded(n, src0, rule, t, f, w.parts, w.fixes)
        except ShardError as e:
            raise ShardError(f"{where}: {e} (on heads folded into another dim, as BLOOM's baddbmm and "
                             "XGLM's bmm over batch x heads have them)") from None
        t.factor[n], t.origin[n] = f, None
        return n.users
    sliced: dict[fx.Node, int] = {}
    if rule is not None and rule.kind == "elementwise" and n.args and src0 in sdim:
        split_attrs(w.gm, n, src0, t)
        split_broadcasts(n, src0, t, w.fixes, where)
        sliced = slice_operands(n, src0, t)
    elif n.target == aten.cat.default:  # (GPT-OSS's attention sinks, one per head, joined to the scores)
        sliced = slice_operands(n, src0, t)
    if n.target == aten.mean.dim and sdim[src0] in _reduced_dims(n, src0):
        # equal slices per rank, so (sum of slice means) / parts is the full mean; with
        # replicated KV heads too (each distinct slice counted parts / factor times)
        t.means.append(n)  # replicated once all-reduced: its users see an unsplit value
        return ()
    if rule is not None and rule.kind == "reshape":
        f, origins = _reshape(n, src0, rule, f, origins, w)
    elif rule is not None:
        _apply_rule(n, src0, rule, f, sliced, w)
    elif n.target in LINEAR_OPS:
        raise ShardError(f"{where}: {n.name} ({n.target}) reads a split tensor but is not the row-parallel "
                         "projection")
    else:
        raise ShardError(f"{where}: no sharding rule for {n.name} ({n.target}) on a tensor split over {w.group}")
    t.factor[n] = t.factor[n.args[0]] if gqa else f
    return _settle_origin(n, t, origins, w.whole)


def _ends_here(n: fx.Node, split_in: list[fx.Node], w: _Walk) -> bool:
    """A row-parallel input, the graph output (a cache returned whole), an ignored op or a size
    read: the path ends at ``n`` (or is refused there)."""
    t, where = w.t, w.where
    if n in w.rows:
        a = projection(n).x
        if t.dim.get(a) != ndim(a) - 1 or a in t.inner:
            raise ShardError(f"{where}: row-parallel {n.name} gets an input not split along its last dim")
        if t.factor[a] != w.parts:
            raise ShardError(f"{where}: row-parallel {n.name} reads heads replicated over {w.parts // t.factor[a]} "
                             f"ranks; only KV heads may be replicated (the layout must divide the attention "
                             f"head count; {w.parts} ranks here)")
        return True
    if n.op == "output":
        caches = {s for s, _, _ in t.states}
        if split_in and all(a in caches or (a.target in STATE_WRITES and a.args[0] in caches) for a in split_in):
            return True  # a cache returned whole to the caller (each rank wrote its own slice of it)
        raise ShardError(f"{where}: a tensor split over the {w.group} group reaches the graph output via {n.args}")
    if n.target in IGNORED or (n.op == "call_module" and n.target == "_guards_fn"):  # export's input guards
        return True
    if n.target == aten.sym_size.int:  # a size: the same on every rank unless it is the split dim's
        if n.args[1] % ndim(n.args[0]) == t.dim[n.args[0]]:
            raise ShardError(f"{where}: {n.name} reads the size of the split dim {t.dim[n.args[0]]} of "
                             f"{n.args[0].name}, which differs per rank")
        return True
    return False


def _cut_by_block_op(n: fx.Node, src0: fx.Node, t: Track, f: int) -> bool:
    """A chunk / split / slice along the split dim: the column's blocks (False: not one)."""
    if n.target not in BLOCK_OPS or n.args[0] not in t.dim:
        return False
    pos = 1 if n.target == aten.slice.Tensor else 2
    dim_arg = n.args[pos] if len(n.args) > pos else n.kwargs.get("dim", 0)
    if dim_arg % ndim(src0) != t.dim[src0]:
        return False
    _cut_into_blocks(n, src0, t)
    col, starts = t.pieces[n]
    t.dim[n], t.factor[n] = t.dim[src0], f
    t.origin[n] = (col, starts[0]) if n.target == aten.slice.Tensor and starts else None
    return True


def _reshape(n: fx.Node, src0: fx.Node, rule: ShardRule, f: int, origins: set, w: _Walk) -> tuple[int, set]:
    """A view / reshape / expand of a split tensor: the dim it moves to, with heads folded into the
    dim before them, heads replicated (fewer heads than ranks), and KV heads repeated by an expand
    that is merged back. Returns the factor and origins of ``n``."""
    t, sdim, where, parts, fixes = w.t, w.t.dim, w.where, w.parts, w.fixes
    blocks_at = _fused_reshape(n, src0, t)
    if blocks_at is not None:
        sdim[n] = _cut_reshape_into_blocks(n, src0, t, blocks_at, f, fixes, where)
        return f, {None}  # each rank's slice of every block, no one block
    try:
        sdim[n] = rule.fn(n, sdim, f, fixes)
    except ShardError as e:  # the heads folded into the dim before them: [B, H, S, D] -> [B*H, S, D]
        if n.target not in VIEW_OPS or f != parts:
            raise
        try:
            sdim[n], t.inner[n] = folded_view(n, sdim[src0], None, parts, fixes)
        except ShardError:
            raise ShardError(f"{e} (nor do the heads fold into the dim before them)") from None
    except Replicate as r:
        key = t.origin.get(src0)
        if key is None:
            raise ShardError(f"{where}: {n.name} reshapes into {r.heads} heads, fewer than {f} ranks, and "
                             "the heads do not come from one projection that could be replicated") from None
        t.replicate[key] = f // r.heads
        f = t.factor[src0] = r.heads
        sdim[n] = rule.fn(n, sdim, f, fixes)
    if src0 in w.merged:
        j, m = sdim[n], w.merged[src0]
        want = sym_expr(src0.meta["val"].shape[m]) * sym_expr(src0.meta["val"].shape[m + 1])
        if sympy.simplify(sym_expr(n.meta["val"].shape[j]) - want) != 0:
            raise ShardError(f"{where}: {n.name} does not merge the replicated KV heads back into one dim")
    elif n.target in EXPANDS and f == 1 and expands_single_head(n, src0, sdim[n], parts):
        fixes.append(ArgFix(n.name, sdim[n], n.args[1][sdim[n]], n.args[1][sdim[n]] // parts))
        f = parts
    elif n.target in EXPANDS and f < parts:
        d = sdim[n]
        arg = n.args[1][d + 1] if d + 1 < len(n.args[1]) else None
        insize = shape_of(src0)[d + 1 - (ndim(n) - ndim(src0))] if d + 1 < ndim(n) else None
        if not (isinstance(arg, int) and insize == 1 and arg % (parts // f) == 0):
            raise ShardError(f"{where}: {n.name}: replicated KV heads must be repeated by an expand of a "
                             f"size-1 dim after the head dim divisible by {parts // f}")
        fixes.append(ArgFix(n.name, d + 1, arg, arg // (parts // f)))
        w.merged[n] = d
        f = parts
    return f, origins


def _apply_rule(n: fx.Node, src0: fx.Node, rule: ShardRule, f: int, sliced: dict[fx.Node, int], w: _Walk) -> None:
    """A table rule; SDPA first broadcasts an unsplit single K/V head to this rank's heads."""
    t, sdim, where = w.t, w.t.dim, w.where
    if n.target in SDPA_OPS and n.args[0] in sdim:
        q = n.args[0]
        heads = int(sym_expr(q.meta["val"].shape[-3]))  # (meta holds the unsharded shape)
        single = {t.origin.get(x) for x in n.args[1:3] if x in sdim and sdim[x] == ndim(x) - 1}
        if single and None not in single and all(k[1] is not None for k in single):
            raise WholeBlocks(single)
        for x in n.args[1:3]:
            if x not in sdim and isinstance(x, fx.Node):
                _broadcast_heads(x, heads, t.factor[q], w.fixes, where)
                sdim[x], t.factor[x], t.origin[x] = ndim(x) - 3, t.factor[q], None
    m = w.merged.get(src0)  # (a flatten of the repeated KV heads' two dims merges them)
    flat = [i % ndim(src0) for i in n.args[1:3]] if n.target == aten.flatten.using_ints else None
    if m is not None and flat != [m, m + 1]:
        raise ShardError(f"{where}: {n.name} ({n.target}) reads repeated KV heads before they are merged")
    sdim[n] = rule.fn(n, {**sdim, **sliced} if sliced else sdim, f, w.fixes)


def _settle_origin(n: fx.Node, t: Track, origins: set, whole: frozenset) -> Iterable[fx.Node]:
    """The column block ``n`` comes from (one piece of a chunk / split names its block); a block
    replicated whole is not followed further."""
    if n.target == operator.getitem and n.args[0] in t.pieces:  # one piece of a chunk/split
        col, starts = t.pieces[n.args[0]]
        t.origin[n] = (col, starts[n.args[1]])
        if t.origin[n] in whole:  # replicated whole: every rank computes the same, not followed
            del t.dim[n]
            return ()
    else:
        t.origin[n] = origins.pop() if len(origins) == 1 else None
    return n.users
