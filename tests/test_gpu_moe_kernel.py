"""The fused (Triton) path of ``afd::moe_experts`` on a GPU (issue 34): equal to the reference
(fp32, on the same bf16 operands) for each activation, bias and routing-weight placement, at
token counts from one to several blocks per expert, and captured whole by a CUDA graph whose
replays take new routing. Marked ``gpu``: ``benchmarks/gpu_suite.sh moe`` runs it (CI has no GPU)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
triton = pytest.importorskip("triton")

from afd_compile.moe import implementation, moe_experts, reference  # noqa: E402

H, INTER, E, K = 256, 192, 16, 4


def _operands(t: int, gated: bool, bias: bool, seed: int = 0):
    g = torch.Generator("cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

    x = randn(t, H)
    ids = torch.argsort(torch.rand(t, E, device="cuda", generator=g), dim=1)[:, :K]
    w = torch.rand(t, K, device="cuda", generator=g).to(torch.bfloat16)
    gu = randn(E, (2 if gated else 1) * INTER, H, scale=H ** -0.5)
    dn = randn(E, H, INTER, scale=INTER ** -0.5)
    return x, ids, w, gu, dn, randn(E, gu.shape[1]) if bias else None, randn(E, H) if bias else None


@pytest.mark.parametrize("t", [1, 7, 64, 160, 300])  # (each tile config of moe_triton.config)
@pytest.mark.parametrize("act,gated,first,bias", [("silu", True, False, False), ("gelu", True, True, True),
                                                  ("relu", False, False, True), ("swiglu_oai", True, False, True),
                                                  ("relu2", False, False, False)])
def test_fused_equals_the_reference(t, act, gated, first, bias):
    ops = _operands(t, gated, bias)
    assert implementation(ops[0], ops[3], ops[4]) == "fused"
    got = moe_experts(*ops, activation=act, gated=gated, weight_first=first).float()
    want = reference(*(o.float() if o is not None and o.is_floating_point() else o for o in ops), act, gated, first)
    assert float((got - want).abs().max() / want.abs().max()) <= 2e-2


def test_a_cuda_graph_captures_it_and_replays_new_routing():
    x, ids, w, gu, dn, _, _ = _operands(32, True, False)
    static = [x.clone(), ids.clone(), w.clone()]
    moe_experts(*static, gu, dn)  # (compiles the kernels outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts(*static, gu, dn)
    for seed in (1, 2):
        nx, nids, nw, *_ = _operands(32, True, False, seed)
        for buf, new in zip(static, (nx, nids, nw), strict=True):
            buf.copy_(new)
        graph.replay()
        assert torch.equal(out, moe_experts(nx, nids, nw, gu, dn))


@pytest.mark.parametrize("t", [7, 300])
@pytest.mark.parametrize("tiles", [2, 3])
def test_the_down_kernel_over_several_tiles_per_program_is_the_same(t, tiles):
    # (3 does not divide the tile count: the last program's extra tiles are masked off)
    from afd_compile.moe_triton import config, fused

    x, ids, w, gu, dn, bgu, bdn = _operands(t, True, True)
    cfg = config(t * K, E)
    many = {**cfg, "down": {**cfg.get("down", {}), "TILES": tiles}}
    assert torch.equal(fused(x, ids, w, gu, dn, bgu, bdn, "silu", True, False, cfg=many),
                       fused(x, ids, w, gu, dn, bgu, bdn, "silu", True, False, cfg=cfg))


@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (7, 60, 4), (1024, 128, 8), (300, 256, 8), (33, 512, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_topk_equals_torch_topk(t, e, k, dtype):
    from afd_compile.router_topk import applies, router_topk

    x = torch.randn(t, e, device="cuda", generator=torch.Generator("cuda").manual_seed(t)).to(dtype)
    assert applies(x, k)
    values, indices = router_topk(x, k)
    want = torch.topk(x, k, dim=-1)
    assert torch.equal(values, want.values) and indices.dtype == torch.int64
    assert torch.equal(x.gather(1, indices), values)  # (bf16 may tie: each index holds its value)
    if dtype == torch.float32:
        assert torch.equal(indices, want.indices)


def test_router_topk_ties_nan_and_masked_scores():
    from afd_compile.router_topk import router_topk

    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, 1.0, 1.0, 0.0], [nan, 2.0, 3.0, 3.0], [-inf, -inf, 5.0, -inf]], device="cuda")
    values, indices = router_topk(x, 3)
    assert indices.tolist() == [[0, 1, 2], [0, 2, 3], [2, 0, 1]]  # ties to the lower index, NaN first
    assert values[0].tolist() == [1.0, 1.0, 1.0] and values[1, 1:].tolist() == [3.0, 3.0]
    assert values[1, 0].isnan() and values[2].tolist() == [5.0, -inf, -inf]


@pytest.mark.parametrize("t,e,k", [(1, E, K), (7, E, K), (300, E, K), (1100, E, K), (1024, 128, 8), (3000, 60, 4)])
def test_align_in_one_program_lays_out_what_the_three_kernels_do(t, e, k):
    # each path forced by moving the one-program limit
    from afd_compile import moe_triton

    ids = torch.argsort(torch.rand(t, e, device="cuda", generator=torch.Generator("cuda").manual_seed(t)), dim=1)[:, :k]
    for block_m in (16, 64, 128):
        got = []
        limit = moe_triton.ALIGN_ONE_MAX
        for one in (True, False):
            moe_triton.ALIGN_ONE_MAX = 1 << 30 if one else 0
            try:
                got.append(moe_triton.align(ids, e, block_m))
            finally:
                moe_triton.ALIGN_ONE_MAX = limit
        (rows_a, experts_a), (rows_b, experts_b) = got
        assert torch.equal(experts_a, experts_b)  # each block's expert
        for x in range(e + 1):  # each expert's pairs (their order within its run follows the atomics)
            blocks = (experts_a == x).repeat_interleave(block_m)
            want = (ids.reshape(-1) == x).nonzero().flatten().int() if x < e else torch.empty(0, dtype=torch.int32,
                                                                                                device="cuda")
            real = rows_a[blocks][rows_a[blocks] < t * k]
            assert torch.equal(real.sort().values, want), (x, block_m)
            assert torch.equal(rows_a[blocks].sort().values, rows_b[blocks].sort().values)


@pytest.mark.parametrize("t", [7, 64, 300])
def test_tma_weight_loads_give_the_pointer_loads_result(t):
    from afd_compile.moe_triton import config, fused

    x, ids, w, gu, dn, bgu, bdn = _operands(t, True, True)
    cfg = config(t * K, E)
    got = fused(x, ids, w, gu, dn, bgu, bdn, "silu", True, False, cfg={**cfg, "TMA": True}).float()
    want = fused(x, ids, w, gu, dn, bgu, bdn, "silu", True, False, cfg={**cfg, "TMA": False}).float()
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-2


@pytest.mark.parametrize("t,k,h", [(1, 4, 256), (300, 8, 2048), (5, 2, 1000)])
def test_token_sum_is_torchs_sum_and_cast(t, k, h):
    from afd_compile.moe_triton import token_sum

    y = torch.randn(t * k, h, device="cuda", generator=torch.Generator("cuda").manual_seed(t)).to(torch.bfloat16)
    want = y.view(t, k, h).sum(dim=1, dtype=torch.float32).to(torch.bfloat16)
    ids = torch.zeros(t, k, dtype=torch.int64, device="cuda")
    got = token_sum(y, ids, 4)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-2)  # (fp32 sums in another order: a bf16 ulp)
    assert torch.equal(got, token_sum(y, ids, 4))  # the same bits every run


@pytest.mark.parametrize("t", [7, 300, 1100])  # (align in one program, and in three kernels)
def test_a_pair_outside_the_experts_takes_none_and_adds_nothing(t):
    # an FFN rank's fixed slot marks its padded rows with id E: they read no weights, add nothing
    x, ids, w, gu, dn, bgu, bdn = _operands(t, True, True)
    ids = ids.clone()
    ids[t // 2:] = E  # the rows past the real ones
    ids[0, 0] = -1  # and one pair of a real row
    got = moe_experts(x, ids, w, gu, dn, bgu, bdn).float()
    want = reference(x.float(), ids, w.float(), gu.float(), dn.float(), bgu.float(), bdn.float(), "silu", True, False)
    assert torch.equal(got[t // 2:], torch.zeros_like(got[t // 2:]))
    assert float((got - want).abs().max() / want.abs().max()) <= 2e-2
