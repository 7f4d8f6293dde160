"""Tensor-parallel sharding: find column- and row-parallel linears, follow the split dimension
through the graph, fix head counts in reshapes, and slice the weights per rank.

Megatron style. In each layer's attention the projections that feed the attention op (q/k/v or a
fused qkv) are column-parallel over the attention TP group and the projection after it (o_proj)
is row-parallel; in a dense MLP the linears feeding the last one (gate/up or fused gate_up) are
column-parallel over the TP group and the last (down) is row-parallel. A row-parallel output is a
partial sum: the collective that settles it is inserted by the TP rewrite (tp_rewrite.py).

The split dimension is followed node by node (``rules.py``: one rule per op in ``RULES``) from each
column-parallel output to the row-parallel input. Reshapes with a constant head count get the
count divided (``view(q, [b, s, 4, 16]) -> view(q, [b, s, 2, 16])`` at tp=2); ``-1`` entries are
left alone. Before / after, one attention at tp=2 (heads 4 -> 2)::

    linear(x, q_proj.weight[64, 64])              linear(x, q_proj.weight[32, 64])     # rows r*32..
    view(q, [s0, s1, -1, 16])                     view(q, [s0, s1, -1, 16])
    expand(k, [s0, 2, 2, s1, 16])                 expand(k, [s0, 1, 2, s1, 16])
    reshape(k, [s0, 4, s1, 16])                   reshape(k, [s0, 2, s1, 16])
    linear(attn, o_proj.weight[64, 64])           linear(attn, o_proj.weight[64, 32])  # partial sum

A tensor cut along the split dim (``chunk``/``split``/``slice`` of a fused gate_up or qkv output)
makes the weight blocked: each rank takes its slice of every block and the cut's sizes are
re-computed per rank. A reshape into fewer heads than ranks (KV heads below attn_tp) replicates
that projection's heads: ranks ``r // k`` share a slice, and repeat_kv's expand repeats ``k``
fewer times. MoE experts are 3-D weights read by a grouped matmul ``(x[N, in], w[E, in, out])``;
they shard like linears along the intermediate size, and the partial sum is settled once on the
block output, which must be linear in it (routing weights scale it, the combine sums it).

Anything the rules do not know that touches a split tensor is an error naming the node.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from ..graph_utils import attention_output, get_attr_path, layers_of, reads_weight
from ..roles import LINEAR_OPS, SDPA_OPS, Role, is_attention_op, role_of
from ..symbolic import sym_expr
from .rules import (
    BLOCK_OPS,
    IGNORED,
    RULES,
    VIEW_OPS,
    Replicate,
    ShardRule,
    folded_view,
    ndim,
    shape_of,
)
from .types import (
    ArgFix,
    OnceOperand,
    ShardedState,
    ShardedWeight,
    ShardError,
    ShardPlan,
    SlicedOperand,
)

aten = torch.ops.aten
META_KEY = "afd.shard"

__all__ = ["META_KEY", "RULES", "ArgFix", "ShardError", "ShardPlan", "ShardRule", "ShardedState", "ShardedWeight",
           "OnceOperand", "SlicedOperand",
           "apply_shards", "one_slice_per_weight",
           "Projection", "is_expert_mm", "is_grouped_mm", "plan_shards", "projection", "reads_weight", "shard_tensor"]




# --- following the split dimension -----------------------------------------------------------


def is_grouped_mm(node: fx.Node) -> bool:
    """A grouped (per-expert) matmul ``(x[N, in], w[E, in, out], offsets) -> [N, out]``:
    ``aten._grouped_mm`` or a library op named like it (transformers' ``grouped_mm_fallback``)."""
    t = node.target
    return node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and "grouped_mm" in t.name()


def is_expert_mm(node: fx.Node) -> bool:
    """A matmul of activations with a 3-D expert weight attribute ``w[E, in, out]`` (through
    transposes and casts): a grouped matmul, or ``bmm(x[E, T, in], w)`` (stacked experts, as
    transformers' ``batched_mm`` experts and hand-written MoEs compute them). Either is tensor-
    sharded like a linear: column-parallel on ``out``, row-parallel on ``in``."""
    if is_grouped_mm(node):
        return True
    if node.op != "call_function" or node.target != aten.bmm.default:
        return False
    try:
        _expert_weight(node, 2)
    except ShardError:
        return False
    return True


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


def _expert_weight(mm: fx.Node, operand_dim: int) -> tuple[fx.Node, int]:
    """The 3-D expert weight a grouped matmul reads, and which of its dims is the operand's
    ``operand_dim`` (1: in features, 2: out features), looking through transposes and casts."""
    w, dim = mm.args[1], operand_dim
    while isinstance(w, fx.Node) and w.op != "get_attr":
        if w.target == aten.transpose.int:
            a, b = (x % 3 for x in w.args[1:3])
            dim = a if dim == b else b if dim == a else dim
        elif w.target == aten.permute.default:
            dim = [x % 3 for x in w.args[1]][dim]
        elif w.target not in (aten.to.dtype, aten._to_copy.default, aten.contiguous.default, aten.clone.default):
            raise ShardError(f"{mm.name}: expert weight reaches the grouped matmul through {w.name} ({w.target}); "
                             "only transposes and casts of a graph attribute are understood")
        w = w.args[0]
    if not (isinstance(w, fx.Node) and ndim(w) in (0, 3)):
        raise ShardError(f"{mm.name}: grouped matmul weight is not a 3-D graph attribute ({w})")
    return w, dim


def _out_features(col: fx.Node) -> int:
    return int(col.meta["val"].shape[-1])


Block = tuple[fx.Node, int | None]  # (column, start of a block of its output features | None: all of it)


@dataclass
class _Track:
    """What the follow knows per node: split dim, how many distinct slices the dim is cut into
    (``factor``: below the group size on replicated KV heads), and the column block it comes from."""

    dim: dict[fx.Node, int]
    factor: dict[fx.Node, int]
    origin: dict[fx.Node, Block | None]
    blocks: dict[fx.Node, set[int]]  # column -> block boundaries along its output features
    replicate: dict[Block, int]  # block -> ranks per slice
    pieces: dict[fx.Node, tuple[fx.Node, list[int]]]  # cut node -> (column, start of each output piece)
    cuts: list[tuple[fx.Node, fx.Node, int, int | None, int, int]]  # (column, node, arg, index, start, end)
    means: list[fx.Node] = field(default_factory=list)  # means over the split dim (settled by an all-reduce)
    attrs: list[fx.Node] = field(default_factory=list)  # weights spanning the split dim (a norm's scale)
    states: list[tuple[fx.Node, int, int]] = field(default_factory=list)  # (cache, dim, slices) written split
    # (user, operand, dim, slices, origin of the split input, heads when the dim is batch x heads
    # folded, else 0): unsplit tensors read in slices
    operands: list[tuple[fx.Node, fx.Node, int, int, Block | None, int]] = field(default_factory=list)
    # node -> the outer factor of its split dim, where the heads are folded into it as the inner
    # factor ([B*H, S, D]: B); such a dim is cut per rank as B x (H / parts), not in contiguous slices
    inner: dict[fx.Node, object] = field(default_factory=dict)


#: in-place writes into a state tensor (a KV cache update): op -> position of the value written
STATE_WRITES = {aten.index_copy_.default: 3, aten.index_put_.default: 2}


def _write_into_state(n: fx.Node, t: _Track, where: str) -> bool:
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


def _cut_into_blocks(n: fx.Node, src: fx.Node, t: _Track) -> None:
    """``n`` cuts ``src`` along its split dim: ``src`` must be one column's whole output; the
    cut's boundaries become weight blocks. Its sizes and bounds are fixed once every block's
    per-rank size is known (:func:`_block_fixes`)."""
    key = t.origin.get(src)
    d = t.dim[src]
    size = sym_expr(src.meta["val"].shape[d])
    if key is None or key[1] is not None or not size.is_Integer or int(size) != _out_features(key[0]):
        raise ShardError(f"{n.name} ({n.target}) cuts along the split dim a tensor that is not one projection's "
                         "whole output")
    col, full = key[0], int(size)
    if n.target == aten.chunk.default:
        k = n.args[1]
        if full % k:
            raise ShardError(f"{n.name}: chunk of {full} features into {k} pieces is uneven")
        starts = list(range(0, full, full // k))
        t.cuts.extend((col, n, -1, None, a, a + full // k) for a in starts)  # arg -1: check equal pieces only
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
_TAKE_APART = {aten.select.int, aten.unbind.int, aten.chunk.default, aten.split.Tensor,
               aten.split_with_sizes.default}


def _taken_apart(n: fx.Node, dim: int) -> bool:
    """Some later op selects / unbinds / chunks dim ``dim`` of ``n`` (followed through permutes,
    transposes, (un)squeezes and copies, by their own shard rules): that dim enumerates the blocks
    of a fused projection."""
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


def _fused_reshape(n: fx.Node, src: fx.Node, t: _Track) -> int | None:
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
    if not (k.is_Integer and int(k) > 1 and j + 1 < len(oshape)) or int(ishape[d]) != _out_features(t.origin[src][0]):
        return None
    return j if _taken_apart(n, j) else None


def _follow_folded(n: fx.Node, src: fx.Node, rule: ShardRule | None, t: _Track, f: int, parts: int,
                   fixes: list[ArgFix]) -> int:
    """The split dim of ``n``, which reads a tensor whose heads are folded into its split dim
    (``t.inner``): a view folds or unfolds them (:func:`~.rules.folded_view`); any other op with a
    rule keeps the folded dim as it is (a ``bmm`` over batch x heads, a softmax, a transpose), its
    rule refusing an unsplit operand that spans it."""
    if rule is None:
        raise ShardError(f"no sharding rule for {n.name} ({n.target}) on a tensor split over its heads")
    if f != parts:
        raise ShardError(f"{n.name}: replicated KV heads folded into another dim")
    if n.target in VIEW_OPS:
        d, outer = folded_view(n, t.dim[src], t.inner[src], parts, fixes)
        if outer is not None:
            t.inner[n] = outer
        return d
    if rule.kind == "reshape" or n.target in (aten.mean.dim, *BLOCK_OPS):
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


def _cut_reshape_into_blocks(n: fx.Node, src: fx.Node, t: _Track, j: int, parts: int, fixes: list[ArgFix],
                             where: str) -> int:
    """The fused view :func:`_fused_reshape` found: the column is cut into ``k`` equal blocks (each
    rank its slice of every block) and the dim after the blocks (the heads) is the split dim, its
    constant size divided."""
    col, full = t.origin[src][0], _out_features(t.origin[src][0])
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


def _block_fixes(col: fx.Node, t: _Track, parts: int, fixes: list[ArgFix]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-block sizes and replication of a column, and the fixed sizes/bounds of its cuts."""
    full = _out_features(col)
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
        elif start == end:  # a slice bound
            fixes.append(ArgFix(n.name, None, start, offset(start), arg=arg))
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


def _split_attrs(gm: fx.GraphModule, n: fx.Node, src: fx.Node, t: _Track) -> None:
    """A weight attribute an elementwise op applies along the split dim (a norm's scale over all
    heads, OLMo-2's q_norm) is split with the column it meets: recorded in ``t.attrs``."""
    d = t.dim[src] + ndim(n) - ndim(src)
    for a in n.all_input_nodes:
        if a.op != "get_attr" or a in t.dim:
            continue
        shape = tuple(get_attr_path(gm, a.target).shape)
        ad = d - (ndim(n) - len(shape))
        if ad >= 0 and shape[ad] != 1:
            t.dim[a], t.factor[a], t.origin[a] = ad, t.factor[src], t.origin.get(src)
            t.attrs.append(a)


def _split_broadcasts(n: fx.Node, src: fx.Node, t: _Track, fixes: list[ArgFix], where: str) -> None:
    """An unsplit operand broadcast to the split dim by ``expand`` from size 1 (MLA's shared
    rotary key part, expanded to every head) is split by expanding to this rank's count."""
    d = t.dim[src] + ndim(n) - ndim(src)
    for a in n.all_input_nodes:
        if a in t.dim or not isinstance(a.meta.get("val"), torch.Tensor) or a.op == "get_attr":
            continue
        ad = d - (ndim(n) - ndim(a))
        if ad < 0 or sym_expr(a.meta["val"].shape[ad]) == 1:
            continue
        ok = a.target in (aten.expand.default, aten.broadcast_to.default) and len(a.users) == 1
        arg = a.args[1][ad] if ok and ad < len(a.args[1]) else None
        inner = a.args[0] if ok else None
        ok = ok and isinstance(arg, int) and isinstance(inner, fx.Node) and ndim(inner) == ndim(a) and (
            sym_expr(inner.meta["val"].shape[ad]) == 1) and arg % t.factor[src] == 0
        if not ok:
            continue  # the elementwise rule names it
        fixes.append(ArgFix(a.name, ad, arg, arg // t.factor[src]))
        t.dim[a], t.factor[a], t.origin[a] = ad, t.factor[src], None


def _slice_operands(n: fx.Node, src: fx.Node, t: _Track) -> dict[fx.Node, int]:
    """Unsplit tensors the graph computes (not weights) that the elementwise ``n`` applies along
    the split dim at its full size (an ALiBi bias ``[.., heads, ..]`` added to each rank's heads
    of the scores), or that a ``cat`` along another dim joins to a split tensor (GPT-OSS's
    per-head attention sinks): ``n`` reads this rank's slice of each (:class:`SlicedOperand`).
    Returns operand -> its split dim, for the op's rule to see them split."""
    d = t.dim[src] + ndim(n) - ndim(src)
    full = sym_expr(n.meta["val"].shape[d])  # (meta holds the unsharded shapes)
    out: dict[fx.Node, int] = {}
    for a in n.all_input_nodes:
        if a in t.dim or a.op == "get_attr" or not isinstance(a.meta.get("val"), torch.Tensor):
            continue
        ad = d - (ndim(n) - ndim(a))
        if ad < 0 or sym_expr(a.meta["val"].shape[ad]) != full or not full.is_Integer or int(full) % t.factor[src]:
            continue  # size 1 broadcasts; anything else the elementwise rule names
        t.operands.append((n, a, ad, t.factor[src], t.origin.get(src), 0))
        out[a] = ad
    return out


class _WholeBlocks(Exception):
    """Blocks of a fused projection that are one head without a head dim (multi-query attention's
    K and V): they must be replicated whole, not cut along head_dim."""

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


def _follow(gm: fx.GraphModule, columns: list[fx.Node], rows: set[fx.Node], parts: int, group: str,
            fixes: list[ArgFix], where: str, whole: frozenset = frozenset()) -> _Track:
    t = _Track({c: ndim(c) - 1 for c in columns}, {c: parts for c in columns}, {c: (c, None) for c in columns},
               {}, {}, {}, [])
    for key in whole:
        t.replicate[key] = parts
    sdim = t.dim
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    frontier = sorted({u for c in columns for u in c.users}, key=order.__getitem__)
    seen: set[fx.Node] = set()
    merged: dict[fx.Node, int] = {}  # expand outputs whose split spans dims d and d+1 (replicated KV)
    while frontier:
        n = frontier.pop(0)
        if n in seen or n in sdim:
            continue
        seen.add(n)
        split_in = [a for a in n.all_input_nodes if a in sdim]
        if n in rows:
            a = n.args[0] if is_expert_mm(n) else projection(n).x
            if sdim.get(a) != ndim(a) - 1 or a in t.inner:
                raise ShardError(f"{where}: row-parallel {n.name} gets an input not split along its last dim")
            if t.factor[a] != parts:
                raise ShardError(f"{where}: row-parallel {n.name} reads heads replicated over {parts // t.factor[a]} "
                                 f"ranks; only KV heads may be replicated (the layout must divide the attention "
                                 f"head count; {parts} ranks here)")
            continue
        if n.op == "output":
            whole = {s for s, _, _ in t.states}
            if split_in and all(a in whole or (a.target in STATE_WRITES and a.args[0] in whole) for a in split_in):
                continue  # a cache returned whole to the caller (each rank wrote its own slice of it)
            raise ShardError(f"{where}: a tensor split over the {group} group reaches the graph output via {n.args}")
        target = n.target
        if target in IGNORED or (n.op == "call_module" and target == "_guards_fn"):  # export's input guards
            continue
        if target == aten.sym_size.int:  # a size: the same on every rank unless it is the split dim's
            if n.args[1] % ndim(n.args[0]) == sdim[n.args[0]]:
                raise ShardError(f"{where}: {n.name} reads the size of the split dim {sdim[n.args[0]]} of "
                                 f"{n.args[0].name}, which differs per rank")
            continue
        folded = [a for a in split_in if a in t.inner]
        if folded and n.target in STATE_WRITES:
            raise ShardError(f"{where}: {n.name} ({n.target}) reads {folded[0].name}, whose heads are folded into "
                             "another dim")
        if _write_into_state(n, t, where):
            frontier.extend(sorted(set(n.args[0].users) | set(n.users), key=order.__getitem__))
            frontier.sort(key=order.__getitem__)
            continue
        factors = {t.factor[a] for a in split_in}
        gqa = target == aten.scaled_dot_product_attention.default and n.kwargs.get("enable_gqa")
        if len(factors) > 1 and not gqa:
            raise ShardError(f"{where}: {n.name} ({target}) combines tensors split into different numbers of "
                             f"heads per rank ({sorted(factors)})")
        src0 = n.args[0] if n.args and isinstance(n.args[0], fx.Node) and n.args[0] in sdim else split_in[0]
        f = t.factor[src0]
        origins = {t.origin[a] for a in split_in}
        if target in BLOCK_OPS and n.args[0] in sdim:
            pos = 1 if target == aten.slice.Tensor else 2
            dim_arg = n.args[pos] if len(n.args) > pos else n.kwargs.get("dim", 0)
            if dim_arg % ndim(src0) == sdim[src0]:
                _cut_into_blocks(n, src0, t)
                col, starts = t.pieces[n]
                sdim[n], t.factor[n] = sdim[src0], f
                t.origin[n] = (col, starts[0]) if target == aten.slice.Tensor and starts else None
                frontier.extend(sorted(n.users, key=order.__getitem__))
                frontier.sort(key=order.__getitem__)
                continue
        rule = RULES.get(target)
        sliced: dict[fx.Node, int] = {}
        if folded:  # no per-rank slice of an unsplit operand along folded heads: the rules refuse it
            try:
                sdim[n] = _follow_folded(n, src0, rule, t, f, parts, fixes)
            except ShardError as e:
                raise ShardError(f"{where}: {e} (on heads folded into another dim, as BLOOM's baddbmm and "
                                 "XGLM's bmm over batch x heads have them)") from None
            t.factor[n], t.origin[n] = f, None
            frontier.extend(sorted(n.users, key=order.__getitem__))
            frontier.sort(key=order.__getitem__)
            continue
        if rule is not None and rule.kind == "elementwise" and n.args and src0 in sdim:
            _split_attrs(gm, n, src0, t)
            _split_broadcasts(n, src0, t, fixes, where)
            sliced = _slice_operands(n, src0, t)
        elif target == aten.cat.default:  # (GPT-OSS's attention sinks, one per head, joined to the scores)
            sliced = _slice_operands(n, src0, t)
        if target == aten.mean.dim and sdim[src0] in _reduced_dims(n, src0):
            # equal slices per rank, so (sum of slice means) / parts is the full mean; with
            # replicated KV heads too (each distinct slice counted parts / factor times)
            t.means.append(n)  # replicated once all-reduced: its users see an unsplit value
            continue
        blocks_at = _fused_reshape(n, src0, t) if rule is not None and rule.kind == "reshape" else None
        if blocks_at is not None:
            sdim[n] = _cut_reshape_into_blocks(n, src0, t, blocks_at, f, fixes, where)
            origins = {None}  # each rank's slice of every block, no one block
        elif rule is not None and rule.kind == "reshape":
            try:
                sdim[n] = rule.fn(n, sdim, f, fixes)
            except ShardError as e:  # the heads folded into the dim before them: [B, H, S, D] -> [B*H, S, D]
                if target not in VIEW_OPS or f != parts:
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
            if src0 in merged:
                j = sdim[n]
                want = sym_expr(src0.meta["val"].shape[merged[src0]]) * sym_expr(src0.meta["val"].shape[merged[src0] + 1])
                if sympy.simplify(sym_expr(n.meta["val"].shape[j]) - want) != 0:
                    raise ShardError(f"{where}: {n.name} does not merge the replicated KV heads back into one dim")
            elif target == aten.expand.default and f < parts:
                d = sdim[n]
                arg = n.args[1][d + 1] if d + 1 < len(n.args[1]) else None
                insize = shape_of(src0)[d + 1 - (ndim(n) - ndim(src0))] if d + 1 < ndim(n) else None
                if not (isinstance(arg, int) and insize == 1 and arg % (parts // f) == 0):
                    raise ShardError(f"{where}: {n.name}: replicated KV heads must be repeated by an expand of a "
                                     f"size-1 dim after the head dim divisible by {parts // f}")
                fixes.append(ArgFix(n.name, d + 1, arg, arg // (parts // f)))
                merged[n] = d
                f = parts
        elif rule is not None:
            if target in SDPA_OPS and n.args[0] in sdim:
                q = n.args[0]
                heads = int(sym_expr(q.meta["val"].shape[-3]))  # (meta holds the unsharded shape)
                single = {t.origin.get(x) for x in n.args[1:3] if x in sdim and sdim[x] == ndim(x) - 1}
                if single and None not in single and all(k[1] is not None for k in single):
                    raise _WholeBlocks(single)
                for x in n.args[1:3]:
                    if x not in sdim and isinstance(x, fx.Node):
                        _broadcast_heads(x, heads, t.factor[q], fixes, where)
                        sdim[x], t.factor[x], t.origin[x] = ndim(x) - 3, t.factor[q], None
            if src0 in merged:
                raise ShardError(f"{where}: {n.name} ({target}) reads repeated KV heads before they are merged")
            sdim[n] = rule.fn(n, {**sdim, **sliced} if sliced else sdim, f, fixes)
        elif target in LINEAR_OPS or is_expert_mm(n):
            raise ShardError(f"{where}: {n.name} ({target}) reads a split tensor but is not the row-parallel projection")
        else:
            raise ShardError(f"{where}: no sharding rule for {n.name} ({target}) on a tensor split over {group}")
        t.factor[n] = t.factor[n.args[0]] if gqa else f
        if target == operator.getitem and n.args[0] in t.pieces:  # one piece of a chunk/split
            col, starts = t.pieces[n.args[0]]
            t.origin[n] = (col, starts[n.args[1]])
            if t.origin[n] in whole:  # replicated whole: every rank computes the same, not followed
                del sdim[n]
                continue
        else:
            t.origin[n] = origins.pop() if len(origins) == 1 else None
        frontier.extend(sorted(n.users, key=order.__getitem__))
        frontier.sort(key=order.__getitem__)
    return t


# ops a pending partial sum may pass through unchanged in meaning (linear in the partial operand)
_LINEAR_IN_PARTIAL = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.to.dtype, aten._to_copy.default,
    aten.contiguous.default, aten.clone.default, aten.index.Tensor, aten.sum.dim_IntList, aten.unsqueeze.default,
    aten.squeeze.dim, aten.permute.default, aten.transpose.int, aten.index_select.default,
}


_INDEX_ADD = (aten.index_add_.default, aten.index_add.default)


def _is_zeros(n: object) -> bool:
    return isinstance(n, fx.Node) and (n.target in (aten.zeros_like.default, aten.zeros.default, aten.new_zeros.default)
                                       or (n.target in (aten.full.default, aten.full_like.default) and n.args[1] == 0))


def column_row_pairs(projs: list[fx.Node], region: set[fx.Node],
                      where: str) -> list[tuple[list[fx.Node], fx.Node]]:
    """Group an MLP's projections into (column-parallel inputs, row-parallel output) pairs: a row
    reads a value computed from other projections, its columns are those projections. Others
    (a shared expert's gate: a linear to one sigmoid) stay replicated."""
    from ..roles import ancestors

    pset = set(projs)

    def act(n: fx.Node) -> fx.Node:  # the activation operand
        return n.args[0] if is_expert_mm(n) else projection(n).x

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
        # out.index_add_(0, tokens, partial): linear in the source and in out, which must be a
        # partial sum too or zeros (a zero counted once per rank is still zero): an expert loop
        ok |= (n.target in _INDEX_ADD and len(n.args) > 3 and n.args[3] in on and n.args[2] not in on
               and (n.args[0] in on or _is_zeros(n.args[0])))
        if not ok:
            raise ShardError(f"{where}: {n.name} ({n.target}) sits between the row-parallel "
                             f"{[r.name for r in rows]} and the block output {out.name} but is not linear in "
                             "their partial sums")
    if out not in partial:
        raise ShardError(f"{where}: the block output {out.name} does not come from {[r.name for r in rows]}")


def plan_shards(gm: fx.GraphModule, attn_parts: int, mlp_parts: int,
                replicated_mlp: frozenset[int] = frozenset()) -> ShardPlan:
    """Find the linears of every layer and follow their splits. Needs ``afd.role``. The MLPs of
    the ``replicated_mlp`` layers keep their full weights (a data-parallel MLP)."""
    from ..roles import ancestors, descendants, find_router

    weights: list[ShardedWeight] = []
    fixes: list[ArgFix] = []
    rows_out: list[tuple[str, str, int]] = []
    split_means: list[tuple[str, str, int, int]] = []
    states: list[ShardedState] = []
    operands: list[SlicedOperand] = []
    once: list[OnceOperand] = []
    for layer, parts in layers_of(gm).items():
        members = list(parts.members)
        where = f"layer {layer}"
        attn_ops = [n for n in members if role_of(n).role is Role.ATTENTION and is_attention_op(n)]
        ffn = [n for n in members if role_of(n).role is Role.FFN]
        if len(attn_ops) != 1:
            raise ShardError(f"{where}: expected one attention op, found {[n.name for n in attn_ops]}")
        attn = attn_ops[0]
        lin = [n for n in members if n.target in LINEAR_OPS and role_of(n).role is Role.ATTENTION
               and not role_of(n).router]
        anchor = attention_output(attn)  # explicit attention: v enters at the matmul after the softmax
        layer_nodes = set(members)  # walks stay inside the layer: linear in the graph, not quadratic
        before = ancestors([anchor], within=layer_nodes)
        cols = [n for n in lin if n in before and reads_weight(n)]  # not e.g. the rotary inv_freq matmul
        # only the projections that feed attention directly: a low-rank down projection before
        # another one (DeepSeek's MLA q_a_proj / kv_a_proj) stays replicated
        cols = [c for c in cols if not ((descendants(c, before) - {c}) & set(cols))]
        rows = parts.output_projections
        if not cols or len(rows) != 1:
            raise ShardError(f"{where}: expected q/k/v projections before {attn.name} and one output projection after "
                             f"it, found {[n.name for n in cols]} / {[n.name for n in rows]}")
        heads = _attention_heads(attn)
        if attn_parts > 1 and heads is not None and heads % attn_parts:
            raise ShardError(f"{where}: {attn.name} has {heads} attention heads, which {attn_parts} attention-TP ranks "
                             "cannot divide (only KV heads may be replicated)")
        if attn_parts > 1:
            means: list[fx.Node] = []
            shard_pair(gm, cols, rows[0], attn_parts, "attn", weights, fixes, where, means, states, operands)
            rows_out.append((rows[0].name, "attn", layer))
            split_means.extend((m.name, "attn", layer, attn_parts) for m in means)
        ffn_set = set(ffn)
        out = parts.ffn_output
        router = find_router(ffn)
        projs = [n for n in ffn if (n.target in LINEAR_OPS or is_expert_mm(n)) and n is not router
                 and not role_of(n).router]
        pairs = column_row_pairs(projs, ffn_set, where)
        if not pairs:
            raise ShardError(f"{where}: the MLP has no down projection fed by up projections "
                             f"(projections found: {[n.name for n in projs]})")
        if mlp_parts > 1 and layer not in replicated_mlp:
            for cols_, row in pairs:
                mlp_means: list[fx.Node] = []  # (BitNet's norm over the intermediate size before down_proj)
                shard_pair(gm, cols_, row, mlp_parts, "mlp", weights, fixes, where, mlp_means, operands=operands)
                split_means.extend((m.name, "mlp", layer, mlp_parts) for m in mlp_means)
            if len(pairs) == 1 and _producer_linear(out, ffn_set) is pairs[0][1]:
                rows_out.append((pairs[0][1].name, "mlp", layer))  # settle right after the down projection
            else:  # several partial sums (experts + shared experts) or a combine step: settle at the block output
                check_linear_path([row for _, row in pairs], out, ffn_set, where, once,
                                  cols=[c for cs, _ in pairs for c in cs])
                rows_out.append((out.name, "mlp", layer))
    return ShardPlan(one_slice_per_weight(weights), tuple(fixes), tuple(rows_out), tuple(split_means), tuple(states),
                     tuple(operands), tuple(once))


def _attention_heads(attn: fx.Node) -> int | None:
    """The query head count of an SDPA-style op (query is ``[batch, heads, seq, head_dim]``)."""
    q = attn.args[0] if attn.args else None
    v = q.meta.get("val") if isinstance(q, fx.Node) else None
    if attn.target in SDPA_OPS and isinstance(v, torch.Tensor) and v.dim() == 4:
        h = sym_expr(v.shape[1])
        return int(h) if h.is_Integer else None
    return None


def _producer_linear(out: fx.Node, members: set) -> fx.Node | None:
    from ..roles import PASSTHROUGH_OPS

    n = out
    while n in members:
        if n.target in LINEAR_OPS:
            return n
        if n.target in PASSTHROUGH_OPS:
            n = n.args[0]
            continue
        return None
    return None


def _projection_weight(gm: fx.GraphModule, proj: fx.Node, column: bool) -> tuple[str, int, int]:
    """(target, dim, size) of the weight dim a column (out features) / row (in features) split cuts."""
    if is_expert_mm(proj):
        w, dim = _expert_weight(proj, 2 if column else 1)
        return str(w.target), dim, int(get_attr_path(gm, w.target).shape[dim])
    p = projection(proj)
    dim = p.out_dim if column else 1 - p.out_dim
    return str(p.weight.target), dim, int(get_attr_path(gm, p.weight.target).shape[dim])


def shard_pair(gm: fx.GraphModule, cols: list[fx.Node], row: fx.Node, parts: int, group: str,
                weights: list[ShardedWeight], fixes: list[ArgFix], where: str,
                means: list[fx.Node] | None = None, states: list[ShardedState] | None = None,
                operands: list[SlicedOperand] | None = None) -> None:
    names = ", ".join(_projection_weight(gm, c, True)[0] for c in cols)
    for c in cols:
        target, dim, size = _projection_weight(gm, c, True)
        if size % parts:
            raise ShardError(f"{where}: {parts} ranks do not divide dim {dim} (size {size}) of column-parallel "
                             f"weight {target}")
    target, dim, size = _projection_weight(gm, row, False)
    if size % parts:
        raise ShardError(f"{where}: {parts} ranks do not divide dim {dim} (size {size}) of row-parallel weight {target}")
    whole: frozenset = frozenset()
    mark = len(fixes)
    try:
        for _ in range(3):
            try:
                track = _follow(gm, cols, {row}, parts, group, fixes, where, whole)
                break
            except _WholeBlocks as w:  # multi-query K/V: retry with those blocks replicated whole
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
        target, dim, size = _projection_weight(gm, c, True)
        blocks, rep = _block_fixes(c, track, parts, fixes)
        weights.append(ShardedWeight(target, dim, parts, group, "column", blocks, rep))
        bias = None if is_expert_mm(c) else projection(c).bias
        if bias is not None:
            weights.append(ShardedWeight(str(bias.target), 0, parts, group, "column", blocks, rep))
        for a in track.attrs:
            if track.origin.get(a) == (c, None):
                weights.append(ShardedWeight(str(a.target), track.dim[a], parts, group, "column", blocks, rep))
            elif track.origin.get(a) is not None and track.origin[a][0] is c:
                raise ShardError(f"{where}: {a.target} spans the split dim of {c.name} but not its whole output")
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
        if origin is not None and origin[1] is None and len(_block_fixes(origin[0], track, parts, [])[0]) > 1:
            raise ShardError(f"{where}: {user.name} applies {a.name} along the split dim of the fused projection "
                             f"{origin[0].name} before it is cut: a rank's slice of it is not one block of {a.name}")
        size = fold or int(sym_expr(a.meta["val"].shape[d]))
        operands.append(SlicedOperand(user.name, a.name, d, size, slices, parts, group, fold=bool(fold)))
    if means is not None:
        means.extend(track.means)
    elif track.means:
        raise ShardError(f"{where}: {track.means[0].name} averages over a split dim")
    target, dim, size = _projection_weight(gm, row, False)
    weights.append(ShardedWeight(target, dim, parts, group, "row", (size,)))
    bias = None if is_expert_mm(row) else projection(row).bias
    if bias is not None:  # added once: kept on group rank 0, zeros elsewhere
        weights.append(ShardedWeight(str(bias.target), -1, parts, group, "row_bias"))


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
