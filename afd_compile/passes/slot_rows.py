"""Mark a fixed slot's padded rows for the MoE experts op, so an FFN rank's compute follows its
peers' real tokens (runtime/slots.py: every peer sends ``C`` rows a step, its count in a header).

The rows of each live peer past its count are padding; ``afd::moe_experts`` leaves out a pair
whose expert id is outside ``[0, E)`` (moe.py). After the step's first receive, the real rows are
read from the headers on the device (``afd::slot_rows``), and each experts op's ids are replaced
by ``E`` on the other rows. Before (an FFN program)::

    afd_recv_L0 = afd.p2p_recv_group(dep, 0, 0, 0, total_tokens, spec)
    ...
    moe = afd.moe_experts(x, ids, weights, w_gate_up, w_down, ...)

After::

    afd_recv_L0 = afd.p2p_recv_group(dep, 0, 0, 0, total_tokens, spec)
    slot_rows = afd.slot_rows(afd_recv_L0[0], 0, 0, 0)        # bool [rows]
    ...
    unsqueeze = aten.unsqueeze(slot_rows, -1)
    where = aten.where(unsqueeze, ids, E)                      # padded rows: no expert
    moe = afd.moe_experts(x, where, weights, w_gate_up, w_down, ...)

Every layer's counts are the step's, so one mark serves all of a micro-batch stage's layers (a
staged program: one mark a stage, each experts op taking its stage's, ``node.meta['afd.stage']``).
A dense FFN has nothing to mark: its padded rows are computed (benchmarks/slot_padding.py
measures what that costs).

In an FFN group the ids are those of the rows the experts see: an FFN TP group's experts take
the group's rows (``afd::all_gather_tokens`` of each rank's), so the marks are gathered the same
way (once a stage); with expert parallelism the dispatch and the combine route by the rank's own
ids, which are marked (a padded row goes to no rank: no all-to-all bytes, no expert)::

    where = aten.where(unsqueeze(slot_rows, -1), ids, E)
    ep_dispatch = afd.ep_dispatch([x, w], where, group, E, P) ... afd.ep_combine(y, where, counts, group, E)
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .. import meta_keys

afd = torch.ops.afd
META = meta_keys.SLOT_ROWS
STAGE = meta_keys.STAGE
_RECEIVES = (afd.p2p_recv_group.default,)
#: where a layer's rows come in (a walk up an experts op's inputs stops there)
_LAYER_STARTS = (*_RECEIVES, afd.p2p_send_recv_group.default, afd.p2p_recv_group_into.default,
                 afd.p2p_send_recv_group_into.default)


@dataclass(frozen=True)
class SlotRows:
    """One experts op whose padded rows were marked: its node and its expert count."""

    node: str
    experts: int

    def __str__(self) -> str:
        return f"{self.node}: ids outside its {self.experts} experts on a fixed slot's padded rows"


def _experts(gm: fx.GraphModule, weight: fx.Node) -> int:
    val = weight.meta.get("val")
    if val is None and weight.op == "get_attr":
        val = operator.attrgetter(str(weight.target))(gm)
    if val is None:
        raise ValueError(f"slot_rows: the expert weights {weight.name} have no traced value to count experts by")
    return int(val.shape[0])


def _gathered_by(node: fx.Node) -> fx.Node | None:
    """The FFN group's gather of tokens (``afd::all_gather_tokens``) that ``node``'s rows come
    through in its layer, if any: a walk up its inputs, stopping at the layer's receive."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if n.target == afd.all_gather_tokens.default:
            return n
        if n.target not in _LAYER_STARTS:
            todo += [a for a in n.all_input_nodes]
    return None


def _targets(graph: fx.Graph) -> list[tuple[fx.Node, int, int]]:
    """What takes each experts op's routing ids of the rank's own rows: (node, index of its ids
    argument, expert count argument index or -1: counted from its weights). With expert
    parallelism the dispatch and the combine (both route by the ids; the experts op behind them
    takes local ids), else the experts op itself."""
    out = []
    for n in graph.nodes:
        if n.target in (afd.ep_dispatch.default, afd.ep_combine.default):
            out.append((n, 1, 3 if n.target == afd.ep_dispatch.default else 4))
        elif n.target == afd.moe_experts.default:
            ids = n.args[1]
            if not (isinstance(ids, fx.Node) and ids.target is operator.getitem
                    and ids.args[0].target == afd.ep_dispatch.default):  # type: ignore[union-attr]
                out.append((n, 1, -1))
    return out


def mark_slot_rows(gm: fx.GraphModule) -> list[SlotRows]:
    """Mark the padded rows of each ``afd::moe_experts`` of ``gm`` (in place; module docstring);
    the ops marked (none: a dense FFN, or no receive)."""
    graph = gm.graph
    targets = _targets(graph)
    marks: dict[int, fx.Node] = {}  # per micro-batch stage: its real rows, after its first receive
    for recv in [n for n in graph.nodes if n.target in _RECEIVES] if targets else []:
        stage = int(recv.args[3])
        if stage in marks:
            continue
        first = next((u for u in recv.users if u.target is operator.getitem and u.args[1] == 0), None)
        if first is None:
            with graph.inserting_after(recv):
                first = graph.call_function(operator.getitem, (recv, 0))
        with graph.inserting_after(first):
            marks[stage] = graph.call_function(afd.slot_rows.default, (first, recv.args[1], recv.args[2], stage))
    out: list[SlotRows] = []
    masked_ids: dict[fx.Node, fx.Node] = {}
    rows: dict[tuple, fx.Node] = {}
    for op, at, count_at in targets if marks else []:
        ids = op.args[at]
        assert isinstance(ids, fx.Node)
        stage = int(op.meta.get(STAGE, 0))  # (a staged program's copy of a node names its stage)
        if stage not in marks:
            raise ValueError(f"slot_rows: {op.name} computes micro-batch stage {stage}, which no receive of the "
                             f"program feeds (stages received: {sorted(marks)})")
        e = int(op.args[count_at]) if count_at >= 0 else _experts(gm, op.args[3])  # type: ignore[arg-type]
        if ids not in masked_ids:
            gather = _gathered_by(ids)
            key = (stage, *(gather.args[1:] if gather is not None else ()))
            if key not in rows:  # (one gather of the marks a stage serves all its layers)
                rows[key] = _rows_of(graph, marks[stage], gather)
            masked_ids[ids] = _masked(graph, ids, rows[key], e)
        op.update_arg(at, masked_ids[ids])
        rec = SlotRows(op.name, e)
        op.meta[META] = rec
        out.append(rec)
    graph.lint()
    gm.recompile()
    return out


def _rows_of(graph: fx.Graph, mark: fx.Node, gather: fx.Node | None) -> fx.Node:
    """The real rows of the rows ``gather`` (an FFN TP group's all-gather) makes of each rank's
    own: the marks gathered alike (None: the rank's own rows, ``mark`` itself)."""
    if gather is None:
        return mark
    with graph.inserting_after(gather):
        as_int = graph.call_function(torch.ops.aten._to_copy.default, (mark,), {"dtype": torch.int32})
    with graph.inserting_after(as_int):
        got = graph.call_function(afd.all_gather_tokens.default, (as_int, *gather.args[1:]), dict(gather.kwargs))
    with graph.inserting_after(got):
        return graph.call_function(torch.ops.aten.ne.Scalar, (got, 0))


def _masked(graph: fx.Graph, ids: fx.Node, rows: fx.Node, experts: int) -> fx.Node:
    """``ids`` with ``experts`` (no expert) on the rows ``rows`` does not mark real."""
    after = max((ids, rows), key=lambda n: _position(graph, n))
    with graph.inserting_after(after):
        col = graph.call_function(torch.ops.aten.unsqueeze.default, (rows, -1))
    with graph.inserting_after(col):
        return graph.call_function(torch.ops.aten.where.ScalarOther, (col, ids, experts))


def _position(graph: fx.Graph, node: fx.Node) -> int:
    return next(i for i, n in enumerate(graph.nodes) if n is node)
