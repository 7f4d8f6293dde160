"""The backend's lowering of an FFN program's exchange: each send and the next receive as one op
(passes/fuse_exchange.py), and every receive into buffers the program allocates
(passes/recv_into.py). Which pairs are fused (op counts on split, staged and FFN TP programs),
what is left alone, the rewritten receives, and the ops' transfers between real gloo processes
(uneven peers, rows padded to a bucket, wire checks on, three tensors on the wire)."""

from __future__ import annotations

import operator

import pytest
import torch

from afd_compile.comm import AFDCommunicator, register_communicator
from afd_compile.passes.fuse_exchange import META, fuse_send_recv
from afd_compile.passes.recv_into import receive_into_buffers
from afd_compile.runtime import run_local
from afd_compile.split_api import split

afd = torch.ops.afd
SEND, RECV, FUSED = afd.p2p_send_group.default, afd.p2p_recv_group.default, afd.p2p_send_recv_group.default
RECV_INTO, FUSED_INTO = afd.p2p_recv_group_into.default, afd.p2p_send_recv_group_into.default


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.target == target)


def test_each_send_runs_with_the_next_layers_receive(exported):
    ffn = split(exported("qwen3moe3_mixed")[0]).ffn  # 3 layers: MoE, dense, MoE
    done = fuse_send_recv(ffn)
    assert [(r.send, r.recv) for r in done] == [((0, 0), (1, 0)), ((1, 0), (2, 0))]
    assert (_count(ffn, RECV), _count(ffn, FUSED), _count(ffn, SEND)) == (1, 2, 1)
    order = [n.name for n in ffn.graph.nodes if n.target in (SEND, RECV, FUSED)]
    assert order == ["afd_recv_L0", "afd_send_recv_L0_L1", "afd_send_recv_L1_L2", "afd_send_L2"]
    fused = next(n for n in ffn.graph.nodes if n.target == FUSED)
    assert fused.meta[META] == done[0] and str(done[0]).startswith("afd_send_recv_L0_L1: send layer 0")
    assert fuse_send_recv(ffn) == []  # nothing left to fuse


def test_staged_and_ffn_tp_programs_fuse_every_adjacent_pair(exported):
    from afd_compile.passes.ffn_tp import tensor_parallel_ffn
    from afd_compile.passes.stages import stage_ffn_program

    ffn = split(exported("llama2")[0]).ffn
    staged = stage_ffn_program(ffn, 3)  # per layer, per stage: receive, compute, send
    assert [(r.send, r.recv) for r in fuse_send_recv(staged)] == [
        ((0, 0), (0, 1)), ((0, 1), (0, 2)), ((0, 2), (1, 0)), ((1, 0), (1, 1)), ((1, 1), (1, 2))]
    assert (_count(staged, RECV), _count(staged, SEND)) == (1, 1)
    # an FFN TP group's collectives stay where they were: after the receive, before the send
    tp = tensor_parallel_ffn(split(exported("llama2")[0]).ffn, 2, 0).program
    colls = [n.target for n in tp.graph.nodes if n.target in (afd.all_gather_tokens.default,
                                                               afd.reduce_scatter_tokens.default)]
    assert len(fuse_send_recv(tp)) == 1
    assert [n.target for n in tp.graph.nodes if n.target in (afd.all_gather_tokens.default,
                                                             afd.reduce_scatter_tokens.default)] == colls


def test_a_pair_with_a_side_effect_between_is_left_alone(exported):
    ffn = split(exported("llama2")[0]).ffn
    recv = next(n for n in ffn.graph.nodes if n.name == "afd_recv_L1")
    with ffn.graph.inserting_before(recv):
        ffn.graph.call_function(torch._assert, (True, "between the send and the receive"))
    assert fuse_send_recv(ffn) == [] and _count(ffn, FUSED) == 0


# --- the fused op between real gloo processes --------------------------------------------------

SPEC = "hidden:float32[8]"
LAYERS = 3


def _fused_exchange(rank: int, world: int, check: bool) -> dict:
    """FFN rank 0 serves peers 1 (3 tokens) and 2 (4 tokens) for 3 layers, its rows padded to a
    bucket of 8: layer 0's receive, two fused send/receives, the last send. Each layer doubles."""
    if rank == 0:
        comm = AFDCommunicator("ffn", 0, (1, 2), check_wire=check)
        comm.set_step({0: (3, 4)})
        comm.step_rows = {0: 8}  # (what FFNWorker sets under token buckets)
        register_communicator(comm, 0)
        (x,) = afd.p2p_recv_group(torch.empty(8, 0), 0, 0, 0, 8, SPEC)
        for layer in range(1, LAYERS):
            (x,) = afd.p2p_send_recv_group([x * 2], 0, layer - 1, 0, SPEC, layer, 0, 8, SPEC)
            assert x.shape == (8, 8) and torch.equal(x[7], x[6])  # (the padding repeats the last row)
        afd.p2p_send_group([x * 2], 0, LAYERS - 1, 0, SPEC)
        return {"transfers": comm.stage_transfers}
    n = 3 if rank == 1 else 4
    comm = AFDCommunicator("attention", rank, (0,), check_wire=check)
    comm.set_step({0: (n,)})
    register_communicator(comm, 0)
    h = torch.randn(n, 8, generator=torch.Generator().manual_seed(rank))
    want = h.clone()
    for layer in range(LAYERS):
        tok = afd.p2p_send([h], 0, layer, 0, SPEC)
        (h,) = afd.p2p_recv(tok, 0, layer, 0, n, SPEC)
        h, want = h + 1, want * 2 + 1
    return {"err": float((h - want).abs().max())}


@pytest.mark.parametrize("check", [False, True], ids=["plain", "wire_checks"])
def test_the_fused_op_moves_every_peers_rows(check):
    res = run_local(_fused_exchange, 3, check, timeout_s=120)
    assert res[1]["err"] == 0 and res[2]["err"] == 0
    assert res[0]["transfers"] == {0: 2 * LAYERS * 2}  # a receive and a send per peer and layer


def test_every_receive_writes_into_buffers_the_program_allocates(exported):
    from afd_compile.split_api import SplitConfig

    # router logits on the wire: two tensors per receive, two buffers
    ffn = split(exported("qwen3moe2")[0], SplitConfig(compute_gate_on_attention=True)).ffn
    fuse_send_recv(ffn)
    assert receive_into_buffers(ffn) == ["afd_recv_L0_into", "afd_send_recv_L0_L1_into"]
    assert (_count(ffn, RECV), _count(ffn, FUSED), _count(ffn, RECV_INTO), _count(ffn, FUSED_INTO)) == (0, 0, 1, 1)
    for n in (n for n in ffn.graph.nodes if n.target in (RECV_INTO, FUSED_INTO)):
        bufs = n.args[1]
        assert [b.kwargs["dtype"] for b in bufs] == [torch.float32, torch.float32]
        assert [b.args[1][1] for b in bufs] == [64, 4]  # (hidden, router logits: 4 experts)
        assert all(b.target == torch.ops.aten.new_empty.default for b in bufs)
    # no op returns a list to the rest of the program any more
    assert not any(n.target is operator.getitem and n.args[0].target in (RECV_INTO, FUSED_INTO)
                   for n in ffn.graph.nodes if n.op == "call_function")


SPEC3 = "hidden:float32[8],router_logits:float32[4],token_ids:int32[]"


def _into_exchange(rank: int, world: int) -> dict:
    """Peers 1 (2 tokens) and 2 (3 tokens) send three tensors; FFN rank 0 receives them into
    buffers of 8 rows (a bucket), then returns hidden + 1 in a fused send / receive of layer 1."""
    peers_tokens = {1: 2, 2: 3}
    if rank == 0:
        comm = AFDCommunicator("ffn", 0, (1, 2))
        comm.set_step({0: (2, 3)})
        comm.step_rows = {0: 8}
        register_communicator(comm, 0)
        bufs = [torch.full((8, 8), -1.0), torch.full((8, 4), -1.0), torch.full((8,), -1, dtype=torch.int32)]
        afd.p2p_recv_group_into(torch.empty(8, 0), bufs, 0, 0, 0, SPEC3)
        again = [torch.empty(8, 8), torch.empty(8, 4), torch.empty(8, dtype=torch.int32)]
        afd.p2p_send_recv_group_into([bufs[0] + 1], again, 0, 0, 0, "ffn_out:float32[8]", 1, 0, SPEC3)
        afd.p2p_send_group([again[0] * 2], 0, 1, 0, "ffn_out:float32[8]")
        return {"first": [b.tolist() for b in bufs], "second": [b.tolist() for b in again]}  # (lists: picklable)
    n = peers_tokens[rank]
    comm = AFDCommunicator("attention", rank, (0,))
    comm.set_step({0: (n,)})
    register_communicator(comm, 0)
    sent = _peer_tensors(rank, n)
    (back,) = afd.p2p_recv(afd.p2p_send(sent, 0, 0, 0, SPEC3), 0, 0, 0, n, "ffn_out:float32[8]")
    again = [t * 3 if t.dtype != torch.int32 else t + 3 for t in sent]
    (back2,) = afd.p2p_recv(afd.p2p_send(again, 0, 1, 0, SPEC3), 0, 1, 0, n, "ffn_out:float32[8]")
    return {"back": back.tolist(), "back2": back2.tolist()}


def _peer_tensors(rank: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g),
            torch.randint(0, 100, (n,), generator=g, dtype=torch.int32)]


def test_receives_into_buffers_fill_each_peers_rows_and_pad_the_rest():
    res = run_local(_into_exchange, 3, timeout_s=120)
    res = {r: {k: ([torch.tensor(x) for x in v] if k in ("first", "second") else torch.tensor(v))
               for k, v in d.items()} for r, d in res.items()}
    one, two = _peer_tensors(1, 2), _peer_tensors(2, 3)
    want = [torch.cat([a, b]) for a, b in zip(one, two, strict=True)]
    for got, w in zip(res[0]["first"], want, strict=True):
        assert torch.equal(got[:5], w) and all(torch.equal(got[r], w[-1]) for r in range(5, 8))
    assert torch.equal(res[0]["second"][2][:5], torch.cat([one[2] + 3, two[2] + 3]))
    assert torch.equal(res[0]["second"][0][:5], torch.cat([one[0] * 3, two[0] * 3]))
    assert torch.equal(res[1]["back"], one[0] + 1) and torch.equal(res[2]["back"], two[0] + 1)
    assert torch.equal(res[1]["back2"], one[0] * 6) and torch.equal(res[2]["back2"], two[0] * 6)


def test_a_receive_buffer_other_than_the_wire_spec_is_refused():
    from afd_compile.comm import unregister_communicator

    comm = AFDCommunicator("ffn", 0, (1, 2))
    comm.set_step({0: (3, 5)})
    register_communicator(comm, 7)
    try:
        with pytest.raises(ValueError, match=r"p2p_recv_group_into \(ffn rank 0, layer 2, stage 0\): the receive "
                                             r"buffers are \[\(torch.float16, \(8, 8\)\)\], the wire spec"):
            afd.p2p_recv_group_into(torch.empty(8, 0), [torch.empty(8, 8, dtype=torch.float16)], 7, 2, 0,
                                    "hidden:float32[8]")
    finally:
        unregister_communicator(7)
