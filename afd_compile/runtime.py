"""Run a split program on ``torch.distributed``: locally (spawned processes) or under torchrun.

Every rank compiles for itself (SPMD-style: the same source, the same passes, its own role), then:

- an **attention rank** per step sends its token count to its FFN rank (one small control message
  per step, not per layer), then runs the attention program, whose ``afd::p2p_send`` /
  ``afd::p2p_recv`` ops exchange hidden states with the FFN rank at every layer;
- an **FFN rank** per step receives the token count of every attention peer, stores them as the
  step's transfer metadata, and runs the FFN program on a ``(T, 0)`` token carrier. A count of -1
  from every peer ends the loop.

``run_local`` spawns ``world_size`` processes with gloo (the path tests and ``afd-compile verify``
take); under ``torchrun`` the same :func:`rank_main` reads ``RANK`` / ``WORLD_SIZE`` from the
environment.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.distributed as dist
import torch.fx as fx

from .comm import AFDCommunicator, register_communicator
from .layout import AFDLayout
from .passes.symbolic import sym_expr
from .split_api import SplitConfig, split_graph_module

STOP = -1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(rank: int | None = None, world_size: int | None = None, backend: str | None = None,
                     timeout_s: float = 120.0) -> tuple[int, int]:
    """Join the process group (env:// as torchrun sets it). gloo on CPU, NCCL when CUDA is used."""
    rank = int(os.environ["RANK"]) if rank is None else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    backend = backend or ("nccl" if torch.cuda.is_available() and os.environ.get("AFD_BACKEND") != "gloo" else "gloo")
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world_size


def shutdown() -> None:
    """Leave the process group cleanly: free the compiled programs and their CUDA graphs first
    (:func:`afd_compile.backend.release`; a graph that captured an NCCL operation keeps its
    communicator from being destroyed, and the process would hang at exit), then
    ``destroy_process_group``."""
    import sys

    backend = sys.modules.get("afd_compile.backend")
    if backend is not None:
        backend.release()
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class TokenCount:
    """A step's token count as ``factor * prod(inputs[i].shape[d] for i, d in dims)``."""

    dims: tuple[tuple[int, int], ...]
    factor: int = 1

    def __call__(self, inputs: Sequence[torch.Tensor]) -> int:
        n = self.factor
        for i, d in self.dims:
            n *= int(inputs[i].shape[d])
        return n

    def to_json(self) -> dict:
        return {"dims": [list(x) for x in self.dims], "factor": self.factor}

    @staticmethod
    def from_json(data: dict) -> TokenCount:
        return TokenCount(tuple((int(i), int(d)) for i, d in data["dims"]), int(data["factor"]))

    @staticmethod
    def for_graph(gm: fx.GraphModule, token_dims: Sequence[str]) -> TokenCount:
        """From the plan's token dims (sympy expressions over the graph's input symbols)."""
        where: dict[str, tuple[int, int]] = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for i, n in enumerate(placeholders):
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor):
                for d, size in enumerate(val.shape):
                    e = sym_expr(size)
                    if e.is_Symbol and str(e) not in where:
                        where[str(e)] = (i, d)
        total = sympy.expand(sympy.Mul(*[sympy.sympify(t) for t in token_dims]))
        coeff, rest = total.as_coeff_Mul()
        dims = []
        for factor in sympy.Mul.make_args(rest):
            if factor == 1:
                continue
            if not factor.is_Symbol or str(factor) not in where:
                raise ValueError(f"token count {total}: factor {factor} is not an input dimension")
            dims.append(where[str(factor)])
        return TokenCount(tuple(dims), int(coeff))


@dataclass
class AttentionWorker:
    program: fx.GraphModule
    comm: AFDCommunicator
    count_tokens: TokenCount
    stage: int = 0

    def step(self, *inputs: torch.Tensor) -> Any:
        n = self.count_tokens(inputs)
        self._control(n)
        self.comm.set_step({self.stage: (n,)})
        if n == 0:
            return None
        return self.program(*inputs)

    def stop(self) -> None:
        self._control(STOP)

    def _control(self, n: int) -> None:
        dev = "cuda" if self.comm.device_transport else "cpu"
        dist.send(torch.tensor([n], dtype=torch.int64, device=dev), self.comm.peers[0], group=self.comm.group)


@dataclass
class FFNWorker:
    program: fx.GraphModule
    comm: AFDCommunicator
    device: torch.device
    stage: int = 0
    #: how a step's program runs: ``(per-peer counts, (T, 0) carrier) -> None``; the compile
    #: backend replaces it to pick the program compiled for that token layout
    run_program: Callable[[tuple[int, ...], torch.Tensor], Any] | None = None

    def serve(self, on_step: Callable[[tuple[int, ...]], None] | None = None) -> int:
        """Serve steps until every peer says stop; returns the number of steps served."""
        steps = 0
        while self.serve_one(on_step) is not None:
            steps += 1
        return steps

    def serve_one(self, on_step: Callable[[tuple[int, ...]], None] | None = None) -> tuple[int, ...] | None:
        """Receive one step's per-peer token counts (the control message) and run the program
        once; returns the counts, or None when every peer said stop."""
        dev = "cuda" if self.comm.device_transport else "cpu"
        bufs = [torch.empty(1, dtype=torch.int64, device=dev) for _ in self.comm.peers]
        for b, p in zip(bufs, self.comm.peers, strict=True):
            dist.recv(b, p, group=self.comm.group)
        counts = tuple(int(b.item()) for b in bufs)
        if all(c == STOP for c in counts):
            return None
        if any(c == STOP for c in counts):
            raise RuntimeError(f"afd: FFN rank {self.comm.rank}: some peers stopped and some did not: {counts}")
        self.comm.set_step({self.stage: counts})
        if on_step:
            on_step(counts)
        if sum(counts):
            slots = torch.empty(sum(counts), 0, device=self.device)
            if self.run_program is not None:
                self.run_program(counts, slots)
            else:
                self.program(slots)
        return counts


def make_worker(gm: fx.GraphModule, layout: AFDLayout, rank: int, config: SplitConfig | None = None,
                device: torch.device | None = None, group: dist.ProcessGroup | None = None,
                ) -> AttentionWorker | FFNWorker:
    """Split ``gm`` and wrap this rank's program. Registers the communicator under config.comm_id."""
    config = config or SplitConfig()
    result = split_graph_module(gm, config, layout=layout)
    role, idx = layout.role_of(rank)
    device = device or torch.device("cpu")
    if role == "ffn":
        comm = AFDCommunicator("ffn", rank, layout.peers_of_ffn(idx), group)
        register_communicator(comm, config.comm_id)
        return FFNWorker(result.ffn.to(device), comm, device)
    comm = AFDCommunicator("attention", rank, (layout.ffn_of_attention(idx),), group)
    register_communicator(comm, config.comm_id)
    counter = TokenCount.for_graph(gm, result.plan.cuts[0].token_dims)
    return AttentionWorker(result.attention.to(device), comm, counter)


def load_rewritten_worker(outdir: str, rank: int, device: torch.device | None = None) -> AttentionWorker | FFNWorker:
    """This rank's worker from the files ``afd-compile rewrite`` wrote (plan.json + role .pt2)."""
    import json

    from .programs import load_program

    with open(os.path.join(outdir, "plan.json")) as f:
        plan = json.load(f)
    layout = AFDLayout(plan["layout"]["attention_ranks"], plan["layout"]["ffn_ranks"])
    role, idx = layout.role_of(rank)
    device = device or torch.device("cpu")
    comm_id = int(plan["comm_id"])
    if role == "ffn":
        comm = AFDCommunicator("ffn", rank, layout.peers_of_ffn(idx))
        register_communicator(comm, comm_id)
        program = load_program(os.path.join(outdir, plan["programs"]["ffn"])).module().to(device)
        return FFNWorker(program, comm, device)
    comm = AFDCommunicator("attention", rank, (layout.ffn_of_attention(idx),))
    register_communicator(comm, comm_id)
    program = load_program(os.path.join(outdir, plan["programs"]["attention"])).module().to(device)
    return AttentionWorker(program, comm, TokenCount.from_json(plan["token_count"]))


def max_rel_err(out: Any, ref: Any) -> float:
    """max |out - ref| / max |ref| over all tensors of a (nested) output; inf on a shape mismatch."""
    outs, refs = _flat(out), _flat(ref)
    if len(outs) != len(refs):
        return float("inf")
    err = 0.0
    for o, r in zip(outs, refs, strict=True):
        if o.shape != r.shape:
            return float("inf")
        denom = r.detach().abs().max().clamp_min(1e-30).float()
        err = max(err, float((o.detach().float() - r.detach().float()).abs().max() / denom))
    return err


def _flat(x: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


# --- local launch ------------------------------------------------------------------------------


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        init_distributed(rank, world_size, backend="gloo")
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException as e:  # report, never hang the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        shutdown()


class RankFailure(RuntimeError):
    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank
        self.short = message.splitlines()[0] if message else ""


def run_local(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300.0) -> dict[int, Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes; returns
    {rank: result}. A failing rank raises RankFailure (the others are terminated)."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failure: RankFailure | None = None
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size and failure is None:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    failure = RankFailure(dead[0], f"process exited with code {procs[dead[0]].exitcode} "
                                          "before reporting (crash, or a function spawn cannot import)")
                elif time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in results]
                    failure = RankFailure(missing[0], f"no result within {timeout_s:.0f}s from ranks {missing}")
                continue
            if status == "error":
                failure = RankFailure(rank, payload)
            else:
                results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=1 if failure else 30)
            if p.is_alive():
                p.terminate()
                p.join()
    if failure:
        raise failure
    return results

