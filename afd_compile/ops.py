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

Every op is registered as side-effecting (``torch.fx.node.has_side_effect``), so a send whose token
is unused is not dead-code-eliminated. Each op waits for its transfers before returning, on the
current stream, so buffers are never reused while in flight and the ops are capturable.
Metadata checks run outside tracing only (``torch.compiler.is_compiling()``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch.fx.node import has_side_effect

from .comm import AFDCommunicator, TransferMetadata, get_communicator
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
        if comm.device_transport and t.device.type == "cpu":
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
    return comm, where, [(t, comm.peers[0], w.kind) for t, w in zip(tensors, wspec.tensors, strict=True)]


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
    outs = [torch.empty(w.shape(num_tokens), dtype=w.dtype, device=dep.device) for w in wspec.tensors]
    return comm, where, [(t, comm.peers[0], w.kind) for t, w in zip(outs, wspec.tensors, strict=True)], outs


@torch.library.custom_op("afd::p2p_send", mutates_args=())
def p2p_send(
    tensors: list[torch.Tensor], comm_id: int, layer_idx: int, stage_idx: int, spec: str
) -> torch.Tensor:
    comm, where, sends = _attention_sends(tensors, comm_id, layer_idx, stage_idx, spec, "p2p_send")
    comm.exchange(sends, [], layer_idx=layer_idx, stage_idx=stage_idx, where=where)
    return _token(tensors[0])


@p2p_send.register_fake
def _(tensors, comm_id, layer_idx, stage_idx, spec):
    return torch.empty(0, device=tensors[0].device)


@torch.library.custom_op("afd::p2p_recv", mutates_args=())
def p2p_recv(
    dep: torch.Tensor, comm_id: int, layer_idx: int, stage_idx: int, num_tokens: int, spec: str
) -> list[torch.Tensor]:
    comm, where, recvs, outs = _attention_recv_buffers(dep, comm_id, layer_idx, stage_idx, num_tokens, spec,
                                                       "p2p_recv")
    comm.exchange([], recvs, layer_idx=layer_idx, stage_idx=stage_idx, where=where)
    return outs


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
# The works and the tensors in flight (the sent ones stay alive until the wait) are held here,
# keyed by (comm, layer, stage, direction): unique within a step. On NCCL a work's wait() makes
# the current stream wait for the transfer, not the host, so the three ops are capturable.

#: transfers started and not waited on: (comm_id, layer, stage, "send" | "recv") -> (works, tensors)
IN_FLIGHT: dict[tuple[int, int, int, str], tuple[list, list[torch.Tensor]]] = {}


def _hold(key: tuple[int, int, int, str], works: list, tensors: list[torch.Tensor], where: str) -> None:
    if key in IN_FLIGHT:
        raise RuntimeError(f"{where}: a {key[3]} of this layer and stage is already in flight (started twice "
                           "without a wait in between)")
    IN_FLIGHT[key] = (works, tensors)


@torch.library.custom_op("afd::p2p_send_start", mutates_args=())
def p2p_send_start(
    tensors: list[torch.Tensor], comm_id: int, layer_idx: int, stage_idx: int, spec: str,
    dep: torch.Tensor | None = None,
) -> torch.Tensor:
    sent = [t.contiguous() for t in tensors]
    comm, where, sends = _attention_sends(sent, comm_id, layer_idx, stage_idx, spec, "p2p_send_start")
    works = comm.start(sends, [], layer_idx=layer_idx, stage_idx=stage_idx, where=where)
    _hold((comm_id, layer_idx, stage_idx, "send"), works, sent, where)
    return _token(tensors[0])


@p2p_send_start.register_fake
def _(tensors, comm_id, layer_idx, stage_idx, spec, dep=None):
    return torch.empty(0, device=tensors[0].device)


@torch.library.custom_op("afd::p2p_recv_start", mutates_args=())
def p2p_recv_start(
    dep: torch.Tensor, comm_id: int, layer_idx: int, stage_idx: int, num_tokens: int, spec: str
) -> torch.Tensor:
    comm, where, recvs, outs = _attention_recv_buffers(dep, comm_id, layer_idx, stage_idx, num_tokens, spec,
                                                       "p2p_recv_start")
    works = comm.start([], recvs, layer_idx=layer_idx, stage_idx=stage_idx, where=where)
    _hold((comm_id, layer_idx, stage_idx, "recv"), works, outs, where)
    return _token(dep)


@p2p_recv_start.register_fake
def _(dep, comm_id, layer_idx, stage_idx, num_tokens, spec):
    return torch.empty(0, device=dep.device)


@torch.library.custom_op("afd::p2p_recv_wait", mutates_args=())
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
    key = (comm_id, layer_idx, stage_idx, "recv")
    if key not in IN_FLIGHT:
        raise RuntimeError(f"{where}: no receive of this layer and stage was started")
    works, outs = IN_FLIGHT.pop(key)
    sent = IN_FLIGHT.pop((comm_id, layer_idx, stage_idx, "send"), ([], []))
    for work in [*sent[0], *works]:
        work.wait()
    return list(outs)


@p2p_recv_wait.register_fake
def _(handle, comm_id, layer_idx, stage_idx, num_tokens, spec, keep, dep=None):
    return [torch.empty(w.shape(num_tokens), dtype=w.dtype, device=handle.device) for w in _spec(spec).tensors]


# --- FFN side -------------------------------------------------------------------------------


@torch.library.custom_op("afd::p2p_recv_group", mutates_args=())
def p2p_recv_group(
    dep: torch.Tensor, comm_id: int, layer_idx: int, stage_idx: int, total_tokens: int, spec: str
) -> list[torch.Tensor]:
    comm = get_communicator(comm_id)
    where = _where("p2p_recv_group", comm, layer_idx, stage_idx)
    wspec = _spec(spec)
    meta = comm.metadata(layer_idx, stage_idx)
    sizes = split_sizes(total_tokens, meta.seq_lens, len(comm.peers), where)
    per_peer = [
        [torch.empty(w.shape(n), dtype=w.dtype, device=dep.device) for w in wspec.tensors]
        for n in sizes
    ]
    comm.exchange([], [(t, p, w.kind) for p, ts in zip(comm.peers, per_peer, strict=True)
                       for t, w in zip(ts, wspec.tensors, strict=True)],
                  layer_idx=layer_idx, stage_idx=stage_idx, where=where)
    if len(per_peer) == 1:
        return per_peer[0]
    return [torch.cat([ts[i] for ts in per_peer], dim=0) for i in range(len(wspec.tensors))]


@p2p_recv_group.register_fake
def _(dep, comm_id, layer_idx, stage_idx, total_tokens, spec):
    return [
        torch.empty(w.shape(total_tokens), dtype=w.dtype, device=dep.device)
        for w in _spec(spec).tensors
    ]


@torch.library.custom_op("afd::p2p_send_group", mutates_args=())
def p2p_send_group(
    tensors: list[torch.Tensor], comm_id: int, layer_idx: int, stage_idx: int, spec: str
) -> torch.Tensor:
    comm = get_communicator(comm_id)
    where = _where("p2p_send_group", comm, layer_idx, stage_idx)
    wspec = _spec(spec)
    meta = comm.metadata(layer_idx, stage_idx)
    total = tensors[0].shape[0]
    sizes = split_sizes(total, meta.seq_lens, len(comm.peers), where)
    if not torch.compiler.is_compiling():
        check_wire_tensors(tensors, wspec, None, comm, where)
    sends = []
    for t, w in zip(tensors, wspec.tensors, strict=True):
        for piece, peer in zip(torch.split(t, sizes, dim=0), comm.peers, strict=True):
            sends.append((piece, peer, w.kind))
    # Order on the wire per peer must be spec order: group the sends by peer.
    sends.sort(key=lambda sp: comm.peers.index(sp[1]))
    comm.exchange(sends, [], layer_idx=layer_idx, stage_idx=stage_idx, where=where)
    return _token(tensors[0])


@p2p_send_group.register_fake
def _(tensors, comm_id, layer_idx, stage_idx, spec):
    return torch.empty(0, device=tensors[0].device)


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
SEND_OPS = (torch.ops.afd.p2p_send.default, torch.ops.afd.p2p_send_group.default)
RECV_OPS = (torch.ops.afd.p2p_recv.default, torch.ops.afd.p2p_recv_group.default)

for _op in AFD_OPS + ASYNC_OPS:
    has_side_effect(_op)


# --- scatter-mode collectives ------------------------------------------------------------------


@torch.library.custom_op("afd::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_id: int) -> torch.Tensor:
    """Sum ``x`` over the process group ``group_id`` (out of place, waited on before returning): a small
    message of a group with symmetric memory in one one-shot kernel (symm_mem.py), else NCCL / gloo."""
    import torch.distributed as dist

    from .comm import get_group
    from .symm_mem import try_all_reduce

    fast = try_all_reduce(x, group_id)
    if fast is not None:
        return fast
    out = x.contiguous().clone()
    dist.all_reduce(out, group=get_group(group_id))
    return out


@all_reduce.register_fake
def _(x, group_id):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("afd::all_gather_last", mutates_args=())
def all_gather_last(x: torch.Tensor, group_id: int, size: int) -> torch.Tensor:
    """Join the group's slices of the last dim, in group-rank order, and keep the first ``size``
    (a column-parallel LM head's logits: each rank holds ``ceil(V / parts)`` columns, the last
    rank's padded with zero rows of the weight): ``(..., n) -> (..., size)``."""
    import torch.distributed as dist

    from .comm import get_group

    group = get_group(group_id)
    src = x.contiguous()
    parts, n = dist.get_world_size(group), src.shape[-1]
    if parts * n < size:
        raise ValueError(f"afd.all_gather_last: {parts} slices of {n} columns cannot hold {size}")
    out = src.new_empty((parts * src.shape[0], *src.shape[1:]))  # the slices one after another on dim 0
    dist.all_gather_into_tensor(out, src, group=group)  # one buffer, no per-slice copies
    joined = out.view(parts, *src.shape).movedim(0, -2).reshape(*src.shape[:-1], parts * n)  # [P, ..., n] -> [..., P * n]: one copy
    return joined[..., :size].contiguous()


@all_gather_last.register_fake
def _(x, group_id, size):
    return x.new_empty((*x.shape[:-1], size))


COLLECTIVE_OPS = (torch.ops.afd.all_reduce.default, torch.ops.afd.all_gather_last.default)


def _dp_check(x: torch.Tensor, total: int, where: str, rows: str, stage: int = 0) -> object:
    from .comm import get_tp_step

    step = get_tp_step(where, stage)
    n = step.own if rows == "own" else step.total
    if x.shape[0] != n or step.total != total:
        raise ValueError(f"{where}: shape mismatch: input has {x.shape[0]} rows, expected {n} "
                         f"({rows}); graph total {total} vs step counts {list(step.counts)}")
    return step


@torch.library.custom_op("afd::all_gather_tokens", mutates_args=())
def all_gather_tokens(x: torch.Tensor, group_id: int, total: int, stage: int = 0) -> torch.Tensor:
    """Every DP group's tokens, in group order: ``(own, H) -> (total, H)``. Each rank is its own
    DP group (attn_tp == 1). Padding rule: every rank pads to the largest count, gathers, and
    drops the padding (so groups with zero tokens take part too). ``stage``: whose per-step
    counts (``comm.set_tp_step``) to use: a micro-batch's, in an FFN group's staged program."""
    import torch.distributed as dist

    from .comm import get_group

    step = _dp_check(x, total, "afd.all_gather_tokens", "own", stage)
    group = get_group(group_id)
    pad = max(step.counts)
    buf = torch.zeros((pad, *x.shape[1:]), dtype=x.dtype, device=x.device)
    buf[: x.shape[0]] = x
    parts = [torch.empty_like(buf) for _ in step.counts]
    dist.all_gather(parts, buf, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, step.counts, strict=True)], dim=0)


@all_gather_tokens.register_fake
def _(x, group_id, total, stage=0):
    return x.new_empty((total, *x.shape[1:]))


@torch.library.custom_op("afd::gather_partial_tokens", mutates_args=())
def gather_partial_tokens(x: torch.Tensor, group_id: int, total: int) -> torch.Tensor:
    """Reduce-then-gather (SGLang's dp_gather_partial): ``x`` holds this attention TP rank's
    partial sum of its group's tokens. Padding rule: pad to the sum: a zero buffer of all
    tokens gets ``x`` at the group's offset, then one all-reduce over the TP group."""
    import torch.distributed as dist

    from .comm import get_group

    step = _dp_check(x, total, "afd.gather_partial_tokens", "own")
    buf = torch.zeros((step.total, *x.shape[1:]), dtype=x.dtype, device=x.device)
    buf[step.offset : step.offset + step.own] = x
    dist.all_reduce(buf, group=get_group(group_id))
    return buf


@gather_partial_tokens.register_fake
def _(x, group_id, total):
    return x.new_empty((total, *x.shape[1:]))


@torch.library.custom_op("afd::reduce_scatter_tokens", mutates_args=())
def reduce_scatter_tokens(x: torch.Tensor, group_id: int, total: int, own: int, stage: int = 0) -> torch.Tensor:
    """Sum a FULL partial tensor over the TP group and keep this rank's DP group's rows (``stage``:
    as in :func:`all_gather_tokens`).
    Implemented as an all-reduce of all rows then the local slice: DP groups of unequal sizes
    need no padding this way (a padded reduce_scatter + attention-group all_gather moves fewer
    bytes; not done yet)."""
    import torch.distributed as dist

    from .comm import get_group

    step = _dp_check(x, total, "afd.reduce_scatter_tokens", "total", stage)
    buf = x.contiguous().clone()
    dist.all_reduce(buf, group=get_group(group_id))
    return buf[step.offset : step.offset + step.own].clone()


@reduce_scatter_tokens.register_fake
def _(x, group_id, total, own, stage=0):
    return x.new_empty((own, *x.shape[1:]))


@torch.library.custom_op("afd::scatter_tokens", mutates_args=())
def scatter_tokens(x: torch.Tensor, total: int, own: int) -> torch.Tensor:
    """This DP group's rows of a FULL tensor: a local slice, no communication."""
    step = _dp_check(x, total, "afd.scatter_tokens", "total")
    return x[step.offset : step.offset + step.own].clone()


@scatter_tokens.register_fake
def _(x, total, own):
    return x.new_empty((own, *x.shape[1:]))


COLLECTIVE_OPS = COLLECTIVE_OPS + (
    torch.ops.afd.all_gather_tokens.default,
    torch.ops.afd.gather_partial_tokens.default,
    torch.ops.afd.reduce_scatter_tokens.default,
    torch.ops.afd.scatter_tokens.default,
)


# --- SCATTERED inside an attention-TP group (each rank a slice of its group's tokens) ----------


def group_token_sizes(total: int, parts: int) -> list[int]:
    """Rows per attention-TP rank when a group's ``total`` tokens are SCATTERED over its ``parts``
    ranks: ``torch.tensor_split``'s rule, the first ``total % parts`` ranks one row more (so a
    rank may hold zero rows). Rank ``i`` holds ``(total + parts - 1 - i) // parts`` rows."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _group_rank(group_id: int) -> tuple[object, int, int]:
    import torch.distributed as dist

    from .comm import get_group

    group = get_group(group_id)
    return group, dist.get_rank(group), dist.get_world_size(group)


def _group_check(op: str, x: torch.Tensor, rows: int, total: int, own: int, rank: int, parts: int) -> list[int]:
    sizes = group_token_sizes(total, parts)
    if x.shape[0] != rows or sizes[rank] != own:
        raise ValueError(f"afd.{op}: shape mismatch on group rank {rank}/{parts}: input has {x.shape[0]} rows, "
                         f"expected {rows}; {total} tokens split {sizes}, this rank's share {own} in the graph")
    return sizes


@torch.library.custom_op("afd::scatter_group_tokens", mutates_args=())
def scatter_group_tokens(x: torch.Tensor, group_id: int, total: int, own: int) -> torch.Tensor:
    """TP_ATTN_FULL -> SCATTERED, not partial: this rank's rows of its group's ``(total, H)``
    tokens (:func:`group_token_sizes`); a local slice, no communication."""
    _, rank, parts = _group_rank(group_id)
    sizes = _group_check("scatter_group_tokens", x, total, total, own, rank, parts)
    start = sum(sizes[:rank])
    return x[start : start + own].clone()


@scatter_group_tokens.register_fake
def _(x, group_id, total, own):
    return x.new_empty((own, *x.shape[1:]))


@torch.library.custom_op("afd::all_gather_group_tokens", mutates_args=())
def all_gather_group_tokens(x: torch.Tensor, group_id: int, total: int, own: int) -> torch.Tensor:
    """SCATTERED -> TP_ATTN_FULL: ``(own, H) -> (total, H)`` over the attention-TP group. Padding
    rule: every rank pads to the largest share (``ceil(total / parts)``), gathers, drops the pad."""
    import torch.distributed as dist

    group, rank, parts = _group_rank(group_id)
    sizes = _group_check("all_gather_group_tokens", x, own, total, own, rank, parts)
    pad = max(sizes)
    buf = x.new_zeros((pad, *x.shape[1:]))
    buf[:own] = x
    out = x.new_empty((parts * pad, *x.shape[1:]))
    dist.all_gather_into_tensor(out, buf, group=group)
    return torch.cat([out[i * pad : i * pad + n] for i, n in enumerate(sizes)], dim=0)


@all_gather_group_tokens.register_fake
def _(x, group_id, total, own):
    return x.new_empty((total, *x.shape[1:]))


@torch.library.custom_op("afd::reduce_scatter_group_tokens", mutates_args=())
def reduce_scatter_group_tokens(x: torch.Tensor, group_id: int, total: int, own: int) -> torch.Tensor:
    """TP_ATTN_FULL + partial -> SCATTERED: sum ``(total, H)`` over the attention-TP group and keep
    this rank's rows. One ``reduce_scatter_tensor`` over shares padded to ``ceil(total / parts)``
    (not an all-reduce then a slice: each rank receives only its share)."""
    import torch.distributed as dist

    group, rank, parts = _group_rank(group_id)
    sizes = _group_check("reduce_scatter_group_tokens", x, total, total, own, rank, parts)
    pad = max(sizes)
    buf = x.new_zeros((parts * pad, *x.shape[1:]))
    start = 0
    for i, n in enumerate(sizes):
        buf[i * pad : i * pad + n] = x[start : start + n]
        start += n
    out = x.new_empty((pad, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, buf, group=group)
    return out[:own].clone()


@reduce_scatter_group_tokens.register_fake
def _(x, group_id, total, own):
    return x.new_empty((own, *x.shape[1:]))


# --- MoE expert parallelism with all-to-all (the SCATTERED MoE) --------------------------------


def _ep_routes(ids: torch.Tensor, parts: int, num_experts: int) -> tuple[list[torch.Tensor], int]:
    """Per destination rank, the rows (token indices, ascending) with at least one expert there."""
    if num_experts % parts:
        raise ValueError(f"afd.ep_dispatch: {num_experts} experts do not divide over {parts} ranks")
    per = num_experts // parts
    owner = torch.div(ids, per, rounding_mode="floor")
    return [torch.nonzero((owner == d).any(dim=-1)).flatten() for d in range(parts)], per


def _a2a(send: torch.Tensor, send_counts: list[int], recv_counts: list[int], group: object) -> torch.Tensor:
    import torch.distributed as dist

    out = send.new_empty((sum(recv_counts), *send.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts,
                           group=group)
    return out


@torch.library.custom_op("afd::ep_dispatch", mutates_args=())
def ep_dispatch(payloads: list[torch.Tensor], ids: torch.Tensor, group_id: int, num_experts: int,
                parts: int) -> list[torch.Tensor]:
    """All-to-all dispatch of this rank's tokens to the ranks owning their experts (rank ``d``
    owns experts ``[d * E/P, (d+1) * E/P)``). ``ids`` ``(n, k)`` are the selected experts,
    ``payloads`` per-token rows ``(n, ...)``, ``parts`` the group size the program was built for. A token goes once to each rank owning at least one of
    its experts. Returns ``[*payloads received (m, ...), local ids (m, k), valid (m, k) bool,
    received counts per source rank (P,) int64]``: ``valid`` marks the slots whose expert this
    rank owns (the others' local id is 0 and their routing weight must be zeroed)."""
    group, rank, size = _group_rank(group_id)
    if size != parts:
        raise ValueError(f"afd.ep_dispatch: the program was sharded for {parts} expert-parallel ranks, the group "
                         f"has {size}")
    for p in payloads:
        if p.shape[0] != ids.shape[0]:
            raise ValueError(f"afd.ep_dispatch: a payload has {p.shape[0]} rows, the routing ids {ids.shape[0]}")
    routes, per = _ep_routes(ids, parts, num_experts)
    send_counts = [int(r.numel()) for r in routes]
    counts = torch.tensor(send_counts, dtype=torch.int64, device=ids.device)
    recv = torch.empty_like(counts)
    import torch.distributed as dist

    dist.all_to_all_single(recv, counts, group=group)
    recv_counts = [int(c) for c in recv.tolist()]
    order = torch.cat(routes)
    out = [_a2a(p[order], send_counts, recv_counts, group) for p in (*payloads, ids)]
    local = out[-1] - rank * per
    valid = (local >= 0) & (local < per)
    return [*out[:-1], torch.where(valid, local, torch.zeros_like(local)), valid, recv]


@ep_dispatch.register_fake
def _(payloads, ids, group_id, num_experts, parts):
    m = torch.library.get_ctx().new_dynamic_size()
    return [*(p.new_empty((m, *p.shape[1:])) for p in payloads), ids.new_empty((m, *ids.shape[1:])),
            ids.new_empty((m, *ids.shape[1:]), dtype=torch.bool), ids.new_empty((parts,), dtype=torch.int64)]


@torch.library.custom_op("afd::ep_combine", mutates_args=())
def ep_combine(y: torch.Tensor, ids: torch.Tensor, recv_counts: torch.Tensor, group_id: int,
               num_experts: int) -> torch.Tensor:
    """The reverse all-to-all of :func:`ep_dispatch`: each owner's partial output for a token
    (its experts' weighted sum) returns to the token's rank, where the partials are summed."""
    group, _rank, parts = _group_rank(group_id)
    routes, _ = _ep_routes(ids, parts, num_experts)
    send_counts = [int(c) for c in recv_counts.tolist()]
    if sum(send_counts) != y.shape[0]:
        raise ValueError(f"afd.ep_combine: {y.shape[0]} expert output rows, {sum(send_counts)} were dispatched here")
    back = _a2a(y, send_counts, [int(r.numel()) for r in routes], group)
    out = y.new_zeros((ids.shape[0], *y.shape[1:]))
    return out.index_add_(0, torch.cat(routes), back)


@ep_combine.register_fake
def _(y, ids, recv_counts, group_id, num_experts):
    return y.new_empty((ids.shape[0], *y.shape[1:]))


COLLECTIVE_OPS = COLLECTIVE_OPS + (
    torch.ops.afd.scatter_group_tokens.default,
    torch.ops.afd.all_gather_group_tokens.default,
    torch.ops.afd.reduce_scatter_group_tokens.default,
    torch.ops.afd.ep_dispatch.default,
    torch.ops.afd.ep_combine.default,
)
