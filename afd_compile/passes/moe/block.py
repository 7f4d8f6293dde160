"""Where an MoE block's experts sit in a graph, found by structure alone (:func:`find_blocks`).

The interface of every expert form is the same, whatever the model wrote between:

- the router's choice ``ids [T, K]``: the integer indices of a selection over ``[T, E]`` scores
  (``topk``; ``max`` / ``argmax`` over the experts, several concatenated, as PhiMoE's
  sparsemixer picks one expert at a time; a ``sort`` sliced to its first ``K``), the widest
  choice when several reach one combine (group-limited routing selects groups first);
- the token rows the experts read, ``x [T, H]`` (not computed from the choice);
- the combine: the first ``[T, H]`` tensor computed from ``ids`` (a loop's ``index_add_``
  chain is followed to its last link);
- a probe source: the latest tensor both the router and ``x`` are computed from, from which the
  block can be evaluated whole (router included) on random rows (``match.py``).

The expert path is what the block computes from ``x`` other than through the router; that is
what the op replaces. Everything else between the choice and the combine (sorting the ids,
normalising or gathering the routing weights, a dense ``[T, E]`` weight matrix) is routing,
kept, and dead code once the op reads what it needs.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ... import moe as _moe  # noqa: F401  (registers afd::moe_experts)
from ..graph_utils import writes_first_arg
from ..op_kinds import LINEAR_OPS, PASSTHROUGH_OPS
from ..roles import ancestors, descendants
from ..router import EXPERT_SELECT_OPS
from ..symbolic import sym_expr

aten = torch.ops.aten

#: ops whose values do not depend on their input's (a loop's accumulator): never the token rows
_SHAPE_ONLY = {aten.zeros_like.default, aten.empty_like.default, aten.ones_like.default, aten.full_like.default,
               aten.new_zeros.default, aten.new_empty.default, aten.new_ones.default, aten.new_full.default,
               aten.zeros.default, aten.empty.memory_format, aten.full.default, aten.ones.default}

#: ops a probe cannot run or need not (asserts, metadata checks): kept out of the evaluation
_SKIPPED = {aten._assert_tensor_metadata.default, aten._assert_scalar.default}




@dataclass(frozen=True)
class Choice:
    """A candidate expert choice: integer ``ids [T, K]`` (``[T]`` for one expert) selected from
    ``[T, E]`` scores by the ``selects`` nodes."""

    ids: fx.Node
    selects: tuple[fx.Node, ...]
    num_experts: int
    ranking: bool = False  # all E experts in order (a sort's indices): a choice only sliced to K

    @property
    def top_k(self) -> int:
        v = self.ids.meta["val"]
        return int(v.shape[1]) if v.dim() == 2 else 1


@dataclass
class Block:
    """One MoE block's interface in the graph (see the module docstring)."""

    choice: Choice
    ids: fx.Node
    end: fx.Node  # the combine's last node: its value is the routed experts' sum, [T, H]
    x: fx.Node  # the token rows the experts read
    source: fx.Node  # what the probe feeds (router and experts are computed from it)
    closure: list[fx.Node]  # what the probe evaluates, graph order (source excluded)
    experts: set[fx.Node]  # the expert path (replaced by the op)
    params: list[fx.Node]  # the get_attr nodes the expert path reads (weights, biases)
    router: set[fx.Node]  # the choice and what it is computed from
    bases: list[fx.Node]  # tensors the expert path writes in place (a loop's zeros): read after it as ``end``

    @property
    def num_experts(self) -> int:
        return self.choice.num_experts

    @property
    def top_k(self) -> int:
        return self.choice.top_k

    @property
    def first(self) -> fx.Node:
        """The first selection op: where the block's routing starts."""
        return self.choice.selects[0]


def hint(v: object) -> int | None:
    """A size's value in the traced example (None for a data-dependent size)."""
    if isinstance(v, (int, bool)):
        return int(v)
    if isinstance(v, torch.SymInt):
        try:
            env = v.node.shape_env  # (torch 2.13 renames size_hint)
            return int(getattr(env, "guarding_hint_or_throw", env.size_hint)(v.node.expr))
        except Exception:  # an unbacked (data-dependent) size has no hint
            return None
    return None


def same(a: object, b: object) -> bool:
    """Two sizes (ints or SymInts) are equal for every value of their symbols."""
    try:
        return sym_expr(a) - sym_expr(b) == 0
    except TypeError:
        return False


def rows_of(v: object) -> object | None:
    """The leading (token) extent of a ``[..., H]`` tensor value: the product of its leading dims."""
    if not isinstance(v, torch.Tensor) or v.dim() < 2:
        return None
    n: object = 1
    for s in v.shape[:-1]:
        n = n * s
    return n


def _is_rows(n: fx.Node, tokens: object, width: int | None = None, two_d: bool = True) -> bool:
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.dim() < 2 or (two_d and v.dim() != 2):
        return False
    if width is not None and not same(v.shape[-1], width):
        return False
    return rows_of(v) is not None and same(rows_of(v), tokens)


def choices(gm: fx.GraphModule) -> list[Choice]:
    """Every candidate expert choice, graph order: each selection's indices over the last dim of
    ``[T, E]`` float scores, and what concatenates, slices (from 0), casts or unsqueezes them."""
    found: dict[fx.Node, Choice] = {}
    for n in gm.graph.nodes:
        if n.target in EXPERT_SELECT_OPS:
            c = _selected(n)
            if c is not None:
                found[c.ids] = c
            continue
        ins = [found.get(a) for a in n.all_input_nodes]
        if not any(ins) or not _int_rows(n):
            continue
        if n.target in (aten.cat.default, aten.concat.default) and _last_dim(n, n.args[1] if len(n.args) > 1 else 0) \
                and all(c is not None for c in ins):
            sel = tuple(dict.fromkeys(s for c in ins for s in c.selects))
            found[n] = Choice(n, sel, max(c.num_experts for c in ins), any(c.ranking for c in ins))
        elif n.args[0] not in found:
            continue
        elif _keeps_choice(n):
            c = found[n.args[0]]
            found[n] = Choice(n, c.selects, c.num_experts, c.ranking and n.meta["val"].shape[-1] == c.num_experts)
    return [c for c in found.values() if _int_rows(c.ids) and not c.ranking]


def _keeps_choice(n: fx.Node) -> bool:
    """``n`` is its first input's choice again: the same shape (a cast, a copy, a full slice),
    its first ``K`` (a slice of the last dim from 0), or ``[T]`` as ``[T, 1]``."""
    src, out = n.args[0].meta["val"], n.meta["val"]
    if n.target in PASSTHROUGH_OPS or n.target == aten.slice.Tensor:
        if out.shape == src.shape:
            return True
    if n.target == aten.slice.Tensor:
        return _last_dim(n.args[0], n.args[1] if len(n.args) > 1 else 0) and (n.args[2] if len(n.args) > 2 else 0) \
            in (0, None)
    return n.target == aten.unsqueeze.default and src.dim() == 1 and n.args[1] in (1, -1)


def _selected(n: fx.Node) -> Choice | None:
    scores = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point() or scores.dim() < 2 or \
            not isinstance(scores.shape[-1], int):
        return None
    at = 2 if n.target == aten.topk.default else 1  # (topk(x, k, dim); max / argmax / sort(x, dim))
    dim = n.args[at] if len(n.args) > at else n.kwargs.get("dim", -1)
    if not _last_dim(n.args[0], dim):
        return None
    out = EXPERT_SELECT_OPS[n.target]
    ids = n if out is None else next((u for u in n.users if u.target == operator.getitem and u.args[1] == out), None)
    return None if ids is None else Choice(ids, (n,), int(scores.shape[-1]), n.target == aten.sort.default)


def _last_dim(n: object, dim: object) -> bool:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return isinstance(v, torch.Tensor) and isinstance(dim, int) and dim in (-1, v.dim() - 1)


def _int_rows(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dtype != torch.bool and v.dim() in (1, 2)


def find_blocks(gm: fx.GraphModule) -> list[Block]:
    """Every MoE block's interface, in graph order. A choice whose indices reach no ``[T, H]``
    combine (a top-k over vocabulary logits) is none; of several choices reaching one combine
    (a group-limited routing's groups, then its experts; one expert at a time, then all) the one
    over the most experts, choosing the most, is the block's."""
    order = {n: j for j, n in enumerate(gm.graph.nodes)}
    by_end: dict[fx.Node, Choice] = {}
    for c in choices(gm):
        end = _combine(c, order)
        if end is None or end.target == torch.ops.afd.moe_experts.default:
            continue  # (none, or recognised already)
        if end not in by_end or _rank(c, order) > _rank(by_end[end], order):
            by_end[end] = c
    return [b for end, c in sorted(by_end.items(), key=lambda kv: order[kv[0]])
            if (b := _block(gm, c, end, order)) is not None]


def _rank(c: Choice, order: dict[fx.Node, int]) -> tuple[int, int, int]:
    return c.num_experts, c.top_k, order[c.ids]


def _combine(c: Choice, order: dict[fx.Node, int]) -> fx.Node | None:
    """The first ``[T, H]`` tensor computed from the choice, ``H`` a width the router reads,
    then along the combine chain: a user that adds another expert's result (a loop's next
    ``index_add_``) continues it."""
    ids = c.ids
    tokens = ids.meta["val"].shape[0]
    up = ancestors([ids])
    # the hidden width: what the router's projection reads (else any row width but the scores')
    widths = {int(v.shape[-1]) for a in up if a.target in LINEAR_OPS and isinstance(a.args[0], fx.Node)
              and _is_rows(a.args[0], tokens, two_d=False) and isinstance((v := a.args[0].meta["val"]).shape[-1], int)}
    if not widths:
        widths = {int(v.shape[-1]) for a in up if _is_rows(a, tokens, two_d=False)
                  and isinstance((v := a.meta["val"]).shape[-1], int)} - {c.num_experts}
    down = descendants(ids)
    hits = sorted((n for n in down if any(_is_rows(n, tokens, w) for w in widths)), key=order.__getitem__)
    if not hits:
        return None
    end = hits[0]
    width = int(end.meta["val"].shape[-1])
    while True:
        nxt = [u for u in end.users if _is_rows(u, tokens, width) and any(
            a in down and a is not end for a in u.all_input_nodes)]
        if len(nxt) != 1:
            return end
        end = nxt[0]


def _block(gm: fx.GraphModule, c: Choice, end: fx.Node, order: dict[fx.Node, int]) -> Block | None:
    ids = c.ids
    tokens = ids.meta["val"].shape[0]
    width = int(end.meta["val"].shape[-1])
    router = ancestors([ids])
    chosen = set().union(*(descendants(s) for s in c.selects))
    up = ancestors([end])
    # the rows the experts read: read by something besides the router (the router may view them again)
    xs = [n for n in up if n not in chosen and n.target not in _SHAPE_ONLY and _is_rows(n, tokens, width)
          and any(u in up and u not in router for u in n.users)]
    if not xs:
        return None
    x = max(xs, key=order.__getitem__)
    common = [n for n in ancestors([x]) & router if _is_rows(n, tokens, width, two_d=False)]
    if not common:
        return None
    source = max(common, key=order.__getitem__)
    closure = _closure(end, source, order)
    inside = set(closure)
    experts = _forward(x, inside, blocked=router) - {x}
    # what the expert path reads, not through the rows (a norm of them with its weight: Gemma-4's)
    # nor the routing weights (a per-expert scale gathered at the chosen experts weighs the routing)
    weighing = {n for n, _ in _routing(c, closure, experts, router)}
    reads = ancestors(experts, stop=lambda n: n is x or n in weighing, within=inside | experts)
    # (a get_attr node may be the router's ancestor too: a block applied as several layers)
    params = sorted({a for n in reads - router for a in n.all_input_nodes if a.op == "get_attr"},
                    key=order.__getitem__)
    bases = [n.args[0] for n in closure if n in experts and writes_first_arg(n) and isinstance(n.args[0], fx.Node)]
    return Block(c, ids, end, x, source, closure, experts, params, router, list(dict.fromkeys(bases)))


def _closure(end: fx.Node, source: fx.Node, order: dict[fx.Node, int]) -> list[fx.Node]:
    """What the probe evaluates to get ``end`` from ``source``: ``end``'s ancestors (not past
    ``source``, nor past a size: sizes come from the symbols' hints) and the in-place updates of
    them that run before ``end``, in graph order."""
    seen: set[fx.Node] = set()
    stack = [end]
    while stack:
        n = stack.pop()
        if n in seen or n is source:
            continue
        seen.add(n)
        v = n.meta.get("val")
        if not isinstance(v, (torch.SymInt, int, bool)) or hint(v) is None:
            stack.extend(n.all_input_nodes)
        stack.extend(u for u in n.users if u not in seen and writes_first_arg(u) and u.args[0] is n
                     and order[u] < order[end])
    return sorted((n for n in seen if n.target not in _SKIPPED), key=order.__getitem__)


def _forward(x: fx.Node, inside: set[fx.Node], blocked: set[fx.Node]) -> set[fx.Node]:
    """``x`` and what is computed from it inside the closure, not through the router."""
    seen: set[fx.Node] = set()
    stack = [x]
    while stack:
        n = stack.pop()
        if n in seen or (n is not x and (n not in inside or n in blocked)):
            continue
        seen.add(n)
        stack.extend(n.users)
    return seen


def routing_candidates(block: Block) -> list[tuple[fx.Node, bool]]:
    """Routing-weight tensors computed from the choice, latest first: ``[T, K]`` ones (``[T]``
    for one expert per token), then dense ``[T, E]`` ones (read at the chosen experts)."""
    return _routing(block.choice, block.closure, block.experts, block.router)


def _routing(c: Choice, closure: list[fx.Node], experts: set[fx.Node],
             router: set[fx.Node]) -> list[tuple[fx.Node, bool]]:
    tokens, k, e = c.ids.meta["val"].shape[0], c.top_k, c.num_experts
    out: list[tuple[fx.Node, bool]] = []
    for n in reversed([n for n in closure if n not in experts and n not in router]):
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() == 1 and k == 1 and \
                same(v.shape[0], tokens):
            out.append((n, False))
        elif isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() == 2 and same(v.shape[0], tokens):
            if same(v.shape[1], k):
                out.append((n, False))
            elif same(v.shape[1], e):
                out.append((n, True))
    return sorted(dict.fromkeys(out), key=lambda c: c[1])
