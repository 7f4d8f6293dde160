"""Micro-batch stages: an AFD role program run as ``S`` micro-batches, interleaved layer-major.

With ``S >= 2`` stages an attention rank splits its step's sequences into ``S`` micro-batches
(whole sequences, contiguous: :func:`afd_compile.passes.pingpong.micro_batches`) and its program
holds one copy of the model per micro-batch, interleaved layer by layer, so that micro-batch ``s``
of layer ``l`` is exchanged while ``s + 1`` is computed (the ping-pong schedule of
``passes/pingpong.py``); the FFN program holds one copy of each layer's FFN per stage, in the same
order. Every transfer carries its stage index, and each transfer depends on the one before it
(data, or a ``dep`` argument of the start and wait ops), so no compiler reorders them.

Attention program, before (``S = 1``; one layer)::

    ids = placeholder; ...
    send = afd.p2p_send([hidden], 0, 0, 0, spec)
    recv = afd.p2p_recv(send, 0, 0, 0, n, spec)
    ...
    return (logits,)

After (``S = 2``): two more inputs whose first dims are the micro-batches' sequence counts::

    ids = placeholder; ...; stage_rows_0 = placeholder; stage_rows_1 = placeholder
    ids_0 = aten.slice(ids, 0, 0, b0); ids_1 = aten.slice(ids, 0, b0, b0 + b1)
    ... (layer 0, stage 0) ...;  send_0 = afd.p2p_send_start([hidden_0], 0, 0, 0, spec)
    recv_0 = afd.p2p_recv_start(send_0, 0, 0, 0, n_0, spec)
    ... (layer 0, stage 1) ...;  send_1 = afd.p2p_send_start([hidden_1], 0, 0, 1, spec, dep=recv_0)
    recv_1 = afd.p2p_recv_start(send_1, 0, 0, 1, n_1, spec)
    out_0 = afd.p2p_recv_wait(recv_0, 0, 0, 0, n_0, spec, [hidden_0], dep=recv_1)   # layer 1, stage 0
    ... (layer 1, stage 0) ... (layer 1, stage 1) ...
    return (aten.cat([logits_0, logits_1], 0),)

The attention side's transfers are asynchronous (``afd::p2p_send_start`` / ``p2p_recv_start``
post them, ``p2p_recv_wait`` waits where the FFN output is first used), so micro-batch ``s + 1``
is computed while the FFN rank computes ``s``; on one communication stream per rank the order
start(send s), start(recv s), start(send s + 1), ... is the pairing the FFN rank's blocking
receive, compute, send follows (``passes/pingpong.py`` checks that order).

FFN program, after: inputs ``token_slots_0 .. token_slots_{S-1}`` (each stage's tokens over all
peers), ``recv_group(l, s)`` depending on ``send_group`` of the transfer before.

Refused with a :class:`StageError`: a program holding a KV cache (each micro-batch would own its
cache rows: not built yet), a program without a dynamic batch dim to split, an output without it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from .. import ops as afd_ops  # noqa: F401  (registers the afd ops)
from ..errors import AFDCompileError
from .graph_utils import batch_symbol_dims, writes_first_arg
from .symbolic import sym_expr

aten = torch.ops.aten
afd = torch.ops.afd

META_KEY = "afd.stage"


class StageError(AFDCompileError):
    """A program that cannot run as micro-batch stages, and why."""


def _check_stages(stages: int) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise StageError(f"stages must be an integer >= 1, got {stages!r}")


def _refuse_state(gm: fx.GraphModule, name: str) -> None:
    for n in gm.graph.nodes:
        if n.op == "call_function" and writes_first_arg(n):
            raise StageError(f"{name}: node {n.name} ({n.target}) writes a tensor in place (a KV cache): micro-batch "
                             "stages with a KV cache are not supported yet (each stage would own its cache rows); "
                             "use stages=1")


def _replicate(gm: fx.GraphModule, stages: int, graph: fx.Graph, envs: list[dict[fx.Node, object]],
               boundary: object, on_transfer: Callable[[fx.Node, fx.Node, int, fx.Node | None], fx.Node | None],
               enter: Callable[[int, fx.Node | None], None] = lambda s, last: None) -> list[list[object]]:
    """Copy every node of ``gm`` but placeholders and output once per stage into ``graph``,
    segment by segment (a segment ends with a ``boundary`` op), stage-minor; ``get_attr`` once for
    all. ``on_transfer(old, new, stage, last)`` fixes a copied transfer (its stage, its
    dependency on the transfer before) and returns the token the next one depends on;
    ``enter(stage, last)`` runs before a stage's nodes of each segment. Returns each stage's
    output values (the output node's args, mapped)."""
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    segments: list[list[fx.Node]] = [[]]
    for n in body:
        segments[-1].append(n)
        if n.op == "call_function" and n.target == boundary:
            segments.append([])
    shared: dict[fx.Node, fx.Node] = {}
    last: fx.Node | None = None
    for seg in segments:
        for s in range(stages):
            env = envs[s]
            enter(s, last)
            for n in seg:
                if n.op == "get_attr":
                    if n not in shared:
                        shared[n] = graph.node_copy(n)
                    env[n] = shared[n]
                    continue
                new = graph.node_copy(n, lambda a, _env=env: _env[a])
                new.meta[META_KEY] = s
                if n.op == "call_function" and n.target in afd_ops.AFD_OPS:
                    args = list(new.args)
                    args[3] = s  # stage_idx
                    new.args = tuple(args)
                    last = on_transfer(n, new, s, last)
                env[n] = new
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return [[fx.node.map_arg(a, lambda x, _env=env: _env[x]) for a in out.args] for env in envs]


def stage_attention_program(gm: fx.GraphModule, stages: int, name: str = "attention program") -> fx.GraphModule:
    """The attention program of ``stages`` micro-batches (module docstring); ``stages = 1``
    returns ``gm`` itself. Its inputs: ``gm``'s, then one ``[b_s, 0]`` tensor per stage whose
    first dim is that micro-batch's sequence count (they sum to the batch)."""
    _check_stages(stages)
    if stages == 1:
        return gm
    _refuse_state(gm, name)
    sym, dims = batch_symbol_dims(gm)
    if sym is None:
        raise StageError(f"{name}: its first input has no dynamic batch dim (dim 0 is static), so its sequences "
                         "cannot be split into micro-batches; export with a dynamic batch")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    g = fx.Graph()
    new_ph = {}
    for n in placeholders:
        new_ph[n] = g.placeholder(n.name)
        new_ph[n].meta.update(n.meta)
    carriers = [g.placeholder(f"stage_rows_{s}") for s in range(stages)]
    batch_dims: dict[int, list[int]] = {}
    for i, d in dims:
        batch_dims.setdefault(i, []).append(d)
    envs: list[dict[fx.Node, object]] = []
    start: object = 0
    for s in range(stages):
        b = g.call_function(aten.sym_size.int, (carriers[s], 0))
        end = b if s == 0 else g.call_function(operator.add, (start, b))
        env: dict[fx.Node, object] = {}
        for i, n in enumerate(placeholders):
            x: object = new_ph[n]
            for d in batch_dims.get(i, []):
                x = g.call_function(aten.slice.Tensor, (x, d, start, end))
            env[n] = x
        envs.append(env)
        start = end

    pending: dict[int, tuple[fx.Node, fx.Node]] = {}  # stage -> (the receive, its started copy)
    sent: dict[int, object] = {}  # stage -> the tensors its send in flight reads

    def on_transfer(old: fx.Node, new: fx.Node, s: int, last: fx.Node | None) -> fx.Node | None:
        # the transfers start here and are waited on where the next segment of the stage begins
        if old.target == afd.p2p_send.default:
            new.target = afd.p2p_send_start.default
            sent[s] = new.args[0]
            if last is not None:
                new.kwargs = {**new.kwargs, "dep": last}
            return new
        new.target = afd.p2p_recv_start.default
        pending[s] = (old, new)
        return new

    def enter(s: int, last: fx.Node | None) -> None:
        if s in pending:
            old, started = pending.pop(s)
            # the sent tensors are inputs of the wait: a compiler keeps their memory until then
            wait = g.call_function(afd.p2p_recv_wait.default, (started, *started.args[1:], sent.pop(s)),
                                   {"dep": last})
            wait.meta.update(old.meta)
            wait.meta[META_KEY] = s
            envs[s][old] = wait

    outs = _replicate(gm, stages, g, envs, afd.p2p_recv.default, on_transfer, enter)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    g.output(_concat_outputs(g, out_node, outs, sym, name))
    staged = fx.GraphModule(gm, g)
    staged.meta.update(gm.meta)
    return staged


def _concat_outputs(g: fx.Graph, out_node: fx.Node, outs: list[list[object]], sym: object, name: str) -> object:
    """The program's outputs: each stage's, concatenated along the batch dim."""
    flat_old, spec = torch.utils._pytree.tree_flatten(out_node.args[0])
    per_stage = [torch.utils._pytree.tree_flatten(o[0])[0] for o in outs]
    merged = []
    for j, old in enumerate(flat_old):
        val = old.meta.get("val") if isinstance(old, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            raise StageError(f"{name}: output {j} ({old}) is not a tensor; micro-batch stages concatenate tensors "
                             "along the batch")
        dim = next((d for d, size in enumerate(val.shape) if str(sym_expr(size)) == sym), None)
        if dim is None:
            raise StageError(f"{name}: output {j} ({old.name}, shape {tuple(val.shape)}) has no batch dim ({sym}): "
                             "micro-batch stages cannot put it back together")
        merged.append(g.call_function(aten.cat.default, ([p[j] for p in per_stage], dim)))
    return torch.utils._pytree.tree_unflatten(merged, spec)


def stage_ffn_program(gm: fx.GraphModule, stages: int, name: str = "FFN program") -> fx.GraphModule:
    """The FFN program of ``stages`` micro-batches: inputs ``token_slots_0 .. token_slots_{S-1}``
    (each stage's tokens over all peers, as ``[T_s, 0]``), every layer's FFN once per stage,
    layer-major; ``stages = 1`` returns ``gm`` itself."""
    _check_stages(stages)
    if stages == 1:
        return gm
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise StageError(f"{name}: expected one input (the token slots), got {[n.name for n in placeholders]}")
    g = fx.Graph()
    slots = [g.placeholder(f"token_slots_{s}") for s in range(stages)]
    envs: list[dict[fx.Node, object]] = [{placeholders[0]: slots[s]} for s in range(stages)]

    def on_transfer(old: fx.Node, new: fx.Node, s: int, last: fx.Node | None) -> fx.Node | None:
        if old.target == afd.p2p_recv_group.default and last is not None:
            new.args = (last, *new.args[1:])  # after the transfer before it (it allocates on dep's device)
        return new if old.target == afd.p2p_send_group.default else last

    outs = _replicate(gm, stages, g, envs, afd.p2p_send_group.default, on_transfer)
    g.output(outs[-1][0])
    staged = fx.GraphModule(gm, g)
    staged.meta.update(gm.meta)
    return staged
