"""Keep a program's first K layers: the few layers ``profile --layers K`` times of a deep model.

A decoder's layers are identical in structure, so K of them time like any K: the program keeps
layers ``0 .. K-1`` and whatever is outside the layers (embedding, masks, final norm, LM head).
Every layer must hold the same ops in the same order (size arithmetic aside: export computes a
shared size once, in the first layer that needs it). Every node outside the dropped layers that
read a node of a dropped layer reads instead its twin, the node at the same place in layer ``K-1``
(a size: a kept node of the same value); the dropped layers' nodes and the weights only they read
go. Before / after at K = 1 of 2 layers::

    x1 = add(x0, mlp0(...))  L0     x2 = add(x1, mlp1(...))  L1     y = norm(x2)  -
 -> x1 = add(x0, mlp0(...))  L0                                      y = norm(x1)  -

``share_weights``: every kept layer after the first reads the first layer's weights (the weight at
the same place; its own go), so K layers time as K with one layer's memory: the second depth
``profile`` times a model of which one layer fits the device.

Reads the layers from ``node.meta["afd.role"]`` (``passes/roles.py``); records nothing.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..errors import AFDCompileError
from .graph_utils import drop_unused_attrs, get_attr_path, layers_of


class KeepLayersError(AFDCompileError):
    """The layers cannot be cut down to K: too few of them, or not identical in structure."""


def _signature(n: fx.Node) -> tuple[str, str]:
    """What must match between a node and its twin: its kind, and the op it calls (a weight's name
    differs from layer to layer)."""
    return n.op, str(n.target) if n.op in ("call_function", "call_method") else ""


def _is_size(n: fx.Node) -> bool:
    """Size arithmetic (export computes a shared ``s0 * s1`` once, in the first layer that needs it)."""
    return isinstance(n.meta.get("val"), (int, torch.SymInt))


def keep_layers(gm: fx.GraphModule, k: int, graph_name: str = "graph", share_weights: bool = False) -> int:
    """Keep the first ``k`` layers of ``gm`` in place (see the module docstring); returns how many
    layers it had. Refused (KeepLayersError): ``k < 1``, no layer roles, layers that are not alike
    (their ops, size arithmetic aside, in another order: the few kept would not stand for the rest).
    ``share_weights``: layers 1 .. k-1 read layer 0's weights."""
    if k < 1:
        raise KeepLayersError(f"{graph_name}: keep {k} layers: give at least 1")
    found = layers_of(gm)  # (a node with no role, as a split program's inputs and output, is outside them)
    if not found:
        raise KeepLayersError(f"{graph_name}: no node has a layer role: annotate the roles first")
    layers = [list(found[i].members) if i in found else [] for i in range(max(found) + 1)]
    total = len(layers)
    ops = [[n for n in layer if not _is_size(n)] for layer in layers]
    if share_weights:
        _share_first_weights(gm, ops[:k], graph_name)
    if k >= total:
        if share_weights:
            _finish(gm)
        return total
    last = ops[k - 1]
    for j, layer in enumerate(ops):
        if [_signature(n) for n in layer] != [_signature(n) for n in last]:
            raise KeepLayersError(
                f"{graph_name}: layer {j} is not like layer {k - 1} ({len(layer)} ops against {len(last)}, size "
                f"arithmetic aside): its layers differ in structure, so the first {k} do not stand for all "
                f"{total}; profile the whole model")
    dropped = {n for layer in layers[k:] for n in layer}
    twins = {n: last[i] for layer in ops[k:] for i, n in enumerate(layer)}
    sizes = {str(n.meta["val"]): n for n in gm.graph.nodes if _is_size(n) and n not in dropped}
    for n in list(gm.graph.nodes):
        for src in [s for s in n.all_input_nodes if s in dropped] if n not in dropped else []:
            twin = twins.get(src) or sizes.get(str(src.meta.get("val")))
            if twin is None:
                raise KeepLayersError(f"{graph_name}: {n.name} reads {src.name} of a dropped layer, a size no "
                                      "kept node computes: profile the whole model")
            n.replace_input_with(src, twin)
    for n in reversed(list(gm.graph.nodes)):
        if n in dropped:
            gm.graph.erase_node(n)  # (its users: dropped, erased first, or rerouted above)
    _finish(gm)
    return total


def _share_first_weights(gm: fx.GraphModule, layers: list[list[fx.Node]], graph_name: str) -> None:
    """Each node of layers 1.. reads, in place of a weight of its own, the weight its twin in layer 0
    reads at the same place (same shape)."""
    for j, layer in enumerate(layers[1:], start=1):
        if len(layer) != len(layers[0]):
            raise KeepLayersError(f"{graph_name}: layer {j} is not like layer 0: cannot share its weights")
        for n, twin in zip(layer, layers[0], strict=True):
            for own, first in zip(n.all_input_nodes, twin.all_input_nodes, strict=False):
                if own is first or own.op != "get_attr" or first.op != "get_attr":
                    continue
                shapes = [tuple(get_attr_path(gm, str(x.target)).shape) for x in (own, first)]
                if shapes[0] != shapes[1]:
                    raise KeepLayersError(f"{graph_name}: {n.name} reads {own.target} of shape {shapes[0]}, its "
                                          f"twin in layer 0 {first.target} of shape {shapes[1]}: cannot share")
                n.replace_input_with(own, first)


def _finish(gm: fx.GraphModule) -> None:
    """Weights nothing reads any more are deleted; the graph is checked and recompiled."""
    for n in list(gm.graph.nodes):
        if n.op == "get_attr" and not n.users:
            gm.graph.erase_node(n)
    drop_unused_attrs(gm)
    gm.graph.lint()
    gm.recompile()

