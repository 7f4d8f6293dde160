"""Every ``node.meta`` / ``gm.meta`` key afd-compile writes, in one place: one key per pass (or
record), each written by one module and named here, so no two passes share one by accident and a
reader finds who writes it. ``tests/test_architecture.py`` holds that no other module spells an
``"afd.<key>"`` literal."""

from __future__ import annotations

#: node.meta: the layer and attention / FFN role of every node (passes/roles.py: NodeRole)
ROLE = "afd.role"
#: node.meta: the distribution state of every node of a TP program (passes/dist_states.py, vocab_head.py)
DIST = "afd.dist"
#: node.meta: the micro-batch stage a node of a staged program belongs to (passes/stages.py)
STAGE = "afd.stage"
#: node.meta: the dim of a static-batch program's batch a node carries (passes/batch_dims.py)
BATCH_DIM = "afd.batch_dim"
#: node.meta: how a sharded weight or state was split (passes/shard/projections.py)
SHARD = "afd.shard"
#: node.meta: an FFN TP / EP group program's record (passes/ffn_tp.py)
FFN_TP = "afd.ffn_tp"
#: node.meta: a recognised MoE block's record on its afd::moe_experts node (passes/moe)
MOE = "afd.moe"
#: gm.meta: every MoE block's record (passes/moe: recognise_moe)
MOE_RECORDS = "afd.moe_blocks"
#: gm.meta: the projections packed per KV group that were unpacked (passes/grouped_qkv.py)
UNPACKED_PROJECTIONS = "afd.unpacked_projections"
#: gm.meta: the split-into-heads merged before TP (passes/head_pieces.py)
HEAD_PIECES = "afd.merged_head_pieces"
#: gm.meta: what every token count of a static-token FFN program is a multiple of (passes/split.py)
TOKEN_MULTIPLE = "afd.token_multiple"
#: node.meta: an SDPA over a KV cache replaced (or why not) (passes/decode_attention.py)
DECODE_ATTENTION = "afd.decode_attention"
#: node.meta: a TP rank's KV cache held as its slice (passes/local_state.py)
HELD_STATE = "afd.held_state"
#: node.meta: a receive rewritten into buffers (passes/recv_into.py)
RECV_INTO = "afd.recv_into"
#: node.meta: a send and the next receive fused (passes/fuse_exchange.py)
FUSED_EXCHANGE = "afd.fused_exchange"
#: node.meta: an experts op whose fixed slot's padded rows were marked (passes/slot_rows.py)
SLOT_ROWS = "afd.slot_rows"
#: gm.meta: what each lowering pass did, by pass name (pipeline.lower)
LOWERED = "afd.lowered"
