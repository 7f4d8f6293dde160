"""How the split dimension passes each op: one rule per op, registered in :data:`RULES`.

A rule is ``fn(node, sdim, parts, fixes) -> dim``: given the split dim of each split input
(``sdim``: node -> dim) and the number of slices, it returns the node's split dim, appends to
``fixes`` the constant size arguments that must be divided (a head count in a reshape), or raises
ShardError naming the node when the op would mix the split dim into something a slice cannot
compute (a reduction over it, a norm over it, an unsplit operand spanning it). The walk in
``shard/follow.py`` (``follow_split``) calls the rule of each op it meets; a rule's ``kind`` tells the
walk what else to do there: ``elementwise`` (weight attributes and broadcast operands applied
along the split dim are split too), ``reshape`` (may ask for replicated heads with
:class:`Replicate`), ``op`` (nothing else). This is the idea of DTensor's per-op sharding
strategies and view-op dim maps, for one split dim.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from ..op_kinds import ELEMENTWISE_OPS
from ..symbolic import sym_expr
from .types import ArgFix, ShardError

aten = torch.ops.aten

def ndim(n: object) -> int:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v.dim() if isinstance(v, torch.Tensor) else 0


def shape_of(n: fx.Node) -> list:
    return [sym_expr(s) for s in n.meta["val"].shape]


RuleFn = Callable[[fx.Node, dict, int, "list[ArgFix] | None"], "int | None"]


@dataclass(frozen=True)
class ShardRule:
    """How the split dim passes one op (see the module docstring): ``fn`` and its ``kind``."""

    fn: RuleFn
    kind: str = "op"  # elementwise | reshape | op

    def __post_init__(self) -> None:
        if self.kind not in ("elementwise", "reshape", "op"):
            raise ValueError(f"shard rule kind must be elementwise, reshape or op, got {self.kind!r}")


def _elementwise(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    out = ndim(node)
    dims = set()
    for a in node.all_input_nodes:
        if a in sdim:
            dims.add(sdim[a] + out - ndim(a))
    if len(dims) != 1:
        raise ShardError(f"{node.name} ({node.target}) combines tensors split along different dims {sorted(dims)}")
    d = dims.pop()
    for a in node.all_input_nodes:  # an unsplit operand must broadcast along the split dim
        if a not in sdim and isinstance(a.meta.get("val"), torch.Tensor) and ndim(a) > 0:
            ad = d - (out - ndim(a))
            if ad >= 0 and sym_expr(a.meta["val"].shape[ad]) != 1:
                raise ShardError(f"{node.name}: operand {a.name} is not split but spans the split dim {d}")
    return d


def _reduce_over(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    (src,) = [a for a in node.all_input_nodes if a in sdim]
    d = sdim[src]
    dims = node.args[1] if len(node.args) > 1 else list(range(ndim(src)))
    dims = [x % ndim(src) for x in (dims if isinstance(dims, (list, tuple)) else [dims])]
    if d in dims:
        raise ShardError(f"{node.name} ({node.target}) reduces over the split dim {d}")
    keep = node.target in (aten.softmax.int, aten._softmax.default, aten._safe_softmax.default) or (
        len(node.args) > 2 and node.args[2])
    return d if keep else d - sum(1 for x in dims if x < d)


def _transpose(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    d = sdim[node.args[0]]
    a, b = (x % ndim(node) for x in node.args[1:3])
    return b if d == a else a if d == b else d


def _reverse_dims(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    """``x.mT`` / ``x.mH`` (the last two dims swapped), ``x.t()`` (a 2-D transpose), ``x.T``
    (``numpy_T``: every dim reversed): the transposes a model writes without naming the dims."""
    d, n = sdim[node.args[0]], ndim(node)
    if node.target == aten.numpy_T.default or (node.target == aten.t.default and n == 2):
        return n - 1 - d
    if node.target == aten.t.default:
        return d
    return n - 1 if d == n - 2 else n - 2 if d == n - 1 else d


def _permute(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    perm = [x % ndim(node) for x in node.args[1]]
    return perm.index(sdim[node.args[0]])


def _unsqueeze(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    d, at = sdim[node.args[0]], node.args[1] % ndim(node)
    return d + 1 if at <= d else d


def _common_split(node: fx.Node, srcs: Sequence[fx.Node], sdim: dict) -> int:
    """The split dim every one of ``srcs`` shares (cat / stack / chunk need all split alike)."""
    split = {sdim[s] for s in srcs if s in sdim}
    if len(split) != 1 or any(s not in sdim for s in srcs):
        grown = next((s for s in srcs if s not in sdim and _graph_input(s) is not None), None)
        dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % max(ndim(node), 1)
        if grown is not None and split == {1} and ndim(node) == 4 and dim == 2:  # [batch, heads, seq, head_dim]
            raise ShardError(
                f"{node.name} ({node.target}) appends split heads to {_graph_input(grown).name}, a graph input or a "
                "tensor created empty, not split: a KV cache that grows by concatenation (transformers' DynamicCache). "
                "Tensor "
                "parallelism writes each rank's heads into a cache in place: use a static cache "
                "(model.generation_config.cache_implementation = 'static', or pass a StaticCache)")
        raise ShardError(f"{node.name} ({node.target}) mixes split and unsplit inputs")
    return split.pop()


def _graph_input(n: object) -> fx.Node | None:
    """The graph input ``n`` is (or is a view / alias of), or the tensor it is when the graph creates
    it from nothing (a constant or a factory such as ``empty``), else None."""
    while isinstance(n, fx.Node) and n.op == "call_function":
        if n.target == aten.lift_fresh_copy.default or not any(
                isinstance(a.meta.get("val"), torch.Tensor) for a in n.all_input_nodes):
            return n  # created in the graph (an empty cache before its first append)
        schema = getattr(n.target, "_schema", None)
        if not n.args or schema is None or not schema.returns or schema.returns[0].alias_info is None:
            return None
        n = n.args[0]
    return n if isinstance(n, fx.Node) and n.op in ("placeholder", "get_attr") else None


def _along_other_dim(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    src = node.args[0][0] if isinstance(node.args[0], (list, tuple)) else node.args[0]
    srcs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
    d = _common_split(node, srcs, sdim)
    pos = 2 if node.target in (aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default,
                               aten.tensor_split.indices) else 1
    dim = (node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", 0)) % ndim(src)
    if dim == d:
        raise ShardError(f"{node.name} ({node.target}) works along the split dim {d}")
    if node.target in (aten.select.int, aten.unbind.int) and dim < d:
        return d - 1  # the dim selected (or unbound) before the split dim is gone
    return d


def _pad(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    """pad(x, [left, right, ...] from the last dim back): any dim but the split one (Qwen3-Next's
    chunked delta rule pads the sequence to whole chunks)."""
    d, n, pad = sdim[node.args[0]], ndim(node.args[0]), list(node.args[1])
    j = n - 1 - d
    if 2 * j + 1 < len(pad) and (pad[2 * j], pad[2 * j + 1]) != (0, 0):
        raise ShardError(f"{node.name} ({node.target}) pads the split dim {d}")
    return d


def _last_two(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    """tril / triu: the mask is over the last two dims; any other dim passes."""
    d = sdim[node.args[0]]
    if d >= ndim(node.args[0]) - 2:
        raise ShardError(f"{node.name} ({node.target}) masks over the split dim {d}")
    return d


def _squeeze(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    """squeeze(x, dim(s)): dims of size 1 go; a split dim is never one of them (it has >= parts)."""
    src = node.args[0]
    d = sdim[src]
    dims = node.args[1] if len(node.args) > 1 else [i for i, s in enumerate(shape_of(src)) if s == 1]
    dims = [x % ndim(src) for x in (dims if isinstance(dims, (list, tuple)) else [dims])]
    dims = [x for x in dims if shape_of(src)[x] == 1]
    if d in dims:
        raise ShardError(f"{node.name}: squeeze removes the split dim {d}")
    return d - sum(1 for x in dims if x < d)


def _unflatten(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    """unflatten(x, dim, sizes): ``dim`` becomes ``sizes``; a split ``dim`` splits the outermost of
    them (``[.., H*D] -> [.., H, D]``: the heads), whose constant size is divided. A fused
    projection unflattened into its blocks (``[.., 3*E] -> [.., 3, E]``) is cut into blocks by the
    walk before this rule (``shard/follow.py``)."""
    src, dim, sizes = node.args[0], node.args[1] % ndim(node.args[0]), list(node.args[2])
    d = sdim[src]
    if d < dim:
        return d
    if d > dim:
        return d + len(sizes) - 1
    outer = sizes[0]
    if not isinstance(outer, int) or outer == -1:
        raise ShardError(f"{node.name}: unflatten of the split dim {d} into {sizes}: the outer size must be a constant")
    if outer % parts or outer < parts:
        if outer > 0 and parts % outer == 0:  # fewer heads than ranks (KV heads): replicated
            raise Replicate(outer)
        raise ShardError(f"{node.name}: unflatten of the split dim {d} into {sizes}: {parts} ranks cannot divide "
                         f"its outer size {outer}")
    if fixes is not None:
        fixes.append(ArgFix(node.name, 0, outer, outer // parts, arg=2))
    return d


def _einsum_terms(node: fx.Node) -> tuple[list[list[str]], list[str]]:
    """An einsum's subscripts per operand and for the output, one token per dim (``...`` expanded
    into per-dim tokens ``.0``, ``.1``, ..., aligned from the right as einsum broadcasts them)."""
    eq = node.args[0].replace(" ", "")
    ops = list(node.args[1])
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")

    def tokens(term: str, n: int) -> list[str]:
        if "..." not in term:
            return list(term)
        a, b = term.split("...")
        k = n - len(a) - len(b)
        return list(a) + [f".{i}" for i in range(k)] + list(b)

    out_terms = [tokens(t, ndim(x)) for t, x in zip(terms, ops, strict=True)]
    ell = max((sum(1 for c in t if c.startswith(".")) for t in out_terms), default=0)
    for t in out_terms:  # right-align the broadcast dims: .0 is the outermost of the longest
        k = sum(1 for c in t if c.startswith("."))
        i = 0
        for j, c in enumerate(t):
            if c.startswith("."):
                t[j] = f".{ell - k + i}"
                i += 1
    if "->" in eq:
        out = tokens(rhs, ell + len(rhs.replace("...", "")))
    else:  # implicit output: broadcast dims, then the letters used once, in alphabetical order
        letters = [c for t in out_terms for c in t if not c.startswith(".")]
        out = [f".{i}" for i in range(ell)] + sorted(c for c in set(letters) if letters.count(c) == 1)
    return out_terms, out


def _einsum(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    """einsum: the split dim is a subscript; every operand holding that subscript must be split along
    it (a head dim shared by q and k: ``bihd,bjhd->bhij``), and the output keeps it where its
    subscript is. A subscript summed over (not in the output) would leave a partial sum: refused."""
    terms, out = _einsum_terms(node)
    ops = list(node.args[1])
    letters = {terms[i][sdim[x]] for i, x in enumerate(ops) if x in sdim}
    if len(letters) != 1:
        raise ShardError(f"{node.name}: einsum {node.args[0]!r} with operands split along different subscripts "
                         f"{sorted(letters)}")
    (letter,) = letters
    for i, x in enumerate(ops):
        if x not in sdim and letter in terms[i] and shape_of(x)[terms[i].index(letter)] != 1:
            raise ShardError(f"{node.name}: einsum {node.args[0]!r}: operand {x.name} is not split but spans the "
                             f"split subscript {letter!r}")
    if letter not in out:
        raise ShardError(f"{node.name}: einsum {node.args[0]!r} sums over the split subscript {letter!r} (a "
                         "projection written as an einsum is not understood)")
    return out.index(letter)


def _stack(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    """stack(xs, dim): a new dim at ``dim``; the split dim moves right when it is at or after it
    (GPT-J's rotary stacks the rotated halves along a new last dim)."""
    d = _common_split(node, node.args[0], sdim)
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % ndim(node)
    return d if d < dim else d + 1


def _flatten(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    """flatten(x, start, end): dims start..end merge; the split dim may only be the outermost of them."""
    src = node.args[0]
    n = ndim(src)
    start = (node.args[1] if len(node.args) > 1 else 0) % max(n, 1)
    end = (node.args[2] if len(node.args) > 2 else -1) % max(n, 1)
    d = sdim[src]
    if d < start:
        return d
    if d > end:
        return d - (end - start)
    if d != start:
        raise ShardError(f"{node.name}: flatten merges the split dim {d} into dims {start}..{end} as an inner dim")
    return start


def _layer_norm(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    """layer_norm / rms_norm over trailing dims that leave the split dim alone (Persimmon's
    per-head q/k LayerNorm over head_dim): the split dim passes through."""
    src, shape = node.args[0], node.args[1]
    d = sdim[src]
    if d >= ndim(src) - len(shape):
        dims = list(range(ndim(src) - len(shape), ndim(src)))
        raise ShardError(f"{node.name} ({node.target}) normalises over dims {dims}, which hold the split dim {d}: "
                         "a norm over all heads together, which a rank holding some of the heads cannot compute "
                         "(a per-head norm normalises over head_dim only; per-head weights go after it: "
                         "F.layer_norm(x, (head_dim,)) * w[heads, head_dim] + b)")
    if any(a in sdim for a in node.all_input_nodes if a is not src):
        raise ShardError(f"{node.name} ({node.target}): its weight or bias is split with the heads, but it "
                         "normalises over trailing dims that do not hold them")
    return d


def _index(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    """x[..., idx] with ``None`` for every dim up to and including the split dim and 1-D
    indices after it (Falcon picks K and V out of each KV group): the split dim stays."""
    src, idx = node.args[0], node.args[1]
    d = sdim[src]
    if (any(i in sdim for i in idx if isinstance(i, fx.Node)) or len(idx) <= d
            or any(i is not None for i in idx[: d + 1])):
        raise ShardError(f"{node.name}: indexing touches the split dim {d}")
    if sum(1 for i in idx if i is not None) > 1 or any(
            isinstance(i, fx.Node) and ndim(i) != 1 for i in idx):
        raise ShardError(f"{node.name}: only one 1-D index after the split dim is understood")
    return d


def _new_empty(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    """``x.new_empty(size)`` with ``x`` split: the new tensor is split where ``x`` is (MLA builds
    its key from a split k_nope and a broadcast k_pe this way); its size there is divided."""
    src = node.args[0]
    d = sdim[src]
    size = node.args[1]
    if len(size) != ndim(src) or not isinstance(size[d], int) or size[d] % parts:
        raise ShardError(f"{node.name}: new_empty of size {size} does not keep the split dim {d} as a constant")
    if fixes is not None:
        fixes.append(ArgFix(node.name, d, size[d], size[d] // parts))
    return d


def _repeat_interleave(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    """``repeat_interleave(x, n, dim)`` (GQA's K/V heads expanded to the query heads, as
    hand-written decoders do): each rank repeats its own heads ``n`` times, so the split dim stays
    where it is (replicated KV heads: :func:`repeat_replicated` first)."""
    src = node.args[0]
    if not isinstance(node.args[1], int):
        raise ShardError(f"{node.name}: repeat_interleave with per-element repeats {node.args[1]} on a split tensor")
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if dim is None:
        raise ShardError(f"{node.name}: repeat_interleave without a dim flattens the split tensor")
    return sdim[src]


def repeat_replicated(node: fx.Node, d: int, f: int, parts: int, fixes: list[ArgFix]) -> int:
    """``repeat_interleave(x, n, d)`` of heads replicated over the ranks (fewer KV heads than the
    ``parts`` ranks: ``f`` distinct slices, rank ``r`` holding slice ``r * f // parts``): the
    repeated heads split over every rank as the queries' do, so each rank repeats its own
    ``n * f // parts`` times (a fix of ``n``); returns the result's factor (``f`` along another dim)."""
    rep, dim = node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if dim is None or dim % ndim(node) != d:
        return f
    if not isinstance(rep, int) or (rep * f) % parts or node.kwargs.get("output_size") is not None:
        raise ShardError(f"{node.name}: repeat_interleave of heads replicated over {parts // f} ranks each, "
                         f"repeats {rep}: expected an int that {parts // f} divides and no output_size")
    fixes.append(ArgFix(node.name, None, rep, rep * f // parts))
    return parts


def _getitem(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    return sdim[node.args[0]]


def _sdpa(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    q, k, v = node.args[:3]
    if not all(x in sdim for x in (q, k, v)):
        raise ShardError(f"{node.name}: attention with q/k/v not all split over heads")
    bad = {x.name: sdim[x] for x in (q, k, v) if sdim[x] != ndim(x) - 3}
    if bad:  # [batch, heads, seq, head_dim]: a split head_dim would be a silently wrong attention
        raise ShardError(f"{node.name}: attention inputs must be split along the heads dim (-3); {bad} are split "
                         "along another dim (a projection whose output is one head, e.g. multi-query attention's "
                         "single K/V head, is not supported yet)")
    return sdim[q]


def _matmul(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    a, b = node.args[:2]
    out = ndim(node)
    dims = {sdim[x] + out - ndim(x) for x in (a, b) if x in sdim}
    if len(dims) != 1 or not all(x in sdim for x in (a, b)) or dims.pop() >= out - 2:
        raise ShardError(f"{node.name}: matmul must have both operands split along the same batch (head) dim")
    return sdim[a] + out - ndim(a)


def _baddbmm(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    """``baddbmm(bias, a, b)`` = ``bias + a @ b`` over a batch dim (BLOOM's scores with their ALiBi
    bias, over batch x heads): ``a`` and ``b`` split along the batch dim as for ``bmm``; the bias
    split there too (read in slices) or broadcast along it."""
    bias, a, b = node.args[:3]
    if not (a in sdim and b in sdim and sdim[a] == sdim[b] < ndim(node) - 2):
        raise ShardError(f"{node.name}: baddbmm must have both factors split along the same batch (head) dim")
    d = sdim[a]
    if isinstance(bias, fx.Node) and ndim(bias) > 0:
        bd = d - (ndim(node) - ndim(bias))
        if bias in sdim and sdim[bias] != bd:
            raise ShardError(f"{node.name}: the bias {bias.name} is split along dim {sdim[bias]}, the "
                             f"product along {d}")
        if bias not in sdim and bd >= 0 and shape_of(bias)[bd] != 1:
            raise ShardError(f"{node.name}: operand {bias.name} is not split but spans the split dim {d}")
    return d


class Replicate(Exception):
    """A reshape into fewer heads than ranks: the projection's heads get replicated."""

    def __init__(self, heads: int) -> None:
        super().__init__(heads)
        self.heads = heads


def _reshape(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    src = node.args[0]
    d = sdim[src]
    ishape, oshape = shape_of(src), shape_of(node)
    prefix = sympy.Integer(1)
    for x in ishape[:d]:
        prefix *= x
    # the leading dims kept as they are (x[B, S, H*D] -> [B, S, H, D]): the split dim stays at d.
    # Matching by the product of the leading dims alone is ambiguous when a size-1 dim follows
    # them (decode: S == 1 makes [B, 1, H, D]'s dims 1 and 2 both start after a prefix B)
    kept = len(oshape) > d and all(sympy.simplify(a - b) == 0 for a, b in zip(ishape[:d], oshape[:d], strict=False))
    acc = sympy.Integer(1)
    for j, size in enumerate(oshape):
        if (j == d) if kept else sympy.simplify(acc - prefix) == 0:
            if not (size.is_Integer and int(size) % parts == 0 and int(size) >= parts):
                if size.is_Integer and int(size) > 0 and parts % int(size) == 0:
                    raise Replicate(int(size))
                raise ShardError(
                    f"{node.name}: split dim {d} (size {ishape[d]}) of {src.name} maps to output dim {j} of "
                    f"size {size}, which {parts} ranks cannot divide (a head count: the layout must divide the "
                    "attention head count, and divide or be a multiple of the KV head count)"
                )
            arg = node.args[1][j]
            if isinstance(arg, int) and arg != -1 and fixes is not None:
                fixes.append(ArgFix(node.name, j, arg, arg // parts))
            elif not isinstance(arg, int):
                raise ShardError(f"{node.name}: output dim {j} is split but its size is symbolic ({arg})")
            return j
        acc *= size
    raise ShardError(f"{node.name}: cannot follow split dim {d} of {tuple(ishape)} into {tuple(oshape)}: no output "
                     "dim starts where it does")


def expands_single_head(n: fx.Node, src: fx.Node, d: int, parts: int) -> bool:
    """``n`` (an expand) broadcasts ``src``'s single head (size 1 at the split dim ``d``) to a
    head count the ``parts`` ranks divide: multi-query K/V repeated to every query head."""
    arg = n.args[1][d] if d < len(n.args[1]) else None
    din = d - (ndim(n) - ndim(src))
    return din >= 0 and shape_of(src)[din] == 1 and isinstance(arg, int) and arg > 1 and arg % parts == 0


VIEW_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _prod(xs: Sequence) -> sympy.Expr:
    out = sympy.Integer(1)
    for x in xs:
        out *= x
    return out


def folded_view(node: fx.Node, d: int, outer: sympy.Expr | None, parts: int,
                fixes: list[ArgFix]) -> tuple[int, sympy.Expr | None]:
    """A view of a tensor split along ``d`` whose heads fold into the dim before them or unfold
    from it: ``(output dim, outer factor)``, the outer factor None once the heads are a dim again.

    ``outer`` None: ``d`` holds the heads (or heads x head_dim) unfolded; the view folds them as the
    inner factor of an output dim with the dims before them (``[B, H, S, D] -> [B*H, S, D]``, XGLM's
    ``bmm``; ``[S, B, H*D] -> [S, B*H, D]``, PyTorch's ``nn.MultiheadAttention``). Each rank's dim is
    ``outer x H / parts``: its size argument is divided (symbolic, ``B * 4`` computed in the graph:
    by a node inserted, ``B * 4 // parts``). ``outer``: ``d`` is such a folded dim; the view unfolds it
    (``[B*H, S, S] -> [B, H, S, S]``: the heads dim's size divided) or keeps it folded.
    Raises ShardError when neither fits."""
    src = node.args[0]
    ishape, oshape = shape_of(src), shape_of(node)
    args = list(node.args[1])

    def fix_size(j: int) -> None:
        arg = args[j]
        if isinstance(arg, int) and arg != -1:
            if arg % parts:
                raise ShardError(f"{node.name}: size {arg} of the folded heads dim {j} does not divide by {parts}")
            fixes.append(ArgFix(node.name, j, arg, arg // parts))
        elif isinstance(arg, fx.Node):
            fixes.append(ArgFix(node.name, j, arg.name, parts, div=True))

    acc = sympy.Integer(1)
    before = _prod(ishape[:d])
    for j, size in enumerate(oshape):
        if outer is not None:
            if sympy.simplify(acc - before * outer) == 0:  # the heads are a dim again
                if not (size.is_Integer and int(size) % parts == 0 and int(size) >= parts):
                    raise ShardError(f"{node.name}: the heads folded into dim {d} of {src.name} unfold into a dim "
                                     f"of size {size}, which {parts} ranks cannot divide")
                if isinstance(args[j], int) and args[j] != -1:
                    fixes.append(ArgFix(node.name, j, args[j], args[j] // parts))
                return j, None
            if sympy.simplify(acc - before) == 0 and sympy.simplify(size - ishape[d]) == 0:  # still folded
                fix_size(j)
                return j, outer
        else:
            for k in range(d):  # output dim j = input dims k..d-1 times the heads (the leading part of d)
                if sympy.simplify(acc - _prod(ishape[:k])) != 0:
                    continue
                lead = _prod(ishape[k:d])
                heads = sympy.simplify(size / lead)
                if heads.is_Integer and int(heads) % parts == 0 and int(heads) >= parts and \
                        sympy.simplify(ishape[d] / heads).is_Integer:
                    fix_size(j)
                    return j, lead
        acc *= size
    raise ShardError(f"{node.name}: cannot follow split dim {d} of {tuple(ishape)} into {tuple(oshape)}")


def _expand(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    src = node.args[0]
    d = sdim[src] + ndim(node) - ndim(src)
    arg = node.args[1][d]
    if isinstance(arg, int) and arg != -1 and fixes is not None:
        if arg % parts:
            raise ShardError(f"{node.name}: expand size {arg} at split dim {d} does not divide by {parts}")
        fixes.append(ArgFix(node.name, d, arg, arg // parts))
    return d


def _complex_view(node: fx.Node, sdim: dict, parts: int, fixes: list[ArgFix] | None = None) -> int | None:
    """``view_as_complex`` (``[.., n, 2]`` -> ``[.., n]``) and ``view_as_real`` (the reverse): the
    leading dims are kept, so a split dim among them stays where it is (a complex rotary over
    head_dim pairs, as Meta's Llama and gpt-fast apply it, on a tensor split along its heads)."""
    src = node.args[0]
    d = sdim[src]
    if node.target == aten.view_as_complex.default and d == ndim(src) - 1:
        raise ShardError(f"{node.name}: view_as_complex pairs the last dim, which is the split dim")
    return d


_TRANSPOSE_OPS = [getattr(aten, name).default for name in ("mT", "mH", "adjoint", "t", "numpy_T", "matrix_H")
                  if hasattr(aten, name)]

#: op -> its rule; every op a split tensor may reach is here, or the walk refuses it by name
RULES: dict[object, ShardRule] = {op: ShardRule(_elementwise, "elementwise") for op in ELEMENTWISE_OPS}
RULES.update({op: ShardRule(fn) for op, fn in {
    aten.mean.dim: _reduce_over, aten.sum.dim_IntList: _reduce_over, aten.amax.default: _reduce_over,
    aten.max.dim: _reduce_over, aten.min.dim: _reduce_over, aten.amin.default: _reduce_over,
    aten.softmax.int: _reduce_over, aten._softmax.default: _reduce_over, aten._safe_softmax.default: _reduce_over,
    aten.logsumexp.default: _reduce_over,  # (attention sinks as an LSE scale: Granite-SWA's)
    aten.transpose.int: _transpose, aten.permute.default: _permute,
    **{op: _reverse_dims for op in _TRANSPOSE_OPS}, aten.unsqueeze.default: _unsqueeze,
    aten.slice.Tensor: _along_other_dim, aten.cat.default: _along_other_dim, aten.chunk.default: _along_other_dim,
    aten.split.Tensor: _along_other_dim, aten.split_with_sizes.default: _along_other_dim,
    aten.tensor_split.indices: _along_other_dim, aten.cumsum.default: _along_other_dim,
    **{op: _elementwise for op in (aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
                                   aten.full_like.default)},  # (the shape of their input, split alike)
    aten.tril.default: _last_two, aten.triu.default: _last_two,
    aten.pad.default: _pad, aten.constant_pad_nd.default: _pad,
    aten.select.int: _along_other_dim, aten.unbind.int: _along_other_dim, aten.stack.default: _stack,
    aten.flatten.using_ints: _flatten, aten.squeeze.dim: _squeeze, aten.squeeze.dims: _squeeze,
    aten.einsum.default: _einsum,
    operator.getitem: _getitem, aten.layer_norm.default: _layer_norm, aten.index.Tensor: _index,
    aten.repeat_interleave.self_int: _repeat_interleave,
    **({aten.rms_norm.default: _layer_norm} if hasattr(aten, "rms_norm") else {}),
    aten.scaled_dot_product_attention.default: _sdpa,
    aten.matmul.default: _matmul, aten.bmm.default: _matmul, aten.baddbmm.default: _baddbmm,
    aten.linalg_solve_triangular.default: _matmul,  # (batched over the heads, as a matmul: a chunked delta rule)
    aten.view_as_complex.default: _complex_view, aten.view_as_real.default: _complex_view,
}.items()})
RULES.update({op: ShardRule(fn, "reshape") for op, fn in {
    aten.view.default: _reshape, aten.reshape.default: _reshape, aten._unsafe_view.default: _reshape,
    aten.expand.default: _expand, aten.broadcast_to.default: _expand, aten.new_empty.default: _new_empty,
    aten.unflatten.int: _unflatten,
}.items()})
IGNORED = {aten._assert_tensor_metadata.default}
# ops that cut a tensor into pieces along a dim: along the split dim they mark a fused projection
BLOCK_OPS = {aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor,
             aten.tensor_split.indices}


def one_head_broadcast(n: fx.Node, split_in: list[fx.Node], factor: dict[fx.Node, int],
                       dim: dict[fx.Node, int]) -> bool:
    """Attention whose operands on fewer ranks are one head broadcast to the others' (multi-query
    K / V of ``[B, 1, S, D]`` meeting split query heads in SDPA, no expand in the graph): every
    rank's query heads read the same single head, so each rank's slice is exact."""
    if n.target != aten.scaled_dot_product_attention.default:
        return False
    most = max(factor[a] for a in split_in)
    sizes = [(a.meta.get("val"), dim[a]) for a in split_in if factor[a] != most]
    return all(isinstance(v, torch.Tensor) and d < v.dim() and v.shape[d] == 1 for v, d in sizes)
