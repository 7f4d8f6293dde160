"""Communicators for the AFD custom ops, looked up by integer id.

A custom op cannot capture a Python object, so each op takes a ``comm_id`` and finds its
:class:`AFDCommunicator` in a process-wide registry. The communicator knows this rank's role, its
peers (an attention rank has one FFN peer; an FFN rank owns a contiguous block of attention peers),
the transport (gloo on CPU, NCCL on CUDA) and the per-step transfer metadata (per-peer token
counts), which the runtime learns once per step from a small control message.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .errors import AFDCompileError


@dataclass(frozen=True)
class TransferMetadata:
    """Seed 000's metadata record: layer, stage and one token count per attention peer."""

    layer_idx: int
    stage_idx: int
    seq_lens: tuple[int, ...]

    @property
    def total_tokens(self) -> int:
        return sum(self.seq_lens)

    def validate_tensor_shape(self, shape: Sequence[int]) -> bool:
        return len(shape) >= 1 and shape[0] == self.total_tokens


def wire_checks_from_env() -> bool:
    """``AFD_CHECK_WIRE=1``: every transfer is preceded by a check header (see AFDCommunicator)."""
    return os.environ.get("AFD_CHECK_WIRE", "0") not in ("", "0")


class TransferError(AFDCompileError):
    """A transfer with an AFD peer that did not complete (timeout, closed connection)."""


class WireMismatch(AFDCompileError):
    """A received transfer is not what the receiver expects (layer, stage, kind, dtype, shape)."""


#: one transfer: (tensor, peer world rank, wire kind)
Transfer = tuple[torch.Tensor, int, str]


@dataclass
class AFDCommunicator:
    """This rank's view of the AFD exchange.

    ``peers`` are world ranks: for an attention rank, ``[its FFN rank]``; for an FFN rank, its
    attention peers in order. ``step_seq_lens[stage]`` holds the token count per peer for the
    current step (set by the runtime before the program runs).

    ``check_wire`` (default: ``AFD_CHECK_WIRE``; on in ``verify`` and the tests): each transfer
    is preceded by a small header (layer, stage, kind, dtype, shape) in a batched exchange of its
    own; the receiver compares it with what it expects and raises :class:`WireMismatch` naming
    layer, stage, peer and both values before any data is received. It costs one more small
    round trip per exchange, so it is off by default; both sides of a pair must agree (the
    per-step control message carries the flag, and the FFN rank refuses a mismatch).
    """

    role: str
    rank: int
    peers: tuple[int, ...]
    group: dist.ProcessGroup | None = None
    step_seq_lens: dict[int, tuple[int, ...]] = field(default_factory=dict)
    check_wire: bool = field(default_factory=wire_checks_from_env)
    #: an attention rank has told its FFN rank it is done (runtime.finish)
    stopped: bool = False
    #: runtime.shutdown() sends this attention rank's STOP if it was not sent (the backend's)
    finish_at_shutdown: bool = False
    #: transfers exchanged per stage index (non-empty ones), since this communicator was made
    stage_transfers: dict[int, int] = field(default_factory=dict)
    #: bytes this rank has sent through this communicator (the data, not the check headers)
    bytes_sent: int = 0
    #: an attention rank's wire slot per stage this step (token buckets, buckets.py): its tokens
    #: cross the wire padded to this many rows; absent: the exact count
    step_slots: dict[int, int] = field(default_factory=dict)
    #: an FFN rank's program rows per stage this step (token buckets): its peers' tokens padded
    #: with repeated rows (ops.pad_rows); absent: the tokens exactly
    step_rows: dict[int, int] = field(default_factory=dict)
    #: the group the per-step control messages travel on as host tensors (runtime.control_group:
    #: a gloo group beside an NCCL ``group``); None: on ``group``, as device tensors on NCCL
    control_group: dist.ProcessGroup | None = None
    #: transfers a staged program started and has not waited on, this step: (layer, stage, "send" |
    #: "recv") -> (works, tensors kept alive until the wait) (ops.p2p_send_start / recv_start / recv_wait)
    in_flight: dict[tuple[int, int, str], tuple[list, list]] = field(default_factory=dict)
    #: a fixed slot (runtime/slots.py): every transfer of a step is this many rows a peer, and each
    #: attention send carries a header ``[tokens, flags]`` beside its data; None: per-step sizes
    fixed_slot: int | None = None
    #: an attention rank's headers this step, one per stage (fixed slot), on the exchange's device
    header_out: torch.Tensor | None = None
    #: an attention rank's transfers, in its program's order (fixed slot: what a step owes)
    schedule: tuple = ()
    #: an attention rank's transfers this step, ("send" | "recv", layer, stage) (fixed slot)
    step_log: list[tuple[str, int, int]] = field(default_factory=list)
    #: an FFN rank's headers received this step per (layer, stage): ``[peers, 2]`` (fixed slot)
    headers_in: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    #: an attention rank whose program has fewer micro-batches than its FFN rank's (a static batch
    #: of fewer sequences than stages; fixed slot): after the transfer ("send" | "recv", layer,
    #: stage) the missing stages' transfers at that layer (``slots.WireStep``s), in zeros, in the
    #: order the program's last stage made its own (runtime/slots.ghost_plan)
    ghosts: dict[tuple[str, int, int], tuple] | None = None
    #: the buffers of those transfers, made once per shape (zeros sent; receives never read)
    ghost_buffers: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ("attention", "ffn"):
            raise ValueError(f"afd: communicator role must be 'attention' or 'ffn', got {self.role!r}")
        if not self.peers:
            raise ValueError(f"afd: {self.role} rank {self.rank} has no peers")

    @property
    def device_transport(self) -> bool:
        """True when the transport moves device (CUDA) tensors only: NCCL."""
        if not dist.is_initialized():
            return False
        return dist.get_backend(self.group) == "nccl"

    @property
    def control_device(self) -> str:
        """Where a control message lives: ``"cuda"`` when it travels on an NCCL group (reading
        it on the host waits for the device), else ``"cpu"``."""
        return "cuda" if self.control_group is None and self.device_transport else "cpu"

    @property
    def control_peer_group(self) -> dist.ProcessGroup | None:
        """The group the control messages travel on."""
        return self.control_group if self.control_group is not None else self.group

    def metadata(self, layer_idx: int, stage_idx: int) -> TransferMetadata:
        if stage_idx not in self.step_seq_lens:
            raise RuntimeError(
                f"afd: {self.role} rank {self.rank} has no token counts for stage {stage_idx} "
                f"(layer {layer_idx}); the runtime must call set_step() before running a program"
            )
        return TransferMetadata(layer_idx, stage_idx, self.step_seq_lens[stage_idx])

    def set_step(self, seq_lens_per_stage: dict[int, Sequence[int]], slots: dict[int, int] | None = None) -> None:
        """This step's token counts per stage (one per peer); ``slots`` (an attention rank with
        token buckets): per stage the rows its tokens take on the wire (>= its count)."""
        self.step_seq_lens = {s: tuple(int(n) for n in v) for s, v in seq_lens_per_stage.items()}
        self.step_slots = {s: int(n) for s, n in (slots or {}).items()}
        self.step_rows = {}
        for s, n in self.step_slots.items():
            if n < sum(self.step_seq_lens.get(s, ())):
                raise ValueError(f"afd: {self.role} rank {self.rank}, stage {s}: a wire slot of {n} rows cannot hold "
                                 f"{sum(self.step_seq_lens[s])} tokens")

    def received_tokens(self, stage_idx: int, rows: int, where: str) -> int:
        """An FFN rank's tokens at ``stage_idx`` when its program runs ``rows`` rows: the sum of
        the peers' counts when the runtime padded the rows to a bucket (``step_rows``), else
        ``rows`` itself."""
        padded = self.step_rows.get(stage_idx)
        if padded is None or padded == sum(self.step_seq_lens.get(stage_idx, ())):
            return rows
        if rows != padded:
            raise ValueError(f"{where}: shape mismatch: the program runs {rows} rows but this step's rows are "
                             f"{padded} (its peers' {sum(self.step_seq_lens[stage_idx])} tokens padded to a bucket)")
        return sum(self.step_seq_lens[stage_idx])

    def slot(self, stage_idx: int, tokens: int) -> int:
        """The rows ``tokens`` take on the wire at ``stage_idx`` this step (an attention rank's
        bucket slot; ``tokens`` without one)."""
        return self.step_slots.get(stage_idx, tokens)

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], *, layer_idx: int = -1,
                 stage_idx: int = -1, where: str = "afd") -> None:
        """Send and receive in one batched call and wait for all of it.

        Batched so that cross-rank order comes from one call, not from source order (DESIGN §8);
        waited on before returning so no buffer is reused while in flight. Zero-length tensors
        are skipped on both sides (both sides know the counts). With ``check_wire`` the headers
        of every transfer go first (:meth:`_check_headers`).
        """
        works = self.start(sends, recvs, layer_idx=layer_idx, stage_idx=stage_idx, where=where)
        self.wait(works, where, [*sends, *recvs])

    def wait(self, works: Sequence[Any], where: str, transfers: Sequence[Transfer] | None = None) -> None:
        """Wait for ``works``; one that fails (a peer that failed mid-step leaves this rank waiting
        until its group's timeout, or closed its connections) is a :class:`TransferError` naming
        this rank's role, the peers of ``transfers`` (None: all its peers) and ``where``, the
        transport's own message kept. Nothing is computed for the message unless one fails."""
        try:
            for work in works:
                work.wait()
        except RuntimeError as e:
            other = "FFN" if self.role == "attention" else "attention"
            peers = sorted({p for _, p, _ in transfers}) if transfers is not None else self.peers
            names = ", ".join(str(p) for p in peers)
            raise TransferError(f"{where}: the transfer with {other} rank(s) {names} did not complete (a peer that "
                                f"failed or stopped mid-step, or the group's timeout): {e}") from e

    def start(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], *, layer_idx: int = -1,
              stage_idx: int = -1, where: str = "afd", recv_at: tuple[int, int] | None = None) -> list[Any]:
        """Post the transfers of :meth:`exchange` and return their works, not waited on: the
        caller waits (``work.wait()``: on NCCL the current stream waits for the transfer, the host
        does not) and keeps the sent tensors alive until then. The wire-check headers, if on, are
        exchanged (and waited on) first.

        ``recv_at``: the receives' (layer, stage) when they are not the sends' (an FFN rank's
        send and the next layer's receive in one call). With wire checks the sends are posted
        first: the receives' headers come only after the peers have this send's data."""
        sends = [s for s in sends if s[0].numel()]
        recvs = [r for r in recvs if r[0].numel()]
        if recv_at is not None and recvs and self.check_wire:
            return (self.start(sends, [], layer_idx=layer_idx, stage_idx=stage_idx, where=where)
                    + self.start([], recvs, layer_idx=recv_at[0], stage_idx=recv_at[1], where=where))
        if not sends and not recvs:
            return []
        self._count(sends, stage_idx)
        self._count(recvs, stage_idx if recv_at is None else recv_at[1])
        self.bytes_sent += sum(t.numel() * t.element_size() for t, _, _ in sends)
        if self.check_wire:
            self._check_headers(sends, recvs, layer_idx, stage_idx, where)
        ops = [dist.P2POp(dist.isend, t.contiguous(), p, self.group) for t, p, _ in sends]
        ops += [dist.P2POp(dist.irecv, t, p, self.group) for t, p, _ in recvs]
        if self.fixed_slot is not None:
            ops += self._header_ops(sends, recvs, layer_idx, stage_idx, recv_at or (layer_idx, stage_idx))
        works = list(dist.batch_isend_irecv(ops))
        after = (self.ghosts or {}).get(("send" if sends else "recv", layer_idx, max(stage_idx, 0)))
        if after:
            works += self._ghost_stages(after, where, (sends or recvs)[0][0].device)
        return works

    def _ghost_stages(self, steps: Sequence[Any], where: str, device: torch.device) -> list[Any]:
        """The transfers ``steps`` (``slots.WireStep``) of stages this attention rank's program does
        not have: zeros sent, received into buffers never read, each with its stage's header
        (tokens 0), in the FFN rank's order."""
        from .wire import WireSpec

        assert self.fixed_slot is not None
        works = []
        for g in steps:
            bufs = [(self._ghost(g.direction, w.shape(self.fixed_slot), w.dtype, device), self.peers[0], w.kind)
                    for w in WireSpec.parse(g.spec).tensors]
            out, into = (bufs, []) if g.direction == "send" else ([], bufs)
            works += self.start(out, into, layer_idx=g.layer, stage_idx=g.stage,
                                where=f"{where} (stage {g.stage}: none here)")
        return works

    def _ghost(self, direction: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (direction, tuple(shape), dtype, device)
        if key not in self.ghost_buffers:
            self.ghost_buffers[key] = torch.zeros(shape, dtype=dtype, device=device)
        return self.ghost_buffers[key]

    def _header_ops(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], layer_idx: int, stage_idx: int,
                    recv_at: tuple[int, int]) -> list[dist.P2POp]:
        """A fixed slot's headers (runtime/slots.py), after the data they describe: an attention
        rank's send carries its ``header_out`` (and its transfers are logged); an FFN rank
        receives one header per peer it receives from into ``headers_in[recv_at]``."""
        if self.role == "attention":
            self.step_log += [(d, layer_idx, stage_idx) for d, xs in (("send", sends), ("recv", recvs)) if xs]
            assert self.header_out is not None
            head = self.header_out[max(stage_idx, 0)]
            return [dist.P2POp(dist.isend, head, self.peers[0], self.group)] if sends else []
        if not recvs:
            return []
        buf = self.headers_in.get(recv_at)
        if buf is None:
            buf = self.headers_in[recv_at] = torch.zeros(len(self.peers), 2, dtype=torch.int64,
                                                         device=recvs[0][0].device)
        return [dist.P2POp(dist.irecv, buf[self.peers.index(p)], p, self.group)
                for p in dict.fromkeys(p for _, p, _ in recvs)]

    def _count(self, transfers: Sequence[Transfer], stage_idx: int) -> None:
        if transfers:
            self.stage_transfers[stage_idx] = self.stage_transfers.get(stage_idx, 0) + len(transfers)

    def _check_headers(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], layer_idx: int,
                       stage_idx: int, where: str) -> None:
        """Exchange one header per transfer; raise WireMismatch on the first that differs from
        what this rank expects to receive (its own buffer's dtype and shape, layer, stage)."""
        from .wire import HEADER_SLOTS, describe_header, wire_header

        dev = (sends or recvs)[0][0].device
        out = [torch.tensor(wire_header(k, t.dtype, tuple(t.shape), layer_idx, stage_idx), dtype=torch.int64,
                            device=dev) for t, _, k in sends]
        got = [torch.full((HEADER_SLOTS,), -1, dtype=torch.int64, device=dev) for _ in recvs]
        ops = [dist.P2POp(dist.isend, h, p, self.group) for h, (_, p, _) in zip(out, sends, strict=True)]
        ops += [dist.P2POp(dist.irecv, h, p, self.group) for h, (_, p, _) in zip(got, recvs, strict=True)]
        self.wait(dist.batch_isend_irecv(ops), f"{where} (wire check headers)", [*sends, *recvs])
        for h, (t, p, k) in zip(got, recvs, strict=True):
            expected = wire_header(k, t.dtype, tuple(t.shape), layer_idx, stage_idx)
            received = [int(v) for v in h.tolist()]
            if received != expected:
                raise WireMismatch(
                    f"{where}: from peer rank {p}: expected {describe_header(expected)}, received "
                    f"{describe_header(received)}")


_REGISTRY: dict[int, AFDCommunicator] = {}


def register_communicator(comm: AFDCommunicator, comm_id: int = 0) -> int:
    _REGISTRY[comm_id] = comm
    return comm_id


def registered_communicators() -> dict[int, AFDCommunicator]:
    """Every registered communicator, by comm id (a copy)."""
    return dict(_REGISTRY)


def communicator_for(role: str, rank: int, peers: Sequence[int], group: dist.ProcessGroup | None,
                     check_wire: bool, comm_id: int, control_group: dist.ProcessGroup | None = None,
                     finish_at_shutdown: bool = False) -> AFDCommunicator:
    """The communicator registered under ``comm_id`` when it is this one (same role, rank,
    peers, group, checks, shutdown behaviour, not stopped), else a new one, registered. The
    backend compiles one program per graph (a prefill and a decode graph under ``generate()``);
    they share one communicator, so the per-step token counts the runtime sets are the ones every
    op reads."""
    old = _REGISTRY.get(comm_id)
    if (old is not None and not old.stopped
            and (old.role, old.rank, old.peers, old.group, old.check_wire, old.control_group, old.finish_at_shutdown)
            == (role, rank, tuple(peers), group, check_wire, control_group, finish_at_shutdown)):
        return old
    comm = AFDCommunicator(role, rank, tuple(peers), group, check_wire=check_wire, control_group=control_group,
                           finish_at_shutdown=finish_at_shutdown)
    register_communicator(comm, comm_id)
    return comm


def unregister_communicator(comm_id: int) -> None:
    _REGISTRY.pop(comm_id, None)


def get_communicator(comm_id: int) -> AFDCommunicator:
    try:
        return _REGISTRY[comm_id]
    except KeyError:
        raise KeyError(
            f"afd: unknown communicator id {comm_id} (registered ids: {sorted(_REGISTRY)}); "
            "register one with afd_compile.comm.register_communicator before running a split program"
        ) from None


# --- process groups for the scatter-mode collectives, looked up by integer id ----------------

#: Group ids the TP rewrite uses: the whole TP group, and this rank's attention TP group; and an
#: AFD FFN rank's FFN TP group (passes/ffn_tp.py); the group the TP ranks' per-step token counts
#: travel on (runtime.dp_step_counts: a gloo group beside the TP group, runtime.control_group).
GROUP_TP, GROUP_ATTN_TP, GROUP_FFN_TP, GROUP_TP_CONTROL = 0, 1, 2, 3
_GROUPS: dict[int, dist.ProcessGroup | None] = {}


def register_group(group_id: int, group: dist.ProcessGroup | None) -> int:
    """``None`` means the default (world) group."""
    _GROUPS[group_id] = group
    return group_id


def get_group(group_id: int) -> dist.ProcessGroup | None:
    if group_id not in _GROUPS:
        raise KeyError(f"afd: unknown process group id {group_id} (registered: {sorted(_GROUPS)}); "
                       "the runtime registers groups before running a sharded program")
    return _GROUPS[group_id]


@dataclass
class TPStep:
    """Per-step token counts of the attention DP groups (one entry per group), known to every
    TP rank before the program runs (one small all-gather per step), and this rank's group."""

    attn_dp_rank: int
    counts: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def offset(self) -> int:
        return sum(self.counts[: self.attn_dp_rank])

    @property
    def own(self) -> int:
        return self.counts[self.attn_dp_rank]


#: the token counts of the step running now (one per micro-batch stage): set for the duration of
#: one program call by :func:`step_counts`, read by the token collectives
_STEP_COUNTS: contextvars.ContextVar[tuple[TPStep, ...]] = contextvars.ContextVar("afd_step_counts", default=())


@contextmanager
def step_counts(step: TPStep | Sequence[TPStep]) -> Iterator[None]:
    """This step's DP / FFN-group token counts for the program run inside the block (a sequence:
    one per micro-batch stage, an FFN group's staged program). The runtime opens it around each
    program call whose token collectives need them; nothing outlives the step."""
    token = _STEP_COUNTS.set((step,) if isinstance(step, TPStep) else tuple(step))
    try:
        yield
    finally:
        _STEP_COUNTS.reset(token)


def get_tp_step(where: str, stage: int = 0) -> TPStep:
    """Stage ``stage``'s counts of the step running now (``where``: the op asking, for the error)."""
    steps = _STEP_COUNTS.get()
    if stage >= len(steps) or not steps[stage].counts:
        raise RuntimeError(f"{where}: no per-step DP token counts for stage {stage} (given for {len(steps)} "
                           "stage(s)); run the program inside afd_compile.comm.step_counts(...), as the runtime's "
                           "workers do")
    return steps[stage]
