"""An attention rank's per-step control messages to its FFN rank (runtime/protocol.py): its
token count, STOP, FAILED; and how a rank tells its FFN rank it is done (:func:`finish`). Under a
fixed slot (runtime/slots.py) a stop and a failure travel in band instead."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..comm import AFDCommunicator
from ..errors import AFDCompileError
from . import slots

log = logging.getLogger("afd_compile.runtime")

STOP = -1
#: the token count of a control message an attention rank sends when its step raised: its FFN
#: rank ends at once, naming it, instead of waiting on it until the timeout
FAILED = -2

#: failure notices in flight (isend works kept alive until the process ends)
_NOTICES: list = []


def send_control(comm: AFDCommunicator, n: int, stage_counts: Sequence[int] | None = None) -> None:
    """An attention rank's per-step control message to its FFN rank: ``[tokens, flags]``
    (``tokens`` = :data:`STOP`: this rank is done; it sends nothing after it), ``flags`` = the
    wire checks (bit 0) and the micro-batch stages - 1 (bits 1 and up; 0 for one stage, so a
    one-stage message is what it always was); with 2 or more stages a second message follows
    with the tokens of each stage."""
    if comm.role != "attention":
        raise ValueError(f"afd: rank {comm.rank} is an FFN rank; only attention ranks send control messages")
    if comm.stopped:
        raise ControlError(f"afd: attention rank {comm.rank} already told FFN rank {comm.peers[0]} it stopped; "
                           "it cannot run another step (a new deployment needs a new comm_id)")
    dev, group = comm.control_device, comm.control_peer_group
    stages = len(stage_counts) if stage_counts is not None else 1
    flags = int(comm.check_wire) | (stages - 1) << 1
    if comm.fixed_slot is not None:  # (a fixed slot tells only a STOP, in band: a step of zeros)
        if n != STOP:
            raise ControlError(f"afd: attention rank {comm.rank} sends its fixed slot's counts in the headers of its "
                               f"transfers; a control message can only say STOP ({STOP}), got {n}")
        comm.step_log.clear()
        slots.owe(comm, STOP, flags)
        comm.stopped = True
        return
    dist.send(torch.tensor([n, flags], dtype=torch.int64, device=dev), comm.peers[0], group=group)
    if n == STOP:
        comm.stopped = True
    elif stages > 1:
        dist.send(torch.tensor(list(stage_counts), dtype=torch.int64, device=dev), comm.peers[0], group=group)


def tell_failed(comm: AFDCommunicator) -> None:
    """An attention rank whose step raised: send :data:`FAILED` to its FFN rank, without waiting
    (the FFN rank may be mid-step and never take it), on a control group of host tensors only (a
    device send on an error path could wait behind the failed step's work). An FFN rank reading
    its control messages ends at once naming this rank; one blocked on this step's data (gloo)
    still waits until its timeout. This rank sends nothing after it."""
    if comm.stopped or comm.role != "attention" or not dist.is_initialized():
        return
    if comm.fixed_slot is not None:  # in band: the rest of the step (or a whole one) in zeros, saying FAILED
        comm.stopped = True
        if len(comm.step_log) == len(comm.schedule):  # (no transfer of the step made, or all of it)
            comm.step_log.clear()
        try:
            slots.owe(comm, FAILED, 0)
        except Exception as e:  # a transfer of the step failed (the peer gone): nothing more to tell
            log.warning("afd: attention rank %d could not tell FFN rank %d its step failed: %s", comm.rank,
                        comm.peers[0], e)
        return
    if comm.control_device != "cpu":
        return
    comm.stopped = True
    try:
        _NOTICES.append(dist.isend(torch.tensor([FAILED, 0], dtype=torch.int64), comm.peers[0],
                                   group=comm.control_peer_group))
    except Exception as e:  # the peer already gone: nothing to tell
        log.warning(
            "afd: attention rank %d could not tell FFN rank %d its step failed: %s", comm.rank, comm.peers[0], e
        )


def finish(comm_id: int | None = None, *, at_shutdown: bool = False) -> list[int]:
    """Attention rank: tell the FFN rank(s) this rank is done (one STOP per AFD communicator, or
    only ``comm_id``'s), so :func:`serve` on them returns once every peer has finished. Call it
    after the last step (``generate()`` returned); :func:`shutdown` calls it for the backend's
    communicators not stopped yet (``at_shutdown``). Returns the comm ids stopped; a communicator
    already stopped (or an FFN one) is skipped."""
    from ..comm import registered_communicators

    done = []
    for cid, comm in sorted(registered_communicators().items()):
        if at_shutdown and not comm.finish_at_shutdown:
            continue
        if (comm_id is None or cid == comm_id) and comm.role == "attention" and not comm.stopped:
            send_control(comm, STOP)
            done.append(cid)
    return done


class ControlError(AFDCompileError):
    """A per-step control message an FFN rank cannot accept."""
