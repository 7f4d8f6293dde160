"""The output folder of ``afd-compile rewrite``: written whole or not at all, and never a folder
the user did not ask to replace.

What ``-o PATH`` may name (each refusal is a :class:`OutputError`, one line, before any work):

- not an empty path (``""`` is the current directory), not the current directory or a folder
  holding it, not a folder holding an input file (``-o .`` next to ``model.pt2``), after
  symbolic links are resolved (a link is followed: the folder it names is what is replaced);
- a new path, an empty folder, or, with ``--force``, a folder that ``rewrite`` wrote: its
  ``plan.json`` carries :data:`MARKER` and it holds nothing but the files that plan names.

Writing goes into a temporary sibling ``.NAME.tmp-PID-XXXX`` renamed over the target at the end;
any exception while writing (a full disk raises ``RuntimeError`` from torch's archive writer, not
``OSError``), ``KeyboardInterrupt`` or ``SystemExit`` (SIGTERM, see :func:`exit_on_sigterm`)
removes it. A sibling left by a run that was killed outright (SIGKILL) is removed by the next
run into the same target, which says so on stderr.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

from .errors import AFDCompileError

#: the field of plan.json that says a folder was written by ``rewrite`` (what ``--force`` may replace)
MARKER = ("written_by", "afd-compile rewrite")


class OutputError(AFDCompileError):
    """The output folder cannot or may not be written (the path and the reason)."""


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def rewrite_files(folder: str) -> set[str] | None:
    """The entries a rewrite wrote into ``folder`` (plan.json and the programs it names), or None
    when its plan.json does not carry :data:`MARKER`."""
    try:
        with open(os.path.join(folder, "plan.json")) as f:
            plan = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(plan, dict) or plan.get(MARKER[0]) != MARKER[1]:
        return None
    return {"plan.json", *plan.get("sha256", {})}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputFolder:
    """``with OutputFolder(path, force, inputs) as tmp:`` write into ``tmp``; on success it replaces
    ``path``. Checks the target at construction (see the module docstring)."""

    def __init__(self, path: str, force: bool, inputs: Sequence[str] = ()) -> None:
        if not path.strip():
            raise OutputError("-o: an empty path (it would name the current directory); give the new folder's name")
        self.shown = path
        self.target = os.path.realpath(path)  # a symbolic link is followed: its folder is the one replaced
        via = "" if self.target == os.path.abspath(path) else f" (a link to {self.target})"
        cwd = os.path.realpath(os.getcwd())
        if _inside(cwd, self.target):
            what = "the current directory" if cwd == self.target else f"a folder holding the current directory {cwd}"
            raise OutputError(f"-o {path}{via}: is {what}; rewrite replaces its output folder whole: give a new folder")
        for inp in inputs:
            if _inside(os.path.realpath(inp), self.target):
                raise OutputError(f"-o {path}{via}: holds the input {inp}; rewrite replaces its output folder whole: "
                                  "give a folder that does not hold the input")
        if os.path.lexists(self.target):
            if not os.path.isdir(self.target):
                raise OutputError(f"-o {path}{via}: exists and is not a folder")
            try:
                entries = set(os.listdir(self.target))
            except OSError as e:
                raise OutputError(f"-o {path}: cannot read the folder: {e.strerror or e}") from None
            if entries and not force:
                raise OutputError(f"-o {path}{via}: the folder exists and is not empty; pass --force to replace it "
                                  "whole (only a folder rewrite wrote)")
            if entries:
                ours = rewrite_files(self.target)
                if ours is None:
                    raise OutputError(f"-o {path}{via}: --force replaces only a folder rewrite wrote (its plan.json "
                                      f"says {MARKER[0]}: {MARKER[1]!r}); this one is not: remove it yourself or "
                                      "give another folder")
                if entries - ours:
                    raise OutputError(f"-o {path}{via}: holds files rewrite did not write "
                                      f"({', '.join(sorted(entries - ours))}); --force would delete them: move them "
                                      "out or give another folder")
        self.tmp: str | None = None

    def _clean_stale(self, parent: str, base: str) -> None:
        pattern = re.compile(rf"^\.{re.escape(base)}\.tmp-(\d+)-[^/]*$")
        try:
            names = os.listdir(parent)
        except OSError:
            return
        for name in names:
            m = pattern.match(name)
            if m and not _pid_alive(int(m.group(1))):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
                print(f"afd-compile rewrite: removed {os.path.join(parent, name)}, left by a run that was killed "
                      f"(pid {m.group(1)})", file=sys.stderr)

    def __enter__(self) -> str:
        parent, base = os.path.split(self.target)
        self._clean_stale(parent, base)
        try:
            self.tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-{os.getpid()}-", dir=parent)
        except OSError as e:
            raise OutputError(f"-o {self.shown}: cannot write in {parent}: {e.strerror or e}") from None
        return self.tmp

    def __exit__(self, kind, value, tb) -> None:
        assert self.tmp is not None
        if kind is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if isinstance(value, Exception):
                text = str(value).strip()
                why = (value.strerror if isinstance(value, OSError) and value.strerror
                       else text.splitlines()[0] if text else type(value).__name__)
                where = getattr(value, "filename", None) or "a file"
                raise OutputError(f"-o {self.shown}: writing {where} failed: {why}; nothing was written") from None
            return  # KeyboardInterrupt / SystemExit: the temporary folder is gone, the exit goes on
        old = None
        try:
            if os.path.lexists(self.target):
                old = f"{self.tmp}.old"
                os.rename(self.target, old)
            os.rename(self.tmp, self.target)
        except OSError as e:
            if old is not None and not os.path.lexists(self.target):
                os.rename(old, self.target)
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise OutputError(f"-o {self.shown}: cannot move the result into place: {e.strerror or e}") from None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


class _FailSafeFile(io.RawIOBase):
    """A file torch's archive writer writes through. The writer is C++: when a write fails it
    raises, and its destructor then writes again, throws from a destructor and aborts the
    process (SIGABRT, exit 134). This wrapper keeps the first ``OSError`` and takes every later
    write as done, so the writer finishes; :func:`save_program` raises the kept error after."""

    def __init__(self, f: io.BufferedWriter) -> None:
        super().__init__()
        self.f, self.pos = f, 0
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == os.SEEK_SET else self.pos + offset if whence == os.SEEK_CUR else self.pos
        if self.error is None:
            try:
                self.pos = self.f.seek(offset, whence)
            except OSError as e:
                self.error = e
        return self.pos

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        if self.error is None:
            try:
                self.f.write(b)
            except OSError as e:
                self.error = e
        self.pos += n
        return n


def save_program(ep: Any, path: str) -> str:
    """``torch.export.save(ep, path)``; a failed write raises its ``OSError`` (never aborts the
    process). Returns the file's sha256."""
    import torch

    with open(path, "wb") as raw:
        f = _FailSafeFile(raw)
        torch.export.save(ep, f)
        if f.error is None:
            try:
                raw.flush()
            except OSError as e:
                f.error = e
    if f.error is not None:
        if not f.error.filename:
            f.error.filename = path
        raise f.error
    return sha256_of(path)


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """SIGTERM raises ``SystemExit(143)`` in the main thread while inside (so ``finally`` blocks
    and :class:`OutputFolder` clean up); the previous handler is restored after. A no-op off the
    main thread."""
    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
