"""``afd-compile ARGS`` run in the test process: ``afd_compile.cli.main`` with its stdout and stderr
captured, the exit status as the console script returns it. A subprocess pays the torch import
(and its ranks their forkserver's) again on every call; the tests that are about the process itself
(``--help`` without torch, the README's quick start, a rewritten program in a fresh process) still
start one."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass


@dataclass
class Ran:
    """What a ``subprocess.run(..., capture_output=True, text=True)`` would have returned."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(*args: str) -> Ran:
    from afd_compile.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 2
    return Ran(code, out.getvalue(), err.getvalue())
