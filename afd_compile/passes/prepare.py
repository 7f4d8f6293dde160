"""The passes every build of a rank's program starts with, in order (:func:`prepare_graph`):

1. MoE recognition (``passes/moe``): each MoE block's experts, whatever form the model wrote
   them in, become one ``afd::moe_experts`` node; the records go on ``gm.meta``;
2. projections packed per KV group unpacked into q / k / v blocks (``passes/grouped_qkv.py``:
   Falcon's fused q/k/v, so a layout with fewer KV groups than ranks splits the query heads and
   replicates K/V);
3. role annotation (``passes/roles.py``): every node's layer and attention / FFN role.

AFD splitting, TP / EP sharding and FFN groups all read the graph after both, so each sees the
experts as one op.
"""

from __future__ import annotations

import torch.fx as fx

from .grouped_qkv import unpack_grouped_projections
from .moe import recognise_moe
from .roles import RolePolicy, RoleSummary, annotate_roles, default_policy


def prepare_graph(gm: fx.GraphModule, policy: RolePolicy = default_policy, *, compute_gate_on_attention: bool = False,
                  graph_name: str = "graph", strict: bool = False) -> RoleSummary:
    """Recognise the MoE blocks of ``gm`` and annotate its roles, in place. ``strict`` (what
    shards experts: TP, EP, FFN groups): an MoE block no form matches is an error naming it and
    what was tried, not the model's code left to per-form rules."""
    recognise_moe(gm, strict=strict, graph_name=graph_name)
    unpack_grouped_projections(gm)
    return annotate_roles(gm, policy, compute_gate_on_attention=compute_gate_on_attention, graph_name=graph_name)
