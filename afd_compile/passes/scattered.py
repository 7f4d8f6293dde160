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
own tokens; the expert computation (everything downstream of top-k's indices up to the
per-token combine) runs on the tokens an ``afd.ep_dispatch`` all-to-all brings, and
``afd.ep_combine`` returns the partial outputs to their tokens' ranks and sums them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..comm import GROUP_ATTN_TP, GROUP_TP
from ..errors import AFDCompileError, TPRewriteError
from ..scatter import Collective, ScatterMode, TPLayout
from .anatomy import rebind_token_sizes, residual_add_after_attention
from .dist_states import TPPlan
from .emitters import LayerSite, emit_layer, register
from .graph_utils import (
    Builder,
    get_attr_path,
    layers_of,
    region_output,
    shape_args,
    symbol_sources,
)
from .roles import META_KEY as ROLE_KEY
from .roles import Role, ancestors, descendants, mutates_first_arg
from .shard import ShardedWeight, ShardError, ShardPlan, apply_shards

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
        x = x_res if x_res is not None else next(a for a in h1.all_input_nodes if a not in descendants(row, set(members)))
        hidden = int(row.meta["val"].shape[-1])
        if token_nodes is None:
            with graph.inserting_before(x.next):
                flat = b.call(aten.view.default, (x, [-1, hidden]), "sc_tokens_flat")
                total = b.call(aten.sym_size.int, (flat, 0), "sc_group_tokens")
                plus = b.call(operator.add, (total, k - 1 - i))
                own = b.call(operator.floordiv, (plus, k), "sc_own_tokens")
            token_nodes = (total, own)
        site = ScatteredSite(graph, layer, members, where, b, fake_mode, m.mlp is ScatterMode.SCATTERED,
                             m.layer_input is ScatterMode.SCATTERED, ffn, h1, row,
                             x, x_res, hidden, tuple(row.meta["val"].shape), *token_nodes, sources, prev_out)
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
    if any(a is x or a not in descendants(h1, member_set) | {h1} for a in ffn_in_nodes):
        raise TPRewriteError(f"{site.where}: the MLP does not read the residual sum after attention ({h1.name}) (a "
                             "parallel-residual block): a SCATTERED MLP with attn_tp > 1 is not supported there")
    with graph.inserting_before(row.next):
        flat = b.call(aten.view.default, (row, [-1, hidden]), "sc_o_flat")
        rs = b.call(torch.ops.afd.reduce_scatter_group_tokens.default, (flat, GROUP_ATTN_TP, site.total, own),
                    "sc_reduce_scatter")
    row.replace_all_uses_with(rs, delete_user_cb=lambda u, _f=flat: u is not _f)
    site.settled = True
    if not site.input_scattered:  # the residual arrives TP_ATTN_FULL: take this rank's rows, a local slice
        with graph.inserting_before(h1):
            xflat = b.call(aten.view.default, (x, [-1, hidden]), "sc_residual_flat")
            xs = b.call(torch.ops.afd.scatter_group_tokens.default, (xflat, GROUP_ATTN_TP, site.total, own),
                        "sc_residual")
        h1.replace_input_with(x, xs)
    _set_val(h1, site.fake_mode, (own.meta.get("val"), hidden), like)
    sizes = [a for n in ffn for a in n.all_input_nodes if a not in ffn_set and a.op != "get_attr"
             and not isinstance(a.meta.get("val"), torch.Tensor)]
    if sizes:
        rebind_token_sizes(b, ffn, list(dict.fromkeys(sizes)), ffn_in_nodes[0], own, site.where)
    out = region_output(ffn)
    outside = [u for u in out.users if u not in ffn_set]
    with graph.inserting_before(min(outside, key=lambda u: members.index(u) if u in member_set else 1 << 30)):
        out2d = b.call(aten.view.default, (out, [-1, hidden]), "sc_mlp_out")
    _set_val(out2d, site.fake_mode, (own.meta.get("val"), hidden), like)
    for u in outside:
        u.replace_input_with(out, out2d)
    site.h2 = _layer_output(members, site.full_shape, site.where)
    _set_val(site.h2, site.fake_mode, (own.meta.get("val"), hidden), like)


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

_TOKEN_MAJOR = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.to.dtype,
                aten._to_copy.default, aten.unsqueeze.default, aten.contiguous.default, aten.clone.default,
                aten.flatten.using_ints}


def expert_parallel(new: fx.GraphModule, layer: int, parts: int, rank: int, fake_mode: object,
                    group: int = GROUP_TP) -> list[ShardedWeight]:
    """Split one MoE layer's experts over ``parts`` ranks (process group ``group``: the TP group,
    or an AFD FFN rank's FFN group) and route tokens with all-to-all.

    Before (transformers' grouped experts, one layer)::

        logits = linear(x2d, gate.weight); w, ids = topk(softmax(logits), k)       # router
        y = experts(x2d, ids, normalize(w))     # sort, histc(ids, E), grouped_mm(w_e[E, ...]), combine
        out = reshape(y, [b, s, H]) (+ shared experts)

    After, on rank ``d`` (experts ``[d*E/P, (d+1)*E/P)``, weights sliced along the expert dim)::

        logits, w, ids: unchanged, on this rank's tokens
        xr, wr, ids_l, valid, counts = afd.ep_dispatch([x2d, w], ids, group=TP, E, P)   # all-to-all
        yr = experts(xr, ids_l, wr * valid)     # histc(ids_l, E/P), w_e[E/P, ...]: local experts only
        y = afd.ep_combine(yr, ids, counts, group=TP, E)                                # all-to-all back

    Recognised experts (``afd::moe_experts``, passes/moe) take the op's rule (moe/parallel.py).
    Otherwise the expert computation is found from the graph: the nodes downstream of top-k's
    indices up to the first ``(tokens, H)`` tensor (the per-token combine). Its other inputs must
    be per-token rows; expert-count constants (``histc`` bins, ``one_hot`` classes) become the
    local count, any other use of the count is an error naming the node."""
    from .symbolic import TokenBinding, sym_expr

    where, graph = f"layer {layer}", new.graph
    ffn = [n for n in layers_of(new)[layer].members if n.meta[ROLE_KEY].role is Role.FFN or n.meta[ROLE_KEY].router]
    ffn_set = set(ffn)
    if any(n.target == torch.ops.afd.moe_experts.default for n in ffn):  # the op's one rule
        return _expert_parallel_ops(new, ffn, parts, rank, fake_mode, group, where)
    topks = [n for n in ffn if n.target == aten.topk.default]
    # the expert choice is the last top-k; earlier ones (DeepSeek's group-limited routing picks
    # groups first) must only feed it
    topk = topks[-1] if topks else None
    if topk is None or not set(topks[:-1]) <= ancestors([topk], within=ffn_set):
        raise ScatteredRewriteError(f"{where}: expert parallelism needs one final top-k routing op in the MoE, "
                                    f"found {[n.name for n in topks]}")
    ids = next((u for u in topk.users if u.target == operator.getitem and u.args[1] == 1), None)
    vals = next((u for u in topk.users if u.target == operator.getitem and u.args[1] == 0), None)
    if ids is None:
        raise ScatteredRewriteError(f"{where}: {topk.name}'s expert indices are never read")
    n_tok = ids.meta["val"].shape[0]
    down = descendants(ids, ffn_set)
    order = {n: j for j, n in enumerate(graph.nodes)}
    out = region_output(ffn)
    hidden = out.meta["val"].shape[-1]
    end = None
    for n in sorted(down, key=order.__getitem__):
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dim() == 2 and _same(v.shape[0], n_tok) and _same(v.shape[1], hidden):
            end = n
            break
    if end is None:
        raise ScatteredRewriteError(f"{where}: no per-token (tokens, hidden) tensor after the experts: cannot find "
                                    "where the expert outputs are combined")
    region = ((ancestors([end], within=down) | {end}) & down) - {ids}
    while True:  # weight-only inputs (a transposed expert weight) are recomputed from the sliced weights
        inputs = list(dict.fromkeys(a for n in sorted(region, key=order.__getitem__) for a in n.all_input_nodes
                                    if a not in region and a is not ids))  # graph order: same on every rank
        extra = {a for a in inputs if a.op == "call_function" and isinstance(a.meta.get("val"), torch.Tensor)
                 and _weights_only(a)}
        # an in-place op on a region tensor (transformers 5.17 clamps the sorted ids in place)
        extra |= {u for n in region for u in n.users if u not in region and not u.users
                  and mutates_first_arg(u) and u.args[0] in region}
        if not extra:
            break
        region |= extra
    region_list = sorted(region, key=order.__getitem__)
    params = [a for a in inputs if a.op == "get_attr"]
    # experts whose weights other layers read too (one MoE block applied as several layers; by
    # target: a program may read one weight through several get_attr nodes): each layer's rewrite
    # would slice them again
    targets = {str(p.target) for p in params}
    others = sorted({r.layer for a in graph.nodes if a.op == "get_attr" and str(a.target) in targets
                     for u in a.users if (r := u.meta.get(ROLE_KEY)) is not None and r.layer not in (None, layer)})
    if others:
        raise ScatteredRewriteError(
            f"{where}: its experts' weights {sorted(targets)[:3]} are read by layer(s) {others} too (one MoE block "
            "applied as several layers): expert parallelism of a shared MoE block is not supported (TP of the "
            "whole MoE, or AFD FFN TP groups, split it)")
    sizes = [a for a in inputs if isinstance(a.meta.get("val"), (int, torch.SymInt))]
    odd = [a for a in inputs if a.op != "get_attr" and a not in sizes and not isinstance(a.meta.get("val"), torch.Tensor)]
    if odd:
        raise ScatteredRewriteError(f"{where}: the experts read {[f'{a.name} ({a.target})' for a in odd]} for "
                                    f"{[u.name for a in odd for u in a.users if u in region]}, neither tensors nor sizes")
    tensors = [a for a in inputs if a not in params and a not in sizes]
    from_vals = descendants(vals, ffn_set) if vals is not None else set()
    payload_shapes = []
    for t in tensors:
        _check_token_major(t, n_tok, where)
        payload_shapes.append(tuple(t.meta["val"].shape))
    num_experts = _num_experts(new, params, region_list, where)
    scores = [t for t in tensors if t.meta["val"].dim() >= 2 and _same(t.meta["val"].shape[-1], num_experts)]
    if scores:  # indexed by global expert ids inside: dispatched with local ids it would pick wrong scores
        raise ScatteredRewriteError(
            f"{where}: the expert computation reads per-expert router scores {[t.name for t in scores]} after "
            "top-k (routing weights gathered by expert id, DeepSeek-V3 style); expert parallelism needs the "
            "routing weights complete before the experts: not supported yet (use the FULL MoE: drop --moe-a2a)")
    if num_experts % parts:
        raise ShardError(f"{where}: {num_experts} experts do not divide over {parts} expert-parallel ranks")
    local = num_experts // parts
    weights = []
    for p in params:
        shape = tuple(get_attr_path(new, p.target).shape)
        if shape and shape[0] == num_experts:
            weights.append(ShardedWeight(str(p.target), 0, parts, "mlp", "expert"))
    apply_shards(new, ShardPlan(tuple(weights), (), ()), {"mlp": rank})
    for p in params:  # the copies below are shape-propagated with the sliced weights
        if fake_mode is not None and "val" in p.meta:
            p.meta["val"] = fake_mode.from_tensor(get_attr_path(new, p.target), static_shapes=True)
    b = Builder(graph, fake_mode, layer)
    anchor = max([*tensors, ids], key=order.__getitem__)
    role = end.meta[ROLE_KEY]
    made: list[fx.Node] = []

    def call(target: object, args: tuple, name: str | None = None) -> fx.Node:
        node = b.call(target, args, name)
        node.meta[ROLE_KEY] = role
        made.append(node)
        return node

    with graph.inserting_before(anchor.next):
        count = call(aten.sym_size.int, (ids, 0))  # (explicit widths: a view to [0, -1] is ambiguous with no tokens)
        rows = [call(aten.view.default, (t, [count, _row_width(t, n_tok)])) for t in tensors]
        disp = call(torch.ops.afd.ep_dispatch.default, (rows, ids, group, num_experts, parts), "ep_dispatch")
        got = [call(operator.getitem, (disp, j)) for j in range(len(tensors) + 3)]
        env: dict[fx.Node, object] = {ids: got[len(tensors)]}
        valid = got[len(tensors) + 1]
        m_rows = call(aten.sym_size.int, (got[0] if tensors else env[ids], 0), "ep_rows")
        binding = TokenBinding.for_token_dims([n_tok], where)
        for t, r, shape in zip(tensors, got[: len(tensors)], payload_shapes, strict=True):
            back = call(aten.view.default, (r, [-1, *[int(s) for s in shape[1:]]]))
            if t in from_vals:  # a routing weight: zero the slots whose expert lives elsewhere
                mask = call(aten.view.default, (call(aten.to.dtype, (valid, t.meta["val"].dtype)), [-1, *[
                    int(s) for s in shape[1:]]]))
                back = call(aten.mul.Tensor, (back, mask))
            env[t] = back
        for s in sizes:
            expr = binding.substitute(sym_expr(s.meta["val"]))
            if not binding.known(expr):
                raise ScatteredRewriteError(f"{where}: the experts read {s.name} ({s.meta['val']}), which is not a "
                                            "function of the token count")
            env[s] = _emit_rows_size(lambda tgt, a: call(tgt, a), expr, binding, m_rows)
        last = made[-1]
        for n in region_list:
            with graph.inserting_after(last):
                c = graph.node_copy(n, lambda a: env.get(a, a))
            _fix_expert_count(c, num_experts, local, where)
            _propagate(c, fake_mode)
            env[n] = c
            last = c
        with graph.inserting_after(last):
            y = call(torch.ops.afd.ep_combine.default, (env[end], ids, got[len(tensors) + 2], group, num_experts),
                     "ep_combine")
    end.replace_all_uses_with(y, delete_user_cb=lambda u: u not in region)
    for n in region_list:
        for u in list(n.users):
            if u not in region and u.target == aten._assert_tensor_metadata.default:
                graph.erase_node(u)
            elif u not in region:
                raise ScatteredRewriteError(f"{where}: {u.name} reads {n.name} from inside the experts' computation")
    for n in reversed(region_list):  # in-place ops (index_put_) would survive dead-code elimination
        graph.erase_node(n)
    return weights


def _expert_parallel_ops(gm: fx.GraphModule, ffn: list[fx.Node], parts: int, rank: int, fake_mode: object,
                         group: int, where: str) -> list[ShardedWeight]:
    from .moe.parallel import expert_parallel_op

    ops = [n for n in ffn if n.target == torch.ops.afd.moe_experts.default]
    return [w for op in ops for w in expert_parallel_op(gm, op, parts, rank, fake_mode, group, where)]


def _weights_only(n: fx.Node) -> bool:
    """Computed from graph attributes and sizes alone (a transposed expert weight, an
    ``arange`` over the token count): no token data reaches it, so the region recomputes it."""
    seen, todo = set(), [n]
    while todo:
        x = todo.pop()
        if x.op == "placeholder":
            return False
        if x in seen or (x is not n and isinstance(x.meta.get("val"), (int, torch.SymInt))):
            continue  # a size (SymInt): rebound to the dispatched token count
        seen.add(x)
        todo.extend(x.all_input_nodes)
    return True


def _emit_rows_size(call: Callable[[object, tuple], fx.Node], expr: object, binding: object, m_rows: fx.Node) -> object:
    """A size the experts read, for the ``m_rows`` rows dispatched to this rank. ``expr`` is in the
    program's token symbol ``sigma`` (tokens ``T = coeff * sigma``: a static batch ``B`` makes
    ``coeff = B``, and sizes like ``B * k * (T // B)``). Written in ``T`` when that has integer
    coefficients (``k * T``: right for any row count), else with ``sigma = m_rows // coeff``
    (right only for a multiple of ``coeff``: an expression that needs it)."""
    import sympy

    from .symbolic import emit_with

    if binding.sigma is not None and binding.coeff != 1:
        rows = sympy.Symbol("ep_rows", integer=True, positive=True)
        in_rows = sympy.expand(expr.subs(binding.sigma, rows / binding.coeff))
        if in_rows.is_polynomial(rows) and all(c.is_Integer for c in sympy.Poly(in_rows, rows).coeffs()):
            return emit_with(call, in_rows, {rows: m_rows})
    sigma = call(operator.floordiv, (m_rows, binding.coeff)) if binding.coeff != 1 else m_rows
    return emit_with(call, expr, {binding.sigma: sigma})


def _row_width(t: fx.Node, n_tok: object) -> int:
    from .symbolic import sym_expr

    v = t.meta["val"]
    width = sym_expr(v.numel()) / sym_expr(n_tok)
    if not width.is_Integer:
        raise ScatteredRewriteError(f"{t.name}: {tuple(v.shape)} is not a fixed number of values per token")
    return int(width)


def _same(a: object, b: object) -> bool:
    from .symbolic import sym_expr

    return sym_expr(a) == sym_expr(b)


def _check_token_major(t: fx.Node, n_tok: object, where: str) -> None:
    """``t``'s rows must be tokens in order (``[n, ...]``, or ``[c * n, ...]`` flattened from
    ``[n, c, ...]``): it is dispatched row-block by token."""
    from .symbolic import sym_expr

    n = t
    while True:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and _same(v.shape[0], n_tok):
            break
        if n.target not in _TOKEN_MAJOR or not isinstance(n.args[0], fx.Node):
            raise ScatteredRewriteError(f"{where}: the experts read {t.name}, which is not per-token rows (token-major "
                                        f"[tokens, ...]); cannot dispatch it with its tokens")
        n = n.args[0]
    ratio = sym_expr(t.meta["val"].shape[0]) / sym_expr(n_tok) if t.meta["val"].dim() else None
    if ratio is None or not ratio.is_Integer:
        raise ScatteredRewriteError(f"{where}: {t.name} has {t.meta['val'].shape[0] if t.meta['val'].dim() else 0} rows, "
                                    "not a multiple of the token count")


def _num_experts(gm: fx.GraphModule, params: list[fx.Node], region: list[fx.Node], where: str) -> int:
    counts = {int(get_attr_path(gm, p.target).shape[0]) for p in params if get_attr_path(gm, p.target).dim() == 3}
    if len(counts) != 1:
        raise ScatteredRewriteError(f"{where}: expert parallelism needs 3-D expert weights [experts, ...] read by "
                                    f"the experts; found {[str(p.target) for p in params]}")
    return counts.pop()


def _fix_expert_count(n: fx.Node, num_experts: int, local: int, where: str) -> None:
    if n.target == aten.histc.default:
        args = list(n.args) + [100, 0, 0][len(n.args) - 1:]
        bins, lo, hi = args[1:4]
        if (bins, lo, hi) != (num_experts, 0, num_experts - 1):
            raise ScatteredRewriteError(f"{where}: {n.name}: histc over ({bins}, {lo}, {hi}), expected the expert "
                                        f"count ({num_experts}, 0, {num_experts - 1})")
        n.args = (args[0], local, 0, local - 1)
        return
    if n.target == aten.one_hot.default:
        if n.args[1] != num_experts:
            raise ScatteredRewriteError(f"{where}: {n.name}: one_hot over {n.args[1]} classes, not the expert count")
        n.args = (n.args[0], local)
        return
    if n.target in _COMPARE and n.args[1] in (num_experts, num_experts - 1):
        # transformers' EP sentinels: ids >= E mark slots routed elsewhere (then clamped to E - 1)
        n.args = (n.args[0], local if n.args[1] == num_experts else local - 1, *n.args[2:])
        return
    if n.target in _CLAMP:
        bounds = list(n.args[1:]) + [n.kwargs.get("min"), n.kwargs.get("max")][len(n.args) - 1:]
        if n.target in (aten.clamp_max.default, aten.clamp_max_.default):
            bounds = [None, n.args[1]]
        if bounds[1] == num_experts - 1 and bounds[0] in (None, 0):
            if n.target in (aten.clamp_max.default, aten.clamp_max_.default):
                n.args = (n.args[0], local - 1)
            else:
                n.args, n.kwargs = (n.args[0], bounds[0], local - 1), {}
            return
    flat = [a for a in n.args if isinstance(a, int) and not isinstance(a, bool)] + [
        x for a in n.args if isinstance(a, (list, tuple)) for x in a if isinstance(x, int)]
    if num_experts in flat:
        raise ScatteredRewriteError(f"{where}: {n.name} ({n.target}) reads the expert count {num_experts} as a "
                                    "constant; afd-compile cannot tell it is the expert count to localize it")


_COMPARE = {aten.ge.Scalar, aten.gt.Scalar, aten.lt.Scalar, aten.le.Scalar, aten.eq.Scalar, aten.ne.Scalar}
_CLAMP = {aten.clamp.default, aten.clamp_.default, aten.clamp_max.default, aten.clamp_max_.default}


def _propagate(n: fx.Node, fake_mode: object) -> None:
    if fake_mode is None:
        return
    args = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val"))
    if n.target == operator.getitem:
        n.meta["val"] = args[0][0][args[0][1]]
        return
    with fake_mode:
        n.meta["val"] = n.target(*args[0], **args[1])
