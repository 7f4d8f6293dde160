"""Keep a program's first K layers: the few layers ``profile --layers K`` times of a deep model.

A decoder's layers are identical in structure, so K of them time like any K: the program keeps
layers ``0 .. K-1`` and whatever is outside the layers (embedding, masks, final norm, LM head).
Every layer must hold the same ops in the same order (size arithmetic and checks aside: export
computes a shared size once, and asserts a dtype, in the first layer that needs it). Every node
outside the dropped layers that read a node of a dropped layer reads instead its twin, the node at
the same place in layer ``K-1`` (a size: a kept node of the same value); the dropped layers' nodes
and the weights only they read go. Before / after at K = 1 of 2 layers::

    x1 = add(x0, mlp0(...))  L0     x2 = add(x1, mlp1(...))  L1     y = norm(x2)  -
 -> x1 = add(x0, mlp0(...))  L0                                      y = norm(x1)  -

K = 0 keeps no layer (what a program costs besides its layers: ``profile``'s second depth): what
read the last layer reads instead what layer 0 read from outside the layers of the same shape and
dtype (the residual stream, passed through), which must be one node::

    h = embed(ids)  -     x1 = add(h, attn0(h, cos))  L0     y = norm(x1)  -
 -> h = embed(ids)  -                                         y = norm(h)   -

Reads the layers from ``node.meta["afd.role"]`` (``passes/roles.py``); records nothing.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..errors import AFDCompileError
from .graph_utils import drop_unused_attrs, layers_of


class KeepLayersError(AFDCompileError):
    """The layers cannot be cut down to K: too few of them, or not identical in structure."""


def _signature(n: fx.Node) -> tuple[str, str]:
    """What must match between a node and its twin: its kind, and the op it calls (a weight's name
    differs from layer to layer)."""
    return n.op, str(n.target) if n.op in ("call_function", "call_method") else ""


#: checks export inserts where it first needs one (a dtype assert in one layer, not in another): not compute
_CHECKS = (torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default)


def _is_check(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in _CHECKS


def _is_size(n: fx.Node) -> bool:
    """Size arithmetic (export computes a shared ``s0 * s1`` once, in the first layer that needs it)."""
    return isinstance(n.meta.get("val"), (int, torch.SymInt))


def keep_layers(gm: fx.GraphModule, k: int, graph_name: str = "graph") -> int:
    """Keep the first ``k`` layers of ``gm`` in place (see the module docstring); returns how many
    layers it had. Refused (KeepLayersError): ``k < 0``, no layer roles, layers that are not alike
    (their ops, size arithmetic and checks aside, in another order: the few kept would not stand for the rest);
    at ``k = 0``, a layer output with no one input of layer 0 like it."""
    if k < 0:
        raise KeepLayersError(f"{graph_name}: keep {k} layers: give 0 or more")
    found = layers_of(gm)  # (a node with no role, as a split program's inputs and output, is outside them)
    if not found:
        raise KeepLayersError(f"{graph_name}: no node has a layer role: annotate the roles first")
    layers = [list(found[i].members) if i in found else [] for i in range(max(found) + 1)]
    total = len(layers)
    if k >= total:
        return total
    ops = [[n for n in layer if not _is_size(n) and not _is_check(n)] for layer in layers]
    last = ops[max(k - 1, 0)]
    for j, layer in enumerate(ops if k else []):
        if [_signature(n) for n in layer] != [_signature(n) for n in last]:
            raise KeepLayersError(
                f"{graph_name}: layer {j} is not like layer {k - 1} ({len(layer)} ops against {len(last)}, size "
                f"arithmetic and checks aside): its layers differ in structure, so the first {k} do not stand for all "
                f"{total}; profile the whole model")
    dropped = {n for layer in layers[k:] for n in layer}
    twins = {n: last[i] for layer in ops[k:] for i, n in enumerate(layer)} if k else _stream_inputs(layers[0])
    sizes = {str(n.meta["val"]): n for n in gm.graph.nodes if _is_size(n) and n not in dropped}
    for n in list(gm.graph.nodes):
        for src in [s for s in n.all_input_nodes if s in dropped] if n not in dropped else []:
            twin = sizes.get(str(src.meta.get("val"))) if _is_size(src) else \
                twins.get(src) if k else twins.get(_like(src))
            if twin is None:
                raise KeepLayersError(
                    f"{graph_name}: {n.name} reads {src.name} of a dropped layer, " + (
                        "a size no kept node computes" if _is_size(src) or k else
                        f"and layer 0 reads {'no' if _like(src) not in _stream_kinds(layers[0]) else 'several'} "
                        f"inputs like it ({_like(src)[0]}) to pass through in its place") + ": profile the whole model")
            n.replace_input_with(src, twin)
    for n in reversed(list(gm.graph.nodes)):
        if n in dropped:
            gm.graph.erase_node(n)  # (its users: dropped, erased first, or rerouted above)
    drop_unused_attrs(gm)  # (the get_attr nodes only dropped layers read, and their weights)
    gm.graph.lint()
    gm.recompile()
    return total


def _like(n: fx.Node) -> tuple[str, str]:
    """A tensor's shape and dtype, as text (symbolic sizes by their expression)."""
    val = n.meta.get("val")
    return (str(tuple(val.shape)), str(val.dtype)) if isinstance(val, torch.Tensor) else ("?", "?")


def _stream_kinds(layer: list[fx.Node]) -> dict[tuple[str, str], list[fx.Node]]:
    """The nodes outside ``layer`` (weights aside) that it reads, by shape and dtype."""
    inside, out = set(layer), {}
    for n in layer:
        for src in n.all_input_nodes:
            if src not in inside and src.op != "get_attr" and not _is_size(src):
                group = out.setdefault(_like(src), [])
                if src not in group:
                    group.append(src)
    return out


def _stream_inputs(layer: list[fx.Node]) -> dict[tuple[str, str], fx.Node]:
    """Of :func:`_stream_kinds`, the shapes only one input has: what passes through in place of an
    output of that shape when no layer is kept."""
    return {kind: nodes[0] for kind, nodes in _stream_kinds(layer).items() if len(nodes) == 1}
