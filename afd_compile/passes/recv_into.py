"""Give an FFN program's receives their buffers: each list-returning receive becomes one that
receives into buffers the program allocates (``afd::p2p_recv_group_into``,
``afd::p2p_send_recv_group_into``).

Why: under the backend's ``ffn_capture="compute"`` the exchange ops run between captured pieces
(Inductor's graph partition), and Inductor hands the next piece the op's whole output list where
the piece reads one tensor of it; CUDA graph trees refuse a piece whose input is a list (torch 2.11
asserts). A buffer received into is a tensor: the piece reads it as one. The receive also writes
each peer's rows in place instead of concatenating them.

Before (one wire tensor; a receive fused with the send before it alike)::

    afd_recv_L0 = afd.p2p_recv_group(token_slots, 0, 0, 0, total_tokens, spec)
    h = afd_recv_L0[0]

After::

    afd_recv_L0_buf0 = aten.new_empty(token_slots, [total_tokens, 2048], dtype=bfloat16)
    afd_recv_L0_into = afd.p2p_recv_group_into(token_slots, [afd_recv_L0_buf0], 0, 0, 0, spec)
    (h: afd_recv_L0_buf0)

The buffers take their device from the receive's ``dep`` (the fused op's first sent tensor):
the program's device when it runs, not the one it was traced on. A receive whose list is read
other than element by element (``getitem``) is left as it was. The backend runs this pass on each
FFN program it compiles, after passes/fuse_exchange.py; each rewritten node records the op it
replaced under ``node.meta["afd.recv_into"]``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import (
    meta_keys,
    ops,  # noqa: F401  (registers the afd:: ops this module's table names)
)
from ..wire import WireSpec

afd = torch.ops.afd
aten = torch.ops.aten
META = meta_keys.RECV_INTO

#: list-returning receive -> (its replacement, the arg holding the token count, the arg holding the spec)
_INTO = {
    afd.p2p_recv_group.default: (afd.p2p_recv_group_into.default, 4, 5),
    afd.p2p_send_recv_group.default: (afd.p2p_send_recv_group_into.default, 7, 8),
}


def receive_into_buffers(gm: fx.GraphModule) -> list[str]:
    """Rewrite every list-returning receive of ``gm`` (module docstring); returns the new
    nodes' names (the old name + ``_into``), in program order."""
    graph = gm.graph
    done = []
    for node in [n for n in graph.nodes if n.target in _INTO]:
        if not all(u.target == operator.getitem for u in node.users):
            continue
        into, total_at, spec_at = _INTO[node.target]
        total, spec = node.args[total_at], node.args[spec_at]
        like = node.args[0] if node.target == afd.p2p_recv_group.default else node.args[0][0]
        name = node.name
        with graph.inserting_before(node):
            bufs = []
            for i, w in enumerate(WireSpec.parse(spec).tensors):
                buf = graph.call_function(aten.new_empty.default, (like, list(w.shape(total))), {"dtype": w.dtype})
                buf._rename(f"{name}_buf{i}")
                bufs.append(buf)
            args = list(node.args)
            del args[total_at]
            args.insert(1, bufs)
            new = graph.call_function(into, tuple(args))
        for u in list(node.users):
            u.replace_all_uses_with(bufs[u.args[1]])
            graph.erase_node(u)
        new.meta[META] = node.target.name()
        graph.erase_node(node)
        new._rename(f"{name}_into")
        done.append(new.name)
    if done:
        graph.lint()
        gm.recompile()
    return done
