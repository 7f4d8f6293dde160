"""Run a split program on ``torch.distributed``: locally (spawned processes) or under torchrun.

Every rank compiles for itself (SPMD-style: the same source, the same passes, its own role), then:

- an **attention rank** per step sends its token count to its FFN rank (one small control message
  per step, not per layer), then runs the attention program, whose ``afd::p2p_send`` /
  ``afd::p2p_recv`` ops exchange hidden states with the FFN rank at every layer;
- an **FFN rank** per step receives the token count of every attention peer, stores them as the
  step's transfer metadata, and runs the FFN program on a ``(T, 0)`` token carrier. A count of -1
  from every peer ends the loop.

``run_local`` starts ``world_size`` processes with gloo (the path tests and ``afd-compile verify``
take), forked from a launcher (itself from a forkserver that imported torch's export loader once)
that can load what every rank needs first (verify: the programs); under ``torchrun`` the
same :func:`rank_main` reads ``RANK`` / ``WORLD_SIZE`` from the environment.
"""

from __future__ import annotations

import datetime
import functools
import logging
import math
import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.distributed as dist
import torch.fx as fx

from .comm import AFDCommunicator, communicator_for, register_communicator, wire_checks_from_env
from .errors import AFDCompileError
from .layout import AFDLayout
from .limits import MAX_TIMEOUT_S, local_process_override
from .passes.graph_utils import batch_symbol_dims
from .passes.stages import (
    check_stage_layout,
    stage_attention_program,
    stage_ffn_program,
    static_batch,
    static_rows,
)
from .passes.symbolic import sym_expr
from .scatter import TPLayout
from .split_api import SplitConfig, split_graph_module

log = logging.getLogger("afd_compile.runtime")

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


def shutdown(sync: bool = True) -> None:
    """Leave the process group cleanly: free the compiled programs and their CUDA graphs first
    (:func:`afd_compile.backend.release`; a graph that captured an NCCL operation keeps its
    communicator from being destroyed, and the process would hang at exit), then
    ``destroy_process_group``. ``sync`` (the normal end, every rank calling it): a barrier first,
    so no rank closes its connections while a peer is still communicating (gloo aborted a rank at
    exit now and then under load: "terminate called without an active exception"); pass False
    on an error path, where the peers may never arrive: then no STOP is sent to, or heard from,
    an AFD peer either (a peer mid-step would not take it, and this rank would wait on it until
    the timeout)."""
    import sys

    if sync and _FAILED_STEP is not None:
        log.warning("afd: shutdown: a step failed on this rank (%s): leaving without the STOP exchange "
                    "and the barrier", _FAILED_STEP)
        sync = False
    if dist.is_initialized() and sync:
        try:  # the FFN peers of the backend's attention communicators stop serving this rank
            finish(at_shutdown=True)
        except Exception as e:  # a peer already gone: nothing left to tell it
            log.warning("afd: shutdown: could not tell an FFN rank this rank stopped: %s", e)
        try:  # ... and the backend's FFN workers hear it (else the peers' STOP finds no receiver)
            by_comm: dict[int, list[FFNWorker]] = {}
            for w in SERVE_AT_SHUTDOWN:  # workers of several graphs share a communicator: serve it once
                by_comm.setdefault(id(w.comm), []).append(w)
            for workers in by_comm.values():
                w = workers[-1]
                w.left.update(*(x.left for x in workers))
                if len(w.left) < len(w.comm.peers):
                    w.serve()
        except Exception as e:  # a peer already gone
            log.warning("afd: shutdown: FFN rank could not hear every attention peer stop: %s", e)
        SERVE_AT_SHUTDOWN.clear()
    backend = sys.modules.get("afd_compile.backend")
    if backend is not None:
        backend.release()
    _GROUPS.clear()
    if dist.is_initialized():
        if sync:
            dist.barrier()
        dist.destroy_process_group()


#: what failed in a worker step of this process (None: nothing): a later stop() / shutdown()
#: exchanges nothing with the peers
_FAILED_STEP: str | None = None


def _step_failed(what: str) -> None:
    global _FAILED_STEP
    if _FAILED_STEP is None:
        _FAILED_STEP = what


#: FFN workers the compile backend runs one step per call: :func:`shutdown` serves them until
#: every attention peer has stopped (the peers' shutdown sends STOP)
SERVE_AT_SHUTDOWN: list[FFNWorker] = []

#: process groups created by :func:`process_group`, by (ranks, timeout): created once per process
_GROUPS: dict[tuple[tuple[int, ...], float | None], dist.ProcessGroup] = {}


def process_group(ranks: Sequence[int], timeout_s: float | None = None) -> dist.ProcessGroup:
    """A process group over ``ranks`` (with ``timeout_s``, else the default timeout), created once
    per process and reused: the backend compiles per graph, and a new group per compile would
    open new communicators each time. Every rank must ask in the same order (``new_group`` is
    collective); :func:`shutdown` forgets them."""
    key = (tuple(ranks), timeout_s)
    if key not in _GROUPS:
        kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        _GROUPS[key] = dist.new_group(list(ranks), **kw)
    return _GROUPS[key]


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

    def describe(self, names: Sequence[str]) -> str:
        """``input_ids.shape[0] * input_ids.shape[1]`` (``names``: the program's inputs, in order)."""
        terms = [f"{names[i]}.shape[{d}]" for i, d in sorted(self.dims)]
        return " * ".join(([str(self.factor)] if self.factor != 1 or not terms else []) + terms)

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
    #: micro-batch stages (passes/stages.py): the program takes one ``[b_s, 0]`` tensor per stage
    #: after the model's inputs, ``b_s`` the sequences of micro-batch ``s``
    stages: int = 1
    #: (input, dim) of the batch (sequences), where ``stages`` > 1 splits it
    batch_dim: tuple[int, int] | None = None
    #: the batch is static (a static KV cache): the staged program's micro-batches are fixed and
    #: it takes no ``[b_s, 0]`` inputs
    static: bool = False
    #: the program of k micro-batches, built on first use (k < stages when a step has fewer
    #: sequences than stages: the empty micro-batches are the last ones and have no transfer)
    staged: dict[int, fx.GraphModule] = field(default_factory=dict)
    #: how a program runs (the compile backend compiles it): applied once per program
    wrap: Callable[[fx.GraphModule], Callable[..., Any]] | None = None
    runners: dict[int, Callable[..., Any]] = field(default_factory=dict)

    def program_for(self, k: int) -> Callable[..., Any]:
        """The program of ``k`` micro-batches (1: the unstaged one), as it runs."""
        if k not in self.runners:
            prog = self.program if k == 1 else staged_program(self.staged, self.program, k, stage_attention_program)
            self.runners[k] = self.wrap(prog) if self.wrap is not None else prog
        return self.runners[k]

    def step(self, *inputs: torch.Tensor) -> Any:
        """One step: the control message to the FFN rank, then the program. A step that raises is
        remembered: :meth:`stop` and :func:`shutdown` then leave without exchanging anything with
        the peers (an FFN rank mid-step would not take a STOP, and this rank would wait on it)."""
        try:
            return self._step(*inputs)
        except BaseException as e:
            _step_failed(f"attention step: {type(e).__name__}: {e}")
            raise

    def _step(self, *inputs: torch.Tensor) -> Any:
        slice_of = self.count_tokens if isinstance(self.count_tokens, GroupSlice) else None
        # an attention TP rank whose slice is empty still runs: its group's collectives need it
        total = slice_of.total(inputs) if slice_of is not None else self.count_tokens(inputs)
        n = slice_of.of(total) if slice_of is not None else total
        if self.stages == 1:
            send_control(self.comm, n)
            self.comm.set_step({self.stage: (n,)})
            return self.program_for(1)(*inputs) if total else None
        from .passes.pingpong import micro_batches

        assert self.batch_dim is not None
        batch = int(inputs[self.batch_dim[0]].shape[self.batch_dim[1]])
        per_seq = total // batch if batch else 0
        rows = [end - start for start, end in micro_batches([per_seq] * batch, self.stages)]
        # this rank's tokens per stage: with attention TP its slice of each micro-batch's tokens
        counts = tuple(r * per_seq if slice_of is None else slice_of.of(r * per_seq) for r in rows)
        n = sum(counts)  # (with attention TP: the sum of its slices, each micro-batch split over the group apart)
        send_control(self.comm, n, counts)
        self.comm.set_step({s: (c,) for s, c in enumerate(counts)})
        if total == 0:
            return None
        rows = [r for r in rows if r]
        if len(rows) == 1:
            return self.program_for(1)(*inputs)
        if self.static:
            return self.program_for(len(rows))(*inputs)
        dev = inputs[self.batch_dim[0]].device
        return self.program_for(len(rows))(*inputs, *(torch.empty(r, 0, device=dev) for r in rows))

    def stop(self) -> None:
        if _FAILED_STEP is not None:
            log.warning("afd: stop: not sent, a step failed on this rank (%s)", _FAILED_STEP)
            return
        send_control(self.comm, STOP)


def staged_program(cache: dict[int, fx.GraphModule], program: fx.GraphModule, k: int,
                   build: Callable[[fx.GraphModule, int], fx.GraphModule]) -> fx.GraphModule:
    """``program`` as ``k`` micro-batch stages, built once per ``k``."""
    if k not in cache:
        cache[k] = build(program, k)
    return cache[k]


def send_control(comm: AFDCommunicator, n: int, stage_counts: Sequence[int] | None = None) -> None:
    """An attention rank's per-step control message to its FFN rank: ``[tokens, flags]``
    (``tokens`` = :data:`STOP`: this rank is done; it sends nothing after it), ``flags`` = the
    wire checks (bit 0) and the micro-batch stages - 1 (bits 1 and up; 0 for one stage, so a
    one-stage message is what it always was); with 2 or more stages a second message follows
    with the tokens of each stage."""
    if comm.role != "attention":
        raise ValueError(f"afd: rank {comm.rank} is an FFN rank; only attention ranks send control messages")
    if comm.stopped:
        raise ControlError(f"afd: attention rank {comm.rank} already told FFN rank {comm.peers[0]} it stopped; "
                           "it cannot run another step (a new deployment needs a new comm_id)")
    dev = "cuda" if comm.device_transport else "cpu"
    stages = len(stage_counts) if stage_counts is not None else 1
    flags = int(comm.check_wire) | (stages - 1) << 1
    dist.send(torch.tensor([n, flags], dtype=torch.int64, device=dev), comm.peers[0], group=comm.group)
    if n == STOP:
        comm.stopped = True
    elif stages > 1:
        dist.send(torch.tensor(list(stage_counts), dtype=torch.int64, device=dev), comm.peers[0], group=comm.group)


def finish(comm_id: int | None = None, *, at_shutdown: bool = False) -> list[int]:
    """Attention rank: tell the FFN rank(s) this rank is done (one STOP per AFD communicator, or
    only ``comm_id``'s), so :func:`serve` on them returns once every peer has finished. Call it
    after the last step (``generate()`` returned); :func:`shutdown` calls it for the backend's
    communicators not stopped yet (``at_shutdown``). Returns the comm ids stopped; a communicator
    already stopped (or an FFN one) is skipped."""
    from .comm import registered_communicators

    done = []
    for cid, comm in sorted(registered_communicators().items()):
        if at_shutdown and not comm.finish_at_shutdown:
            continue
        if (comm_id is None or cid == comm_id) and comm.role == "attention" and not comm.stopped:
            send_control(comm, STOP)
            done.append(cid)
    return done


@dataclass
class FFNWorker:
    program: fx.GraphModule
    comm: AFDCommunicator
    device: torch.device
    stage: int = 0
    #: how a step's program runs: ``(per-peer counts, (T, 0) carrier) -> None``; the compile
    #: backend replaces it to pick the program compiled for that token layout
    run_program: Callable[[tuple[int, ...], torch.Tensor], Any] | None = None
    #: attention peers that have stopped (sent STOP); they are not served again
    left: set[int] = field(default_factory=set)
    #: micro-batch stages (passes/stages.py): the program of k stages takes one ``[T_s, 0]``
    #: tensor per stage; built on first use (stages with no token from any peer are the last ones)
    stages: int = 1
    staged: dict[int, fx.GraphModule] = field(default_factory=dict)
    #: how a staged program runs (the compile backend compiles it): applied once per program
    wrap: Callable[[fx.GraphModule], Callable[..., Any]] | None = None
    runners: dict[int, Callable[..., Any]] = field(default_factory=dict)
    #: this step's tokens per stage and peer: what a compiled program (a CUDA graph captures the
    #: per-peer receive sizes) is chosen by
    step_counts: tuple[tuple[int, ...], ...] = ()
    #: an FFN TP group (passes/ffn_tp.py): its process group and this rank's index in it; the
    #: program takes a second ``[group total, 0]`` input; each step the group's ranks exchange their
    #: token counts (:meth:`_group_step`), and a rank runs while any rank of its group has a live peer
    ffn_group: dist.ProcessGroup | None = None
    group_rank: int = 0
    group_size: int = 1
    #: the program takes the group's token count as a second input (FFN TP; EP routes by all-to-all)
    group_input: bool = False
    #: the token counts of the group's ranks this step
    group_counts: tuple[int, ...] = ()
    #: with stages: per stage the group runs, each group rank's tokens in it
    group_stage_counts: tuple[tuple[int, ...], ...] = ()
    #: the static batch of the attention peers (a static KV cache), whose micro-batches are fixed
    #: (passes/stages.static_rows); None: a dynamic batch
    static_batch: int | None = None

    def program_for(self, k: int) -> Callable[..., Any]:
        """The program of ``k`` micro-batch stages (1: the unstaged one), as it runs."""
        if k not in self.runners:
            prog = self.program if k == 1 else staged_program(
                self.staged, self.program, k, functools.partial(stage_ffn_program, batch=self.static_batch))
            self.runners[k] = self.wrap(prog) if self.wrap is not None else prog
        return self.runners[k]

    def serve(self, on_step: Callable[[tuple[int, ...]], None] | None = None) -> int:
        """Serve steps until every peer says stop; returns the number of steps served."""
        steps = 0
        while self.serve_one(on_step) is not None:
            steps += 1
        return steps

    def serve_one(self, on_step: Callable[[tuple[int, ...]], None] | None = None) -> tuple[int, ...] | None:
        """:meth:`_serve_one`; a step that raises is remembered (as :meth:`AttentionWorker.step`)."""
        try:
            return self._serve_one(on_step)
        except BaseException as e:
            _step_failed(f"FFN step: {type(e).__name__}: {e}")
            raise

    def _serve_one(self, on_step: Callable[[tuple[int, ...]], None] | None = None) -> tuple[int, ...] | None:
        """Receive one step's per-peer token counts (the control messages of the peers still
        running) and run the program once; returns the counts (0 for a peer that has left), or
        None once every peer has stopped. A peer that sends STOP leaves: later steps serve the
        others (attention ranks may finish at different steps, e.g. at EOS under ``generate()``)."""
        dev = "cuda" if self.comm.device_transport else "cpu"
        live = [p for p in self.comm.peers if p not in self.left]
        bufs = [torch.empty(2, dtype=torch.int64, device=dev) for _ in live]
        for b, p in zip(bufs, live, strict=True):
            dist.recv(b, p, group=self.comm.group)
        got = dict(zip(live, ([int(v) for v in b.tolist()] for b in bufs), strict=True))
        counts = self._check_control(got)
        per_stage = self._stage_counts(counts, dev) if self.stages > 1 and counts is not None else None
        if self.group_size > 1:
            counts = self._group_step(counts, per_stage)
        if counts is None:
            return None
        if self.stages == 1:
            per_stage = [counts]
        elif per_stage is None:  # this rank's peers have all left; its group still runs
            per_stage = [counts] * self.stages
        self.comm.set_step({s: c for s, c in enumerate(per_stage)} if self.stages > 1 else {self.stage: counts})
        if on_step:
            on_step(counts)
        if self.stages > 1 and self.group_size > 1:  # the group's stages, in lockstep (some maybe empty here)
            k = len(self.group_stage_counts)
            if k:
                self.step_counts = (tuple(per_stage[:k]), self.group_stage_counts)
                own = [torch.empty(sum(per_stage[s]), 0, device=self.device) for s in range(k)]
                group = [torch.empty(sum(c), 0, device=self.device) for c in self.group_stage_counts]
                self.program_for(k)(*own, *(group if self.group_input else ()))
            return counts
        if sum(counts):
            if self.stages > 1:
                live = [sum(c) for c in per_stage if sum(c)]
                self.step_counts = tuple(c for c in per_stage if sum(c))
                self.program_for(len(live))(*(torch.empty(t, 0, device=self.device) for t in live))
                return counts
            self._run(counts)
        elif self.group_size > 1 and sum(self.group_counts):  # no token here, some in the group: join its collectives
            self._run(counts)
        return counts

    def _run(self, counts: tuple[int, ...]) -> None:
        """The unstaged program on this step's ``(T, 0)`` carrier (and, in an FFN TP group, the
        group's ``(total, 0)``)."""
        slots = [torch.empty(sum(counts), 0, device=self.device)]
        if self.group_input:
            slots.append(torch.empty(sum(self.group_counts), 0, device=self.device))
        if self.run_program is not None:
            self.run_program(counts, *slots)
        else:
            self.program(*slots)

    def _stage_counts(self, counts: tuple[int, ...], dev: str) -> list[tuple[int, ...]]:
        """Each live peer's tokens per stage (sent after its control message), checked against its
        total; per stage, one count per peer (0 for a peer that left)."""
        by_peer = {}
        for p, n in zip(self.comm.peers, counts, strict=True):
            if p in self.left:
                by_peer[p] = [0] * self.stages
                continue
            b = torch.empty(self.stages, dtype=torch.int64, device=dev)
            dist.recv(b, p, group=self.comm.group)
            by_peer[p] = [int(v) for v in b.tolist()]
            if sum(by_peer[p]) != n or min(by_peer[p]) < 0:
                raise ControlError(f"afd: FFN rank {self.comm.rank}: attention rank {p} announced {n} tokens but "
                                   f"stage counts {by_peer[p]}")
        return [tuple(by_peer[p][s] for p in self.comm.peers) for s in range(self.stages)]

    def _group_step(self, counts: tuple[int, ...] | None,
                    per_stage: list[tuple[int, ...]] | None = None) -> tuple[int, ...] | None:
        """Exchange this rank's token count (and, with stages, its tokens per stage) with its FFN
        group (-1: every peer has left) and record the group's counts for the program's
        collectives (``comm.set_tp_step``: with stages one entry per stage the group runs, up to
        its last stage with a token anywhere in the group: ``group_stage_counts``). Returns the
        per-peer counts (zeros once this rank's peers have left while others of the group run),
        or None once every rank of the group is done."""
        from .comm import TPStep, set_tp_step

        dev = "cuda" if self.comm.device_transport else "cpu"
        # (over a static batch B each stage's tokens are padded to a multiple of B: stages._padded_tokens)
        pad = (lambda t: -(-t // self.static_batch) * self.static_batch) if self.static_batch else (lambda t: t)
        stages = ([pad(sum(c)) for c in per_stage] if per_stage is not None
                  else [0] * self.stages if self.stages > 1 else [])
        mine = torch.tensor([-1 if counts is None else sum(counts), *stages], dtype=torch.int64, device=dev)
        parts = [torch.empty_like(mine) for _ in range(self.group_size)]
        dist.all_gather(parts, mine, group=self.ffn_group)
        got = [[int(v) for v in p.tolist()] for p in parts]
        if all(g[0] < 0 for g in got):
            return None
        self.group_counts = tuple(max(g[0], 0) for g in got)
        if self.stages > 1:
            live = [s for s in range(self.stages) if any(g[1 + s] for g in got)]
            k = live[-1] + 1 if live else 0
            self.group_stage_counts = tuple(tuple(g[1 + s] for g in got) for s in range(k))
            set_tp_step([TPStep(self.group_rank, c) for c in self.group_stage_counts])
        else:
            set_tp_step(TPStep(self.group_rank, self.group_counts))
        return counts if counts is not None else tuple(0 for _ in self.comm.peers)

    def _check_control(self, messages: dict[int, list[int]]) -> tuple[int, ...] | None:
        """The per-peer counts of a step from the control messages ``[tokens, check_wire]`` of
        the peers still running (0 for a peer that left), checked: a peer sending STOP leaves;
        None once every peer has left. A negative count or a peer whose wire checks differ from
        this rank's is a ControlError naming the peer."""
        for p, (n, flags) in messages.items():
            if n == STOP:
                self.left.add(p)
                continue
            check, stages = flags & 1, (flags >> 1) + 1
            if stages != self.stages:
                raise ControlError(f"afd: FFN rank {self.comm.rank} runs {self.stages} micro-batch stage(s), attention "
                                   f"rank {p} {stages}; give every rank of the layout the same stages")
            if n < 0:
                raise ControlError(f"afd: FFN rank {self.comm.rank}: attention rank {p} announced {n} tokens for "
                                   "the next step; a token count is >= 0")
            if bool(check) != self.comm.check_wire:
                raise ControlError(f"afd: FFN rank {self.comm.rank} runs with wire checks "
                                   f"{'on' if self.comm.check_wire else 'off'}, attention rank {p} with them "
                                   f"{'on' if check else 'off'}; set AFD_CHECK_WIRE (or check_wire) alike on every rank")
        if len(self.left) == len(self.comm.peers):
            return None
        return tuple(0 if p in self.left else messages[p][0] for p in self.comm.peers)


class ControlError(AFDCompileError):
    """A per-step control message an FFN rank cannot accept."""


def make_worker(gm: fx.GraphModule, layout: AFDLayout, rank: int, config: SplitConfig | None = None,
                device: torch.device | None = None, group: dist.ProcessGroup | None = None,
                check_wire: bool | None = None, stages: int = 1, symm_mem: bool = True) -> AttentionWorker | FFNWorker:
    """Split ``gm`` and wrap this rank's program. Registers the communicator under config.comm_id
    (an attention rank reuses the one registered there when it matches: :func:`communicator_for`).
    ``check_wire``: header checks on every transfer (None: ``AFD_CHECK_WIRE``; see AFDCommunicator).
    ``stages``: micro-batches per step (passes/stages.py); every rank of the layout the same.
    ``symm_mem``: an FFN or attention TP group on CUDA all-reduces small messages over symmetric
    memory where it can (symm_mem.py); False: NCCL."""
    from .passes.pingpong import check_schedule, schedule_of_programs
    from .passes.schedule import verify_schedule

    config = config or SplitConfig()
    role, idx = layout.role_of(rank)
    # the layout's fan-in constrains the FFN program only: an attention rank's program may have a
    # static token count (a decode graph of a static cache)
    result = split_graph_module(gm, config, layout=layout if role == "ffn" else None)
    attention, ffn = result.attention, result.ffn
    size = layout.ffn_group_size
    groups = [process_group(g) for g in layout.ffn_groups()]  # every rank creates every group, in one order
    attn_groups = [process_group(g) for g in layout.attention_groups()]
    batch = static_batch(result.attention) if stages != 1 else None
    check_stage_layout(layout, stages, batch)
    if role == "attention" and layout.attn_tp > 1:
        attention, counter = attention_tp_program(gm, result, layout, idx, config, attn_groups[idx // layout.attn_tp])
    if batch is not None:  # a static batch (a static KV cache): min(stages, batch) micro-batches
        stages_built = len(static_rows(batch, stages))
    else:
        stages_built = stages
    if stages_built != 1:  # the programs of all stages built now: refused here, not at a step
        staged = stage_attention_program(attention, stages), stage_ffn_program(ffn, stages, batch=batch)
        verify_schedule(*staged)  # the two programs' transfers, stage by stage, in one order
        check_schedule(schedule_of_programs(layout, *staged))  # paired in order, no deadlock
    device = device or torch.device("cpu")
    check = wire_checks_from_env() if check_wire is None else check_wire
    if role == "attention" and layout.attn_tp > 1:
        from .comm import GROUP_ATTN_TP, GROUP_TP
        from .symm_mem import prepare_groups

        own = attn_groups[idx // layout.attn_tp]
        prepare_groups({GROUP_TP: own, GROUP_ATTN_TP: own}, device, symm_mem)
    if role == "ffn":
        comm = communicator_for("ffn", rank, layout.peers_of_ffn(idx), group, check, config.comm_id)
        worker = FFNWorker(ffn, comm, device, stages=stages, static_batch=batch)
        if size > 1:
            from .comm import GROUP_FFN_TP, register_group
            from .passes.ffn_tp import ffn_group_program
            from .symm_mem import prepare_groups

            ffn_group_program(ffn, layout.ffn_tp, layout.ffn_ep, idx % size)
            worker.ffn_group = groups[idx // size]
            register_group(GROUP_FFN_TP, worker.ffn_group)
            prepare_groups({GROUP_FFN_TP: worker.ffn_group}, device, symm_mem)
            worker.group_rank, worker.group_size, worker.group_input = idx % size, size, layout.ffn_tp > 1
        worker.program = ffn.to(device)
        if stages_built != 1:  # (a group's program: staged again, with its group inputs and collectives)
            worker.staged[stages_built] = (staged[1] if size == 1 else stage_ffn_program(ffn, stages, batch=batch)
                                           ).to(device)
        return worker
    # one communicator per comm id, shared by every graph of this rank (prefill, decode)
    comm = communicator_for("attention", rank, (layout.ffn_of_attention(idx),), group, check, config.comm_id)
    if layout.attn_tp == 1:
        counter = TokenCount.for_graph(gm, result.plan.cuts[0].token_dims)
    worker = AttentionWorker(attention.to(device), comm, counter, stages=stages,
                             batch_dim=_stage_batch_dim(result.attention, stages), static=batch is not None)
    if stages_built != 1:
        worker.staged[stages_built] = staged[0].to(device)
    return worker


def _stage_batch_dim(program: fx.GraphModule, stages: int) -> tuple[int, int] | None:
    """(input, dim) of the batch that micro-batch stages split: the dynamic batch symbol's first
    place, or a static batch's (the first input's dim 0); None with one stage."""
    if stages == 1:
        return None
    dims = batch_symbol_dims(program)[1]
    return dims[0] if dims else (0, 0)


@dataclass(frozen=True)
class GroupSlice:
    """An attention-TP rank's token count: its slice of the group's ``total`` tokens (the group
    shares its sequences; ``ops.group_token_sizes``' rule, the first ranks one row more)."""

    total: Callable[[Sequence[torch.Tensor]], int]
    parts: int
    rank: int

    def __call__(self, inputs: Sequence[torch.Tensor]) -> int:
        return self.of(self.total(inputs))

    def of(self, total: int) -> int:
        """This rank's slice of ``total`` group tokens (a step's, or a micro-batch's)."""
        from .ops import group_token_sizes

        return group_token_sizes(total, self.parts)[self.rank]


def attention_tp_program(gm: fx.GraphModule, result: object, layout: AFDLayout, idx: int, config: SplitConfig,
                         group: dist.ProcessGroup | None) -> tuple[fx.GraphModule, GroupSlice]:
    """An attention rank of an attention TP group: the model sharded over the group with every
    MLP SCATTERED over it (the scatter-mode TP rewrite with dense MLPs data-parallel: o_proj's
    partial sum reduce-scattered to this rank's slice of the group's tokens, the residual stream
    gathered back before the next attention), then cut: the slice is what this rank sends, so
    each token crosses the wire once. MoE layers (whose SCATTERED mode is expert parallelism
    inside the group) are refused for now."""
    from .comm import GROUP_ATTN_TP, GROUP_TP, register_group
    from .layout import LayoutError
    from .passes.graph_utils import propagate_meta_fresh
    from .passes.roles import annotate_roles
    from .passes.split import build_attention_program, plan_split
    from .passes.tp_rewrite import shard_for_rank
    from .scatter import TPLayout

    annotate_roles(gm, config.policy, compute_gate_on_attention=config.compute_gate_on_attention,
                   graph_name=config.graph_name)
    moe = sorted({n.meta["afd.role"].layer for n in gm.graph.nodes if n.target == torch.ops.aten.topk.default
                  and n.meta["afd.role"].layer is not None})
    if moe:
        raise LayoutError(f"AFD layout {layout}: attention TP with MoE layers ({moe}: top-k routing) is not supported "
                          "yet; use attn_tp=1 (the FFN side can still be ffn_tp / ffn_ep)")
    tp = shard_for_rank(gm, TPLayout(layout.attn_tp, dense_dp=True), idx % layout.attn_tp, config.graph_name,
                        fuse_norm=False)
    for gid in (GROUP_TP, GROUP_ATTN_TP):
        register_group(gid, group)
    propagate_meta_fresh(tp.program)  # the MLPs now run on this rank's slice: their shapes change
    annotate_roles(tp.program, config.policy, compute_gate_on_attention=config.compute_gate_on_attention,
                   graph_name=config.graph_name)
    plan = plan_split(tp.program, comm_id=config.comm_id, stage=config.stage, graph_name=config.graph_name,
                      attention_only=True)
    if [c.wire_in for c in plan.cuts] != [c.wire_in for c in result.plan.cuts]:
        raise LayoutError(f"AFD layout {layout}: the attention TP program's wire {[str(c.wire_in) for c in plan.cuts]} "
                          f"differs from the FFN program's {[str(c.wire_in) for c in result.plan.cuts]}")
    total = TokenCount.for_graph(gm, result.plan.cuts[0].token_dims)
    return build_attention_program(tp.program, plan), GroupSlice(total, layout.attn_tp, idx % layout.attn_tp)


def load_rewritten_worker(outdir: str, rank: int, device: torch.device | None = None) -> AttentionWorker | FFNWorker:
    """This rank's worker from the files ``afd-compile rewrite`` wrote (plan.json + role .pt2).

    plan.json is checked field by field and each program against the sha256 it records
    (:func:`afd_compile.saved.read_saved_plan`): a folder runs only the programs rewrite wrote
    into it. A ``.pt2`` is code (torch unpickles it): load only folders you trust."""
    from .programs import ProgramLoadError, load_program
    from .saved import read_saved_plan

    plan = read_saved_plan(outdir)
    if plan.kind != "afd":
        raise ProgramLoadError(f"{outdir}: plan.json was written by rewrite --tp (layout {plan['layout']}); "
                               "load its rank<r>.pt2 with afd_compile.programs.load_program, not as an AFD deployment")
    layout = AFDLayout(plan["layout"]["attention_ranks"], plan["layout"]["ffn_ranks"])
    role, idx = layout.role_of(rank)
    device = device or torch.device("cpu")
    comm_id = int(plan["comm_id"])
    # rewrite --stages S saves the unstaged programs and S; the staged ones are built on first use
    stages = int(plan.get("stages", 1))
    if role == "ffn":
        comm = AFDCommunicator("ffn", rank, layout.peers_of_ffn(idx))
        register_communicator(comm, comm_id)
        program = load_program(plan.path("ffn")).module().to(device)
        return FFNWorker(program, comm, device, stages=stages, static_batch=plan.get("static_batch"))
    comm = AFDCommunicator("attention", rank, (layout.ffn_of_attention(idx),))
    register_communicator(comm, comm_id)
    program = load_program(plan.path("attention")).module().to(device)
    return AttentionWorker(program, comm, TokenCount.from_json(plan["token_count"]), stages=stages,
                           batch_dim=_stage_batch_dim(program, stages), static=static_batch(program) is not None)


@dataclass(frozen=True)
class Comparison:
    """One output compared with its reference: ``max |out - ref| / max |ref|`` over every tensor,
    and what made the comparison meaningless, if anything (a non-finite value, another
    structure or shape), naming the output. ``max_rel_err`` is ``inf`` then, never NaN: Python's
    ``max(0.0, nan)`` is ``0.0``, so a NaN error would vanish in any running maximum."""

    max_rel_err: float
    problem: str | None = None
    values: int = 0  # elements compared

    def passes(self, tol: float) -> bool:
        return self.problem is None and self.values > 0 and self.max_rel_err <= tol


def _nonfinite(t: torch.Tensor) -> str | None:
    if not t.is_floating_point() and not t.is_complex():
        return None
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    return f"{nan} NaN and {inf} Inf of {t.numel()} values" if nan or inf else None


def compare(out: Any, ref: Any) -> Comparison:
    """Compare a (nested) output with the reference: see :class:`Comparison`."""
    outs, refs = _flat(out), _flat(ref)
    if len(outs) != len(refs):
        return Comparison(math.inf, f"{len(outs)} output tensors, the reference has {len(refs)}")
    err, values = 0.0, 0
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        if o.shape != r.shape:
            return Comparison(math.inf, f"output {i} has shape {tuple(o.shape)}, the reference {tuple(r.shape)}")
        o, r = o.detach(), r.detach()
        bad = _nonfinite(r)
        if bad:
            return Comparison(math.inf, f"the reference output {i} holds {bad}: nothing to compare against")
        bad = _nonfinite(o)
        if bad:
            return Comparison(math.inf, f"output {i} holds {bad}")
        if o.numel():
            denom = r.abs().max().clamp_min(1e-30).float()
            err = max(err, float((o.float() - r.float()).abs().max() / denom))
        values += o.numel()
    return Comparison(err, None, values)


def max_rel_err(out: Any, ref: Any) -> float:
    """max |out - ref| / max |ref| over all tensors of a (nested) output; ``inf`` on a structure
    or shape mismatch and on any NaN / Inf (see :func:`compare` for which output)."""
    return compare(out, ref).max_rel_err


def _flat(x: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


# --- tensor parallelism: process groups and per-step DP token counts --------------------------


def tp_groups(world: int, layouts: Sequence[TPLayout], timeout_s: float | None = None) -> dict:
    """Every process group the cases need, created in the same order on every rank; with
    ``timeout_s`` each is a new group with that timeout (else the world group where it fits)."""
    groups: dict = {}
    for lay in layouts:
        key = ("tp", lay.tp)
        if key not in groups:
            whole = lay.tp == world and timeout_s is None
            groups[key] = dist.group.WORLD if whole else process_group(range(lay.tp), timeout_s)
        for g in range(lay.attn_dp):
            ranks = tuple(range(g * lay.attn_tp, (g + 1) * lay.attn_tp))
            k = ("attn", ranks)
            if k not in groups:
                groups[k] = groups[key] if lay.attn_tp == lay.tp else process_group(ranks, timeout_s)
    return groups


def dp_step_counts(x: Sequence[torch.Tensor], lay: TPLayout, rank: int) -> tuple[int, ...]:
    """All TP ranks exchange their token counts (one small all-gather per step) and record the
    step's per-DP-group counts for the DP collectives; returns them."""
    from .comm import GROUP_TP, TPStep, get_group, set_tp_step

    own = int(x[0].numel())  # tokens of this rank's input (batch x sequence)
    group = get_group(GROUP_TP)
    dev = x[0].device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    counts = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(lay.tp)]
    dist.all_gather(counts, torch.tensor([own], device=dev), group=group)
    per_rank = [int(c) for c in counts]
    groups = [per_rank[i * lay.attn_tp] for i in range(lay.attn_dp)]
    for r, c in enumerate(per_rank):
        if c != groups[lay.attn_dp_rank(r)]:
            raise RuntimeError(f"ranks of attention DP group {lay.attn_dp_rank(r)} disagree on tokens: {per_rank}")
    set_tp_step(TPStep(lay.attn_dp_rank(rank), tuple(groups)))
    return tuple(groups)


# --- local launch ------------------------------------------------------------------------------

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


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any, timeout_s: float,
           env: dict[str, str]) -> None:
    global _PROGRESS
    _die_with_parent()
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
        # this rank reported its result; the barrier at exit failed because a peer is gone, and
        # that peer reports its own failure: exiting nonzero here would blame this rank for it


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
    port = _free_port()
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
    launcher.start()
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
