"""A fixed slot: one receive size for every step, the token counts on the device.

With token buckets ``"fixed:C"`` (buckets.py) every attention rank sends ``C`` rows at every
transfer of every step, whatever its token count (none included: zeros), and beside each send a
header ``[tokens, flags]`` (int64, on the exchange's device) in the same batched call. Its FFN
rank therefore knows every receive size before a step (``C`` per live peer): it reads no control
message on the host, and one program (on CUDA one captured graph) serves every step::

    attention rank a (step t)                         FFN rank
      header_out <- [n_a, flags]                        (nothing read before the step)
      layer l: send  hidden[C rows] + header  ----->    recv C rows + header per live peer
               recv  out[C rows]    <---------------    send each peer its C rows
      (rows past n_a: its last row repeated, dropped)   after the step: headers_in read
                                                        (counts; STOP / FAILED)

What ends a peer travels the same way, in band: a rank that stops sends one more step of zeros
whose headers say STOP (:func:`owe`); a rank whose step raised completes the step's remaining
transfers with zeros and headers saying FAILED, so its FFN rank finishes the step, reads the
headers and ends naming it (no hang, no host message). The FFN rank reads the headers once its
step has run (on CUDA a wait for its own step, not for a peer's message): a peer that said STOP
is not received from again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx

from ..buckets import TokenBuckets
from ..comm import AFDCommunicator
from ..errors import AFDCompileError
from ..pipeline import Build


class FixedSlotError(AFDCompileError):
    """A fixed slot asked for where it cannot apply, or a step it cannot hold."""


@dataclass(frozen=True)
class WireStep:
    """One transfer of an attention rank's step: ``send`` or ``recv`` at (layer, stage), the
    tensors of ``spec`` (a wire spec string)."""

    direction: str
    layer: int
    stage: int
    spec: str


def wire_schedule(program: fx.GraphModule) -> tuple[WireStep, ...]:
    """The transfers of an attention program (a staged one: of every micro-batch), in the order it
    posts them."""
    ops = torch.ops.afd
    out = []
    for n in program.graph.nodes:
        if n.target in (ops.p2p_send.default, ops.p2p_send_start.default):
            out.append(WireStep("send", int(n.args[2]), int(n.args[3]), str(n.args[4])))
        elif n.target in (ops.p2p_recv.default, ops.p2p_recv_start.default):
            out.append(WireStep("recv", int(n.args[2]), int(n.args[3]), str(n.args[5])))
    return tuple(out)


def ghost_plan(
    schedule: Sequence[WireStep], real: int, stages: int
) -> dict[tuple[str, int, int], tuple[WireStep, ...]]:
    """An attention program of ``real`` micro-batches whose FFN rank runs ``stages``: after the
    last transfer of its last stage at each layer, the missing stages' transfers at that layer, in
    the order its last stage made its own (the order a program of every stage makes them: each
    stage sends, then receives)."""
    last = max(real - 1, 0)
    plan: dict[tuple[str, int, int], tuple[WireStep, ...]] = {}
    for layer in dict.fromkeys(step.layer for step in schedule):
        own = [step for step in schedule if step.layer == layer and max(step.stage, 0) == last]
        if own and real < stages:
            plan[(own[-1].direction, layer, last)] = tuple(
                WireStep(step.direction, layer, s, step.spec) for s in range(real, stages) for step in own
            )
    return plan


def with_ghosts(schedule: Sequence[WireStep], real: int, stages: int) -> tuple[WireStep, ...]:
    """An attention schedule of ``real`` micro-batches as its FFN rank's of ``stages`` sees it:
    :func:`ghost_plan`'s transfers where the communicator posts them."""
    plan, out = ghost_plan(schedule, real, stages), []
    for step in schedule:
        out += [step, *plan.get((step.direction, step.layer, max(step.stage, 0)), ())]
    return tuple(out)


def check_fixed_slot(buckets: TokenBuckets | None, *, rank: int, ffn_static_rows: bool = False) -> int | None:
    """The slot of a fixed-slot deployment (None: buckets are not a fixed slot), refused where the fixed
    slot does not apply, naming what to change: an FFN program of static rows (``ffn_static_rows``; an
    attention rank's program takes any slot). Every rank decides alike."""
    slot = buckets.fixed_slot if buckets is not None else None
    if slot is None:
        return None
    if ffn_static_rows:
        raise FixedSlotError(
            f"afd: {buckets} (token buckets) does not apply to rank {rank}: its FFN program has "
            "static rows (an export whose every shape is fixed: its rows cannot become a slot per "
            "peer); export the token count dynamic, or use a bucket list (buckets='default' or sizes)"
        )
    return slot


#: an FFN group rank's state in :class:`GroupAgreement`: serving, every peer gone, a peer failed
SERVING, DONE, PEER_FAILED = 0, 1, 2


@dataclass
class GroupAgreement:
    """An FFN TP / EP group's in-band agreement under a fixed slot. Every rank of the group runs
    ``rows[r]`` rows a step (``C`` per attention peer of group rank ``r``; a peer that left is
    padding), so the group's collectives need no per-step count. What a rank knows only from its
    headers (every peer gone, a peer failed) reaches the others one step late: each step, beside
    its program, the rank all-gathers its state of the step before (on the group, on the
    device), read with its headers::

        step k: program (C rows a peer, padding for the gone)  +  all_gather([state_(k-1), peer])
                after the step: headers read -> state_k;  the gathered states read:
                every rank DONE -> the group stops together; any PEER_FAILED -> every rank raises

    A rank whose peers have all gone runs steps of padding only until its group agrees."""

    group: object
    rows: tuple[int, ...]
    device: torch.device
    state: tuple[int, int] = (SERVING, -1)
    _posted: list[torch.Tensor] = field(default_factory=list)
    _mine: torch.Tensor | None = None

    def post(self) -> None:
        """All-gather this rank's state (before this step) beside the step's own work (into buffers made
        once: each step's writes queue behind the last step's gather on the same stream, and
        :meth:`read` has read the gathered states before the next post)."""
        if self._mine is None:
            self._mine = torch.empty(2, dtype=torch.int64, device=self.device)
            self._posted = [torch.empty_like(self._mine) for _ in self.rows]
        self._mine[0].fill_(self.state[0])
        self._mine[1].fill_(self.state[1])
        dist.all_gather(self._posted, self._mine, group=self.group)

    def read(self) -> list[tuple[int, int]]:
        """Every group rank's state as posted this step: ``(state, attention rank)``."""
        got = torch.stack(self._posted).tolist()
        return [(int(s), int(p)) for s, p in got]


def prepare(
    comm: AFDCommunicator,
    slot: int | None,
    device: torch.device,
    program: fx.GraphModule | None = None,
    lowering: Build | None = None,
    stages: int = 1,
    real_stages: int | None = None,
) -> tuple[tuple[WireStep, ...], dict | None]:
    """Make ``comm`` exchange fixed slots of ``slot`` rows (None: nothing to do): an attention
    rank's communicator gets its header (one per micro-batch stage) and the transfers of its
    ``program`` (the program of every stage: what a step it cannot finish still owes).
    ``real_stages``: the micro-batches ``program`` has when fewer than ``stages`` (a static batch
    of fewer sequences): the others cross in zeros (``comm.ghosts``). Returns the schedule and the
    ghosts (the worker sets them again each step: programs of one rank share its communicator).
    ``lowering``: the build the rank's programs were lowered by, which must agree (an FFN program
    lowered for a fixed slot reads its headers)."""
    if lowering is not None and lowering.fixed_slot != (slot is not None):
        raise FixedSlotError(
            f"rank {comm.rank}: its programs were lowered {'for' if lowering.fixed_slot else 'without'}"
            f" a fixed slot, its wire {'is one' if slot is not None else 'is not one'}: build both "
            "from the same buckets (pipeline.rank_build(..., fixed_slot=))"
        )
    # (a communicator registered earlier under the same id may be reused for this worker: what an
    # earlier deployment's wire left on it goes)
    comm.fixed_slot, comm.header_out, comm.schedule, comm.ghosts = slot, None, (), None
    comm.headers_in.clear()
    comm.step_log.clear()
    if slot is None or comm.role != "attention":
        return (), None
    assert program is not None
    real = stages if real_stages is None else real_stages
    comm.schedule = with_ghosts(wire_schedule(program), real, stages) if real < stages else wire_schedule(program)
    comm.ghosts = ghost_plan(wire_schedule(program), real, stages) if real < stages else None
    comm.header_out = torch.zeros(stages, 2, dtype=torch.int64, device=device)
    return comm.schedule, comm.ghosts


def set_header(comm: AFDCommunicator, tokens: Sequence[int], flags: int) -> None:
    """This step's headers of an attention rank, its tokens per stage: what every send of a stage
    carries."""
    assert comm.header_out is not None
    _fill_header(comm.header_out, tokens, flags)
    comm.step_log.clear()


def _fill_header(header: torch.Tensor, tokens: Sequence[int], flags: int) -> None:
    """``header[s] = [tokens[s], flags]`` by fills with scalar arguments: on CUDA kernel launches that
    wait for nothing (a copy from a host tensor would wait for the stream's queued work: the
    previous step's, on every step)."""
    for s, n in enumerate(tokens):
        header[s, 0].fill_(n)
    header[:, 1].fill_(flags)


def owe(comm: AFDCommunicator, tokens: int, flags: int) -> None:
    """Send (and receive) what this step still owes the FFN rank, zeros in slots of the fixed
    size, every header ``[tokens, flags]``: the whole step for a stop (``comm.step_log`` empty),
    the rest of a step that raised. A step whose transfers are not a prefix of the schedule (a
    transfer that failed) cannot be completed: FixedSlotError."""
    from ..wire import WireSpec

    assert comm.fixed_slot is not None and comm.header_out is not None
    done = [(s.direction, s.layer, s.stage) for s in comm.schedule[: len(comm.step_log)]]
    if done != comm.step_log:
        raise FixedSlotError(
            f"afd: attention rank {comm.rank}: its step's transfers {comm.step_log} are not the "
            f"start of its schedule; the step cannot be completed for FFN rank {comm.peers[0]}"
        )
    rest = comm.schedule[len(comm.step_log) :]
    _fill_header(comm.header_out, [tokens] * comm.header_out.shape[0], flags)
    dev, peer, slot = comm.header_out.device, comm.peers[0], comm.fixed_slot
    where = f"afd: attention rank {comm.rank}, the owed transfers of its step"
    works, held = [], []  # (all posted in the program's order, then waited on: the FFN rank takes them in its own)
    ghosts, comm.ghosts = comm.ghosts, None  # (the schedule has the ghost stages' transfers already)
    try:
        for s in rest:
            spec = WireSpec.parse(s.spec)
            bufs = [(torch.zeros(w.shape(slot), dtype=w.dtype, device=dev), peer, w.kind) for w in spec.tensors]
            sends, recvs = (bufs, []) if s.direction == "send" else ([], bufs)
            works += comm.start(sends, recvs, layer_idx=s.layer, stage_idx=s.stage, where=where)
            held += bufs
    finally:
        comm.ghosts = ghosts
    comm.wait(works, where, held)
    comm.in_flight.clear()
    comm.step_log.clear()


def read_headers(comm: AFDCommunicator, live: Sequence[int]) -> dict[int, dict[tuple[int, int], tuple[int, int]]]:
    """An FFN rank's headers of the step just run: per live peer, ``(tokens, flags)`` of each of
    its transfers by (layer, stage) (one device-to-host copy, after the step's own work)."""
    keys = sorted(comm.headers_in)
    if not keys:
        return {p: {} for p in live}
    got = torch.stack([comm.headers_in[k] for k in keys]).tolist()  # [transfers, peers, 2]
    index = {p: i for i, p in enumerate(comm.peers)}
    return {p: {k: (int(h[index[p]][0]), int(h[index[p]][1])) for k, h in zip(keys, got, strict=True)} for p in live}


def step_tokens(headers: dict[tuple[int, int], tuple[int, int]]) -> int:
    """A peer's tokens this step: its first layer's header of each stage, summed."""
    first = min((layer for layer, _ in headers), default=0)
    return sum(max(t, 0) for (layer, _), (t, _) in headers.items() if layer == first)


def step_message(headers: Sequence[tuple[int, int]], failed: int) -> list[int]:
    """A peer's step as one control message ``[tokens, flags]``: ``failed`` if any of its
    headers says so (its step raised part way), else its first header's."""
    headers = list(headers)
    if any(t == failed for t, _ in headers):
        return [failed, 0]
    return list(headers[0])
