"""FFN tensor parallelism inside AFD: an FFN program run by a TP group of FFN ranks.

With ``ffn_tp = P`` the FFN ranks form groups of ``P`` (``AFDLayout.ffn_group``). Each FFN rank
still receives only its own attention peers' tokens (every token crosses the wire once); the
group's ranks then all-gather their tokens (distribution state SCATTERED -> FULL over the FFN
group), run the MLP with its weights split over the group (column-parallel up projections,
row-parallel down projection: the output is a partial sum), and reduce-scatter the output (FULL +
partial -> SCATTERED: the sum settled, each rank keeping its own tokens) before sending it back.
The collectives are the scatter-mode ones (``afd.all_gather_tokens`` / ``reduce_scatter_tokens``,
chosen by :func:`afd_compile.scatter.transition`), and the weight split is the TP sharding's
(``passes/shard``), so what a TP layout can shard an FFN TP group can.

FFN program, one layer, before (``ffn_tp = 1``)::

    token_slots = placeholder; total_tokens = sym_size(token_slots, 0)
    recv = afd.p2p_recv_group(dep, 0, L, S, total_tokens, spec)
    x = view(getitem(recv, 0), [1, total_tokens, 64]) ; <MLP> ; y = view(mlp_out, [total_tokens, 64])
    dep = afd.p2p_send_group([y], 0, L, S, spec)

After (``ffn_tp = 2``; the weights of ``<MLP>`` are this rank's slices)::

    token_slots = placeholder; ffn_group_slots = placeholder   # [own, 0], [group total, 0]
    group_tokens = sym_size(ffn_group_slots, 0)
    recv = afd.p2p_recv_group(dep, 0, L, S, total_tokens, spec)
    g = afd.all_gather_tokens(getitem(recv, 0), FFN_TP, group_tokens)
    x = view(g, [1, group_tokens, 64]) ; <MLP> ; y = view(mlp_out, [group_tokens, 64])
    dep = afd.p2p_send_group([afd.reduce_scatter_tokens(y, FFN_TP, group_tokens, total_tokens)], ...)

The runtime gives the program the group's total each step (one small all-gather of the FFN
ranks' token counts, ``runtime.FFNWorker``), which is also what the collectives check against.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .. import meta_keys
from .. import ops as afd_ops  # noqa: F401  (registers torch.ops.afd)
from ..comm import GROUP_FFN_TP
from ..errors import AFDCompileError
from ..scatter import Collective, DistState, ScatterMode, TPLayout, Transition, transition
from .router import routes_experts
from .shard import (
    ShardError,
    ShardPlan,
    apply_shards,
    one_slice_per_weight,
    shard_mlp,
)
from .shard.plan import refuse_unrecognised_moe
from .shard.types import ArgFix, OnceOperand, ShardedWeight, SlicedOperand

aten = torch.ops.aten
afd = torch.ops.afd

#: node.meta key of the nodes this pass inserts: "gather" / "settle"
META_KEY = meta_keys.FFN_TP

#: the two boundaries of an FFN TP group, as the state algebra names them: FULL is the FFN TP
#: group (a TPLayout of tp = ffn_tp whose attention is fully data-parallel: SCATTERED is one rank)
ENTER = (DistState(ScatterMode.SCATTERED), DistState(ScatterMode.FULL))
LEAVE = (DistState(ScatterMode.FULL, partial=True), DistState(ScatterMode.SCATTERED))

#: the op of each collective the boundaries need
_OPS = {Collective.ALL_GATHER: afd.all_gather_tokens.default,
        Collective.REDUCE_SCATTER: afd.reduce_scatter_tokens.default}


class FFNTPError(AFDCompileError):
    """An FFN program that an FFN TP group cannot run, and why (names layer and node)."""


@dataclass(frozen=True)
class FFNTPProgram:
    program: fx.GraphModule
    shards: ShardPlan
    parts: int
    rank: int
    kind: str = "tp"  # "tp": weights split, tokens gathered; "ep": experts split, tokens all-to-all

    def __str__(self) -> str:
        if self.kind == "ep":
            return (f"FFN EP rank {self.rank} of {self.parts}: {len(self.shards.weights)} expert weights split; "
                    "per MoE layer the tokens stay SCATTERED and go to their experts' ranks and back by all-to-all")
        enter, leave = (boundary(self.parts, *b) for b in (ENTER, LEAVE))
        return (f"FFN TP rank {self.rank} of {self.parts}: {len(self.shards.weights)} weights split; per layer "
                f"{enter} after the receive, {leave} before the send")


def boundary(parts: int, src: DistState, dst: DistState) -> Transition:
    """The collective taking an FFN program's tensor from ``src`` to ``dst`` in a group of ``parts``."""
    rec = transition(src, dst, TPLayout(parts, parts))
    if rec is None or rec.collective not in _OPS:
        raise FFNTPError(f"ffn_tp={parts}: no FFN-group collective takes {src} to {dst} (transition: {rec})")
    return rec


def tensor_parallel_ffn(ffn: fx.GraphModule, parts: int, rank: int) -> FFNTPProgram:
    """``ffn`` (an FFN program of ``build_ffn_program``; changed in place) for rank ``rank`` of an
    FFN TP group of ``parts`` ranks (module docstring). ``parts = 1`` returns it unchanged."""
    if parts == 1:
        return FFNTPProgram(ffn, ShardPlan((), (), (), (), ()), 1, 0)
    enter, leave = _OPS[boundary(parts, *ENTER).collective], _OPS[boundary(parts, *LEAVE).collective]
    graph = ffn.graph
    slots = next(n for n in graph.nodes if n.op == "placeholder")
    own = next(u for u in slots.users if u.target == aten.sym_size.int)
    with graph.inserting_after(slots):
        group_slots = graph.placeholder("ffn_group_slots")
    with graph.inserting_after(own):
        group_total = graph.call_function(aten.sym_size.int, (group_slots, 0))
    group_total._rename("group_tokens")
    # the MLP and its sizes run on the group's tokens; the receive and the send on this rank's
    own.replace_all_uses_with(group_total, delete_user_cb=lambda u: u.target != afd.p2p_recv_group.default)
    for recv in [n for n in graph.nodes if n.target == afd.p2p_recv_group.default]:
        for item in [u for u in recv.users if u.target == operator.getitem]:
            with graph.inserting_after(item):
                g = graph.call_function(enter, (item, GROUP_FFN_TP, group_total))
            g.meta[META_KEY] = "gather"
            item.replace_all_uses_with(g, delete_user_cb=lambda u, _g=g: u is not _g)
    sends = [n for n in graph.nodes if n.target == afd.p2p_send_group.default]
    for send in sends:
        (y,) = send.args[0]
        with graph.inserting_before(send):
            rs = graph.call_function(leave, (y, GROUP_FFN_TP, group_total, own))
        rs.meta[META_KEY] = "settle"
        send.args = ([rs], *send.args[1:])
    graph.lint()
    ffn.recompile()
    from .split import propagate_ffn_meta

    propagate_ffn_meta(ffn)
    weights: list[ShardedWeight] = []
    fixes: list[ArgFix] = []
    operands: list[SlicedOperand] = []
    once: list[OnceOperand] = []
    try:
        refuse_unrecognised_moe(ffn, "FFN program")
    except ShardError as e:
        raise FFNTPError(f"ffn_tp={parts}: {e}") from None
    for send in sends:
        _plan_layer(ffn, send.args[0][0].args[0], send.args[2], parts, weights, fixes, operands, once)
    plan = ShardPlan(one_slice_per_weight(weights), tuple(fixes), (), (), (), tuple(operands), tuple(once))
    apply_shards(ffn, plan, {"mlp": rank})
    return FFNTPProgram(ffn, plan, parts, rank)


def _plan_layer(ffn: fx.GraphModule, y: fx.Node, layer: int, parts: int, weights: list[ShardedWeight],
                fixes: list[ArgFix], operands: list[SlicedOperand], once: list[OnceOperand]) -> None:
    """The weight split of one layer's MLP: its column/row pairs, and a check that everything
    between the row-parallel outputs and ``y`` (settled by the reduce-scatter) is linear."""
    where = f"FFN program: layer {layer}"
    members = [n for n in ffn.graph.nodes if n.op == "call_function" and _layer(n) == layer]
    try:
        shard_mlp(ffn, members, y, parts, where, weights, fixes, operands, once)
    except ShardError as e:
        raise FFNTPError(f"ffn_tp={parts}: {e}") from None


def _layer(n: fx.Node) -> int | None:
    r = n.meta.get(meta_keys.ROLE)
    return None if r is None else r.layer


def expert_parallel_ffn(ffn: fx.GraphModule, parts: int, rank: int) -> FFNTPProgram:
    """``ffn`` (changed in place) for rank ``rank`` of an FFN expert-parallel group of ``parts``
    ranks: each MoE layer's experts split over the group, every rank routing its own tokens to
    the experts' ranks and back with all-to-all (``scattered.expert_parallel``: the tokens stay
    SCATTERED, no gather); dense layers run on each rank's own tokens with their whole weights.
    A program with no MoE layer is refused (expert parallelism would change nothing)."""
    if parts == 1:
        return FFNTPProgram(ffn, ShardPlan((), (), (), (), ()), 1, 0)
    from torch._guards import detect_fake_mode

    from .graph_utils import layers_of
    from .scattered import ScatteredRewriteError, expert_parallel

    fake_mode = detect_fake_mode([n.meta.get("val") for n in ffn.graph.nodes if "val" in n.meta])
    # weights first (the FFN program reads each where first used): the rewrite copies the experts
    # to after the dispatch, which may come before the original reads
    last_input = [n for n in ffn.graph.nodes if n.op == "placeholder"][-1]
    for n in [n for n in ffn.graph.nodes if n.op == "get_attr"]:
        last_input.append(n)
    weights: list[ShardedWeight] = []
    for layer, parts_of in layers_of(ffn).items():
        if not any(routes_experts(n) for n in parts_of.members):
            continue  # dense: data-parallel over the group, whole weights
        try:
            weights.extend(expert_parallel(ffn, layer, parts, rank, fake_mode, group=GROUP_FFN_TP))
        except (ScatteredRewriteError, ShardError) as e:
            raise FFNTPError(f"ffn_ep={parts}: FFN program: {e}") from None
    if not weights:
        raise FFNTPError(f"ffn_ep={parts}: the FFN program has no MoE layer (no top-k routing): expert "
                         "parallelism would change nothing; use ffn_tp for dense MLPs")
    ffn.graph.eliminate_dead_code()
    ffn.graph.lint()
    ffn.recompile()
    return FFNTPProgram(ffn, ShardPlan(tuple(weights), (), (), (), ()), parts, rank, "ep")


def ffn_group_program(ffn: fx.GraphModule, ffn_tp: int, ffn_ep: int, rank: int) -> FFNTPProgram:
    """``ffn`` for rank ``rank`` of its FFN group: tensor-parallel (``ffn_tp > 1``) or
    expert-parallel (``ffn_ep > 1``); unchanged when both are 1."""
    if ffn_tp > 1 and ffn_ep > 1:
        raise FFNTPError(f"ffn_tp={ffn_tp} and ffn_ep={ffn_ep} together are not supported yet; give one of them")
    if ffn_ep > 1:
        return expert_parallel_ffn(ffn, ffn_ep, rank)
    return tensor_parallel_ffn(ffn, ffn_tp, rank)
