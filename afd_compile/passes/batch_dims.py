"""Where a program with a static batch holds its batch: the dims, and the constants that are it.

A program exported with a static KV cache has a static batch ``B``: ``input_ids`` is ``[B, s]``,
the cache ``[B, kv_heads, L, d]``, and ``B`` is written as a constant into every view, reshape
and expand (``view(x, [B, s, -1, 16])``). To run its sequences as micro-batches of ``b`` rows
(``passes/stages.py``), each copy of the program must say ``b`` where it said ``B``, and only
there: the head count of a reshape may equal ``B`` too. This pass follows the batch dim from the
inputs through the graph, op by op, as ``passes/shard/rules.py`` follows a split dim (those
rules are reused here: the batch is a split dim), and records every constant that is the batch.

Before (``B = 3``)::

    input_ids = placeholder                         # [3, s]   batch dim 0
    key_cache_0 = get_attr                          # [3, 2, 32, 16]
    view = aten.view(linear, [3, s, -1, 16])        # a batch site: [3 -> b]
    index_copy_ = aten.index_copy_(key_cache_0, 2, pos, k)   # the cache: batch dim 0 (from k)
    mask = aten.expand(le, [3, -1, s, 32])          # the batch created from a constant: a site
    sdpa = aten.scaled_dot_product_attention(q, k, v, mask)

:func:`plan_batch` returns a :class:`BatchPlan` (printable): the batch dim of every tensor the
batch reaches (``node.meta["afd.batch_dim"]``), the inputs and states that carry it, the sites,
the batch dim of each output. Refused with a :class:`BatchError` naming the node: an op that
mixes sequences (a reduction or a norm over the batch dim, a ``cat`` along it), an op this pass
has no rule for that the batch reaches.
"""

from __future__ import annotations

import operator
import sys
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from .. import meta_keys
from .. import ops as afd_ops  # noqa: F401  (registers the afd ops)
from ..errors import AFDCompileError
from .graph_utils import aliases_first_arg
from .shard.rules import RULES as SHARD_RULES
from .shard.rules import ndim, shape_of
from .shard.types import ArgFix, ShardError
from .symbolic import sym_expr

aten = torch.ops.aten
afd = torch.ops.afd

META_KEY = meta_keys.BATCH_DIM


class BatchError(AFDCompileError):
    """A static-batch program whose sequences cannot be run apart, and where."""


@dataclass(frozen=True)
class BatchSite:
    """A constant that is (a multiple of) the batch: ``node.args[arg][index]``."""

    node: str
    arg: int
    index: int
    value: int

    def resized(self, batch: int, rows: int) -> int:
        """The constant for ``rows`` sequences out of ``batch``."""
        return self.value // batch * rows


@dataclass(frozen=True)
class BatchPlan:
    batch: int
    #: graph inputs and states (placeholders, get_attr) carrying the batch: (name, dim)
    inputs: tuple[tuple[str, int], ...]
    sites: tuple[BatchSite, ...]
    #: the batch dim of each flat output (None: it does not carry the batch)
    outputs: tuple[int | None, ...]

    def describe(self) -> str:
        ins = ", ".join(f"{n}[{d}]" for n, d in self.inputs)
        return (f"static batch {self.batch}: carried by {ins}; {len(self.sites)} constant(s) are the batch "
                f"({', '.join(s.node for s in self.sites[:6])}{', ...' if len(self.sites) > 6 else ''}); "
                f"outputs along dims {list(self.outputs)}")


_ELEMENTWISE_MORE = {
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor, aten.lt.Scalar,
    aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar,
    aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_not.default, aten.logical_and.default,
    aten.logical_or.default, aten.logical_not.default, aten.tanh.default, aten.where.ScalarOther,
    aten.where.ScalarSelf, aten.masked_fill.Tensor, aten.to.device, aten.to.dtype, aten.fill_.Scalar,
    aten.reciprocal.default, aten.softplus.default, aten.clamp_min.default, aten.clamp_max.default,
    aten.detach.default, aten.lift_fresh_copy.default, aten.sigmoid.default, aten.log_softmax.int,
}
#: factories and expands: where a constant can create the batch dim of a tensor the inputs do not reach
_CREATORS = {aten.expand.default: 1, aten.broadcast_to.default: 1, aten.new_zeros.default: 1,
             aten.new_ones.default: 1, aten.new_full.default: 1, aten.new_empty.default: 1,
             aten.zeros.default: 0, aten.ones.default: 0, aten.full.default: 0, aten.empty.memory_format: 0}


#: op -> (position of its dim argument, its default)
_CHOICES = {aten.topk.default: (2, -1), aten.sort.default: (1, -1), aten.argmax.default: (1, None),
            aten.argmin.default: (1, None)}


class _Restart(Exception):
    """A tensor turned out to carry the batch (a state written from the batch, a mask expanded
    to it): walk again with it seeded."""


def _aligned(node: fx.Node, a: fx.Node, d: int) -> int:
    return d - (ndim(node) - ndim(a))


def _size(a: fx.Node, d: int) -> object:
    return sym_expr(a.meta["val"].shape[d])


class _Walk:
    def __init__(self, gm: fx.GraphModule, batch: int, seeds: dict[fx.Node, int], name: str, why: str | None = None):
        self.gm, self.batch, self.name, self.why = gm, batch, name, why
        self.seeds = dict(seeds)
        self.created: dict[fx.Node, int] = {}  # creator node -> the dim its constant makes the batch

    def run(self) -> tuple[dict[fx.Node, int], list[BatchSite]]:
        for _ in range(64):
            try:
                return self._once()
            except _Restart:
                continue
        raise BatchError(f"{self.name}: the batch dim does not settle")  # pragma: no cover

    def where(self, n: fx.Node) -> str:
        return f"{self.name}: node {n.name} ({n.target})"

    def _once(self) -> tuple[dict[fx.Node, int], list[BatchSite]]:
        bd: dict[fx.Node, int] = {}
        sites: list[BatchSite] = []
        for n in self.gm.graph.nodes:
            if n in self.seeds:
                bd[n] = self.seeds[n]
                continue
            if n.op != "call_function":
                continue
            if n in self.created:
                d = self.created[n]
                pos = _CREATORS[n.target]
                sites.append(BatchSite(n.name, pos, d, int(n.args[pos][d])))
                bd[n] = d
                continue
            if n.target in _CREATORS and (d := self._sized_by_batch(n, bd)) is not None:
                bd[n] = d  # its size there is read off the batch: each micro-batch's copy reads its own
                continue
            if n.target in afd_ops.RECV_OPS:
                bd[n] = 0  # the tokens received: dim 0 of every tensor (its input is the send's token)
                continue
            if not any(a in bd for a in n.all_input_nodes):
                continue
            d = self._rule(n, bd, sites)
            if d is not None:
                bd[n] = d
        return bd, sites

    # --- a tensor the batch does not reach, met where the batch is ------------------------------

    def _unbatched_operand(self, n: fx.Node, a: fx.Node, d: int) -> None:
        """``a`` (not carrying the batch) meets the batch at its dim ``d`` in ``n``: fine if it
        broadcasts there (size 1 or no such dim); a constant creating it is made a site; else refused."""
        if d < 0 or not isinstance(a.meta.get("val"), torch.Tensor) or _size(a, d) == 1:
            return
        creator = self._creator(a, d, 12)
        if creator is not None:
            self.created[creator[0]] = creator[1]  # the constant creates the batch dim: a site
            raise _Restart
        raise BatchError(f"{self.where(n)}: operand {a.name} spans the batch dim {d} (size {_size(a, d)}) without "
                         "carrying the batch from the program's inputs: micro-batches of whole sequences cannot "
                         "cut it")

    def _creator(self, a: fx.Node, d: int, depth: int) -> tuple[fx.Node, int] | None:
        """The expand or factory whose constant made dim ``d`` of ``a`` the batch's size: ``a``
        itself, or found up through the tensors ``a`` is computed from elementwise (a mask
        expanded to the batch, then turned into a bias by ``where``)."""
        if depth == 0 or a.op != "call_function" or not isinstance(a.meta.get("val"), torch.Tensor) \
                or d < 0 or _size(a, d) != self.batch:
            return None
        pos = _CREATORS.get(a.target)
        sizes = a.args[pos] if pos is not None and len(a.args) > pos else None
        if isinstance(sizes, (list, tuple)) and d < len(sizes) and sizes[d] == self.batch and a not in self.created:
            inner = a.args[0] if pos == 1 else None
            if not isinstance(inner, fx.Node) or _aligned(a, inner, d) < 0 or _size(inner, _aligned(a, inner, d)) == 1:
                return a, d
            return None
        elementwise = a.target in _ELEMENTWISE_MORE or (a.target in SHARD_RULES
                                                        and SHARD_RULES[a.target].kind == "elementwise")
        if not elementwise:
            return None
        for x in a.all_input_nodes:
            found = self._creator(x, _aligned(a, x, d), depth - 1)
            if found is not None:
                return found
        return None

    def _sized_by_batch(self, n: fx.Node, bd: dict[fx.Node, int]) -> int | None:
        """The dim of a factory or an expand (of a tensor without the batch) whose size is read
        off the batch (``inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)``): it
        makes the batch there, as a micro-batch's own rows. ``None``: no such dim."""
        pos = _CREATORS[n.target]
        sizes = n.args[pos] if len(n.args) > pos else None
        inner = n.args[0] if pos == 1 else None
        if not isinstance(sizes, (list, tuple)) or (isinstance(inner, fx.Node) and inner in bd):
            return None
        dims = [j for j, a in enumerate(sizes) if self._batch_size_of(a, bd)]
        if not dims:
            return None
        if len(dims) > 1:
            return self._refuse(n, f"its sizes at dims {dims} are all read off the batch")
        d = dims[0]
        if isinstance(inner, fx.Node) and _aligned(n, inner, d) >= 0 and _size(inner, _aligned(n, inner, d)) != 1:
            return self._refuse(n, f"it expands dim {d} of {inner.name} (size {_size(inner, _aligned(n, inner, d))}) "
                                   "to the batch")
        return d

    def _seed_state(self, n: fx.Node, state: fx.Node, d: int) -> None:
        base = state
        while base.op == "call_function" and aliases_first_arg(base):
            base = base.args[0]
        if base.op not in ("placeholder", "get_attr") or base is not state:
            raise BatchError(f"{self.where(n)} writes the batch into {state.name}, which is not a state "
                             "(a graph input or buffer) itself")
        if _size(state, d) != self.batch:
            raise BatchError(f"{self.where(n)} writes the batch into dim {d} of {state.name}, of size "
                             f"{_size(state, d)}, not the batch {self.batch}")
        self.seeds[state] = d
        raise _Restart

    # --- the rules --------------------------------------------------------------------------

    def _rule(self, n: fx.Node, bd: dict[fx.Node, int], sites: list[BatchSite]) -> int | None:
        t = n.target
        if t == operator.getitem:
            return bd[n.args[0]]
        if t == aten._assert_tensor_metadata.default:
            return None  # a check of dtype and device, not of shape
        if t == aten.sym_size.int:
            return None  # a size: the batch's is the micro-batch's once its input is cut
        if t in afd_ops.SEND_OPS or t in (afd.p2p_send_start.default,):
            return None  # a token
        if t in (aten.index_copy_.default, aten.index_copy.default):
            return self._index_copy(n, bd)
        if t == aten.copy_.default:
            dst, src = n.args[:2]
            if src in bd and dst not in bd:
                self._seed_state(n, dst, bd[src] + ndim(dst) - ndim(src))
            return bd.get(dst)
        if t == aten.slice.Tensor and n.args[0] in bd and (d := self._batch_slice(n, bd)) is not None:
            return d
        if t == aten.linear.default:
            x = n.args[0]
            if x not in bd or bd[x] >= ndim(x) - 1 or any(a in bd for a in n.args[1:] if isinstance(a, fx.Node)):
                return self._refuse(n, "linear over the batch dim, or with a weight carrying the batch")
            return bd[x]
        if t == aten.addmm.default:  # addmm(bias, x, w): Conv1D-style projections
            if n.args[1] not in bd or bd[n.args[1]] != 0 or any(a in bd for a in (n.args[0], n.args[2])):
                return self._refuse(n, "addmm with the batch outside its first matrix's rows")
            return 0
        if t == aten.embedding.default:
            if n.args[0] in bd:
                return self._refuse(n, "an embedding table carrying the batch")
            return bd[n.args[1]]
        if t == aten.scaled_dot_product_attention.default:
            return self._sdpa(n, bd)
        if t in _CHOICES:  # per row along another dim (an MoE router's top-k over the experts)
            return self._choice(n, bd)
        if t == afd.moe_experts.default:  # one row per token: x, its expert ids and weights
            if any(bd.get(a) != 0 for a in n.args[:3]) or any(a in bd for a in n.args[3:] if isinstance(a, fx.Node)):
                return self._refuse(n, "the MoE op with its tokens not all along dim 0, or a weight carrying them")
            return 0
        if t in (aten.matmul.default, aten.bmm.default):
            return self._matmul(n, bd)
        if t in SHARD_RULES and t not in (aten.expand.default, aten.broadcast_to.default, aten.new_empty.default,
                                          aten.view.default, aten.reshape.default, aten._unsafe_view.default) \
                and SHARD_RULES[t].kind != "elementwise":
            return self._shard_rule(n, bd, sites)
        if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            return self._reshape(n, bd, sites)
        if t in (aten.expand.default, aten.broadcast_to.default, aten.new_empty.default):
            return self._shard_rule(n, bd, sites)
        if (t in SHARD_RULES and SHARD_RULES[t].kind == "elementwise") or t in _ELEMENTWISE_MORE:
            return self._elementwise(n, bd)
        if self.why is None:
            raise BatchError(f"{self.where(n)}: the batch reaches an op micro-batch stages have no rule for; "
                             "run this program with stages=1")
        raise BatchError(f"{self.where(n)}: the batch reaches an op with no rule for it here: {self.why}")

    def _choice(self, n: fx.Node, bd: dict[fx.Node, int]) -> int | None:
        """``topk`` / ``sort`` / ``argmax`` / ``argmin`` along a dim that is not the batch's."""
        x, (dim_at, default) = n.args[0], _CHOICES[n.target]
        dim = n.args[dim_at] if len(n.args) > dim_at else n.kwargs.get("dim", default)
        d = bd[x]
        if dim is None or dim % ndim(x) == d:
            return self._refuse(n, "it chooses along the batch dim")
        keep = n.target in (aten.topk.default, aten.sort.default) or (len(n.args) > 2 and n.args[2]) or \
            n.kwargs.get("keepdim", False)
        return d if keep or dim % ndim(x) > d else d - 1

    def _batch_slice(self, n: fx.Node, bd: dict[fx.Node, int]) -> int | None:
        """``x[start:end:step]`` along the batch dim: followed when it keeps every row (``end``
        past the size, or read off the batch), an identity here and in each micro-batch's copy
        (its rows are fewer, so the same ``end`` keeps them all: a slice clamps; some torch
        versions' graphs keep such no-op slices where others drop them); refused when it drops
        rows. ``None``: not along the batch dim (the shard rule follows it)."""
        src = n.args[0]
        dim, start, end, step = (list(n.args[1:]) + [0, None, None, 1][len(n.args) - 1:])[:4]
        d = bd[src]
        if dim % ndim(src) != d:
            return None
        size = _size(src, d)
        if isinstance(end, int):
            whole_end = end >= sys.maxsize // 2 or bool(sympy.simplify(sympy.Integer(end) - size).is_nonnegative)
        else:
            whole_end = end is None or self._batch_size_of(end, bd)
        if start in (None, 0) and step == 1 and whole_end:
            return d
        end_text = getattr(end, "name", end)
        return self._refuse(n, f"a slice [{start}:{end_text}:{step}] of the batch dim {d} (size {size}) "
                            "that drops rows")

    def _refuse(self, n: fx.Node, what: str) -> int | None:
        raise BatchError(f"{self.where(n)}: {what}: {self.why or 'micro-batches of whole sequences cannot cut it'}")

    def _shard_rule(self, n: fx.Node, bd: dict[fx.Node, int], sites: list[BatchSite]) -> int | None:
        fixes: list[ArgFix] = []
        try:
            d = SHARD_RULES[n.target].fn(n, bd, 1, fixes)
        except ShardError as e:
            why = f": {self.why}" if self.why else ""
            raise BatchError(f"{self.name}: the batch dim: {e}".replace("split dim", "batch dim") + why) from None
        except Exception as e:  # a rule's Replicate: no head count is divided here
            raise BatchError(f"{self.where(n)}: cannot follow the batch dim ({type(e).__name__}: {e})") from None
        for f in fixes:
            if f.old % self.batch:
                raise BatchError(
                    f"{self.where(n)}: its size {f.old} at the batch dim {f.index} is not a multiple of "
                    f"the batch {self.batch}"
                )
            sites.append(BatchSite(n.name, f.arg, f.index, f.old))
        return d

    def _reshape(self, n: fx.Node, bd: dict[fx.Node, int], sites: list[BatchSite]) -> int | None:
        """view / reshape: the batch dim goes to the output dim that starts at the same element
        offset (the leading dims before it kept, or their product); that dim's size is the batch
        times what it merged (tokens flattened: ``[B, s, H] -> [B * s, H]``)."""
        src = n.args[0]
        d = bd[src]
        ishape, oshape = shape_of(src), shape_of(n)
        prefix = sympy.Mul(*ishape[:d])
        kept = len(oshape) > d and all(sympy.simplify(a - b) == 0 for a, b in zip(ishape[:d], oshape[:d], strict=False))
        acc = sympy.Integer(1)
        for j, size in enumerate(oshape):
            if (j == d) if kept else sympy.simplify(acc - prefix) == 0:
                inner = sympy.simplify(size / self.batch)
                if inner.is_Rational and not inner.is_Integer or sympy.simplify(size - inner * self.batch) != 0:
                    return self._refuse(n, f"its output dim {j} (size {size}) holds a part of the batch")
                arg = n.args[1][j]
                if isinstance(arg, int) and arg != -1:
                    if arg % self.batch:
                        return self._refuse(n, f"its size {arg} at the batch dim {j} is not a multiple of the batch")
                    sites.append(BatchSite(n.name, 1, j, arg))
                elif (
                    not isinstance(arg, int)
                    and not (size.free_symbols and inner.free_symbols)
                    and not self._batch_size_of(arg, bd)
                ):
                    return self._refuse(n, f"its size at the batch dim {j} is computed ({arg})")
                return j
            acc *= size
        return self._refuse(n, f"the batch dim {d} of {tuple(ishape)} does not map onto {tuple(oshape)}")

    def _batch_size_of(self, arg: object, bd: dict[fx.Node, int]) -> bool:
        """``arg`` is read off a tensor carrying the batch, at its batch dim (times a constant):
        a micro-batch's copy reads its own rows' count."""
        if isinstance(arg, fx.Node) and arg.target == operator.mul and len(arg.args) == 2:
            return any(self._batch_size_of(a, bd) for a in arg.args) and any(isinstance(a, int) for a in arg.args)
        return (
            isinstance(arg, fx.Node)
            and arg.target == aten.sym_size.int
            and arg.args[0] in bd
            and arg.args[1] == bd[arg.args[0]]
        )

    def _elementwise(self, n: fx.Node, bd: dict[fx.Node, int]) -> int | None:
        dims = {bd[a] + ndim(n) - ndim(a) for a in n.all_input_nodes if a in bd}
        if len(dims) != 1:
            return self._refuse(n, f"tensors with the batch at different dims {sorted(dims)} combined")
        d = dims.pop()
        for a in n.all_input_nodes:
            if a not in bd:
                self._unbatched_operand(n, a, _aligned(n, a, d))
        return d

    def _index_copy(self, n: fx.Node, bd: dict[fx.Node, int]) -> int | None:
        state, dim, _, src = n.args[:4]
        if src not in bd:
            return self._refuse(n, "a write of something without the batch into a state carrying it")
        d = bd[src]
        if dim % ndim(state) == d:
            return self._refuse(n, f"a write along the batch dim {d}")
        if state not in bd:
            self._seed_state(n, state, d)
        if bd[state] != d:
            return self._refuse(n, f"a write of the batch at dim {d} into {state.name}'s dim {bd[state]}")
        return d

    def _sdpa(self, n: fx.Node, bd: dict[fx.Node, int]) -> int | None:
        q, k, v = n.args[:3]
        if not all(x in bd for x in (q, k, v)) or len({bd[x] + ndim(n) - ndim(x) for x in (q, k, v)}) != 1:
            return self._refuse(n, "attention whose query, key and value do not all carry the batch at one dim")
        d = bd[q]
        if d >= ndim(q) - 2:
            return self._refuse(n, "attention over the batch dim")
        mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node) and mask not in bd:
            self._unbatched_operand(n, mask, _aligned(n, mask, d))
        elif isinstance(mask, fx.Node) and bd[mask] != _aligned(n, mask, d):
            return self._refuse(n, "a mask carrying the batch at another dim")
        return d

    def _matmul(self, n: fx.Node, bd: dict[fx.Node, int]) -> int | None:
        a, b = n.args[:2]
        out = ndim(n)
        dims = {bd[x] + out - ndim(x) for x in (a, b) if x in bd}
        if len(dims) != 1 or dims.pop() >= out - 2:
            return self._refuse(n, "a matmul over the batch dim")
        d = next(bd[x] + out - ndim(x) for x in (a, b) if x in bd)
        for x in (a, b):
            if x not in bd:
                self._unbatched_operand(n, x, _aligned(n, x, d))
        return d


def plan_batch(
    gm: fx.GraphModule, batch: int, seeds: dict[str, int], name: str = "program", why: str | None = None
) -> BatchPlan:
    """Follow the batch (of size ``batch``) from ``seeds`` (node name -> dim: the inputs that
    carry it) through ``gm``; writes ``node.meta[META_KEY]`` (module docstring). ``why``: what a
    refusal means to the caller (default: micro-batch stages cannot cut the batch)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    walk = _Walk(gm, batch, {by_name[k]: d for k, d in seeds.items()}, name, why)
    bd, sites = walk.run()
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat, _ = torch.utils._pytree.tree_flatten(out.args[0])
    outputs = tuple(bd.get(o) if isinstance(o, fx.Node) else None for o in flat)
    for n in gm.graph.nodes:
        n.meta.pop(META_KEY, None)
        if n in bd:
            n.meta[META_KEY] = bd[n]
    inputs = tuple((n.name, d) for n, d in bd.items() if n.op in ("placeholder", "get_attr"))
    return BatchPlan(batch, inputs, tuple(sites), outputs)
