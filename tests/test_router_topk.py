"""``afd::router_topk`` and the pass that gives an MoE router's top-k to it (issue 34): on CPU the
op is ``torch.topk`` (the Triton kernel is checked on a GPU in test_gpu_moe_kernel.py)."""

from __future__ import annotations

import torch

from afd_compile.compare import max_rel_err
from afd_compile.models import build_hf, export_lm
from afd_compile.passes.moe import recognise_moe
from afd_compile.passes.moe.topk import use_router_topk
from afd_compile.router_topk import applies, router_topk

TOPK = torch.ops.afd.router_topk.default


def test_the_op_is_torch_topk_off_cuda_and_keeps_its_shapes_under_export():
    x = torch.randn(7, 60, generator=torch.Generator().manual_seed(0))
    values, indices = router_topk(x, 8)
    want = torch.topk(x, 8, dim=-1)
    assert torch.equal(values, want.values) and torch.equal(indices, want.indices) and indices.dtype == torch.int64
    assert not applies(x, 8)  # (CPU: torch.topk itself)

    class Router(torch.nn.Module):
        def forward(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return router_topk(s.softmax(-1), 2)

    ep = torch.export.export(Router(), (x,), dynamic_shapes={"s": {0: torch.export.Dim("t")}})
    assert [n.target for n in ep.graph.nodes if n.op == "call_function"].count(TOPK) == 1
    v, i = ep.module()(x[:3])
    assert v.shape == (3, 2) and i.shape == (3, 2) and i.dtype == torch.int64


def test_a_recognised_routers_top_k_is_replaced_and_the_program_unchanged():
    for ep in (export_lm(build_hf("qwen3_moe", experts_implementation="grouped_mm")),
               export_lm(build_hf("deepseek_v3", num_layers=2, experts_implementation="grouped_mm"))):
        gm = ep.module()
        blocks = len(recognise_moe(gm))
        before = sum(n.target == torch.ops.aten.topk.default for n in gm.graph.nodes)
        done = use_router_topk(gm)
        assert len(done) >= blocks >= 1 and sum(n.target == TOPK for n in gm.graph.nodes) == len(done)
        assert sum(n.target == torch.ops.aten.topk.default for n in gm.graph.nodes) == before - len(done)
        ids = torch.randint(1, 128, (3, 5), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            assert max_rel_err(gm(ids), ep.module()(ids)) <= 1e-6


def test_a_top_k_that_feeds_no_experts_op_is_left():
    class NotARouter(torch.nn.Module):
        def forward(self, s: torch.Tensor) -> torch.Tensor:
            return s.topk(3, dim=-1).indices.float().sum(-1)

    gm = torch.export.export(NotARouter(), (torch.randn(4, 16),)).module()
    assert use_router_topk(gm) == []
