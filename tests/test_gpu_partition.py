"""An FFN rank's exchange between captured pieces (issue 35), on one GPU: the backend's compiled
program (``PerLayout``) with ``eager_ops`` runs those ops outside its CUDA graphs, every call
(they read each step's per-peer sizes from the host), while the rest of the program is captured
and replayed. A stand-in op reads a host value at each call: under capture it would keep the value
it saw when captured. And a real FFN program (a split Llama) lowered and compiled as the backend
does, against the eager program, its exchange on a stand-in transport (one GPU has no peers).
Marked ``gpu`` (CI has no GPU); ``benchmarks/gpu_suite.sh one`` runs it."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from afd_compile.backend.compiled import PerLayout  # noqa: E402

#: what the stand-in op multiplies by: a host value, as the per-peer sizes are
FACTOR = {"value": 1.0}


@torch.library.custom_op("afdtest::scale_by_host", mutates_args=())
def scale_by_host(x: torch.Tensor) -> torch.Tensor:
    return x * FACTOR["value"]


@scale_by_host.register_fake
def _(x):
    return torch.empty_like(x)


class _Step(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x @ self.w)
        return torch.sigmoid(scale_by_host(y)) + 1


def _runs(eager_ops: tuple[str, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model = _Step().cuda()
    x = torch.randn(16, 64, device="cuda")
    program = torch.export.export(model, (x,)).module()
    compiled = PerLayout(program, f"test-{bool(eager_ops)}", True, True, "test", eager_ops=eager_ops)
    assert compiled.cudagraphs and compiled.eager_ops == eager_ops
    got, want = [], []
    for factor in (1.0, 1.0, 1.0, 2.0, -3.0):  # (the first calls warm up and record; then replays)
        FACTOR["value"] = factor
        got.append(compiled(("layout",), x).clone())
        want.append(model(x).detach())
    return got, want


def test_eager_ops_run_at_every_call_between_captured_pieces():
    got, want = _runs(("afdtest::scale_by_host",))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_without_them_the_graph_keeps_what_it_captured():
    # (the control: the same program captured whole replays the factor it was captured with, so
    # the test above would fail if its op were captured)
    got, want = _runs(())
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got[-1], want[-1], rtol=1e-2, atol=1e-2)


# --- a real FFN program between its captured pieces ---------------------------------------------


class _Transport:
    """The stand-in for ``dist.batch_isend_irecv`` on one GPU (no peers): each receive gets a
    seeded random tensor (the k-th receive of a run the k-th seed), each send is recorded. A run
    of the compiled program and of the eager one then see the same inputs and can be compared."""

    def __init__(self) -> None:
        self.count, self.sent = 0, []

    def __call__(self, ops: list) -> list:
        import torch.distributed as dist

        for op in ops:
            if op.op is dist.irecv:
                g = torch.Generator(device=op.tensor.device).manual_seed(self.count)
                op.tensor.copy_(torch.randn(op.tensor.shape, generator=g, device=op.tensor.device))
                self.count += 1
            else:
                self.sent.append(op.tensor.clone())
        return []


def test_a_split_ffn_program_runs_between_pieces_as_it_does_eagerly(monkeypatch):
    """The backend's lowering of a real FFN program (each send fused with the next receive, every
    receive into buffers) compiled with its exchange between CUDA graphs: it ran at all only once
    its receives returned tensors, not lists (torch 2.11's CUDA graph trees assert on a list
    input). Three steps with the peers' split changing under one compiled program (its exchange
    reads the sizes when it runs), every sent tensor against the eager program's."""
    import copy

    import torch.distributed as dist
    import torch.fx as fx
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from afd_compile.backend import ffn_step_ops
    from afd_compile.comm import AFDCommunicator, register_communicator
    from afd_compile.layout import AFDLayout
    from afd_compile.models import build_hf, export_lm
    from afd_compile.passes.fuse_exchange import fuse_send_recv
    from afd_compile.passes.recv_into import receive_into_buffers
    from afd_compile.split_api import split

    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=3)
    try:
        ffn = split(export_lm(build_hf("llama", num_layers=3)), layout=AFDLayout(2, 1)).ffn.cuda()
        prog = fx.GraphModule(ffn, copy.deepcopy(ffn.graph))
        assert len(fuse_send_recv(prog)) == 2 and len(receive_into_buffers(prog)) == 3
        compiled = PerLayout(prog, "test-split-ffn", True, True, "ffn", eager_ops=ffn_step_ops())
        comm = AFDCommunicator("ffn", 2, (0, 1), check_wire=False)  # (the tests' AFD_CHECK_WIRE=1: no headers here)
        register_communicator(comm, 0)
        carrier = torch.empty(8, 0, device="cuda")
        runs = {}
        for name, fn in (("eager", lambda: ffn(carrier)), ("pieces", lambda: compiled(("carriers", (8,)), carrier))):
            sent = []
            for split_ in ((3, 5), (5, 3), (3, 5), (8, 0), (1, 7)):  # (the first calls warm up and record)
                transport = _Transport()
                monkeypatch.setattr(dist, "batch_isend_irecv", transport)
                comm.set_step({0: split_})
                with torch.no_grad():
                    fn()
                torch.cuda.synchronize()
                sent.append(transport.sent)
            runs[name] = sent
        assert len(compiled.compiled) == 1
        for got, want in zip(runs["pieces"], runs["eager"], strict=True):
            assert [t.shape for t in got] == [t.shape for t in want]
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    finally:
        dist.destroy_process_group()


class _DeviceTransport:
    """A stand-in for ``dist.batch_isend_irecv`` whose transfers are device copies, so a captured
    graph's replays move data as NCCL's captured kernels would: the j-th transfer of the i-th
    batched call of a step copies from (a receive) or into (a send) a tensor kept per (i, j,
    shape). ``refill(step)`` gives every receive source the step's seeded values in place."""

    def __init__(self, calls_per_step: int) -> None:
        self.calls_per_step, self.call, self.step = calls_per_step, 0, 0
        self.sources: dict[tuple, torch.Tensor] = {}
        self.sinks: dict[tuple, torch.Tensor] = {}

    def _fill(self, key: tuple, t: torch.Tensor) -> None:
        g = torch.Generator(device=t.device).manual_seed(hash((self.step, key)) % (1 << 31))
        t.copy_(torch.randn(t.shape, generator=g, device=t.device))

    def refill(self, step: int) -> None:
        self.step = step
        for key, t in self.sources.items():
            self._fill(key, t)

    def __call__(self, ops: list) -> list:
        import torch.distributed as dist

        i, self.call = self.call % self.calls_per_step, self.call + 1
        for j, op in enumerate(ops):
            key = (i, j, tuple(op.tensor.shape))
            if op.op is dist.irecv:
                if key not in self.sources:
                    self.sources[key] = torch.empty_like(op.tensor)
                    self._fill(key, self.sources[key])
                op.tensor.copy_(self.sources[key])
            else:
                self.sinks.setdefault(key, torch.empty_like(op.tensor)).copy_(op.tensor)
        return []


def test_step_graphs_compile_per_bucket_capture_per_peer_sizes_and_replay_the_exchange(monkeypatch):
    """ffn_capture="all": the lowered FFN program compiled once for symbolic rows and captured
    whole once per tuple of the peers' sizes (PerLayout(step_graphs=True)); replays move each
    step's data (the stand-in's copies are in the graphs). Every step's sent tensors against the
    same program run eagerly."""
    import copy

    import torch.distributed as dist
    import torch.fx as fx
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from afd_compile.comm import AFDCommunicator, register_communicator
    from afd_compile.layout import AFDLayout
    from afd_compile.models import build_hf, export_lm
    from afd_compile.passes.fuse_exchange import fuse_send_recv
    from afd_compile.passes.recv_into import receive_into_buffers
    from afd_compile.split_api import split

    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=3)
    try:
        ffn = split(export_lm(build_hf("llama", num_layers=3)), layout=AFDLayout(2, 1)).ffn.cuda()
        prog = fx.GraphModule(ffn, copy.deepcopy(ffn.graph))
        fuse_send_recv(prog)
        receive_into_buffers(prog)  # (4 batched calls a step: the receive, two fused, the last send)
        eager = fx.GraphModule(prog, copy.deepcopy(prog.graph))
        compiled = PerLayout(prog, "test-step-graphs", True, True, "ffn", step_graphs=True)
        assert compiled.step_graphs and not compiled.eager_ops
        comm = AFDCommunicator("ffn", 2, (0, 1), check_wire=False)
        register_communicator(comm, 0)
        steps = [(3, 5), (5, 3), (3, 5), (8, 0), (3, 5), (2, 14), (5, 3), (2, 14), (8, 0)]
        runs = {}
        for name in ("eager", "graphs"):
            transport = _DeviceTransport(4)
            monkeypatch.setattr(dist, "batch_isend_irecv", transport)
            sent = []
            for i, split_ in enumerate(steps):
                transport.refill(i)
                comm.set_step({0: split_})
                carrier = torch.empty(sum(split_), 0, device="cuda")
                with torch.no_grad():
                    if name == "eager":
                        eager(carrier)
                    else:
                        compiled((("carriers", (sum(split_),)), ("peers", split_)), carrier)
                torch.cuda.synchronize()
                sent.append({k: v.clone() for k, v in transport.sinks.items()})
            runs[name] = sent
        assert len(compiled.compiled) == 1 and len(compiled.graphs) == 4  # (symbolic rows) four tuples
        for i, (got, want) in enumerate(zip(runs["graphs"], runs["eager"], strict=True)):
            assert got.keys() == want.keys(), i
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4, msg=f"step {i} {k}")
    finally:
        dist.destroy_process_group()
