"""Give an MoE router's top-k the small kernel (``afd::router_topk``), for programs run on CUDA.

Before (a router choosing 8 of 128 experts; its choice feeds the experts op)::

    topk = aten.topk(scores, 8, -1)          # scores [T, 128]
    w, ids = topk[0], topk[1]
    y = afd.moe_experts(x, ids, w', ...)

After::

    topk = afd.router_topk(scores, 8)        # the same (values, indices); ties to the lower index

Only a top-k over the last dim of a 2-D score matrix, largest first (the router's
``torch.topk(scores, k, dim=-1)``; sorted or not: the op's order, descending, is one
``sorted=False`` may return), within the op's limits (``router_topk.MAX_EXPERTS``,
``MAX_K``), whose indices reach an ``afd::moe_experts`` node. The backend runs this pass on the
programs it compiles for CUDA (after the MoE recognition); elsewhere the op is ``torch.topk``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...router_topk import MAX_EXPERTS, MAX_K

aten = torch.ops.aten


def _feeds_experts(n: fx.Node, hops: int = 24) -> bool:
    """The top-k's indices reach an ``afd::moe_experts`` node within ``hops`` nodes."""
    frontier = [u for u in n.users if u.target == operator.getitem and u.args[1] == 1]
    seen: set[fx.Node] = set()
    while frontier and len(seen) < hops:  # (breadth first: the nearest users first)
        u = frontier.pop(0)
        if u in seen:
            continue
        seen.add(u)
        if u.target == torch.ops.afd.moe_experts.default:
            return True
        frontier.extend(u.users)
    return False


def _router_topk_of(n: fx.Node) -> int | None:
    """``k`` when ``n`` is a router's top-k this pass takes (module docstring), else None."""
    if n.target != aten.topk.default or not isinstance(n.args[0], fx.Node):
        return None
    x = n.args[0].meta.get("val")
    k = n.args[1]
    dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", -1)
    largest = n.args[3] if len(n.args) > 3 else n.kwargs.get("largest", True)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or dim not in (-1, 1) or not largest:
        return None
    experts = x.shape[-1]
    if not isinstance(experts, int) or experts > MAX_EXPERTS or not isinstance(k, int) or not 0 < k <= MAX_K:
        return None
    return k if _feeds_experts(n) else None


def use_router_topk(gm: fx.GraphModule) -> list[str]:
    """Replace each router top-k (module docstring) by ``afd::router_topk``, in place; the names
    of the nodes replaced."""
    import afd_compile.router_topk  # noqa: F401  (registers the op)

    done = []
    for n in list(gm.graph.nodes):
        k = _router_topk_of(n)
        if k is None:
            continue
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(torch.ops.afd.router_topk.default, (n.args[0], k))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
        done.append(new.name)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
