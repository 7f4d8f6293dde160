"""Keep a few of a program's layers: what ``profile --layers K`` times of a deep model.

Layers of one kind (the same ops in the same order, size arithmetic and checks aside: export
computes a shared size once, and asserts a dtype, in the first layer that needs it) time alike, so
K of them stand for all of that kind. :func:`layer_kinds` groups a program's layers so (a Llama: one
kind; DeepSeek-V3: its dense first layers, then its MoE layers). :func:`keep_layers` keeps the first
K layers of each kind (or the layers it is given) and whatever is outside the layers (embedding,
masks, final norm, LM head). A dropped layer becomes the identity on the residual stream: a node
that read one of its nodes reads instead that layer's one input of the same shape and dtype (passed
through; further back while that layer is dropped too); failing such an input, the node at the same
place in a kept layer of its kind (the last before it, else the first after it if that comes before
the reader; a size: a kept node of the same value). The dropped layers' nodes, the weights only they
read and export's checks of those weights go. K = 1 of 2 layers of one kind::

    x1 = add(x0, mlp0(...))  L0     x2 = add(x1, mlp1(...))  L1     y = norm(x2)  -
 -> x1 = add(x0, mlp0(...))  L0                                      y = norm(x1)  -

K = 1 of a dense layer then two MoE layers keeps layers 0 and 1; the MoE layers alone (``[1, 2]``,
``profile`` timing each kind apart) pass the embedding through layer 0. K = 0 keeps no layer (what a
program costs besides its layers, ``profile``'s second depth)::

    h = embed(ids)  -     x1 = add(h, attn0(h, cos))  L0     y = norm(x1)  -
 -> h = embed(ids)  -                                         y = norm(h)   -

Reads the layers from ``node.meta["afd.role"]`` (``passes/roles.py``); records nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
import torch.fx as fx

from ..errors import AFDCompileError
from .graph_utils import drop_unused_attrs, layers_of


class KeepLayersError(AFDCompileError):
    """The layers cannot be cut down so: no layer roles, a bad count or index, or a dropped layer's
    node that no kept one stands in for."""


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


def layer_kinds(gm: fx.GraphModule, graph_name: str = "graph") -> list[int]:
    """Each layer's kind, by layer index: layers holding the same ops in the same order (size
    arithmetic and checks aside) share a kind; kinds are numbered as they first appear (a dense
    first layer then MoE layers: ``[0, 1, 1, ...]``). Refused (KeepLayersError): no layer roles."""
    found = layers_of(gm)  # (a node with no role, as a split program's inputs and output, is outside them)
    if not found:
        raise KeepLayersError(f"{graph_name}: no node has a layer role: annotate the roles first")
    seen: dict[tuple, int] = {}
    return [seen.setdefault(tuple(_signature(n) for n in _ops(list(found[i].members) if i in found else [])),
                            len(seen)) for i in range(max(found) + 1)]


def first_of_each_kind(kinds: Sequence[int], k: int) -> list[int]:
    """The layer indices of the first ``k`` layers of each kind (all of a kind with fewer)."""
    return [i for i, kind in enumerate(kinds) if kinds[:i].count(kind) < k]


def keep_layers(gm: fx.GraphModule, k: int | Collection[int], graph_name: str = "graph") -> int:
    """Keep, in place, the first ``k`` layers of each kind of ``gm`` (:func:`layer_kinds`), or the
    layers whose indices ``k`` lists (see the module docstring); returns how many layers it had.
    Refused (KeepLayersError): ``k < 0``, an index it does not have, no layer roles, a node of a
    dropped layer read where no kept node stands in for it."""
    if isinstance(k, int) and k < 0:
        raise KeepLayersError(f"{graph_name}: keep {k} layers: give 0 or more")
    found = layers_of(gm)
    kinds = layer_kinds(gm, graph_name)
    total = len(kinds)
    keep = set(first_of_each_kind(kinds, k) if isinstance(k, int) else k)
    if not keep <= set(range(total)):
        raise KeepLayersError(f"{graph_name}: keep layers {sorted(keep - set(range(total)))}: it has {total}")
    if len(keep) == total:
        return total
    layers = [list(found[i].members) if i in found else [] for i in range(total)]
    dropped = {n for i in range(total) if i not in keep for n in layers[i]}
    where = {n: i for i in range(total) for n in layers[i]}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    streams: dict[int, dict[tuple[str, str], fx.Node]] = {}

    def stand_in(src: fx.Node) -> fx.Node | None:
        """What a reader of ``src`` (a node of a dropped layer) reads instead: the layer's input like
        it (passed through, further back while that is dropped too), or the node at its place in a
        kept layer of its kind."""
        i = where[src]
        through = streams.setdefault(i, _stream_inputs(layers[i])).get(_like(src))
        if through is not None:
            return stand_in(through) if through in dropped else through
        same = [j for j in sorted(keep) if kinds[j] == kinds[i]]
        if not same:
            return None
        ops = _ops(layers[i])
        return _ops(layers[max([j for j in same if j < i], default=same[0])])[ops.index(src)] if src in ops else None

    sizes = {str(n.meta["val"]): n for n in gm.graph.nodes if _is_size(n) and n not in dropped}
    for n in list(gm.graph.nodes):
        for src in [s for s in n.all_input_nodes if s in dropped] if n not in dropped else []:
            twin = sizes.get(str(src.meta.get("val"))) if _is_size(src) else stand_in(src)
            if twin is None or order[twin] > order[n]:
                raise KeepLayersError(
                    f"{graph_name}: {n.name} reads {src.name} of dropped layer {where[src]}, " + (
                        "a size no kept node computes" if _is_size(src) else
                        f"and that layer has no one input like it ({_like(src)[0]}) to pass through, nor a kept "
                        "layer of its kind before it") + ": profile the whole model")
            n.replace_input_with(src, twin)
    for n in reversed(list(gm.graph.nodes)):
        if n in dropped:
            gm.graph.erase_node(n)  # (its users: dropped, erased first, or rerouted above)
    for n in [n for n in gm.graph.nodes if _is_check(n) and n.all_input_nodes]:  # (a check of weights left unread)
        if all(a.op == "get_attr" and all(_is_check(u) for u in a.users) for a in n.all_input_nodes):
            gm.graph.erase_node(n)
    drop_unused_attrs(gm)  # (the get_attr nodes only dropped layers read, and their weights)
    gm.graph.lint()
    gm.recompile()
    return total


def _ops(layer: list[fx.Node]) -> list[fx.Node]:
    """A layer's nodes but its size arithmetic and checks: what two layers of a kind hold alike."""
    return [n for n in layer if not _is_size(n) and not _is_check(n)]


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
