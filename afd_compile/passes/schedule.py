"""Static check that an attention program and an FFN program agree on their transfers.

Run before anything executes. For one (attention, FFN) pair the attention program's sequence of
``p2p_send`` / ``p2p_recv`` must mirror the FFN program's ``p2p_recv_group`` / ``p2p_send_group``
(same layer, stage and wire spec, in the same order), and inside each program every transfer must
depend on the one before it, so no compiler can reorder them (DESIGN §8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .. import ops as afd_ops  # noqa: F401
from ..errors import AFDCompileError

afd = torch.ops.afd


class ScheduleError(AFDCompileError):
    pass


@dataclass(frozen=True)
class Transfer:
    """One transfer seen from the attention side: direction ``to_ffn`` or ``to_attention``."""

    direction: str
    layer: int
    stage: int
    spec: str
    node: str

    def key(self) -> tuple:
        return (self.direction, self.layer, self.stage, self.spec)

    def __str__(self) -> str:
        return f"{self.direction} L{self.layer}/S{self.stage} {self.spec} ({self.node})"


_DIRECTION = {
    afd.p2p_send.default: "to_ffn",
    afd.p2p_send_start.default: "to_ffn",
    afd.p2p_recv_start.default: "to_attention",
    afd.p2p_recv_group.default: "to_ffn",
    afd.p2p_recv.default: "to_attention",
    afd.p2p_send_group.default: "to_attention",
}


def transfers(gm: fx.GraphModule) -> list[Transfer]:
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _DIRECTION:
            _, _comm, layer, stage, *rest = n.args
            out.append(Transfer(_DIRECTION[n.target], int(layer), int(stage), str(rest[-1]), n.name))
    return out


def _check_chained(gm: fx.GraphModule, name: str) -> None:
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _DIRECTION]
    for prev, nxt in zip(ops, ops[1:], strict=False):
        seen, stack = set(), [nxt]
        while stack:
            n = stack.pop()
            if n is prev:
                break
            if n in seen:
                continue
            seen.add(n)
            stack.extend(n.all_input_nodes)
        else:
            raise ScheduleError(
                f"{name} program: transfer {nxt.name} does not depend on the transfer before it "
                f"({prev.name}); a compiler could reorder them"
            )


def verify_schedule(attention: fx.GraphModule, ffn: fx.GraphModule) -> list[Transfer]:
    """Raise ScheduleError on the first mismatch; return the agreed sequence."""
    a, f = transfers(attention), transfers(ffn)
    for i in range(max(len(a), len(f))):
        ta = a[i] if i < len(a) else None
        tf = f[i] if i < len(f) else None
        if ta is None or tf is None or ta.key() != tf.key():
            raise ScheduleError(
                f"transfer #{i}: attention program has {ta or 'nothing'}, FFN program has {tf or 'nothing'}"
            )
        expected = "to_ffn" if i % 2 == 0 else "to_attention"
        if ta.direction != expected:
            raise ScheduleError(f"transfer #{i}: expected a {expected} transfer, got {ta}")
    _check_chained(attention, "attention")
    _check_chained(ffn, "FFN")
    return a
