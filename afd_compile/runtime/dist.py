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
        raise LaunchError(f"RANK={os.environ['RANK']!r} / WORLD_SIZE={os.environ['WORLD_SIZE']!r}: not integers") from None
    if needed is not None and world != needed:
        raise LaunchError(f"{what} needs {needed} processes, torchrun started {world}: "
                          f"torchrun --nproc-per-node {needed} {command}")
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


def init_distributed(rank: int | None = None, world_size: int | None = None, backend: str | None = None,
                     timeout_s: float = 120.0) -> tuple[int, int]:
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
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world_size


#: process groups created by :func:`process_group`, by (ranks, timeout): created once per process
_GROUPS: dict[tuple[tuple[int, ...], float | None], dist.ProcessGroup] = {}


def process_group(ranks: Sequence[int], timeout_s: float | None = None) -> dist.ProcessGroup:
    """A process group over ``ranks`` (with ``timeout_s``, else the default timeout), created once
    per process and reused: the backend compiles per graph, and a new group per compile would
    open new communicators each time. Every rank must ask in the same order (``new_group`` is
    collective); :func:`shutdown` forgets them."""
    key = (tuple(ranks), timeout_s)
    if key not in _GROUPS:
        kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        _GROUPS[key] = dist.new_group(list(ranks), **kw)
    return _GROUPS[key]


def forget_groups() -> None:
    """Forget the groups :func:`process_group` made (the process group is being destroyed)."""
    _GROUPS.clear()


def tp_groups(world: int, layouts: Sequence[TPLayout], timeout_s: float | None = None) -> dict:
    """Every process group the cases need, created in the same order on every rank; with
    ``timeout_s`` each is a new group with that timeout (else the world group where it fits)."""
    groups: dict = {}
    for lay in layouts:
        key = ("tp", lay.tp)
        if key not in groups:
            whole = lay.tp == world and timeout_s is None
            groups[key] = dist.group.WORLD if whole else process_group(range(lay.tp), timeout_s)
        for g in range(lay.attn_dp):
            ranks = tuple(range(g * lay.attn_tp, (g + 1) * lay.attn_tp))
            k = ("attn", ranks)
            if k not in groups:
                groups[k] = groups[key] if lay.attn_tp == lay.tp else process_group(ranks, timeout_s)
    return groups
