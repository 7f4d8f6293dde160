"""Tensors the follow (``follow.py``) splits beside the one it tracks, where an op applies them
along the split dim: a weight attribute (a norm's scale over all heads), an unsplit operand
broadcast by ``expand`` from size 1, a computed tensor read in slices (an ALiBi bias), a tensor
made by a factory op with the full head count in its size (a recurrent state's zeros), and a
depthwise convolution's weight over split channels (the short convolution of Qwen3.5's and
LFM's token mixers). Also the follow's record of what it knows per node (:class:`Track`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..graph_utils import get_attr_path
from ..symbolic import sym_expr
from .projections import Block, out_features
from .rules import ndim
from .types import ArgFix, ShardError

aten = torch.ops.aten


@dataclass
class Track:
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
    # unsplit tensors read in slices: (user, operand, dim, slices, split input's origin, heads folded or 0)
    operands: list[tuple[fx.Node, fx.Node, int, int, Block | None, int]] = field(default_factory=list)
    # node -> the outer factor of its split dim, where the heads are folded into it as the inner
    # factor ([B*H, S, D]: B); such a dim is cut per rank as B x (H / parts), not in contiguous slices
    inner: dict[fx.Node, object] = field(default_factory=dict)
    # a cat of split pieces along the split dim, read as a column of blocks: node -> its width
    joins: dict[fx.Node, int] = field(default_factory=dict)

    def width(self, col: fx.Node) -> int:
        """The output features of a column (or a join's width)."""
        return self.joins[col] if col in self.joins else out_features(col)


def split_attrs(gm: fx.GraphModule, n: fx.Node, src: fx.Node, t: Track) -> None:
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


def split_broadcasts(n: fx.Node, src: fx.Node, t: Track, fixes: list[ArgFix], where: str) -> None:
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


def slice_operands(n: fx.Node, src: fx.Node, t: Track) -> dict[fx.Node, int]:
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


#: ops that make a tensor from a size list (its position in the args)
FACTORIES = {aten.zeros.default: 0, aten.ones.default: 0, aten.empty.memory_format: 0, aten.full.default: 0,
             aten.new_zeros.default: 1, aten.new_ones.default: 1, aten.new_empty.default: 1, aten.new_full.default: 1}


def split_factories(n: fx.Node, src: fx.Node, t: Track, fixes: list[ArgFix]) -> list[fx.Node]:
    """A tensor made by a factory op with the full size of the split dim (Qwen3-Next's recurrent
    state ``zeros([b, heads, dk, dv])``, met by the per-head keys) is made at this rank's size::

        s = zeros([b, 32, 128, 128]) ; o = matmul(q_heads, s)   ->   s = zeros([b, 16, 128, 128])

    Returns the factories' readers, for the follow to check each of them too."""
    d = t.dim[src] + ndim(n) - ndim(src)
    made = []
    for a in n.all_input_nodes:
        if a in t.dim or a.target not in FACTORIES:
            continue
        ad, pos = d - (ndim(n) - ndim(a)), FACTORIES[a.target]
        size = list(a.args[pos]) if len(a.args) > pos else []
        if ad < 0 or ad >= len(size) or size[ad] == 1:
            continue  # (broadcast along the split dim)
        if not isinstance(size[ad], int) or size[ad] % t.factor[src]:
            raise ShardError(f"{a.name} ({a.target}) makes a tensor of {size[ad]} along the split dim of {n.name}, "
                             f"which {t.factor[src]} slices do not divide")
        fixes.append(ArgFix(a.name, ad, size[ad], size[ad] // t.factor[src], arg=pos))
        t.dim[a], t.factor[a], t.origin[a] = ad, t.factor[src], None
        made += list(a.users)
    return made


#: convolutions a split channel dim may pass (depthwise only: ``groups`` = channels)
CHANNEL_OPS = {aten.conv1d.default}


def _weight_path(x: object) -> tuple[list[fx.Node], fx.Node | None]:
    """A convolution's weight (or bias) operand back to its graph attribute, through one-input ops
    (``unsqueeze(weight, 1)``), each read only by the next (nothing else sees the sliced weight):
    (the ops, the attribute), or ([], None) for None."""
    chain: list[fx.Node] = []
    while isinstance(x, fx.Node) and x.op == "call_function" and len(x.all_input_nodes) == 1 and \
            len(x.users) == 1 and \
            x.target in (aten.unsqueeze.default, aten.squeeze.dim, aten.view.default, aten.reshape.default,
                         aten._to_copy.default, aten.to.dtype, aten.alias.default, aten.detach.default):
        chain.append(x)
        x = x.all_input_nodes[0]
    return chain, x if isinstance(x, fx.Node) else None


def depthwise_conv(gm: fx.GraphModule, n: fx.Node, src: fx.Node, t: Track, parts: int, fixes: list[ArgFix]) -> int:
    """``conv1d(x [B, C, L], w [C, 1, K], bias [C], stride, padding, dilation, groups=C)`` with ``x``
    split along its channels: each channel is convolved alone, so a rank convolves its channels with
    its slice of ``w`` and ``bias`` (sliced as the column the channels come from, block by block)
    and ``groups = C / parts``. Returns the split dim (1)."""
    channels = int(src.meta["val"].shape[1])
    groups = n.args[6] if len(n.args) > 6 else n.kwargs.get("groups", 1)
    if t.dim[src] != 1 or groups != channels or len(n.args) <= 6:
        raise ShardError(f"{n.name} ({n.target}) convolves across the split channels (groups={groups}, "
                         f"{channels} channels; only a depthwise convolution, groups = channels, takes them "
                         "apart)")
    for operand in n.args[1:3]:
        chain, attr = _weight_path(operand)
        if attr is None and not chain:
            continue
        kept = all(isinstance(x.meta.get("val"), torch.Tensor) and x.meta["val"].shape[0] == channels for x in chain)
        if attr is None or attr.op != "get_attr" or get_attr_path(gm, str(attr.target)).shape[0] != channels \
                or not kept:
            raise ShardError(f"{n.name}: its weight / bias {getattr(operand, 'name', operand)} is not a graph "
                             f"attribute of {channels} channels along dim 0")
        for x in [*chain, attr]:
            t.dim[x], t.factor[x], t.origin[x] = 0, t.factor[src], t.origin.get(src)
        t.attrs.append(attr)
    key = t.origin.get(src)
    if key is not None and key[1] is None and t.width(key[0]) == channels:
        # a rank's channels once the column's blocks are known (some may be replicated: Qwen3.5's two
        # key heads over four ranks): a bound at the column's end (follow.block_fixes)
        t.cuts.append((key[0], n, 6, None, channels, channels))
    elif t.factor[src] == parts:
        fixes.append(ArgFix(n.name, None, channels, channels // t.factor[src], arg=6))
    else:
        raise ShardError(f"{n.name}: a depthwise convolution over channels of several sources with heads "
                         "replicated over ranks")
    return 1



def join_pieces(n: fx.Node, src: fx.Node, t: Track, parts: int) -> bool:
    """``cat`` along the split dim of pieces each split along it (Qwen3-Next's and Kimi-Linear's
    q | k | v joined before their short convolution): a rank holds its slice of each piece, one
    after another, as a fused projection's output holds its slice of each block. The join is read
    as such a column (its width, the pieces' boundaries as blocks): a depthwise convolution's weight
    is sliced block by block, a split back into the pieces takes per-rank sizes. False: a cat
    along another dim (the rules' case)."""
    d = t.dim[src]
    if n.target != aten.cat.default or (n.args[1] if len(n.args) > 1 else 0) % ndim(n) != d:
        return False
    pieces = list(n.args[0])
    sizes = [sym_expr(x.meta["val"].shape[d]) if isinstance(x, fx.Node) else None for x in pieces]
    if any(x not in t.dim or t.dim[x] != d or t.factor[x] != parts for x in pieces) or \
            not all(s is not None and s.is_Integer for s in sizes):
        raise ShardError(f"{n.name} ({n.target}) joins along the split dim {d} pieces not all split there over "
                         f"every rank (heads replicated: fewer heads than ranks; or sizes not constant: {sizes})")
    bounds = [sum(int(s) for s in sizes[:i]) for i in range(len(sizes) + 1)]
    t.joins[n] = bounds[-1]
    t.blocks.setdefault(n, set()).update(bounds[:-1])
    t.dim[n], t.factor[n], t.origin[n] = d, parts, (n, None)
    return True
