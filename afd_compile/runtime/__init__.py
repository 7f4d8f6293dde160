"""Run programs on ``torch.distributed``: locally (forked processes) or under torchrun. The
runtime only runs programs; what a rank runs is built by :mod:`afd_compile.deploy`.

- :mod:`.dist`: joining the process group, groups created once per process, TP layouts' groups;
- :mod:`.protocol`: the AFD workers (an attention rank's step, an FFN rank's serve loop), their
  per-step control messages, and leaving cleanly (:func:`shutdown`); :mod:`.slots`: the fixed
  slot, whose counts travel on the device instead; :mod:`.tokens`: a step's token count;
  :mod:`.tp`: a TP rank as it runs;
- :mod:`.launch`: local runs (:func:`run_local`): a forkserver, a launcher, the ranks, and the
  supervision that names the first process that failed.

Under ``torchrun`` a script calls :func:`init_distributed` (``RANK`` / ``WORLD_SIZE`` from the
environment), builds its rank's worker with :func:`afd_compile.deploy.make_worker`, runs it and
calls :func:`shutdown`.
"""

from __future__ import annotations

from .control import FAILED, STOP, ControlError, finish, send_control, tell_failed
from .dist import (
    LaunchError,
    PeerRefused,
    agree,
    check_launch,
    control_group,
    free_port,
    group_key,
    init_distributed,
    process_group,
    register_tp_groups,
    report_launch_error,
    tp_groups,
)
from .launch import (
    LOCAL_PROCESS_BYTES,
    LOCAL_PROCESS_LIMIT_RULE,
    PEER_GONE,
    WORKER_PRELOAD,
    WORKER_PRELOAD_IF_IMPORTED,
    LauncherFailure,
    RankFailure,
    RunFault,
    max_local_processes,
    progress,
    run_local,
)
from .protocol import (
    AttentionWorker,
    FFNWorker,
    before_destroy,
    serve_at_shutdown,
    shutdown,
    step_failed,
)
from .tokens import GroupSlice, TokenCount
from .tp import TPRank, dp_step_counts

__all__ = [
    "LaunchError", "PeerRefused", "agree", "TPRank", "check_launch", "report_launch_error",
    "LOCAL_PROCESS_BYTES", "LOCAL_PROCESS_LIMIT_RULE", "PEER_GONE", "STOP", "FAILED", "WORKER_PRELOAD",
    "WORKER_PRELOAD_IF_IMPORTED", "AttentionWorker", "ControlError", "FFNWorker", "GroupSlice", "LauncherFailure",
    "RankFailure", "RunFault", "TokenCount", "dp_step_counts", "serve_at_shutdown", "finish", "free_port",
    "init_distributed", "max_local_processes", "process_group", "control_group", "progress", "run_local",
    "send_control", "shutdown", "step_failed", "before_destroy", "tell_failed", "tp_groups", "register_tp_groups",
    "group_key",
]
