"""Timing the passes of a pipeline: seconds per pass, in the order they ran.

``afd_compile.portable.run`` times each pass of a rank's pipeline through the rank's
:class:`PassTimings`; the split and TP results carry the seconds, and the CLI's ``--timings``
and ``benchmarks/pass_time.py`` print them::

    timings = PassTimings()
    with timings("annotate_roles"):
        annotate_roles(gm, ...)
    print(timings.table())
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class PassTimings:
    """Seconds per named pass (a name timed twice adds up); ``log`` is told when a pass ends."""

    def __init__(self, log: Callable[[str], None] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.log = log

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t
            self.seconds[name] = self.seconds.get(name, 0.0) + dt
            if self.log is not None:
                self.log(f"pass {name}: {dt:.3f}s")

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def table(self) -> str:
        return timings_table(self.seconds)


def timings_table(seconds: dict[str, float]) -> str:
    """One line per pass and a total, as ``--timings`` prints them."""
    width = max([len(n) for n in seconds] + [5])
    rows = [f"{'pass'.ljust(width)}  seconds"]
    rows += [f"{n.ljust(width)}  {s:.3f}" for n, s in seconds.items()]
    rows.append(f"{'total'.ljust(width)}  {sum(seconds.values()):.3f}")
    return "\n".join(rows)
