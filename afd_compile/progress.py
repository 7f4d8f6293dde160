"""Progress lines for long CLI work: one line per finished phase, with the time since the command
started and the phase's own time, on stderr (stdout keeps the plan, the JSON and the verdict)::

    afd-compile verify: [  9.8s] loaded and planned llama.pt2 (9.8s)
    afd-compile verify: [ 14.1s] 3 processes up, programs built (rank 2)
    afd-compile verify: [ 15.0s] step 1/2 done (rank 2)

``quiet`` silences them. Worker processes report through :func:`afd_compile.runtime.progress`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO


class Progress:
    def __init__(self, prefix: str, quiet: bool = False, stream: TextIO | None = None) -> None:
        """``prefix`` starts each line (``afd-compile verify``, ``afd_torchrun``)."""
        self.prefix = prefix
        self.quiet = quiet
        self.stream = stream
        self.start = time.perf_counter()

    def line(self, text: str) -> None:
        if self.quiet:
            return
        stream = self.stream or sys.stderr
        print(f"{self.prefix}: [{time.perf_counter() - self.start:6.1f}s] {text}", file=stream, flush=True)

    @contextmanager
    def phase(self, what: str) -> Iterator[None]:
        """A line when the block ends: ``what (seconds)``; nothing if it raises (the error says it)."""
        t = time.perf_counter()
        yield
        self.line(f"{what} ({time.perf_counter() - t:.1f}s)")

    def rank(self, rank: int, text: str) -> None:
        """A line a worker process reported."""
        self.line(f"{text} (rank {rank})")
