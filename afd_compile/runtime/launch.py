"""Local runs: ``world_size`` gloo processes on this machine (the path tests and ``afd-compile
verify`` take), forked from a launcher (itself from a forkserver that imported torch's export
loader once) that can load what every rank needs first (verify: the programs); the launcher
supervises the ranks, the caller the launcher and the forkserver. Under ``torchrun`` none of
this runs: each rank calls :func:`afd_compile.runtime.init_distributed` itself.
"""

from __future__ import annotations

import os
import queue as queue_mod
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..limits import (
    MAX_RANKS,
    MAX_TIMEOUT_S,
    LaunchConfigError,
    bounded_int,
    local_process_override,
)
from .dist import free_port, init_distributed
from .protocol import shutdown

#: memory a local process is assumed to need (torch, a small program, gloo buffers)
LOCAL_PROCESS_BYTES = 512 << 20


LOCAL_PROCESS_LIMIT_RULE = "available memory / 512 MiB per process, or AFD_MAX_LOCAL_PROCESSES"


def max_local_processes() -> int:
    """How many processes :func:`run_local` may start: ``AFD_MAX_LOCAL_PROCESSES`` when set,
    else the available memory (``/proc/meminfo``) over :data:`LOCAL_PROCESS_BYTES`, at least 2."""
    n = local_process_override()
    if n is not None:
        return n
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        avail = 8 << 30
    return max(2, avail // LOCAL_PROCESS_BYTES)


_PROGRESS: Any = None  # a worker's queue to the parent process (run_local), for progress()


def progress(text: str) -> None:
    """From a worker of :func:`run_local`: a progress line for the parent (its ``on_progress``);
    nothing outside such a worker."""
    if _PROGRESS is not None:
        _PROGRESS.put((int(os.environ.get("RANK", -1)), "progress", text))


#: what every local worker imports (``torch.export.load`` pulls in dynamo and the serializer: about
#: 4 s of CPU per process): the forkserver imports it once and each rank is forked from it
WORKER_PRELOAD = ["afd_compile.forkserver_guard", "afd_compile.verify", "torch._dynamo",
                  "torch._export.serde.serialize", "torch.export.pt2_archive._package"]


#: imported by the forkserver as well when the calling process has imported the package: loading
#: a program of transformers' MoE ops imports them (seconds of CPU per run otherwise)
WORKER_PRELOAD_IF_IMPORTED = {"transformers": ["transformers.integrations.moe"]}


def _start_context() -> Any:
    """The multiprocessing context a local run's launcher starts from: a forkserver preloaded
    with :data:`WORKER_PRELOAD` (and :data:`WORKER_PRELOAD_IF_IMPORTED`; one server per parent
    process, kept for its later runs), where the platform has one; spawn elsewhere."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return torch.multiprocessing.get_context("spawn")
    import sys

    ctx = torch.multiprocessing.get_context("forkserver")
    extra = [m for package, mods in WORKER_PRELOAD_IF_IMPORTED.items() if package in sys.modules for m in mods]
    ctx.set_forkserver_preload(WORKER_PRELOAD + extra)  # (read when the server starts: the first run)
    return ctx


def _rank_context() -> Any:
    """The context the launcher starts ranks from: fork (a rank finds what the launcher loaded
    in memory); spawn where the platform cannot fork."""
    import multiprocessing

    return multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that started it dies (a launcher killed
    by its caller takes its ranks with it); nothing elsewhere."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # (it died before the call)
        os._exit(1)


def _ignore_interrupts() -> None:
    """Ctrl-C reaches every process of the terminal's process group: the launcher and its ranks
    leave it to the caller, which ends the run (killing the launcher takes the ranks with it), so
    one line is printed, not a traceback per process."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any, timeout_s: float,
           env: dict[str, str]) -> None:
    global _PROGRESS
    _die_with_parent()
    _ignore_interrupts()
    _PROGRESS = queue
    os.environ.clear()  # the caller's environment of this run (the launcher's may have been changed by preload())
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    ok = False
    try:
        init_distributed(rank, world_size, backend="gloo", timeout_s=timeout_s)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
        ok = True
    except BaseException as e:  # report, never hang the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    try:
        shutdown(sync=ok)
    except Exception:
        if not ok:
            raise


class RunFault(RuntimeError):
    """A local run ended without a result: a rank failed (:class:`RankFailure`) or a process
    that runs them did (:class:`LauncherFailure`). ``short``: one line naming who and why."""

    def __init__(self, text: str, message: str) -> None:
        super().__init__(text)
        self.message = message
        self.short = message.splitlines()[0] if message else ""

    def line(self) -> str:
        """``rank 2 failed: ...`` / ``the launcher process (pid N) ...``: one line."""
        return self.short


class RankFailure(RunFault):
    """A rank of a local run failed: it raised, died, stopped, or gave no result in time.
    ``rank`` is the rank that failed first (one that died or stopped is named before a
    survivor that only saw its peer go away)."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank} failed: {message}", message)
        self.rank = rank

    def line(self) -> str:
        return f"rank {self.rank} failed: {self.short}"


class LauncherFailure(RunFault):
    """The launcher of a local run or its forkserver died, stopped, or gave no verdict; every
    rank is gone when it is raised."""

    def __init__(self, message: str):
        super().__init__(message, message)


def _proc_state(pid: int | None) -> str | None:
    """The state letter of a live process from /proc (``T``: stopped); None where unknown."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _casualty(procs: Sequence[Any], reported: set[int]) -> RankFailure | None:
    """A rank that died without reporting, or is stopped (SIGSTOP, a debugger): the cause,
    whatever its peers then report."""
    for r, p in enumerate(procs):
        if r in reported:
            continue
        code = p.exitcode
        if code not in (None, 0):
            how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            return RankFailure(r, f"process {how} before reporting (pid {p.pid})")
        if code is None and _proc_state(p.pid) in ("T", "t"):
            return RankFailure(r, f"process is stopped (pid {p.pid}, SIGSTOP or a debugger); its peers cannot "
                               "progress")
    return None


#: what a rank raises when a peer went away first: the peer's own error is the cause
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _drain_results(queue: Any, results: dict[int, Any], on_progress: Callable[[int, str], None] | None
                   ) -> list[tuple[int, str]]:
    """Take what is already queued without waiting: results and progress; returns the errors."""
    errors = []
    while True:
        try:
            rank, status, payload = queue.get_nowait()
        except queue_mod.Empty:
            return errors
        if status == "ok":
            results[rank] = payload
        elif status == "progress":
            if on_progress is not None:
                on_progress(rank, payload)
        else:
            errors.append((rank, payload))


def _end_all(procs: Sequence[Any], grace_s: float) -> None:
    """Join every process within ``grace_s`` in all; then SIGKILL what is left (a stopped
    process ignores SIGTERM until continued) and reap it."""
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def _supervise(procs: Sequence[Any], queue: Any, deadline_s: float,
               on_progress: Callable[[int, str], None] | None) -> dict[int, Any]:
    """Wait for every rank's result; raise RankFailure at the first failure (see :func:`run_local`).
    Every process is gone when this returns or raises."""
    world_size = len(procs)
    results: dict[int, Any] = {}
    failure: RankFailure | None = None
    deadline = time.monotonic() + deadline_s
    checked = time.monotonic()
    try:
        while len(results) < world_size and failure is None:
            try:
                rank, status, payload = queue.get(timeout=0.2)
            except queue_mod.Empty:
                status = None
            if status is None or time.monotonic() - checked > 0.2:  # (progress lines may never stop coming)
                checked = time.monotonic()
                failure = _casualty(procs, set(results))
                if failure is None and time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in results]
                    failure = RankFailure(missing[0], f"no result within {deadline_s:.0f}s from ranks {missing}")
                if failure is not None or status is None:
                    continue
            if status == "progress":
                if on_progress is not None:
                    on_progress(rank, payload)
                continue
            if status == "ok":
                results[rank] = payload
                continue
            # a survivor often reports first ("connection closed" from the rank that died or
            # raised; queued messages arrive in no fixed order): look for a rank that died or
            # stopped, or that raised an error of its own, before blaming the one that reported
            failure, raised = RankFailure(rank, payload), {rank}
            for _ in range(10):
                for r, text in _drain_results(queue, results, on_progress):  # a queued "ok" is no casualty
                    raised.add(r)
                    if any(s in failure.short for s in PEER_GONE) and not any(s in text for s in PEER_GONE):
                        head, _, tail = text.partition("\n")
                        failure = RankFailure(r, f"{head} (rank {rank} then raised: {failure.short})\n{tail}")
                cause = _casualty(procs, set(results) | raised)
                if cause is not None:
                    failure = RankFailure(cause.rank, f"{cause.short} (rank {rank} then raised: {failure.short})")
                    break
                time.sleep(0.1)
    finally:
        _end_all(procs, grace_s=2 if failure else 30)
    if failure:
        raise failure
    return results


def _launch(fn: Callable, world_size: int, args: tuple, preload: Callable[[], object] | None, out: Any,
            timeout_s: float, deadline_s: float, env: dict[str, str]) -> None:
    """The launcher of a local run (a process of its own): runs ``preload()``, forks the ranks
    from itself, supervises them, and puts on ``out`` their progress and then one verdict:
    ``(-1, "ok", results)``, ``(rank, "failure", message)``, or ``(-1, "launcher", traceback)``
    when ``preload()`` raised (no rank was started)."""
    _die_with_parent()
    _ignore_interrupts()
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)  # (no intra-op thread pool in a process that forks)
    if preload is not None:
        try:
            preload()
        except BaseException as e:
            out.put((-1, "launcher", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            out.close()
            out.join_thread()
            return
    ctx = _rank_context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, timeout_s, env), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        results = _supervise(procs, queue, deadline_s, lambda r, text: out.put((r, "progress", text)))
    except RankFailure as e:
        out.put((e.rank, "failure", e.message))
    else:
        out.put((-1, "ok", results))
    out.close()
    out.join_thread()


def run_local(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300.0,
              deadline_s: float | None = None,
              on_progress: Callable[[int, str], None] | None = None,
              preload: Callable[[], object] | None = None) -> dict[int, Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local gloo processes; returns
    {rank: result}. ``on_progress(rank, text)`` gets what the workers report with :func:`progress`.

    The ranks are forked from one launcher process (itself forked from a forkserver that imported
    torch's export loader once). ``preload()``, when given (picklable: a module-level function or
    a ``functools.partial`` of one), runs once in the launcher before the ranks are forked: what
    it loads into module state (verify's programs) every rank finds in memory instead of loading
    it again.

    Never waits unbounded: ``timeout_s`` is the process group's timeout (a rank blocked on a peer
    raises after it); ``deadline_s`` (default ``2 * timeout_s + 60``) bounds the whole run. A rank
    that raises, dies (SIGKILL, a crash) or is stopped (SIGSTOP) fails the run at once, as
    RankFailure naming the rank that failed first; every process is gone when it is raised.
    """
    if not callable(fn):
        raise LaunchConfigError(f"run_local: fn must be a callable fn(rank, world_size, *args), got {fn!r}")
    bounded_int("run_local: world_size", world_size, 1, MAX_RANKS)
    if world_size > max_local_processes():
        raise ValueError(f"run_local: {world_size} processes exceed the local limit {max_local_processes()} "
                         f"({LOCAL_PROCESS_LIMIT_RULE})")
    for name, v in (("timeout_s", timeout_s), ("deadline_s", deadline_s)):
        if v is not None and not (isinstance(v, (int, float)) and 0 < v <= MAX_TIMEOUT_S):
            raise ValueError(f"run_local: {name} must be seconds in (0, {MAX_TIMEOUT_S:.0f}], got {v!r}")
    deadline_s = 2 * timeout_s + 60 if deadline_s is None else deadline_s
    ctx = _start_context()
    server = _forkserver_pid()
    if server is not None and _proc_state(server) in ("T", "t"):
        raise LauncherFailure(f"the forkserver of local runs (pid {server}) is stopped (SIGSTOP or a debugger): "
                              "no run can start; continue or kill it")
    out = ctx.Queue()
    launcher = ctx.Process(target=_launch, args=(fn, world_size, args, preload, out, timeout_s, deadline_s,
                                                 dict(os.environ)))
    _start_watched(launcher, deadline_s)
    server = _forkserver_pid()
    verdict = False
    try:
        result = _await_verdict(launcher, server, out, deadline_s + 60, on_progress)
        verdict = True
        return result
    finally:
        launcher.join(timeout=10 if verdict else 0)  # (no verdict: an error, SIGTERM, ^C: end the run now)
        if launcher.is_alive():
            launcher.kill()  # (its ranks die with it: _die_with_parent)
            launcher.join(timeout=5)


def _start_watched(launcher: Any, limit_s: float) -> None:
    """``launcher.start()``, which waits on the forkserver for the new process's pid: a thread
    watches the forkserver meanwhile, and one stopped (SIGSTOP, a debugger; while it preloads, say)
    or not answering within ``limit_s`` is killed, so the start ends at once as
    :class:`LauncherFailure` instead of waiting forever (the next run starts a new server)."""
    done, why = threading.Event(), []

    def watch() -> None:
        end = time.monotonic() + limit_s
        while not done.wait(0.1):
            server = _forkserver_pid()
            stopped = _proc_state(server) in ("T", "t")
            if stopped or time.monotonic() > end:
                why.append(f"the forkserver of local runs (pid {server}) "
                           + ("is stopped (SIGSTOP or a debugger)" if stopped else f"did not start the run within "
                              f"{limit_s:.0f}s") + " while the run started; the run is ended")
                if server is not None:
                    try:
                        os.kill(server, 9)
                    except OSError:
                        pass
                return

    watcher = threading.Thread(target=watch, name="afd-start-watch", daemon=True)
    watcher.start()
    try:
        launcher.start()
    except (OSError, EOFError) as e:
        done.set()
        watcher.join()
        raise LauncherFailure(why[0] if why else f"the forkserver of local runs could not start the run: "
                              f"{type(e).__name__}: {e}") from None
    done.set()
    watcher.join()
    if why:  # (killed as the start returned: the launcher has no server left)
        launcher.kill()
        raise LauncherFailure(why[0])


def _forkserver_pid() -> int | None:
    """The pid of this process's forkserver, where it runs one (multiprocessing keeps it)."""
    import multiprocessing.forkserver as fs

    server = getattr(fs, "_forkserver", None)
    return getattr(server, "_forkserver_pid", None)


def _await_verdict(launcher: Any, server: int | None, out: Any, limit_s: float,
                   on_progress: Callable[[int, str], None] | None) -> dict[int, Any]:
    """The launcher's verdict, its ranks' progress passed on; :class:`LauncherFailure` when the
    launcher or its forkserver dies or stops, or no verdict comes within ``limit_s`` (the
    launcher enforces the run's deadline itself)."""
    hard_deadline = time.monotonic() + limit_s
    checked = time.monotonic()
    while True:
        try:
            rank, status, payload = out.get(timeout=0.2)
        except queue_mod.Empty:
            status = None
        if status is None or time.monotonic() - checked > 0.2:  # (a stream of progress lines never times out)
            checked = time.monotonic()
            if status is None and launcher.exitcode is not None and out.empty():
                code = launcher.exitcode
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                if server is not None and _proc_state(server) in (None, "Z", "X"):
                    how += f" (its parent, the forkserver of local runs, pid {server}, died first)"
                raise LauncherFailure(f"the launcher process (pid {launcher.pid}) {how} before reporting; its "
                                      "ranks are gone")
            for pid, name in ((launcher.pid, "launcher process"), (server, "forkserver of local runs")):
                if pid is not None and _proc_state(pid) in ("T", "t"):
                    if pid == server:  # (a stopped forkserver outlives its caller: nothing else can end it)
                        os.kill(pid, 9)
                    raise LauncherFailure(f"the {name} (pid {pid}) is stopped (SIGSTOP or a debugger); the run "
                                          "is ended")
            if time.monotonic() > hard_deadline:
                raise LauncherFailure(f"the launcher process (pid {launcher.pid}) gave no verdict within "
                                      f"{limit_s:.0f}s; the run is ended")
        if status is None:
            continue
        if status == "progress":
            if on_progress is not None:
                on_progress(rank, payload)
        elif status == "ok":
            return payload
        elif status == "launcher":
            raise RuntimeError(f"run_local: preload() raised in the launcher, no rank was started: {payload}")
        else:
            raise RankFailure(rank, payload)
