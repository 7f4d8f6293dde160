"""Tensor-parallel sharding (standard TP): structure of the per-rank program and numerics on
real gloo processes against the single-process model."""

from __future__ import annotations

import pytest
import torch

from afd_compile.passes.roles import annotate_roles
from afd_compile.passes.shard import ShardError
from afd_compile.passes.tp_rewrite import TPRewriteError, shard_for_rank
from afd_compile.scatter import TPLayout
from afd_compile.verify import TPCase, run_tp_cases


def _program(exported, name, layout, rank=0):
    gm = exported(name)[0].module()
    annotate_roles(gm)
    return shard_for_rank(gm, layout, rank, graph_name=name)


def test_standard_tp_inserts_two_all_reduces_per_layer(exported):
    prog = _program(exported, "llama2", TPLayout(2))
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
    fixes = {(f.old, f.old // f.parts) for f in prog.shards.arg_fixes}
    assert fixes == {(2, 1), (4, 2)}


def test_ranks_get_different_slices(exported):
    p0 = dict(_program(exported, "llama2", TPLayout(2), 0).program.named_parameters())
    p1 = dict(_program(exported, "llama2", TPLayout(2), 1).program.named_parameters())
    full = dict(exported("llama2")[0].module().named_parameters())
    name = "model.model.layers.1.mlp.gate_proj.weight"
    assert torch.equal(torch.cat([p0[name], p1[name]]), full[name])


def test_head_count_that_does_not_divide_names_the_weights(exported):
    with pytest.raises(ShardError, match=r"layer 0 \(.*k_proj.weight.*size 2, which 4 ranks cannot divide"):
        _program(exported, "llama2", TPLayout(4))


def test_unsupported_parts_are_refused_clearly(exported):
    with pytest.raises(ShardError, match="tensor-parallel MoE experts are not supported yet"):
        _program(exported, "qwen3moe2", TPLayout(2))
    with pytest.raises(TPRewriteError, match="all_gather .* is planned, but this version inserts only"):
        _program(exported, "llama2", TPLayout(2, 2))


@pytest.fixture(scope="module")
def tp_results(exported):
    cases = [TPCase(exported("llama3")[1], TPLayout(2), batch=3),
             TPCase(exported("llama2_mha")[1], TPLayout(4), batch=2),
             TPCase(exported("llama2_mha")[1], TPLayout(2), batch=1)]
    return run_tp_cases(cases)


@pytest.mark.parametrize(("index", "tp"), [(0, 2), (1, 4), (2, 2)])
def test_tp_matches_single_process_model(tp_results, index, tp):
    res = tp_results[index]
    assert sorted(res) == list(range(tp))
    for r, v in res.items():
        assert v["max_rel_err"] <= 1e-5, f"rank {r}: {v['max_rel_err']}"
