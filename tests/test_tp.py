"""Tensor-parallel sharding (standard TP): structure of the per-rank program and numerics on
real gloo processes against the single-process model."""

from __future__ import annotations

import operator

import pytest
import torch

from afd_compile.deploy import tp_rank_program
from afd_compile.errors import TPRewriteError
from afd_compile.passes.roles import META_KEY as ROLE_KEY
from afd_compile.passes.roles import Role, annotate_roles
from afd_compile.passes.shard import ShardError
from afd_compile.scatter import TPLayout
from afd_compile.verify import TPCase, run_tp_cases


def _program(exported, name, layout, rank=0, fuse_norm=True):
    gm = exported(name)[0].module()
    return tp_rank_program(gm, layout, rank, graph_name=name, fuse_norm=fuse_norm)


def test_all_reduce_add_rmsnorm_is_kept_as_one_fusable_unit(exported):
    fused = _program(exported, "llama2", TPLayout(2))
    t = [n.target for n in fused.program.graph.nodes]
    # o_proj -> post-attention norm and down_proj -> next input norm (the last: the final norm)
    assert t.count(torch.ops.afd.all_reduce_add_rms_norm.default) == 4
    assert torch.ops.afd.all_reduce.default not in t  # every reduction is inside a unit, none dropped
    assert t.count(torch.ops.aten.rsqrt.default) == 1  # only layer 0's input norm has no reduction before it


def test_standard_tp_inserts_two_all_reduces_per_layer(exported):
    prog = _program(exported, "llama2", TPLayout(2), fuse_norm=False)
    ars = [n for n in prog.program.graph.nodes if n.target == torch.ops.afd.all_reduce.default]
    assert len(ars) == 4
    # each all-reduce directly follows a row-parallel linear and feeds the residual add
    for ar in ars:
        assert ar.args[0].target == torch.ops.aten.linear.default
        assert [u.target for u in ar.users] == [torch.ops.aten.add.Tensor]
    weights = dict(prog.program.named_parameters())
    q = weights["model.model.layers.0.self_attn.q_proj.weight"]
    o = weights["model.model.layers.0.self_attn.o_proj.weight"]
    down = weights["model.model.layers.0.mlp.down_proj.weight"]
    assert tuple(q.shape) == (32, 64) and tuple(o.shape) == (64, 32) and tuple(down.shape) == (64, 64)
    # the GQA expand/reshape head counts were divided: heads 4 -> 2, kv heads 2 -> 1
    fixes = {(f.old, f.new) for f in prog.shards.arg_fixes}
    assert fixes == {(2, 1), (4, 2)}


def test_decode_graph_with_one_token_per_sequence_splits_the_same_heads():
    # seq == 1 is static in a decode graph (dynamo and export specialise size-1 dims): the head
    # reshape x[B, 1, H*D] -> [B, 1, H, D] must split H, not the size-1 sequence dim
    from afd_compile.models import build_hf, export_lm

    gm = export_lm(build_hf("llama", num_layers=1), seq=1).module()
    annotate_roles(gm)
    prog = tp_rank_program(gm, TPLayout(2), 0, graph_name="decode", fuse_norm=False)
    assert {(f.old, f.new) for f in prog.shards.arg_fixes} == {(2, 1), (4, 2)}
    assert "each slice on" not in str(prog.shards)  # no KV head replicated


def test_conv1d_projections_shard_their_out_features_blockwise(exported):
    # GPT-2: c_attn is addmm(bias, x, W[in, 3 * hidden]) split into q/k/v; c_proj is row-parallel
    prog = _program(exported, "gpt2", TPLayout(2), fuse_norm=False)
    by_target = {w.target: w for w in prog.shards.weights}
    attn = "model.transformer.h.0.attn."
    c_attn, c_attn_bias = by_target[attn + "c_attn.weight"], by_target[attn + "c_attn.bias"]
    assert (c_attn.dim, c_attn.kind, c_attn.blocks) == (1, "column", (64, 64, 64))
    assert (c_attn_bias.dim, c_attn_bias.blocks) == (0, (64, 64, 64))
    assert (by_target[attn + "c_proj.weight"].dim, by_target[attn + "c_proj.weight"].kind) == (0, "row")
    assert by_target[attn + "c_proj.bias"].kind == "row_bias"
    params = dict(prog.program.named_parameters())
    assert tuple(params[attn + "c_attn.weight"].shape) == (64, 96)


def test_norm_over_all_heads_settles_its_mean_across_ranks(exported):
    # OLMo-2 normalises q and k over all heads before splitting them: each rank's mean covers its
    # slice, one all-reduce / tp makes it the full mean; the norm's scale is sharded like q / k
    prog = _program(exported, "olmo2", TPLayout(2), fuse_norm=False)
    assert len(prog.shards.split_means) == 4  # q and k norm, 2 layers
    means = {m for m, *_ in prog.shards.split_means}
    for n in prog.program.graph.nodes:
        if n.name in means:
            (ar,) = n.users
            assert ar.target == torch.ops.afd.all_reduce.default
            (div,) = ar.users
            assert div.target == torch.ops.aten.div.Tensor and div.args[1] == 2
    params = dict(prog.program.named_parameters())
    assert tuple(params["model.model.layers.0.self_attn.q_norm.weight"].shape) == (32,)


def test_a_scale_sliced_for_a_split_path_must_not_be_read_whole_elsewhere(exported):
    gm = exported("olmo2")[0].module()
    w = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target.endswith("layers.0.self_attn.q_norm.weight"))
    with gm.graph.inserting_after(w):
        gm.graph.call_function(torch.ops.aten.neg.default, (w,))  # a second, unsplit reader
    annotate_roles(gm)
    with pytest.raises(ShardError, match="q_norm.weight is applied along the split dim .* also read it whole"):
        tp_rank_program(gm, TPLayout(2), 0, graph_name="olmo2")


def test_explicit_attention_shards_v_with_q_and_k(exported):
    # softmax(q @ k^T) @ v: v enters after the softmax, and p @ v is not the output projection
    prog = _program(exported, "gemma2", TPLayout(2), fuse_norm=False)
    sharded = {w.target for w in prog.shards.weights}
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"model.model.layers.0.self_attn.{proj}.weight" in sharded


def test_dp_attention_looks_through_a_scalar_residual_multiplier(exported):
    # Granite scales o_proj's output before the residual add: linear, so the partial sum is
    # gathered (and settled) after the scaling
    prog = _program(exported, "granite", TPLayout(4, 2), fuse_norm=False)
    pre = [n for n in prog.program.graph.nodes if n.name.startswith("dp_pre_gather")]
    assert len(pre) == 2 and all(n.args[0].target == torch.ops.aten.mul.Tensor for n in pre)


def test_dp_attention_with_attn_tp_gathers_a_parallel_residual_mlp_input_alone(exported):
    # GPT-J: h = x + attn(ln(x)) + mlp(ln(x)). The MLP does not wait for attention: its input is
    # gathered once per group (contributed by attention-TP rank 0), o_proj is all-reduced in the
    # attention group, the MLP output reduce-scattered back
    prog = _program(exported, "gptj", TPLayout(4, 2), rank=1, fuse_norm=False)
    afd = torch.ops.afd
    t = _targets(prog)
    assert t.count(afd.all_reduce.default) == 2 and t.count(afd.gather_partial_tokens.default) == 2
    assert t.count(afd.reduce_scatter_tokens.default) == 2 and afd.scatter_tokens.default not in t
    once = [n for n in prog.program.graph.nodes if n.name.startswith("dp_mlp_input_once")]
    assert len(once) == 2 and all(n.args[1] == 0.0 for n in once)  # rank 1 of its group contributes nothing
    for ar in (n for n in prog.program.graph.nodes if n.target == afd.all_reduce.default):
        assert ar.args[1] == 1  # the attention-TP group


def test_dp_attention_settles_o_proj_before_a_post_attention_norm(exported):
    # Gemma-2: o_proj -> norm -> + residual. The partial sum is all-reduced in the attention
    # group before the norm; the (full) middle residual is then gathered once per group
    prog = _program(exported, "gemma2", TPLayout(4, 2), fuse_norm=False)
    nodes = {n.name: n for n in prog.program.graph.nodes}
    ars = [n for n in nodes.values() if n.name.startswith("dp_attn_all_reduce")]
    assert len(ars) == 2 and all(n.args[0].target == torch.ops.aten.linear.default for n in ars)
    gathers = [n for n in nodes.values() if n.target == torch.ops.afd.gather_partial_tokens.default]
    assert len(gathers) == 2 and not [n for n in nodes.values() if n.target == torch.ops.afd.scatter_tokens.default]


def test_ranks_get_different_slices(exported):
    p0 = dict(_program(exported, "llama2", TPLayout(2), 0).program.named_parameters())
    p1 = dict(_program(exported, "llama2", TPLayout(2), 1).program.named_parameters())
    full = dict(exported("llama2")[0].module().named_parameters())
    name = "model.model.layers.1.mlp.gate_proj.weight"
    assert torch.equal(torch.cat([p0[name], p1[name]]), full[name])


def test_kv_heads_are_replicated_when_attn_tp_exceeds_them(exported):
    # the tiny Llama has 4 query heads and 2 KV heads: at tp=4 ranks {0,1} share KV head 0
    progs = [_program(exported, "llama2", TPLayout(4), r) for r in range(4)]
    full = dict(exported("llama2")[0].module().named_parameters())
    k = "model.model.layers.0.self_attn.k_proj.weight"
    ks = [dict(p.program.named_parameters())[k] for p in progs]
    assert tuple(ks[0].shape) == (16, 64)
    assert torch.equal(ks[0], ks[1]) and torch.equal(ks[2], ks[3])
    assert torch.equal(torch.cat([ks[0], ks[2]]), full[k])
    q = [dict(p.program.named_parameters())["model.model.layers.0.self_attn.q_proj.weight"] for p in progs]
    assert torch.equal(torch.cat(q), full["model.model.layers.0.self_attn.q_proj.weight"])
    # repeat_kv's expand: KV heads 2 -> 1 and the repeat 2 -> 1; its reshape: 4 heads -> 1
    fixes = sorted((f.old, f.new) for f in progs[0].shards.arg_fixes)
    assert fixes == [(2, 1)] * 8 + [(4, 1)] * 4
    assert "each slice on 2 ranks" in str(progs[0].shards)


def test_query_heads_that_do_not_divide_are_refused(exported):
    with pytest.raises(ShardError, match="layer 0: .* has 4 attention heads, which 8 attention-TP ranks cannot divide"):
        _program(exported, "llama2", TPLayout(8))


def test_moe_experts_are_sharded_as_fused_blocks(exported):
    prog = _program(exported, "qwen3moe2", TPLayout(2), rank=1, fuse_norm=False)
    weights = {w.target: w for w in prog.shards.weights}
    gate_up = weights["model.model.layers.0.mlp.experts.gate_up_proj"]  # [experts, 2 * 32, hidden]
    assert (gate_up.dim, gate_up.kind, gate_up.blocks) == (1, "column", (32, 32))
    down = weights["model.model.layers.0.mlp.experts.down_proj"]  # [experts, hidden, 32]
    assert (down.dim, down.kind) == (2, "row")
    full = exported("qwen3moe2")[0].module().get_parameter("model.model.layers.0.mlp.experts.gate_up_proj")
    mine = prog.program.get_parameter("model.model.layers.0.mlp.experts.gate_up_proj")
    # rank 1 holds the second half of the gate block and the second half of the up block
    assert torch.equal(mine, torch.cat([full[:, 16:32], full[:, 48:64]], dim=1))
    assert "model.model.layers.0.mlp.gate.weight" not in weights  # the router stays replicated
    # one all-reduce per MoE block, on the combined output (not per expert), and one after o_proj
    ars = [n for n in prog.program.graph.nodes if n.target == torch.ops.afd.all_reduce.default]
    assert len(ars) == 4
    assert sum(1 for a in ars if a.args[0].target == torch.ops.aten.linear.default) == 2


def test_fused_qkv_is_sliced_per_block_with_replicated_kv(exported):
    # Phi-3: qkv_proj [q 64 | k 32 | v 32] cut by three slices; at tp=4 each rank holds q 16, k 16, v 16
    prog = _program(exported, "phi3", TPLayout(4), rank=3)
    qkv = next(w for w in prog.shards.weights if w.target.endswith("layers.0.self_attn.qkv_proj.weight"))
    assert (qkv.blocks, qkv.replicate) == ((64, 32, 32), (1, 2, 2))
    assert tuple(prog.program.get_parameter(qkv.target).shape) == (48, 64)
    slices = [n for n in prog.program.graph.nodes if n.target == torch.ops.aten.slice.Tensor
              and n.args[0].target == torch.ops.aten.linear.default
              and str(n.args[0].args[1].target).endswith("layers.0.self_attn.qkv_proj.weight")]
    assert sorted(tuple(n.args[2:4]) for n in slices) == [(0, 16), (16, 32), (32, 9223372036854775807)]
    gate_up = next(w for w in prog.shards.weights if w.target.endswith("layers.0.mlp.gate_up_proj.weight"))
    assert gate_up.blocks == (128, 128)


def test_shard_tensor_blocks_and_replication():
    from afd_compile.passes.shard import ShardedWeight, shard_tensor

    t = torch.arange(12).reshape(12, 1)
    # blocks q:8 (4 ranks), k:2 and v:2 (2 KV slices, each on 2 ranks)
    w = ShardedWeight("w", 0, 4, "attn", "column", (8, 2, 2), (1, 2, 2))
    got = [shard_tensor(t, w, r).flatten().tolist() for r in range(4)]
    assert got == [[0, 1, 8, 10], [2, 3, 8, 10], [4, 5, 9, 11], [6, 7, 9, 11]]
    row = ShardedWeight("w", 1, 2, "mlp", "row")
    assert shard_tensor(torch.arange(4).reshape(1, 4), row, 1).tolist() == [[2, 3]]


def test_scattered_mlp_on_a_parallel_residual_block_slices_what_attention_does_not_compute(exported):
    # GPT-J: h = x + attn(ln(x)) + mlp(ln(x)) with a SCATTERED MLP at attn_tp 2 (was refused). Per
    # layer o_proj is reduce-scattered into this rank's rows and the MLP's input ln(x), computed on
    # all the group's tokens, is sliced locally; layer 0's residual x too, layer 1's arrives as its
    # rows (only attention's path reads the gathered input); the last layer gathers once
    prog = _program(exported, "gptj", TPLayout(2, dense_dp=True), fuse_norm=False)
    afd = torch.ops.afd
    t = _targets(prog)
    assert t.count(afd.reduce_scatter_group_tokens.default) == 2 and t.count(afd.all_gather_group_tokens.default) == 2
    assert afd.all_reduce.default not in t
    local = [n for n in prog.program.graph.nodes if n.target == afd.scatter_group_tokens.default]
    readers = sorted(u.target.__name__ for n in local for u in n.users)
    assert readers == ["add.Tensor", "linear.default", "linear.default"]


def test_dense_dp_with_attn_tp_2_keeps_the_residual_scattered(exported):
    # tp=4 attn_dp=2 dense_dp: prepare_mlp reduce-scatters o_proj's partial sum into this rank's
    # share of its group's tokens, the MLP runs there with full weights, layer 1 gathers its
    # attention input, and the last layer adds the residual before its one gather
    prog = _program(exported, "llama2", TPLayout(4, 2, dense_dp=True), rank=1, fuse_norm=False)
    afd = torch.ops.afd
    t = _targets(prog)
    assert t.count(afd.reduce_scatter_group_tokens.default) == 2
    assert t.count(afd.scatter_group_tokens.default) == 1  # layer 0's residual: a local slice
    assert t.count(afd.all_gather_group_tokens.default) == 2  # layer 1's prepare_attn, the last postprocess
    assert afd.all_reduce.default not in t and afd.all_gather_tokens.default not in t
    nodes = {n.name: n for n in prog.program.graph.nodes}
    rs = [n for n in nodes.values() if n.target == afd.reduce_scatter_group_tokens.default]
    assert all(n.args[0].args[0].target == torch.ops.aten.linear.default for n in rs)  # right on o_proj
    last = nodes["sc_gather_out"]
    assert last.args[0].target == torch.ops.aten.add.Tensor  # h1 + mlp: added before communicating
    assert any(a.name.startswith("sc_mlp_out") for a in last.args[0].args)
    full = exported("llama2")[0].module()
    name = "model.model.layers.1.mlp.down_proj.weight"
    assert torch.equal(prog.program.get_parameter(name), full.get_parameter(name))
    q = prog.program.get_parameter("model.model.layers.0.self_attn.q_proj.weight")
    assert tuple(q.shape) == (32, 64)  # attention still sharded over the attention-TP group


def test_moe_a2a_splits_experts_and_reduce_scatters_into_the_moe(exported):
    # standard TP (attn_tp 2) with MoE all-to-all: o_proj's partial sum goes into the SCATTERED
    # MoE by a reduce-scatter (never an all-reduce); each rank owns half of the experts
    prog = _program(exported, "qwen3moe2", TPLayout(2, moe_a2a=True), rank=1, fuse_norm=False)
    afd = torch.ops.afd
    t = _targets(prog)
    assert t.count(afd.ep_dispatch.default) == 2 and t.count(afd.ep_combine.default) == 2
    assert t.count(afd.reduce_scatter_group_tokens.default) == 2
    assert afd.all_reduce.default not in t
    full = exported("qwen3moe2")[0].module()
    for name in ("model.model.layers.0.mlp.experts.gate_up_proj", "model.model.layers.0.mlp.experts.down_proj"):
        assert torch.equal(prog.program.get_parameter(name), full.get_parameter(name)[2:4])
    gate = "model.model.layers.0.mlp.gate.weight"
    assert torch.equal(prog.program.get_parameter(gate), full.get_parameter(gate))  # router replicated
    ops = [n for n in prog.program.graph.nodes if n.target == afd.moe_experts.default]
    assert len(ops) == 2 and all(n.args[0].args[0].target == afd.ep_dispatch.default for n in ops)
    assert all(n.args[3].meta["val"].shape[0] == 2 for n in ops)  # the op over this rank's 2 experts
    weights = [w for w in prog.shards.weights if w.kind == "expert"]
    assert {(w.dim, w.parts) for w in weights} == {(0, 2)} and len(weights) == 4
    # the routing weights of slots whose expert lives on another rank are zeroed after dispatch
    disp = next(n for n in prog.program.graph.nodes if n.target == afd.ep_dispatch.default)
    valid = next(u for u in disp.users if u.args[1] == 3)
    assert any(u.target == torch.ops.aten.to.dtype for u in valid.users)


def _static_batch_program(moe, scale_by_position: bool = False):
    """A hand-written decoder exported with a static batch of 2 (as a static KV cache fixes it),
    the sequence dynamic; ``scale_by_position``: its MLP scales each position by its index."""
    from handwritten import GQADecoder, SwiGLU

    class PositionScaled(SwiGLU):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (reads the sequence length alone)
            return super().forward(x) * torch.arange(x.shape[1], dtype=x.dtype)[:, None]

    model = GQADecoder(layers=1, moe=moe).eval()
    if scale_by_position:
        model.layers[0].mlp = PositionScaled(64, 128)
    ids = torch.randint(0, 128, (2, 5))
    ep = torch.export.export(model, (ids,), dynamic_shapes={"ids": {1: torch.export.Dim("s", min=2, max=16)}})
    return ep


def test_a_scattered_moe_over_a_static_batch_views_the_ranks_rows_as_one_sequence():
    # a static batch of 2 (a static KV cache): the MoE views its tokens back as [2, s, H], which a
    # rank's share (3 of 5 tokens, or 1 of a decode step's 2) cannot fill: such views take the rank's
    # rows as one sequence, [1, -1, H] (was refused); numerics: test_generate's decode steps
    ep = _static_batch_program("bmm")
    prog = tp_rank_program(ep.module(), TPLayout(2, moe_a2a=True), 1, fuse_norm=False)
    assert _targets(prog).count(torch.ops.afd.ep_dispatch.default) == 1
    views = [n for n in prog.program.graph.nodes if n.target in (torch.ops.aten.view.default,
                                                                  torch.ops.aten.reshape.default)
             and n.meta[ROLE_KEY].layer == 0 and n.meta[ROLE_KEY].role is Role.FFN]
    assert views and all(2 not in n.args[1][:-1] for n in views), [n.args[1] for n in views]
    assert any(list(n.args[1]) == [1, -1, 64] for n in views), [n.args[1] for n in views]


def test_a_scattered_mlp_reading_a_size_a_share_cannot_have_is_refused_naming_it():
    ep = _static_batch_program(False, scale_by_position=True)
    with pytest.raises(TPRewriteError, match=r"layer 0: the MLP reads sym_size_int\S* \(s\d*\), a size made from the "
                                             r"token dims \[2, s\d*\] that is not a multiple of their product"):
        tp_rank_program(ep.module(), TPLayout(2, dense_dp=True), 0, fuse_norm=False)


def test_a_hybrid_layer_under_tp_is_refused_naming_its_mixer(exported):
    # Jamba's layer 0 mixes tokens by a Mamba scan: no heads to split (AFD runs it whole: test_numerics)
    with pytest.raises(ShardError, match=r"layer 0: its token mixer is not attention .* AFD without --attn-tp runs it "
                                         r"whole on the attention ranks"):
        _program(exported, "jamba", TPLayout(2))


def test_a_linear_attention_mixer_is_split_by_heads(exported):
    # Qwen3.5's gated delta-net: its projections found by structure (in_proj_qkv / z / b / a columns, out_proj
    # the row), the depthwise convolution over q | k | v takes this rank's channels (groups 128 -> 64: q, k and
    # v heads halved) and the recurrent state starts as zeros of this rank's 2 value heads
    prog = _program(exported, "qwen3_5", TPLayout(2), fuse_norm=False)
    cols = {w.target.split(".layers.0.linear_attn.")[1].split(".")[0] for w in prog.shards.weights
            if ".layers.0.linear_attn." in w.target}
    # (A_log, read through -exp(), is a computed tensor by then: read in slices where it meets the heads)
    assert cols == {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "conv1d", "dt_bias"}
    assert prog.shards.operands, prog.shards
    convs = [n for n in prog.program.graph.nodes if n.target == torch.ops.aten.conv1d.default]
    assert [n.args[6] for n in convs] == [64]
    zeros = [n for n in prog.program.graph.nodes if n.target == torch.ops.aten.zeros.default
             and n.meta[ROLE_KEY].layer == 0 and len(n.args[0]) == 4]
    assert zeros and all(n.args[0][1] == 2 for n in zeros), [n.args for n in zeros]


def test_a_mixer_whose_output_projection_reads_no_projection_is_refused():
    # a running mean over the sequence then out_proj: no projection before it to split by heads (a row-parallel
    # out_proj would read the whole, unsplit, hidden state)
    from handwritten import GQADecoder, export

    class RunningMean(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.o_proj = torch.nn.Linear(64, 64, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[:, None]
            return self.o_proj(x.cumsum(1) / steps)

    model = GQADecoder(layers=1).eval()
    model.layers[0].attn = RunningMean()
    with pytest.raises(ShardError, match=r"layer 0: its token mixer is not attention .* and no projection before its "
                                         r"output projection linear\S*; AFD without --attn-tp runs it whole"):
        tp_rank_program(export(model).module(), TPLayout(2), 0)


def test_a_linear_attention_mixer_no_rule_splits_is_refused_naming_the_op(exported):
    # Qwen3-Next joins q, k and v of the split heads along the heads' dim before its convolution (a column
    # of blocks, each rank its slice of each); its 2 key heads over 4 ranks would be replicated inside
    # that join (not supported yet): refused naming the join
    with pytest.raises(ShardError, match=r"layer 0: its token mixer is not attention .* keeps them apart: .*cat\S* "
                                         r"\(aten.cat.default\) joins along the split dim 2 pieces not all split "
                                         r"there over every rank .* AFD without --attn-tp"):
        _program(exported, "qwen3_next", TPLayout(4))


def test_a_layer_with_no_token_mixer_under_tp_is_refused_naming_it(exported):
    # Nemotron-H's blocks [attention MoE] [MLP] ...: layer 1 is an MLP block alone (a norm, the MLP, an add)
    with pytest.raises(ShardError, match=r"layer 1 has no token mixer \(an MLP or MoE block right after another, "
                                         r"each a layer of its own\).* AFD without --attn-tp runs it"):
        _program(exported, "nemotron_h", TPLayout(2))


def test_residual_streams_under_dp_attention_are_refused_naming_the_sum(exported):
    # HY-V4 keeps four residual streams [b, s, 4, H] (hyper-connections): DP attention would gather a
    # rank's tokens as rows of one stream (it failed at run time: 4x the rows)
    for layout in (TPLayout(4, 2), TPLayout(2, dense_dp=True)):
        with pytest.raises(TPRewriteError, match=r"layer 0: the residual sum after attention \S+ \[\S+, \S+, 4, 64\] "
                                                 r"holds more than one hidden state a token"):
            _program(exported, "hy_v4", layout)


def test_a_token_tensor_mixed_in_after_a_scattered_mlp_is_refused_naming_it(exported):
    # Gemma-4's per-layer input ([b, s, 16], from the embedding) is mixed into the residual after the MLP: a
    # SCATTERED layer runs there on a rank's share of the tokens (it failed at run time: rows 2 vs 5)
    with pytest.raises(TPRewriteError, match=r"layer 0: \S+ reads \S+ \[\S+, \S+, 16\], a tensor over every token "
                                             r"that does not come from the layer's residual stream"):
        _program(exported, "gemma4", TPLayout(2, dense_dp=True))


def test_expert_parallel_needs_experts_that_divide(exported):
    with pytest.raises(ShardError, match="layer 0: .*4 experts do not divide over 8"):
        _program(exported, "qwen3moe2", TPLayout(8, 8, moe_a2a=True))


def test_dense_dp_with_attn_tp_1_runs_dense_mlps_locally(exported):
    # MoE, dense, MoE: the MoE layers gather (FULL, experts sharded); the dense layer stays on this
    # rank's tokens with its full weights (SCATTERED, no collective)
    prog = _program(exported, "qwen3moe3_mixed", TPLayout(2, 2, dense_dp=True))
    t = _targets(prog)
    assert t.count(torch.ops.afd.all_gather_tokens.default) == 2
    assert t.count(torch.ops.afd.reduce_scatter_tokens.default) == 2
    full = exported("qwen3moe3_mixed")[0].module()
    name = "model.model.layers.1.mlp.down_proj.weight"
    assert torch.equal(prog.program.get_parameter(name), full.get_parameter(name))
    (res,) = run_tp_cases([TPCase(exported("qwen3moe3_mixed")[1], TPLayout(2, 2, dense_dp=True), (3, 0))])
    assert max(v["max_rel_err"] for v in res.values()) <= 1e-5


def _targets(prog):
    return [n.target for n in prog.program.graph.nodes if n.op == "call_function"]


def test_attn_tp_1_runs_the_norm_before_the_all_gather(exported):
    prog = _program(exported, "llama2", TPLayout(2, 2))
    afd = torch.ops.afd
    t = _targets(prog)
    assert t.count(afd.all_gather_tokens.default) == 2 and t.count(afd.reduce_scatter_tokens.default) == 2
    assert afd.all_reduce.default not in t and afd.gather_partial_tokens.default not in t
    gather = next(n for n in prog.program.graph.nodes if n.target == afd.all_gather_tokens.default)
    # the gathered tensor is the post-attention norm's output (times its weight): the norm ran first
    norm_out = gather.args[0].args[0]
    assert norm_out.target == torch.ops.aten.mul.Tensor and "post_attention_layernorm" in str(norm_out.args[0].target)
    assert not any(isinstance(a, torch.fx.Node) and a.op == "get_attr" and "q_proj" in str(a.target)
                   and tuple(prog.program.get_parameter(a.target).shape) != (64, 64) for a in prog.program.graph.nodes)


def test_dp_attention_with_attn_tp_2_gathers_partial_sums_once(exported):
    prog = _program(exported, "llama2_mha", TPLayout(4, 2), rank=1)
    afd = torch.ops.afd
    t = _targets(prog)
    assert t.count(afd.gather_partial_tokens.default) == 2  # settles o_proj's sum and gathers: one collective
    assert t.count(afd.scatter_tokens.default) == 2  # the middle residual: a local slice
    assert t.count(afd.reduce_scatter_tokens.default) == 2
    assert afd.all_reduce.default not in t
    # the residual is added on attention-TP rank 0 only: rank 1 scales it by 0
    scale = next(n for n in prog.program.graph.nodes if n.name.startswith("dp_residual_once"))
    assert scale.args[1] == 0.0
    # the post-attention norm now reads the gathered tensor
    gather = next(n for n in prog.program.graph.nodes if n.target == afd.gather_partial_tokens.default)
    assert any(u.target == torch.ops.aten.to.dtype for u in gather.users)


A2A, DDP, VP = {"moe_a2a": True}, {"dense_dp": True}, {"vocab_parallel": True}

NUMERICS = [  # (model, tp, attn_dp, batch per DP group[, layout flags])
    ("llama3", 2, 1, (3,)),
    ("qwen3moe2", 2, 1, (3,)),           # experts sharded (fused gate_up blocks)
    ("phi3", 4, 2, (3, 1)),              # fused qkv (KV replicated) and gate_up, DP attention
    ("llama2_mha", 4, 2, (2, 5), VP),    # attn_tp == 2: partial gather, uneven groups; head split over 2
    ("qwen3moe3_mixed", 4, 2, (2, 5)),   # MoE under DP attention: expert buffers sized from all groups' tokens
    ("gemma2", 4, 1, (2,), VP),          # explicit softmax attention (soft-capped), KV replicated; tied head split
    ("gemma2", 4, 2, (3, 0)),            # norm after o_proj under DP attention; a group with zero tokens
    ("gptj", 4, 2, (3, 0)),              # parallel residual under DP attention with attn_tp == 2
    ("gptj", 4, 2, (3, 1), DDP),         # parallel residual, SCATTERED MLP in attention-TP groups of 2
    ("gpt2", 4, 2, (2, 3)),              # Conv1D (addmm, weight [in, out]), fused c_attn split; DP attention
    ("olmo2", 4, 1, (2,)),               # q/k norm over all heads: all-reduced mean; k norm over replicated KV
    ("qwen3moe3_mixed", 4, 2, (2, 5), A2A),  # MoE a2a + a dense FULL layer between, uneven groups
    ("qwen3moe2", 4, 4, (2, 0, 3, 1), A2A),  # attn_tp == 1: a2a only; a group with zero tokens
    ("llama3", 4, 2, (3, 0), DDP),       # SCATTERED residual in attention-TP groups; zero-token group
    ("nemotron", 2, 1, (2,)),            # relu^2 MLP (square), LayerNorm1P
    ("falcon", 4, 2, (2, 1)),            # qkv packed per KV group, 2 groups over 4 ranks: unpacked, K/V replicated
    ("deepseek_v3", 2, 1, (2,)),         # MLA; a dense layer, then MoE with group-limited routing
    ("gpt_bigcode", 4, 1, (2,)),         # multi-query: K/V replicated whole
    ("llama2_v127", 2, 1, (2,), VP),     # vocab-parallel head: vocab 127 over 2 ranks, slices zero-padded
    ("bloom", 4, 2, (2, 3)),             # heads folded into the batch for baddbmm, its ALiBi bias read per rank
    ("gpt_oss", 2, 1, (2,)),             # attention sinks, interleaved gate_up, expert biases added once
    ("nemotron_h_tp", 4, 2, (2, 3)),     # mixers as blocks: a Mamba beside a layer's attention, replicated
    ("granite_swa", 4, 1, (2,)),         # sinks as sigmoid(logsumexp(scores) - sink): per head, sliced
    ("deepseek_v32", 4, 2, (2, 1)),      # MLA + a sparse-attention indexer (the mask's projections replicated)
    ("hy_v4", 2, 1, (2,)),               # eager attention + indexer (the mask added to the scores), 4 streams
    ("gemma4_moe", 2, 1, (3,)),          # MLP and MoE normalised apart before their sum: each settled apart
    ("gemma4", 4, 2, (2, 3)),            # per-layer inputs after the MLP: replicated, not an output projection
    ("qwen3_5", 4, 1, (2,)),             # delta-net split by heads: its 2 key heads replicated, convolution groups
    ("qwen3_next", 4, 2, (2, 3)),        # q | k | v of the split heads joined before the convolution; MoE
]


# more layouts of families the default list already covers (pytest -m slow)
NUMERICS_SLOW = [
    ("llama2_mha", 4, 1, (2,)),
    ("qwen3moe3_mixed", 4, 1, (2,)),     # MoE, dense, MoE layers; KV replicated
    ("llama3", 2, 2, (3, 1)),            # attn_tp == 1: norm before all-gather
    ("llama2_mha", 4, 4, (2, 0, 3, 1)),  # one group with zero tokens
    ("qwen3moe2", 2, 1, (3,), A2A),      # experts over 2 ranks, all-to-all; reduce-scatter into the MoE
    ("llama2", 4, 1, (2,)),              # KV heads (2) replicated over 4 ranks
    ("gptj", 2, 2, (3, 1)),              # parallel residual, stack/flatten rotary; attn_tp == 1
    ("qwen3moe2", 2, 2, (3, 0)),         # attn_tp == 1, a group with zero tokens
    ("llama2_mha", 2, 1, (1,)),
    ("llama2_mha", 4, 2, (0, 2)),
    ("gptj", 4, 1, (2,)),
    ("falcon", 2, 1, (3,)),
    ("falcon", 2, 2, (2, 1)),            # parallel attention; attn_tp == 1
    ("falcon", 2, 1, (3,), DDP),         # parallel attention, SCATTERED MLP (its own norm) at attn_tp == 2
    ("deepseek_v3", 4, 2, (1, 2)),
    ("gemma2", 4, 2, (1, 2), DDP),       # norm after o_proj on the SCATTERED rows
    ("gpt_oss", 4, 2, (2, 3)),
    ("phimoe", 2, 1, (2,)),              # sparsemixer: the router selects by max (the roles test covers it)
    ("mpt", 4, 2, (2, 3)),               # ALiBi bias over all heads: each attention-TP rank reads its slice
    ("bitnet", 4, 2, (2, 1)),            # norms over all heads before o_proj and over the intermediate size
    ("qwen3_5", 4, 2, (2, 3)),           # delta-net split by heads in attention-TP groups under DP attention
    ("qwen3_5", 2, 1, (3,), DDP),        # ... and beside a SCATTERED MLP
]


@pytest.mark.slow
def test_tp_matches_single_process_model_more_layouts(exported):
    cases = [TPCase(exported(m)[1], TPLayout(tp, dp, **(f[0] if f else {})), b) for m, tp, dp, b, *f in NUMERICS_SLOW]
    for (m, tp, dp, *_), res in zip(NUMERICS_SLOW, run_tp_cases(cases), strict=True):
        assert max(v["max_rel_err"] for v in res.values()) <= 1e-5, f"{m} tp{tp} dp{dp}"


@pytest.fixture(scope="module")
def tp_results(exported):
    return run_tp_cases([TPCase(exported(m)[1], TPLayout(tp, dp, **(f[0] if f else {})), b)
                         for m, tp, dp, b, *f in NUMERICS])


@pytest.mark.parametrize("index", range(len(NUMERICS)),
                         ids=[f"{m}-tp{tp}-dp{dp}-{'_'.join(map(str, b))}{''.join('-' + k for k in (f or [()])[0])}"
                              for m, tp, dp, b, *f in NUMERICS])
def test_tp_matches_single_process_model(tp_results, index):
    _, tp, dp, batches, *_ = NUMERICS[index]
    res = tp_results[index]
    assert sorted(res) == list(range(tp))
    for r, v in res.items():
        assert v["max_rel_err"] <= 1e-5, f"rank {r}: {v['max_rel_err']}"
    if dp > 1:  # every group ran both steps with the sizes rotating (zero-token groups included)
        lay = TPLayout(tp, dp)
        assert res[0]["batches"] == [batches[0], batches[1 % dp]]
        assert {tuple(res[r]["batches"]) for r in lay.attn_tp_group(0)} == {tuple(res[0]["batches"])}


def test_multi_query_kv_is_replicated_whole_and_repeated_to_the_local_heads(exported):
    # GPT-BigCode: c_attn [q 64 | k 16 | v 16], one K/V head with no head dim. Cutting its 16
    # features would split head_dim (the run gave NaN once); instead K and V are replicated whole
    # and repeat_kv's expand / reshape repeat them to this rank's 2 query heads
    prog = _program(exported, "gpt_bigcode", TPLayout(2), rank=1, fuse_norm=False)
    c_attn = next(w for w in prog.shards.weights if w.target.endswith("h.0.attn.c_attn.weight"))
    assert (c_attn.blocks, c_attn.replicate) == ((64, 16, 16), (1, 2, 2))
    full = exported("gpt_bigcode")[0].module().get_parameter(c_attn.target)
    mine = prog.program.get_parameter(c_attn.target)
    assert torch.equal(mine, torch.cat([full[32:64], full[64:96]]))  # q heads 2-3, all of k and v
    split = next(n for n in prog.program.graph.nodes if n.target == torch.ops.aten.split_with_sizes.default)
    assert split.args[1] == [32, 16, 16]
    heads = [(f.old, f.new) for f in prog.shards.arg_fixes if f.old == 4]
    assert heads == [(4, 2)] * 4  # K and V: an expand and a reshape each


def test_alibi_bias_is_read_in_slices_also_over_heads_folded_into_the_batch(exported):
    # MPT: scores = q @ k^T * scale + alibi [heads, 1, keys], the bias computed once for all heads:
    # every rank computes it whole and each layer's add reads this rank's heads of it
    prog = _program(exported, "mpt", TPLayout(2), rank=1, fuse_norm=False)
    assert [(o.dim, o.size, o.local(1)) for o in prog.shards.operands] == [(0, 4, (2, 2))] * 2
    narrows = [n for n in prog.program.graph.nodes if n.target == torch.ops.aten.narrow.default]
    assert [n.args[1:] for n in narrows] == [(0, 2, 2)] * 2
    assert all(u.target == torch.ops.aten.add.Tensor for n in narrows for u in n.users)
    # BLOOM folds the heads into the batch ([batch * heads, seq, head_dim]) for baddbmm: each rank
    # folds its own heads (the symbolic batch * 4 divided by a node inserted), and reads its heads
    # of every batch entry of the ALiBi bias [batch * heads, 1, keys] (unflatten, narrow, flatten)
    prog = _program(exported, "bloom", TPLayout(2), rank=1, fuse_norm=False)
    assert [(o.dim, o.size, o.fold, o.local(1)) for o in prog.shards.operands] == [(0, 4, True, (2, 2))] * 2
    nodes = list(prog.program.graph.nodes)
    narrows = [n for n in nodes if n.target == torch.ops.aten.narrow.default]
    assert [n.args[1:] for n in narrows] == [(1, 2, 2)] * 2
    assert all(n.args[0].target == torch.ops.aten.unflatten.int and n.args[0].args[1:] == (0, [-1, 4]) and
               [u.target for u in n.users] == [torch.ops.aten.flatten.using_ints] for n in narrows)
    halved = [n for n in nodes if n.target == operator.floordiv and n.args[1] == 2]
    assert halved and all(u.target in (torch.ops.aten.reshape.default, torch.ops.aten.view.default)
                          for n in halved for u in n.users)


def test_gpt_oss_sinks_interleaved_gate_up_and_expert_biases(exported):
    # GPT-OSS: sinks [heads] reshaped and expanded, then cat to the scores along the keys: each
    # rank reads its heads' sinks; the interleaved gate_up ([..., ::2] gate, [..., 1::2] up) is
    # de-interleaved by the MoE recognition into [gate | up] halves, sliced alike; down_proj_bias
    # is added per (token, expert) to partial sums: kept on rank 0, zeros on rank 1
    prog = _program(exported, "gpt_oss", TPLayout(2), rank=1, fuse_norm=False)
    sinks = [o for o in prog.shards.operands if o.dim == 1 and o.size == 4]
    assert len(sinks) == 2 and all(o.local(1) == (2, 2) for o in sinks)
    by_target = {w.target: w for w in prog.shards.weights}
    for layer in (0, 1):
        gate_up, down = by_target[f"afd_moe{layer}_w_gate_up"], by_target[f"afd_moe{layer}_w_down"]
        assert (gate_up.kind, gate_up.dim, gate_up.blocks) == ("column", 1, (64, 64))
        assert (down.kind, down.dim) == ("row", 2)
        assert by_target[f"model.model.layers.{layer}.mlp.experts.down_proj_bias"].kind == "row_bias"
    bias = "model.model.layers.0.mlp.experts.down_proj_bias"
    ranks = []
    for rank in (0, 1):  # (HF initialises the bias to zeros: give it values to tell the ranks apart)
        gm = exported("gpt_oss")[0].module()
        old = gm.get_parameter(bias)  # (a new parameter: the fixture's program shares this one's storage)
        owner, name = bias.rsplit(".", 1)
        gm.get_submodule(owner).register_parameter(name, torch.nn.Parameter(
            torch.arange(1.0, 1 + old.numel()).view_as(old), requires_grad=False))
        ranks.append(tp_rank_program(gm, TPLayout(2), rank, graph_name="gpt_oss", fuse_norm=False))
    full = torch.arange(1.0, 1 + ranks[0].program.get_parameter(bias).numel())
    assert torch.equal(ranks[0].program.get_parameter(bias).flatten(), full)
    assert not ranks[1].program.get_parameter(bias).any()


def test_falcon_qkv_packed_per_kv_group_is_unpacked_into_blocks(exported):
    # [kv groups, q per group + 2, head_dim]: the tp pipeline unpacks the fused weight into [all q |
    # all k | all v] blocks (passes/grouped_qkv.py), so each rank holds its query heads and the K/V
    # of their group: at TP 2 (2 groups) rank 1 holds group 1 whole, the original rows 64..127 in
    # their order; the K/V broadcast to the q heads of each group has its group count divided
    # (where that broadcast sits depends on the transformers version: each is compared with the
    # same node of the unsharded program)
    prog = _program(exported, "falcon", TPLayout(2), rank=1, fuse_norm=False)
    qkv = next(w for w in prog.shards.weights if w.target.endswith("h_0_self_attention_query_key_value_weight"))
    assert qkv.target.startswith("afd_unpacked_")
    assert (qkv.dim, qkv.kind, qkv.blocks, qkv.replicate) == (0, "column", (64, 32, 32), ())
    unsharded = exported("falcon")[0].module()
    full = unsharded.get_parameter("model.transformer.h.0.self_attention.query_key_value.weight")
    assert torch.equal(prog.program.get_parameter(qkv.target), full[64:])
    before = {n.name: n for n in unsharded.graph.nodes}
    b = [n for n in prog.program.graph.nodes
         if n.target in (torch.ops.aten.broadcast_to.default, torch.ops.aten.expand.default) and len(n.args[1]) == 5]
    changed = [[(old, new) for old, new in zip(before[n.name].args[1], n.args[1], strict=True)
                if isinstance(old, int) and old != new] for n in b]  # (sizes read off the input: other graphs' nodes)
    assert len(b) == 4 and changed == [[(2, 1)]] * 4, changed
    # 2 KV groups over 4 ranks: each rank one query head, its group's K/V replicated on 2 ranks
    prog = _program(exported, "falcon", TPLayout(4), rank=3, fuse_norm=False)
    qkv = next(w for w in prog.shards.weights if w.target.endswith("h_0_self_attention_query_key_value_weight"))
    assert (qkv.blocks, qkv.replicate) == ((64, 32, 32), (1, 2, 2))
    assert torch.equal(prog.program.get_parameter(qkv.target), torch.cat([full[80:96], full[96:128]]))


def test_mla_shards_the_up_projections_and_keeps_the_low_rank_ones(exported):
    # DeepSeek-V3: q = q_b(norm(q_a(x))), kv = kv_b(norm(kv_a(x)[:16])); the rotary key part
    # kv_a(x)[16:] is shared by every head (expand to 4 heads -> 2 per rank). q_b / kv_b are
    # column-parallel, the low-rank q_a / kv_a stay whole
    prog = _program(exported, "deepseek_v3", TPLayout(2), rank=0, fuse_norm=False)
    kinds = {w.target.rsplit("self_attn.", 1)[-1]: w.kind for w in prog.shards.weights
             if ".layers.0.self_attn." in w.target}
    assert kinds == {"q_b_proj.weight": "column", "kv_b_proj.weight": "column", "o_proj.weight": "row"}
    nodes = {n.name: n for n in prog.program.graph.nodes}
    fixed = {f.node: (f.old, f.new) for f in prog.shards.arg_fixes}
    empties = [n for n in nodes.values() if n.target == torch.ops.aten.new_empty.default]
    assert empties and all(fixed[n.name] == (4, 2) for n in empties)  # the key buffer: 2 heads here
    expands = [n for n in nodes.values() if n.target == torch.ops.aten.expand.default and n.name in fixed]
    assert expands and all(fixed[n.name] == (4, 2) for n in expands)  # the shared rotary part
    # its MoE (routing weights gathered by expert id after a group-limited top-k) is recognised: the
    # routing weights are complete before the op, so all-to-all dispatches them with the tokens
    ep = _targets(_program(exported, "deepseek_v3", TPLayout(2, moe_a2a=True)))
    assert ep.count(torch.ops.afd.ep_dispatch.default) == 1 and ep.count(torch.ops.afd.moe_experts.default) == 1


def test_the_allreduce_add_rmsnorm_unit_fuses_in_bf16_and_computes_the_same():
    # a bf16 model's RMSNorm casts back to bf16 before its scale (every GPU run): the unit fuses
    # with that dtype, keeps the residual stream in bf16, and computes what the unfused program
    # does (one rank of a real gloo group: the all-reduce sums one partial)
    import torch.distributed as dist

    from afd_compile.comm import GROUP_ATTN_TP, GROUP_TP, register_group
    from afd_compile.models import build_hf, export_lm

    model = build_hf("llama", num_layers=2).to(torch.bfloat16)
    ep = export_lm(model)
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    progs = {}
    for fuse in (True, False):
        gm = ep.module()
        annotate_roles(gm)
        # (the head whole: one rank of a group of one cannot gather a vocabulary split in two)
        progs[fuse] = tp_rank_program(
            gm, TPLayout(2, vocab_parallel=False), 0, graph_name="bf16", fuse_norm=fuse
        ).program
    fused = [n for n in progs[True].graph.nodes if n.target == torch.ops.afd.all_reduce_add_rms_norm.default]
    assert len(fused) == 4 and all(n.args[5] == torch.bfloat16 for n in fused)
    # what Inductor gets: each unit lowered back to the all-reduce and the ops Inductor fuses
    import copy

    from afd_compile.passes.fuse_norm import lower_for_inductor

    progs["lowered"] = copy.deepcopy(progs[True])
    assert lower_for_inductor(progs["lowered"]) == 4
    targets = [n.target for n in progs["lowered"].graph.nodes]
    assert torch.ops.afd.all_reduce_add_rms_norm.default not in targets
    assert targets.count(torch.ops.afd.all_reduce.default) == 4 and targets.count(torch.ops.aten.rsqrt.default) == 5
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        register_group(GROUP_TP, group)
        register_group(GROUP_ATTN_TP, group)
        with torch.no_grad():
            out = {fuse: p(ids) for fuse, p in progs.items()}
    finally:
        dist.destroy_process_group()
    a, b, c = (o[0] if isinstance(o, (tuple, list)) else o for o in (out[True], out[False], out["lowered"]))
    assert a.dtype == torch.bfloat16 and torch.equal(a, b) and torch.equal(a, c)


def _head(prog):
    (gather,) = [n for n in prog.program.graph.nodes if n.target == torch.ops.afd.all_gather_last.default]
    return gather.args[0], gather


def test_lm_head_is_split_by_vocabulary_and_its_logits_gathered(exported):
    from afd_compile.comm import GROUP_ATTN_TP
    from afd_compile.scatter import DistState, ScatterMode

    prog = _program(exported, "llama2", TPLayout(4, 2, vocab_parallel=True), rank=3)  # attention TP groups of 2
    head, gather = _head(prog)
    assert gather.args[1:] == (GROUP_ATTN_TP, 128) and list(head.users) == [gather]
    weights = dict(prog.program.named_parameters())
    full = exported("llama2")[0].state_dict["model.lm_head.weight"]
    assert torch.equal(weights["model.lm_head.weight"], full[64:])  # attention TP rank 1 of 2: rows 64..127
    assert tuple(head.meta["val"].shape)[-1] == 64 and tuple(gather.meta["val"].shape)[-1] == 128
    assert str(prog.plan.head) == (
        "lm head linear_14: model.lm_head.weight split by vocabulary over the attention "
        "TP group (2 x 64 rows); all_gather(last) TP_ATTN_FULL+S[2] -> TP_ATTN_FULL[2]"
    )
    assert (head.meta["afd.dist"], gather.meta["afd.dist"]) == (
        DistState(ScatterMode.TP_ATTN_FULL, split_last=True),
        DistState(ScatterMode.TP_ATTN_FULL),
    )


def test_a_tied_head_gets_its_own_slice_and_the_embedding_stays_whole(exported):
    prog = _program(exported, "gemma2", TPLayout(2, vocab_parallel=True), rank=1)
    head, _ = _head(prog)
    weights = dict(prog.program.named_parameters())
    full = exported("gemma2")[0].state_dict["model.model.embed_tokens.weight"]
    assert torch.equal(weights["model.model.embed_tokens.weight"], full)
    assert torch.equal(weights["afd_vocab_head_weight"], full[64:])
    assert head.args[1].target == "afd_vocab_head_weight" and prog.plan.head.tied


def test_a_vocabulary_the_group_does_not_divide_is_zero_padded(exported):
    prog = _program(exported, "llama2_v127", TPLayout(2, vocab_parallel=True), rank=1)
    _, gather = _head(prog)
    w = dict(prog.program.named_parameters())["model.lm_head.weight"]
    full = exported("llama2_v127")[0].state_dict["model.lm_head.weight"]
    assert tuple(w.shape) == (64, 64) and torch.equal(w[:63], full[64:]) and not w[63].any()
    assert gather.args[2] == 127 and "zero-padded from 127" in str(prog.plan.head)


def test_the_head_stays_whole_by_default_and_the_plan_says_why(exported):
    prog = _program(exported, "llama2", TPLayout(2))
    assert not [n for n in prog.program.graph.nodes if n.target == torch.ops.afd.all_gather_last.default]
    assert tuple(dict(prog.program.named_parameters())["model.lm_head.weight"].shape) == (128, 64)
    assert str(prog.plan.head).endswith("whole on every rank (vocab_parallel off)")
    one = _program(exported, "llama2", TPLayout(2, 2, vocab_parallel=True)).plan.head
    assert "whole on every rank (a group of one rank)" in str(one)


def test_a_head_the_sharding_cannot_read_is_refused_only_when_the_split_is_asked_for(exported):
    # the last projection is the head; when its form cannot be split (here its weight reaches it
    # through a multiply), no earlier projection is taken for it: vocab_parallel is refused by name
    from afd_compile.passes.dist_states import plan_tp
    from afd_compile.passes.vocab_head import find_head

    gm = exported("llama2")[0].module()
    annotate_roles(gm)
    head = find_head(gm)
    with gm.graph.inserting_before(head):
        scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (head.args[1], 1.0))
    scaled.meta["afd.role"] = head.meta["afd.role"]
    head.replace_input_with(head.args[1], scaled)
    assert find_head(gm) is head
    assert plan_tp(gm, TPLayout(2)).head is None
    with pytest.raises(ShardError, match=f"vocab_parallel: the LM head {head.name} cannot be split"):
        plan_tp(gm, TPLayout(2, vocab_parallel=True))


def test_means_over_split_dims_are_all_reduced_in_attention_and_mlp(exported):
    # BitNet: an RMSNorm over all heads before o_proj and one over the MLP's intermediate size
    # before down_proj: each rank's mean of its slice, all-reduced over its group and divided by
    # the group size (the numerics of this model run with pytest -m slow)
    prog = _program(exported, "bitnet", TPLayout(2), fuse_norm=False)
    groups = sorted({(g, p) for _, g, _, p in prog.shards.split_means})
    assert groups == [("attn", 2), ("mlp", 2)]
    assert {layer for _, _, layer, _ in prog.shards.split_means} == {0, 1}


def test_expert_parallelism_of_one_moe_block_shared_by_two_layers_is_refused():
    # ALBERT-style sharing of an MoE block: TP of the whole MoE slices each weight once (one
    # slice per weight); expert parallelism would slice the experts again for the second layer:
    # refused at the first, in the TP rewrite and in AFD FFN expert-parallel groups
    from afd_compile.layout import AFDLayout
    from afd_compile.models import build_hf, export_lm
    from afd_compile.passes.ffn_tp import FFNTPError, expert_parallel_ffn
    from afd_compile.split_api import split

    model = build_hf("qwen3_moe", 2)
    layers = model.model.model.layers
    layers[1] = layers[0]
    layers[1].self_attn.layer_idx = 0
    ep = export_lm(model)
    gm = ep.module()
    assert tp_rank_program(gm, TPLayout(2), 1).shards.weights  # the whole MoE over TP: sliced once
    message = (
        r"layer 0: its experts' weights .* are read by layer\(s\) \[1\] too \(one MoE block applied as several "
        r"layers\): expert parallelism of a shared MoE block is not supported"
    )
    with pytest.raises(ShardError, match=message):
        tp_rank_program(gm, TPLayout(2, moe_a2a=True), 0)
    with pytest.raises(FFNTPError, match=message):
        expert_parallel_ffn(split(ep.module(), layout=AFDLayout(2, 2, ffn_ep=2)).ffn, 2, 0)


def test_a_layer_of_two_attention_maps_is_refused_naming_both():
    # DiffLlama's differential attention: two attention ops combined in one layer. Heads cannot be
    # split by one attention op's rule: refused naming both, with what still runs (AFD keeps it whole)
    import torch.nn.functional as F
    from handwritten import GQADecoder

    class TwoMaps(torch.nn.Module):
        def __init__(self, attn: torch.nn.Module) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = attn.q, attn.k, attn.v, attn.o

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            q, k, v = (p(x).view(b, s, -1, 16).transpose(1, 2) for p in (self.q, self.k, self.v))
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            d = F.scaled_dot_product_attention(q * 0.5, k, v, is_causal=True)
            return self.o((a - 0.3 * d).transpose(1, 2).reshape(b, s, -1))

    model = GQADecoder(layers=1).eval()
    model.layers[0].attn = TwoMaps(model.layers[0].attn)
    ids = torch.randint(0, 128, (2, 5))
    gm = torch.export.export(model, (ids,), dynamic_shapes={"ids": {0: torch.export.Dim("b", min=1, max=64)}}).module()
    with pytest.raises(ShardError, match=r"layer 0: splitting heads over ranks needs one attention op a layer, found 2 "
                                         r"\['scaled_dot_product_attention', 'scaled_dot_product_attention_1'\].*"
                                         "AFD without --attn-tp keeps the attention whole"):
        tp_rank_program(gm, TPLayout(2), 0, graph_name="two_maps")
