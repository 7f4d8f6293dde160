"""Each sharding rule on a tiny graph: the split dim in, the split dim out (or the refusal), and
the constant size arguments it divides. The rules are ``afd_compile.passes.shard.rules.RULES``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from afd_compile.passes.shard import RULES, ArgFix, ShardError
from afd_compile.passes.shard.rules import Replicate

aten = torch.ops.aten


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def _apply(fn, shapes, split, target, parts=2):
    """Export ``fn`` on tensors of ``shapes``, find the node of ``target`` and run its rule with
    input ``i`` split along ``split[i]`` (inputs not in ``split`` are unsplit)."""
    with torch.no_grad():
        gm = torch.export.export(_Fn(fn), tuple(torch.randn(s) for s in shapes)).module()
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    node = next(n for n in gm.graph.nodes if n.target == target)
    sdim = {inputs[i]: d for i, d in split.items()}
    for n in gm.graph.nodes:  # ops between an input and the node (getitem of a chunk) keep its dim
        if n not in sdim and n is not node and n.op == "call_function" and n.args and n.args[0] in sdim:
            sdim[n] = sdim[n.args[0]]
    fixes: list[ArgFix] = []
    rule = RULES[target]
    return rule.fn(node, sdim, parts, fixes), [(f.index, f.old, f.new) for f in fixes], rule.kind


CASES = [  # id, fn, input shapes, split dims, op, expected out dim, expected fixes
    ("add_broadcast_size_1", lambda x, y: x + y, [(2, 4, 8), (2, 1, 8)], {0: 1}, aten.add.Tensor, 1, []),
    ("silu", lambda x: F.silu(x), [(2, 4, 8)], {0: 2}, aten.silu.default, 2, []),
    ("mean_other_dim", lambda x: x.mean(-1, keepdim=True), [(2, 4, 8)], {0: 1}, aten.mean.dim, 1, []),
    ("mean_drops_a_dim", lambda x: x.mean(0), [(2, 4, 8)], {0: 2}, aten.mean.dim, 1, []),
    ("softmax_other_dim", lambda x: x.softmax(-1), [(2, 4, 8)], {0: 1}, aten.softmax.int, 1, []),
    ("transpose", lambda x: x.transpose(1, 2), [(2, 4, 8)], {0: 1}, aten.transpose.int, 2, []),
    ("permute", lambda x: x.permute(0, 2, 1, 3), [(2, 4, 3, 5)], {0: 1}, aten.permute.default, 2, []),
    ("mT_last_two", lambda x: x.mT, [(2, 4, 3, 5)], {0: 3}, aten.mT.default, 2, []),
    ("mT_other_dim", lambda x: x.mT, [(2, 4, 3, 5)], {0: 1}, aten.mT.default, 1, []),
    ("mH_real", lambda x: x.mH, [(2, 4, 3, 5)], {0: 2}, aten.mH.default, 3, []),
    ("t_2d", lambda x: x.t(), [(4, 6)], {0: 0}, aten.t.default, 1, []),
    ("numpy_T", lambda x: x.T, [(2, 4, 6)], {0: 0}, aten.numpy_T.default, 2, []),
    ("unsqueeze_before", lambda x: x.unsqueeze(0), [(2, 4, 8)], {0: 1}, aten.unsqueeze.default, 2, []),
    ("cat_other_dim", lambda x, y: torch.cat([x, y], -1), [(2, 4, 8), (2, 4, 8)], {0: 1, 1: 1},
     aten.cat.default, 1, []),
    ("stack_new_last_dim", lambda x, y: torch.stack([x, y], -1), [(2, 4, 8), (2, 4, 8)], {0: 1, 1: 1},
     aten.stack.default, 1, []),
    ("flatten_outer", lambda x: x.flatten(2, 3), [(2, 3, 4, 8)], {0: 2}, aten.flatten.using_ints, 2, []),
    ("layer_norm_trailing", lambda x: F.layer_norm(x, (8,)), [(2, 4, 8)], {0: 1}, aten.layer_norm.default, 1, []),
    ("view_heads_divided", lambda x: x.view(2, 5, 4, 16), [(2, 5, 64)], {0: 2}, aten.view.default, 2,
     [(2, 4, 2)]),
    ("view_heads_minus_one_kept", lambda x: x.view(2, 5, -1, 16), [(2, 5, 64)], {0: 2}, aten.view.default, 2, []),
    ("expand_kv_heads", lambda x: x.expand(2, 4, 3, 8), [(2, 4, 1, 8)], {0: 1}, aten.expand.default, 1,
     [(1, 4, 2)]),
    ("new_empty_split_size", lambda x: x.new_empty([2, 4, 8]), [(2, 4, 8)], {0: 1}, aten.new_empty.default, 1,
     [(1, 4, 2)]),
    ("matmul_heads", lambda a, b: a @ b, [(2, 4, 5, 8), (2, 4, 8, 5)], {0: 1, 1: 1}, aten.matmul.default, 1, []),
    ("sdpa_heads", lambda q, k, v: F.scaled_dot_product_attention(q, k, v), [(1, 4, 5, 8)] * 3,
     {0: 1, 1: 1, 2: 1}, aten.scaled_dot_product_attention.default, 1, []),
    ("index_after_split", lambda x, i: x[:, :, i.long()], [(2, 4, 6), (3,)], {0: 1}, aten.index.Tensor, 1, []),
    ("select_other_dim", lambda x: x[:, :, 0], [(2, 4, 6)], {0: 1}, aten.select.int, 1, []),
    ("chunk_other_dim", lambda x: x.chunk(2, -1)[0], [(2, 4, 8)], {0: 1}, aten.chunk.default, 1, []),
    ("repeat_interleave_heads", lambda x: x.repeat_interleave(2, dim=1), [(2, 4, 5, 8)], {0: 1},
     aten.repeat_interleave.self_int, 1, []),
    ("mul_in_place", lambda x: x.contiguous().mul_(0.25), [(2, 4, 8)], {0: 1}, aten.mul_.Tensor, 1, []),
    ("view_as_complex_heads", lambda x: torch.view_as_complex(x), [(2, 4, 3, 2)], {0: 1},
     aten.view_as_complex.default, 1, []),
    ("view_as_real_heads", lambda x: torch.view_as_real(torch.view_as_complex(x)), [(2, 4, 3, 2)], {0: 1},
     aten.view_as_real.default, 1, []),
    ("select_before_split_dim", lambda x: x[0], [(3, 4, 8)], {0: 1}, aten.select.int, 0, []),
    ("unbind_before_split_dim", lambda x: x.unbind(0)[1], [(3, 4, 8)], {0: 1}, aten.unbind.int, 0, []),
    ("squeeze_before_split_dim", lambda x: x.squeeze(0), [(1, 4, 8)], {0: 1}, aten.squeeze.dim, 0, []),
    ("unflatten_heads_divided", lambda x: x.unflatten(-1, (4, 16)), [(2, 5, 64)], {0: 2}, aten.unflatten.int, 2,
     [(0, 4, 2)]),
    ("unflatten_before_split_dim", lambda x: x.unflatten(0, (2, 1)), [(2, 5, 64)], {0: 2}, aten.unflatten.int, 3,
     []),
    ("einsum_scores_keep_heads", lambda q, k: torch.einsum("bhid,bhjd->bhij", q, k), [(2, 4, 5, 8)] * 2,
     {0: 1, 1: 1}, aten.einsum.default, 1, []),
    ("einsum_moves_heads", lambda a, v: torch.einsum("bhij,bhjd->bihd", a, v), [(2, 4, 5, 5), (2, 4, 5, 8)],
     {0: 1, 1: 1}, aten.einsum.default, 2, []),
    ("einsum_ellipsis", lambda q, k: torch.einsum("...id,...jd->...ij", q, k), [(2, 4, 5, 8)] * 2, {0: 1, 1: 1},
     aten.einsum.default, 1, []),
    ("einsum_broadcast_operand", lambda a, m: torch.einsum("bhij,ij->bhij", a, m), [(2, 4, 5, 5), (5, 5)], {0: 1},
     aten.einsum.default, 1, []),
    # the ops of a chunked delta rule (Qwen3.5's linear attention), each along a dim other than the heads'
    ("pad_the_sequence", lambda x: F.pad(x, (0, 0, 0, 3)), [(2, 4, 5, 8)], {0: 1}, aten.pad.default, 1, []),
    ("constant_pad_nd_last", lambda x: aten.constant_pad_nd(x, [0, 2]), [(2, 4, 8)], {0: 1},
     aten.constant_pad_nd.default, 1, []),
    ("cumsum_other_dim", lambda x: x.cumsum(-1), [(2, 4, 8)], {0: 1}, aten.cumsum.default, 1, []),
    ("tril_last_two", lambda x: x.tril(), [(2, 4, 5, 5)], {0: 1}, aten.tril.default, 1, []),
    ("zeros_like_follows", lambda x: torch.zeros_like(x), [(2, 4, 8)], {0: 1}, aten.zeros_like.default, 1, []),
    ("tensor_split_other_dim", lambda x: x.tensor_split([2], 2)[1], [(2, 4, 5)], {0: 1},
     aten.tensor_split.indices, 1, []),
    ("solve_triangular_heads", lambda a, b: torch.linalg.solve_triangular(a, b, upper=False),
     [(2, 4, 5, 5), (2, 4, 5, 3)], {0: 1, 1: 1}, aten.linalg_solve_triangular.default, 1, []),
]


@pytest.mark.parametrize(("fn", "shapes", "split", "op", "dim", "fixes"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_rule_follows_the_split_dim(fn, shapes, split, op, dim, fixes):
    got, got_fixes, kind = _apply(fn, shapes, split, op)
    assert got == dim
    assert got_fixes == fixes
    assert kind == ("reshape" if op in (aten.view.default, aten.expand.default, aten.new_empty.default,
                                        aten.unflatten.int)
                    else "elementwise" if op in (aten.add.Tensor, aten.silu.default, aten.mul_.Tensor) else "op")


REFUSED = [  # id, fn, shapes, split, op, message
    ("add_unsplit_spans_split_dim", lambda x, y: x + y, [(2, 4, 8), (4, 8)], {0: 1}, aten.add.Tensor,
     "is not split but spans the split dim"),
    ("add_split_along_different_dims", lambda x, y: x + y, [(4, 4), (4, 4)], {0: 0, 1: 1}, aten.add.Tensor,
     "split along different dims"),
    ("mean_over_split_dim", lambda x: x.mean(-1), [(2, 4, 8)], {0: 2}, aten.mean.dim, "reduces over the split dim"),
    ("softmax_over_split_dim", lambda x: x.softmax(-1), [(2, 4, 8)], {0: 2}, aten.softmax.int,
     "reduces over the split dim"),
    ("cat_along_split_dim", lambda x, y: torch.cat([x, y], 1), [(2, 4, 8), (2, 4, 8)], {0: 1, 1: 1},
     aten.cat.default, "works along the split dim"),
    ("cat_split_with_unsplit", lambda x, y: torch.cat([x, y], -1), [(2, 4, 8), (2, 4, 8)], {0: 1},
     aten.cat.default, "mixes split and unsplit inputs"),
    ("flatten_split_inner", lambda x: x.flatten(2, 3), [(2, 3, 4, 8)], {0: 3}, aten.flatten.using_ints,
     "as an inner dim"),
    ("layer_norm_over_split", lambda x: F.layer_norm(x, (8,)), [(2, 4, 8)], {0: 2}, aten.layer_norm.default,
     r"normalises over dims \[2\], which hold the split dim 2"),
    ("view_heads_not_divisible", lambda x: x.view(2, 5, 3, 16), [(2, 5, 48)], {0: 2}, aten.view.default,
     "which 2 ranks cannot divide"),
    ("matmul_one_side_split", lambda a, b: a @ b, [(2, 4, 5, 8), (2, 4, 8, 5)], {0: 1}, aten.matmul.default,
     "both operands split along the same batch (head) dim"),
    ("sdpa_split_head_dim", lambda q, k, v: F.scaled_dot_product_attention(q, k, v), [(1, 4, 5, 8)] * 3,
     {0: 3, 1: 3, 2: 3}, aten.scaled_dot_product_attention.default, "must be split along the heads dim"),
    ("einsum_sums_over_split_subscript", lambda x, w: torch.einsum("bsh,ho->bso", x, w), [(2, 5, 8), (8, 4)],
     {0: 2, 1: 0}, aten.einsum.default, "sums over the split subscript 'h'"),
    ("einsum_unsplit_operand_spans_it", lambda q, k: torch.einsum("bhid,bhjd->bhij", q, k), [(2, 4, 5, 8)] * 2,
     {0: 1}, aten.einsum.default, "is not split but spans the split subscript 'h'"),
    ("einsum_split_along_different_subscripts", lambda q, k: torch.einsum("bhid,bhjd->bhij", q, k),
     [(2, 4, 5, 8)] * 2, {0: 1, 1: 2}, aten.einsum.default, "split along different subscripts"),
    ("unflatten_heads_not_divisible", lambda x: x.unflatten(-1, (3, 16)), [(2, 5, 48)], {0: 2},
     aten.unflatten.int, "2 ranks cannot divide its outer size 3"),
    ("view_folds_split_heads_into_batch", lambda x: x.view(2, 20, 16), [(2, 5, 64)], {0: 2}, aten.view.default,
     "no output dim starts where it does"),
    ("view_as_complex_pairs_the_split_dim", lambda x: torch.view_as_complex(x), [(2, 4, 2)], {0: 2},
     aten.view_as_complex.default, "pairs the last dim, which is the split dim"),
    ("pad_the_split_dim", lambda x: F.pad(x, (0, 0, 1, 1)), [(2, 4, 8)], {0: 1}, aten.pad.default,
     "pads the split dim 1"),
    ("cumsum_over_split_dim", lambda x: x.cumsum(1), [(2, 4, 8)], {0: 1}, aten.cumsum.default,
     "works along the split dim"),
    ("tril_over_split_dim", lambda x: x.tril(), [(2, 4, 5, 5)], {0: 2}, aten.tril.default,
     "masks over the split dim 2"),
]


@pytest.mark.parametrize(("fn", "shapes", "split", "op", "message"), [c[1:] for c in REFUSED],
                         ids=[c[0] for c in REFUSED])
def test_rule_refuses_what_a_slice_cannot_compute(fn, shapes, split, op, message):
    with pytest.raises(ShardError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _apply(fn, shapes, split, op)


def test_a_reshape_into_fewer_heads_than_ranks_asks_for_replication():
    with pytest.raises(Replicate) as e:  # one KV head over 2 ranks: the walk replicates it
        _apply(lambda x: x.view(2, 5, 1, 16), [(2, 5, 16)], {0: 2}, aten.view.default)
    assert e.value.heads == 1


def _view_node(fn, shape):
    with torch.no_grad():
        gm = torch.export.export(_Fn(fn), (torch.randn(shape),)).module()
    return next(n for n in gm.graph.nodes if n.target in (aten.view.default, aten.reshape.default))


@pytest.mark.parametrize(("fn", "shape", "d", "outer", "want", "fixes"), [
    # XGLM / BLOOM: [B, H, S, D] -> [B*H, S, D]: the heads fold as the inner factor of dim 0 (outer B)
    (lambda x: x.reshape(8, 5, 16), (2, 4, 5, 16), 1, None, (0, 2), [(0, 8, 4)]),
    # nn.MultiheadAttention: [S, B, H*D] -> [S, B*H, D]: the heads part of the split dim folds into dim 1
    (lambda x: x.view(5, 8, 16), (5, 2, 64), 2, None, (1, 2), [(1, 8, 4)]),
    # and back: [B*H, S, S] (outer B) -> [B, H, S, S]: the heads are a dim again
    (lambda x: x.view(2, 4, 5, 5), (8, 5, 5), 0, 2, (1, None), [(1, 4, 2)]),
    # kept folded: [B*H, S, S] -> [B*H, S*S]
    (lambda x: x.view(8, 25), (8, 5, 5), 0, 2, (0, 2), [(0, 8, 4)]),
], ids=["fold_batch_heads", "fold_heads_of_hidden", "unfold", "stay_folded"])
def test_heads_fold_into_the_dim_before_them_and_back(fn, shape, d, outer, want, fixes):
    from afd_compile.passes.shard.rules import folded_view

    got: list[ArgFix] = []
    assert folded_view(_view_node(fn, shape), d, outer, 2, got) == want
    assert [(f.index, f.old, f.new) for f in got] == fixes


def test_heads_that_do_not_fold_whole_are_refused():
    from afd_compile.passes.shard.rules import folded_view

    with pytest.raises(ShardError, match="cannot follow split dim 1"):  # 3 heads over 2 ranks
        folded_view(_view_node(lambda x: x.reshape(6, 5, 16), (2, 3, 5, 16)), 1, None, 2, [])


def test_every_rule_has_one_signature_and_a_known_kind():
    import inspect

    for op, rule in RULES.items():
        assert rule.kind in ("elementwise", "reshape", "op"), op
        assert list(inspect.signature(rule.fn).parameters) == ["node", "sdim", "parts", "fixes"], op


class _MLPPlus(torch.nn.Module):
    """down(relu(up(x))) plus ``extra``: a bias (unsplit, counted once over the group) or the
    column-parallel ``up(x)`` itself (split: never a bias)."""

    def __init__(self, extra: str) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False)
        self.bias, self.extra = torch.nn.Parameter(torch.randn(8)), extra

    def forward(self, x):
        h = self.up(x)
        y = self.down(torch.relu(h))
        return y + (self.bias * 2 if self.extra == "bias" else h)


@pytest.mark.parametrize("extra", ["bias", "split"])
def test_a_bias_on_partial_sums_is_added_once_and_a_split_tensor_is_no_bias(extra):
    from afd_compile.passes.shard import OnceOperand, check_linear_path

    gm = torch.export.export(_MLPPlus(extra), (torch.randn(3, 8),)).module()
    nodes = {n.name: n for n in gm.graph.nodes}
    region = {n for n in gm.graph.nodes if n.op == "call_function"}
    up, down = (n for n in gm.graph.nodes if n.target == aten.linear.default)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    once: list[OnceOperand] = []
    if extra == "bias":
        check_linear_path([down], out, region, "layer 0", once, cols=[up])
        assert once == [OnceOperand(out.name, 1, "mlp")] and nodes[out.name].args[0] is down
    else:
        with pytest.raises(ShardError, match=f"{out.name} .* is not linear in their partial sums"):
            check_linear_path([down], out, region, "layer 0", once, cols=[up])


def test_a_weight_read_by_several_layers_is_sliced_once_or_refused():
    from afd_compile.passes.shard import one_slice_per_weight
    from afd_compile.passes.shard.types import ShardedWeight

    q = ShardedWeight("block.attn.q.weight", 0, 2, "attn", "column")
    o = ShardedWeight("block.attn.o.weight", 1, 2, "attn", "row")
    assert one_slice_per_weight([q, o, q, o, q]) == (q, o)  # one block as 3 layers: each weight once
    with pytest.raises(ShardError, match=r"weight block.attn.q.weight is read by layers that split it differently: "
                                         r"column-parallel .* dim 0 / 2 over attn / row-parallel .* dim 1 / 2"):
        one_slice_per_weight([q, ShardedWeight("block.attn.q.weight", 1, 2, "attn", "row")])
