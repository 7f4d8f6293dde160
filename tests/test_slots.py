"""A fixed slot (runtime/slots.py): every attention rank sends the same rows every step with its
count in a header on the device; the FFN rank reads no control message, runs one program for
every step (per set of live peers), hears a stop and a failed step in band, and stays exact."""

from __future__ import annotations

import re
import time

import pytest
import torch

from afd_compile.buckets import BucketError, TokenBuckets
from afd_compile.layout import AFDLayout
from afd_compile.runtime import RankFailure, run_local
from afd_compile.runtime.slots import FixedSlotError, check_fixed_slot, step_message
from afd_compile.verify import Case, run_cases

#: sequences per attention rank, step after step (rank a at step s takes TRACE[(a + s) % 7], 5
#: tokens a sequence): zero-token steps included
TRACE = (0, 1, 2, 3, 4, 6, 7)
SLOT = TokenBuckets.parse("fixed:40")


def test_a_fixed_slot_parses_and_holds_up_to_its_size() -> None:
    assert SLOT.fixed_slot == 40 and str(SLOT) == "a fixed slot of 40 rows"
    assert [SLOT.slot(n) for n in (0, 1, 40)] == [40, 40, 40] and SLOT.padded(0) == 40
    assert TokenBuckets.parse("16").fixed_slot is None  # (one bucket, then multiples of it: not fixed)
    with pytest.raises(BucketError, match="a fixed slot of 40 rows cannot hold 41 tokens"):
        SLOT.slot(41)
    for bad, why in (("fixed:x", "'fixed:N'"), ("fixed:0", "integer in [1,"), ("fixed:", "'fixed:N'")):
        with pytest.raises(BucketError, match=re.escape(why)):
            TokenBuckets.parse(bad)


def test_a_fixed_slot_is_refused_where_it_does_not_apply_naming_why() -> None:
    why = "its FFN program has static rows"
    with pytest.raises(FixedSlotError, match=f"a fixed slot of 40 rows .token buckets. does not apply to rank 3: "
                                             f"{re.escape(why)}"):
        check_fixed_slot(SLOT, rank=3, ffn_static_rows=True)
    assert check_fixed_slot(TokenBuckets(), rank=3, ffn_static_rows=True) is None  # (a bucket list: control messages)
    assert check_fixed_slot(SLOT, rank=0) == 40


def test_a_program_of_fewer_micro_batches_owes_the_others_in_zeros_in_the_ffn_ranks_order() -> None:
    # a static batch of 2 sequences over 3 stages: its program has 2 (each stage sends, then
    # receives); after its last stage's last transfer at a layer, stage 2's, in zeros, in the order
    # a program of 3 makes them (a send posted before the receive of stage 1 would wait on the FFN
    # rank, which waits on that receive: a deadlock under wire checks)
    from afd_compile.runtime.slots import WireStep, ghost_plan, with_ghosts

    two = [WireStep(d, layer, s, "hidden:float32[64]") for layer in (0, 1) for s in (0, 1) for d in ("send", "recv")]
    got = [(w.direction, w.layer, w.stage) for w in with_ghosts(two, 2, 3)]
    assert got == [("send", 0, 0), ("recv", 0, 0), ("send", 0, 1), ("recv", 0, 1), ("send", 0, 2), ("recv", 0, 2),
                   ("send", 1, 0), ("recv", 1, 0), ("send", 1, 1), ("recv", 1, 1), ("send", 1, 2), ("recv", 1, 2)]
    assert sorted(ghost_plan(two, 2, 3)) == [("recv", 0, 1), ("recv", 1, 1)]
    one = [WireStep("send", 0, 0, "h"), WireStep("recv", 0, 0, "h")]  # (one sequence: the unstaged program)
    assert [(w.direction, w.stage) for w in with_ghosts(one, 1, 3)] == [("send", 0), ("recv", 0), ("send", 1),
                                                                        ("recv", 1), ("send", 2), ("recv", 2)]
    assert with_ghosts(two, 2, 2) == tuple(two) and ghost_plan(two, 2, 2) == {}


def test_a_peers_step_is_failed_if_any_of_its_headers_says_so() -> None:
    assert step_message([(5, 1), (5, 1)], -2) == [5, 1]
    assert step_message([(5, 1), (-2, 0)], -2) == [-2, 0]


def test_every_step_one_program_no_control_message_and_exact(exported) -> None:
    llama, moe = exported("llama2")[1], exported("qwen3moe2")[1]
    steps = len(TRACE)
    cases = [Case(llama, AFDLayout(2, 1), TRACE, steps=steps, buckets=SLOT),
             # the same ranks then with buckets: a communicator reused under the same id leaves the
             # fixed slot behind (it once kept it, and the FFN rank waited on headers never sent)
             Case(llama, AFDLayout(2, 1), TRACE, steps=steps),
             # an MoE: padded rows and zero-token peers' zeros go through the router and experts, dropped
             Case(moe, AFDLayout(3, 1), TRACE, steps=steps, buckets=SLOT),
             Case(llama, AFDLayout(4, 2), TRACE, steps=steps, buckets=SLOT),  # two FFN ranks, 2 peers each
             Case(llama, AFDLayout(4, 1, attn_tp=2), TRACE, steps=steps, buckets=SLOT),  # attention TP slices
             # micro-batch stages: every stage of every step crosses (a batch of fewer sequences than
             # stages runs padded to one a stage), the counts per stage in each stage's headers
             Case(llama, AFDLayout(3, 1), TRACE, steps=steps, buckets=SLOT, stages=3)]
    results = run_cases(cases)
    for case, res in zip(cases, results, strict=True):
        att = [v for v in res.values() if v["role"] == "attention"]
        assert len(att) == case.layout.attention_ranks and sum(v["compared"] for v in att) >= steps, (case, res)
        assert max(v["max_rel_err"] for v in att) <= 1e-5, (case, res)
        for f in range(case.layout.ffn_ranks if case.buckets is SLOT else 0):
            ffn = res[f]
            peers = len(case.layout.peers_of_ffn(f))
            # one program for every step (the per-peer sizes never change), nothing read before a step
            sizes = ((40,) * peers,) * case.stages if case.stages > 1 else ((40,) * peers, ())
            assert ffn["layouts"] == [repr(sizes)] and ffn["carriers"] == [(40 * peers,) * case.stages], ffn
            assert ffn["control_reads"] == ffn["device_reads"] == 0 and ffn["steps"] == steps, ffn


def _peers_stop_apart(rank: int, world: int, path: str, layout: AFDLayout, short: int, fail: bool = False) -> dict:
    """Under a fixed slot, attention rank ``short`` stops after 2 steps (``fail``: its second step raises
    before any transfer, and the rank stays up, as a server that logs the error would), the other
    attention ranks after 4; an FFN rank returns what it served."""
    from afd_compile.deploy import make_worker
    from afd_compile.programs import load_program
    from afd_compile.runtime import AttentionWorker, shutdown

    worker = make_worker(load_program(path).module(), layout, rank, buckets=SLOT)
    if isinstance(worker, AttentionWorker):
        for step in range(2 if rank == short else 4):
            if fail and rank == short and step == 1:
                with pytest.raises(Exception):  # noqa: B017 (no inputs to count)
                    worker.step()
                time.sleep(30)  # (the run ends before)
                return {}
            worker.step(torch.randint(0, 128, (1 + step, 5)))
        worker.stop()
        shutdown()
        return {}
    steps = worker.serve()
    shutdown()
    return {"steps": steps, "layouts": sorted(worker.layouts), "left": sorted(worker.left),
            "header_reads": worker.header_reads}


def test_a_stop_travels_in_band_and_the_others_go_on(exported) -> None:
    # attention rank 2 stops after 2 steps, rank 1 after 4: the FFN rank serves 4 steps and runs a program
    # for both peers, then one for rank 1 alone
    res = run_local(_peers_stop_apart, 3, exported("llama2")[1], AFDLayout(2, 1), 2, timeout_s=60)[0]
    assert res["steps"] == 4 and res["left"] == [1, 2], res
    assert res["layouts"] == [((40, 0), ()), ((40, 40), ())], res
    # 5 steps read: rank 2's stop rides with rank 1's third step, rank 1's stop is a step of its own
    assert res["header_reads"] == 5, res


def _fails(rank: int, world: int, path: str, where: str) -> None:
    """Attention rank 1's second step raises: before any transfer (no inputs to count), too many
    tokens for the slot, or after its first layer's transfers (an exchange that raises once
    done); the rank stays up, as a server that logs the error would."""
    from afd_compile.comm import AFDCommunicator
    from afd_compile.deploy import make_worker
    from afd_compile.programs import load_program
    from afd_compile.runtime import AttentionWorker

    worker = make_worker(load_program(path).module(), AFDLayout(1, 1), rank, buckets=SLOT)
    if not isinstance(worker, AttentionWorker):
        worker.serve()
        return
    worker.step(torch.randint(0, 128, (2, 5)))
    if where == "mid-step":
        exchange, calls = AFDCommunicator.exchange, []

        def once_then_raise(self, *args, **kwargs):  # (the transfers done, then this rank fails)
            exchange(self, *args, **kwargs)
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected: the attention layer after the first exchange failed")

        AFDCommunicator.exchange = once_then_raise
    with pytest.raises(Exception):  # noqa: B017 (each kind of failure raises its own error)
        if where == "before":
            worker.step()
        else:
            worker.step(torch.randint(0, 128, (9 if where == "overflow" else 2, 5)))
    time.sleep(30)


@pytest.mark.parametrize("where", ["before", "overflow", "mid-step"])
def test_a_failed_step_travels_in_band_and_the_ffn_rank_ends_naming_it(exported, where: str) -> None:
    t = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_local(_fails, 2, exported("llama2")[1], where, timeout_s=25)
    assert e.value.rank == 0 and "attention rank 1 failed its step" in str(e.value), str(e.value)
    assert time.monotonic() - t < 25, "the FFN rank waited for the timeout"


def test_a_fixed_slot_ffn_program_marks_its_padded_rows_for_the_experts(exported) -> None:
    # lowered as the backend does (verify --lowered): each experts op's ids come through
    # afd::slot_rows, and the numbers stay exact (rows the mark wrongly dropped would not)
    from afd_compile.pipeline import Build, passes_for

    assert "mark_slot_rows" in [p.name for p in passes_for(Build("afd-ffn", fixed_slot=True), "lowering")]
    assert "mark_slot_rows" not in [p.name for p in passes_for(Build("afd-ffn"), "lowering")]
    steps = len(TRACE)
    moe = exported("qwen3moe2")[1]
    # (with 2 stages each stage's experts take its own stage's mark: the last stage's, fewer tokens,
    # would drop real rows of the first; checked to fail so)
    cases = [Case(moe, AFDLayout(3, 1), TRACE, steps=steps, buckets=SLOT, lowered=True),
             Case(moe, AFDLayout(2, 1), TRACE, steps=steps, buckets=SLOT, lowered=True, stages=2)]
    results = run_cases(cases)
    for res in results:
        att = [v for v in res.values() if v["role"] == "attention"]
        assert sum(v["compared"] for v in att) >= steps and max(v["max_rel_err"] for v in att) <= 1e-5, res
        assert res[0]["lowered"]["mark_slot_rows"] == 2 and res[0]["control_reads"] == 0, res[0]  # (an op a layer)
    assert results[0][0]["layouts"] == [repr(((40, 40, 40), ()))], results[0][0]


def test_a_fixed_slot_takes_no_count_in_a_control_message() -> None:
    from afd_compile.comm import AFDCommunicator
    from afd_compile.runtime import ControlError, send_control

    comm = AFDCommunicator("attention", 1, (0,), fixed_slot=8)
    with pytest.raises(ControlError, match=r"attention rank 1 sends its fixed slot's counts .* got 5"):
        send_control(comm, 5)
    assert not comm.stopped


def test_an_ffn_group_runs_a_fixed_slot_exact_with_one_program(exported) -> None:
    # an FFN TP / EP group: every rank runs a slot per peer whatever its peers send (a peer gone:
    # padding), so the group's collectives need no count; MoE padded rows marked (TP: the marks
    # gathered like the rows; EP: the dispatch's ids, a padded row goes to no rank)
    llama, moe = exported("llama2")[1], exported("qwen3moe2")[1]
    steps = len(TRACE)
    cases = [Case(llama, AFDLayout(2, 2, ffn_tp=2), TRACE, steps=steps, buckets=SLOT),
             Case(moe, AFDLayout(3, 2, ffn_tp=2), TRACE, steps=steps, buckets=SLOT, lowered=True),
             Case(moe, AFDLayout(2, 2, ffn_ep=2), TRACE, steps=steps, buckets=SLOT, lowered=True),
             Case(llama, AFDLayout(4, 2, ffn_tp=2), TRACE, steps=steps, buckets=SLOT, stages=2)]
    results = run_cases(cases)
    for case, res in zip(cases, results, strict=True):
        att = [v for v in res.values() if v["role"] == "attention"]
        assert sum(v["compared"] for v in att) >= steps and max(v["max_rel_err"] for v in att) <= 1e-5, (case, res)
        for f in range(case.layout.ffn_ranks):
            ffn, peers = res[f], len(case.layout.peers_of_ffn(f))
            live, gone = ((40,) * peers, (0,) * peers)
            # the steps, then one of padding once every peer has stopped, as the group agrees
            want = [repr((s,) * case.stages if case.stages > 1 else (s, ())) for s in (gone, live)]
            assert ffn["layouts"] == want and ffn["steps"] == steps + 1 and ffn["control_reads"] == 0, (case, ffn)
            if case.lowered:  # (an op a layer; with EP its dispatch and combine)
                assert ffn["lowered"]["mark_slot_rows"] == 2 * (1 + case.layout.ffn_ep // 2), ffn


def test_an_ffn_group_ends_together_when_its_ranks_peers_stop_apart(exported) -> None:
    # AFD 2A2F, ffn_tp=2: attention rank 2 stops after 2 steps, rank 3 after 4
    res = run_local(_peers_stop_apart, 4, exported("llama2")[1], AFDLayout(2, 2, ffn_tp=2), 2, timeout_s=60)
    # FFN rank 0's peer stops after 2 steps, rank 1's after 4: both serve 4 steps, then rank 1's
    # peer's stop step, then one step of padding in which rank 1 says it is done too
    for f in (0, 1):
        assert res[f]["steps"] == 5 and res[f]["left"] == [2 + f], res
        assert res[f]["layouts"] == [((0,), ()), ((40,), ())], res


def test_an_ffn_groups_failed_peer_ends_every_rank_of_the_group_naming_it(exported) -> None:
    t = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_local(_peers_stop_apart, 4, exported("llama2")[1], AFDLayout(2, 2, ffn_tp=2), 2, True, timeout_s=25)
    assert e.value.rank in (0, 1) and "attention rank 2 (a peer of FFN group rank 0) failed its step" in str(e.value)
    assert time.monotonic() - t < 25, "an FFN rank waited for the timeout"
