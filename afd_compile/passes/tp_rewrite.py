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

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from ..comm import GROUP_ATTN_TP, GROUP_TP
from ..errors import TPRewriteError
from ..scatter import ScatterMode, TPLayout
from .anatomy import rebind_token_sizes
from .dist_states import TPPlan, annotate_dist_states, plan_tp
from .emitters import Site, check_emitters, emit_layer
from .graph_utils import Builder, copy_graph_module, layers_of
from .roles import META_KEY as ROLE_KEY
from .scattered import ScatteredRewriteError, expert_parallel, rewrite_scattered_layers
from .shard import ShardPlan, apply_shards, plan_shards
from .vocab_head import split_head


@dataclass
class TPProgram:
    program: fx.GraphModule
    plan: TPPlan
    shards: ShardPlan
    rank: int
    timings: dict[str, float] = field(default_factory=dict)  # seconds per pass (PassTimings)


def _check_supported(plan: TPPlan, layout: TPLayout, gm: fx.GraphModule) -> None:
    kinds = {modes.kind for modes, _ in plan.layers}
    if layout.moe_a2a and "moe" not in kinds:
        raise TPRewriteError(f"moe_a2a (--moe-a2a) is set, but the graph has no MoE layer (layer kinds: "
                             f"{sorted(kinds)}); it would change nothing")
    if layout.dense_dp and "dense" not in kinds:
        raise TPRewriteError(f"dense_dp (--dense-dp) is set, but the graph has no dense MLP layer (layer kinds: "
                             f"{sorted(kinds)}); it would change nothing")
    check_emitters(plan)


@dataclass
class TPWork:
    """One TP rank's program as the steps of :data:`TP_STEPS` build it, in order (the ``tp``
    pipeline's portable passes after the roles: ``afd_compile.portable`` runs them). ``gm`` is the
    prepared graph (MoE op, unpacked projections, ``afd.role``): planned and annotated with
    ``afd.dist``, never rewritten; ``new`` is the rank's copy the rewriting steps change."""

    gm: fx.GraphModule
    layout: TPLayout
    rank: int
    graph_name: str = "graph"
    plan: TPPlan | None = None
    shards: ShardPlan | None = None
    new: fx.GraphModule | None = None
    fake_mode: object = None
    by_name: dict[str, fx.Node] = field(default_factory=dict)
    settled: frozenset[int] = frozenset()
    experts: bool = False  # expert_parallel sliced experts (the graph has dead nodes to drop)

    @property
    def scattered(self) -> frozenset[int]:
        """The layers whose MLP is SCATTERED (data-parallel over the group, or expert-parallel)."""
        assert self.plan is not None
        return frozenset(m.index for m, _ in self.plan.layers if m.mlp is ScatterMode.SCATTERED)

    def program(self, timings: dict[str, float]) -> TPProgram:
        assert self.new is not None and self.plan is not None and self.shards is not None
        return TPProgram(self.new, self.plan, self.shards, self.rank, timings)


def _plan(w: TPWork) -> None:
    w.plan = plan_tp(w.gm, w.layout, w.graph_name)


def _annotate(w: TPWork) -> None:
    assert w.plan is not None
    annotate_dist_states(w.gm, w.plan)
    _check_supported(w.plan, w.layout, w.gm)


def _plan_shards(w: TPWork) -> None:
    lay = w.layout  # (standard TP all-reduces each row output; the other modes settle once at the block output)
    w.shards = plan_shards(w.gm, attn_parts=lay.attn_tp, mlp_parts=lay.tp, replicated_mlp=w.scattered,
                           settle_apart=lay.attn_dp == 1 and not lay.moe_a2a and not lay.dense_dp)


def _apply_shards(w: TPWork) -> None:
    assert w.shards is not None
    w.new, _ = copy_graph_module(w.gm)
    apply_shards(w.new, w.shards, {"attn": w.layout.attn_tp_rank(w.rank), "mlp": w.rank})
    w.fake_mode = detect_fake_mode([n.meta.get("val") for n in w.new.graph.nodes if "val" in n.meta])
    w.by_name = {n.name: n for n in w.new.graph.nodes}
    _settle_split_means(w.new, w.shards, w.by_name, w.fake_mode)


def _vocab_head(w: TPWork) -> None:
    assert w.plan is not None and w.new is not None
    if w.plan.head is not None:
        split_head(w.new, w.plan.head, w.layout.attn_tp_rank(w.rank), w.fake_mode)


def _expert_parallel(w: TPWork) -> None:
    assert w.plan is not None and w.new is not None and w.shards is not None
    experts = []
    for m, _ in w.plan.layers:  # MoE with all-to-all: experts split over the TP group
        if m.kind == "moe" and m.mlp is ScatterMode.SCATTERED and w.layout.tp > 1:
            try:
                experts.extend(expert_parallel(w.new, m.index, w.layout.tp, w.rank, w.fake_mode))
            except ScatteredRewriteError as e:
                raise TPRewriteError(str(e)) from None
    if experts:  # (expert_parallel sliced them)
        w.shards = replace(w.shards, weights=w.shards.weights + tuple(experts))
        w.experts = True


def _scattered_layers(w: TPWork) -> None:
    assert w.plan is not None and w.new is not None
    w.settled = frozenset(rewrite_scattered_layers(w.new, w.plan, w.layout, w.rank, w.fake_mode))
    if w.settled or w.experts:
        w.new.graph.eliminate_dead_code()


def _dp_attention(w: TPWork) -> None:
    assert w.plan is not None and w.new is not None
    _rewrite_dp_attention(w.new, w.plan, w.layout, w.rank, w.fake_mode, skip=w.scattered)
    w.new.graph.lint()
    w.new.recompile()


def _all_reduces(w: TPWork) -> None:
    assert w.plan is not None and w.new is not None and w.shards is not None
    _emit_standard_tp(w.new, w.plan, w.shards, w.settled, w.by_name, w.fake_mode)


def _fuse_norm(w: TPWork) -> None:
    from .fuse_norm import fuse_allreduce_add_rmsnorm

    assert w.new is not None
    fuse_allreduce_add_rmsnorm(w.new)


#: the steps that make a prepared graph rank ``rank``'s program, in order, by the ``tp``
#: pipeline's pass names (``afd_compile.pipeline`` says which apply: ``rewrite_dp_attention``
#: with attention DP groups, ``insert_all_reduces`` and ``fuse_norm`` without)
TP_STEPS: dict[str, Callable[[TPWork], None]] = {
    "plan_tp": _plan,
    "annotate_dist_states": _annotate,
    "plan_shards": _plan_shards,
    "apply_shards": _apply_shards,
    "vocab_parallel_head": _vocab_head,
    "expert_parallel": _expert_parallel,
    "rewrite_scattered_layers": _scattered_layers,
    "rewrite_dp_attention": _dp_attention,
    "insert_all_reduces": _all_reduces,
    "fuse_norm": _fuse_norm,
}


def _emit_standard_tp(new: fx.GraphModule, plan: TPPlan, shards: ShardPlan, settled: set[int] | frozenset[int],
                      by_name: dict[str, fx.Node], fake_mode: object) -> None:
    """Standard TP (attn_dp == 1): per layer, the emitters of its planned junction transitions
    (all-reduces of the row-parallel outputs, ``emitters.py``). A row-parallel output no planned
    transition settles (and no SCATTERED rewrite did) is an error, never a silent partial sum."""
    rows: dict[tuple[int, str], list[fx.Node]] = {}
    for node_name, group, layer in shards.row_outputs:
        rows.setdefault((layer, group), []).append(by_name[node_name])
    members = {i: list(layer.members) for i, layer in layers_of(new).items()}
    for modes, _ in plan.layers:
        i = modes.index
        site = Site(new.graph, i, members.get(i, []), f"layer {i}", Builder(new.graph, fake_mode, i), fake_mode,
                    rows={g: rows.pop((i, g), []) for g in ("attn", "mlp")})
        emit_layer(site, plan)
        left = [g for g, ns in site.rows.items() if ns and g not in site.consumed]
        if left and i not in settled:  # (a SCATTERED rewrite settled o_proj's sum with a reduce-scatter)
            raise TPRewriteError(f"layer {i}: row-parallel outputs {[n.name for n in site.rows[left[0]]]} over the "
                                 f"{left[0]} group have no planned collective to settle their partial sums")
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


def _rewrite_dp_attention(new: fx.GraphModule, plan: TPPlan, layout: TPLayout, rank: int,
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
    from .graph_utils import Builder, layers_of, region_output, symbol_sources
    from .roles import META_KEY as RKEY
    from .roles import Role

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
        inputs = [a for n in ffn for a in n.all_input_nodes if a not in ffn_set and a.op != "get_attr"]
        tensors = [a for a in dict.fromkeys(inputs) if isinstance(a.meta.get("val"), torch.Tensor)]
        sizes = [a for a in dict.fromkeys(inputs) if a not in tensors]
        if len(tensors) != 1:
            raise TPRewriteError(f"{where}: DP attention needs an MLP that reads one hidden tensor; it reads "
                                 f"{[a.name for a in tensors]}")
        ffn_in = tensors[0]
        b = Builder(graph, fake_mode, layer)
        if sizes:  # an MoE block sizes its buffers from the token count: now all groups' tokens
            rebind_token_sizes(b, ffn, sizes, list(ffn_in.meta["val"].shape[:-1]), total, where)
        site = Site(graph, layer, members, where, b, fake_mode, ffn=ffn, out=region_output(ffn), ffn_in=ffn_in,
                    hidden=int(ffn_in.meta["val"].shape[-1]), total=total, root=root, sources=sources)
        emit_layer(site, plan)  # prepare_mlp: a gather; postprocess_layer: a reduce-scatter (emitters.py)
        if site.gathered is None:
            raise TPRewriteError(f"{where}: DP attention planned no gather of the MLP input (prepare_mlp)")
    graph.eliminate_dead_code()  # the original norm nodes the gathered copy replaced


class _Probe(fx.Interpreter):
    node: fx.Node | None = None

    def run_node(self, n: fx.Node) -> object:
        self.node = n
        return super().run_node(n)


def check_any_token_total(program: fx.GraphModule, inputs: list[object], where: str) -> None:
    """A DP-attention rank program must run for any tokens of the other DP groups: its MLP runs
    on all of them, a count set per step (``dp_token_slots``). Runs ``program`` on fake tensors
    (``inputs``: this rank's, real or fake; the slots are added) with one token more in all than
    this rank's own; a size fixed when the graph was traced fails there. Raises TPRewriteError
    naming the node and its layer. (Dynamo traces a decode step under a static KV cache with a
    static batch: an MLP that builds sizes from its token count, as HF's grouped-mm experts do,
    then holds them as constants.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    own = next(int(x.numel()) for x in inputs if isinstance(x, torch.Tensor))  # as runtime.dp_step_counts
    # a shape env: data-dependent sizes (an expert loop's torch.where) become unbacked, not a failure
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    fakes = [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x for x in inputs]
    probe = _Probe(program)
    try:
        with mode, torch.no_grad():
            probe.run(*fakes, torch.empty(own + 1, 0))
    except Exception as e:  # noqa: BLE001  (any failure of the fake run is the answer)
        n = probe.node
        role = n.meta.get(ROLE_KEY) if n is not None else None
        layer = f"layer {role.layer}: " if role is not None and role.layer is not None else ""
        detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise TPRewriteError(
            f"{where}: DP attention: {layer}node {n.name if n is not None else '?'} "
            f"({getattr(n, 'target', '?')}) fails when the DP groups hold {own + 1} tokens in all "
            f"(this rank {own}): {detail}. Its MLP runs on the tokens of every DP group, a count set per "
            "step, but the graph fixed a size from its own token count when it was traced (dynamo traces "
            "decode steps under a static KV cache with a static batch). Use attn_dp=1, or an MLP whose "
            "sizes follow its input rather than the token count it was traced with") from None


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


aten_view = torch.ops.aten.view.default
aten_sym_size = torch.ops.aten.sym_size.int
aten_mul = torch.ops.aten.mul.Tensor
aten_add = torch.ops.aten.add.Tensor
