"""The afd:: custom ops: fake shapes, metadata errors, and that compiled code keeps the calls."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import afd_compile  # noqa: F401
from afd_compile.comm import AFDCommunicator, register_communicator, unregister_communicator
from afd_compile.ops import check_wire_tensors, split_sizes
from afd_compile.runtime import run_local
from afd_compile.wire import WireSpec

afd = torch.ops.afd
SPEC = "hidden:float32[8],router_logits:float32[4],token_ids:int32[]"


def test_fake_shapes_follow_the_wire_spec():
    with FakeTensorMode():
        dep = torch.empty(0)
        outs = afd.p2p_recv_group(dep, 0, 3, 1, 6, SPEC)
        assert [tuple(o.shape) for o in outs] == [(6, 8), (6, 4), (6,)]
        assert [o.dtype for o in outs] == [torch.float32, torch.float32, torch.int32]
        (out,) = afd.p2p_recv(dep, 0, 3, 1, 5, "ffn_out:bfloat16[8]")
        assert out.shape == (5, 8) and out.dtype == torch.bfloat16
        tok = afd.p2p_send([torch.empty(5, 8)], 0, 3, 1, "hidden:float32[8]")
        assert tok.shape == (0,)


def test_wire_spec_round_trips_and_enforces_order():
    assert str(WireSpec.parse(SPEC)) == SPEC
    assert WireSpec.parse(SPEC).bytes_per_token == 8 * 4 + 4 * 4 + 4
    with pytest.raises(ValueError, match="not in wire order"):
        WireSpec.parse("router_logits:float32[4],hidden:float32[8]")
    with pytest.raises(ValueError, match="cannot parse"):
        WireSpec.parse("hidden:float32")


class _NcclView(AFDCommunicator):
    """A communicator that reports a device (NCCL) transport, to test the CPU-tensor check."""

    @property
    def device_transport(self) -> bool:
        return True


@pytest.fixture
def attention_comm():
    comm = AFDCommunicator("attention", 1, (0,))
    comm.set_step({0: (4,)})
    register_communicator(comm, 42)
    yield comm
    unregister_communicator(42)


def _wire(tokens=4, ids_dtype=torch.int32, logits_tokens=None, ids_shape=None):
    return [torch.randn(tokens, 8), torch.randn(logits_tokens or tokens, 4),
            torch.zeros(ids_shape or (tokens,), dtype=ids_dtype)]


def test_shape_mismatch_against_metadata_raises(attention_comm):
    with pytest.raises(ValueError, match=r"layer 3.*shape mismatch.*\(5, 8\).*4 tokens"):
        afd.p2p_send(_wire(tokens=5), 42, 3, 0, SPEC)


def test_token_ids_must_be_1d_int32(attention_comm):
    with pytest.raises(ValueError, match="token_ids must be a 1-D int32"):
        afd.p2p_send(_wire(ids_dtype=torch.int64), 42, 0, 0, SPEC)
    with pytest.raises(ValueError, match="token_ids must be a 1-D int32"):
        afd.p2p_send(_wire(ids_shape=(2, 2)), 42, 0, 0, SPEC)


def test_router_logits_must_be_token_aligned(attention_comm):
    with pytest.raises(ValueError, match="router_logits must be token-aligned"):
        afd.p2p_send(_wire(logits_tokens=3), 42, 0, 0, SPEC)


def test_unknown_communicator_id_raises():
    with pytest.raises(KeyError, match="unknown communicator id 777"):
        afd.p2p_send([torch.randn(2, 8)], 777, 0, 0, "hidden:float32[8]")


def test_cpu_tensor_on_nccl_transport_raises():
    comm = _NcclView("attention", 1, (0,))
    with pytest.raises(ValueError, match="CPU tensor but rank 1's transport is NCCL"):
        check_wire_tensors(_wire(), WireSpec.parse(SPEC), None, comm, "afd.p2p_send")


def test_metadata_missing_for_stage_raises(attention_comm):
    with pytest.raises(RuntimeError, match="no token counts for stage 2"):
        afd.p2p_send(_wire(), 42, 0, 2, SPEC)


@pytest.mark.parametrize(
    ("total", "seq_lens", "peers", "expected"),
    [(7, (3, 4), 2, [3, 4]), (6, (), 3, [2, 2, 2]), (8, (8,), 2, [4, 4])],
)
def test_split_sizes(total, seq_lens, peers, expected):
    assert split_sizes(total, seq_lens, peers, "x") == expected


def test_uneven_even_split_fallback_raises():
    with pytest.raises(ValueError, match="uneven split.*7 tokens 2 ways"):
        split_sizes(7, (7,), 2, "afd.p2p_send_group")
    with pytest.raises(ValueError, match="shape mismatch"):
        split_sizes(7, (3, 3), 2, "afd.p2p_send_group")


# --- compiled code keeps the ops (real gloo processes) ------------------------------------------


def _compiled_exchange(rank: int, world: int) -> dict:
    from torch._inductor.utils import run_and_get_code

    spec_in, spec_out = "hidden:float32[8]", "ffn_out:float32[8]"
    if rank == 0:  # FFN: receive from both peers, compute, split back
        comm = AFDCommunicator("ffn", 0, (1, 2))
        comm.set_step({0: (3, 5)})
        register_communicator(comm, 0)

        def ffn(slots, w):
            (x,) = afd.p2p_recv_group(slots, 0, 0, 0, slots.shape[0], spec_in)
            return afd.p2p_send_group([torch.tanh(x @ w)], 0, 0, 0, spec_out)

        w = torch.eye(8) * 2
        _, code = run_and_get_code(torch.compile(ffn, backend="inductor", fullgraph=True), torch.empty(8, 0), w)
        return {"code": "\n".join(code)}
    comm = AFDCommunicator("attention", rank, (0,))
    n = 3 if rank == 1 else 5
    comm.set_step({0: (n,)})
    register_communicator(comm, 0)

    def attention(h):
        flat = (h * 1.5).reshape(-1, 8)
        tok = afd.p2p_send([flat], 0, 0, 0, spec_in)  # the token is only used to order the recv
        (out,) = afd.p2p_recv(tok, 0, 0, 0, flat.shape[0], spec_out)
        return out + 1

    h = torch.randn(n, 8, generator=torch.Generator().manual_seed(rank))
    out, code = run_and_get_code(torch.compile(attention, backend="inductor", fullgraph=True), h)
    expected = torch.tanh(h * 1.5 * 2) + 1
    return {"code": "\n".join(code), "err": float((out - expected).abs().max())}


def test_inductor_compiled_graph_still_calls_the_ops():
    res = run_local(_compiled_exchange, 3, timeout_s=300)
    assert "afd.p2p_recv_group" in res[0]["code"] and "afd.p2p_send_group" in res[0]["code"]
    for r in (1, 2):
        assert "afd.p2p_send" in res[r]["code"] and "afd.p2p_recv" in res[r]["code"]
        assert res[r]["err"] < 1e-6


@pytest.mark.parametrize("total,parts,sizes", [
    (5, 2, [3, 2]), (4, 2, [2, 2]), (0, 2, [0, 0]), (1, 4, [1, 0, 0, 0]), (7, 4, [2, 2, 2, 1]),
])
def test_group_token_sizes_follow_tensor_split(total, parts, sizes):
    from afd_compile.ops import group_token_sizes

    assert group_token_sizes(total, parts) == sizes
    assert [(total + parts - 1 - i) // parts for i in range(parts)] == sizes  # the graph's own-share formula
    assert [len(c) for c in torch.arange(total).tensor_split(parts)] == sizes
