"""Bounds on run settings, shared by the CLI (which must not import torch to parse its flags)
and the runtime."""

from __future__ import annotations

import argparse
import math
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


def positive_seconds(text: str) -> float:
    """``--timeout``: finite seconds in (0, :data:`MAX_TIMEOUT_S`] (argparse's one-line error else)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    if v > MAX_TIMEOUT_S:  # torch's timedelta and gloo's milliseconds overflow far above
        raise argparse.ArgumentTypeError(f"must be at most {MAX_TIMEOUT_S:.0f} seconds (a week), got {text!r}")
    return v


class TokensError(AFDCompileError):
    """``--tokens`` that no run can take (checked from the flag alone, before anything is loaded)."""


def parse_tokens(text: str | None) -> list[int] | None:
    """``--tokens B1,B2,...``: batch sizes (sequences) per attention rank or DP group, each >= 0
    and not all 0; None when not given. The checks that need the program (its batch range) come
    after it is loaded (``verify_inputs.check_verify_inputs``)."""
    if text is None:
        return None
    if not text.strip():
        raise TokensError("--tokens is empty: give one batch size per attention rank (or DP group), e.g. --tokens 2,3")
    try:
        sizes = [int(t) for t in text.split(",")]
    except ValueError:
        raise TokensError(f"--tokens must be comma-separated integers, got {text!r}") from None
    if any(b < 0 for b in sizes):
        raise TokensError(f"--tokens {sizes}: a batch size (sequences) is >= 0")
    if not any(sizes):
        raise TokensError(f"--tokens {sizes}: every batch size is 0, so nothing would be compared; give one >= 1")
    return sizes
