"""Shard a graph for one TP rank and insert the collectives its junctions need.

Plan first (``plan_tp`` -> junctions, ``plan_shards`` -> weights and head counts), then rewrite a
copy of the graph: weights sliced for this rank, head counts divided, and after every
row-parallel linear the collective that settles its partial sum. Standard TP (attn_dp == 1),
one layer, after::

    o = linear(attn, o_proj.weight[:, r])        # TP_ATTN_FULL+P
    o = afd.all_reduce(o, group=ATTN_TP)         # prepare_mlp: all_reduce
    h1 = add(x, o)                               # middle_residual TP_ATTN_FULL
    ...
    d = linear(m, down_proj.weight[:, r])        # FULL+P
    d = afd.all_reduce(d, group=TP)              # postprocess_layer: all_reduce
    h2 = add(h1, d)

The all-reduce sits on the row-parallel output, before anything else reads it, so the residual
add and the next norm see the full sum (the all-reduce + add + RMSNorm unit stays adjacent for a
fused kernel to replace).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from ..comm import GROUP_ATTN_TP, GROUP_TP
from ..errors import TPRewriteError
from ..scatter import Collective, ScatterMode, TPLayout
from .anatomy import attention_row, is_identity, rebind_token_sizes, residual_add_after_attention
from .dist_states import TPPlan, annotate_dist_states, plan_tp
from .graph_utils import copy_graph_module
from .pipeline import PassTimings
from .roles import META_KEY as ROLE_KEY
from .scattered import ScatteredRewriteError, expert_parallel, rewrite_scattered_layers
from .shard import ShardPlan, apply_shards, plan_shards


@dataclass
class TPProgram:
    program: fx.GraphModule
    plan: TPPlan
    shards: ShardPlan
    rank: int
    timings: dict[str, float] = field(default_factory=dict)  # seconds per pass (PassTimings)


SUPPORTED = {
    "prepare_attn": {Collective.ALL_GATHER},
    "prepare_mlp": {Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER},
    "postprocess_layer": {Collective.ALL_REDUCE, Collective.REDUCE_SCATTER, Collective.ALL_GATHER},
}


def _check_supported(plan: TPPlan, layout: TPLayout) -> None:
    kinds = {modes.kind for modes, _ in plan.layers}
    if layout.moe_a2a and "moe" not in kinds:
        raise TPRewriteError(f"moe_a2a (--moe-a2a) is set, but the graph has no MoE layer (layer kinds: "
                             f"{sorted(kinds)}); it would change nothing")
    if layout.dense_dp and "dense" not in kinds:
        raise TPRewriteError(f"dense_dp (--dense-dp) is set, but the graph has no dense MLP layer (layer kinds: "
                             f"{sorted(kinds)}); it would change nothing")
    for modes, junctions in plan.layers:
        for name in ("prepare_attn", "prepare_mlp", "postprocess_layer"):
            for t in getattr(junctions, name):
                if t.collective not in SUPPORTED[name]:
                    raise TPRewriteError(
                        f"layer {modes.index} {name}: {t} is planned, but its rewrite is not implemented yet; "
                        "`afd-compile plan` shows the full plan"
                    )


def shard_for_rank(gm: fx.GraphModule, layout: TPLayout, rank: int, graph_name: str = "graph",
                   fuse_norm: bool = True) -> TPProgram:
    """This rank's program. Needs ``afd.role`` on ``gm`` (run annotate_roles first). With
    ``fuse_norm`` each all-reduce + residual add + RMSNorm becomes one fusable op (fuse_norm.py)."""
    timings = PassTimings()
    with timings("plan_tp"):
        plan = plan_tp(gm, layout, graph_name)
    with timings("annotate_dist_states"):
        annotate_dist_states(gm, plan)
    _check_supported(plan, layout)
    scattered = frozenset(m.index for m, _ in plan.layers if m.mlp is ScatterMode.SCATTERED)
    with timings("plan_shards"):
        shards = plan_shards(gm, attn_parts=layout.attn_tp, mlp_parts=layout.tp, replicated_mlp=scattered)
    with timings("apply_shards"):
        new, _ = copy_graph_module(gm)
        apply_shards(new, shards, {"attn": layout.attn_tp_rank(rank), "mlp": rank})
        fake_mode = detect_fake_mode([n.meta.get("val") for n in new.graph.nodes if "val" in n.meta])
        by_name = {n.name: n for n in new.graph.nodes}
        _settle_split_means(new, shards, by_name, fake_mode)
    experts = []
    with timings("expert_parallel"):
        for m, _ in plan.layers:  # MoE with all-to-all: experts split over the TP group
            if m.kind == "moe" and m.mlp is ScatterMode.SCATTERED and layout.tp > 1:
                try:
                    experts.extend(expert_parallel(new, m.index, layout.tp, rank, fake_mode))
                except ScatteredRewriteError as e:
                    raise TPRewriteError(str(e)) from None
    if experts:  # (expert_parallel sliced them)
        shards = replace(shards, weights=shards.weights + tuple(experts))
    with timings("rewrite_scattered_layers"):
        settled = rewrite_scattered_layers(new, plan, layout, rank, fake_mode)
        if settled or experts:
            new.graph.eliminate_dead_code()
    if layout.attn_dp > 1:
        with timings("rewrite_dp_attention"):
            _rewrite_dp_attention(new, layout, rank, fake_mode, skip=scattered)
            new.graph.lint()
            new.recompile()
        return TPProgram(new, plan, shards, rank, timings.seconds)
    with timings("insert_all_reduces"):
        _insert_row_all_reduces(new, shards, settled, by_name, fake_mode)
    if fuse_norm:
        from .fuse_norm import fuse_allreduce_add_rmsnorm

        with timings("fuse_norm"):
            fuse_allreduce_add_rmsnorm(new)
    return TPProgram(new, plan, shards, rank, timings.seconds)


def _insert_row_all_reduces(new: fx.GraphModule, shards: ShardPlan, settled: set[int] | frozenset[int],
                            by_name: dict[str, fx.Node], fake_mode: object) -> None:
    """Standard TP: an all-reduce after every row-parallel output (o_proj, down_proj) whose
    partial sum no SCATTERED rewrite settled already."""
    for node_name, group, layer in shards.row_outputs:
        if layer in settled:  # o_proj's partial sum went into a reduce-scatter (SCATTERED MLP)
            continue
        row = by_name[node_name]
        while len(row.users) == 1 and is_identity(next(iter(row.users))):  # keep all-reduce + add adjacent
            row = next(iter(row.users))
        with new.graph.inserting_after(row):
            ar = new.graph.call_function(torch.ops.afd.all_reduce.default,
                                         (row, GROUP_ATTN_TP if group == "attn" else GROUP_TP))
        ar.meta[ROLE_KEY] = row.meta.get(ROLE_KEY)
        if fake_mode is not None and "val" in row.meta:
            with fake_mode:
                ar.meta["val"] = torch.ops.afd.all_reduce.default(row.meta["val"], 0)
        row.replace_all_uses_with(ar, delete_user_cb=lambda u, _ar=ar: u is not _ar)
    new.graph.lint()
    new.recompile()


def _settle_split_means(new: fx.GraphModule, shards: ShardPlan, by_name: dict[str, fx.Node],
                        fake_mode: object) -> None:
    """A mean over a split dim (OLMo-2's q/k RMSNorm over all heads) becomes the full mean::

        v = mean(x_slice, -1, keepdim)        ->   v = afd.all_reduce(mean(x_slice, -1, keepdim)) / parts

    (every rank holds an equal slice, so the mean of the slice means is the full mean)."""
    for node_name, group, _layer, parts in shards.split_means:
        mean = by_name[node_name]
        with new.graph.inserting_after(mean):
            ar = new.graph.call_function(torch.ops.afd.all_reduce.default,
                                         (mean, GROUP_ATTN_TP if group == "attn" else GROUP_TP))
        with new.graph.inserting_after(ar):
            full = new.graph.call_function(torch.ops.aten.div.Tensor, (ar, parts))
        for x in (ar, full):
            x.meta[ROLE_KEY] = mean.meta.get(ROLE_KEY)
            if fake_mode is not None and "val" in mean.meta:
                x.meta["val"] = mean.meta["val"]
        mean.replace_all_uses_with(full, delete_user_cb=lambda u, _ar=ar: u is not _ar)


# --- DP attention (attn_dp > 1) ---------------------------------------------------------------


def _rewrite_dp_attention(new: fx.GraphModule, layout: TPLayout, rank: int,
                          fake_mode: object, skip: frozenset[int] = frozenset()) -> None:
    """Junctions of DP attention, per layer (dense MLP, mode FULL):

    attn_tp == 1 (norm before all-gather: the norm runs on this rank's tokens only)::

        n = post_attention_norm(h1)                        # TP_ATTN_FULL, own tokens
        g = afd.all_gather_tokens(view(n, [-1, H]))        # prepare_mlp: FULL, all tokens
        m = mlp(g)                                         # FULL + partial
        h2 = h1 + view(afd.reduce_scatter_tokens(m), ...)  # postprocess_layer: own tokens

    attn_tp > 1 (SGLang's dp_gather_partial: one collective settles o_proj's partial sum and
    gathers; the residual is added on attention-TP rank 0 only so it is counted once)::

        G = afd.gather_partial_tokens(view(o + x * [attn_tp_rank == 0], [-1, H]))  # FULL
        h1 = view(afd.scatter_tokens(G), [b, s, H])       # middle residual: own tokens, no comm
        n = post_attention_norm(G)                         # the norm runs on the gathered tokens
        m = mlp(n) ; h2 = h1 + view(afd.reduce_scatter_tokens(m), ...)

    The graph gets one more input, ``dp_token_slots`` (a ``(total, 0)`` carrier of all DP
    groups' tokens), so every size stays a graph value.
    """
    from ..comm import GROUP_TP
    from .graph_utils import Builder, layers_of, region_output, shape_args, symbol_sources
    from .roles import META_KEY as RKEY
    from .roles import Role, ancestors, descendants

    graph = new.graph
    graph._codegen = fx.graph.CodeGen()  # flat positional inputs: the model's, then dp_token_slots
    for k in ("_in_spec", "_out_spec"):
        if hasattr(new, k):
            delattr(new, k)
    drop_export_guards(new)  # export's input guards assume the original batch range (min 1)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]):
        slots = graph.placeholder("dp_token_slots")
    if fake_mode is not None:
        from torch._dynamo.source import ConstantSource
        from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

        slots.meta["val"] = fake_mode.from_tensor(torch.empty(8, 0), source=ConstantSource("dp_token_slots"),
                                                  symbolic_context=StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    b0 = Builder(graph, fake_mode, None)
    with graph.inserting_after(slots):
        total = b0.call(aten_sym_size, (slots, 0), "dp_total_tokens")
    sources = symbol_sources(graph)
    by_layer = {i: list(layer.members) for i, layer in layers_of(new).items()}
    root = 1.0 if layout.attn_tp_rank(rank) == 0 else 0.0
    for layer, members in sorted(by_layer.items()):
        if layer in skip:  # a SCATTERED (fully data-parallel) MLP: this rank's tokens, replicated weights
            continue
        where = f"layer {layer}"
        ffn = [n for n in members if n.meta[RKEY].role is Role.FFN]
        ffn_set = set(ffn)
        out = region_output(ffn)
        inputs = [a for n in ffn for a in n.all_input_nodes if a not in ffn_set and a.op != "get_attr"]
        tensors = [a for a in dict.fromkeys(inputs) if isinstance(a.meta.get("val"), torch.Tensor)]
        sizes = [a for a in dict.fromkeys(inputs) if a not in tensors]
        if len(tensors) != 1:
            raise TPRewriteError(f"{where}: DP attention needs an MLP that reads one hidden tensor; it reads "
                                 f"{[a.name for a in tensors]}")
        ffn_in = tensors[0]
        hidden = int(ffn_in.meta["val"].shape[-1])
        b = Builder(graph, fake_mode, layer)
        if sizes:  # an MoE block sizes its buffers from the token count: now all groups' tokens
            rebind_token_sizes(b, ffn, sizes, ffn_in, total, where)
        if layout.attn_tp == 1:
            with graph.inserting_before(ffn[0]):
                flat = b.call(aten_view, (ffn_in, [-1, hidden]), "dp_flat")
                gathered = b.call(torch.ops.afd.all_gather_tokens.default, (flat, GROUP_TP, total), "dp_gather")
            for u in list(ffn_in.users):
                if u in ffn_set:
                    u.replace_input_with(ffn_in, gathered)
        elif _parallel_residual(members, ffn_in, ffn[0]):
            gathered = _parallel_residual_gather(b, graph, members, ffn, ffn_in, root, hidden, total, where)
        else:
            h1, row_out, x_res = residual_add_after_attention(members, ffn[0], where)
            layer_nodes = set(members)
            if ffn_in is not h1 and ffn_in not in descendants(h1, layer_nodes):
                raise TPRewriteError(
                    f"{where}: DP attention with attn_tp > 1 needs the MLP to read the residual sum after "
                    f"attention ({h1.name}) or not depend on attention at all (parallel residual); its input "
                    f"{ffn_in.name} depends on attention some other way")
            between = descendants(h1, layer_nodes) & ancestors([ffn_in], within=layer_nodes)
            norm_nodes = sorted(between - {h1}, key=members.index)
            if x_res is None:  # post-norm: settle o's partial sum in the group before the norm
                gathered = _post_norm_gather(b, graph, row_out, h1, root, hidden, total)
            else:
                with graph.inserting_before(h1):
                    scaled = b.call(aten_mul, (x_res, root), "dp_residual_once")
                    pre = b.call(aten_add, (row_out, scaled), "dp_pre_gather")
                    flat = b.call(aten_view, (pre, [-1, hidden]), "dp_flat")
                    gathered = b.call(torch.ops.afd.gather_partial_tokens.default, (flat, GROUP_TP, total),
                                      "dp_gather")
                    own = b.call(aten_sym_size, (flat, 0), "dp_own_tokens")
                    local = b.call(torch.ops.afd.scatter_tokens.default, (gathered, total, own), "dp_scatter")
                    h1_local = b.call(aten_view, (local, shape_args(b, tuple(h1.meta["val"].shape), sources)),
                                      "dp_middle_residual")
            env: dict[fx.Node, fx.Node] = {h1: gathered}
            with graph.inserting_before(ffn[0]):
                for n in norm_nodes:
                    env[n] = graph.node_copy(n, lambda a, _env=env: _env.get(a, a))
                    env[n].meta.pop("val", None)
            for u in list(ffn_in.users):
                if u in ffn_set:
                    u.replace_input_with(ffn_in, env[ffn_in])
            if x_res is not None:
                h1.replace_all_uses_with(h1_local)
                graph.erase_node(h1)
        # postprocess_layer: reduce-scatter the MLP's partial output back to this group's tokens
        users = [u for u in out.users if u not in ffn_set]
        anchor = users[0]
        with graph.inserting_before(anchor):
            ref = _flat_rows(b, ffn_in, hidden)
            out2d = b.call(aten_view, (out, [-1, hidden]))  # the MLP ran on (tokens, hidden) rows
            out2d.meta["val"] = gathered.meta.get("val")
            rs = b.call(torch.ops.afd.reduce_scatter_tokens.default, (out2d, GROUP_TP, total, ref), "dp_reduce_scatter")
            back = b.call(aten_view, (rs, shape_args(b, tuple(out.meta["val"].shape), sources)), "dp_layer_out")
        for u in users:
            u.replace_input_with(out, back)
    graph.eliminate_dead_code()  # the original norm nodes the gathered copy replaced


def drop_export_guards(gm: fx.GraphModule) -> None:
    """Remove the ``_guards_fn`` call ``torch.export`` adds (input-shape checks; the caller's own
    guards stand in for them). It holds an unpicklable closure, which would keep Inductor's
    caches from keying the graph."""
    for n in list(gm.graph.nodes):
        if n.op == "call_module" and "guards" in str(n.target):
            gm.graph.erase_node(n)
            if hasattr(gm, str(n.target)):
                delattr(gm, str(n.target))
    gm.recompile()


def _flat_rows(b: object, node: fx.Node, hidden: int) -> fx.Node:
    """This rank's token count, as a graph value: rows of ``node`` viewed as (-1, hidden)."""
    flat = b.call(aten_view, (node, [-1, hidden]))
    return b.call(aten_sym_size, (flat, 0))


def _parallel_residual(members: list[fx.Node], ffn_in: fx.Node, first_ffn: fx.Node) -> bool:
    """The MLP reads nothing the attention computed (GPT-J, GPT-NeoX, Phi, Falcon, Cohere:
    ``h = x + attn(ln1(x)) + mlp(ln2(x))``)."""
    from .roles import ancestors, is_attention_op

    attn = next((n for n in members if is_attention_op(n)), None)
    return attn is not None and attn not in ancestors([ffn_in], within=set(members))


def _parallel_residual_gather(b: object, graph: fx.Graph, members: list[fx.Node], ffn: list[fx.Node],
                              ffn_in: fx.Node, root: float, hidden: int, total: fx.Node, where: str) -> fx.Node:
    """DP attention, attn_tp > 1, a parallel-residual block: the MLP input does not wait for
    attention, so it is gathered on its own and o_proj's sum is settled in the attention group::

        o = afd.all_reduce(o, group=ATTN_TP)                                     # attention: TP_ATTN_FULL
        G = afd.gather_partial_tokens(view(ln2(x) * [attn_tp_rank == 0], [-1, H]))  # prepare_mlp: FULL
        h = x + o + view(afd.reduce_scatter_tokens(mlp(G)), ...)                  # postprocess_layer

    (every rank of an attention group holds the same ``ln2(x)``; one of them contributes it)."""
    from .roles import ADD_OPS

    row = attention_row(members, where)
    if not any(u.target in ADD_OPS for u in row.users):
        raise TPRewriteError(f"{where}: the attention output projection {row.name} does not feed an add")
    with graph.inserting_before(row.next):
        ar = b.call(torch.ops.afd.all_reduce.default, (row, GROUP_ATTN_TP), "dp_attn_all_reduce")
    row.replace_all_uses_with(ar, delete_user_cb=lambda u: u is not ar)
    ffn_set = set(ffn)
    with graph.inserting_before(ffn[0]):
        once = b.call(aten_mul, (ffn_in, root), "dp_mlp_input_once")
        flat = b.call(aten_view, (once, [-1, hidden]), "dp_flat")
        gathered = b.call(torch.ops.afd.gather_partial_tokens.default, (flat, GROUP_TP, total), "dp_gather")
    for u in list(ffn_in.users):
        if u in ffn_set:
            u.replace_input_with(ffn_in, gathered)
    return gathered


def _post_norm_gather(b: object, graph: fx.Graph, row: fx.Node, h1: fx.Node, root: float, hidden: int,
                      total: fx.Node) -> fx.Node:
    """DP attention, attn_tp > 1, a norm between o_proj and the residual add (Gemma-2, OLMo-2)::

        o = afd.all_reduce(o, group=ATTN_TP)              # settled before the (non-linear) norm
        h1 = x + norm(o)                                   # middle residual: own tokens, full
        G = afd.gather_partial_tokens(view(h1 * [attn_tp_rank == 0], [-1, H]))   # prepare_mlp: FULL

    (every rank of an attention group holds the same h1; one of them contributes it)."""
    with graph.inserting_after(row):
        ar = b.call(torch.ops.afd.all_reduce.default, (row, GROUP_ATTN_TP), "dp_attn_all_reduce")
    row.replace_all_uses_with(ar, delete_user_cb=lambda u: u is not ar)
    with graph.inserting_before(h1.next):  # (inserting_after would stack them in reverse)
        once = b.call(aten_mul, (h1, root), "dp_residual_once")
        flat = b.call(aten_view, (once, [-1, hidden]), "dp_flat")
        return b.call(torch.ops.afd.gather_partial_tokens.default, (flat, GROUP_TP, total), "dp_gather")


aten_view = torch.ops.aten.view.default
aten_sym_size = torch.ops.aten.sym_size.int
aten_mul = torch.ops.aten.mul.Tensor
aten_add = torch.ops.aten.add.Tensor
