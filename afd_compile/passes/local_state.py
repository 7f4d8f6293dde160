"""A TP rank's KV cache, held as its own slice instead of a view of the caller's whole cache.

Through the backend, HF allocates and keeps the static cache: every TP rank would hold all KV
heads, of which its program reads and writes ``1 / attn_tp`` (``shard.apply._narrow_states`` narrows
the caller's tensor). This pass makes the program take and allocate only the rank's slice; the
backend keeps the slices (:mod:`afd_compile.state_store`) and hands HF a one-element placeholder
of the full shape in their place.

A cache the program receives (decode step; ``user_4`` is HF's layer-0 keys)::

    user_4_local = narrow(user_4, 1, 1, 1)            user_4 = placeholder   # the rank's slice
    index_copy_(user_4_local, 2, pos, k)       ->     index_copy_(user_4, 2, pos, k)

A cache the program allocates (a compiled prefill step creates HF's cache and returns it)::

    zeros = zeros([b, 2, s, 16])                      zeros = zeros([b, 1, s, 16])
    zeros_local = narrow(zeros, 1, 1, 1)       ->     index_copy_(zeros, 2, pos, k)
    index_copy_(zeros_local, 2, pos, k)               return (..., zeros, ...)   # the slice
    return (..., zeros, ...)

Plan records (:class:`HeldState`) say, per cache, which input / outputs carry it and its slice;
the backend maps them at every call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from .. import meta_keys

aten = torch.ops.aten

META_KEY = meta_keys.HELD_STATE

#: factories a program allocates a cache with: size list first
_FACTORIES = {aten.zeros.default, aten.empty.memory_format, aten.full.default}


@dataclass(frozen=True)
class HeldState:
    """One cache the program holds only its slice of: ``input`` (placeholder position) when the
    program receives it, None when it allocates it; ``outputs`` (flat output positions) that
    return it; its slice ``start:start+length`` of ``dim`` out of ``size``."""

    node: str
    input: int | None
    outputs: tuple[int, ...]
    dim: int
    start: int
    length: int
    size: int

    def full_shape(self, local: torch.Size) -> tuple[int, ...]:
        """The caller's shape of the cache whose slice has shape ``local``."""
        return tuple(self.size if d == self.dim else int(n) for d, n in enumerate(local))

    def __str__(self) -> str:
        where = f"input {self.input}" if self.input is not None else "allocated"
        return (f"{self.node} ({where}): holds {self.start}:{self.start + self.length} of dim {self.dim} "
                f"({self.size}), outputs {list(self.outputs)}")


def _narrow_of(node: fx.Node) -> fx.Node | None:
    views = [u for u in node.users if u.target is aten.narrow.default and u.args[0] is node]
    return views[0] if len(views) == 1 else None


def hold_local_states(gm: fx.GraphModule, states: Sequence[str]) -> tuple[HeldState, ...]:
    """Rewrite ``gm`` (a TP rank program: ``deploy.tp_rank_program``) so that each state in ``states``
    (node names of ``ShardPlan.states``) narrowed where read and written is instead taken or
    allocated as the rank's slice. A state that is neither a placeholder nor a factory call, or
    not narrowed once, is left as it is (the caller's whole tensor, narrowed). With a held input,
    export's input-shape checks (``_guards_fn``) go: they would check the slice against the whole
    cache (the caller's guards check the whole one). Returns the plan records; also recorded
    under ``node.meta["afd.held_state"]``."""
    by_name = {n.name: n for n in gm.graph.nodes}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = torch.utils._pytree.tree_leaves(out.args)
    held = []
    for name in states:
        node = by_name.get(name)
        view = _narrow_of(node) if node is not None else None
        if view is None or (node.op != "placeholder" and node.target not in _FACTORIES):
            continue
        _, dim, start, length = view.args
        size = int(node.meta["val"].shape[dim])
        if node.op == "call_function":
            sizes = list(node.args[0])
            sizes[dim] = length
            node.args = (sizes, *node.args[1:])
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            node.meta["val"] = val.new_empty([length if d == dim else n for d, n in enumerate(val.shape)])
        view.replace_all_uses_with(node)
        gm.graph.erase_node(view)
        record = HeldState(name, placeholders.index(node) if node.op == "placeholder" else None,
                           tuple(i for i, leaf in enumerate(leaves) if leaf is node), dim, start, length, size)
        node.meta[META_KEY] = record
        held.append(record)
    if any(h.input is not None for h in held):
        from .tp_rewrite import drop_export_guards

        drop_export_guards(gm)  # export's input-shape checks would check the slice against the whole cache
    gm.recompile()
    return tuple(held)
