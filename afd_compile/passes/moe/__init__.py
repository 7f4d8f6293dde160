"""MoE recognition: each MoE block's experts, whatever form the model wrote them in, become one
``afd::moe_experts`` node (:func:`recognise_moe`; the op is ``afd_compile/moe.py``).

Before (transformers' ``grouped_mm`` experts, one block; the router above is kept)::

    topk = aten.topk(softmax, 2); getitem = topk[0]; getitem_1 = topk[1]
    sort = aten.sort(reshape(getitem_1, [-1])); histc = aten.histc(...); cumsum_1 = aten.cumsum(histc, 0)
    grouped_mm = _grouped_mm(index(view_3, [floor_divide]), transpose(gate_up_proj), cumsum_1)
    ... chunk, silu, mul, _grouped_mm(down_proj), mul by routing weights, index_put_, index ...
    sum_1 = aten.sum(view(index_6, [T, 2, 64]), [1])                      # the combine, [T, H]

After::

    topk = aten.topk(softmax, 2); getitem = topk[0]; getitem_1 = topk[1]
    to_14 = aten.to(getitem, float32)
    moe_experts = afd.moe_experts(view_3, getitem_1, to_14, gate_up_proj, down_proj, None, None,
                                  'silu', True, False)

Found by structure (``block.py``: top-k, token rows, combine), confirmed by evaluation
(``match.py``: the block run on random rows equals the op on the model's own weights). The forms
this covers are whatever reproduces under the op: a loop over experts (``where`` / ``nonzero`` /
``one_hot`` selection, ``index_add_`` / ``index_put_`` combines), gathered per-(token, expert)
weights and ``bmm``, ``torch._grouped_mm`` (or a library's grouped-mm op) with offsets, ``bmm`` /
``einsum`` over stacked weights with a dense dispatch; softmax or sigmoid routers, renormalised
or not, biased or group-limited choices, routing weights gathered from the scores after top-k.

A block that is routed by top-k and combined per token but matches no configuration is recorded
with the reason (``plan`` prints it) and left as the model wrote it; ``strict=True`` makes it an
error naming the block and what was tried.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ... import meta_keys
from ... import moe as _moe  # noqa: F401  (registers afd::moe_experts)
from ...errors import AFDCompileError
from ..graph_utils import del_attr_path, drop_dead_writes, get_attr_path, writes_first_arg
from .block import Block, find_blocks
from .match import Match, match_block

log = logging.getLogger("afd_compile.moe")

aten = torch.ops.aten

#: ``node.meta`` key of each ``afd::moe_experts`` node this pass made: its :class:`MoERecord`
META_KEY = meta_keys.MOE
#: ``gm.meta`` key: every block's record, recognised or not, in graph order
RECORDS_KEY = meta_keys.MOE_RECORDS


class MoERecognitionError(AFDCompileError):
    """An MoE block's experts match no form the op covers (with ``strict``)."""


@dataclass(frozen=True)
class MoERecord:
    """One MoE block: the form found, the op that replaced it (None when none did, and why)."""

    combine: str  # the model's combine node (the block's routed output)
    op: str | None
    form: str
    experts: int
    top_k: int
    activation: str | None = None
    gated: bool | None = None
    weight_first: bool | None = None
    weights: str = ""
    reason: str = ""

    def __str__(self) -> str:
        if self.op is None:
            return f"{self.combine}: {self.form} (E={self.experts}, top-{self.top_k}) not recognised: {self.reason}"
        how = f"{'gated ' if self.gated else ''}{self.activation}{', weights first' if self.weight_first else ''}"
        return f"{self.op}: {self.form} (E={self.experts}, top-{self.top_k}, {how}) from {self.weights}"


def recognise_moe(gm: fx.GraphModule, strict: bool = False, graph_name: str = "graph") -> list[MoERecord]:
    """Replace each recognised MoE block's experts with one ``afd::moe_experts`` node, in place;
    returns every block's record (also added to ``gm.meta[RECORDS_KEY]``). Blocks recognised
    already (the op in place) are not found again."""
    records = []
    replaced: set[str] = set()
    views = functional_writes(gm)
    for j, block in enumerate(find_blocks(gm)):
        form = form_of(block)
        match, why = match_block(gm, block)
        if match is None:
            rec = MoERecord(block.end.name, None, form, block.num_experts, block.top_k, reason=why)
            if strict:
                raise MoERecognitionError(
                    f"{graph_name}: MoE block combined at {block.end.name} (experts chosen by {block.ids.name}, "
                    f"{form}): {why}; tensor and expert parallelism shard experts only as the recognised "
                    "afd::moe_experts op (the forms it covers: README, 'MoE experts'); AFD without FFN groups "
                    "runs any form")
            log.warning("%s", rec)
        else:
            op = _rewrite(gm, block, match, j)
            replaced |= {str(p.target) for p in block.params}
            w = match.weights
            rec = MoERecord(block.end.name, op.name, form, block.num_experts, block.top_k, str(match.activation),
                            w.gated, match.weight_first, w.how)
            op.meta[META_KEY] = rec
        records.append(rec)
    restore_writes(gm, views)
    if any(r.op for r in records):
        _drop_unused_attrs(gm, replaced)
    if views or any(r.op for r in records):
        gm.graph.lint()
        gm.recompile()
    gm.meta[RECORDS_KEY] = gm.meta.get(RECORDS_KEY, ()) + tuple(records)  # (a second run finds none)
    return records


def functional_writes(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """Each op that writes its first argument in place and returns nothing (a library's mutating
    custom op, ``lib::index_add_rows_(out, index, src)``), seen functionally for the recognition:
    its result as a node the later readers read, so the combine is found by data flow as any
    other. Before::

        zeros_like = aten.zeros_like(x); lib.index_add_rows_(zeros_like, rows, y); view = view(zeros_like, ...)

    After (the call made again by :func:`restore_writes` where no recognised block took it)::

        af = auto_functionalized(lib.index_add_rows_, out=zeros_like, index=rows, src=y); out = af[1]
        view = view(out, ...)

    Returns (auto_functionalized, its result) per op; :func:`restore_writes` undoes what no
    recognised block consumed."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    done = []
    for n in list(gm.graph.nodes):
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None or schema.returns or not writes_first_arg(n):
            continue
        base = n.args[0]
        writes = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        later = [u for u in base.users if order[u] > order[n]] if isinstance(base, fx.Node) else []
        if len(writes) != 1 or not later or not isinstance(base.meta.get("val"), torch.Tensor):
            continue
        kwargs = dict(zip((a.name for a in schema.arguments), n.args, strict=False)) | dict(n.kwargs)
        with gm.graph.inserting_before(n):
            af = gm.graph.call_function(auto_functionalized, (n.target,), kwargs)
            out = gm.graph.call_function(operator.getitem, (af, 1))
        af.meta["val"], out.meta["val"] = (None, base.meta["val"]), base.meta["val"]
        out.meta.update({k: n.meta[k] for k in ("nn_module_stack", meta_keys.ROLE) if k in n.meta})
        for u in later:
            u.replace_input_with(base, out)
        gm.graph.erase_node(n)
        done.append((af, out))
    return done


def restore_writes(gm: fx.GraphModule, views: list[tuple[fx.Node, fx.Node]]) -> None:
    """Undo :func:`functional_writes` where no recognised block consumed the result (its readers
    read the written tensor again), and drop the functional nodes either way."""
    for af, out in views:
        if out.users:  # (the write as the model made it, read after it as before)
            base = af.kwargs[next(iter(af.kwargs))]
            with gm.graph.inserting_before(af):
                write = gm.graph.call_function(af.args[0], (), dict(af.kwargs))
            write.meta.update({k: out.meta[k] for k in ("nn_module_stack", meta_keys.ROLE) if k in out.meta})
            out.replace_all_uses_with(base)
        gm.graph.erase_node(out)
        gm.graph.erase_node(af)


def form_of(block: Block) -> str:
    """What the model wrote, named by the ops of its expert path (for ``plan``)."""
    names = {str(getattr(n.target, "__name__", n.target)) for n in block.experts}
    if any("grouped_mm" in t for t in names):
        return "grouped_mm experts"
    combines = sorted({t.split(".")[0] for t in names} & {"index_add_", "index_add", "index_put_", "index_put",
                                                          "scatter_add", "scatter_add_"})
    linears = sum(1 for n in block.experts if n.target in (aten.linear.default, aten.mm.default, aten.addmm.default))
    if linears >= 2 * block.num_experts:
        return f"loop over experts ({', '.join(combines) or 'add'})"
    gathered = any(n.target == aten.index.Tensor and isinstance(n.args[0], fx.Node) and n.args[0] in block.params
                   for n in block.closure)
    if any(t.split(".")[0] in ("bmm", "einsum", "matmul", "baddbmm") for t in names):
        return "gathered-weight bmm experts" if gathered else "stacked-weight bmm experts"
    return "experts of another form"


def _rewrite(gm: fx.GraphModule, block: Block, match: Match, j: int) -> fx.Node:
    graph = gm.graph
    w = match.weights
    mode = block.x.meta["val"].fake_mode
    role = {k: block.end.meta[k] for k in ("nn_module_stack", "stack_trace", meta_keys.ROLE) if k in block.end.meta}

    def node(target: object, args: tuple) -> fx.Node:
        n = graph.call_function(target, args)
        with mode:
            n.meta["val"] = target(*fx.node.map_arg(args, lambda a: a.meta["val"]))
        n.meta.update(role)
        return n

    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):  # (attributes first, as export places them)
        attrs = [None if t is None else _attr(gm, block, t, f"afd_moe{j}_{name}")
                 for name, t in (("w_gate_up", w.w_gate_up), ("w_down", w.w_down), ("b_gate_up", w.b_gate_up),
                                 ("b_down", w.b_down))]
    with graph.inserting_before(block.end):
        ids = block.ids if block.ids.meta["val"].dim() == 2 else node(aten.unsqueeze.default, (block.ids, 1))
        routing = node(aten.gather.default, (match.routing, 1, ids)) if match.dense else match.routing
        if routing.meta["val"].dim() == 1:  # (one expert per token, its weight [T])
            routing = node(aten.unsqueeze.default, (routing, 1))
        op = node(torch.ops.afd.moe_experts.default, (block.x, ids, routing, *attrs, match.activation.name,
                                                      w.gated, match.weight_first, *match.activation.args))
        out = op
        if op.meta["val"].dtype != block.end.meta["val"].dtype:
            out = node(aten.to.dtype, (op, block.end.meta["val"].dtype))
    _redirect(graph, block, out)
    _erase(graph, block)
    drop_dead_writes(graph)  # (an in-place update of a temporary only the experts read, outside the block)
    return op


def _attr(gm: fx.GraphModule, block: Block, t: torch.Tensor, name: str) -> fx.Node:
    """A get_attr of ``t``: the model's own attribute when ``t`` is one, else ``t`` (contiguous)
    registered as a new one."""
    target = next((str(p.target) for p in block.params if get_attr_path(gm, str(p.target)) is t), None)
    if target is None:
        target = name
        while hasattr(gm, target):
            target += "_"
        gm.register_parameter(target, torch.nn.Parameter(t.detach().contiguous(), requires_grad=False))
    n = gm.graph.get_attr(target)
    n.meta["val"] = block.x.meta["val"].fake_mode.from_tensor(get_attr_path(gm, target), static_shapes=True)
    return n


def _redirect(graph: fx.Graph, block: Block, out: fx.Node) -> None:
    """Readers of the combine (and of tensors the expert path wrote in place, read after it)
    read the op; anything else reading the expert path is an error."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    gone = block.experts | {block.end}
    for n in gone:
        for u in list(n.users):
            if u in gone:
                continue
            if u.target in (aten._assert_tensor_metadata.default, aten._assert_scalar.default):
                graph.erase_node(u)  # (a check of a tensor the op replaces)
                continue
            if n is block.end or (n in block.bases and order[u] > order[block.end]):
                u.replace_input_with(n, out)
            else:
                raise MoERecognitionError(f"MoE block combined at {block.end.name}: {u.name} reads {n.name} from "
                                          "inside the expert computation")


def _erase(graph: fx.Graph, block: Block) -> None:
    """Remove the expert path, then what only fed it (sorted ids, dense weights, the per-expert
    selections and their size asserts); an in-place update of a tensor still read is kept."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    lo, hi = order[block.first], order[block.end]
    zone = {n for n in graph.nodes if lo < order[n] <= hi} | set(block.closure) - {block.source}
    checks = (aten._assert_tensor_metadata.default, aten._assert_scalar.default)
    for n in sorted(zone, key=order.__getitem__, reverse=True):
        if n.users or n.op in ("placeholder", "output"):
            continue
        if writes_first_arg(n) and n.target not in checks:
            base = n.args[0]
            if isinstance(base, fx.Node) and base not in block.experts and any(u is not n for u in base.users):
                continue  # (an update of a tensor something else reads)
        elif n.target not in checks and n.is_impure():
            continue
        graph.erase_node(n)


def _drop_unused_attrs(gm: fx.GraphModule, targets: set[str]) -> None:
    """The model's expert weights nothing reads any more (stacked into new ones) are freed."""
    read = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for name in sorted(targets - read):
        del_attr_path(gm, name)
