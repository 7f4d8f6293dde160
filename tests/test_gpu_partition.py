"""An FFN rank's exchange between captured pieces (issue 35), on one GPU: the backend's compiled
program (``PerLayout``) with ``eager_ops`` runs those ops outside its CUDA graphs, every call
(they read each step's per-peer sizes from the host), while the rest of the program is captured
and replayed. A stand-in op reads a host value at each call: under capture it would keep the value
it saw when captured. Marked ``gpu`` (CI has no GPU); ``benchmarks/gpu_suite.sh one`` runs it."""

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
