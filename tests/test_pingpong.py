"""The ping-pong schedule record and its checker: micro-batch splits as a table, the canonical
schedule of any layout accepted, hand-made bad schedules rejected with the transfer named, and a
property test: every mutant of a valid schedule (two transfers of one channel swapped, a step
dropped, a step duplicated) is rejected."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_compile.layout import AFDLayout, micro_batches
from afd_compile.passes.pingpong import (
    COMPUTE,
    RECV,
    SEND,
    Schedule,
    Step,
    check_schedule,
    pingpong_schedule,
)
from afd_compile.passes.schedule import ScheduleError


@pytest.mark.parametrize("seqs, stages, want", [
    ([1, 1, 1, 1], 2, [(0, 2), (2, 4)]),                # decode: one token per sequence
    ([1, 1, 1, 1, 1], 2, [(0, 3), (3, 5)]),
    ([5, 1, 1, 1], 2, [(0, 1), (1, 4)]),                # balanced by tokens, whole sequences
    ([3, 3, 3], 3, [(0, 1), (1, 2), (2, 3)]),
    ([4], 3, [(0, 1), (1, 1), (1, 1)]),                 # fewer sequences than stages: empty stages
    ([2, 2], 1, [(0, 2)]),                              # S = 1: today's step
    ([], 2, [(0, 0), (0, 0)]),
])
def test_micro_batches_are_contiguous_whole_sequences_balanced_by_tokens(seqs, stages, want):
    assert micro_batches(seqs, stages) == want


def test_micro_batches_refuse_bad_input():
    with pytest.raises(ValueError, match="stages must be >= 1"):
        micro_batches([1], 0)
    with pytest.raises(ValueError, match="token counts must be >= 0"):
        micro_batches([1, -1], 2)


def test_the_canonical_schedule_reads_layer_major_stage_minor():
    sched = pingpong_schedule(AFDLayout(1, 1), 2, [[3, 2]])
    check_schedule(sched)
    attn = [str(s) for s in sched.ranks[1].steps]
    assert attn[:6] == ["compute L0/S0", "send L0/S0 hidden -> 0", "recv L0/S0 ffn_out <- 0",
                        "compute L0/S1", "send L0/S1 hidden -> 0", "recv L0/S1 ffn_out <- 0"]
    ffn = [str(s) for s in sched.ranks[0].steps]
    assert ffn[:3] == ["recv L0/S0 hidden <- 1", "compute L0/S0", "send L0/S0 ffn_out -> 1"]
    assert "ping-pong schedule 1A1F, 2 layers x 2 stages" in str(sched)


def test_fan_in_with_an_empty_micro_batch():
    # 3A2F: FFN rank 0 serves attention ranks 2 and 3; rank 3 has nothing in stage 1
    sched = pingpong_schedule(AFDLayout(3, 2), 1, [[2, 1], [1, 0], [1, 1]])
    check_schedule(sched)
    ffn0 = sched.ranks[0].steps
    assert [s.peers for s in ffn0 if s.kind == RECV] == [(2, 3), (2,)]
    assert not [s for s in sched.ranks[3].steps if s.stage == 1]


def _with_steps(sched: Schedule, rank: int, steps: list[Step]) -> Schedule:
    ranks = tuple(dataclasses.replace(r, steps=tuple(steps)) if r.rank == rank else r for r in sched.ranks)
    return dataclasses.replace(sched, ranks=ranks)


def test_sends_ahead_of_their_receives_deadlock_on_one_stream():
    # the attention rank sends both micro-batches before receiving either: the FFN rank's send of
    # stage 0 waits for a receive the attention rank has queued behind its second send
    sched = pingpong_schedule(AFDLayout(1, 1), 1, [[1, 1]])
    c0, c1 = Step(COMPUTE, 0, 0), Step(COMPUTE, 0, 1)
    s0, s1, r0, r1 = (Step(k, 0, s, (0,), "ffn_out" if k == RECV else "hidden")
                      for k, s in ((SEND, 0), (SEND, 1), (RECV, 0), (RECV, 1)))
    bad = _with_steps(sched, 1, [c0, s0, c1, s1, r0, r1])
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 waits at send L0/S0 ffn_out -> 1; "
                                            r"rank 1 waits at send L0/S1 hidden -> 0"):
        check_schedule(bad)


def test_a_mismatched_pair_and_a_broken_chain_are_named():
    sched = pingpong_schedule(AFDLayout(1, 1), 2, [[1, 1]])
    steps = list(sched.ranks[1].steps)
    steps[1], steps[4] = steps[4], steps[1]  # send L0/S0 <-> send L0/S1
    with pytest.raises(ScheduleError, match=r"transfer #0 from rank 1 to rank 0: rank 1 has send L0/S1 hidden -> 0, "
                                            r"rank 0 has recv L0/S0 hidden <- 1"):
        check_schedule(_with_steps(sched, 1, steps))
    steps = [s for s in sched.ranks[0].steps if not (s.kind == COMPUTE and s.layer == 1 and s.stage == 0)]
    with pytest.raises(ScheduleError, match=r"rank 0 \(ffn\), stage 0: send L1/S0 ffn_out -> 1 where compute L1/S0"):
        check_schedule(_with_steps(sched, 0, steps))


layouts = st.integers(1, 4).flatmap(lambda a: st.tuples(st.just(a), st.integers(1, a)))


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    a, f = draw(layouts)
    stages, layers = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    tokens = draw(st.lists(st.lists(st.integers(0, 2), min_size=stages, max_size=stages), min_size=a, max_size=a))
    if not any(map(any, tokens)):
        tokens[0][0] = 1
    return pingpong_schedule(AFDLayout(a, f), layers, tokens)


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_the_canonical_schedule_of_any_layout_is_accepted(sched):
    check_schedule(sched)


@settings(max_examples=300, deadline=None)
@given(schedules(), st.data())
def test_every_mutant_is_rejected(sched, data):
    ranks = [r for r in sched.ranks if r.steps]
    r = data.draw(st.sampled_from(ranks))
    steps = list(r.steps)
    how = data.draw(st.sampled_from(["swap", "drop", "duplicate"]))
    if how == "swap":  # two transfers of one channel (same kind, a peer in common), different ones
        pairs = [(i, j) for i in range(len(steps)) for j in range(i + 1, len(steps))
                 if steps[i].kind == steps[j].kind != COMPUTE and set(steps[i].peers) & set(steps[j].peers)
                 and (steps[i].layer, steps[i].stage) != (steps[j].layer, steps[j].stage)]
        if not pairs:
            how = "drop"
        else:
            i, j = data.draw(st.sampled_from(pairs))
            steps[i], steps[j] = steps[j], steps[i]
    if how == "drop":
        del steps[data.draw(st.integers(0, len(steps) - 1))]
    elif how == "duplicate":
        i = data.draw(st.integers(0, len(steps) - 1))
        steps.insert(data.draw(st.integers(0, len(steps))), steps[i])
    with pytest.raises(ScheduleError):
        check_schedule(_with_steps(sched, r.rank, steps))
