"""Vocab-parallel LM head: the head's weight split by rows (its vocabulary) over the group that
holds the final hidden states; each rank computes its slice of the logits and one all-gather
along the last dim joins them: the state algebra's ``TP_ATTN_FULL+S -> TP_ATTN_FULL``
(``scatter.transition``, ``dim="last"``). Before / after, attention TP group of 2, vocab 128::

    logits = linear(norm, lm_head.weight[128, 64])          # TP_ATTN_FULL, the whole weight on every rank

    part = linear(norm, lm_head.weight[64, 64])             # TP_ATTN_FULL+S, rows r*64 .. r*64+63
    logits = afd.all_gather_last(part, ATTN_TP, 128)        # TP_ATTN_FULL

The head is found by structure: the last projection (linear, addmm, mm/matmul with a 2-D weight
attribute) after the last layer on a path to the output. A weight the embedding also reads (tied
embeddings) is not sliced in place: the head gets its own slice as a new attribute. A vocabulary
the group does not divide is padded: each rank holds ``ceil(V / parts)`` rows, zero rows past
``V``, and the gather keeps the first ``V`` columns. Each rank then reads 1/parts of the head per
step (at decode the head is the largest single weight), and the logits cross the group once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from .. import meta_keys
from .. import ops as afd_ops  # noqa: F401  (registers torch.ops.afd)
from ..comm import GROUP_ATTN_TP
from ..scatter import DistState, ScatterMode, TPLayout, Transition, transition
from .graph_utils import get_attr_path, set_attr_path
from .op_kinds import LINEAR_OPS
from .roles import role_of
from .shard import ShardError, projection

META_DIST = meta_keys.DIST
HEAD_ATTR = "afd_vocab_head"  # prefix of the head's own slices when the embedding reads its weight


@dataclass(frozen=True)
class HeadPlan:
    """The head projection ``node`` and how it is split. ``transition`` is None when the head stays
    whole (``why`` says why: a group of one rank, a form the sharding cannot read, or
    ``vocab_parallel`` off)."""

    node: str
    weight: str
    vocab: int
    parts: int
    tied: bool  # another node reads the weight (a tied embedding): the head gets its own slice
    transition: Transition | None
    why: str = ""

    @property
    def rows(self) -> int:
        """Rows of the weight on each rank (the vocabulary rounded up to a multiple of parts)."""
        return -(-self.vocab // self.parts)

    def __str__(self) -> str:
        if self.transition is None:
            return f"lm head {self.node} ({self.weight}, vocab {self.vocab}): whole on every rank ({self.why})"
        pad = f", zero-padded from {self.vocab}" if self.rows * self.parts != self.vocab else ""
        tied = ", its own slice (the embedding reads the weight whole)" if self.tied else ""
        return (f"lm head {self.node}: {self.weight} split by vocabulary over the attention TP group "
                f"({self.parts} x {self.rows} rows{pad}{tied}); {self.transition}")

    def to_json(self) -> dict:
        return {"node": self.node, "weight": self.weight, "vocab": self.vocab, "parts": self.parts,
                "split": self.transition is not None, "rows_per_rank": self.rows if self.transition else self.vocab,
                "tied": self.tied, "collective": str(self.transition) if self.transition else None,
                **({"why_whole": self.why} if self.why else {})}


def find_head(gm: fx.GraphModule) -> fx.Node | None:
    """The last linear op outside every layer, after the last layer's nodes, whose value reaches
    the output; None when there is none (a graph that returns hidden states). Not an earlier
    projection when the last one's form is not understood (a projection before the head, as OPT's
    ``project_out``, is not the head): :func:`plan_head` says so."""
    nodes = list(gm.graph.nodes)
    tail = max((i for i, n in enumerate(nodes) if role_of(n).layer is not None), default=None)
    if tail is None:
        return None
    output = next(n for n in reversed(nodes) if n.op == "output")
    reach: set[fx.Node] = set()
    todo = [output]
    while todo:  # every node the output depends on
        n = todo.pop()
        if n not in reach:
            reach.add(n)
            todo.extend(n.all_input_nodes)
    return next((n for n in reversed(nodes[tail + 1:]) if n.op == "call_function" and n.target in LINEAR_OPS
                 and n in reach and role_of(n).layer is None), None)


def plan_head(gm: fx.GraphModule, layout: TPLayout, mode: ScatterMode) -> HeadPlan | None:
    """The head's split over the group of ``mode`` (the final hidden states' mode). A head whose
    form the sharding cannot read is no head to split: None, unless ``vocab_parallel`` asks for
    the split, then a ShardError naming the node."""
    head = find_head(gm)
    if head is None:
        return None
    try:
        p = projection(head)
    except ShardError as e:
        if layout.vocab_parallel:
            raise ShardError(f"vocab_parallel: the LM head {head.name} cannot be split: {e}") from None
        return None
    weight = get_attr_path(gm, str(p.weight.target))
    vocab = int(weight.shape[p.out_dim])
    link = _link(head, p.weight)
    # something else reads the weight (a tied embedding) or the transpose the head reads
    tied = list(p.weight.users) != [head] if link is p.weight else \
        (list(p.weight.users) != [link] or list(link.users) != [head])
    parts = layout.group_size(mode)
    rec = HeadPlan(head.name, str(p.weight.target), vocab, parts, tied, None)
    if not layout.vocab_parallel:
        return replace(rec, why="vocab_parallel off")
    if parts == 1:
        return replace(rec, why="a group of one rank")
    return replace(rec, transition=transition(DistState(mode, split_last=True), DistState(mode), layout))


def _slice(t: torch.Tensor, dim: int, rows: int, rank: int) -> torch.Tensor:
    """Rows ``[rank * rows, (rank + 1) * rows)`` of ``t`` along ``dim``, zero rows past its end."""
    t = t.detach()
    start = min(rank * rows, t.shape[dim])
    part = t.narrow(dim, start, min(rows, t.shape[dim] - start))
    if part.shape[dim] < rows:
        pad = list(part.shape)
        pad[dim] = rows - part.shape[dim]
        part = torch.cat([part, part.new_zeros(pad)], dim=dim)
    return part.clone()


def _link(head: fx.Node, attr: fx.Node) -> fx.Node:
    """The head's operand that reads ``attr``: the attribute itself or a transpose of it."""
    return next(a for a in head.all_input_nodes if a is attr or (a.all_input_nodes == [attr]
                                                                 and a.op == "call_function"))


def _set_slice(
    gm: fx.GraphModule, attr: fx.Node, head: fx.Node, dim: int, rows: int, rank: int, own: str | None, fake_mode: object
) -> list[fx.Node]:
    """Make the head read this rank's slice of ``attr`` (its weight or bias): sliced in place, or
    as the new attribute ``own`` when something else reads ``attr`` whole (a tied embedding).
    Returns the nodes whose values changed shape."""
    full = get_attr_path(gm, str(attr.target))
    part = _slice(full, dim, rows, rank)
    value = torch.nn.Parameter(part, requires_grad=False) if isinstance(full, torch.nn.Parameter) else part
    link = _link(head, attr)
    if own is None:  # (setattr: the attribute may be a plain tensor, neither parameter nor buffer)
        parent, _, leaf = str(attr.target).rpartition(".")
        setattr(get_attr_path(gm, parent) if parent else gm, leaf, value)
        new = attr
    else:
        set_attr_path(gm, own, value)
        with gm.graph.inserting_before(head):
            new = gm.graph.get_attr(own)
            if link is not attr:  # a transpose of the whole weight: the head gets its own
                copy = gm.graph.node_copy(link, lambda a: new if a is attr else a)
                head.replace_input_with(link, copy)
                link = copy
        if link is attr:
            head.replace_input_with(attr, new)
    if fake_mode is not None:
        new.meta["val"] = fake_mode.from_tensor(part)  # type: ignore[attr-defined]
    return [] if link is attr else [link]


def _refake(n: fx.Node, fake_mode: object) -> None:
    """Recompute ``n``'s fake value from its inputs' (after a slice changed their shapes)."""
    if fake_mode is None:
        return
    args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
    with fake_mode:  # type: ignore[attr-defined]
        n.meta["val"] = n.target(*args, **kwargs)  # type: ignore[operator]


def split_head(gm: fx.GraphModule, plan: HeadPlan, rank: int, fake_mode: object) -> None:
    """This rank's slice of the head and the all-gather after it (``rank``: within the group)."""
    if plan.transition is None:
        return
    head = next(n for n in gm.graph.nodes if n.name == plan.node)
    p = projection(head)
    full = head.meta.get("val")
    own = f"{HEAD_ATTR}_weight" if plan.tied else None
    changed = _set_slice(gm, p.weight, head, p.out_dim, plan.rows, rank, own, fake_mode)
    if p.bias is not None:
        tied_bias = list(p.bias.users) != [head]
        changed += _set_slice(
            gm, p.bias, head, 0, plan.rows, rank, f"{HEAD_ATTR}_bias" if tied_bias else None, fake_mode
        )
    for n in changed:  # a transpose of the sliced weight (static shapes)
        _refake(n, fake_mode)
    if isinstance(full, torch.Tensor):  # (by shape: re-running the op on symbolic sizes fails on torch 2.11)
        head.meta["val"] = full.new_empty((*full.shape[:-1], plan.rows))
    with gm.graph.inserting_after(head):
        gather = gm.graph.call_function(torch.ops.afd.all_gather_last.default, (head, GROUP_ATTN_TP, plan.vocab))
    head.replace_all_uses_with(gather, delete_user_cb=lambda u: u is not gather)
    gather.meta.update({k: v for k, v in head.meta.items() if k not in ("val", META_DIST)})
    if isinstance(full, torch.Tensor):
        gather.meta["val"] = full
    gather.meta[META_DIST] = plan.transition.dst
    head.meta[META_DIST] = plan.transition.src
    gm.graph.lint()
    gm.recompile()
