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
measures what that costs). Applies to an FFN program whose experts take its received rows as they
came (no FFN group: a fixed slot is refused with one).
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


def mark_slot_rows(gm: fx.GraphModule) -> list[SlotRows]:
    """Mark the padded rows of each ``afd::moe_experts`` of ``gm`` (in place; module docstring);
    the ops marked (none: a dense FFN, or no receive)."""
    graph = gm.graph
    moes = [n for n in graph.nodes if n.target == afd.moe_experts.default]
    marks: dict[int, fx.Node] = {}  # per micro-batch stage: its real rows, after its first receive
    for recv in [n for n in graph.nodes if n.target in _RECEIVES] if moes else []:
        stage = int(recv.args[3])
        if stage in marks:
            continue
        first = next((u for u in recv.users if u.target is operator.getitem and u.args[1] == 0), None)
        if first is None:
            with graph.inserting_after(recv):
                first = graph.call_function(operator.getitem, (recv, 0))
        with graph.inserting_after(first):
            marks[stage] = graph.call_function(afd.slot_rows.default, (first, recv.args[1], recv.args[2], stage))
    out = []
    for moe in moes if marks else []:
        ids = moe.args[1]
        assert isinstance(ids, fx.Node)
        stage = int(moe.meta.get(STAGE, 0))  # (a staged program's copy of a node names its stage)
        if stage not in marks:
            raise ValueError(f"slot_rows: {moe.name} computes micro-batch stage {stage}, which no receive of the "
                             f"program feeds (stages received: {sorted(marks)})")
        rows = marks[stage]
        e = _experts(gm, moe.args[3])
        with graph.inserting_before(moe):
            col = graph.call_function(torch.ops.aten.unsqueeze.default, (rows, -1))
            masked = graph.call_function(torch.ops.aten.where.ScalarOther, (col, ids, e))
        moe.update_arg(1, masked)
        rec = SlotRows(moe.name, e)
        moe.meta[META] = rec
        out.append(rec)
    graph.lint()
    gm.recompile()
    return out
