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

What does not depend on the batch (positions, rotary tables, the causal mask before it is
expanded to the batch, a write position kept in a buffer) is computed once, where the first
micro-batch has it, and read by all (:func:`_once_nodes`).

A KV cache: each micro-batch reads and writes its own rows of it (a ``slice`` of the cache, which
``index_copy_`` updates in place). A program exported with a static cache has a static batch
``B``, written as a constant into its views and expands; its micro-batches are fixed at
:func:`static_rows` and ``passes/batch_dims.py`` finds the constants that are the batch (not the
head count that happens to equal it), which each copy says as its own rows. Its FFN program
pads each micro-batch's tokens to a multiple of ``B`` (:func:`_padded_tokens`). Under the compile
backend a graph may have a symbolic batch and a cache of static shape: the cache's rows are cut
with the symbolic micro-batch bounds (:func:`_written_rows`).

Refused with a :class:`StageError` naming the node: a state without the batch that each
micro-batch updates (a counter of tokens), an op the batch reaches that mixes sequences or has
no rule (``passes/batch_dims.py``), an output that is neither the batch's nor the same for all.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import sympy
import torch
import torch.fx as fx

from .. import meta_keys
from .. import ops as afd_ops  # noqa: F401  (registers the afd ops)
from ..errors import AFDCompileError
from ..layout import AFDLayout
from ..limits import MAX_STAGES
from .batch_dims import META_KEY as BATCH_KEY
from .batch_dims import BatchError, plan_batch
from .graph_utils import aliases_first_arg, batch_symbol_dims, row_carrier, writes_first_arg
from .symbolic import sym_expr

aten = torch.ops.aten
afd = torch.ops.afd

META_KEY = meta_keys.STAGE


class StageError(AFDCompileError):
    """A program that cannot run as micro-batch stages, and why."""


def check_stage_layout(layout: AFDLayout, stages: int, batch: int | None) -> None:
    """Refuse what micro-batch stages do not compose with yet, before anything runs (every rank
    and the CLI call it): attention TP groups over a static ``batch`` (a static KV cache). FFN TP /
    EP groups are staged (:func:`stage_ffn_program`), and attention TP groups over a dynamic
    batch (each micro-batch's tokens split over the group apart: ``runtime.AttentionWorker``)."""
    check_stages(stages)
    if stages == 1:
        return
    if layout.attn_tp > 1 and batch is not None:
        raise StageError(f"layout {layout}: micro-batch stages of attention TP groups over a static batch (a static "
                         f"KV cache, batch {batch}) are not supported yet; use stages=1 or attn_tp=1")


def check_stages(stages: int) -> None:
    """``stages`` is an integer in [1, MAX_STAGES]."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise StageError(f"stages must be an integer >= 1, got {stages!r}")
    if stages > MAX_STAGES:  # (each stage copies the program's nodes)
        raise StageError(f"stages must be at most {MAX_STAGES}, got {stages}")


def _replicate(gm: fx.GraphModule, stages: int, graph: fx.Graph, envs: list[dict[fx.Node, object]],
               boundary: object, on_transfer: Callable[[fx.Node, fx.Node, int, fx.Node | None], fx.Node | None],
               enter: Callable[[int, fx.Node | None], None] = lambda s, last: None,
               on_copy: Callable[[fx.Node, fx.Node, int], object] = lambda old, new, s: None,
               on_attr: Callable[[fx.Node, fx.Node, int], object] = lambda old, new, s: new,
               once: frozenset[fx.Node] = frozenset()) -> list[list[object]]:
    """Copy every node of ``gm`` but placeholders and output once per stage into ``graph``,
    segment by segment (a segment ends with a ``boundary`` op), stage-minor; ``get_attr`` once for
    all. ``on_transfer(old, new, stage, last)`` fixes a copied transfer (its stage, its
    dependency on the transfer before) and returns the token the next one depends on;
    ``enter(stage, last)`` runs before a stage's nodes of each segment; ``on_copy(old, new,
    stage)`` after each copy (a static batch's constants), returning what stands for ``old`` in
    the stage from then on (None: ``new``); ``on_attr(old, shared, stage)`` gives
    the stage's view of an attribute (a static cache's rows). ``once``: nodes copied once, where
    stage 0 has them, and used by every stage (what does not depend on the batch). Returns each
    stage's output values (the output node's args, mapped)."""
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
                    if n not in env:
                        env[n] = on_attr(n, shared[n], s)
                    continue
                if n in once:
                    if s == 0:
                        new = graph.node_copy(n, lambda a, _env=env: _env[a])
                        for e in envs:
                            e[n] = new
                    continue
                new = graph.node_copy(n, lambda a, _env=env: _env[a])
                new.meta[META_KEY] = s
                rep = on_copy(n, new, s)
                if n.op == "call_function" and n.target in afd_ops.AFD_OPS:
                    args = list(new.args)
                    args[3] = s  # stage_idx
                    new.args = tuple(args)
                    last = on_transfer(n, new, s, last)
                env[n] = new if rep is None else rep
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return [[fx.node.map_arg(a, lambda x, _env=env: _env[x]) for a in out.args] for env in envs]


def _carrier_vals(carriers: list[fx.Node], batched: torch.Tensor, dim: int) -> None:
    """Each micro-batch carrier's traced value: a fresh symbol (so the staged program compiles once
    for any split) whose example value is its share of the batch's, so no stage is traced empty
    (a slice traced as 0 rows specialises, and so does a size traced as 1). Left without one (the
    program then compiles per input shapes) when the batch's example value has fewer than two
    sequences a stage."""
    size = batched.shape[dim]
    mode = getattr(batched, "fake_mode", None)
    if mode is None or mode.shape_env is None or not isinstance(size, torch.SymInt):
        return
    hint = int(mode.shape_env.size_hint(size.node.expr))
    if hint < 2 * len(carriers):  # (a share traced as 1 row would be specialised to it)
        return
    for s, c in enumerate(carriers):
        share = hint // len(carriers) + (s < hint % len(carriers))
        c.meta["val"] = row_carrier(mode, c.name, share, batched.device)


def stage_attention_program(gm: fx.GraphModule, stages: int, name: str = "attention program") -> fx.GraphModule:
    """The attention program of ``stages`` micro-batches (module docstring); ``stages = 1``
    returns ``gm`` itself. With a dynamic batch its inputs are ``gm``'s, then one ``[b_s, 0]``
    tensor per stage whose first dim is that micro-batch's sequence count (they sum to the batch).
    With a static batch ``B`` (a program holding a static KV cache) the micro-batches are fixed:
    :func:`static_rows`, ``min(stages, B)`` of them; its inputs are ``gm``'s, each stage reads and
    writes its own rows of the cache, and every constant that is the batch says the stage's rows
    (``passes/batch_dims.py``)."""
    check_stages(stages)
    if stages == 1:
        return gm
    sym, dims = batch_symbol_dims(gm)
    if sym is None:
        return _stage_static_attention(gm, stages, name)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    g = fx.Graph()
    new_ph = {}
    for n in placeholders:
        new_ph[n] = g.placeholder(n.name)
        new_ph[n].meta.update(n.meta)
    carriers = [g.placeholder(f"stage_rows_{s}") for s in range(stages)]
    _carrier_vals(carriers, placeholders[dims[0][0]].meta["val"], dims[0][1])
    batch_dims: dict[int, list[int]] = {}
    for i, d in [*dims, *_written_rows(gm, placeholders, sym)]:
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
    def holds_batch(n: fx.Node) -> bool:  # its value's sizes involve the batch symbol
        val = n.meta.get("val")
        sizes = list(val.shape) if isinstance(val, torch.Tensor) else [val] if isinstance(val, torch.SymInt) else []
        return any(sym in {str(x) for x in sym_expr(size).free_symbols} for size in sizes)

    carried = {placeholders[i].name for i in batch_dims}
    once = _once_nodes(gm, carried, holds_batch, name)
    on_transfer, enter = _async_transfers(g, envs)
    outs = _replicate(gm, stages, g, envs, afd.p2p_recv.default, on_transfer, enter, once=once)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    g.output(_concat_outputs(g, out_node, outs, lambda j, val: next(
        (d for d, size in enumerate(val.shape) if str(sym_expr(size)) == sym), None), once, name, sym))
    staged = fx.GraphModule(gm, g)
    staged.meta.update(gm.meta)
    return staged


def _written_rows(gm: fx.GraphModule, placeholders: list[fx.Node], sym: str) -> list[tuple[int, int]]:
    """(input, dim) of each input a dynamic-batch program writes rows of the batch into in place
    while its own shape is static (the compile backend hands a KV cache that way: the graph
    mutates it, so its shape is fixed, while ``input_ids``'s batch is a symbol): each micro-batch
    writes and reads its own rows."""
    index = {n: i for i, n in enumerate(placeholders)}
    found: list[tuple[int, int]] = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (aten.index_copy_.default, aten.copy_.default):
            continue
        state, src = n.args[0], n.args[3] if n.target == aten.index_copy_.default else n.args[1]
        val, sval = getattr(state, "meta", {}).get("val"), getattr(src, "meta", {}).get("val")
        if state not in index or not isinstance(val, torch.Tensor) or not isinstance(sval, torch.Tensor):
            continue
        for d, size in enumerate(sval.shape):
            at = d + val.dim() - sval.dim()
            if sym in {str(x) for x in sym_expr(size).free_symbols} and at >= 0 \
                    and isinstance(val.shape[at], int) and (index[state], at) not in found:
                found.append((index[state], at))
    return found


def static_batch(gm: fx.GraphModule) -> int | None:
    """The batch of a program whose first input's dim 0 is a constant (a static KV cache fixes
    it), else None."""
    first = next((n for n in gm.graph.nodes if n.op == "placeholder"), None)
    val = first.meta.get("val") if first is not None else None
    if not isinstance(val, torch.Tensor) or val.dim() == 0 or not sym_expr(val.shape[0]).is_number:
        return None
    return int(sym_expr(val.shape[0]))


def static_rows(batch: int, stages: int) -> list[int]:
    """The sequences of each micro-batch of a static batch: the non-empty ones of
    :func:`~afd_compile.passes.pingpong.micro_batches` (every sequence the same length), so
    ``min(stages, batch)`` of them; the attention and FFN sides of a layout agree on it."""
    from ..layout import micro_batches

    return [end - start for start, end in micro_batches([1] * batch, stages) if end > start]


def _stage_static_attention(gm: fx.GraphModule, stages: int, name: str) -> fx.GraphModule:
    batch = static_batch(gm)
    if batch is None:
        raise StageError(f"{name}: its first input has no batch dim to split into micro-batches")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    seeds = {n.name: 0 for n in placeholders
             if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() > 0
             and n.meta["val"].shape[0] == batch}
    try:
        plan = plan_batch(gm, batch, seeds, name)
    except BatchError as e:
        raise StageError(str(e)) from None
    rows = static_rows(batch, stages)
    offsets = [sum(rows[:s]) for s in range(len(rows))]
    carried = dict(plan.inputs)
    sites: dict[str, list] = {}
    for site in plan.sites:
        sites.setdefault(site.node, []).append(site)
    g = fx.Graph()
    envs: list[dict[fx.Node, object]] = [{} for _ in rows]
    whole: dict[fx.Node, fx.Node] = {}
    for n in placeholders:
        new = g.placeholder(n.name)
        new.meta.update(n.meta)
        whole[n] = new
        for s, env in enumerate(envs):
            d = carried.get(n.name)
            env[n] = new if d is None else g.call_function(aten.slice.Tensor,
                                                           (new, d, offsets[s], offsets[s] + rows[s]))

    def on_attr(old: fx.Node, shared: fx.Node, s: int) -> object:
        d = carried.get(old.name)  # a state (the KV cache): the stage's rows, written in place
        return shared if d is None else g.call_function(aten.slice.Tensor,
                                                        (shared, d, offsets[s], offsets[s] + rows[s]))

    def on_copy(old: fx.Node, new: fx.Node, s: int) -> None:
        if old.op == "call_module" and "guards" in str(old.target):  # export's input checks: once, on the batch
            if s:
                g.erase_node(new)
            else:
                new.args = fx.node.map_arg(old.args, lambda a: whole.get(a, a))
            return
        if old.target == afd.p2p_recv.default:  # the tokens it receives: those its stage sent
            send = new.args[0]
            with g.inserting_before(new):
                tokens = g.call_function(aten.sym_size.int, (send.args[0][0], 0))
            new.args = (*new.args[:4], tokens, *new.args[5:])
        for site in sites.get(old.name, ()):
            args = list(new.args)
            sizes = list(args[site.arg])
            sizes[site.index] = site.resized(batch, rows[s])
            args[site.arg] = sizes
            new.args = tuple(args)

    def holds_batch(n: fx.Node) -> bool:
        if n.op == "call_function" and n.target == aten.sym_size.int:
            return n.args[0].meta.get(BATCH_KEY) == n.args[1]
        return n.name in sites or n.meta.get(BATCH_KEY) is not None

    once = _once_nodes(gm, set(carried), holds_batch, name)
    on_transfer, enter = _async_transfers(g, envs)
    outs = _replicate(gm, len(rows), g, envs, afd.p2p_recv.default, on_transfer, enter, on_copy, on_attr,
                      once=once)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    g.output(_concat_outputs(g, out_node, outs, lambda j, val: plan.outputs[j], once, name))
    staged = fx.GraphModule(gm, g)
    staged.meta.update(gm.meta)
    return staged


def _once_nodes(gm: fx.GraphModule, carried: set[str], holds_batch: Callable[[fx.Node], bool],
                name: str) -> frozenset[fx.Node]:
    """The nodes that do not depend on the batch (positions, rotary tables, the causal mask
    before it is expanded to the batch, a write position kept in a buffer): the same in every
    micro-batch, so computed once, where the first micro-batch has them. A node depends on the
    batch when ``holds_batch`` says its value does, or it reads one that does (but a size
    other than the batch's is the same in every micro-batch). A state (input or buffer) that
    does not hold the batch and is updated in place by a node of each micro-batch is refused:
    every micro-batch would update it and the next read it (a batch-free update runs once per
    step, as without stages)."""
    staged: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            if n.name in carried:
                staged.add(n)
        elif n.op == "call_function" and n.target == aten.sym_size.int:
            if holds_batch(n):
                staged.add(n)
        elif n.op != "output" and (holds_batch(n) or any(a in staged for a in n.all_input_nodes)
                                   or n.op == "call_module" or n.target in afd_ops.AFD_OPS):
            staged.add(n)
    for n in gm.graph.nodes:
        if n in staged and n.op == "call_function" and n.args and writes_first_arg(n):
            base = n.args[0]
            while isinstance(base, fx.Node) and base.op == "call_function" and base.args and aliases_first_arg(base):
                base = base.args[0]
            if isinstance(base, fx.Node) and base not in staged:  # a state, or a tensor computed once
                raise StageError(f"{name}: node {n.name} ({n.target}) updates {base.name}, which does not hold the "
                                 "batch, from each micro-batch's values: every micro-batch would update it and the "
                                 "next read it; run with stages=1")
    return frozenset(n for n in gm.graph.nodes if n.op == "call_function" and n not in staged)


def _async_transfers(g: fx.Graph, envs: list[dict[fx.Node, object]]) -> tuple[Callable, Callable]:
    """The ``on_transfer`` and ``enter`` hooks of :func:`_replicate` for an attention program:
    sends and receives start where they were, a receive is waited on where its stage next runs."""
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

    return on_transfer, enter


def _concat_outputs(g: fx.Graph, out_node: fx.Node, outs: list[list[object]],
                    batch_dim: Callable[[int, torch.Tensor], int | None], once: frozenset[fx.Node],
                    name: str, batch_symbol: str | None = None) -> object:
    """The program's outputs: each stage's, concatenated along the batch dim
    (``batch_dim(j, value)`` of output ``j``); one computed once (``once``) as it is; a size
    that is a multiple of the batch (symbol ``batch_symbol``), summed over the stages."""
    flat_old, spec = torch.utils._pytree.tree_flatten(out_node.args[0])
    per_stage = [torch.utils._pytree.tree_flatten(o[0])[0] for o in outs]
    merged = []
    for j, old in enumerate(flat_old):
        if not isinstance(old, fx.Node) or old in once:
            merged.append(per_stage[0][j])
            continue
        val = old.meta.get("val") if isinstance(old, fx.Node) else None
        if isinstance(val, torch.SymInt) and batch_symbol is not None:
            expr = sym_expr(val)
            b = sympy.Symbol(batch_symbol, integer=True, positive=True)
            b = next((x for x in expr.free_symbols if str(x) == batch_symbol), b)
            if sympy.simplify(expr - b * sympy.diff(expr, b)) == 0:  # c * batch: the stages' values add up
                total = per_stage[0][j]
                for p in per_stage[1:]:
                    total = g.call_function(operator.add, (total, p[j]))
                merged.append(total)
                continue
        if not isinstance(val, torch.Tensor):
            raise StageError(f"{name}: output {j} ({old}) is not a tensor; micro-batch stages concatenate tensors "
                             "along the batch")
        dim = batch_dim(j, val)
        if dim is None:
            raise StageError(f"{name}: output {j} ({old.name}, shape {tuple(val.shape)}) has no batch dim: "
                             "micro-batch stages cannot put it back together")
        merged.append(g.call_function(aten.cat.default, ([p[j] for p in per_stage], dim)))
    return torch.utils._pytree.tree_unflatten(merged, spec)


def stage_ffn_program(gm: fx.GraphModule, stages: int, name: str = "FFN program",
                      batch: int | None = None) -> fx.GraphModule:
    """The FFN program of ``stages`` micro-batches: inputs ``token_slots_0 .. token_slots_{S-1}``
    (each stage's tokens over all peers, as ``[T_s, 0]``), every layer's FFN once per stage,
    layer-major; ``stages = 1`` returns ``gm`` itself. ``batch``: the static batch of its
    attention peers (None: dynamic): ``min(stages, batch)`` stages (:func:`static_rows`), each
    padding its tokens to a multiple of the batch (:func:`_padded_tokens`).

    The program of an FFN TP group (passes/ffn_tp.py: a second input, the group's tokens) takes
    ``ffn_group_slots_0 .. S-1`` after the token slots, and each stage's collectives read that
    stage's per-rank counts (the ``stage`` argument of ``afd.all_gather_tokens`` /
    ``reduce_scatter_tokens``); an expert-parallel group's all-to-alls need nothing more. Every
    rank of a group runs the same stages (a stage with no token of its own still joins the
    group's collectives)."""
    check_stages(stages)
    if batch is not None:
        stages = len(static_rows(batch, stages))
    if stages == 1:
        return gm

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    group = len(placeholders) == 2 and placeholders[1].name == "ffn_group_slots"
    if len(placeholders) != 1 and not group:
        raise StageError(f"{name}: expected one input (the token slots), or two in an FFN TP group (and the "
                         f"group's), got {[n.name for n in placeholders]}")
    g = fx.Graph()
    padded = _padded_tokens(gm, g, batch) if batch is not None else (lambda old, new, s: None)

    def on_copy(old: fx.Node, new: fx.Node, s: int) -> object:
        _group_stage(old, new, s)
        return padded(old, new, s)

    slots = [g.placeholder(f"token_slots_{s}") for s in range(stages)]
    envs: list[dict[fx.Node, object]] = [{placeholders[0]: slots[s]} for s in range(stages)]
    if group:  # then each stage's group tokens: ffn_group_slots_0 .. S-1
        for s in range(stages):
            envs[s][placeholders[1]] = g.placeholder(f"ffn_group_slots_{s}")

    def on_transfer(old: fx.Node, new: fx.Node, s: int, last: fx.Node | None) -> fx.Node | None:
        if old.target == afd.p2p_recv_group.default and last is not None:
            new.args = (last, *new.args[1:])  # after the transfer before it (it allocates on dep's device)
        return new if old.target == afd.p2p_send_group.default else last

    outs = _replicate(gm, stages, g, envs, afd.p2p_send_group.default, on_transfer, on_copy=on_copy)
    g.output(outs[-1][0])
    staged = fx.GraphModule(gm, g)
    staged.meta.update(gm.meta)
    if batch is None:  # (each carrier a fresh symbol: the program compiles once for any rows)
        from .split import propagate_ffn_meta

        propagate_ffn_meta(staged)
    return staged


#: an FFN TP group's collectives, which read the step's per-rank counts of their stage
_GROUP_COLLECTIVES = {afd.all_gather_tokens.default: 3, afd.reduce_scatter_tokens.default: 4}


def _group_stage(old: fx.Node, new: fx.Node, s: int) -> None:
    """The ``on_copy`` of an FFN TP group's program: each copied group collective reads stage
    ``s``'s counts (``comm.step_counts`` with one entry per stage)."""
    at = _GROUP_COLLECTIVES.get(new.target) if new.op == "call_function" else None
    if at is not None:
        new.args = (*new.args[:at], s)


def _padded_tokens(gm: fx.GraphModule, graph: fx.Graph, batch: int) -> Callable[[fx.Node, fx.Node, int], object]:
    """The ``on_copy`` of the FFN program of a static batch ``B``. That program was cut from a
    graph whose every size holds ``B`` as a constant (it views what it receives as ``[B, T // B,
    H]``, MoE routing sizes its buffers ``B * k * (T // B)``), so it runs on a multiple of ``B``
    tokens only. A micro-batch's ``T_s`` tokens are padded with zero rows to the next multiple
    of ``B`` where they are received and cut back where they are sent: an FFN is per token (the
    AFD contract), so the padding rows change no real token's output; they cost at most
    ``B - 1`` tokens of FFN compute per micro-batch.

    ``total_tokens = sym_size(token_slots, 0)`` stays the count received and sent; every other
    use reads ``padded = (total_tokens + B - 1) // B * B``; ``p2p_recv_group``'s tensors get
    ``constant_pad_nd``, ``p2p_send_group``'s a ``slice`` to ``total_tokens``."""
    slots = next(n for n in gm.graph.nodes if n.op == "placeholder")  # (an FFN TP group's second input, its
    # group's tokens, comes padded: the runtime sums the group's padded counts)
    totals = {n for n in slots.users if n.op == "call_function" and n.target == aten.sym_size.int}
    raw: dict[int, fx.Node] = {}  # stage -> its total_tokens
    padded: dict[int, fx.Node] = {}  # stage -> the multiple of B it is padded to

    def on_copy(old: fx.Node, new: fx.Node, s: int) -> object:
        if old in totals:
            raw[s] = new
            up = graph.call_function(operator.add, (new, batch - 1))
            padded[s] = graph.call_function(operator.mul, (graph.call_function(operator.floordiv, (up, batch)), batch))
            return padded[s]
        if old.op == "call_module" and "guards" in str(old.target):
            graph.erase_node(new)  # export's input checks: T a multiple of B, which a micro-batch's T_s is not
            return None
        if old.op != "call_function":
            return None
        if old.target == afd.p2p_recv_group.default:
            new.args = (*new.args[:4], raw[s], *new.args[5:])  # receives the real tokens
            return None
        if old.target == operator.getitem and isinstance(old.args[0], fx.Node) \
                and old.args[0].target == afd.p2p_recv_group.default:
            val = old.meta.get("val")
            rank = val.dim() if isinstance(val, torch.Tensor) else 2
            extra = graph.call_function(operator.sub, (padded[s], raw[s]))
            return graph.call_function(aten.constant_pad_nd.default, (new, [0, 0] * (rank - 1) + [0, extra], 0.0))
        if old.target == afd.p2p_send_group.default:
            with graph.inserting_before(new):
                cut = [graph.call_function(aten.slice.Tensor, (t, 0, 0, raw[s])) for t in new.args[0]]
            new.args = (cut, *new.args[1:])
        return None

    return on_copy
