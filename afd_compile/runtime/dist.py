"""Process groups: joining the world (env:// as torchrun sets it), groups created once per
process, and the groups a TP layout's collectives need."""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..errors import AFDCompileError
from ..scatter import TPLayout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchError(AFDCompileError):
    """A script started the wrong way: not under torchrun, or with another number of processes
    than its layout needs."""


#: what torchrun sets for every process (env://)
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_launch(needed: int | None, what: str, command: str) -> tuple[int, int]:
    """(rank, world size) from torchrun's environment, checked before anything is built: a
    :class:`LaunchError` naming the command to run when the script was not started by torchrun,
    or when ``needed`` (the processes ``what`` needs; None: any) differs from the world size."""
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    n = needed if needed is not None else "N"
    if missing:
        raise LaunchError(f"{command.split()[0]}: start it with torchrun (no {', '.join(missing)} in the environment): "
                          f"torchrun --nproc-per-node {n} {command}")
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise LaunchError(
            f"RANK={os.environ['RANK']!r} / WORLD_SIZE={os.environ['WORLD_SIZE']!r}: not integers"
        ) from None
    if needed is not None and world != needed:
        raise LaunchError(
            f"{what} needs {needed} processes, torchrun started {world}: torchrun --nproc-per-node {needed} {command}"
        )
    return rank, world


def report_launch_error(script: str, error: Exception) -> int:
    """A script's launch, option or refused-graph error, said once: rank 0 (or a process outside
    torchrun) prints ``<script>: error: ...`` on stderr; the other ranks wait a little first, so
    torchrun ends them when rank 0 exits rather than ending rank 0 before it printed, and print it
    (``rank r:``) only if still running then (an error of their own that rank 0 did not meet).
    Returns the exit status, 2."""
    import sys
    import time

    rank = os.environ.get("RANK", "0")
    if rank != "0":
        time.sleep(5)
    print(f"{script}: error: {'' if rank == '0' else f'rank {rank}: '}{error}", file=sys.stderr, flush=True)
    return 2


def init_distributed(
    rank: int | None = None, world_size: int | None = None, backend: str | None = None, timeout_s: float = 120.0
) -> tuple[int, int]:
    """Join the process group (env:// as torchrun sets it). gloo on CPU, NCCL when CUDA is used.
    Outside torchrun (no ``RANK`` / ``WORLD_SIZE`` given or set): :class:`LaunchError`."""
    if (rank is None or world_size is None) and not dist.is_initialized():
        import sys

        env_rank, env_world = check_launch(None, "", " ".join(sys.argv) or "SCRIPT")
        rank = env_rank if rank is None else rank
        world_size = env_world if world_size is None else world_size
    rank = dist.get_rank() if rank is None else rank
    world_size = dist.get_world_size() if world_size is None else world_size
    backend = backend or ("nccl" if torch.cuda.is_available() and os.environ.get("AFD_BACKEND") != "gloo" else "gloo")
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
    return rank, world_size


#: process groups created by :func:`process_group`, by (ranks, timeout, backend): created once per process
_GROUPS: dict[tuple[tuple[int, ...], float | None, str | None], dist.ProcessGroup] = {}


def process_group(
    ranks: Sequence[int], timeout_s: float | None = None, backend: str | None = None
) -> dist.ProcessGroup:
    """A process group over ``ranks`` (with ``timeout_s``, else the default timeout; ``backend``,
    else the world's), created once per process and reused: the backend compiles per graph, and a
    new group per compile would open new communicators each time. Every rank of the world must
    ask in the same order (``new_group`` is collective); :func:`shutdown` forgets them."""
    key = (tuple(ranks), timeout_s, backend)
    if key not in _GROUPS:
        kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        _GROUPS[key] = group = dist.new_group(list(ranks), backend=backend, **kw)
        if group is not dist.GroupMember.NON_GROUP_MEMBER:  # (one object for every group a rank is not in)
            _MADE[id(group)] = (tuple(ranks), timeout_s)
    return _GROUPS[key]


#: (ranks, timeout) of each group :func:`process_group` made, by id: what :func:`group_key` says
_MADE: dict[int, tuple[tuple[int, ...], float | None]] = {}


def group_key(group: dist.ProcessGroup | None) -> tuple[tuple[int, ...], float | None]:
    """The world ranks of ``group`` (None: the world) and the timeout it was made with (None:
    the default): as :func:`process_group` was asked for it, so that every rank, member or not,
    names it alike; a group made elsewhere is read (this rank must be in it)."""
    if group is None or group is dist.group.WORLD:
        pg, ranks = dist.group.WORLD, tuple(range(dist.get_world_size()))
    elif id(group) in _MADE:
        return _MADE[id(group)]
    else:
        pg, ranks = group, tuple(dist.get_process_group_ranks(group))
    for device in ("cpu", "cuda"):
        try:
            return ranks, pg._get_backend(torch.device(device)).options._timeout.total_seconds()
        except (RuntimeError, AttributeError, ValueError):
            continue
    return ranks, None


def control_group(ranks: Sequence[int], timeout_s: float | None = None) -> dist.ProcessGroup:
    """The gloo group over ``ranks`` (with ``timeout_s``) that control messages travel on beside
    the group of those ranks that moves the data (:func:`group_key` names it): host tensors, so an
    FFN rank learns a step's per-peer slots without a device-to-host wait when the data group is
    NCCL (a read on an NCCL group waits for everything queued on the stream before it, so the FFN
    rank could not queue a step before its last one finished). Collective like
    :func:`process_group`: every rank of the world asks in the same order."""
    return process_group(ranks, timeout_s, "gloo")


def forget_groups() -> None:
    """Forget the groups :func:`process_group` made (the process group is being destroyed)."""
    _GROUPS.clear()
    _MADE.clear()


def tp_groups(world: int, layouts: Sequence[TPLayout], timeout_s: float | None = None) -> dict:
    """Every process group the cases need, created in the same order on every rank; with
    ``timeout_s`` each is a new group with that timeout (else the world group where it fits).
    A layout with attention DP groups also gets the gloo group its per-step token counts travel
    on (``("control", tp)``, :func:`control_group`)."""
    groups: dict = {}
    for lay in layouts:
        key = ("tp", lay.tp)
        if key not in groups:
            whole = lay.tp == world and timeout_s is None
            groups[key] = dist.group.WORLD if whole else process_group(range(lay.tp), timeout_s)
        if lay.attn_dp > 1 and ("control", lay.tp) not in groups:
            whole = groups[key] is dist.group.WORLD  # (named alike on a rank outside the TP group)
            groups[("control", lay.tp)] = control_group(*(group_key(None) if whole else (range(lay.tp), timeout_s)))
        for g in range(lay.attn_dp):
            ranks = tuple(range(g * lay.attn_tp, (g + 1) * lay.attn_tp))
            k = ("attn", ranks)
            if k not in groups:
                groups[k] = groups[key] if lay.attn_tp == lay.tp else process_group(ranks, timeout_s)
    return groups


def register_tp_groups(groups: dict, layout: TPLayout, rank: int) -> None:
    """Register the groups of ``tp_groups`` that rank ``rank`` of ``layout`` runs with: its TP
    group, its attention TP group, and the group its per-step token counts travel on (the TP
    group itself when ``layout`` has no attention DP groups)."""
    from ..comm import GROUP_ATTN_TP, GROUP_TP, GROUP_TP_CONTROL, register_group

    register_group(GROUP_TP, groups[("tp", layout.tp)])
    register_group(GROUP_ATTN_TP, groups[("attn", layout.attn_tp_group(rank))])
    register_group(GROUP_TP_CONTROL, groups.get(("control", layout.tp), groups[("tp", layout.tp)]))


class PeerRefused(AFDCompileError):
    """Another rank refused what every rank was building (its line, naming it): this rank stops
    too, at once, instead of waiting on that rank in a collective until the timeout."""


#: how often :func:`agree` looks at the store while it waits
_AGREE_POLL_S = 0.05


def agree(tag: str, refusal: str | None, timeout_s: float) -> None:
    """Every rank of the world posts its outcome of ``tag`` (None: built; else its refusal's
    line) to the process group's store, then (when it built) waits for every other rank's: a
    refusal of any rank is raised here as :class:`PeerRefused` naming that rank and its line, on
    every rank, before any of them makes a process group the refusing rank would never join. A
    rank not heard from within ``timeout_s`` is an error naming it. Every rank calls it with the
    same ``tag`` once (a refusing rank posts and returns: it raises its own error)."""
    import time

    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    store.set(f"afd/agree/{tag}/{rank}", "ok" if refusal is None else "refused:" + refusal)
    if refusal is not None:
        return
    pending, end = [r for r in range(world) if r != rank], time.monotonic() + timeout_s
    while pending:
        for r in list(pending):
            key = f"afd/agree/{tag}/{r}"
            try:
                if not store.check([key]):
                    continue
                value = store.get(key).decode()
            except dist.DistError as e:  # (the rank holding the store ended: it refused, or failed)
                raise PeerRefused(f"the store went away while rank {rank} waited for ranks {pending} to say whether "
                                  f"they built their programs ({tag}): a rank ended, its own error says why "
                                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); rank {rank} "
                                  "stops too") from None
            if value.startswith("refused:"):
                raise PeerRefused(f"rank {r} refused it ({value[len('refused:') :]}); rank {rank} stops too")
            pending.remove(r)
        if pending:
            if time.monotonic() > end:
                raise PeerRefused(
                    f"ranks {pending} did not report within {timeout_s:.0f}s whether they built their "
                    f"programs ({tag}); rank {rank} stops"
                )
            time.sleep(_AGREE_POLL_S)
