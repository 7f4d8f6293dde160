"""The plan drives the TP rewrite: one emitter per planned transition.

``scatter.transition`` gives each junction of each layer its collectives (``TPPlan``). Here every
kind of planned transition, keyed by :class:`JunctionKey` (junction, collective, whether it also
settles a partial sum, the MLP's mode), has one registered :class:`Emitter`: the function that
puts its ``afd::`` op into a rank's graph. The standard-TP and DP-attention emitters are here;
the SCATTERED-MLP ones are in ``scattered.py`` (registered with ``by="scattered"``: their site
carries the previous layer's SCATTERED output). ``tp_rewrite`` and ``scattered`` only
orchestrate: per layer they look each planned transition up and call its emitter; neither
branches on modes to choose a collective. A transition with no emitter is refused by
:func:`check_emitters` before anything is rewritten, naming the layer, the junction and the
transition. Adding a collective = its op (``collectives.py``), its row in ``scatter.transition``, its
emitter here.

Emitters of standard TP (attn_dp == 1), the Megatron pattern::

    o = linear(attn, o_proj[:, slice])       ->  o = afd.all_reduce(linear(...), ATTN_TP)   # prepare_mlp
    d = linear(act, down_proj[:, slice])     ->  d = afd.all_reduce(linear(...), TP)        # postprocess_layer

Emitters of DP attention (attn_dp > 1, a FULL MLP): see :func:`gather_after_norm`,
:func:`gather_partial` and :func:`reduce_scatter_mlp_output`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..comm import GROUP_ATTN_TP, GROUP_TP
from ..errors import TPRewriteError
from ..scatter import Collective, ScatterMode
from .anatomy import attention_row, is_identity, parallel_residual, residual_add_after_attention
from .graph_utils import Builder, shape_args
from .op_kinds import ADD_OPS
from .roles import META_KEY as ROLE_KEY
from .roles import ancestors, descendants

aten_view = torch.ops.aten.view.default
aten_sym_size = torch.ops.aten.sym_size.int
aten_mul = torch.ops.aten.mul.Tensor
aten_add = torch.ops.aten.add.Tensor

JUNCTIONS = ("prepare_attn", "prepare_mlp", "postprocess_layer")


@dataclass(frozen=True)
class JunctionKey:
    """What an emitter is registered for."""

    junction: str
    collective: Collective
    reduces: bool
    mlp: ScatterMode

    def __str__(self) -> str:
        return (f"{self.junction}: {self.collective}{' (settling a partial sum)' if self.reduces else ''} "
                f"with a {self.mlp.name} MLP")


@dataclass
class LayerSite:
    """What every emitter gets: one layer of one rank's graph, a node builder for it."""

    graph: fx.Graph
    layer: int
    members: list[fx.Node]
    where: str
    b: Builder
    fake_mode: object


@dataclass
class Site(LayerSite):
    """The site of tp_rewrite's emitters. Standard TP fills ``rows``; DP attention fills the MLP
    fields; ``gathered`` passes prepare_mlp's result to postprocess_layer."""

    rows: dict[str, list[fx.Node]] = field(default_factory=dict)  # row-parallel outputs by group
    ffn: list[fx.Node] = field(default_factory=list)
    out: fx.Node | None = None  # the MLP's output
    ffn_in: fx.Node | None = None  # the one hidden tensor the MLP reads
    hidden: int = 0
    total: fx.Node | None = None  # all DP groups' tokens (sym_size of dp_token_slots)
    root: float = 1.0  # 1 on attention-TP rank 0, else 0: who contributes a replicated value
    sources: dict = field(default_factory=dict)  # symbol -> (placeholder, dim)
    gathered: fx.Node | None = None
    consumed: set[str] = field(default_factory=set)  # row groups an emitter settled


@dataclass(frozen=True)
class Emitter:
    by: str  # the pass whose walk calls it: tp_rewrite | scattered (its site type differs)
    fn: Callable[[Any], None]
    what: str


EMITTERS: dict[JunctionKey, Emitter] = {}


def register(junction: str, collective: Collective, reduces: bool, mlp: ScatterMode, what: str,
             by: str = "tp_rewrite") -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    def deco(fn: Callable[[Any], None]) -> Callable[[Any], None]:
        key = JunctionKey(junction, collective, reduces, mlp)
        if key in EMITTERS:
            raise ValueError(f"an emitter for {key} is registered twice")
        EMITTERS[key] = Emitter(by, fn, what)
        return fn

    return deco


def planned(plan: object) -> list[tuple[int, str, JunctionKey]]:
    """(layer, junction, key) of every planned transition, in layer and junction order."""
    out = []
    for modes, junctions in plan.layers:  # type: ignore[attr-defined]
        for name in JUNCTIONS:
            for t in getattr(junctions, name):
                out.append((modes.index, name, JunctionKey(name, t.collective, t.reduces, modes.mlp)))
    return out


def check_emitters(plan: object) -> None:
    """Every planned transition has an emitter, or a TPRewriteError naming the first that has none."""
    for layer, _, key in planned(plan):
        if key not in EMITTERS:
            raise TPRewriteError(f"layer {layer} {key}: planned, but no emitter is registered for it (its rewrite "
                                 "is not implemented yet); `afd-compile plan` shows the full plan")


def emit_layer(site: Any, plan: object, by: str = "tp_rewrite") -> None:
    """Call, in junction order, the emitter of each of this layer's planned transitions that the
    pass ``by`` emits (``tp_rewrite``: standard TP and DP attention; ``scattered``: SCATTERED
    MLPs, whose site carries the previous layer's output)."""
    for layer, _, key in planned(plan):
        if layer == site.layer and EMITTERS[key].by == by:
            EMITTERS[key].fn(site)


# --- standard TP: all-reduce the row-parallel outputs ---------------------------------------------


def _all_reduce_rows(site: Site, group: str) -> None:
    rows = site.rows.get(group, [])
    site.consumed.add(group)
    if not rows:
        raise TPRewriteError(f"{site.where}: the plan all-reduces over the {group} group here, but the sharding "
                             "found no row-parallel output to settle")
    for row in rows:
        while len(row.users) == 1 and is_identity(next(iter(row.users))):  # keep all-reduce + add adjacent
            row = next(iter(row.users))
        with site.graph.inserting_after(row):
            ar = site.graph.call_function(torch.ops.afd.all_reduce.default,
                                          (row, GROUP_ATTN_TP if group == "attn" else GROUP_TP))
        ar.meta[ROLE_KEY] = row.meta.get(ROLE_KEY)
        if site.fake_mode is not None and "val" in row.meta:
            with site.fake_mode:
                ar.meta["val"] = torch.ops.afd.all_reduce.default(row.meta["val"], 0)
        row.replace_all_uses_with(ar, delete_user_cb=lambda u, _ar=ar: u is not _ar)


@register("prepare_mlp", Collective.ALL_REDUCE, True, ScatterMode.FULL,
          "afd.all_reduce of o_proj's partial sum over the attention-TP group")
def all_reduce_attention_output(site: Site) -> None:
    _all_reduce_rows(site, "attn")


@register("postprocess_layer", Collective.ALL_REDUCE, True, ScatterMode.FULL,
          "afd.all_reduce of the MLP's partial sum (down_proj, or the combined MoE output) over the TP group")
def all_reduce_mlp_output(site: Site) -> None:
    _all_reduce_rows(site, "mlp")


# --- DP attention with a FULL MLP -----------------------------------------------------------------


def _route_mlp_input(site: Site, new_input: fx.Node) -> None:
    ffn_set = set(site.ffn)
    for u in list(site.ffn_in.users):
        if u in ffn_set:
            u.replace_input_with(site.ffn_in, new_input)


@register("prepare_mlp", Collective.ALL_GATHER, False, ScatterMode.FULL,
          "attn_tp == 1: afd.all_gather_tokens of the normed MLP input (the norm ran on own tokens)")
def gather_after_norm(site: Site) -> None:
    """attn_tp == 1 (the norm runs on this rank's tokens only)::

        n = post_attention_norm(h1)                        # TP_ATTN_FULL, own tokens
        g = afd.all_gather_tokens(view(n, [-1, H]))        # prepare_mlp: FULL, all tokens
    """
    b = site.b
    with site.graph.inserting_before(site.ffn[0]):
        flat = b.call(aten_view, (site.ffn_in, [-1, site.hidden]), "dp_flat")
        site.gathered = b.call(torch.ops.afd.all_gather_tokens.default, (flat, GROUP_TP, site.total), "dp_gather")
    _route_mlp_input(site, site.gathered)


@register("prepare_mlp", Collective.ALL_GATHER, True, ScatterMode.FULL,
          "attn_tp > 1: afd.gather_partial_tokens settles o_proj's partial sum and gathers in one collective")
def gather_partial(site: Site) -> None:
    """attn_tp > 1 (SGLang's dp_gather_partial: one collective settles o_proj's partial sum and
    gathers; the residual is added on attention-TP rank 0 only so it is counted once)::

        G = afd.gather_partial_tokens(view(o + x * [attn_tp_rank == 0], [-1, H]))  # FULL
        h1 = view(afd.scatter_tokens(G), [b, s, H])       # middle residual: own tokens, no comm
        n = post_attention_norm(G)                         # the norm runs on the gathered tokens

    A parallel-residual block or a norm after o_proj take their own forms (below)."""
    if parallel_residual(site.members, [site.ffn_in]):
        site.gathered = _parallel_residual_gather(site)
        return
    b, graph, members, where = site.b, site.graph, site.members, site.where
    h1, row_out, x_res = residual_add_after_attention(members, site.ffn[0], where)
    layer_nodes = set(members)
    if site.ffn_in is not h1 and site.ffn_in not in descendants(h1, layer_nodes):
        raise TPRewriteError(
            f"{where}: DP attention with attn_tp > 1 needs the MLP to read the residual sum after "
            f"attention ({h1.name}) or not depend on attention at all (parallel residual); its input "
            f"{site.ffn_in.name} depends on attention some other way")
    between = descendants(h1, layer_nodes) & ancestors([site.ffn_in], within=layer_nodes)
    norm_nodes = sorted(between - {h1}, key=members.index)
    if x_res is None:  # post-norm: settle o's partial sum in the group before the norm
        gathered = _post_norm_gather(site, row_out, h1)
    else:
        with graph.inserting_before(h1):
            scaled = b.call(aten_mul, (x_res, site.root), "dp_residual_once")
            pre = b.call(aten_add, (row_out, scaled), "dp_pre_gather")
            flat = b.call(aten_view, (pre, [-1, site.hidden]), "dp_flat")
            gathered = b.call(torch.ops.afd.gather_partial_tokens.default, (flat, GROUP_TP, site.total),
                              "dp_gather")
            own = b.call(aten_sym_size, (flat, 0), "dp_own_tokens")
            local = b.call(torch.ops.afd.scatter_tokens.default, (gathered, site.total, own), "dp_scatter")
            h1_local = b.call(aten_view, (local, shape_args(b, tuple(h1.meta["val"].shape), site.sources)),
                              "dp_middle_residual")
    env: dict[fx.Node, fx.Node] = {h1: gathered}
    with graph.inserting_before(site.ffn[0]):
        for n in norm_nodes:
            env[n] = graph.node_copy(n, lambda a, _env=env: _env.get(a, a))
            env[n].meta.pop("val", None)
    _route_mlp_input(site, env[site.ffn_in])
    if x_res is not None:
        h1.replace_all_uses_with(h1_local)
        graph.erase_node(h1)
    site.gathered = gathered


@register("postprocess_layer", Collective.REDUCE_SCATTER, True, ScatterMode.FULL,
          "afd.reduce_scatter_tokens of the MLP's partial output back to this group's tokens")
def reduce_scatter_mlp_output(site: Site) -> None:
    """``h2 = h1 + view(afd.reduce_scatter_tokens(m), ...)``: the MLP ran on all groups' tokens;
    each group gets its own rows back, summed over the TP group."""
    b, out = site.b, site.out
    ffn_set = set(site.ffn)
    users = [u for u in out.users if u not in ffn_set]
    with site.graph.inserting_before(users[0]):
        ref = _flat_rows(b, site.ffn_in, site.hidden)
        out2d = b.call(aten_view, (out, [-1, site.hidden]))  # the MLP ran on (tokens, hidden) rows
        out2d.meta["val"] = site.gathered.meta.get("val") if site.gathered is not None else None
        rs = b.call(torch.ops.afd.reduce_scatter_tokens.default, (out2d, GROUP_TP, site.total, ref),
                    "dp_reduce_scatter")
        back = b.call(aten_view, (rs, shape_args(b, tuple(out.meta["val"].shape), site.sources)), "dp_layer_out")
    for u in users:
        u.replace_input_with(out, back)


def _flat_rows(b: Builder, node: fx.Node, hidden: int) -> fx.Node:
    """This rank's token count, as a graph value: rows of ``node`` viewed as (-1, hidden)."""
    flat = b.call(aten_view, (node, [-1, hidden]))
    return b.call(aten_sym_size, (flat, 0))


def _parallel_residual_gather(site: Site) -> fx.Node:
    """DP attention, attn_tp > 1, a parallel-residual block: the MLP input does not wait for
    attention, so it is gathered on its own and o_proj's sum is settled in the attention group::

        o = afd.all_reduce(o, group=ATTN_TP)                                     # attention: TP_ATTN_FULL
        G = afd.gather_partial_tokens(view(ln2(x) * [attn_tp_rank == 0], [-1, H]))  # prepare_mlp: FULL
        h = x + o + view(afd.reduce_scatter_tokens(mlp(G)), ...)                  # postprocess_layer

    (every rank of an attention group holds the same ``ln2(x)``; one of them contributes it)."""
    b, graph = site.b, site.graph
    row = attention_row(site.members, site.where)
    if not any(u.target in ADD_OPS for u in row.users):
        raise TPRewriteError(f"{site.where}: the attention output projection {row.name} does not feed an add")
    with graph.inserting_before(row.next):
        ar = b.call(torch.ops.afd.all_reduce.default, (row, GROUP_ATTN_TP), "dp_attn_all_reduce")
    row.replace_all_uses_with(ar, delete_user_cb=lambda u: u is not ar)
    with graph.inserting_before(site.ffn[0]):
        once = b.call(aten_mul, (site.ffn_in, site.root), "dp_mlp_input_once")
        flat = b.call(aten_view, (once, [-1, site.hidden]), "dp_flat")
        gathered = b.call(torch.ops.afd.gather_partial_tokens.default, (flat, GROUP_TP, site.total), "dp_gather")
    _route_mlp_input(site, gathered)
    return gathered


def _post_norm_gather(site: Site, row: fx.Node, h1: fx.Node) -> fx.Node:
    """DP attention, attn_tp > 1, a norm between o_proj and the residual add (Gemma-2, OLMo-2)::

        o = afd.all_reduce(o, group=ATTN_TP)              # settled before the (non-linear) norm
        h1 = x + norm(o)                                   # middle residual: own tokens, full
        G = afd.gather_partial_tokens(view(h1 * [attn_tp_rank == 0], [-1, H]))   # prepare_mlp: FULL

    (every rank of an attention group holds the same h1; one of them contributes it)."""
    b, graph = site.b, site.graph
    with graph.inserting_after(row):
        ar = b.call(torch.ops.afd.all_reduce.default, (row, GROUP_ATTN_TP), "dp_attn_all_reduce")
    row.replace_all_uses_with(ar, delete_user_cb=lambda u: u is not ar)
    with graph.inserting_before(h1.next):  # (inserting_after would stack them in reverse)
        once = b.call(aten_mul, (h1, site.root), "dp_residual_once")
        flat = b.call(aten_view, (once, [-1, site.hidden]), "dp_flat")
        return b.call(torch.ops.afd.gather_partial_tokens.default, (flat, GROUP_TP, site.total), "dp_gather")
