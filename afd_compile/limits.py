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

#: the most ranks a layout has (world size): far past any deployment, and every loop over ranks
#: (peer maps, groups, per-rank batch lists) stays cheap below it
MAX_RANKS = 65536
#: the most micro-batch stages a step takes (the systems we generalise use 2-4): each stage is a
#: copy of the program's nodes, so S sizes the staged program
MAX_STAGES = 64
#: the most steps a verify runs (each step is a forward on every rank)
MAX_STEPS = 100_000
#: the largest batch (sequences) verify gives an attention rank or DP group
MAX_BATCH = 1 << 20
#: a .pt2 member (its graph, weights, constants) read whole is at most this many bytes unpacked
MAX_MEMBER_BYTES = 1 << 30


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


class BoundError(AFDCompileError):
    """A count that sizes work or memory outside its bounds, or not an integer."""


def bounded_int(name: str, value: object, lo: int, hi: int) -> int:
    """``value`` as an int in ``[lo, hi]`` (a bool is not an int); :class:`BoundError` naming
    ``name`` else. Checked before anything is sized by it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise BoundError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if not lo <= value <= hi:
        raise BoundError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def count_flag(lo: int, hi: int):
    """An argparse ``type``: an integer in ``[lo, hi]`` (argparse's one-line error, exit 2)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {text}")
        return v

    parse.__name__ = "integer"  # (argparse names the type in "invalid integer value")
    return parse


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
    if len(sizes) > MAX_RANKS:
        raise TokensError(f"--tokens gives {len(sizes)} batch sizes: at most one per attention rank ({MAX_RANKS})")
    if any(b < 0 for b in sizes):
        raise TokensError(f"--tokens {sizes}: a batch size (sequences) is >= 0")
    if max(sizes) > MAX_BATCH:
        raise TokensError(f"--tokens: a batch size is at most {MAX_BATCH} sequences, got {max(sizes)}")
    if not any(sizes):
        raise TokensError(f"--tokens {sizes}: every batch size is 0, so nothing would be compared; give one >= 1")
    return sizes
