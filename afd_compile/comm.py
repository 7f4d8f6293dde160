"""Communicators for the AFD custom ops, looked up by integer id.

A custom op cannot capture a Python object, so each op takes a ``comm_id`` and finds its
:class:`AFDCommunicator` in a process-wide registry. The communicator knows this rank's role, its
peers (an attention rank has one FFN peer; an FFN rank owns a contiguous block of attention peers),
the transport (gloo on CPU, NCCL on CUDA) and the per-step transfer metadata (per-peer token
counts), which the runtime learns once per step from a small control message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


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


@dataclass
class AFDCommunicator:
    """This rank's view of the AFD exchange.

    ``peers`` are world ranks: for an attention rank, ``[its FFN rank]``; for an FFN rank, its
    attention peers in order. ``step_seq_lens[stage]`` holds the token count per peer for the
    current step (set by the runtime before the program runs).
    """

    role: str
    rank: int
    peers: tuple[int, ...]
    group: dist.ProcessGroup | None = None
    step_seq_lens: dict[int, tuple[int, ...]] = field(default_factory=dict)

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

    def metadata(self, layer_idx: int, stage_idx: int) -> TransferMetadata:
        if stage_idx not in self.step_seq_lens:
            raise RuntimeError(
                f"afd: {self.role} rank {self.rank} has no token counts for stage {stage_idx} "
                f"(layer {layer_idx}); the runtime must call set_step() before running a program"
            )
        return TransferMetadata(layer_idx, stage_idx, self.step_seq_lens[stage_idx])

    def set_step(self, seq_lens_per_stage: dict[int, Sequence[int]]) -> None:
        self.step_seq_lens = {s: tuple(int(n) for n in v) for s, v in seq_lens_per_stage.items()}

    def exchange(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
    ) -> None:
        """Send and receive in one batched call and wait for all of it.

        Batched so that cross-rank order comes from one call, not from source order (DESIGN §8);
        waited on before returning so no buffer is reused while in flight. Zero-length tensors
        are skipped on both sides (both sides know the counts).
        """
        ops = [dist.P2POp(dist.isend, t.contiguous(), p, self.group) for t, p in sends if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, p, self.group) for t, p in recvs if t.numel()]
        if not ops:
            return
        for work in dist.batch_isend_irecv(ops):
            work.wait()


_REGISTRY: dict[int, AFDCommunicator] = {}


def register_communicator(comm: AFDCommunicator, comm_id: int = 0) -> int:
    _REGISTRY[comm_id] = comm
    return comm_id


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

#: Group ids the TP rewrite uses: the whole TP group, and this rank's attention TP group.
GROUP_TP, GROUP_ATTN_TP = 0, 1
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


_TP_STEP: list[TPStep] = []


def set_tp_step(step: TPStep) -> None:
    _TP_STEP[:] = [step]


def get_tp_step(where: str) -> TPStep:
    if not _TP_STEP or not _TP_STEP[0].counts:
        raise RuntimeError(f"{where}: no per-step DP token counts; the runtime must call set_tp_step() first")
    return _TP_STEP[0]
