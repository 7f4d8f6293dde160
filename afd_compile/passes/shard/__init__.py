"""Tensor-parallel sharding: find column- and row-parallel linears, follow the split dimension
through the graph, fix head counts in reshapes, and slice the weights per rank.

Megatron style. In each layer's attention the projections that feed the attention op (q/k/v or a
fused qkv) are column-parallel over the attention TP group and the projection after it (o_proj)
is row-parallel; in a dense MLP the linears feeding the last one (gate/up or fused gate_up) are
column-parallel over the TP group and the last (down) is row-parallel. A row-parallel output is a
partial sum: the collective that settles it is inserted by the TP rewrite (tp_rewrite.py).

The split dimension is followed node by node (``rules.py``: one rule per op in ``RULES``) from each
column-parallel output to the row-parallel input. Reshapes with a constant head count get the
count divided (``view(q, [b, s, 4, 16]) -> view(q, [b, s, 2, 16])`` at tp=2); ``-1`` entries are
left alone. Before / after, one attention at tp=2 (heads 4 -> 2)::

    linear(x, q_proj.weight[64, 64])              linear(x, q_proj.weight[32, 64])     # rows r*32..
    view(q, [s0, s1, -1, 16])                     view(q, [s0, s1, -1, 16])
    expand(k, [s0, 2, 2, s1, 16])                 expand(k, [s0, 1, 2, s1, 16])
    reshape(k, [s0, 4, s1, 16])                   reshape(k, [s0, 2, s1, 16])
    linear(attn, o_proj.weight[64, 64])           linear(attn, o_proj.weight[64, 32])  # partial sum

A tensor cut along the split dim (``chunk``/``split``/``slice`` of a fused gate_up or qkv output)
makes the weight blocked: each rank takes its slice of every block and the cut's sizes are
re-computed per rank. A reshape into fewer heads than ranks (KV heads below attn_tp) replicates
that projection's heads: ranks ``r // k`` share a slice, and repeat_kv's expand repeats ``k``
fewer times. MoE experts are one ``afd::moe_experts`` op whatever the model wrote (the
recognition pass, ``passes/moe``, runs first; an unrecognised expert form is refused there): each
rank keeps every expert's slice of the intermediate size, and the partial sum is settled once on
the block output, which must be linear in it (a shared expert's sum adds to it).

Anything the rules do not know that touches a split tensor is an error naming the node.
"""

from __future__ import annotations

from ..graph_utils import reads_weight
from .apply import apply_shards, one_slice_per_weight, shard_pair, shard_tensor
from .pairing import check_linear_path, column_row_pairs
from .plan import plan_shards, shard_mlp
from .projections import META_KEY, Block, Projection, projection
from .rules import RULES, ShardRule
from .types import (
           ArgFix,
           OnceOperand,
           ShardedState,
           ShardedWeight,
           ShardError,
           ShardPlan,
           SlicedOperand,
)

__all__ = ["META_KEY", "RULES", "ArgFix", "Block", "OnceOperand", "Projection", "ShardError", "ShardPlan", "ShardRule",
           "ShardedState", "ShardedWeight", "SlicedOperand", "apply_shards", "check_linear_path", "column_row_pairs",
           "one_slice_per_weight", "plan_shards", "projection", "reads_weight",
           "shard_mlp", "shard_pair", "shard_tensor"]
