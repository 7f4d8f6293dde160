"""Shard a graph for one TP rank and insert the collectives its junctions need.

Plan first (``plan_tp`` -> junctions, ``plan_shards`` -> weights and head counts), then rewrite a
copy of the graph: weights sliced for this rank, head counts divided, and after every
row-parallel linear the collective that settles its partial sum. Standard TP (attn_dp == 1),
one layer, after::

    o = linear(attn, o_proj.weight[:, r])        # TP_ATTN_FULL+P
    o = afd.all_reduce(o, group=ATTN_TP)         # prepare_mlp: all_reduce
    h1 = add(x, o)                               # middle_residual TP_ATTN_FULL
    ...
    d = linear(m, down_proj.weight[:, r])        # FULL+P
    d = afd.all_reduce(d, group=TP)              # postprocess_layer: all_reduce
    h2 = add(h1, d)

The all-reduce sits on the row-parallel output, before anything else reads it, so the residual
add and the next norm see the full sum (the all-reduce + add + RMSNorm unit stays adjacent for a
fused kernel to replace).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from ..comm import GROUP_ATTN_TP, GROUP_TP
from ..scatter import Collective, TPLayout
from .dist_states import TPPlan, annotate_dist_states, plan_tp
from .roles import META_KEY as ROLE_KEY
from .shard import ShardPlan, apply_shards, plan_shards
from .split import _copy_graph_module


class TPRewriteError(ValueError):
    pass


@dataclass
class TPProgram:
    program: fx.GraphModule
    plan: TPPlan
    shards: ShardPlan
    rank: int


def _check_supported(plan: TPPlan) -> None:
    for modes, junctions in plan.layers:
        for name in ("prepare_attn", "prepare_mlp", "postprocess_layer"):
            for t in getattr(junctions, name):
                if t.collective is not Collective.ALL_REDUCE:
                    raise TPRewriteError(
                        f"layer {modes.index} {name}: {t} is planned, but this version inserts only the "
                        f"all-reduces of standard TP (attn_dp=1); `afd-compile plan` shows the full plan"
                    )


def shard_for_rank(gm: fx.GraphModule, layout: TPLayout, rank: int, graph_name: str = "graph") -> TPProgram:
    """This rank's program. Needs ``afd.role`` on ``gm`` (run annotate_roles first)."""
    plan = plan_tp(gm, layout, graph_name)
    annotate_dist_states(gm, plan)
    _check_supported(plan)
    shards = plan_shards(gm, attn_parts=layout.attn_tp, mlp_parts=layout.tp)
    new, _ = _copy_graph_module(gm)
    apply_shards(new, shards, {"attn": layout.attn_tp_rank(rank), "mlp": rank})
    fake_mode = detect_fake_mode([n.meta.get("val") for n in new.graph.nodes if "val" in n.meta])
    by_name = {n.name: n for n in new.graph.nodes}
    for node_name, group, _layer in shards.row_outputs:
        row = by_name[node_name]
        with new.graph.inserting_after(row):
            ar = new.graph.call_function(torch.ops.afd.all_reduce.default,
                                         (row, GROUP_ATTN_TP if group == "attn" else GROUP_TP))
        ar.meta[ROLE_KEY] = row.meta.get(ROLE_KEY)
        if fake_mode is not None and "val" in row.meta:
            with fake_mode:
                ar.meta["val"] = torch.ops.afd.all_reduce.default(row.meta["val"], 0)
        row.replace_all_uses_with(ar, delete_user_cb=lambda u, _ar=ar: u is not _ar)
    new.graph.lint()
    new.recompile()
    return TPProgram(new, plan, shards, rank)
