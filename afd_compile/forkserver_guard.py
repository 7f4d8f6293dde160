"""Imported by the forkserver of local runs, and only there (``runtime.WORKER_PRELOAD`` lists
it): the server exits when the process that started it (the CLI, a test, a script) dies, however
it died (SIGKILL included). Its launcher and the launcher's ranks die with it in turn (each gets
SIGKILL when its parent dies: ``runtime._die_with_parent``), so no process of a run outlives the
process that asked for it. Python's forkserver alone stays up while a child of it still runs.

A thread polls the parent pid (not ``PR_SET_PDEATHSIG``, which fires when the parent *thread*
that started the server ends: a caller's worker thread). Do not import this module elsewhere:
it ends the process that imports it when that process's parent dies.
"""

from __future__ import annotations

import os
import threading
import time

POLL_S = 0.2


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os._exit(1)


threading.Thread(target=_watch, args=(os.getppid(),), name="afd-forkserver-guard", daemon=True).start()
