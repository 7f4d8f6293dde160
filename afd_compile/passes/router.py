"""The MoE router (gate) of a layer's FFN region, found by structure: the linear whose scores a
selection (softmax / sigmoid / top-k / max) reads. ``compute_gate_on_attention`` moves it and
what it reads to the attention side; TP keeps it whole."""

from __future__ import annotations

import operator

import torch.fx as fx

from .module_paths import body_of
from .op_kinds import LINEAR_OPS, PASSTHROUGH_OPS, ROUTER_SELECT_OPS


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
        if u.target in PASSTHROUGH_OPS:
            frontier.extend(u.users)
    return False
