"""The MoE router, found by structure: the one place that says what routes tokens to experts.

- :func:`find_router`: the router (gate) of a layer's FFN region, the linear whose scores a
  selection (softmax / sigmoid / top-k / max) reads; ``compute_gate_on_attention`` moves it and
  what it reads to the attention side; TP keeps it whole;
- :data:`EXPERT_SELECT_OPS` / :func:`routes_experts` / :func:`moe_layers`: the expert choice of an
  ATen graph (a selection over the experts' scores, or a recognised ``afd::moe_experts`` op) and
  the layers that have one (MoE recognition, TP's layer kinds, FFN groups, attention TP's refusal);
- :func:`selects_by_name`: the same choice in a graph of torch functions (dynamo's, before export:
  the backend's no-layout path decides from it whether to run the MoE recognition).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import moe as _moe  # noqa: F401  (registers afd::moe_experts)
from .module_paths import body_of
from .op_kinds import LINEAR_OPS, PASSTHROUGH_OPS, ROUTER_SELECT_OPS

aten = torch.ops.aten

#: ops that select experts by score, and where their indices are (None: the result itself)
EXPERT_SELECT_OPS = {aten.topk.default: 1, aten.max.dim: 1, aten.sort.default: 1, aten.argmax.default: None}


def routes_experts(n: fx.Node) -> bool:
    """``n`` chooses experts (a top-k, or a recognised block's op): its layer is an MoE layer."""
    return n.target in (aten.topk.default, torch.ops.afd.moe_experts.default)


def moe_layers(gm: fx.GraphModule, role_key: str) -> list[int]:
    """The layers of ``gm`` (annotated under ``role_key``) with a node that routes experts."""
    return sorted({n.meta[role_key].layer for n in gm.graph.nodes if routes_experts(n)
                   and n.meta.get(role_key) is not None and n.meta[role_key].layer is not None})


def selects_by_name(n: fx.Node) -> bool:
    """In a graph of torch functions and methods (dynamo's): a top-k, or a max over a dim (PhiMoE's
    router picks its expert by value)."""
    name = getattr(n.target, "__name__", n.target) if n.op in ("call_function", "call_method") else None
    return name == "topk" or (name == "max" and (len(n.args) > 1 and isinstance(n.args[1], int) or "dim" in n.kwargs))


def _computes_linear(n: fx.Node) -> bool:
    """A linear op, or a region op (a higher-order op: ``torch.autocast``'s, a ``wrap``) whose body
    holds one: a router computed in fp32 under ``autocast(enabled=False)`` is such a region."""
    if n.op != "call_function":
        return False
    if n.target in LINEAR_OPS:
        return True
    body = body_of(n)
    return body is not None and any(m.op == "call_function" and m.target in LINEAR_OPS for m in body.graph.nodes)


def find_router(ffn_nodes: list[fx.Node]) -> fx.Node | None:
    """The router (gate): a linear op in the region whose output reaches a softmax / sigmoid /
    topk through pass-through ops only; or, for a region op computing one
    (:func:`_computes_linear`), its output (the ``getitem``) that does."""
    members = set(ffn_nodes)
    for n in ffn_nodes:
        if not _computes_linear(n):
            continue
        if n.target in LINEAR_OPS:
            if _reaches_select(n, members):
                return n
            continue
        for u in n.users:  # (a region op: its outputs are getitems of it)
            if u in members and u.target is operator.getitem and _reaches_select(u, members):
                return u
    return None


def _reaches_select(n: fx.Node, members: set[fx.Node]) -> bool:
    frontier = list(n.users)
    while frontier:
        u = frontier.pop()
        if u not in members:
            continue
        if u.target in ROUTER_SELECT_OPS:
            return True
        if u.target in PASSTHROUGH_OPS or _score_bias(u):
            frontier.extend(u.users)
    return False


#: arithmetic that keeps scores scores when the other operand is a constant or a parameter
_SCORE_ARITHMETIC = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor}


def _score_bias(u: fx.Node) -> bool:
    """``scores + bias`` with a bias parameter or buffer (a score correction read before the
    top-k, DeepSeek's and Kolibri's), or the scores scaled by a constant."""
    return u.target in _SCORE_ARITHMETIC and len(u.args) == 2 and any(
        not isinstance(a, fx.Node) or a.op == "get_attr" for a in u.args)
