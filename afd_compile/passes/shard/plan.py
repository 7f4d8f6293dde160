"""The shard plan of a graph: per layer the column/row pairs, their split dims, the weights to
slice, the head counts to divide (:func:`plan_shards`)."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph_utils import attention_inputs, layers_of, reads_weight
from ..mixer_blocks import mixes_tokens
from ..op_kinds import LINEAR_OPS, SDPA_OPS
from ..roles import Role, is_attention_op, role_of
from ..symbolic import sym_expr
from .apply import one_slice_per_weight, shard_pair
from .pairing import check_linear_path, column_row_pairs
from .projections import is_moe_op, moe_op_shards
from .types import (
    ArgFix,
    OnceOperand,
    ShardedState,
    ShardedWeight,
    ShardError,
    ShardPlan,
    SlicedOperand,
)

aten = torch.ops.aten

def refuse_unrecognised_moe(gm: fx.GraphModule, where: str) -> None:
    """A backstop for callers that skipped the recognition pass: an MoE block whose experts are
    not one ``afd::moe_experts`` op is refused (sharding has rules for the op only)."""
    from ..moe.block import find_blocks

    left = find_blocks(gm)
    if left:
        raise ShardError(f"{where}: the MoE block combined at {left[0].end.name} (experts chosen by "
                         f"{left[0].ids.name}) is not one afd::moe_experts op: tensor and expert parallelism "
                         "shard only the recognised op (build the rank through afd_compile.deploy.tp_rank_program, "
                         "as every entry point does: its MoE recognition names the form it cannot recognise)")


def plan_shards(gm: fx.GraphModule, attn_parts: int, mlp_parts: int,
                replicated_mlp: frozenset[int] = frozenset(), settle_apart: bool = False) -> ShardPlan:
    """Find the linears of every layer and follow their splits. Needs ``afd.role``. The MLPs of
    the ``replicated_mlp`` layers keep their full weights (a data-parallel MLP). ``settle_apart``
    (standard TP, which all-reduces each row output it is given): an MLP whose partial sums meet
    through something not linear in them settles each where it is made (:func:`shard_mlp`)."""

    weights: list[ShardedWeight] = []
    fixes: list[ArgFix] = []
    rows_out: list[tuple[str, str, int]] = []
    split_means: list[tuple[str, str, int, int]] = []
    states: list[ShardedState] = []
    operands: list[SlicedOperand] = []
    once: list[OnceOperand] = []
    if mlp_parts > 1:
        refuse_unrecognised_moe(gm, f"mlp_parts={mlp_parts}")
    for layer, parts in layers_of(gm).items():
        members = list(parts.members)
        where = f"layer {layer}"
        attn_ops = [n for n in members if role_of(n).role is Role.ATTENTION and is_attention_op(n)]
        ffn = [n for n in members if role_of(n).role is Role.FFN]
        _shard_attention(gm, parts, attn_ops, attn_parts, where, layer, weights, fixes, rows_out, split_means,
                         states, operands)
        if mlp_parts > 1 and layer not in replicated_mlp:
            mlp_means: list[fx.Node] = []  # (BitNet's norm over the intermediate size before down_proj)
            settle = shard_mlp(gm, ffn, parts.ffn_output, mlp_parts, where, weights, fixes, operands, once, mlp_means,
                               settle_apart)
            split_means.extend((m.name, "mlp", layer, mlp_parts) for m in mlp_means)
            rows_out.extend((n.name, "mlp", layer) for n in settle)
        else:
            shard_mlp(gm, ffn, parts.ffn_output, 1, where, [], [], [], [], [])  # (checks the MLP has pairs)
    return ShardPlan(one_slice_per_weight(weights), tuple(fixes), tuple(rows_out), tuple(split_means), tuple(states),
                     tuple(operands), tuple(once))


def _shard_attention(gm: fx.GraphModule, parts: object, attn_ops: list[fx.Node], attn_parts: int, where: str,
                     layer: int, weights: list[ShardedWeight], fixes: list[ArgFix], rows_out: list, split_means: list,
                     states: list[ShardedState], operands: list[SlicedOperand]) -> None:
    """A layer's attention: its q/k/v projections and output projection split by heads over
    ``attn_parts`` ranks (checked, and planned only when ``attn_parts > 1``)."""

    members = list(parts.members)
    if not attn_ops and not mixes_tokens(n for n in members if role_of(n).role is Role.ATTENTION):
        raise ShardError(f"{where} has no token mixer (an MLP or MoE block right after another, each a layer of its "
                         "own): TP plans every layer as attention then MLP, and does not take such a layer yet; "
                         "AFD without --attn-tp runs it")
    if not attn_ops:
        _shard_mixer(gm, parts, attn_parts, where, layer, weights, fixes, rows_out, split_means, states, operands)
        return
    if len(attn_ops) != 1:
        raise ShardError(f"{where}: splitting heads over ranks needs one attention op a layer, found "
                         f"{len(attn_ops)} {[n.name for n in attn_ops]} (two attention maps combined, as "
                         "DiffLlama's differential attention): not supported under TP / attention "
                         "TP; AFD without --attn-tp keeps the attention whole")
    attn = attn_ops[0]
    # (what q, k and v are computed from; not the mask, which an indexer's own projections may compute, as
    # DeepSeek-V3.2's and HY-V4's sparse attention pick the keys: replicated, they need no split)
    cols = _columns(members, attention_inputs(attn))
    rows = parts.output_projections
    if not cols or len(rows) != 1:
        raise ShardError(f"{where}: expected q/k/v projections before {attn.name} and one output projection after "
                         f"it, found {[n.name for n in cols]} / {[n.name for n in rows]}")
    heads = _attention_heads(attn)
    if attn_parts > 1 and heads is not None and heads % attn_parts:
        raise ShardError(f"{where}: {attn.name} has {heads} attention heads, which {attn_parts} attention-TP ranks "
                         "cannot divide (only KV heads may be replicated)")
    if attn_parts > 1:
        _split_heads(gm, cols, rows[0], attn_parts, where, layer, weights, fixes, rows_out, split_means, states,
                     operands)


def _columns(members: list[fx.Node], inputs: list[fx.Node]) -> list[fx.Node]:
    """The column-parallel projections of a layer's token mixer: the weight-reading projections of
    attention role (not a router; not e.g. the rotary inv_freq matmul) that ``inputs`` are computed
    from, only those feeding it directly: a low-rank down projection before another one (DeepSeek's
    MLA q_a_proj / kv_a_proj) stays replicated. Walks stay inside the layer."""
    from ..roles import ancestors, descendants

    before = ancestors(inputs, within=set(members))
    cols = [n for n in members if n in before and n.target in LINEAR_OPS and reads_weight(n)
            and role_of(n).role is Role.ATTENTION and not role_of(n).router]
    return [c for c in cols if not ((descendants(c, before) - {c}) & set(cols))]


def _split_heads(gm: fx.GraphModule, cols: list[fx.Node], row: fx.Node, attn_parts: int, where: str, layer: int,
                 weights: list[ShardedWeight], fixes: list[ArgFix], rows_out: list, split_means: list,
                 states: list[ShardedState], operands: list[SlicedOperand]) -> None:
    """The token mixer's ``cols`` / ``row`` pair split over the ``attn_parts`` ranks: its weights,
    the row's partial sum to settle and the means over the split heads to all-reduce."""
    means: list[fx.Node] = []
    shard_pair(gm, cols, row, attn_parts, "attn", weights, fixes, where, means, states, operands)
    rows_out.append((row.name, "attn", layer))
    split_means.extend((m.name, "attn", layer, attn_parts) for m in means)


def shard_mlp(gm: fx.GraphModule, members: list[fx.Node], out: fx.Node, parts: int, where: str,
              weights: list[ShardedWeight], fixes: list[ArgFix], operands: list[SlicedOperand],
              once: list[OnceOperand], means: list[fx.Node] | None = None, settle_apart: bool = False
              ) -> list[fx.Node]:
    """The weight split of one MLP or MoE block over ``parts`` ranks (``members``: its nodes,
    graph order; ``out``: its output), the one rule set TP and AFD FFN TP groups share: each
    column/row pair of projections, each ``afd::moe_experts`` op (a pair in one node). Returns
    the nodes whose values are the pending partial sums to settle: the down projection itself when
    it is the block's only pair and its output, else ``out`` (everything between checked linear);
    with ``settle_apart``, where something between is not linear in them (Gemma-4 normalises the
    MLP's and the MoE's outputs apart before adding them), each row output itself."""
    from ..router import find_router

    region = set(members)
    router = find_router(members)
    projs = [n for n in members if n.target in LINEAR_OPS and n is not router
             and not role_of(n).router]
    pairs = column_row_pairs(projs, region, where)
    moe_ops = [n for n in members if is_moe_op(n)]
    if not pairs and not moe_ops:
        raise ShardError(f"{where}: the MLP has no down projection fed by up projections "
                         f"(projections found: {[n.name for n in projs]})")
    if parts == 1:
        return [out]
    for op in moe_ops:
        weights.extend(moe_op_shards(op, parts, "mlp", where))
    for cols, row in pairs:
        shard_pair(gm, cols, row, parts, "mlp", weights, fixes, where, means, operands=operands)
    if not moe_ops and len(pairs) == 1 and _producer_linear(out, region) is pairs[0][1]:
        return [pairs[0][1]]  # settle right after the down projection
    # several partial sums (experts + shared experts) or a combine step: settle at the block output
    rows = [*moe_ops, *(row for _, row in pairs)]
    kept = len(once)
    try:
        check_linear_path(rows, out, region | {out}, where, once, cols=[c for cs, _ in pairs for c in cs])
    except ShardError as e:
        if not settle_apart:
            raise ShardError(f"{e} (standard TP settles each apart; DP attention, --moe-a2a, --dense-dp and FFN "
                             "groups settle once at the block output)") from None
        del once[kept:]  # (settled apart, a bias added after them is added to full values, on every rank)
        return rows
    return [out]


def _shard_mixer(gm: fx.GraphModule, parts: object, attn_parts: int, where: str, layer: int,
                 weights: list[ShardedWeight], fixes: list[ArgFix], rows_out: list, split_means: list,
                 states: list[ShardedState], operands: list[SlicedOperand]) -> None:
    """A token mixer that is not attention (Qwen3-Next's gated delta rule, LFM's short convolution,
    MiniMax's lightning attention: per head, or per channel, along the sequence) split by heads as
    attention is. Its output projection is the layer's last projection before the MLP
    (``Layer.output_projections``); its columns the projections that output projection reads
    (a low-rank down projection before another stays replicated). The follow checks every op
    between: one no rule splits (a scan over all channels, a norm over all heads read unsettled)
    refuses the layer, naming it."""
    rows = parts.output_projections
    mixer = ("its token mixer is not attention (no scaled_dot_product_attention, and no softmax between two "
             "matmuls: a state-space, convolution or linear-attention mixer, as in hybrid models)")
    row = rows[0] if len(rows) == 1 else None
    cols = _columns(list(parts.members), list(row.all_input_nodes)) if row is not None else []
    if not cols:  # (a row-parallel output projection needs split inputs)
        found = f"no projection before its output projection {row.name}" if row is not None else \
            "no output projection"
        raise ShardError(f"{where}: {mixer} and {found}; AFD without --attn-tp runs it whole on the attention ranks")
    if attn_parts == 1:
        return
    try:
        _split_heads(gm, cols, row, attn_parts, where, layer, weights, fixes, rows_out, split_means, states,
                     operands)
    except ShardError as e:
        raise ShardError(f"{where}: {mixer}, which TP / attention TP splits by heads only where every op of it "
                         f"keeps them apart: {str(e).removeprefix(where + ': ')}; AFD without --attn-tp runs it "
                         "whole on the attention ranks") from None


def _attention_heads(attn: fx.Node) -> int | None:
    """The query head count of an SDPA-style op (query is ``[batch, heads, seq, head_dim]``)."""
    q = attn.args[0] if attn.args else None
    v = q.meta.get("val") if isinstance(q, fx.Node) else None
    if attn.target in SDPA_OPS and isinstance(v, torch.Tensor) and v.dim() == 4:
        h = sym_expr(v.shape[1])
        return int(h) if h.is_Integer else None
    return None


def _producer_linear(out: fx.Node, members: set) -> fx.Node | None:
    from ..op_kinds import PASSTHROUGH_OPS

    n = out
    while n in members:
        if n.target in LINEAR_OPS:
            return n
        if n.target in PASSTHROUGH_OPS:
            n = n.args[0]
            continue
        return None
    return None
