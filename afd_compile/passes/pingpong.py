"""The ping-pong schedule of AFD micro-batches, as a printable record, and its static checker.

With ``S`` stages each attention rank splits a step's sequences into ``S`` micro-batches (whole
sequences, contiguous, balanced by tokens: :func:`afd_compile.layout.micro_batches`). Every rank runs the layers
layer-major, stage-minor; an attention rank sends micro-batch ``s`` of layer ``l`` and goes on with
micro-batch ``s + 1`` while its FFN rank computes ``s``::

    attention rank                         FFN rank
    attn L0/S0  send L0/S0  recv L0/S0     recv L0/S0  ffn L0/S0  send L0/S0
    attn L0/S1  send L0/S1  recv L0/S1     recv L0/S1  ffn L0/S1  send L0/S1
    attn L1/S0  ...                        recv L1/S0  ...

(``attn L1/S0`` needs ``recv L0/S0``: it overlaps the FFN rank's ``ffn L0/S1``.) An FFN rank's
receive and send of one layer and stage take every peer at once (fan-in: it concatenates the
peers' micro-batch ``s``); a peer whose micro-batch ``s`` has no token has no transfer in stage
``s``, and a stage with no token on any peer of an FFN rank is not run there.

:func:`check_schedule` proves, for the record of every rank of a layout, before anything runs:

1. **pairing**: for every ordered pair of ranks, the sends of one to the other and the other's
   receives from it are the same transfers (layer, stage, what) in the same order (NCCL pairs
   the n-th send with the n-th receive);
2. **causality**: each rank's micro-batch ``s`` goes through the layers in order (attention: send
   ``l`` after computing ``l``, computing ``l + 1`` after receiving ``l``; FFN: receive, compute,
   send), each layer once;
3. **no deadlock**: the transfers of each rank run one after the other in record order (one
   communication stream), a transfer completing when both ends have reached it; simulated to the
   end, every rank finishes.

The first violation is a :class:`ScheduleError` naming the rank, layer, stage and transfer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..layout import AFDLayout
from .schedule import ScheduleError

SEND, RECV, COMPUTE = "send", "recv", "compute"
#: what an FFN rank sends back (a step's label; the hidden states go the other way)
FFN_OUT = "ffn_out"


@dataclass(frozen=True)
class Step:
    """One entry of a rank's schedule: ``compute`` (attention or FFN work of a layer and stage),
    or a ``send`` / ``recv`` with ``peers`` (an FFN rank's take all its peers with tokens)."""

    kind: str
    layer: int
    stage: int
    peers: tuple[int, ...] = ()
    what: str = "hidden"

    def __str__(self) -> str:
        where = f"L{self.layer}/S{self.stage}"
        if self.kind == COMPUTE:
            return f"compute {where}"
        arrow = "->" if self.kind == SEND else "<-"
        return f"{self.kind} {where} {self.what} {arrow} {','.join(map(str, self.peers))}"


@dataclass(frozen=True)
class RankSchedule:
    rank: int
    role: str  # "attention" | "ffn"
    steps: tuple[Step, ...]

    def __str__(self) -> str:
        return f"rank {self.rank} ({self.role}): " + "; ".join(map(str, self.steps))


@dataclass(frozen=True)
class Schedule:
    """Every rank's steps for one model step of ``layers`` layers in ``stages`` stages;
    ``tokens[a][s]`` the tokens of attention index ``a``'s micro-batch ``s``."""

    layout: AFDLayout
    layers: int
    stages: int
    tokens: tuple[tuple[int, ...], ...]
    ranks: tuple[RankSchedule, ...] = field(default=())
    #: False for the schedule read from programs (every micro-batch taken to have tokens)
    tokens_known: bool = True

    def __str__(self) -> str:
        head = f"ping-pong schedule {self.layout}, {self.layers} layers x {self.stages} stages"
        if self.tokens_known:
            head += f"; tokens per attention rank and stage {[list(t) for t in self.tokens]}"
        return "\n".join([head, *(f"  {r}" for r in self.ranks)])


def pingpong_schedule(layout: AFDLayout, layers: int, tokens: Sequence[Sequence[int]]) -> Schedule:
    """The canonical schedule (module docstring) for ``tokens[a][s]``: attention index ``a``'s
    tokens in stage ``s`` (every attention rank the same number of stages)."""
    stages = {len(t) for t in tokens}
    if len(tokens) != layout.attention_ranks or len(stages) != 1:
        raise ValueError(f"tokens must give {layout.attention_ranks} attention ranks the same number of stages, "
                         f"got {[list(t) for t in tokens]}")
    (n_stages,) = stages
    ranks = []
    for f in range(layout.ffn_ranks):
        peers = layout.peers_of_ffn(f)
        steps: list[Step] = []
        for layer in range(layers):
            for s in range(n_stages):
                live = tuple(p for p in peers if tokens[p - layout.ffn_ranks][s])
                if live:
                    steps += [Step(RECV, layer, s, live), Step(COMPUTE, layer, s), Step(SEND, layer, s, live, FFN_OUT)]
        ranks.append(RankSchedule(f, "ffn", tuple(steps)))
    for a in range(layout.attention_ranks):
        ffn = (layout.ffn_of_attention(a),)
        steps = []
        for layer in range(layers):
            for s in range(n_stages):
                if tokens[a][s]:
                    steps += [Step(COMPUTE, layer, s), Step(SEND, layer, s, ffn), Step(RECV, layer, s, ffn, FFN_OUT)]
        ranks.append(RankSchedule(layout.attention_world_rank(a), "attention", tuple(steps)))
    return Schedule(layout, layers, n_stages, tuple(tuple(t) for t in tokens), tuple(ranks))


def check_schedule(schedule: Schedule) -> None:
    """Raise ScheduleError on the first pairing, causality or deadlock violation (module docstring)."""
    by_rank = {r.rank: r for r in schedule.ranks}
    if sorted(by_rank) != list(range(schedule.layout.world_size)):
        raise ScheduleError(f"schedule {schedule.layout}: records for ranks {sorted(by_rank)}, expected "
                            f"0..{schedule.layout.world_size - 1}")
    _check_pairing(by_rank)
    for r in schedule.ranks:
        _check_causality(r, schedule)
    _check_progress(by_rank)


def _channel(by_rank: dict[int, RankSchedule], src: int, dst: int) -> tuple[list[Step], list[Step]]:
    """The sends ``src -> dst`` in ``src``'s order, and the receives at ``dst`` from ``src``."""
    sends = [s for s in by_rank[src].steps if s.kind == SEND and dst in s.peers]
    recvs = [s for s in by_rank[dst].steps if s.kind == RECV and src in s.peers]
    return sends, recvs


def _check_pairing(by_rank: dict[int, RankSchedule]) -> None:
    for src in by_rank:
        for dst in by_rank:
            sends, recvs = _channel(by_rank, src, dst)
            for i in range(max(len(sends), len(recvs))):
                a = sends[i] if i < len(sends) else None
                b = recvs[i] if i < len(recvs) else None
                if a is None or b is None or (a.layer, a.stage, a.what) != (b.layer, b.stage, b.what):
                    raise ScheduleError(
                        f"transfer #{i} from rank {src} to rank {dst}: rank {src} has {a or 'no send'}, rank {dst} "
                        f"has {b or 'no receive'}: every send needs its receive, in the same order")


def _check_causality(r: RankSchedule, schedule: Schedule) -> None:
    # per stage, the kinds in the order a micro-batch goes through a layer, and the next layer
    cycle = (COMPUTE, SEND, RECV) if r.role == "attention" else (RECV, COMPUTE, SEND)
    seen: dict[int, list[Step]] = {}
    for step in r.steps:
        seen.setdefault(step.stage, []).append(step)
    for stage, steps in seen.items():
        if not 0 <= stage < schedule.stages:
            raise ScheduleError(f"rank {r.rank} ({r.role}): {steps[0]} has stage {stage}, outside "
                                f"0..{schedule.stages - 1}")
        for i, step in enumerate(steps):
            layer, kind = divmod(i, 3)
            if (step.layer, step.kind) != (layer, cycle[kind]):
                raise ScheduleError(
                    f"rank {r.rank} ({r.role}), stage {stage}: {step} where {cycle[kind]} L{layer}/S{stage} belongs "
                    f"(a micro-batch goes {' -> '.join(cycle)} through each layer in order)"
                )
        if len(steps) not in (0, 3 * schedule.layers):
            raise ScheduleError(
                f"rank {r.rank} ({r.role}), stage {stage}: {len(steps) // 3} of {schedule.layers} layers scheduled"
            )


def _check_progress(by_rank: dict[int, RankSchedule]) -> None:
    """Run the transfers of every rank one after the other (compute takes no turn); a transfer
    member (one peer of a send or receive) completes when the peer's current transfer holds its
    mirror. Raise, naming every waiting rank, when no rank can move and some have not finished."""
    comm = {r: [s for s in rs.steps if s.kind != COMPUTE] for r, rs in by_rank.items()}
    pos = dict.fromkeys(comm, 0)
    done: dict[int, set[int]] = {r: set() for r in comm}  # peers of the current transfer completed

    def head(r: int) -> Step | None:
        return comm[r][pos[r]] if pos[r] < len(comm[r]) else None

    moved = True
    while moved:
        moved = False
        for r in comm:
            h = head(r)
            if h is None:
                continue
            for p in h.peers:
                g = head(p)
                if p in done[r] or g is None or r not in g.peers or r in done[p] or g.kind == h.kind:
                    continue
                done[r].add(p)
                done[p].add(r)
                moved = True
            for q in (r, *h.peers):
                g = head(q)
                if g is not None and done[q] >= set(g.peers):
                    pos[q] += 1
                    done[q] = set()
                    moved = True
    waiting = {r: head(r) for r in comm if head(r) is not None}
    if waiting:
        raise ScheduleError("deadlock: " + "; ".join(f"rank {r} waits at {h}" for r, h in sorted(waiting.items())))


def schedule_of_programs(layout: AFDLayout, attention: fx.GraphModule, ffn: fx.GraphModule) -> Schedule:
    """The schedule the programs themselves hold, every attention rank running ``attention``
    (each micro-batch with tokens) and every FFN rank ``ffn``: the transfers in program order
    (a started transfer counts where it starts), a layer's compute before its send."""
    from .. import ops  # noqa: F401  (registers the afd ops)

    afd = torch.ops.afd
    sends = {afd.p2p_send.default, afd.p2p_send_start.default}
    recvs = {afd.p2p_recv.default, afd.p2p_recv_start.default}
    a_steps: list[Step] = []
    for n in attention.graph.nodes:
        if n.op == "call_function" and n.target in sends | recvs:
            layer, stage = int(n.args[2]), int(n.args[3])
            a_steps += (
                [Step(COMPUTE, layer, stage), Step(SEND, layer, stage)]
                if n.target in sends
                else [Step(RECV, layer, stage, what=FFN_OUT)]
            )
    f_steps: list[Step] = []
    for n in ffn.graph.nodes:
        if n.op == "call_function" and n.target in (afd.p2p_recv_group.default, afd.p2p_send_group.default):
            layer, stage = int(n.args[2]), int(n.args[3])
            f_steps += (
                [Step(RECV, layer, stage), Step(COMPUTE, layer, stage)]
                if n.target == afd.p2p_recv_group.default
                else [Step(SEND, layer, stage, what=FFN_OUT)]
            )
    layers = 1 + max((s.layer for s in a_steps), default=-1)
    stages = 1 + max((s.stage for s in a_steps + f_steps), default=-1)
    ranks = []
    for f in range(layout.ffn_ranks):
        peers = layout.peers_of_ffn(f)
        steps = tuple(s if s.kind == COMPUTE else dataclasses.replace(s, peers=peers) for s in f_steps)
        ranks.append(RankSchedule(f, "ffn", steps))
    for a in range(layout.attention_ranks):
        ffn_rank = (layout.ffn_of_attention(a),)
        steps = tuple(s if s.kind == COMPUTE else dataclasses.replace(s, peers=ffn_rank) for s in a_steps)
        ranks.append(RankSchedule(layout.attention_world_rank(a), "attention", steps))
    tokens = tuple(tuple([1] * stages) for _ in range(layout.attention_ranks))
    return Schedule(layout, layers, stages, tokens, tuple(ranks), tokens_known=False)
