"""Scatter-mode plans on real graphs: golden plan tables and per-node DistStates."""

from __future__ import annotations

import json

import pytest

from afd_compile.passes.dist_states import META_KEY, annotate_dist_states, layer_kinds, plan_tp
from afd_compile.passes.roles import Role, annotate_roles
from afd_compile.scatter import DistState, ScatterMode, TPLayout

PLANS = [
    ("llama2", TPLayout(4), "tp4"),
    ("llama2", TPLayout(4, 2), "tp4_dp2"),
    ("llama2", TPLayout(4, 4), "tp4_dp4"),
    ("qwen3moe2", TPLayout(4, 2, moe_a2a=True), "tp4_dp2_a2a"),
    ("qwen3moe3_mixed", TPLayout(4, 2, moe_a2a=True), "tp4_dp2_a2a_mixed"),
]


def _plan(exported, name, layout):
    gm = exported(name)[0].module()
    annotate_roles(gm)
    plan = plan_tp(gm, layout, graph_name=name)
    annotate_dist_states(gm, plan)
    return gm, plan


@pytest.mark.parametrize(("name", "layout", "tag"), PLANS, ids=[p[2] + "-" + p[0] for p in PLANS])
def test_golden_plan_tables(exported, check_golden, name, layout, tag):
    _, plan = _plan(exported, name, layout)
    check_golden(f"plan_{name}_{tag}.txt", json.dumps(plan.to_json(), indent=1) + "\n\n" + plan.table() + "\n")


def test_mixture_layer_kinds(exported):
    gm = exported("qwen3moe3_mixed")[0].module()
    annotate_roles(gm)
    assert layer_kinds(gm) == ["moe", "dense", "moe"]


def test_node_states_standard_tp(exported):
    gm, _ = _plan(exported, "llama2", TPLayout(4))
    states = [n.meta[META_KEY] for n in gm.graph.nodes]
    assert all(s.mode in (ScatterMode.TP_ATTN_FULL, ScatterMode.FULL) for s in states)
    partial = [n for n in gm.graph.nodes if n.meta[META_KEY].partial]
    # o_proj and down_proj of each layer: the two row-parallel linears owe a sum
    assert len(partial) == 4
    assert [n.meta["afd.role"].role for n in partial] == [Role.ATTENTION, Role.FFN] * 2


def test_node_states_dp_attention(exported):
    gm, _ = _plan(exported, "llama2", TPLayout(4, 2))
    ffn = [n for n in gm.graph.nodes if n.meta["afd.role"].role is Role.FFN]
    assert {n.meta[META_KEY].mode for n in ffn} == {ScatterMode.FULL}
    assert ffn[-1].meta[META_KEY] == DistState(ScatterMode.FULL, True)
    sdpa = [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert all(n.meta[META_KEY] == DistState(ScatterMode.TP_ATTN_FULL) for n in sdpa)
