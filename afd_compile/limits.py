"""Bounds on run settings, shared by the CLI (which must not import torch to parse its flags)
and the runtime."""

from __future__ import annotations

import os

from .errors import AFDCompileError

#: the longest timeout a run takes, in seconds (a week): torch's timedelta and gloo's millisecond
#: timers overflow far above (``--timeout 1e300`` raised OverflowError inside a rank)
MAX_TIMEOUT_S = 7 * 24 * 3600.0


class LaunchConfigError(AFDCompileError):
    """An environment setting of the local launcher is not usable (the variable and its value)."""


def local_process_override() -> int | None:
    """``AFD_MAX_LOCAL_PROCESSES`` as an integer >= 1, None when unset; LaunchConfigError else."""
    env = os.environ.get("AFD_MAX_LOCAL_PROCESSES")
    if env is None:
        return None
    try:
        n = int(env)
    except ValueError:
        n = 0
    if n < 1:
        raise LaunchConfigError(f"AFD_MAX_LOCAL_PROCESSES must be an integer >= 1, got {env!r}")
    return n
