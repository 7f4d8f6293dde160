"""The output folder of ``afd-compile rewrite``: written whole or not at all, and never a folder
the user did not ask to replace.

What ``-o PATH`` may name (each refusal is a :class:`OutputError`, one line, before any work):

- not an empty path (``""`` is the current directory), not the current directory or a folder
  holding it, not a folder holding an input file (``-o .`` next to ``model.pt2``), after
  symbolic links are resolved (a link is followed: the folder it names is what is replaced);
- a new path, an empty folder, or, with ``--force``, a folder that ``rewrite`` wrote, judged by
  content: its ``plan.json`` (a regular file) passes every check of
  :func:`afd_compile.saved.read_saved_plan` (field types, hash format, each program a regular file
  whose sha256 matches) and the folder holds nothing but plan.json and those programs.

Writing goes into a temporary sibling ``.NAME.tmp-PID-XXXX`` renamed into place at the end; any
exception while writing (a full disk raises ``RuntimeError`` from torch's archive writer, not
``OSError``), ``KeyboardInterrupt`` or ``SystemExit`` (SIGTERM, see :func:`exit_on_sigterm`)
removes it. The target is checked again at the moment of replacement, not only when the run
starts: a folder that was absent is claimed by creating it (``mkdir`` fails if anything appeared
meanwhile, and the rename onto the claimed folder fails if anything was put in it), and a folder
that is replaced is first moved aside into a temporary folder of ours and checked there, by
content, as it is at that moment (a file added since the start: moved back, refused).

Every temporary folder holds :data:`TMP_MARKER`, a file naming the process that made it. A sibling
left by a run that was killed outright (SIGKILL) is removed by the next run into the same target,
which says so on stderr, only when it carries that file and its process is gone: a folder of the
user's that merely has such a name is left alone.
"""

from __future__ import annotations

import contextlib
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
from .saved import MARKER, read_saved_plan, sha256_of

#: the file inside every temporary folder of a rewrite (JSON: MARKER's field and the writer's pid)
TMP_MARKER = ".afd-compile-tmp"


class OutputError(AFDCompileError):
    """The output folder cannot or may not be written (the path and the reason)."""


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def replaceable(folder: str, force: bool) -> str | None:
    """Why ``folder`` (an existing folder) may not be replaced, or None: empty, or with ``force``
    a whole rewrite folder, checked by content (see the module docstring)."""
    try:
        entries = set(os.listdir(folder))
    except OSError as e:
        return f"cannot read the folder: {e.strerror or e}"
    if not entries:
        return None
    if not force:
        return ("the folder exists and is not empty; pass --force to replace it whole (only a folder rewrite "
                "wrote)")
    try:
        plan = read_saved_plan(folder)
    except AFDCompileError as e:
        return (f"--force replaces only a folder rewrite wrote, checked by content (plan.json says "
                f"{MARKER[0]}: {MARKER[1]!r}, every field valid, each program its recorded sha256); this one is "
                f"not ({str(e).removeprefix(folder + ': ')}): remove it yourself or give another folder")
    extra = entries - {"plan.json", *plan.programs.values()}
    if extra:
        return (f"holds files rewrite did not write ({', '.join(sorted(extra))}); --force would delete them: "
                "move them out or give another folder")
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _marked_pid(folder: str) -> int | None:
    """The pid in ``folder``'s :data:`TMP_MARKER` when it is one of ours, else None."""
    path = os.path.join(folder, TMP_MARKER)
    try:
        if os.path.islink(path) or not os.path.isfile(path) or os.path.getsize(path) > 4096:
            return None
        with open(path) as f:
            mark = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(mark, dict) or mark.get(MARKER[0]) != MARKER[1]:
        return None
    pid = mark.get("pid")
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


def _make_tmp(parent: str, base: str, suffix: str = "") -> str:
    """A new temporary folder beside the target, marked as ours (:data:`TMP_MARKER`)."""
    tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-{os.getpid()}-", suffix=suffix, dir=parent)
    with open(os.path.join(tmp, TMP_MARKER), "w") as f:
        json.dump({MARKER[0]: MARKER[1], "pid": os.getpid()}, f)
    return tmp


class OutputFolder:
    """``with OutputFolder(path, force, inputs) as tmp:`` write into ``tmp``; on success it replaces
    ``path``. Checks the target at construction and again at the replacement (module docstring)."""

    def __init__(self, path: str, force: bool, inputs: Sequence[str] = ()) -> None:
        if not path.strip():
            raise OutputError("-o: an empty path (it would name the current directory); give the new folder's name")
        self.shown, self.force = path, force
        self.target = os.path.realpath(path)  # a symbolic link is followed: its folder is the one replaced
        self.via = "" if self.target == os.path.abspath(path) else f" (a link to {self.target})"
        cwd = os.path.realpath(os.getcwd())
        if _inside(cwd, self.target):
            what = "the current directory" if cwd == self.target else f"a folder holding the current directory {cwd}"
            raise OutputError(f"-o {path}{self.via}: is {what}; rewrite replaces its output folder whole: give a "
                              "new folder")
        for inp in inputs:
            if _inside(os.path.realpath(inp), self.target):
                raise OutputError(f"-o {path}{self.via}: holds the input {inp}; rewrite replaces its output folder "
                                  "whole: give a folder that does not hold the input")
        self.existed = os.path.lexists(self.target)
        if self.existed:
            if not os.path.isdir(self.target):
                raise OutputError(f"-o {path}{self.via}: exists and is not a folder")
            why = replaceable(self.target, force)
            if why is not None:
                raise OutputError(f"-o {path}{self.via}: {why}")
        # the finished folder's mode: the replaced folder's own, else what the umask gives a new one
        # (it is written as a private temporary folder, 0700)
        self.mode = os.stat(self.target).st_mode & 0o7777 if self.existed else 0o777 & ~_umask()
        self.tmp: str | None = None

    def _clean_stale(self, parent: str, base: str) -> None:
        pattern = re.compile(rf"^\.{re.escape(base)}\.tmp-(\d+)-[^/]*$")
        try:
            names = os.listdir(parent)
        except OSError:
            return
        for name in names:
            m = pattern.match(name)
            full = os.path.join(parent, name)
            if not m or os.path.islink(full) or _marked_pid(full) != int(m.group(1)) or _pid_alive(int(m.group(1))):
                continue  # not ours (no marker naming its pid), or its run is still going
            shutil.rmtree(full, ignore_errors=True)
            print(f"afd-compile rewrite: removed {full}, left by a run that was killed (pid {m.group(1)})",
                  file=sys.stderr)

    def __enter__(self) -> str:
        parent, base = os.path.split(self.target)
        self._clean_stale(parent, base)
        try:
            self.tmp = _make_tmp(parent, base)
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
        try:
            self._replace()
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    def _refuse(self, why: str) -> OutputError:
        return OutputError(f"-o {self.shown}{self.via}: {why}; nothing was written")

    def _replace(self) -> None:
        """Move the result into place: the old folder (if any) aside into a folder of ours,
        checked there; the target claimed by ``mkdir``; the result renamed onto the claim."""
        assert self.tmp is not None
        parent, base = os.path.split(self.target)
        trash = None
        if os.path.lexists(self.target):
            if not self.existed:
                raise self._refuse("appeared while rewrite ran (made by another process); it was left as it is")
            trash = _make_tmp(parent, base, ".old")
            old = os.path.join(trash, "old")
            try:
                os.rename(self.target, old)
            except FileNotFoundError:  # gone meanwhile: nothing to replace
                pass
            except OSError as e:
                shutil.rmtree(trash, ignore_errors=True)
                raise self._refuse(f"cannot move the old folder aside: {e.strerror or e}") from None
            if os.path.lexists(old):
                folder = os.path.isdir(old) and not os.path.islink(old)
                why = replaceable(old, self.force) if folder else "is not a folder"
                if why is not None:  # changed since the start: back where it was, untouched
                    try:
                        os.rename(old, self.target)
                        shutil.rmtree(trash, ignore_errors=True)
                        kept = ""
                    except OSError:
                        kept = f" (kept at {old}: something else now sits at the target)"
                    raise self._refuse(f"changed while rewrite ran: {why}{kept}")
        try:
            os.mkdir(self.target, 0o700)  # the claim: fails if anything appeared since
        except FileExistsError:
            kept = f"; the old folder is kept at {os.path.join(trash, 'old')}" if trash else ""
            raise self._refuse(
                f"appeared while rewrite ran (made by another process); it was left as it is{kept}"
            ) from None
        except OSError as e:
            raise self._refuse(f"cannot create the folder: {e.strerror or e}") from None
        os.remove(os.path.join(self.tmp, TMP_MARKER))
        try:
            os.rename(self.tmp, self.target)  # onto the empty claim: fails if anything was put in it
        except OSError as e:
            raise self._refuse(
                f"was written into while rewrite ran ({e.strerror or e}); it was left as it is"
            ) from None
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        os.chmod(self.target, self.mode)


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


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
