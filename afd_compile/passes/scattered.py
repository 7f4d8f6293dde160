"""SCATTERED MLPs: junction collectives inside an attention-TP group, and MoE expert parallelism.

A layer whose MLP mode is SCATTERED (``--dense-dp``: a data-parallel dense MLP; ``--moe-a2a``: an
MoE whose tokens travel by all-to-all) keeps its residual stream SCATTERED: each rank of an
attention-TP group of ``k`` ranks holds its share of the group's ``T`` tokens
(:func:`afd_compile.ops.group_token_sizes`: the first ``T % k`` ranks one row more). One layer at
``attn_tp = k > 1``, before / after (a pre-norm decoder)::

    h1 = x + o_proj(attn(norm(x)))          xf = view(afd.all_gather_group_tokens(x), [b, s, H])  # prepare_attn
    h2 = h1 + mlp(norm(h1))                 o = o_proj(attn(norm(xf)))                            # TP_ATTN_FULL+P
                                            h1 = x + afd.reduce_scatter_group_tokens(view(o, [-1, H]))  # prepare_mlp
                                            h2 = h1 + view(mlp(norm(h1)), [-1, H])                # SCATTERED, local

The first layer's residual comes from TP_ATTN_FULL tokens: ``afd.scatter_group_tokens`` takes
this rank's rows (a local slice). The last layer returns to TP_ATTN_FULL at postprocess_layer by
gathering ``h2``: the residual is added *before* communicating, so one tensor crosses, not two.
Into a SCATTERED MoE, o_proj's partial sum is settled by a reduce-scatter, never an all-reduce.

MoE with all-to-all (:func:`expert_parallel`): experts are split over the TP group (rank ``d``
owns experts ``[d * E/P, (d+1) * E/P)``); router and shared experts run replicated on the rank's
own tokens; the recognised ``afd::moe_experts`` op runs on the tokens an ``afd.ep_dispatch``
all-to-all brings, and ``afd.ep_combine`` returns the partial outputs to their tokens' ranks and
sums them. Only the op is sharded so: an MoE the recognition did not match is refused.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from ..comm import GROUP_ATTN_TP, GROUP_TP
from ..errors import AFDCompileError, TPRewriteError
from ..scatter import Collective, ScatterMode, TPLayout
from .anatomy import VIEW_OPS, is_identity, parallel_residual, rebind_token_sizes, residual_add_after_attention
from .dist_states import TPPlan
from .emitters import LayerSite, emit_layer, register
from .graph_utils import (
    Builder,
    layers_of,
    region_output,
    shape_args,
    symbol_sources,
)
from .op_kinds import ADD_OPS
from .roles import META_KEY as ROLE_KEY
from .roles import Role, ancestors, descendants, is_attention_op
from .shard import ShardedWeight

aten = torch.ops.aten


class ScatteredRewriteError(AFDCompileError):
    pass


def _set_val(node: fx.Node, fake_mode: object, shape: tuple, like: torch.Tensor) -> None:
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = torch.empty(shape, dtype=like.dtype, device=like.device)


@dataclass
class ScatteredSite(LayerSite):
    """The site of the SCATTERED emitters (attention-TP groups of ``k``)."""

    mlp_scattered: bool
    input_scattered: bool  # the layer's input is SCATTERED (a SCATTERED layer came before)
    ffn: list[fx.Node]
    h1: fx.Node  # the residual add after attention
    row: fx.Node  # o_proj's output (partial sum)
    x: fx.Node  # the layer's residual input
    x_res: fx.Node | None
    hidden: int
    full_shape: tuple
    total: fx.Node  # the group's tokens
    own: fx.Node  # this rank's share
    sources: dict
    prev_out: fx.Node | None  # the previous layer's SCATTERED output
    parallel: bool  # a parallel-residual block (anatomy.parallel_residual)
    h2: fx.Node | None = None  # this layer's SCATTERED output, once its MLP ran SCATTERED
    settled: bool = False  # o_proj's partial sum went into a reduce-scatter


def rewrite_scattered_layers(new: fx.GraphModule, plan: TPPlan, layout: TPLayout, rank: int,
                             fake_mode: object) -> set[int]:
    """Rewrite every layer the plan makes SCATTERED (and every layer whose input is SCATTERED):
    per layer, the emitters of its planned SCATTERED transitions (registered below). Returns the
    layers whose attention partial sum this pass settled (the caller must not all-reduce them again)."""

    k, i = layout.attn_tp, layout.attn_tp_rank(rank)
    graph = new.graph
    members_of = {i: list(layer.members) for i, layer in layers_of(new).items()}
    modes = {m.index: m for m, _ in plan.layers}
    if k == 1:
        return set()
    sources = symbol_sources(graph)
    settled: set[int] = set()
    token_nodes: tuple[fx.Node, object] | None = None  # (T, own), computed once before layer 0
    prev_out: fx.Node | None = None  # the previous layer's SCATTERED output
    for layer in sorted(members_of):
        m = modes[layer]
        if m.mlp is not ScatterMode.SCATTERED and m.layer_input is not ScatterMode.SCATTERED:
            continue
        where = f"layer {layer}"
        members = members_of[layer]
        ffn = [n for n in members if n.meta[ROLE_KEY].role is Role.FFN]
        b = Builder(graph, fake_mode, layer)
        h1, row, x_res = residual_add_after_attention(members, ffn[0], where)
        hidden = int(row.meta["val"].shape[-1])
        ffn_set = set(ffn)
        parallel = parallel_residual(members, [a for n in ffn for a in n.all_input_nodes if a not in ffn_set])
        if parallel:  # (h1 may join attention with the MLP's output: the input is the layer's)
            x = _layer_input(members, hidden, where)
        elif x_res is not None:
            x = x_res
        else:
            below = descendants(row, set(members))
            x = next(a for a in h1.all_input_nodes if a not in below)
        if token_nodes is None:
            with graph.inserting_before(x.next):
                flat = b.call(aten.view.default, (x, [-1, hidden]), "sc_tokens_flat")
                total = b.call(aten.sym_size.int, (flat, 0), "sc_group_tokens")
                plus = b.call(operator.add, (total, k - 1 - i))
                own = b.call(operator.floordiv, (plus, k), "sc_own_tokens")
            token_nodes = (total, own)
        site = ScatteredSite(graph, layer, members, where, b, fake_mode, m.mlp is ScatterMode.SCATTERED,
                             m.layer_input is ScatterMode.SCATTERED, ffn, h1, row,
                             x, x_res, hidden, tuple(row.meta["val"].shape), *token_nodes, sources, prev_out,
                             parallel)
        emit_layer(site, plan, by="scattered")
        if site.settled:
            settled.add(layer)
        if site.h2 is not None:
            prev_out = site.h2
    return settled


@register("prepare_attn", Collective.ALL_GATHER, False, ScatterMode.SCATTERED, by="scattered",
          what="afd.all_gather_group_tokens of the SCATTERED layer input for attention")
@register("prepare_attn", Collective.ALL_GATHER, False, ScatterMode.FULL, by="scattered",
          what="afd.all_gather_group_tokens of the SCATTERED layer input (after a SCATTERED layer) for attention")
def gather_attention_input(site: ScatteredSite) -> None:
    """prepare_attn: ``xf = view(afd.all_gather_group_tokens(x), [b, s, H])``; attention reads
    ``xf``, the residual add keeps the rank's own rows when the MLP stays SCATTERED."""
    b, x, members = site.b, site.x, site.members
    member_set = set(members)
    _check_from(x, site.prev_out, site.where)
    _set_val(x, site.fake_mode, (site.own.meta.get("val"), site.hidden), x.meta["val"])
    users = [u for u in x.users if u in member_set and (u is not site.h1 or not site.mlp_scattered)]
    if site.mlp_scattered and site.parallel:  # (the residual adds read this rank's rows as they
        path = ancestors([next(n for n in members if is_attention_op(n))], within=member_set)  # are)
        users = [u for u in users if u in path or u.target not in ADD_OPS]
    with site.graph.inserting_before(min(users, key=lambda u: members.index(u))):
        g = b.call(torch.ops.afd.all_gather_group_tokens.default, (x, GROUP_ATTN_TP, site.total, site.own),
                   "sc_gather_attn")
        xf = b.call(aten.view.default, (g, shape_args(b, site.full_shape, site.sources)), "sc_attn_input")
    for u in users:
        u.replace_input_with(x, xf)


@register("prepare_mlp", Collective.REDUCE_SCATTER, True, ScatterMode.SCATTERED, by="scattered",
          what="afd.reduce_scatter_group_tokens of o_proj's partial sum into this rank's share of the group's "
               "tokens; the MLP then runs on them (SCATTERED)")
def reduce_scatter_into_mlp(site: ScatteredSite) -> None:
    """prepare_mlp: ``h1 = x + afd.reduce_scatter_group_tokens(view(o, [-1, H]))`` (the first
    SCATTERED layer takes its residual's rows locally: ``afd.scatter_group_tokens``); the MLP
    runs on this rank's rows and its output stays SCATTERED (``site.h2``)."""
    b, graph, members, ffn, h1, row, x, hidden = (site.b, site.graph, site.members, site.ffn, site.h1, site.row,
                                                  site.x, site.hidden)
    member_set, ffn_set = set(members), set(ffn)
    own, like = site.own, row.meta["val"]
    ffn_in_nodes = [a for n in ffn for a in n.all_input_nodes if a not in ffn_set and a.op != "get_attr"
                    and isinstance(a.meta.get("val"), torch.Tensor)]
    if not site.parallel and any(a is x or a not in descendants(h1, member_set) | {h1} for a in ffn_in_nodes):
        raise TPRewriteError(f"{site.where}: the MLP reads {[a.name for a in ffn_in_nodes]}, neither the residual sum "
                             f"after attention ({h1.name}) nor only what attention does not compute (a parallel-"
                             "residual block): a SCATTERED MLP with attn_tp > 1 is not supported there")
    if not site.parallel:
        _refuse_full_rows_after(site, _layer_output(members, site.full_shape, site.where))
    with graph.inserting_before(row.next):
        flat = b.call(aten.view.default, (row, [-1, hidden]), "sc_o_flat")
        rs = b.call(torch.ops.afd.reduce_scatter_group_tokens.default, (flat, GROUP_ATTN_TP, site.total, own),
                    "sc_reduce_scatter")
    row.replace_all_uses_with(rs, delete_user_cb=lambda u, _f=flat: u is not _f)
    site.settled = True
    if site.parallel:
        _parallel_mlp(site, rs, ffn_in_nodes)
        return
    if not site.input_scattered:  # the residual arrives TP_ATTN_FULL: take this rank's rows, a local slice
        with graph.inserting_before(h1):
            xflat = b.call(aten.view.default, (x, [-1, hidden]), "sc_residual_flat")
            xs = b.call(torch.ops.afd.scatter_group_tokens.default, (xflat, GROUP_ATTN_TP, site.total, own),
                        "sc_residual")
        h1.replace_input_with(x, xs)
    _set_val(h1, site.fake_mode, (own.meta.get("val"), hidden), like)
    _own_mlp_output(site, ffn_in_nodes[0])
    site.h2 = _layer_output(members, site.full_shape, site.where)
    _set_val(site.h2, site.fake_mode, (own.meta.get("val"), hidden), like)


def _refuse_full_rows_after(site: ScatteredSite, out: fx.Node) -> None:
    """From the residual sum after attention to the layer's output ``out`` everything runs on this
    rank's rows: a tensor of all the group's tokens read there from elsewhere (Gemma-4's per-layer
    input, computed from the embedding, mixed into the residual after the MLP) would not match
    them. Refused naming it (its rows are not sliced yet)."""
    member_set = set(site.members)
    rows = descendants(site.h1, member_set)  # (the MLP's own reads are checked where it is rewritten)
    between = (rows & ancestors([out], within=member_set)) - {site.h1} - set(site.ffn)
    for n in sorted(between, key=site.members.index):
        for a in n.all_input_nodes:
            v = a.meta.get("val")
            if a in rows or a.op == "get_attr" or not isinstance(v, torch.Tensor) or v.dim() < 2:
                continue
            if any(not (isinstance(d, int) and d == 1) for d in v.shape[:-1]):
                raise TPRewriteError(
                    f"{site.where}: {n.name} reads {a.name} {list(v.shape)}, a tensor over every token that does not "
                    f"come from the layer's residual stream, between the residual sum after attention "
                    f"({site.h1.name}) and the layer's output ({out.name}); a SCATTERED layer (--dense-dp, "
                    "--moe-a2a, an AFD attention TP group) runs there on this rank's share of the tokens and does "
                    "not slice such a tensor yet; standard TP, DP attention and AFD without --attn-tp run it")


def _own_mlp_output(site: ScatteredSite, ffn_in: fx.Node) -> fx.Node:
    """The MLP, its input now this rank's rows: the sizes it reads re-expressed in them, its output
    viewed as ``[own, H]`` for every reader outside it (returned)."""
    b, graph, members, ffn, hidden, own = site.b, site.graph, site.members, site.ffn, site.hidden, site.own
    member_set, ffn_set, like = set(members), set(ffn), site.row.meta["val"]
    sizes = [a for n in ffn for a in n.all_input_nodes if a not in ffn_set and a.op != "get_attr"
             and not isinstance(a.meta.get("val"), torch.Tensor)]
    tokens = list(site.full_shape[:-1])
    live = _views_of_rows(ffn, tokens)
    sizes = [a for a in sizes if any(a in u.all_input_nodes for u in live)]
    if sizes:
        rebind_token_sizes(b, ffn, list(dict.fromkeys(sizes)), tokens, own, site.where, share=True)
    out = region_output(ffn)
    outside = [u for u in out.users if u not in ffn_set]
    with graph.inserting_before(min(outside, key=lambda u: members.index(u) if u in member_set else 1 << 30)):
        out2d = b.call(aten.view.default, (out, [-1, hidden]), "sc_mlp_out")
    _set_val(out2d, site.fake_mode, (own.meta.get("val"), hidden), like)
    for u in outside:
        if u.target in VIEW_OPS and u.args[0] is out and u.meta["val"].shape[-1] == hidden:
            u.args = (out2d, [-1, hidden])  # (a view back to the layer's [b, s, H] outside the MLP, as Llama 4's
            _set_val(u, site.fake_mode, (own.meta.get("val"), hidden), like)  # view(residual.shape): its rows now)
        else:
            u.replace_input_with(out, out2d)
    return out2d


def _views_of_rows(ffn: list[fx.Node], tokens: list[object]) -> list[fx.Node]:
    """Views inside the MLP whose leading dims are the layer's tokens (``tokens``: ``[b, s]``, their
    product the token count) view this rank's rows instead, as one sequence (as a dynamic batch
    binds its symbols: ``b = 1``, ``s = own``): ``view(y, [2, s, H])`` becomes ``view(y, [1, -1,
    H])``. A rank's share of a static batch's tokens need not fill ``[2, own // 2]`` (decode steps
    under a static KV cache: one token a sequence). Returns the MLP's nodes still read (a size
    only those views read is not)."""
    from .symbolic import sym_expr

    count = sympy.expand(sympy.Mul(*(sym_expr(d) for d in tokens)))
    for n in ffn:
        val = n.meta.get("val")
        if n.target not in VIEW_OPS or not isinstance(val, torch.Tensor) or val.dim() < 2:
            continue
        prod = sympy.Integer(1)
        for j, d in enumerate(val.shape[:-1]):
            prod = sympy.expand(prod * sym_expr(d))
            if prod == count:
                rest = val.shape[j + 1:]
                if j > 0 or not isinstance(n.args[1][0], int) or n.args[1][0] != -1:
                    if all(isinstance(r, int) for r in rest):
                        n.args = (n.args[0], [*[1] * j, -1, *rest])
                break
    dead: set[fx.Node] = set()  # (sizes only those views read: 2 * s, and s itself)
    while True:
        more = {n for n in ffn if n not in dead and n.op == "call_function" and n.users.keys() <= dead
                and not isinstance(n.meta.get("val"), torch.Tensor)}
        if not more:
            return [n for n in ffn if n not in dead]
        dead |= more


def _layer_input(members: list[fx.Node], hidden: int, where: str) -> fx.Node:
    """The residual stream entering the layer: the one hidden-sized tensor it reads from outside."""
    member_set = set(members)
    found = list(dict.fromkeys(
        a for n in members for a in n.all_input_nodes if a not in member_set and a.op != "get_attr"
        and isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dim() > 1
        and a.meta["val"].shape[-1] == hidden and a.meta["val"].is_floating_point()))
    if len(found) != 1:
        raise TPRewriteError(f"{where}: expected one hidden-state tensor entering the layer, found "
                             f"{[n.name for n in found]}")
    return found[0]


def _parallel_mlp(site: ScatteredSite, rs: fx.Node, ffn_in_nodes: list[fx.Node]) -> None:
    """prepare_mlp of a parallel-residual block: the MLP's inputs (TP_ATTN_FULL: computed from the
    layer input, gathered if it came SCATTERED) each take this rank's rows, a local slice; then
    every op joining a value on this rank's rows (o_proj's reduce-scatter, the MLP's output, a
    SCATTERED layer input) with a TP_ATTN_FULL one slices the latter the same way::

        o = afd.reduce_scatter_group_tokens(view(o, [-1, H]))             # this rank's rows, settled
        m = mlp(afd.scatter_group_tokens(view(ln2(x), [-1, H])))          # local slices in
        h = afd.scatter_group_tokens(view(x, [-1, H])) + o + view(m, [-1, H])   # SCATTERED out
    """
    b, graph, members, hidden, own = site.b, site.graph, site.members, site.hidden, site.own
    pos = {n: i for i, n in enumerate(members)}
    ffn_set, like = set(site.ffn), site.row.meta["val"]

    def own_rows(a: fx.Node, before: fx.Node) -> fx.Node:
        with graph.inserting_before(before):
            flat = b.call(aten.view.default, (a, [-1, hidden]), "sc_full_flat")
            sliced = b.call(torch.ops.afd.scatter_group_tokens.default, (flat, GROUP_ATTN_TP, site.total, own),
                            "sc_local_rows")
        _set_val(sliced, site.fake_mode, (own.meta.get("val"), hidden), like)
        return sliced

    for a in dict.fromkeys(ffn_in_nodes):
        if a is site.x and site.input_scattered:  # (this rank's rows already)
            continue
        if a.meta["val"].shape[-1] != hidden:
            raise TPRewriteError(f"{site.where}: the MLP of a parallel-residual block reads {a.name} "
                                 f"{tuple(a.meta['val'].shape)}, not hidden-sized rows: it cannot take a share of them")
        readers = [u for u in a.users if u in ffn_set]
        sliced = own_rows(a, min(readers, key=lambda u: pos[u]))
        for u in readers:
            u.replace_input_with(a, sliced)
    shared = {rs, _own_mlp_output(site, ffn_in_nodes[0])} | ({site.x} if site.input_scattered else set())
    for n in members:
        if (n in ffn_set or n in shared or not any(a in shared for a in n.all_input_nodes)
                or n.target == aten._assert_tensor_metadata.default):  # (a check of dtype and device, not shape)
            continue
        if n.target in ADD_OPS:
            for a in [a for a in n.all_input_nodes if a not in shared]:
                n.replace_input_with(a, own_rows(a, n))
        elif not (n.target in _CASTS or is_identity(n)):
            raise TPRewriteError(f"{site.where}: {n.name} ({n.target}) reads this rank's share of the tokens in a "
                                 "parallel-residual block; only adds, casts and identities may join the residual "
                                 "stream there")
        _set_val(n, site.fake_mode, (own.meta.get("val"), hidden), like)
        shared.add(n)
    site.h2 = _layer_output(members, site.full_shape, site.where)
    if site.h2 not in shared:
        raise TPRewriteError(f"{site.where}: the layer's output {site.h2.name} does not come from this rank's share "
                             "of the tokens")


@register("postprocess_layer", Collective.ALL_GATHER, False, ScatterMode.SCATTERED, by="scattered",
          what="the last SCATTERED layer adds the residual, then afd.all_gather_group_tokens (one tensor crosses)")
def gather_layer_output(site: ScatteredSite) -> None:
    """postprocess_layer back to TP_ATTN_FULL: add first, then gather once."""
    h2, b = site.h2, site.b
    assert h2 is not None, "prepare_mlp's emitter runs first and leaves the SCATTERED output"
    after = [u for u in h2.users if (u.meta.get(ROLE_KEY) is None or u.meta[ROLE_KEY].layer != site.layer)]
    with site.graph.inserting_before(h2.next):
        g = b.call(torch.ops.afd.all_gather_group_tokens.default, (h2, GROUP_ATTN_TP, site.total, site.own),
                   "sc_gather_out")
        back = b.call(aten.view.default, (g, shape_args(b, site.full_shape, site.sources)), "sc_layer_out")
    for u in after:
        u.replace_input_with(h2, back)


_CASTS = {aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.alias.default, aten.contiguous.default}


def _check_from(x: fx.Node, prev: fx.Node | None, where: str) -> None:
    """The layer's residual input ``x`` must be the previous layer's SCATTERED output, directly or
    through casts (transformers' fp32 residual), so it holds the same rows."""

    n = x
    while n is not prev and n.target in _CASTS and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    if n is not prev:
        raise TPRewriteError(f"{where}: the layer input {x.name} does not come from the previous layer's output "
                             f"{prev.name if prev is not None else None} (only casts may sit between)")


def _layer_output(members: list[fx.Node], shape: tuple, where: str) -> fx.Node:
    """The residual stream leaving the layer: the one hidden-sized tensor read after it."""

    layer = members[0].meta[ROLE_KEY].layer

    def outside(u: fx.Node) -> bool:
        r = u.meta.get(ROLE_KEY)
        return r is None or r.layer != layer

    outs = [n for n in members if n.op == "call_function" and any(outside(u) for u in n.users)
            and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() > 0
            and n.meta["val"].shape[-1] == shape[-1]]
    if len(outs) != 1:
        raise TPRewriteError(f"{where}: expected one hidden-state tensor leaving the layer, found "
                             f"{[n.name for n in outs]}")
    return outs[0]


# --- MoE expert parallelism ---------------------------------------------------------------------

def expert_parallel(new: fx.GraphModule, layer: int, parts: int, rank: int, fake_mode: object,
                    group: int = GROUP_TP) -> list[ShardedWeight]:
    """Split one MoE layer's experts over ``parts`` ranks (process group ``group``: the TP group,
    or an AFD FFN rank's FFN group) and route tokens with all-to-all: the rule of the recognised
    ``afd::moe_experts`` op (passes/moe/parallel.py), the one expert form sharded.

    Before (one layer, the experts recognised)::

        logits = linear(x2d, gate.weight); w, ids = topk(softmax(logits), k)       # router
        y = afd.moe_experts(x2d, ids, w, w_gate_up[E, ...], w_down[E, ...], ...)
        out = reshape(y, [b, s, H]) (+ shared experts)

    After, on rank ``d`` (experts ``[d*E/P, (d+1)*E/P)``, weights sliced along the expert dim)::

        logits, w, ids: unchanged, on this rank's tokens
        xr, wr, ids_l, valid, counts = afd.ep_dispatch([x2d, w], ids, group, E, P)   # all-to-all
        yr = afd.moe_experts(xr, ids_l, wr * valid, w_gate_up[E/P, ...], ...)        # local experts only
        y = afd.ep_combine(yr, ids, counts, group, E)                                # all-to-all back

    A layer whose experts the recognition did not turn into the op is refused, naming it."""
    where = f"layer {layer}"
    ffn = [n for n in layers_of(new)[layer].members if n.meta[ROLE_KEY].role is Role.FFN or n.meta[ROLE_KEY].router]
    ops = [n for n in ffn if n.target == torch.ops.afd.moe_experts.default]
    if not ops:
        raise ScatteredRewriteError(
            f"{where}: expert parallelism shards only the recognised afd::moe_experts op, and this layer's MoE "
            "block was not recognised as one (`afd-compile plan` prints what the recognition found per block; "
            "drop --moe-a2a / --ffn-ep to run the MoE unsplit)")
    from .moe.parallel import expert_parallel_op

    return [w for op in ops for w in expert_parallel_op(new, op, parts, rank, fake_mode, group, where)]
