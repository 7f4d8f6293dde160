"""Decoders written by hand, not by transformers (issue 14): GQA by ``repeat_interleave`` and an
in-place scaled query, an MoE with ``bmm`` experts, a static KV cache of its own, through TP
(standard and DP attention) and AFD (with micro-batch stages) on real gloo processes."""

from __future__ import annotations

import os

import pytest
import torch
from handwritten import GQADecoder, export

from afd_compile.layout import AFDLayout
from afd_compile.scatter import TPLayout
from afd_compile.verify import Case, TPCase, run_cases, run_tp_cases


@pytest.fixture(scope="module")
def gqa_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("handwritten") / "gqa.pt2")
    torch.export.save(export(GQADecoder()), path)
    return path


#: (tp, attn_dp, batches) each hand-written GQA decoder (dense and bmm-experts) is verified with;
#: AFD: 2A1F (tests/support_table.py reads these for the README's table)
GQA_TP = [(2, 1, None), (4, 2, (3, 1))]


def test_gqa_by_repeat_interleave_shards_and_matches(gqa_path):
    results = run_tp_cases([TPCase(gqa_path, TPLayout(t, d), b) for t, d, b in GQA_TP])
    for res in results:
        assert res and max(r["max_rel_err"] for r in res.values()) <= 1e-5, res
        assert all(r["compared"] for r in res.values())


def test_gqa_by_repeat_interleave_splits_for_afd(gqa_path):
    (res,) = run_cases([Case(gqa_path, AFDLayout(2, 1), (2, 3))])
    errs = [r["max_rel_err"] for r in res.values() if r["role"] == "attention"]
    assert len(errs) == 2 and max(errs) <= 1e-5


@pytest.fixture(scope="module")
def bmm_moe_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("handwritten") / "bmm_moe.pt2")
    torch.export.save(export(GQADecoder(moe=True)), path)
    return path


def test_bmm_experts_shard_over_the_intermediate_size_and_match(bmm_moe_path):
    # experts as bmm over stacked [E, in, out] weights: recognised as one afd::moe_experts op,
    # whose [E, 2I, H] gate_up is column-parallel on 2I (in its two blocks) and [E, H, I] down
    # row-parallel on I, one all-reduce after the weighted sum over experts
    from afd_compile.deploy import tp_rank_program
    from afd_compile.programs import load_program

    gm = load_program(bmm_moe_path).module()
    weights = {str(w) for w in tp_rank_program(gm, TPLayout(2), 0).shards.weights}
    assert "column-parallel afd_moe0_w_gate_up dim 1 / 2 over mlp in blocks [128, 128]" in weights
    assert "row-parallel afd_moe0_w_down dim 2 / 2 over mlp" in weights
    results = run_tp_cases([TPCase(bmm_moe_path, TPLayout(t, d), b) for t, d, b in GQA_TP])
    for res in results:
        assert res and max(r["max_rel_err"] for r in res.values()) <= 1e-5, res
        assert all(r["compared"] for r in res.values())
    (res,) = run_cases([Case(bmm_moe_path, AFDLayout(2, 1), (2, 3))])
    errs = [r["max_rel_err"] for r in res.values() if r["role"] == "attention"]
    assert len(errs) == 2 and max(errs) <= 1e-5


def test_replicated_kv_heads_repeat_interleaved_shard_and_match(gqa_path):
    """2 KV heads over 4 ranks: each rank holds one (replicated over 2 ranks) and repeats it to its
    one query head (repeat_interleave's count 2 becomes 1), against the model on one process."""
    from afd_compile.deploy import tp_rank_program
    from afd_compile.passes.roles import annotate_roles
    from afd_compile.programs import load_program

    gm = load_program(gqa_path).module()
    annotate_roles(gm)
    prog = tp_rank_program(gm, TPLayout(4), 3).program
    reps = [n.args[1] for n in prog.graph.nodes if n.target == torch.ops.aten.repeat_interleave.self_int]
    assert reps == [1] * 4, reps  # (K and V of 2 layers)
    (res,) = run_tp_cases([TPCase(gqa_path, TPLayout(4), None)])
    assert res and max(r["max_rel_err"] for r in res.values()) <= 1e-5 and all(r["compared"] for r in res.values())


def test_replicated_kv_heads_repeated_unevenly_are_refused():
    from afd_compile.passes.shard import ShardError
    from afd_compile.passes.shard.rules import repeat_replicated

    g = torch.fx.Graph()
    k = g.placeholder("k")
    k.meta["val"] = torch.empty(1, 2, 3, 8)
    n = g.call_function(torch.ops.aten.repeat_interleave.self_int, (k, 3, 1))
    n.meta["val"] = torch.empty(1, 6, 3, 8)
    with pytest.raises(ShardError, match=r"repeat_interleave of heads replicated over 2 ranks each, repeats 3: "
                       r"expected an int that 2 divides"):
        repeat_replicated(n, 1, 2, 4, [])


class _FlatMLP(torch.nn.Module):
    """A SwiGLU run on tokens flattened with sizes read from its input: traced with static shapes,
    those sizes are constants of the graph."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        return self.mlp(x.reshape(b * s, h)).view(b, s, h)


def test_dp_attention_refuses_an_mlp_with_sizes_fixed_at_trace_time():
    # under DP attention the MLP runs on every DP group's tokens, a count set per step: a graph
    # traced with a static batch (dynamo's decode step under a static KV cache) that built sizes
    # from its own token count cannot; the check names the node and layer (a dynamic export passes)
    from afd_compile.deploy import tp_rank_program
    from afd_compile.errors import TPRewriteError
    from afd_compile.passes.roles import annotate_roles
    from afd_compile.passes.tp_rewrite import check_any_token_total

    model = GQADecoder()
    for block in model.layers:
        block.mlp = _FlatMLP(block.mlp)
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    for static in (True, False):
        with torch.no_grad():
            ep = torch.export.export(model.eval(), (ids,)) if static else export(model)
        gm = ep.module()
        annotate_roles(gm)
        prog = tp_rank_program(gm, TPLayout(2, 2), 0).program
        if static:
            with pytest.raises(TPRewriteError, match=r"rank 0: DP attention: layer 0: node \w+ \(aten\.(view|reshape)"
                               r"[.\w]*\) fails when the DP groups hold 11 tokens in all \(this rank 10\)"):
                check_any_token_total(prog, [ids], "rank 0")
        else:
            check_any_token_total(prog, [ids], "rank 0")


@pytest.fixture(scope="module")
def more_paths(tmp_path_factory) -> dict[str, str]:
    """nanoGPT (fused c_attn, LayerNorm, tied head, blocks in ``transformer.h``), an MoE looping
    over experts with ``index_add_``, a decoder with no layer container at all, and Meta's
    reference Llama (complex rotary, ``repeat_kv`` by expand); PyTorch's post-norm
    ``nn.TransformerEncoderLayer``, a GPT-J-style parallel block of raw parameters, einsum
    attention over a fused q/k/v viewed as ``[B, S, 3, H, D]``, and one block applied as every
    layer (ALBERT-style sharing)."""
    from handwritten import MODELS

    folder = tmp_path_factory.mktemp("handwritten")
    paths = {}
    for name in ("nanogpt", "loop_moe", "flat", "meta_llama", "torch_postnorm", "parallel", "einsum", "shared",
                 "looped", "biased_moe", "per_head_norm", "per_head_norm_manual", "grouped_qkv", "broadcast_mqa",
                 "split_head_norm"):
        paths[name] = str(folder / f"{name}.pt2")
        torch.export.save(export(MODELS[name]()), paths[name])
    return paths


def test_layers_without_a_numbered_container_are_found_by_structure(more_paths):
    from afd_compile.passes.graph_utils import layers_of
    from afd_compile.passes.roles import NoStructureError, annotate_roles, module_path_policy
    from afd_compile.programs import load_program

    gm = load_program(more_paths["flat"]).module()
    with pytest.raises(NoStructureError, match="no nn_module_stack paths with a layer index"):
        module_path_policy(gm)
    annotate_roles(gm)  # the default policy falls back to the data flow
    layers = layers_of(gm)
    assert sorted(layers) == [0, 1]
    # the FFN region is the SwiGLU: three linears, nothing of the norms or residual adds
    for parts in layers.values():
        ffn = [n for n in parts.members if n.meta["afd.role"].role.name == "FFN"]
        assert sum(n.target == torch.ops.aten.linear.default for n in ffn) == 3
        assert not any(n.target == torch.ops.aten.rsqrt.default for n in ffn)


MORE_TP = [("nanogpt", 2, 1, None), ("loop_moe", 2, 1, None), ("flat", 2, 1, None),
           ("meta_llama", 4, 1, None),  # complex rotary on split heads; 2 KV heads replicated by repeat_kv's expand
           ("parallel", 2, 1, None), ("einsum", 4, 2, (1, 2)),
           ("torch_postnorm", 4, 2, (1, 2)),  # nn.MultiheadAttention: heads folded into the batch for SDPA
           ("shared", 2, 1, None),  # one block as every layer: its weights sliced once
           ("looped", 2, 1, None),  # numbered layers applied twice over
           # a router read through a score bias before its top-k, its weight cast in the forward: kept whole
           ("biased_moe", 2, 1, None),
           # per-head q/k norms ([H, D] affine: sliced with the heads, KV's replicated at tp 4), keys by .mT
           ("per_head_norm", 2, 1, None), ("per_head_norm", 4, 2, (1, 2)), ("per_head_norm_manual", 2, 1, None),
           # q/k/v packed per KV group, one group: the query heads split, K/V replicated (grouped_qkv.py)
           ("grouped_qkv", 2, 1, None), ("grouped_qkv", 4, 2, (1, 2)),
           # multi-query: one K/V head broadcast by SDPA to the split query heads (no expand): replicated
           ("broadcast_mqa", 2, 1, None), ("broadcast_mqa", 4, 2, (1, 2)),
           # per-head q/k LayerNorm modules over the heads split apart, concatenated back: merged first
           ("split_head_norm", 2, 1, None), ("split_head_norm", 4, 2, (1, 2))]
MORE_AFD = ["nanogpt", "loop_moe", "flat", "meta_llama", "torch_postnorm", "einsum", "shared", "looped",
            "per_head_norm", "grouped_qkv", "broadcast_mqa", "split_head_norm"]  # (parallel: as GPT-J's)


def test_more_hand_written_decoders_shard_and_split_and_match(more_paths):
    # TP: nanoGPT's fused c_attn (column blocks), the expert loop's index_add_ (linear in the
    # partial sums: one all-reduce at the block output), the flat decoder's structural layers
    tp = [TPCase(more_paths[name], TPLayout(t, d), batches) for name, t, d, batches in MORE_TP]
    for case, res in zip(tp, run_tp_cases(tp), strict=True):
        assert res and all(r["compared"] for r in res.values()), (case, res)
        assert max(r["max_rel_err"] for r in res.values()) <= 1e-5, (case, res)
    # AFD: the expert loop's data-dependent token counts per expert run on the FFN rank
    afd = [Case(more_paths[name], AFDLayout(2, 1), (2, 3)) for name in MORE_AFD]
    for case, res in zip(afd, run_cases(afd), strict=True):
        errs = [r["max_rel_err"] for r in res.values() if r["role"] == "attention"]
        assert len(errs) == 2 and max(errs) <= 1e-5, (case, res)


def test_a_numbered_layer_applied_again_is_a_layer_each_time(more_paths):
    # a looped decoder runs layers.0, layers.1, layers.0, layers.1: four layers (by module path, one
    # layer's FFN region was two MLP applications reading two hidden states)
    from afd_compile.passes.graph_utils import layers_of
    from afd_compile.passes.roles import annotate_roles, module_path_policy
    from afd_compile.programs import load_program

    gm = load_program(more_paths["looped"]).module()
    roles = module_path_policy(gm)
    assert sorted({r.layer for r in roles.values() if r.layer is not None}) == [0, 1, 2, 3]
    assert annotate_roles(gm).num_layers == 4
    for parts in layers_of(gm).values():
        ffn = [n for n in parts.members if n.meta["afd.role"].role.name == "FFN"]
        assert sum(n.target == torch.ops.aten.linear.default for n in ffn) == 3


def test_post_norm_parallel_and_fused_view_layers_are_found_by_structure(more_paths):
    """No MLP module in any of them: a post-norm layer's MLP reads ``norm1(x + attn)`` and adds into
    it; a parallel block's MLP reads the layer input's norm and adds beside the attention; the
    fused q/k/v view ``[B, S, 3, H, D]`` is cut into three column blocks under TP."""
    from afd_compile.passes.graph_utils import layers_of
    from afd_compile.passes.roles import annotate_roles
    from afd_compile.programs import load_program

    for name, linears in (("torch_postnorm", 2), ("parallel", 2), ("einsum", 2)):
        gm = load_program(more_paths[name]).module()
        annotate_roles(gm)
        layers = layers_of(gm)
        assert sorted(layers) == [0, 1], name
        for parts in layers.values():
            ffn = [n for n in parts.members if n.meta["afd.role"].role.name == "FFN"]
            mms = [n for n in ffn if n.target in (torch.ops.aten.linear.default, torch.ops.aten.matmul.default)]
            assert len(mms) == linears, (name, [n.name for n in ffn])
            assert not any(n.target == torch.ops.aten.layer_norm.default or "attention" in str(n.target)
                           for n in ffn), (name, [n.name for n in ffn])


def test_plan_shards_lists_the_fused_view_cut_into_blocks(more_paths, capsys):
    from afd_compile.cli import main

    assert main(["plan", more_paths["einsum"], "--tp", "2", "--shards", "-q"]) == 0
    out = capsys.readouterr().out
    assert "shards (rank 0): 12 weights split (6 column, 4 row, 2 row bias; 2 fused, in blocks)" in out
    assert "column-parallel blocks.0.qkv.weight dim 0 / 2 over attn in blocks [64, 64, 64]" in out
    assert "reshape arg 1[3]: 4 -> 2" in out  # [B, S, 3, H, D]: the heads, not the blocks


def test_a_hand_written_static_cache_decodes_in_micro_batches(tmp_path, capsys):
    # a decoder with its own static KV cache (buffers written by index_copy_, a causal mask
    # broadcast over the batch, not expanded to it), batch 3 over 2 micro-batches of 2 and 1
    # sequences: each micro-batch writes its own cache rows, decode steps read them back
    from handwritten import CachedDecoder, export_cached

    from afd_compile.cli import main

    path = str(tmp_path / "cached.pt2")
    torch.export.save(export_cached(CachedDecoder(batch=3)), path)
    assert main(["verify", path, "-A", "1", "-F", "1", "--stages", "2", "--decode-steps", "3", "-q"]) == 0
    out = capsys.readouterr().out
    assert "fixed micro-batches of [2, 1] sequences" in out and "transfers per stage {0: " in out
    assert out.strip().splitlines()[-1].startswith("verify: OK"), out[-2000:]
    # and TP: each rank its KV heads' slice of the cache buffers; at 4 ranks over the 2 KV heads each
    # pair of ranks holds one head's cache, repeat_interleave'd to the rank's one query head
    for tp in ("2", "4"):
        assert main(["verify", path, "--tp", tp, "--decode-steps", "3", "-q"]) == 0
        assert capsys.readouterr().out.strip().splitlines()[-1].startswith("verify: OK")


def test_a_gpt_fast_style_cache_is_found_by_its_writes_not_its_input_name(tmp_path, capsys):
    # gpt-fast: forward(ids, input_pos), k_cache[:, :, input_pos] = k (index_put_): the input that
    # positions the cache writes is found from the graph; AFD and TP decode against the original
    from handwritten import GptFastDecoder, export_cached

    from afd_compile.cli import main

    path = str(tmp_path / "gpt_fast.pt2")
    torch.export.save(export_cached(GptFastDecoder(batch=2)), path)
    assert main(["verify", path, "-A", "1", "-F", "1", "--decode-steps", "2", "-q"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("verify: OK")
    # TP: each rank writes its KV heads into its slice of the caches by index_put_ (verified: slow)
    assert main(["plan", path, "--tp", "2", "-q"]) == 0
    assert "4 cache states split" in capsys.readouterr().out


@pytest.mark.slow
def test_a_gpt_fast_style_cache_decodes_under_tp(tmp_path, capsys):
    from handwritten import GptFastDecoder, export_cached

    from afd_compile.cli import main

    path = str(tmp_path / "gpt_fast.pt2")
    torch.export.save(export_cached(GptFastDecoder(batch=2)), path)
    assert main(["verify", path, "--tp", "2", "--decode-steps", "2", "-q"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("verify: OK")


LIB_MOE = [("dense_then_in_place_moe", ("-A", "2", "-F", "1")), ("dense_then_in_place_moe", ("--tp", "2")),
           ("dense_then_in_place_moe", ("-A", "2", "-F", "2", "--ffn-ep", "2")),
           ("dense_then_in_place_moe", ("--tp", "4", "--attn-dp", "2")),
           ("dense_then_lib_moe", ("-A", "3", "-F", "2"))]


@pytest.mark.parametrize(("name", "layout"), LIB_MOE, ids=[f"{n}-{' '.join(a)}" for n, a in LIB_MOE])
def test_a_dense_first_layer_then_a_library_moe_with_a_shared_expert_splits_and_shards(tmp_path, capsys, name,
                                                                                       layout):
    # a model library's MoE (tests/moelib.py: router under autocast off, a higher-order op whose
    # weights export hoists to the graph's top; grouped GEMMs of its own) beside a shared expert,
    # after a dense first layer: the hoisted weights once made layer 1 the first layer (the split's
    # programs disagreed: "attention program has to_ffn L2/S0 ..., FFN program has to_ffn L0/S0")
    # and DP attention found no output projection. Its combine written as an in-place op of the
    # library's (no return value: read after it) was not recognised (TP refused the shared
    # expert's add, FFN EP had no op)
    from handwritten import MODELS

    from afd_compile.cli import main

    moelib = os.path.join(os.path.dirname(__file__), "moelib.py")
    path = str(tmp_path / f"{name}.pt2")
    torch.export.save(export(MODELS[name]()), path)
    assert main(["verify", path, *layout, "--import", moelib, "-q"]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("verify: OK"), out[-2000:]
    if layout == ("-A", "2", "-F", "1"):
        assert main(["plan", path, *layout, "--import", moelib]) == 0
        out = capsys.readouterr().out
        assert "MoE experts: 2 of 2 blocks recognised as afd::moe_experts" in out and "grouped_mm experts" in out, out


def test_per_head_modules_over_the_heads_split_apart_merge_into_one(more_paths):
    # the split into one-head pieces, a LayerNorm module per piece, the cat back: one layer_norm over
    # all heads and the pieces' weights stacked [H, D] (what TP slices with the heads); the same numbers
    from afd_compile.passes.head_pieces import merge_head_pieces
    from afd_compile.programs import flat_inputs, load_program

    ep = load_program(more_paths["split_head_norm"])
    gm, x = ep.module(), flat_inputs(ep)
    want = gm(*x)
    done = merge_head_pieces(gm)
    assert [r.pieces for r in done] == [4, 2, 4, 2], [str(r) for r in done]  # q and k of each layer
    ops = [n.target for n in gm.graph.nodes]
    assert torch.ops.aten.split.Tensor not in ops and ops.count(torch.ops.aten.layer_norm.default) == 4
    assert tuple(gm.get_parameter(done[0].weights[0]).shape) == (4, 16)
    torch.testing.assert_close(gm(*x), want)
    # pieces whose chains differ are left as written (a model's own per-head choice)
    class Uneven(torch.nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            a, b = q.split(1, dim=2)
            return torch.cat([a.relu(), b.sigmoid()], dim=2)

    g = torch.export.export(Uneven(), (torch.randn(2, 3, 2, 4),)).module()
    assert merge_head_pieces(g) == [] and torch.ops.aten.split.Tensor in [n.target for n in g.graph.nodes]
