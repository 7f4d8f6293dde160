"""The cost model of plan --estimate, as a table of hand-computed cases (afd_compile/estimate.py)."""

from __future__ import annotations

import pytest

from afd_compile.estimate import (
    AFDCandidate,
    Costs,
    Curve,
    EstimateError,
    KVCurves,
    LayerKind,
    Link,
    ModelFacts,
    TPCandidate,
    afd,
    best,
    candidates,
    experts_reached,
    past_profile,
    search,
    tp,
)

FLAT, FFN, HEAD = Curve(((1, 100.0),)), Curve(((1, 50.0),)), Curve(((1, 10.0),))  # one point: flat


def _costs(attention=FLAT, ffn=FFN, head=HEAD, kv=0.0, memory=10**12) -> Costs:
    return Costs("test", memory, attention, ffn, head, KVCurves((8,), (Curve(((1, kv),)),)))  # (at context 8)


FACTS = ModelFacts(layers=1, hidden=4, attention_bytes=1000, ffn_bytes=4000, other_bytes=100, kv_bytes=10,
                   kv_heads=2, to_ffn_bytes=1000, to_attention_bytes=1000)
LINK = Link("test", 1.0, 5.0)  # 1 GB/s = 1000 bytes a µs, 5 µs a transfer


@pytest.mark.parametrize("points,x,want", [
    (((1, 10.0), (3, 30.0)), 2, 20.0),  # linear between
    (((2, 10.0), (4, 30.0)), 1, 10.0),  # below the first: its value (weight-bound)
    (((1, 10.0), (3, 30.0)), 5, 50.0),  # past the last: the line through the last two
    (((1, 10.0), (3, 10.0)), 9, 10.0),  # ... never below the last
    (((4, 40.0),), 8, 40.0),  # one point: its value everywhere
])
def test_curve(points, x, want):
    assert Curve(points).at(x) == pytest.approx(want)


@pytest.mark.parametrize("points", [(), ((2, 1.0), (1, 1.0)), ((0, 1.0),), ((1, float("nan")),), ((1, -1.0),)])
def test_a_bad_curve_is_refused(points):
    with pytest.raises(EstimateError, match="ascending sizes"):
        Curve(points)


@pytest.mark.parametrize("rows,want", [(1, 8.0), (2, 8.0 + 7.5), (10**4, 128.0)])
def test_experts_reached(rows, want):  # top 8 of 128: the first row 8 experts, the second 8 x 120/128 new ones
    assert experts_reached(rows, 128, 8) == pytest.approx(want)


def _moe(r: float) -> float:  # an MoE FFN's time: 20 µs + 2 µs per expert reached + 0.5 µs per row
    return 20.0 + 2.0 * experts_reached(r, 128, 8) + 0.5 * r


def test_an_moe_curve_follows_the_experts_its_rows_reach():
    points = tuple((r, _moe(r)) for r in (1, 8, 64, 256))
    routed, straight = Curve(points, (128, 8)), Curve(points)
    assert [routed.at(r) for r in (1, 8, 64, 256)] == pytest.approx([y for _, y in points])  # through the points
    assert [routed.at(r) for r in (4, 16, 32, 512)] == pytest.approx([_moe(r) for r in (4, 16, 32, 512)])
    assert straight.at(16) < _moe(16) - 40  # a straight line misses the knee by ~45 µs
    off = Curve(tuple((r, y + (5.0 if r == 8 else 0.0)) for r, y in points), (128, 8))  # noise at one point
    assert off.at(8) == pytest.approx(_moe(8) + 5.0) and abs(off.at(16) - _moe(16)) < 5.0


def test_an_moe_curve_is_never_below_zero():  # a layer timed as 0 (its program no slower than its call): the
    points = ((1, 1810.088), (4, 0.0), (16, 0.0), (64, 2500.0))  # fit's rounding gave -4.5e-14, which a kind-
    routed = Curve(points, (128, 8))  # weighted curve built from it then refused as "times >= 0"
    assert all(routed.at(x) >= 0.0 for x in (*range(1, 80), 2.5, 3.999, 4.0))
    assert Curve(tuple((x, routed.at(x)) for x, _ in points))  # builds


def test_an_moe_curve_of_two_points_is_a_line():  # three terms need three points
    assert Curve(((1, 10.0), (3, 30.0)), (128, 8)).at(2) == pytest.approx(20.0)


def test_kv_read_is_linear_in_the_context():
    kv = KVCurves((1000, 2000), (Curve(((1, 10.0),)), Curve(((1, 20.0),))))
    assert [kv.at(1, c) for c in (500, 1000, 1500, 2000, 4000)] == pytest.approx([5.0, 10.0, 15.0, 20.0, 40.0])


# (candidate, batch, attention µs, ffn µs, wire µs one way, layer µs): FACTS, LINK, attention 100, FFN 50
AFD_CASES = [
    # one stage: the chain (attention, 2 rows to the FFN rank = 2000 bytes: 5 + 2 µs, FFN, back)
    (AFDCandidate(1, 1), 2, 100.0, 50.0, 7.0, 164.0),
    # two stages of 2: each resource serialises 2 jobs (2 x 100) > one micro-batch's chain (164)
    (AFDCandidate(1, 1, stages=2), 4, 100.0, 50.0, 7.0, 200.0),
    # a batch of 1 over 2 stages: one micro-batch (stages never exceed the sequences)
    (AFDCandidate(1, 1, stages=2), 1, 100.0, 50.0, 6.0, 162.0),
    # fan-in 3: the FFN rank's link carries 3 peers' rows (3 x 2 x 1000 bytes)
    (AFDCandidate(3, 1), 2, 100.0, 50.0, 11.0, 172.0),
    # FFN TP 2: half the FFN (flat: 50 / 2) + all-gather and reduce-scatter of 2 x 2 rows of 1000 bytes, (P-1)/P
    (AFDCandidate(2, 2, ffn_tp=2), 2, 100.0, 25.0 + 2 * (5.0 + 2.0), 7.0, 100 + 7 + 39.0 + 7),
    # attention TP 2 (one group of 2 ranks, 2 sequences): heads halved (100 / 2, KV over both KV heads) +
    # reduce-scatter and all-gather of 2 rows of 1000 bytes, (t-1)/t; each rank sends 1 row, the FFN rank gets 2
    (AFDCandidate(2, 1, attn_tp=2), 2, 50.0 + 2 * (5.0 + 1.0), 50.0, 7.0, 62 + 7 + 50 + 7),
]


@pytest.mark.parametrize("cand,batch,att,ffn,wire,layer", AFD_CASES, ids=[str(c[0]) + f" b={c[1]}" for c in AFD_CASES])
def test_afd_layer(cand, batch, att, ffn, wire, layer):
    e = afd(_costs(), FACTS, cand, batch, context=8, link=LINK)
    assert (e.attention_us, e.ffn_us, e.wire_us, e.layer_us) == pytest.approx((att, ffn, wire, layer))
    assert e.step_us == pytest.approx(layer + 10.0)  # + the head
    sequences = batch * cand.attention // cand.attn_tp  # (batch: per attention rank, or per attention TP group)
    assert e.tokens_per_s_per_gpu == pytest.approx(sequences / (layer + 10.0) * 1e6 / e.gpus)
    if min(cand.stages, batch) > 1:  # what the stages buy: the same batch in one stage, the chain (here a loss:
        # flat curves, so each of 2 micro-batches costs what the whole batch did)
        assert e.stages_gain == pytest.approx((100 + 50 + 2 * (5.0 + batch * cand.attention / cand.ffn)) / layer)
    else:
        assert e.stages_gain is None


def test_a_programs_call_is_counted_once_a_step():
    """Profiled at two depths, an AFD step adds the attention program's call and the FFN program's once
    (not the head: the attention's call holds it), a TP rank's the model's."""
    costs = Costs("test", 10**12, FLAT, FFN, HEAD, KVCurves((8,), (Curve(((1, 0.0),)),)),
                  call_attention=Curve(((1, 30.0), (4, 60.0))), call_ffn=Curve(((1, 5.0), (8, 12.0))),
                  call_model=Curve(((1, 70.0),)))
    facts = ModelFacts(**{**FACTS.__dict__, "layers": 3})
    e = afd(costs, facts, AFDCandidate(1, 1), 2, context=8, link=LINK)
    # (the attention call at 2 sequences: 30 + (60 - 30) / 3; the FFN's at its 2 rows: 5 + 7 / 7)
    assert e.step_us == pytest.approx(3 * 164.0 + 40.0 + 6.0)
    e = afd(costs, facts, AFDCandidate(2, 1, stages=2), 4, context=8, link=LINK)  # (fan-in 2: 8 rows a step)
    assert e.step_us == pytest.approx(3 * e.layer_us + 30.0 + 30.0 * 3 / 3 + 12.0)
    e = tp(costs, facts, TPCandidate(1, 1), 2, context=8, link=LINK)
    assert e.step_us == pytest.approx(3 * 150.0 + 70.0)


def test_afd_memory_and_a_layout_that_does_not_fit():
    e = afd(_costs(memory=2000), FACTS, AFDCandidate(1, 1), 4, context=8, link=LINK)
    # attention rank: weights 1000 + KV 4 sequences x 8 positions x 10 bytes + head/embedding 100
    assert e.memory == {"attention rank": 1000 + 320 + 100, "FFN rank": 4000}
    assert not e.fits  # the FFN rank's 4000 bytes exceed 90% of 2000


def test_attention_tp_splits_the_attention_ranks_memory():
    e = afd(_costs(), FACTS, AFDCandidate(2, 1, attn_tp=2), 4, context=8, link=LINK)
    # weights 1000 / 2 + KV 4 sequences x 8 positions x 10 bytes over 2 KV heads + head/embedding 100
    assert e.memory["attention rank"] == 500 + 160 + 100 and e.sequences == 4


def test_tp_layer():
    e = tp(_costs(kv=8.0), FACTS, TPCandidate(4, 2), 2, context=8, link=LINK)
    ring = 5.0 + 2 * 1000 * 2 * 1 / 2 / 1000  # one all-reduce of 2 tokens' hidden states (1000 bytes), 2(t-1)/t
    assert e.attention_us == pytest.approx(100 / 2 + 8.0 / 2)
    assert e.ffn_us == pytest.approx(50 / 2 + ring)
    assert e.layer_us == pytest.approx(54 + ring + 25 + ring)
    assert e.sequences == 4 and e.gpus == 4  # 2 replicas of 2 sequences
    assert e.memory == {"GPU": 1000 // 2 + 2 * 8 * 10 // 2 + 100 + 4000 // 2}


def test_best_batch_is_the_largest_under_the_target():
    # attention grows with the batch: 10 µs a sequence; the target allows a layer up to ~1 ms
    costs = _costs(attention=Curve(((1, 10.0), (1024, 10240.0))))
    e = best(lambda b: afd(costs, FACTS, AFDCandidate(1, 1), b, 8, LINK), tpot_ms=1.0)
    assert e is not None and e.step_us <= 1000 and e.batch == 64
    assert best(lambda b: afd(costs, FACTS, AFDCandidate(1, 1), b, 8, LINK), tpot_ms=0.01) is None


def test_search_ranks_by_tokens_per_gpu_and_keeps_the_target():
    costs = _costs(attention=Curve(((1, 10.0), (1024, 10240.0))), ffn=Curve(((1, 20.0), (1024, 2048.0))))
    found = search(costs, FACTS, gpus=4, context=8, tpot_ms=2.0, fabric=LINK)
    assert found and all(e.step_us <= 2000 for e in found)
    rates = [e.tokens_per_s_per_gpu for e in found]
    assert rates == sorted(rates, reverse=True)
    assert {e.layout.split()[0] for e in found} == {"AFD", "TP"}


def test_candidates():
    moe = ModelFacts(**{**FACTS.__dict__, "experts": 8, "top_k": 2})
    names = {str(c) for c in candidates(4, moe, max_stages=2)}
    assert {"AFD 3A1F S=1", "AFD 2A2F S=2 ffn_tp=2", "AFD 2A2F S=1 ffn_ep=2", "TP 4", "TP 2 x DP 2",
            "TP 1 x DP 4, EP 4"} <= names
    assert not any(c.startswith("AFD 1A3F") for c in names)  # more FFN than attention ranks


def test_an_moe_ffn_ep_group_may_span_every_ffn_rank_and_then_crosses_nodes():
    """As TP/EP's experts over all GPUs: AFD's FFN EP group over all F ranks, past a node too; its
    all-to-all then takes the link between nodes, a group inside a node NVLink (the group link)."""
    moe = ModelFacts(**{**FACTS.__dict__, "experts": 32, "top_k": 2})
    names = {str(c) for c in candidates(48, moe, max_stages=1)}
    assert {"AFD 32A16F S=1 ffn_ep=16", "AFD 24A24F S=1 ffn_ep=8"} <= names
    assert "AFD 24A24F S=1 ffn_ep=24" not in names  # (24 does not divide 32 experts)
    node, fabric = Link("node", 1.0, 1.0), Link("fabric", 1.0, 100.0)
    # 2 rows per FFN rank, 16 ranks: 2 x 16 rows over 16 = 50 (flat) / 16 ... 2 all-to-alls of 2 rows x 1000 bytes
    # x min(2, 16) copies x 15/16 off the rank
    wide = afd(_costs(), moe, AFDCandidate(32, 16, ffn_ep=16), 1, context=8, link=fabric, group_link=node)
    assert wide.ffn_us == pytest.approx(50.0 / 16 + 2 * (100.0 + 2 * 1000 * 2 * 15 / 16 / 1000))
    inside = afd(_costs(), moe, AFDCandidate(16, 8, ffn_ep=8), 1, context=8, link=fabric, group_link=node)
    assert inside.ffn_us == pytest.approx(50.0 / 8 + 2 * (1.0 + 2 * 1000 * 2 * 7 / 8 / 1000))


def test_layers_of_two_kinds_are_costed_apart():
    """One dense layer and three MoE layers (shares 1/4, 3/4): under FFN EP 2 the dense layer runs whole
    on the rank's own rows (no all-to-all, its weights whole), the MoE layers split; each kind's layer
    takes its own maximum over the stages' resources."""
    moe = ModelFacts(**{**FACTS.__dict__, "layers": 4, "experts": 8, "top_k": 2})
    dense = LayerKind(0.25, Curve(((1, 100.0),)), Curve(((1, 40.0),)), False, 1000, 4000)
    experts = LayerKind(0.75, Curve(((1, 100.0),)), Curve(((1, 80.0),)), True, 1000, 16000)
    costs = Costs("test", 10**12, FLAT, FFN, HEAD, KVCurves((8,), (Curve(((1, 0.0),)),)), kinds=(dense, experts))
    e = afd(costs, moe, AFDCandidate(2, 2, ffn_ep=2), 2, context=8, link=LINK)
    wire = 5.0 + 2 * 1000 / 1000  # 2 rows of 1000 bytes each way
    a2a = 2 * (5.0 + 2 * 1000 * 2 * 1 / 2 / 1000)  # 2 rows x min(2, 2) copies x 1/2 off the rank, twice
    layers = [100 + wire + 40.0 + wire, 100 + wire + 80.0 / 2 + a2a + wire]
    assert e.ffn_us == pytest.approx(0.25 * 40.0 + 0.75 * (40.0 + a2a))
    assert e.layer_us == pytest.approx(0.25 * layers[0] + 0.75 * layers[1])
    assert e.memory["FFN rank"] == 4 * 0.25 * 4000 + 4 * 0.75 * 16000 // 2
    t = tp(costs, moe, TPCandidate(2, 2), 2, context=8, link=LINK)  # TP 2, no EP: both kinds split over 2
    ring = 5.0 + 2 * 1000 * 2 * (1 / 2) / 1000
    assert t.ffn_us == pytest.approx(0.25 * (40.0 / 2 + ring) + 0.75 * (80.0 / 2 + ring))
    ep = tp(costs, moe, TPCandidate(2, 1, ep=True), 2, context=8, link=LINK)  # experts over 2, the dense MLP whole
    assert ep.ffn_us == pytest.approx(0.25 * 40.0 + 0.75 * (80.0 / 2 + 2 * (5.0 + 2 * 1000 * 1 / 1000)))
    assert ep.memory["GPU"] == 4 * (1000 + 2 * 8 * 10) + 100 + 4 * 0.25 * 4000 + 4 * 0.75 * 16000 // 2


@pytest.mark.parametrize("text,want", [("nvlink", (300.0, 15.0)), ("ib", (50.0, 20.0)), ("25,3.5", (25.0, 3.5))])
def test_link(text, want):
    link = Link.parse(text)
    assert (link.gbps, link.latency_us) == want


@pytest.mark.parametrize("text", ["fast", "0,1", "10", "10,-1", "nan,1"])
def test_a_bad_link_is_refused(text):
    with pytest.raises(EstimateError, match="--link"):
        Link.parse(text)


def test_what_an_estimate_reads_past_the_profile():
    costs = _costs(attention=Curve(((1, 10.0), (64, 100.0))), ffn=Curve(((1, 20.0), (32, 40.0))))
    inside = afd(costs, FACTS, AFDCandidate(1, 1), 8, context=8, link=LINK)
    assert inside.reads == {"attention": 8, "KV read": 8, "context": 8, "FFN": 8, "head": 8}
    # (the KV and head curves of _costs: one point, at 1)
    assert past_profile(costs, inside) == ["KV read at 8 sequences (profiled to 1)", "head at 8 tokens (profiled to 1)"]
    wide = afd(costs, FACTS, AFDCandidate(4, 1), 16, context=16, link=LINK)  # 4 peers x 16 rows, context 16
    assert past_profile(costs, wide) == ["KV read at 16 sequences (profiled to 1)", "context at 16 positions "
                                         "(profiled to 8)", "FFN at 64 rows (profiled to 32)", "head at 16 tokens "
                                         "(profiled to 1)"]
