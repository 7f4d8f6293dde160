"""Expert parallelism of the MoE op, the one EP rule for every expert form (TP's is
``shard/projections.moe_op_shards``): used by ``--moe-a2a`` (TP groups) and AFD FFN EP groups.

Before (one block, every expert on every rank)::

    moe_experts = afd.moe_experts(x, ids, w, w_gate_up, w_down, None, None, 'silu', True, False)

After, on rank ``d`` of ``P`` (experts ``[d*E/P, (d+1)*E/P)``: the weights sliced along dim 0)::

    ep_dispatch = afd.ep_dispatch([view(x, [T, H]), view(w, [T, K])], ids, group, E, P)   # all-to-all
    xr, wr, ids_local, valid, counts = ep_dispatch[0..4]
    y = afd.moe_experts(xr, ids_local, wr * valid, w_gate_up, w_down, ...)                 # local experts
    moe_experts = afd.ep_combine(y, ids, counts, group, E)                                 # all-to-all back

The routing weights arrive complete (however the router computed them: renormalised, gathered
from the scores, scaled), so no router form needs a rule of its own.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ... import ops as _ops  # noqa: F401  (registers afd::ep_dispatch / ep_combine)
from ..graph_utils import Builder, get_attr_path
from ..roles import META_KEY as ROLE_KEY
from ..shard import ShardedWeight, ShardError, ShardPlan, apply_shards

aten = torch.ops.aten


def expert_parallel_op(gm: fx.GraphModule, op: fx.Node, parts: int, rank: int, fake_mode: object, group: int,
                       where: str) -> list[ShardedWeight]:
    """Rewrite one ``afd::moe_experts`` node for rank ``rank`` of ``parts`` expert-parallel ranks
    over process group ``group`` (module docstring); returns the weights it sliced."""
    x, ids, w, *params = op.args[:7]
    num_experts = int(params[0].meta["val"].shape[0])
    if num_experts % parts:
        raise ShardError(f"{where}: {op.name}'s {num_experts} experts do not divide over {parts} expert-parallel ranks")
    layer = getattr(op.meta.get(ROLE_KEY), "layer", None)
    targets = {str(p.target) for p in params if p is not None}
    others = sorted({r.layer for a in gm.graph.nodes if a.op == "get_attr" and str(a.target) in targets
                     for u in a.users if (r := u.meta.get(ROLE_KEY)) is not None and r.layer not in (None, layer)})
    if others:  # (each layer's rewrite would slice them again)
        raise ShardError(f"{where}: its experts' weights {sorted(targets)[:3]} are read by layer(s) {others} too (one "
                         "MoE block applied as several layers): expert parallelism of a shared MoE block is not "
                         "supported (TP of the whole MoE, or AFD FFN TP groups, split it)")
    weights = [ShardedWeight(str(p.target), 0, parts, "mlp", "expert") for p in params if p is not None]
    apply_shards(gm, ShardPlan(tuple(weights), (), ()), {"mlp": rank})
    for p in params:
        if p is not None and fake_mode is not None:
            p.meta["val"] = fake_mode.from_tensor(get_attr_path(gm, str(p.target)), static_shapes=True)
    role = op.meta.get(ROLE_KEY)
    b = Builder(gm.graph, fake_mode, None)

    def call(target: object, args: tuple, name: str | None = None) -> fx.Node:
        node = b.call(target, args, name)
        if role is not None:
            node.meta[ROLE_KEY] = role
        return node

    hidden, k = int(x.meta["val"].shape[-1]), int(ids.meta["val"].shape[-1])
    with gm.graph.inserting_before(op):
        count = call(aten.sym_size.int, (ids, 0))  # (explicit widths: a view to [0, -1] is ambiguous)
        rows = [call(aten.view.default, (x, [count, hidden])), call(aten.view.default, (w, [count, k]))]
        disp = call(torch.ops.afd.ep_dispatch.default, (rows, ids, group, num_experts, parts), "ep_dispatch")
        xr, wr, local, valid, counts = (call(operator.getitem, (disp, j)) for j in range(5))
        wl = call(aten.mul.Tensor, (wr, call(aten.to.dtype, (valid, w.meta["val"].dtype))))
        y = call(op.target, (xr, local, wl, *op.args[3:]))
        out = call(torch.ops.afd.ep_combine.default, (y, ids, counts, group, num_experts), "ep_combine")
    op.replace_all_uses_with(out)
    gm.graph.erase_node(op)
    return weights
