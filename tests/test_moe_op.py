"""The afd::moe_experts op (issue 34): its reference equals transformers' eager experts, its
grouped path equals its reference, its fake keeps it one node through export."""

from __future__ import annotations

import pytest
import torch

from afd_compile import moe


def _hf_block(seed: int = 0, **overrides):
    import transformers
    from transformers.models.qwen3_moe import modeling_qwen3_moe as q

    config = transformers.Qwen3MoeConfig(hidden_size=64, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True,
                                         experts_implementation="eager", **overrides)
    torch.manual_seed(seed)
    block = q.Qwen3MoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return block.eval()


@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_the_reference_equals_transformers_eager_experts(tokens):
    block = _hf_block()
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        _, weights, ids = block.gate(x)
        want = block.experts(x, ids, weights)
        got = moe.moe_experts(x, ids, weights, block.experts.gate_up_proj, block.experts.down_proj)
    assert (got - want).abs().max() / want.abs().max() < 1e-6


def _random_case(tokens: int, gated: bool, bias: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(7 * tokens + gated + 2 * bias)
    e, h, i, k = 6, 32, 16, 2
    n = 2 * i if gated else i
    x = torch.randn(tokens, h, generator=g, dtype=dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]) if tokens else \
        torch.empty(0, k, dtype=torch.int64)
    w = torch.rand(tokens, k, generator=g, dtype=dtype)
    wgu, wd = torch.randn(e, n, h, generator=g, dtype=dtype) * 0.2, torch.randn(e, h, i, generator=g, dtype=dtype) * 0.2
    bgu = torch.randn(e, n, generator=g, dtype=dtype) if bias else None
    bd = torch.randn(e, h, generator=g, dtype=dtype) if bias else None
    return x, ids, w, wgu, wd, bgu, bd


@pytest.mark.parametrize("tokens", [0, 1, 9])
@pytest.mark.parametrize(("gated", "bias", "activation", "weight_first"), [
    (True, False, "silu", False), (False, True, "gelu", False), (True, True, "gelu_tanh", True),
    (False, False, "relu", True), (False, True, "relu2", False),
])
def test_the_grouped_path_equals_the_reference(tokens, gated, bias, activation, weight_first):
    case = _random_case(tokens, gated, bias)
    want = moe.reference(*case, activation, gated, weight_first)
    try:
        got = moe.grouped(*case, activation, gated, weight_first)
    except (RuntimeError, NotImplementedError) as e:  # a torch whose CPU build has no _grouped_mm
        pytest.skip(f"torch._grouped_mm on CPU: {e}")
    scale = max(float(want.abs().max()) if want.numel() else 0.0, 1.0)
    assert got.shape == want.shape and (not want.numel() or float((got - want).abs().max()) / scale < 1e-5)


def test_the_op_stays_one_node_through_export():
    block = _hf_block()

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block

        def forward(self, x):
            _, w, ids = self.block.gate(x)
            return moe.moe_experts(x, ids, w, self.block.experts.gate_up_proj, self.block.experts.down_proj)

    x = torch.randn(5, 64)
    ep = torch.export.export(Experts(), (x,), dynamic_shapes=({0: torch.export.Dim("tokens", min=1)},))
    ops = [n for n in ep.graph.nodes if n.target == torch.ops.afd.moe_experts.default]
    assert len(ops) == 1
    y = torch.randn(9, 64)
    assert torch.allclose(ep.module()(y), Experts()(y), rtol=0, atol=0)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"activation": "swish"}, "activation 'swish' is not one of"),
    ({"w_down": torch.zeros(8, 64, 16)}, "expected w_gate_up [E, 2 I, H=64] and w_down [E, H, I]"),
])
def test_a_misshapen_call_is_refused_naming_the_op(kwargs, message):
    block = _hf_block()
    x = torch.randn(3, 64)
    _, w, ids = block.gate(x)
    args = {"w_gate_up": block.experts.gate_up_proj, "w_down": block.experts.down_proj, **kwargs}
    with pytest.raises(ValueError, match="afd::moe_experts: " + message.replace("[", r"\[")):
        moe.moe_experts(x, ids, w, **args)


@pytest.mark.parametrize("impl", ["reference", "grouped"])
def test_a_pair_outside_the_experts_takes_none_and_adds_nothing(impl):
    # an FFN rank's fixed slot marks its padded rows with id E (or any id outside [0, E)): no
    # expert is computed for them and they add nothing to their token's sum
    x, ids, w, wgu, wd, _, _ = _random_case(9, True, False)
    e = wgu.shape[0]
    masked = ids.clone()
    masked[5:] = e
    masked[0, 1] = -1
    took = (masked >= 0) & (masked < e)
    want = moe.reference(x, masked.clamp(0, e - 1), w * took, wgu, wd, None, None, "silu", True, False)
    try:
        got = getattr(moe, impl)(x, masked, w, wgu, wd, None, None, "silu", True, False)
    except (RuntimeError, NotImplementedError) as err:  # a torch whose CPU build has no _grouped_mm
        pytest.skip(f"torch._grouped_mm on CPU: {err}")
    assert torch.equal(got[5:], torch.zeros_like(got[5:]))
    assert float((got - want).abs().max()) / float(want.abs().max()) < 1e-6


def _ep_rank(rank: int, world: int, weight_first: bool) -> dict:
    """One rank of expert parallelism over gloo: its own tokens dispatched to the experts' ranks,
    the op over this rank's experts, the partials combined back; against the op over all experts."""
    import torch.distributed as dist

    from afd_compile.collectives import ep_combine, ep_dispatch
    from afd_compile.comm import register_group

    register_group(0, dist.group.WORLD)
    g = torch.Generator().manual_seed(0)  # (the same experts on every rank)
    e, hidden, inter, k = 4, 8, 6, 2
    w_gate_up, w_down = torch.randn(e, 2 * inter, hidden, generator=g), torch.randn(e, hidden, inter, generator=g)
    b_gate_up, b_down = torch.randn(e, 2 * inter, generator=g), torch.randn(e, hidden, generator=g)
    g.manual_seed(1 + rank)  # (each rank its own tokens)
    x = torch.randn(5, hidden, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(5)])
    w = torch.rand(5, k, generator=g)
    xr, wr, local, valid, counts = ep_dispatch([x, w], ids, 0, e, world)
    per = e // world
    mine = slice(rank * per, (rank + 1) * per)
    y = moe.moe_experts(xr, local, wr * valid, w_gate_up[mine], w_down[mine], b_gate_up[mine], b_down[mine], "silu",
                        True, weight_first)
    out = ep_combine(y, ids, counts, 0, e)
    want = moe.moe_experts(x, ids, w, w_gate_up, w_down, b_gate_up, b_down, "silu", True, weight_first)
    return {"err": float((out - want).abs().max() / want.abs().max()), "slots": int(valid.numel()),
            "local": int(valid.sum()), "outside": bool(torch.equal(local[~valid], torch.full_like(local[~valid], per))),
            "inside": bool(((local[valid] >= 0) & (local[valid] < per)).all())}


@pytest.mark.parametrize("weight_first", [False, True])
def test_expert_parallel_dispatch_leaves_other_ranks_slots_to_no_expert(weight_first):
    """A token dispatched to a rank for one of its experts carries its other slots too: their local id
    is outside this rank's experts, so the op computes no row for them (an id of 0 ran expert 0 on
    them, and with the routing weight applied first and expert biases, added its biases)."""
    from afd_compile.runtime import run_local

    res = run_local(_ep_rank, 2, weight_first, timeout_s=120)
    for rank, r in res.items():
        assert r["err"] < 1e-5 and r["outside"] and r["inside"], (rank, r)
        assert r["local"] < r["slots"], (rank, r)  # (some received slots belong to the other rank)
