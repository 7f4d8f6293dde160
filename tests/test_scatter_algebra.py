"""The state algebra as a table: every (src, dst, partial) row, and the group-size collapses."""

from __future__ import annotations

import pytest

from afd_compile.layout import LayoutError
from afd_compile.scatter import (
    Collective,
    DistState,
    ScatterMode,
    TPLayout,
    TransitionError,
    infer_layer_modes,
    plan_junctions,
    transition,
)

S, T, F = ScatterMode.SCATTERED, ScatterMode.TP_ATTN_FULL, ScatterMode.FULL
DP = TPLayout(tp=4, attn_dp=2)  # group sizes: SCATTERED 1, TP_ATTN_FULL 2, FULL 4

# (src mode, partial, dst mode) -> (collective or None, reduces)
TABLE = [
    (S, False, S, None, False),
    (T, False, T, None, False),
    (F, False, F, None, False),
    (S, True, S, Collective.ALL_REDUCE, True),
    (T, True, T, Collective.ALL_REDUCE, True),
    (F, True, F, Collective.ALL_REDUCE, True),
    (S, False, T, Collective.ALL_GATHER, False),
    (S, False, F, Collective.ALL_GATHER, False),
    (T, False, F, Collective.ALL_GATHER, False),
    (S, True, T, Collective.ALL_GATHER, True),
    (T, True, F, Collective.ALL_GATHER, True),
    (F, True, T, Collective.REDUCE_SCATTER, True),
    (F, True, S, Collective.REDUCE_SCATTER, True),
    (T, True, S, Collective.REDUCE_SCATTER, True),
    (F, False, T, Collective.SCATTER, False),
    (F, False, S, Collective.SCATTER, False),
    (T, False, S, Collective.SCATTER, False),
]


@pytest.mark.parametrize(("src", "partial", "dst", "collective", "reduces"), TABLE,
                         ids=[f"{s}{'+P' if p else ''}-to-{d}" for s, p, d, *_ in TABLE])
def test_transition_table(src, partial, dst, collective, reduces):
    t = transition(DistState(src, partial), DistState(dst), DP)
    if collective is None:
        assert t is None
        return
    assert (t.collective, t.reduces) == (collective, reduces)
    assert (t.src_size, t.dst_size) == (DP.group_size(src), DP.group_size(dst))


def test_partial_to_scattered_is_one_reduce_scatter():
    t = transition(DistState(F, True), DistState(S), DP)
    assert str(t) == "reduce_scatter FULL+P[4] -> SCATTERED[1]"


def test_cannot_target_a_partial_state():
    with pytest.raises(TransitionError, match="into a partial state FULL\\+P"):
        transition(DistState(T), DistState(F, True), DP)


def test_standard_tp_collapses_tp_attn_full_and_full():
    tp = TPLayout(tp=4)
    assert transition(DistState(T), DistState(F), tp) is None
    assert transition(DistState(F, True), DistState(T), tp).collective is Collective.ALL_REDUCE


def test_standard_tp_is_the_megatron_pattern():
    tp = TPLayout(tp=4)
    for modes in infer_layer_modes(["dense", "dense", "moe"], tp):
        assert {
            tp.group_size(getattr(modes, m)) for m in ("layer_input", "attn", "mlp", "middle_residual", "layer_output")
        } == {4}
        assert plan_junctions(modes, tp).names() == {
            "prepare_attn": [],
            "prepare_mlp": ["all_reduce"],
            "postprocess_layer": ["all_reduce"],
        }


def test_dp_attention_gathers_for_the_mlp_and_reduce_scatters_back():
    modes = infer_layer_modes(["dense", "dense"], DP)
    assert modes[0].modes() == {
        "layer_input": "TP_ATTN_FULL",
        "attn": "TP_ATTN_FULL",
        "mlp": "FULL",
        "middle_residual": "TP_ATTN_FULL",
        "layer_output": "TP_ATTN_FULL",
    }
    assert plan_junctions(modes[0], DP).names() == {
        "prepare_attn": [],
        "prepare_mlp": ["all_gather"],
        "postprocess_layer": ["reduce_scatter"],
    }


def test_attn_tp_1_gathers_without_a_reduction():
    full_dp = TPLayout(tp=4, attn_dp=4)
    (m,) = infer_layer_modes(["dense"], full_dp)
    (t,) = plan_junctions(m, full_dp).prepare_mlp
    assert t.collective is Collective.ALL_GATHER and not t.reduces  # o_proj is not sharded: nothing owed


def test_moe_all_to_all_mixture_adapts_per_layer():
    layout = TPLayout(tp=4, attn_dp=2, moe_a2a=True)
    modes = infer_layer_modes(["moe", "dense", "moe", "dense"], layout)
    names = [plan_junctions(m, layout).names() for m in modes]
    assert [str(m.mlp) for m in modes] == ["SCATTERED", "FULL", "SCATTERED", "FULL"]
    assert names[0]["prepare_mlp"] == ["reduce_scatter"]  # half the traffic of an all-reduce
    assert str(modes[1].layer_input) == "SCATTERED"
    assert names[1]["prepare_attn"] == ["all_gather"]  # the dense layer after a scattered MoE gathers
    assert names[3]["postprocess_layer"] == ["reduce_scatter"]  # last layer returns to TP_ATTN_FULL


@pytest.mark.parametrize(("tp", "attn_dp", "msg"), [(4, 3, "attn_dp=3 does not divide tp=4"), (0, 1, "tp >= 1")])
def test_bad_layouts(tp, attn_dp, msg):
    with pytest.raises(LayoutError, match=msg):
        TPLayout(tp, attn_dp)


# the last (feature) dim split over the group: a vocab-parallel head's logits
SPLIT = [
    (
        DistState(T, split_last=True),
        DistState(T),
        Collective.ALL_GATHER,
        "all_gather(last) TP_ATTN_FULL+S[2] -> TP_ATTN_FULL[2]",
    ),
    (DistState(F, split_last=True), DistState(F), Collective.ALL_GATHER, "all_gather(last) FULL+S[4] -> FULL[4]"),
    (
        DistState(T),
        DistState(T, split_last=True),
        Collective.SCATTER,
        "scatter(last) TP_ATTN_FULL[2] -> TP_ATTN_FULL+S[2]",
    ),
    (DistState(S, split_last=True), DistState(S), None, None),  # a group of one: nothing is split
    (DistState(T, split_last=True), DistState(T, split_last=True), None, None),
]


@pytest.mark.parametrize(("src", "dst", "collective", "text"), SPLIT, ids=[f"{a}-to-{b}" for a, b, *_ in SPLIT])
def test_split_last_dim_table(src, dst, collective, text):
    t = transition(src, dst, DP)
    assert (t and t.collective, t and str(t)) == (collective, text)
    if t is not None:
        assert t.dim == "last" and not t.reduces


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (DistState(T, split_last=True), DistState(F)),
        (DistState(T, True), DistState(T, split_last=True)),
        (DistState(F, split_last=True), DistState(T)),
    ],
)
def test_split_last_dim_changes_alone(src, dst):
    with pytest.raises(TransitionError, match="in one collective: a split last dim changes only within one mode"):
        transition(src, dst, DP)
