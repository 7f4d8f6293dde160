"""Run an FFN program's send and the receive after it as one op (``afd::p2p_send_recv_group``).

An FFN program returns layer ``i``'s output to its attention peers and at once waits for layer
``i + 1``'s input: the two ops are adjacent, the receive's ``dep`` is the send's token.
Before (passes/split.py's FFN program)::

    afd_send_L0 = afd.p2p_send_group([y0], 0, 0, 0, spec_out0)
    afd_recv_L1 = afd.p2p_recv_group(afd_send_L0, 0, 1, 0, total_tokens, spec_in1)
    h1 = afd_recv_L1[0]

After::

    afd_send_recv_L0_L1 = afd.p2p_send_recv_group([y0], 0, 0, 0, spec_out0, 1, 0, total_tokens, spec_in1)
    h1 = afd_send_recv_L0_L1[0]

Both are posted in one batched call and waited on together: the send is posted when it was, the
receive no later, so no peer waits longer. A program captured in pieces around its exchange
(the backend's ``ffn_capture="compute"``: Inductor's graph partition) then holds one piece per
layer plus one, not two per layer: the piece between a send and the next receive held nearly
nothing and cost a graph launch (benchmarks/ffn_partition.py).

A pair is fused only when the send's token has no other user and no side-effecting node lies
between the two (a group collective of an FFN TP group stays where it was). The backend runs
this pass on each FFN program it compiles, after every pass that reads the four exchange ops
(stages, FFN TP, schedule checks): the saved programs and the plain runtime keep the two ops.
Each fused node records both ends under ``node.meta["afd.fused_exchange"]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .. import meta_keys

afd = torch.ops.afd
META = meta_keys.FUSED_EXCHANGE


@dataclass(frozen=True)
class FusedExchange:
    """One fused pair: the send's and the receive's (layer, stage), and the new node's name."""

    node: str
    send: tuple[int, int]
    recv: tuple[int, int]

    def __str__(self) -> str:
        return (f"{self.node}: send layer {self.send[0]} stage {self.send[1]} + receive layer {self.recv[0]} "
                f"stage {self.recv[1]}")


def _between_impure(send: fx.Node, recv: fx.Node) -> bool:
    n = send.next
    while n is not recv:
        if n.op == "call_function" and n.is_impure():
            return True
        n = n.next
    return False


def fuse_send_recv(gm: fx.GraphModule) -> list[FusedExchange]:
    """Fuse every adjacent ``p2p_send_group`` / ``p2p_recv_group`` pair of ``gm`` (module
    docstring); returns what was fused, in program order."""
    graph = gm.graph
    done = []
    for recv in [n for n in graph.nodes if n.target == afd.p2p_recv_group.default]:
        send = recv.args[0]
        if not (isinstance(send, fx.Node) and send.target == afd.p2p_send_group.default
                and len(send.users) == 1 and send.args[1] == recv.args[1]) or _between_impure(send, recv):
            continue
        tensors, comm_id, layer, stage, spec = send.args
        _, _, r_layer, r_stage, total, r_spec = recv.args
        with graph.inserting_before(recv):
            fused = graph.call_function(afd.p2p_send_recv_group.default,
                                        (tensors, comm_id, layer, stage, spec, r_layer, r_stage, total, r_spec))
        fused._rename(f"afd_send_recv_L{layer}_L{r_layer}" + (f"_S{stage}_S{r_stage}" if stage or r_stage else ""))
        fused.meta.update(recv.meta)  # (its value: the receive's tensors)
        record = FusedExchange(fused.name, (int(layer), int(stage)), (int(r_layer), int(r_stage)))
        fused.meta[META] = record
        recv.replace_all_uses_with(fused)
        graph.erase_node(recv)
        graph.erase_node(send)
        done.append(record)
    if done:
        graph.lint()
        gm.recompile()
    return done
