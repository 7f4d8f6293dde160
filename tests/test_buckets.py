"""Token buckets (issue 35): the slot of a token count, and a batch that changes every step through
AFD: exact numerics, and an FFN rank that runs one program per bucket of its rows (per bucket tuple
of its peers when its CUDA graphs hold the exchange)."""

from __future__ import annotations

import re

import pytest
import torch

from afd_compile.buckets import BucketError, TokenBuckets
from afd_compile.comm import AFDCommunicator
from afd_compile.layout import AFDLayout
from afd_compile.verify import Case, run_cases


@pytest.mark.parametrize("n, slot", [(0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (17, 24),
                                     (256, 256), (257, 272), (512, 512), (513, 768), (1000, 1024)])
def test_default_slot_is_the_next_bucket_then_a_multiple_of_256(n: int, slot: int) -> None:
    assert TokenBuckets().slot(n) == slot


def test_a_given_list_pads_past_its_last_size_to_multiples_of_it() -> None:
    b = TokenBuckets.parse("4,16")
    assert [b.slot(n) for n in (0, 1, 4, 5, 16, 17, 33)] == [0, 4, 4, 16, 16, 32, 48]
    assert TokenBuckets.parse([1, 8]).sizes == (1, 8)


@pytest.mark.parametrize("value", [None, True, "default", "on"])
def test_default_and_on_give_the_default_list(value: object) -> None:
    assert TokenBuckets.parse(value) == TokenBuckets()


@pytest.mark.parametrize("value", [False, "off", "none", "exact"])
def test_off_gives_exact_counts(value: object) -> None:
    assert TokenBuckets.parse(value) is None


@pytest.mark.parametrize("value, message", [("4,2", "strictly ascending"), ("0,4", "integer in [1, 16777216]"),
                                            ("a,b", "give 'default', 'off'"), ("", "no sizes"),
                                            ([1, 2.5], "integer in [1, 16777216]"), ([], "no sizes")])
def test_a_bad_list_is_refused_naming_why(value: object, message: str) -> None:
    with pytest.raises(BucketError, match=re.escape(message)):
        TokenBuckets.parse(value)


def test_a_negative_count_and_a_slot_smaller_than_the_count_are_refused() -> None:
    with pytest.raises(BucketError, match="a token count is >= 0"):
        TokenBuckets().slot(-1)
    comm = AFDCommunicator("attention", 3, (0,))
    with pytest.raises(ValueError, match="attention rank 3, stage 0: a wire slot of 4 rows cannot hold 5 tokens"):
        comm.set_step({0: (5,)}, {0: 4})
    comm.set_step({0: (5,)}, {0: 8})
    assert comm.slot(0, 5) == 8 and comm.slot(1, 3) == 3


def test_backend_option_buckets_is_checked() -> None:
    from afd_compile.backend import BackendOptionError, BackendOptions

    assert BackendOptions.parse({"attention": 2, "ffn": 1}).afd.token_buckets == TokenBuckets()
    assert BackendOptions.parse({"attention": 2, "ffn": 1, "buckets": "off"}).afd.token_buckets is None
    assert BackendOptions.parse({"attention": 2, "ffn": 1, "buckets": [8, 64]}).afd.token_buckets.sizes == (8, 64)
    with pytest.raises(BackendOptionError, match=r"buckets=\[4, 2\] \(list\) must be"):
        BackendOptions.parse({"attention": 2, "ffn": 1, "buckets": [4, 2]})
    with pytest.raises(BackendOptionError, match="buckets='off' applies to an AFD layout"):
        BackendOptions.parse({"tp": 2, "buckets": "off"})
    assert BackendOptions.parse({"attention": 2, "ffn": 1, "buckets": "fixed:64"}).afd.token_buckets.fixed_slot == 64
    # an attention rank's batch buckets: sequences, never a fixed slot
    assert BackendOptions.parse({"attention": 2, "ffn": 1}).afd.batch_buckets == "auto"
    assert BackendOptions.parse({"attention": 2, "ffn": 1, "batch_buckets": [2, 4]}).afd.batch_buckets == (2, 4)
    for bad in ("fixed:8", "sometimes", [3, 1]):
        with pytest.raises(BackendOptionError, match=r"batch_buckets=.* must be 'auto', 'default', 'off'"):
            BackendOptions.parse({"attention": 2, "ffn": 1, "batch_buckets": bad})


def test_backend_option_ffn_capture_is_checked() -> None:
    from afd_compile.backend import BackendOptionError, BackendOptions

    assert BackendOptions.parse({"attention": 2, "ffn": 1}).afd.ffn_capture == "all"
    assert BackendOptions.parse({"attention": 2, "ffn": 1, "ffn_capture": "compute"}).afd.ffn_capture == "compute"
    with pytest.raises(BackendOptionError, match=r"ffn_capture='graph' \(str\) must be 'compute' or 'all'"):
        BackendOptions.parse({"attention": 2, "ffn": 1, "ffn_capture": "graph"})
    with pytest.raises(BackendOptionError, match="ffn_capture='compute' applies to an AFD layout"):
        BackendOptions.parse({"tp": 2, "ffn_capture": "compute"})
    assert BackendOptions.parse({"tp": 2, "ffn_capture": "all"}).afd is None  # (its default changes nothing)


def test_an_ffn_program_is_compiled_per_rows_and_captured_per_peer_sizes() -> None:
    # the policy (backend.ffn_key): compiled per carrier sizes (rows per stage: one per bucket);
    # with its exchange captured (ffn_capture="all", the default: step_graphs) a CUDA graph replays
    # the per-peer sizes it captured, so a graph is captured per them (no compile)
    from types import SimpleNamespace

    import torch

    from afd_compile.backend import ffn_key, ffn_step_ops

    worker = SimpleNamespace(step_counts=((8, 16), ()))
    rows = [torch.empty(24, 0)]
    assert ffn_key(SimpleNamespace(step_graphs=True), worker, rows) == (("carriers", (24,)), ("peers", ((8, 16), ())))
    assert ffn_key(SimpleNamespace(step_graphs=False), worker, rows) == ("carriers", (24,))
    ops = ffn_step_ops()
    assert {"afd::p2p_recv_group", "afd::p2p_send_group", "afd::all_gather_group_tokens"} <= set(ops)
    assert {"afd::p2p_send_recv_group_into", "afd::p2p_recv_group_into"} <= set(ops)
    assert "afd::all_reduce" not in ops and all(op.startswith("afd::") for op in ops)


def test_eager_ops_apply_only_to_a_captured_program() -> None:
    import torch

    from afd_compile.backend import ffn_step_ops
    from afd_compile.backend.compiled import PerLayout

    program = torch.fx.symbolic_trace(torch.nn.ReLU())
    assert PerLayout(program, "k", True, False, "t", eager_ops=ffn_step_ops()).eager_ops == ()
    assert PerLayout(program, "k", False, None, "t", eager_ops=ffn_step_ops()).eager_ops == ()
    # and so do graphs captured per step: not without capture (gloo / CPU), not with eager ops
    assert not PerLayout(program, "k", True, False, "t", step_graphs=True).step_graphs


#: sequences per attention rank, step after step (rank a at step s takes TRACE[(a + s) % 7]); the
#: models are traced with 5 tokens a sequence
TRACE = (0, 1, 2, 3, 4, 6, 7)
COARSE = TokenBuckets((16, 64))


def _slot_tuples(peers: int, steps: int, buckets: TokenBuckets | None) -> set[tuple[int, ...]]:
    """The per-peer wire sizes of every step that has a token (what an FFN rank runs a program for)."""
    slot = buckets.slot if buckets is not None else (lambda n: n)
    tuples = {tuple(slot(5 * TRACE[(a + s) % len(TRACE)]) for a in range(peers)) for s in range(steps)}
    return {t for t in tuples if sum(t)}


def test_a_changing_batch_runs_one_ffn_program_per_bucket_tuple_and_stays_exact(exported) -> None:
    llama, moe = exported("llama2")[1], exported("qwen3moe2")[1]
    steps = len(TRACE)
    cases = [Case(llama, AFDLayout(2, 1), TRACE, steps=steps, buckets=None),
             Case(llama, AFDLayout(2, 1), TRACE, steps=steps, buckets=COARSE),
             Case(llama, AFDLayout(2, 1), TRACE, steps=steps),  # the default list
             # 3 peers over an FFN TP group of 2 (uneven blocks), an MoE model: padded rows go
             # through the router and the experts and are dropped; and two micro-batch stages
             Case(moe, AFDLayout(3, 2, ffn_tp=2), TRACE, steps=steps, buckets=COARSE),
             Case(llama, AFDLayout(3, 1), TRACE, steps=steps, stages=2, buckets=COARSE)]
    results = run_cases(cases)
    for case, res in zip(cases, results, strict=True):
        att = [v for v in res.values() if v["role"] == "attention"]
        assert len(att) == case.layout.attention_ranks, (case, res)
        assert sum(v["compared"] for v in att) >= steps, (case, res)  # (a rank with no tokens compares nothing)
        assert max(v["max_rel_err"] for v in att) <= 1e-5, (case, res)
    exact, coarse, default = (len(results[i][0]["layouts"]) for i in range(3))
    assert exact == len(_slot_tuples(2, steps, None)) == 7
    assert coarse == len(_slot_tuples(2, steps, COARSE)) == 5  # (per peer 0, 16 or 64)
    assert default == len(_slot_tuples(2, steps, TokenBuckets())) <= exact
    # not captured in a CUDA graph, a program is compiled per carrier: the FFN rank pads its peers'
    # slots to a bucket too, so it runs one program per bucket its totals touch
    for i, buckets in ((1, COARSE), (2, TokenBuckets())):
        carriers = {(buckets.slot(sum(t)),) for t in _slot_tuples(2, steps, buckets)}
        assert {tuple(c) for c in results[i][0]["carriers"]} == carriers, results[i][0]
    assert len(results[0][0]["carriers"]) == len({sum(t) for t in _slot_tuples(2, steps, None)})
    # an FFN rank of the group serves a program per tuple of its own peers' slots and its group's
    for f in (0, 1):
        assert len(results[3][f]["layouts"]) <= len(_slot_tuples(3, steps, COARSE)), results[3]
    assert len(results[4][0]["layouts"]) < len(_slot_tuples(3, steps, None)) * 2, results[4]
    # the FFN rank reads its peers' control messages on the host once per step, whatever the fan-in
    # (and the stop at the end), their stage counts once more; they travel on a gloo group beside
    # the exchange's (runtime.control_group), so none waits for the device
    assert results[2][0]["control_reads"] == results[2][0]["steps"] + 1, results[2][0]
    assert results[4][0]["control_reads"] == 2 * results[4][0]["steps"] + 1, results[4][0]
    assert all(r[0]["device_reads"] == 0 for r in results), results


def test_padding_repeats_the_last_row_so_an_moe_reads_no_new_expert():
    import torch

    from afd_compile.ops import pad_rows, padded_to_slot

    x = torch.arange(6.0).view(3, 2)
    assert torch.equal(pad_rows(x, 5), torch.tensor([[0.0, 1], [2, 3], [4, 5], [4, 5], [4, 5]]))
    assert pad_rows(x, 3) is x and torch.equal(pad_rows(x[:0], 2), torch.zeros(2, 2))
    ids = torch.tensor([7, 9], dtype=torch.int32)  # token ids and router logits pad the same way
    hidden, tok = padded_to_slot([x, torch.tensor([7, 8, 9], dtype=torch.int32)], 4)
    assert hidden.shape == (4, 2) and tok.tolist() == [7, 8, 9, 9] and tok.dtype == ids.dtype


def test_padded_counts_in_units_of_the_programs_token_multiple():
    b = TokenBuckets((16, 64))
    assert [b.padded(n, 3) for n in (0, 1, 5, 48, 49)] == [0, 48, 48, 48, 192]
    assert [b.padded(n) for n in (0, 7, 17)] == [0, 16, 64]


def _layout_groups(rank: int, world: int) -> dict:
    import datetime

    import torch.distributed as dist

    from afd_compile.comm import GROUP_TP_CONTROL, get_group
    from afd_compile.deploy import layout_groups
    from afd_compile.runtime import group_key, process_group, register_tp_groups, tp_groups
    from afd_compile.scatter import TPLayout

    data = process_group(range(world), 17.0)  # the exchange's group, with its own timeout
    ffn, attn, control, ffn_controls = layout_groups(AFDLayout(2, 2, ffn_tp=2), *group_key(data))
    again = layout_groups(AFDLayout(2, 2, ffn_tp=2), *group_key(data))  # made once per process: no collective again
    # the control messages' group carries host tensors between the same ranks as the exchange's
    peer = (rank + 1) % world
    works = [dist.isend(torch.tensor([rank]), peer, group=control),
             dist.irecv(got := torch.zeros(1, dtype=torch.int64), (rank - 1) % world, group=control)]
    for w in works:
        w.wait(datetime.timedelta(seconds=30))
    # TP ranks with attention DP groups exchange their token counts on one beside the TP group
    lay = TPLayout(2, attn_dp=2)
    tp = tp_groups(world, [TPLayout(4, attn_dp=2), lay])
    register_tp_groups(tp, lay, rank) if rank < 2 else None
    tp_control = get_group(GROUP_TP_CONTROL) if rank < 2 else None
    return {
        "tp_control": tp_control is not None
        and [dist.get_process_group_ranks(tp_control), dist.get_backend(tp_control)],
        "tp_world_control": [dist.get_process_group_ranks(tp[("control", 4)]), dist.get_backend(tp[("control", 4)])],
        "control": dist.get_process_group_ranks(control),
        "backend": dist.get_backend(control),
        "distinct": control is not data,
        "timeout": control._get_backend(torch.device("cpu")).options._timeout,
        "ffn_controls": [dist.get_process_group_ranks(g) for g in ffn_controls],
        "ffn": [dist.get_process_group_ranks(g) for g in ffn],
        "same": again == (ffn, attn, control, ffn_controls),
        "got": int(got),
    }


def test_control_messages_travel_on_a_gloo_group_beside_the_exchanges() -> None:
    """The per-step control messages (and an FFN group's token counts) go on gloo groups over the
    exchange's ranks with its timeout, host to host: on NCCL reading them waits for no device."""
    import datetime

    from afd_compile.runtime import run_local

    res = run_local(_layout_groups, 4, timeout_s=60)
    for rank, r in res.items():
        assert r["control"] == [0, 1, 2, 3] and r["backend"] == "gloo" and r["distinct"] and r["same"], r
        assert r["timeout"] == datetime.timedelta(seconds=17), r
        if rank < 2:  # (a rank outside a group holds torch's placeholder for it)
            assert r["ffn_controls"] == r["ffn"] == [[0, 1]], r
        assert r["got"] == (rank - 1) % 4
        assert r["tp_world_control"] == [[0, 1, 2, 3], "gloo"], r
        assert r["tp_control"] == ([[0, 1], "gloo"] if rank < 2 else False), r
