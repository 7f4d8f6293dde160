"""The ``afd::`` custom ops that carry hidden states between attention and FFN ranks.

Four ops, as in seed 000, each with a fake implementation so dynamo, AOT, Inductor and CUDA graph
capture keep them:

- ``afd::p2p_send(tensors, comm_id, layer_idx, stage_idx, spec) -> token``: an attention rank sends
  its wire tensors (hidden, then optional router logits, then optional token ids) to its FFN rank.
- ``afd::p2p_recv(dep, comm_id, layer_idx, stage_idx, num_tokens, spec) -> [tensor]``: an attention
  rank receives the FFN output for its own tokens. ``dep`` is the token of the matching send, so
  no compiler can move the receive ahead of the send.
- ``afd::p2p_recv_group(dep, comm_id, layer_idx, stage_idx, total_tokens, spec) -> [tensor]``: an
  FFN rank receives from every attention peer in one batched call and concatenates along tokens.
- ``afd::p2p_send_group(tensors, comm_id, layer_idx, stage_idx, spec) -> token``: an FFN rank
  splits its output by the step's per-peer token counts and returns each slice to its producer.

An FFN program compiled by the backend runs each ``p2p_send_group`` and the ``p2p_recv_group``
right after it as one ``afd::p2p_send_recv_group`` (one batched call; passes/fuse_exchange.py).

Every op is registered as side-effecting (``torch.fx.node.has_side_effect``), so a send whose token
is unused is not dead-code-eliminated. Each op waits for its transfers before returning, on the
current stream, so buffers are never reused while in flight and the ops are capturable.
Metadata checks run outside tracing only (``torch.compiler.is_compiling()``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch.fx.node import has_side_effect

from .comm import AFDCommunicator, Transfer, TransferMetadata, get_communicator
from .oplib import afd_op
from .wire import WireSpec


@functools.cache
def _spec(text: str) -> WireSpec:
    """A wire spec string, parsed once: the ops run per layer and per step."""
    return WireSpec.parse(text)


def split_sizes(total: int, seq_lens: Sequence[int], n_peers: int, where: str) -> list[int]:
    """Per-peer token counts: the recorded lengths, or an even split when they do not cover
    every peer (seed 000), which raises if the tokens do not divide."""
    if len(seq_lens) == n_peers:
        if sum(seq_lens) != total:
            raise ValueError(
                f"{where}: shape mismatch: {total} tokens but the metadata seq_lens {list(seq_lens)} "
                f"sum to {sum(seq_lens)}"
            )
        return list(seq_lens)
    if total % n_peers:
        raise ValueError(
            f"{where}: uneven split: seq_lens {list(seq_lens)} do not cover the {n_peers} peers, and "
            f"the even fallback cannot split {total} tokens {n_peers} ways"
        )
    return [total // n_peers] * n_peers


def check_wire_tensors(
    tensors: Sequence[torch.Tensor],
    spec: WireSpec,
    meta: TransferMetadata | None,
    comm: AFDCommunicator,
    where: str,
) -> None:
    """The seed-000 checks on what a rank is about to send. Runs outside tracing."""
    if len(tensors) != len(spec.tensors):
        raise ValueError(f"{where}: expected {len(spec.tensors)} tensors ({spec}), got {len(tensors)}")
    tokens = tensors[0].shape[0] if tensors[0].dim() else -1
    for t, w in zip(tensors, spec.tensors, strict=True):
        if t.device.type == "cpu" and comm.device_transport:  # (the transport looked up for CPU tensors only)
            raise ValueError(
                f"{where}: {w.kind} is a CPU tensor but rank {comm.rank}'s transport is NCCL, "
                "which moves CUDA tensors only; move the program to the GPU"
            )
        if w.kind == "token_ids":
            if t.dim() != 1 or t.dtype != torch.int32:
                raise ValueError(
                    f"{where}: token_ids must be a 1-D int32 tensor, got shape {tuple(t.shape)} "
                    f"dtype {t.dtype}"
                )
        if w.kind == "router_logits" and (t.dim() == 0 or t.shape[0] != tokens):
            raise ValueError(
                f"{where}: router_logits must be token-aligned with hidden: shape "
                f"{tuple(t.shape)} vs hidden tokens {tokens}"
            )
        if w.kind == "token_ids" and t.shape[0] != tokens:
            raise ValueError(
                f"{where}: token_ids must be token-aligned with hidden: {t.shape[0]} vs {tokens}"
            )
        if tuple(t.shape[1:]) != w.shape(0)[1:] or t.dtype != w.dtype:
            raise ValueError(
                f"{where}: {w.kind} has shape {tuple(t.shape)} dtype {t.dtype}, "
                f"the wire spec says {w}"
            )
    if meta is not None and not meta.validate_tensor_shape(tuple(tensors[0].shape)):
        raise ValueError(
            f"{where}: shape mismatch: hidden has shape {tuple(tensors[0].shape)} but the transfer "
            f"metadata says {meta.total_tokens} tokens (seq_lens {list(meta.seq_lens)})"
        )


def _where(op: str, comm: AFDCommunicator, layer_idx: int, stage_idx: int) -> str:
    return f"afd.{op} ({comm.role} rank {comm.rank}, layer {layer_idx}, stage {stage_idx})"


def _token(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, device=like.device)


# --- attention side ---------------------------------------------------------------------------


def _attention_sends(tensors: list[torch.Tensor], comm_id: int, layer_idx: int, stage_idx: int, spec: str,
                     op: str) -> tuple[AFDCommunicator, str, list]:
    """An attention rank's send to its FFN rank, checked: (communicator, where, transfers)."""
    comm = get_communicator(comm_id)
    where = _where(op, comm, layer_idx, stage_idx)
    wspec = _spec(spec)
    if not torch.compiler.is_compiling():
        check_wire_tensors(tensors, wspec, comm.metadata(layer_idx, stage_idx), comm, where)
    tensors = padded_to_slot(tensors, comm.slot(stage_idx, int(tensors[0].shape[0])))
    return comm, where, [(t, comm.peers[0], w.kind) for t, w in zip(tensors, wspec.tensors, strict=True)]


def padded_to_slot(tensors: Sequence[torch.Tensor], slot: int) -> list[torch.Tensor]:
    """``tensors`` (token-aligned) padded up to ``slot`` rows: what crosses the wire under token
    buckets (buckets.py); unchanged when they already have ``slot`` rows. The padding repeats the
    last row (:func:`pad_rows`)."""
    return [pad_rows(t, slot) for t in tensors]


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with its last row repeated up to ``rows`` rows (zeros when it has none). A repeated
    real row makes an MoE route the padding to experts the step reads anyway: no expert weights
    are read for it (zero rows would choose experts of their own); its results are dropped."""
    n = int(t.shape[0])
    if rows <= n:
        return t
    fill = t[-1:].expand(rows - n, *t.shape[1:]) if n else t.new_zeros((rows, *t.shape[1:]))
    return torch.cat([t, fill], dim=0)


def _attention_recv_buffers(dep: torch.Tensor, comm_id: int, layer_idx: int, stage_idx: int, num_tokens: int,
                            spec: str, op: str) -> tuple[AFDCommunicator, str, list, list[torch.Tensor]]:
    """An attention rank's receive from its FFN rank, checked against the step's token count:
    (communicator, where, transfers, the buffers they fill)."""
    comm = get_communicator(comm_id)
    where = _where(op, comm, layer_idx, stage_idx)
    wspec = _spec(spec)
    if not torch.compiler.is_compiling():
        meta = comm.metadata(layer_idx, stage_idx)
        if meta.total_tokens != num_tokens:
            raise ValueError(
                f"{where}: shape mismatch: expecting "
                f"{num_tokens} tokens but the transfer metadata says {meta.total_tokens}"
            )
    # under token buckets the FFN rank returns the whole slot; the rows past num_tokens are dropped
    slot = comm.slot(stage_idx, num_tokens)
    outs = [torch.empty(w.shape(slot), dtype=w.dtype, device=dep.device) for w in wspec.tensors]
    return comm, where, [(t, comm.peers[0], w.kind) for t, w in zip(outs, wspec.tensors, strict=True)], outs


def _own_rows(outs: Sequence[torch.Tensor], num_tokens: int) -> list[torch.Tensor]:
    """The first ``num_tokens`` rows of each received slot (all of it without buckets)."""
    return [o if o.shape[0] == num_tokens else o[:num_tokens].clone() for o in outs]


@afd_op("afd::p2p_send", mutates_args=())
def p2p_send(
    tensors: list[torch.Tensor], comm_id: int, layer_idx: int, stage_idx: int, spec: str
) -> torch.Tensor:
    comm, where, sends = _attention_sends(tensors, comm_id, layer_idx, stage_idx, spec, "p2p_send")
    comm.exchange(sends, [], layer_idx=layer_idx, stage_idx=stage_idx, where=where)
    return _token(tensors[0])


@p2p_send.register_fake
def _(tensors, comm_id, layer_idx, stage_idx, spec):
    return torch.empty(0, device=tensors[0].device)


@afd_op("afd::p2p_recv", mutates_args=())
def p2p_recv(
    dep: torch.Tensor, comm_id: int, layer_idx: int, stage_idx: int, num_tokens: int, spec: str
) -> list[torch.Tensor]:
    comm, where, recvs, outs = _attention_recv_buffers(dep, comm_id, layer_idx, stage_idx, num_tokens, spec,
                                                       "p2p_recv")
    comm.exchange([], recvs, layer_idx=layer_idx, stage_idx=stage_idx, where=where)
    return _own_rows(outs, num_tokens)


@p2p_recv.register_fake
def _(dep, comm_id, layer_idx, stage_idx, num_tokens, spec):
    return [
        torch.empty(w.shape(num_tokens), dtype=w.dtype, device=dep.device)
        for w in _spec(spec).tensors
    ]


# --- attention side, asynchronous (micro-batch stages) ------------------------------------------
#
# A staged attention program (passes/stages.py) starts the transfers of micro-batch s and goes on
# computing micro-batch s + 1; it waits for them where the FFN output is first used:
#
#   token  = afd::p2p_send_start(tensors, comm_id, layer, stage, spec, dep)   # posts the send
#   handle = afd::p2p_recv_start(token, comm_id, layer, stage, num_tokens, spec)   # posts the receive
#   ... the next micro-batch's work ...
#   outs   = afd::p2p_recv_wait(handle, comm_id, layer, stage, num_tokens, spec, tensors, dep)
#
# The works and the tensors in flight (the sent ones stay alive until the wait) are held by the
# communicator (AFDCommunicator.in_flight), keyed by (layer, stage, direction): unique within a
# step. On NCCL a work's wait() makes the current stream wait for the transfer, not the host, so
# the three ops are capturable.

def _hold(comm: AFDCommunicator, key: tuple[int, int, str], works: list, tensors: list[torch.Tensor],
          where: str) -> None:
    if key in comm.in_flight:
        raise RuntimeError(f"{where}: a {key[2]} of this layer and stage is already in flight (started twice "
                           "without a wait in between)")
    comm.in_flight[key] = (works, tensors)


@afd_op("afd::p2p_send_start", mutates_args=())
def p2p_send_start(
    tensors: list[torch.Tensor], comm_id: int, layer_idx: int, stage_idx: int, spec: str,
    dep: torch.Tensor | None = None,
) -> torch.Tensor:
    sent = [t.contiguous() for t in tensors]
    comm, where, sends = _attention_sends(sent, comm_id, layer_idx, stage_idx, spec, "p2p_send_start")
    works = comm.start(sends, [], layer_idx=layer_idx, stage_idx=stage_idx, where=where)
    # (what is on the wire, padded to the bucket slot, stays alive until the wait)
    _hold(comm, (layer_idx, stage_idx, "send"), works, [t for t, _, _ in sends], where)
    return _token(tensors[0])


@p2p_send_start.register_fake
def _(tensors, comm_id, layer_idx, stage_idx, spec, dep=None):
    return torch.empty(0, device=tensors[0].device)


@afd_op("afd::p2p_recv_start", mutates_args=())
def p2p_recv_start(
    dep: torch.Tensor, comm_id: int, layer_idx: int, stage_idx: int, num_tokens: int, spec: str
) -> torch.Tensor:
    comm, where, recvs, outs = _attention_recv_buffers(dep, comm_id, layer_idx, stage_idx, num_tokens, spec,
                                                       "p2p_recv_start")
    works = comm.start([], recvs, layer_idx=layer_idx, stage_idx=stage_idx, where=where)
    _hold(comm, (layer_idx, stage_idx, "recv"), works, outs, where)
    return _token(dep)


@p2p_recv_start.register_fake
def _(dep, comm_id, layer_idx, stage_idx, num_tokens, spec):
    return torch.empty(0, device=dep.device)


@afd_op("afd::p2p_recv_wait", mutates_args=())
def p2p_recv_wait(
    handle: torch.Tensor, comm_id: int, layer_idx: int, stage_idx: int, num_tokens: int, spec: str,
    keep: list[torch.Tensor], dep: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Wait for the receive (and the send) of this layer and stage; returns what was received.
    ``dep``: the latest transfer started, so the wait stays after it; ``keep``: the tensors the
    send reads, inputs here so that a compiler keeps their memory (no buffer reuse) until the
    transfer is done."""
    comm = get_communicator(comm_id)
    where = _where("p2p_recv_wait", comm, layer_idx, stage_idx)
    key = (layer_idx, stage_idx, "recv")
    if key not in comm.in_flight:
        raise RuntimeError(f"{where}: no receive of this layer and stage was started")
    works, outs = comm.in_flight.pop(key)
    sent = comm.in_flight.pop((layer_idx, stage_idx, "send"), ([], []))
    comm.wait([*sent[0], *works], where)
    return _own_rows(outs, num_tokens)


@p2p_recv_wait.register_fake
def _(handle, comm_id, layer_idx, stage_idx, num_tokens, spec, keep, dep=None):
    return [torch.empty(w.shape(num_tokens), dtype=w.dtype, device=handle.device) for w in _spec(spec).tensors]


# --- FFN side -------------------------------------------------------------------------------


def _group_recvs(outs: Sequence[torch.Tensor], comm: AFDCommunicator, layer_idx: int, stage_idx: int, spec: str,
                 where: str) -> tuple[list[Transfer], Callable[[], None]]:
    """An FFN rank's receive from every attention peer into ``outs`` (one ``[rows, ...]`` buffer
    per wire tensor): (transfers, each peer's rows of each buffer in turn; what pads the rows past
    the peers' tokens once they are done: the last real row repeated, see :func:`pad_rows`)."""
    wspec = _spec(spec)
    rows = int(outs[0].shape[0]) if outs else 0
    if not torch.compiler.is_compiling():
        want = [(w.dtype, w.shape(rows)) for w in wspec.tensors]
        if [(o.dtype, tuple(o.shape)) for o in outs] != want or not all(o.is_contiguous() for o in outs):
            raise ValueError(f"{where}: the receive buffers are {[(o.dtype, tuple(o.shape)) for o in outs]}, the wire "
                             f"spec {spec} wants contiguous {want}")
    meta = comm.metadata(layer_idx, stage_idx)
    tokens = comm.received_tokens(stage_idx, rows, where)  # (< rows: rows padded to a bucket)
    sizes = split_sizes(tokens, meta.seq_lens, len(comm.peers), where)
    recvs, start = [], 0
    for p, n in zip(comm.peers, sizes, strict=True):
        recvs += [(o[start:start + n], p, w.kind) for o, w in zip(outs, wspec.tensors, strict=True)]
        start += n

    def pad() -> None:  # (as pad_rows: the last real row repeated, zeros without one)
        for o in outs if tokens < rows else ():
            if tokens:
                o[tokens:].copy_(o[tokens - 1:tokens].expand_as(o[tokens:]))
            else:
                o.zero_()

    return recvs, pad


def _buffers(like: torch.Tensor, rows: int, spec: str) -> list[torch.Tensor]:
    return [torch.empty(w.shape(rows), dtype=w.dtype, device=like.device) for w in _spec(spec).tensors]


def _group_sends(tensors: list[torch.Tensor], comm: AFDCommunicator, layer_idx: int, stage_idx: int, spec: str,
                 where: str) -> list[Transfer]:
    """An FFN rank's return of each peer's rows (the padding of a bucket goes to no peer),
    checked, grouped by peer (each peer's transfers in spec order)."""
    wspec = _spec(spec)
    meta = comm.metadata(layer_idx, stage_idx)
    total = comm.received_tokens(stage_idx, tensors[0].shape[0], where)
    if total < tensors[0].shape[0]:  # rows padded to a bucket: the padding goes to no peer
        tensors = [t[:total] for t in tensors]
    sizes = split_sizes(total, meta.seq_lens, len(comm.peers), where)
    if not torch.compiler.is_compiling():
        check_wire_tensors(tensors, wspec, None, comm, where)
    # each peer's rows, the peers in order and each peer's tensors in spec order (its wire order)
    sends, start = [], 0
    for peer, n in zip(comm.peers, sizes, strict=True):
        sends += [(t[start:start + n], peer, w.kind) for t, w in zip(tensors, wspec.tensors, strict=True)]
        start += n
    return sends


@afd_op("afd::p2p_recv_group", mutates_args=())
def p2p_recv_group(
    dep: torch.Tensor, comm_id: int, layer_idx: int, stage_idx: int, total_tokens: int, spec: str
) -> list[torch.Tensor]:
    comm = get_communicator(comm_id)
    where = _where("p2p_recv_group", comm, layer_idx, stage_idx)
    outs = _buffers(dep, total_tokens, spec)
    recvs, pad = _group_recvs(outs, comm, layer_idx, stage_idx, spec, where)
    comm.exchange([], recvs, layer_idx=layer_idx, stage_idx=stage_idx, where=where)
    pad()
    return outs


@p2p_recv_group.register_fake
def _(dep, comm_id, layer_idx, stage_idx, total_tokens, spec):
    return [
        torch.empty(w.shape(total_tokens), dtype=w.dtype, device=dep.device)
        for w in _spec(spec).tensors
    ]


@afd_op("afd::p2p_send_group", mutates_args=())
def p2p_send_group(
    tensors: list[torch.Tensor], comm_id: int, layer_idx: int, stage_idx: int, spec: str
) -> torch.Tensor:
    comm = get_communicator(comm_id)
    where = _where("p2p_send_group", comm, layer_idx, stage_idx)
    sends = _group_sends(tensors, comm, layer_idx, stage_idx, spec, where)
    comm.exchange(sends, [], layer_idx=layer_idx, stage_idx=stage_idx, where=where)
    return _token(tensors[0])


@p2p_send_group.register_fake
def _(tensors, comm_id, layer_idx, stage_idx, spec):
    return torch.empty(0, device=tensors[0].device)


def _send_recv(tensors: list[torch.Tensor], outs: list[torch.Tensor], comm_id: int, send_at: tuple[int, int],
               spec: str, recv_at: tuple[int, int], recv_spec: str) -> None:
    """An FFN rank's send at ``send_at`` (layer, stage) and its receive at ``recv_at`` into
    ``outs``, in one batched call, waited on together."""
    comm = get_communicator(comm_id)
    where = (f"afd.p2p_send_recv_group ({comm.role} rank {comm.rank}, send: layer {send_at[0]}, stage {send_at[1]}; "
             f"receive: layer {recv_at[0]}, stage {recv_at[1]})")
    sends = _group_sends(tensors, comm, *send_at, spec, where)
    recvs, pad = _group_recvs(outs, comm, *recv_at, recv_spec, where)
    works = comm.start(sends, recvs, layer_idx=send_at[0], stage_idx=send_at[1], where=where, recv_at=recv_at)
    comm.wait(works, where, [*sends, *recvs])
    pad()


@afd_op("afd::p2p_send_recv_group", mutates_args=())
def p2p_send_recv_group(
    tensors: list[torch.Tensor], comm_id: int, layer_idx: int, stage_idx: int, spec: str,
    recv_layer_idx: int, recv_stage_idx: int, total_tokens: int, recv_spec: str,
) -> list[torch.Tensor]:
    """``p2p_send_group(tensors, comm_id, layer_idx, stage_idx, spec)`` and the receive that
    follows it, ``p2p_recv_group(token, comm_id, recv_layer_idx, recv_stage_idx, total_tokens,
    recv_spec)``, posted in one batched call (passes/fuse_exchange.py): one op where the FFN
    program held two adjacent ones, so a program captured in pieces around its exchange has one
    piece fewer per layer. What each transfer carries, and its checks, are the two ops'."""
    outs = _buffers(tensors[0], total_tokens, recv_spec)
    _send_recv(tensors, outs, comm_id, (layer_idx, stage_idx), spec, (recv_layer_idx, recv_stage_idx), recv_spec)
    return outs


@p2p_send_recv_group.register_fake
def _(tensors, comm_id, layer_idx, stage_idx, spec, recv_layer_idx, recv_stage_idx, total_tokens, recv_spec):
    return [torch.empty(w.shape(total_tokens), dtype=w.dtype, device=tensors[0].device)
            for w in _spec(recv_spec).tensors]


# --- FFN side, receiving into given buffers (passes/recv_into.py) ----------------------------
#
# The two receives above return lists. Inductor's graph partition (the backend's
# ffn_capture="compute": the exchange between captured pieces) hands a partition the whole list
# where a piece reads one of its tensors, and CUDA graph trees refuse it (torch 2.11: an assert on
# a non-tensor input). The backend runs these instead: the buffers are allocated in the program
# (``new_empty``), each peer's rows are received into them in place (no concatenation), and a
# piece reads them as tensors.


@afd_op("afd::p2p_recv_group_into", mutates_args=("outs",))
def p2p_recv_group_into(
    dep: torch.Tensor, outs: list[torch.Tensor], comm_id: int, layer_idx: int, stage_idx: int, spec: str
) -> None:
    """``p2p_recv_group`` into ``outs`` (one ``[rows, ...]`` buffer per wire tensor)."""
    comm = get_communicator(comm_id)
    where = _where("p2p_recv_group_into", comm, layer_idx, stage_idx)
    recvs, pad = _group_recvs(outs, comm, layer_idx, stage_idx, spec, where)
    comm.exchange([], recvs, layer_idx=layer_idx, stage_idx=stage_idx, where=where)
    pad()


@p2p_recv_group_into.register_fake
def _(dep, outs, comm_id, layer_idx, stage_idx, spec):
    return None


@afd_op("afd::p2p_send_recv_group_into", mutates_args=("outs",))
def p2p_send_recv_group_into(
    tensors: list[torch.Tensor], outs: list[torch.Tensor], comm_id: int, layer_idx: int, stage_idx: int, spec: str,
    recv_layer_idx: int, recv_stage_idx: int, recv_spec: str,
) -> None:
    """``p2p_send_recv_group`` receiving into ``outs``."""
    _send_recv(tensors, outs, comm_id, (layer_idx, stage_idx), spec, (recv_layer_idx, recv_stage_idx), recv_spec)


@p2p_send_recv_group_into.register_fake
def _(tensors, outs, comm_id, layer_idx, stage_idx, spec, recv_layer_idx, recv_stage_idx, recv_spec):
    return None


# --- FFN side, a fixed slot's real rows (runtime/slots.py, passes/slot_rows.py) ----------------


@afd_op("afd::slot_rows", mutates_args=())
def slot_rows(dep: torch.Tensor, comm_id: int, layer_idx: int, stage_idx: int) -> torch.Tensor:
    """Which of an FFN rank's received rows are a peer's real tokens under a fixed slot: a bool
    ``[rows]``, each live peer's ``C`` rows in order, the first ``n_p`` true (``n_p`` from the
    header that came with the data at ``layer_idx`` / ``stage_idx``; a stop or failure: none),
    then the padding in place of peers gone (an FFN group's rows never change): false.
    Read on the device from the headers' buffer, so a captured graph reads each step's counts.
    ``dep``: the receive's output (this runs after it)."""
    comm = get_communicator(comm_id)
    where = _where("slot_rows", comm, layer_idx, stage_idx)
    slot, heads = comm.fixed_slot, comm.headers_in.get((layer_idx, stage_idx))
    if slot is None or heads is None:
        raise RuntimeError(f"{where}: no fixed slot's headers were received at this layer and stage (a program "
                           "lowered for a fixed slot run without one: give the same buckets to every rank)")
    live = [i for i, n in enumerate(comm.step_seq_lens.get(stage_idx, ())) if n]
    rows = comm.step_rows.get(stage_idx, len(live) * slot)  # (in an FFN group: gone peers' rows are padding)
    if rows != dep.shape[0] or rows < len(live) * slot:
        raise ValueError(f"{where}: {dep.shape[0]} rows received, but {len(live)} live peers of {slot} rows"
                         + (f" in {rows} rows" if rows != len(live) * slot else ""))
    grid = torch.arange(slot, device=heads.device)[None, :] < heads[:, :1].clamp(min=0)  # [peers, C]
    return torch.cat([*(grid[i] for i in live), grid.new_zeros(rows - len(live) * slot)])


@slot_rows.register_fake
def _(dep, comm_id, layer_idx, stage_idx):
    return torch.empty(dep.shape[0], dtype=torch.bool, device=dep.device)


AFD_OPS = (
    torch.ops.afd.p2p_send.default,
    torch.ops.afd.p2p_recv.default,
    torch.ops.afd.p2p_recv_group.default,
    torch.ops.afd.p2p_send_group.default,
)
#: the asynchronous attention-side ops of staged programs
ASYNC_OPS = (
    torch.ops.afd.p2p_send_start.default,
    torch.ops.afd.p2p_recv_start.default,
    torch.ops.afd.p2p_recv_wait.default,
)
#: the FFN-side ops of the backend's lowering of an FFN program (after every pass that reads the
#: four ops above): a send and the next receive as one op (passes/fuse_exchange.py), and the
#: receives into given buffers (passes/recv_into.py)
LOWERED_OPS = (
    torch.ops.afd.p2p_send_recv_group.default,
    torch.ops.afd.p2p_recv_group_into.default,
    torch.ops.afd.p2p_send_recv_group_into.default,
)
SEND_OPS = (torch.ops.afd.p2p_send.default, torch.ops.afd.p2p_send_group.default)
RECV_OPS = (torch.ops.afd.p2p_recv.default, torch.ops.afd.p2p_recv_group.default)

for _op in AFD_OPS + ASYNC_OPS + LOWERED_OPS:
    has_side_effect(_op)


# the group collectives live in their own module; importing this one registers them too
from .collectives import COLLECTIVE_OPS, group_token_sizes  # noqa: E402,F401
