"""The AFD worker protocol: what an attention rank and an FFN rank do each step, and how a
rank leaves.

- an **attention rank** per step sends its token count to its FFN rank (one small control message
  per step, not per layer; host tensors on the communicator's ``control_group``, a gloo group
  beside the exchange's, so neither side waits on the device for it), then runs the attention
  program, whose ``afd::p2p_send`` /
  ``afd::p2p_recv`` ops exchange hidden states with the FFN rank at every layer;
- an **FFN rank** per step receives the token count of every attention peer, stores them as the
  step's transfer metadata, and runs the FFN program on a ``(T, 0)`` token carrier. A count of -1
  (:data:`STOP`) from every peer ends the loop.

The workers only run programs: every program they run (each number of micro-batch stages
included) is built before, by :mod:`afd_compile.deploy`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from ..buckets import TokenBuckets
from ..comm import AFDCommunicator, TPStep
from ..layout import micro_batches
from . import slots
from .control import FAILED, STOP, ControlError, finish, send_control, tell_failed
from .dist import forget_groups
from .pad_batch import BatchPad
from .tokens import GroupSlice, TokenCount

log = logging.getLogger("afd_compile.runtime")



#: what runs before the process group is destroyed (:func:`before_destroy`), in registration order
_BEFORE_DESTROY: list[Callable[[], None]] = []


def before_destroy(hook: Callable[[], None]) -> None:
    """Run ``hook`` in :func:`shutdown` before the process group is destroyed (once per hook, however
    often it is registered). The compile backend registers its ``release`` here: a CUDA graph that
    captured an NCCL operation keeps its communicator from being destroyed."""
    if hook not in _BEFORE_DESTROY:
        _BEFORE_DESTROY.append(hook)


def shutdown(sync: bool = True) -> None:
    """Leave the process group cleanly: free the compiled programs and their CUDA graphs first
    (the hooks registered with :func:`before_destroy`: the backend's ``release``; a graph that
    captured an NCCL operation keeps its communicator from being destroyed, and the process would
    hang at exit), then
    ``destroy_process_group``. ``sync`` (the normal end, every rank calling it): a barrier first,
    so no rank closes its connections while a peer is still communicating (gloo aborted a rank at
    exit now and then under load: "terminate called without an active exception"); pass False
    on an error path, where the peers may never arrive: then no STOP is sent to, or heard from,
    an AFD peer either (a peer mid-step would not take it, and this rank would wait on it until
    the timeout)."""
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
            for w in _SERVE_AT_SHUTDOWN:  # workers of several graphs share a communicator: serve it once
                by_comm.setdefault(id(w.comm), []).append(w)
            for workers in by_comm.values():
                w = workers[-1]
                w.left.update(*(x.left for x in workers))
                if len(w.left) < len(w.comm.peers):
                    w.serve()
        except Exception as e:  # a peer already gone
            log.warning("afd: shutdown: FFN rank could not hear every attention peer stop: %s", e)
        _SERVE_AT_SHUTDOWN.clear()
    for hook in list(_BEFORE_DESTROY):  # (the backend's release(): registered when it compiles)
        hook()
    forget_groups()
    if dist.is_initialized():
        if sync:
            dist.barrier()
        dist.destroy_process_group()


#: what failed in a worker step of this process (None: nothing): a later stop() / shutdown()
#: exchanges nothing with the peers
_FAILED_STEP: str | None = None


def step_failed(what: str) -> None:
    """Record that a step (or the build of this rank's program) failed on this process: a later
    ``stop()`` / ``shutdown()`` exchanges nothing with the peers, who may never arrive."""
    global _FAILED_STEP
    if _FAILED_STEP is None:
        _FAILED_STEP = what


#: FFN workers the compile backend runs one step per call (:func:`serve_at_shutdown`)
_SERVE_AT_SHUTDOWN: list[FFNWorker] = []


def serve_at_shutdown(worker: FFNWorker) -> None:
    """:func:`shutdown` serves ``worker`` until every attention peer has stopped (the peers'
    shutdown sends STOP): the compile backend's FFN workers, which run one step per call."""
    _SERVE_AT_SHUTDOWN.append(worker)


@dataclass
class AttentionWorker:
    program: fx.GraphModule
    comm: AFDCommunicator
    count_tokens: TokenCount
    #: micro-batch stages (passes/stages.py): the program takes one ``[b_s, 0]`` tensor per stage
    #: after the model's inputs, ``b_s`` the sequences of micro-batch ``s``
    stages: int = 1
    #: (input, dim) of the batch (sequences), where ``stages`` > 1 splits it
    batch_dim: tuple[int, int] | None = None
    #: the batch is static (a static KV cache): the staged program's micro-batches are fixed and
    #: it takes no ``[b_s, 0]`` inputs
    static: bool = False
    #: the program of k micro-batches for each k a step can take (k < stages when a step has fewer
    #: sequences than stages: the empty micro-batches are the last ones and have no transfer)
    staged: dict[int, fx.GraphModule] = field(default_factory=dict)
    #: how a program runs (the compile backend compiles it): applied once per program
    wrap: Callable[[fx.GraphModule], Callable[..., Any]] | None = None
    runners: dict[int, Callable[..., Any]] = field(default_factory=dict)
    #: token buckets (buckets.py): this rank's tokens cross the wire in a slot of
    #: ``slot_unit * buckets.slot(n / slot_unit)`` rows, so its FFN rank sees bucketed sizes only;
    #: None: the exact count (also for a static token count, which never changes)
    buckets: TokenBuckets | None = None
    #: the granularity of the token count (its static factor: a static batch of a static cache);
    #: the FFN program views the tokens in groups of it
    slot_unit: int = 1
    #: a fixed slot with stages: how a batch of fewer sequences than stages is padded to one a stage
    batch_pad: BatchPad | None = None
    #: a fixed slot: this worker's transfers and ghost stages (``slots.prepare``), set on the
    #: communicator each step (the programs of one rank, prefill and decode, share it)
    wire: tuple = ()
    ghosts: dict | None = None
    #: the micro-batches of its program when fewer than ``stages`` (a static batch; the others
    #: cross in zeros: ``ghosts``)
    real_stages: int | None = None

    def slot(self, n: int) -> int:
        """The rows ``n`` tokens take on the wire this step."""
        return n if self.buckets is None or self.static else self.buckets.padded(n, self.slot_unit)

    def program_for(self, k: int) -> Callable[..., Any]:
        """The program of ``k`` micro-batches (1: the unstaged one), as it runs."""
        if k not in self.runners:
            prog = self.program if k == 1 else program_of(self.staged, k, "attention")
            self.runners[k] = self.wrap(prog) if self.wrap is not None else prog
        return self.runners[k]

    def step(self, *inputs: torch.Tensor) -> Any:
        """One step: the control message to the FFN rank, then the program. A step that raises is
        remembered: :meth:`stop` and :func:`shutdown` then leave without exchanging anything with
        the peers (an FFN rank mid-step would not take a STOP, and this rank would wait on it)."""
        try:
            return self._step(*inputs)
        except BaseException as e:
            step_failed(f"attention step: {type(e).__name__}: {e}")
            tell_failed(self.comm)
            raise

    def _step(self, *inputs: torch.Tensor) -> Any:
        slice_of = self.count_tokens if isinstance(self.count_tokens, GroupSlice) else None
        # an attention TP rank whose slice is empty still runs: its group's collectives need it
        total = slice_of.total(inputs) if slice_of is not None else self.count_tokens(inputs)
        n = slice_of.of(total) if slice_of is not None else total
        if self.comm.fixed_slot is not None:
            return self._fixed_step(inputs, n, total, slice_of)
        if self.stages == 1:
            slot = self.slot(n)
            send_control(self.comm, slot)
            self.comm.set_step({0: (n,)}, {0: slot})  # (an unstaged step: stage 0)
            return self.program_for(1)(*inputs) if total else None
        assert self.batch_dim is not None
        batch = int(inputs[self.batch_dim[0]].shape[self.batch_dim[1]])
        per_seq = total // batch if batch else 0
        rows = [end - start for start, end in micro_batches([per_seq] * batch, self.stages)]
        # this rank's tokens per stage: with attention TP its slice of each micro-batch's tokens
        counts = tuple(r * per_seq if slice_of is None else slice_of.of(r * per_seq) for r in rows)
        # (with attention TP: its slices, each micro-batch split over the group apart); on the wire
        # each stage takes its bucket slot
        slots = tuple(self.slot(c) for c in counts)
        send_control(self.comm, sum(slots), slots)
        self.comm.set_step({s: (c,) for s, c in enumerate(counts)}, dict(enumerate(slots)))
        if total == 0:
            return None
        rows = [r for r in rows if r]
        if len(rows) == 1:
            return self.program_for(1)(*inputs)
        if self.static:
            return self.program_for(len(rows))(*inputs)
        dev = inputs[self.batch_dim[0]].device
        return self.program_for(len(rows))(*inputs, *(torch.empty(r, 0, device=dev) for r in rows))

    def _fixed_step(self, inputs: Sequence[torch.Tensor], n: int, total: int, slice_of: GroupSlice | None) -> Any:
        """A step in a fixed slot (runtime/slots.py): its headers, then the program (its sends carry
        them); every stage runs (an empty micro-batch sends its slot of zeros), and with no token
        the step is all zeros (the FFN rank receives every stage of every step)."""
        comm, slot, flags = self.comm, self.comm.fixed_slot, int(self.comm.check_wire) | (self.stages - 1) << 1
        assert slot is not None
        if self.wire:
            comm.schedule, comm.ghosts = self.wire, self.ghosts
        counts, rows = [n], []
        if self.stages > 1:
            assert self.batch_dim is not None
            batch = int(inputs[self.batch_dim[0]].shape[self.batch_dim[1]])
            # (every stage runs: a sequence each, the last repeated, its outputs dropped; a static
            # batch's missing stages cross in zeros instead: ghosts)
            if 0 < batch < self.stages and not self.static:
                pad = self.batch_pad
                if pad is None:
                    raise slots.FixedSlotError(f"afd: attention rank {comm.rank}: {batch} sequences for {self.stages} "
                                               "stages, and no way to pad its batch was built (deploy builds it)")
                padded, _ = pad.pad(inputs)
                more = self.count_tokens.total(padded) if slice_of is not None else self.count_tokens(padded)
                return pad.cut(self._fixed_step(padded, slice_of.of(more) if slice_of else more, more, slice_of),
                               batch)
            per_seq = total // batch if batch else 0
            rows = [end - start for start, end in micro_batches([per_seq] * batch, self.stages)]
            counts = [r * per_seq if slice_of is None else slice_of.of(r * per_seq) for r in rows]
        slots.set_header(comm, counts, flags)
        if max(counts) > slot:
            raise slots.FixedSlotError(f"afd: attention rank {comm.rank}: {max(counts)} tokens in a stage of this "
                                       f"step, more than the fixed slot of {slot} rows; give a larger slot "
                                       "('fixed:N', N the most tokens a rank sends in a stage) or a bucket list")
        comm.set_step({s: (c,) for s, c in enumerate(counts)}, {s: slot for s in range(self.stages)})
        if total == 0:
            slots.owe(comm, 0, flags)
            return None
        if self.stages == 1 or self.static:  # (a static batch's micro-batches are fixed: no carriers)
            return self.program_for(self.real_stages or self.stages)(*inputs)
        dev = inputs[self.batch_dim[0]].device
        return self.program_for(self.stages)(*inputs, *(torch.empty(r, 0, device=dev) for r in rows))

    def stop(self) -> None:
        if _FAILED_STEP is not None:
            log.warning("afd: stop: not sent, a step failed on this rank (%s)", _FAILED_STEP)
            return
        send_control(self.comm, STOP)


def program_of(staged: dict[int, fx.GraphModule], k: int, role: str) -> fx.GraphModule:
    """The program of ``k`` micro-batch stages, which the builder made (deploy.py)."""
    if k not in staged:
        raise RuntimeError(f"afd: {role} worker: no program of {k} micro-batch stages was built (built: "
                           f"{sorted(staged)}); afd_compile.deploy builds one per stage count a step can take")
    return staged[k]


@dataclass
class FFNWorker:
    program: fx.GraphModule
    comm: AFDCommunicator
    device: torch.device
    #: attention peers that have stopped (sent STOP); they are not served again
    left: set[int] = field(default_factory=set)
    #: micro-batch stages (passes/stages.py): the program of k stages takes one ``[T_s, 0]``
    #: tensor per stage; one for each k a step can take (stages with no token from any peer are the last ones)
    stages: int = 1
    staged: dict[int, fx.GraphModule] = field(default_factory=dict)
    #: how a program runs (the compile backend compiles it; it reads :attr:`step_counts` at each
    #: call): applied once per program, the unstaged one included
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
    #: every token layout a program ran for (per stage and peer, and the group's): what a compiling
    #: runner compiles one program for (a CUDA graph captures the per-peer receive sizes)
    layouts: set[tuple] = field(default_factory=set)
    #: every tuple of carrier sizes a program ran on (the tokens of each stage, and the group's):
    #: what a compiled program that is not captured in a CUDA graph depends on (the per-peer sizes
    #: are read when the exchange runs)
    carriers: set[tuple[int, ...]] = field(default_factory=set)
    #: token buckets of the program's rows (buckets.py): each stage's tokens (the sum of its peers'
    #: slots) run padded to ``token_unit * buckets.slot(t / token_unit)`` rows, so a program not
    #: captured in a CUDA graph (compiled per carrier sizes) is one per bucket; None: exact rows
    buckets: TokenBuckets | None = None
    #: what every token count of the program is a multiple of (passes/split.TOKEN_MULTIPLE)
    token_unit: int = 1
    #: the gloo group beside ``ffn_group`` its token counts travel on (runtime.control_group);
    #: None: on ``ffn_group``
    ffn_control_group: dist.ProcessGroup | None = None
    #: messages read on the host since this worker was made (control messages, stage counts, the
    #: FFN group's counts)
    control_reads: int = 0
    #: those of them that travelled on an NCCL group: each a device-to-host wait on the step path
    #: (it waits for everything queued on the stream before it); 0 with a control group
    device_reads: int = 0
    #: steps whose fixed-slot headers were read after the step ran (runtime/slots.py)
    header_reads: int = 0
    #: an FFN group's in-band agreement under a fixed slot (its ranks' rows, gone peers, failures)
    slot_group: slots.GroupAgreement | None = None

    def rows(self, tokens: int) -> int:
        """The rows a program runs for ``tokens`` received tokens (padded to a bucket: rows that
        :func:`afd_compile.ops.p2p_recv_group` appends and ``p2p_send_group`` drops)."""
        return tokens if self.buckets is None or self.static_batch else self.buckets.padded(tokens, self.token_unit)

    def program_for(self, k: int) -> Callable[..., Any]:
        """The program of ``k`` micro-batch stages (1: the unstaged one), as it runs."""
        if k not in self.runners:
            prog = self.program if k == 1 else program_of(self.staged, k, "FFN")
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
            step_failed(f"FFN step: {type(e).__name__}: {e}")
            raise

    def _serve_one(self, on_step: Callable[[tuple[int, ...]], None] | None = None) -> tuple[int, ...] | None:
        """Receive one step's per-peer token counts (the control messages of the peers still
        running) and run the program once; returns the counts (0 for a peer that has left), or
        None once every peer has stopped. A peer that sends STOP leaves: later steps serve the
        others (attention ranks may finish at different steps, e.g. at EOS under ``generate()``)."""
        if self.comm.fixed_slot is not None:
            return self._serve_fixed(on_step)
        live = [p for p in self.comm.peers if p not in self.left]
        got = dict(zip(live, self._receive(live, 2), strict=True))
        counts = self._check_control(got)
        per_stage = self._stage_counts(counts) if self.stages > 1 and counts is not None else None
        if self.group_size > 1:
            counts = self._group_step(counts, per_stage)
        if counts is None:
            return None
        if self.stages == 1:
            per_stage = [counts]
        elif per_stage is None:  # this rank's peers have all left; its group still runs
            per_stage = [counts] * self.stages
        per = {s: c for s, c in enumerate(per_stage)} if self.stages > 1 else {0: counts}  # (unstaged: stage 0)
        self.comm.set_step(per)
        self.comm.step_rows = {s: self.rows(sum(c)) for s, c in per.items()}
        if on_step:
            on_step(counts)
        if self.stages > 1 and self.group_size > 1:  # the group's stages, in lockstep (some maybe empty here)
            k = len(self.group_stage_counts)
            if k:
                self.step_counts = (tuple(per_stage[:k]), self.group_stage_counts)
                own = [torch.empty(self.rows(sum(per_stage[s])), 0, device=self.device) for s in range(k)]
                group = [torch.empty(sum(c), 0, device=self.device) for c in self.group_stage_counts]
                self._launch(self.program_for(k), [*own, *(group if self.group_input else ())])
            return counts
        if sum(counts):
            if self.stages > 1:
                live = [self.rows(sum(c)) for c in per_stage if sum(c)]
                self.step_counts = tuple(c for c in per_stage if sum(c))
                self._launch(self.program_for(len(live)), [torch.empty(t, 0, device=self.device) for t in live])
                return counts
            self._run(counts)
        elif self.group_size > 1 and sum(self.group_counts):  # no token here, some in the group: join its collectives
            self._run(counts)
        return counts

    def _serve_fixed(self, on_step: Callable[[tuple[int, ...]], None] | None) -> tuple[int, ...] | None:
        """A step in a fixed slot (runtime/slots.py): every live peer's slot received, nothing read
        first; the headers read after the step give the counts (and STOP / FAILED). In an FFN
        group the rows never change (a gone peer's are padding) and its ranks agree in band
        (``slots.GroupAgreement``)."""
        comm, slot, agree = self.comm, self.comm.fixed_slot, self.slot_group
        assert slot is not None
        live = [p for p in comm.peers if p not in self.left]
        if not live and agree is None:
            return None
        sizes = tuple(0 if p in self.left else slot for p in comm.peers)
        comm.set_step(dict.fromkeys(range(self.stages), sizes))
        rows, group = sum(sizes), []
        if agree is not None:
            rows = slot * len(comm.peers)
            comm.step_rows = dict.fromkeys(range(self.stages), rows)
            self.group_counts, self.group_stage_counts = agree.rows, (agree.rows,) * self.stages
            group = [torch.empty(sum(agree.rows), 0, device=self.device)] * self.stages if self.group_input else []
        self.step_counts = (sizes,) * self.stages if self.stages > 1 else (sizes, ())
        self._launch(self.program_for(self.stages), [torch.empty(rows, 0, device=self.device)] * self.stages + group)
        if agree is not None:
            agree.post()
        heads = slots.read_headers(comm, live)
        self.header_reads += 1
        msgs = {p: slots.step_message(h.values(), FAILED) for p, h in heads.items()}
        failed = [p for p, (n, _) in msgs.items() if n == FAILED] if agree is not None else []
        self.left.update(failed)  # (a group goes on one step, then every rank raises: _group_verdict)
        counts = self._check_control({p: m for p, m in msgs.items() if p not in failed})
        over = [(p, t) for p, h in heads.items() for t, _ in h.values() if t > slot]
        if over:
            raise ControlError(f"afd: FFN rank {comm.rank}: attention rank {over[0][0]}'s header says {over[0][1]} "
                               f"tokens, more than the fixed slot of {slot} rows")
        if agree is not None and self._group_verdict(agree, failed):
            return None
        if counts is None and agree is None:  # (the last peers' stop: a step of zeros, not one served)
            return None
        counts = tuple(slots.step_tokens(heads[p]) if p in heads and p not in failed else 0 for p in comm.peers)
        if on_step:
            on_step(counts)
        return counts

    def _group_verdict(self, agree: slots.GroupAgreement, failed: list[int]) -> bool:
        """This rank's state for the next step, then what its group posted this step: True when
        every rank's peers have gone (the group stops together); a rank's failed peer raises here
        on every rank of the group, naming it."""
        if failed and agree.state[0] != slots.PEER_FAILED:
            agree.state = (slots.PEER_FAILED, failed[0])
        elif agree.state[0] == slots.SERVING and len(self.left) == len(self.comm.peers):
            agree.state = (slots.DONE, -1)
        got = agree.read()
        bad = next(((r, p) for r, (s, p) in enumerate(got) if s == slots.PEER_FAILED), None)
        if bad is not None:
            raise ControlError(f"afd: FFN rank {self.comm.rank}: attention rank {bad[1]} (a peer of FFN group rank "
                               f"{bad[0]}) failed its step (it said so in its fixed slot's header); the FFN group "
                               "stops serving")
        return all(s == slots.DONE for s, _ in got)

    def _run(self, counts: tuple[int, ...]) -> None:
        """The unstaged program on this step's ``(T, 0)`` carrier (and, in an FFN TP group, the
        group's ``(total, 0)``)."""
        slots = [torch.empty(self.rows(sum(counts)), 0, device=self.device)]
        if self.group_input:
            slots.append(torch.empty(sum(self.group_counts), 0, device=self.device))
        self.step_counts = (counts, self.group_counts)
        self._launch(self.program_for(1), slots)

    def _launch(self, program: Callable[..., Any], carriers: list[torch.Tensor]) -> None:
        """Run a step's program on its token carriers, recording the step's layouts; an FFN
        group's counts are the step's (``comm.step_counts``) while it runs."""
        from ..comm import step_counts

        self.layouts.add(self.step_counts)
        self.carriers.add(tuple(int(c.shape[0]) for c in carriers))
        counts = self.group_stage_counts if self.stages > 1 else (self.group_counts,)
        with step_counts(tuple(TPStep(self.group_rank, c) for c in counts) if self.group_size > 1 else ()):
            program(*carriers)

    def _receive(self, peers: Sequence[int], width: int) -> list[list[int]]:
        """One message of ``width`` int64 from each of ``peers`` on the control group, read on
        the host at once (counted: :attr:`control_reads`, and :attr:`device_reads` when it
        travelled on the device)."""
        dev = self.comm.control_device
        bufs = torch.empty(len(peers), width, dtype=torch.int64, device=dev)
        for i, p in enumerate(peers):
            dist.recv(bufs[i], p, group=self.comm.control_peer_group)
        self.control_reads += 1
        self.device_reads += dev != "cpu"
        return bufs.tolist()

    def _stage_counts(self, counts: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Each live peer's tokens per stage (sent after its control message), checked against its
        total; per stage, one count per peer (0 for a peer that left)."""
        live = [p for p in self.comm.peers if p not in self.left]
        by_peer = {p: [0] * self.stages for p in self.left} | dict(zip(live, self._receive(live, self.stages),
                                                                      strict=True))
        for p, n in zip(self.comm.peers, counts, strict=True):
            if p not in self.left and (sum(by_peer[p]) != n or min(by_peer[p]) < 0):
                raise ControlError(f"afd: FFN rank {self.comm.rank}: attention rank {p} announced {n} tokens but "
                                   f"stage counts {by_peer[p]}")
        return [tuple(by_peer[p][s] for p in self.comm.peers) for s in range(self.stages)]

    def _group_step(self, counts: tuple[int, ...] | None,
                    per_stage: list[tuple[int, ...]] | None = None) -> tuple[int, ...] | None:
        """Exchange this rank's token count (and, with stages, its tokens per stage) with its FFN
        group (-1: every peer has left) and record the group's counts for the program's
        collectives (``group_counts``; with stages one entry per stage the group runs, up to its
        last stage with a token anywhere in the group: ``group_stage_counts``). Returns the
        per-peer counts (zeros once this rank's peers have left while others of the group run),
        or None once every rank of the group is done."""
        group = self.ffn_control_group if self.ffn_control_group is not None else self.ffn_group
        dev = "cuda" if self.ffn_control_group is None and dist.get_backend(group) == "nccl" else "cpu"
        # (over a static batch B each stage's tokens are padded to a multiple of B: stages._padded_tokens)
        # (else each stage's rows: its tokens padded to a bucket, self.rows)
        pad = (lambda t: -(-t // self.static_batch) * self.static_batch) if self.static_batch else self.rows
        stages = ([pad(sum(c)) for c in per_stage] if per_stage is not None
                  else [0] * self.stages if self.stages > 1 else [])
        mine = torch.tensor([-1 if counts is None else self.rows(sum(counts)), *stages], dtype=torch.int64, device=dev)
        parts = [torch.empty_like(mine) for _ in range(self.group_size)]
        dist.all_gather(parts, mine, group=group)
        got = torch.stack(parts).tolist()
        self.control_reads += 1
        self.device_reads += dev != "cpu"
        if all(g[0] < 0 for g in got):
            return None
        self.group_counts = tuple(max(g[0], 0) for g in got)
        if self.stages > 1:
            live = [s for s in range(self.stages) if any(g[1 + s] for g in got)]
            k = live[-1] + 1 if live else 0
            self.group_stage_counts = tuple(tuple(g[1 + s] for g in got) for s in range(k))
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
            if n == FAILED:
                raise ControlError(f"afd: FFN rank {self.comm.rank}: attention rank {p} failed its step (it said so "
                                   "on the control group; its own error says why); this rank stops serving")
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
                                   f"{'on' if check else 'off'}; set AFD_CHECK_WIRE (or check_wire) alike "
                                   "on every rank")
        if len(self.left) == len(self.comm.peers):
            return None
        return tuple(0 if p in self.left else messages[p][0] for p in self.comm.peers)
