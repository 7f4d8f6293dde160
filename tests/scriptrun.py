"""Run a torchrun script (``examples/*.py``) on ``n`` real local gloo processes without torchrun:
the ranks are forked by :func:`afd_compile.runtime.run_local` from a launcher that imported torch,
transformers and Inductor once (under torchrun each rank imports them: ~10 s of CPU a rank).

The script runs as under torchrun (``__main__``, its argv, ``RANK`` / ``WORLD_SIZE`` / ``MASTER_*``
set, the process group formed with gloo before it starts; its own ``init_distributed()`` finds it
formed). Each test file keeps one run under real torchrun for the launch itself.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys
from dataclasses import dataclass

#: what the launcher imports before forking the ranks (the examples' heavy imports)
PRELOAD = ("transformers.modeling_utils", "transformers.integrations.moe", "torch._inductor.compile_fx",
           "afd_compile.backend", "afd_compile.models")


def _preload() -> None:
    import importlib

    import transformers

    for name in PRELOAD:
        importlib.import_module(name)
    for cls in ("LlamaForCausalLM", "Qwen3MoeForCausalLM"):  # (transformers imports a model lazily)
        getattr(transformers, cls)


def _script_rank(rank: int, world: int, script: str, argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    os.environ.update(env)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    out = io.StringIO()
    code: object = 0
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code
    sys.stdout.flush()
    return (code if isinstance(code, int) else 0 if code is None else 1), out.getvalue()


@dataclass
class ScriptRun:
    """What a test reads of a run, as of a ``subprocess.CompletedProcess``: the worst exit
    status, and every rank's stdout (rank 0's last: it prints the summary)."""

    returncode: int
    stdout: str
    stderr: str = ""


def run_script(n: int, script: str, *args: str, env: dict[str, str] | None = None,
               timeout_s: float = 300.0) -> ScriptRun:
    """``torchrun --nproc-per-node n script *args``, ranks forked from a preloaded launcher.
    A rank that raises (not SystemExit) fails the call with RankFailure naming it."""
    from afd_compile.runtime import run_local

    env = {"AFD_BACKEND": "gloo", **(env or {})}
    res = run_local(_script_rank, n, script, list(args), env, timeout_s=timeout_s, preload=_preload)
    order = [*range(1, n), 0]
    return ScriptRun(max(res[r][0] for r in order), "".join(res[r][1] for r in order))


def run_torchrun(n: int, script: str, *args: str, timeout_s: float = 600.0) -> subprocess.CompletedProcess:
    """The same under real torchrun (a process per rank, each importing everything)."""
    import shutil

    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    return subprocess.run([torchrun, "--standalone", "--nproc-per-node", str(n), script, *args], capture_output=True,
                          text=True, timeout=timeout_s, env={**os.environ, "AFD_BACKEND": "gloo"})
