"""Layer discovery and role annotation on HF Llama and HF Qwen3-MoE graphs."""

from __future__ import annotations

import pytest
import torch

from afd_compile.passes.roles import (
    META_KEY,
    NodeRole,
    NoStructureError,
    Role,
    annotate_roles,
    module_path_policy,
    structural_policy,
)


def _ffn_targets(gm, layer):
    return [str(n.target) for n in gm.graph.nodes if n.meta[META_KEY] == NodeRole(layer, Role.FFN)]


def test_llama_mlp_nodes_are_ffn_and_residual_add_is_attention(exported):
    gm = exported("llama2")[0].module()
    summary = annotate_roles(gm)
    assert summary.num_layers == 2 and summary.routers == (None, None)
    for layer in (0, 1):
        assert _ffn_targets(gm, layer) == ["aten.linear.default", "aten.silu.default", "aten.linear.default",
                                           "aten.mul.Tensor", "aten.linear.default"]
    by_name = {n.name: n for n in gm.graph.nodes}
    down = [n for n in gm.graph.nodes if n.meta[META_KEY] == NodeRole(0, Role.FFN)][-1]
    (residual_add,) = down.users
    assert residual_add.target == torch.ops.aten.add.Tensor
    assert residual_add.meta[META_KEY] == NodeRole(0, Role.ATTENTION)
    sdpa = [n for n in by_name.values() if "scaled_dot_product" in str(n.target)]
    assert [n.meta[META_KEY] for n in sdpa] == [NodeRole(0, Role.ATTENTION), NodeRole(1, Role.ATTENTION)]
    assert by_name["embedding"].meta[META_KEY] == NodeRole(None, Role.ATTENTION)


def test_an_mlp_that_adds_the_residual_itself_leaves_the_add_to_attention(exported):
    """BLOOM's ``mlp(x, residual)`` ends with ``residual + down(x)`` under the MLP's module path: that
    add is the residual stream's, so the FFN region reads one hidden state. Its attention (ALiBi
    scores by ``baddbmm``, softmax, ``bmm``) is found as attention. Both policies agree."""
    by_path = exported("bloom")[0].module()
    annotate_roles(by_path, module_path_policy)
    by_structure = _strip_module_paths(exported("bloom")[0].module())
    annotate_roles(by_structure, structural_policy)
    for gm in (by_path, by_structure):
        for layer in (0, 1):
            region = [n for n in gm.graph.nodes if n.meta[META_KEY] == NodeRole(layer, Role.FFN)]
            assert [str(n.target) for n in region if "linear" in str(n.target)] == ["aten.linear.default"] * 2
            residual_add = region[-1]  # through the (eval-mode) dropout the structural policy leaves out
            while residual_add.target != torch.ops.aten.add.Tensor:
                (residual_add,) = residual_add.users
            assert residual_add.meta[META_KEY] == NodeRole(layer, Role.ATTENTION)
            reads = {a for n in region for a in n.all_input_nodes if a.op != "get_attr" and a not in region}
            assert len(reads) == 1, reads
    assert [n.name for n in by_path.graph.nodes if n.meta[META_KEY].role is Role.FFN and "linear" in n.name] == [
        n.name for n in by_structure.graph.nodes if n.meta[META_KEY].role is Role.FFN and "linear" in n.name]


def test_moe_router_is_on_the_ffn_side_by_default(exported):
    gm = exported("qwen3moe2")[0].module()
    summary = annotate_roles(gm)
    router = {n.name: n for n in gm.graph.nodes}[summary.routers[0]]
    assert router.target == torch.ops.aten.linear.default
    assert router.meta[META_KEY] == NodeRole(0, Role.FFN)
    assert any("topk" in t for t in _ffn_targets(gm, 0))


def test_a_router_that_selects_by_max_is_found(exported):
    """PhiMoE's sparsemixer reads the router logits with ``max`` first (no topk): the linear is the
    router, not an up projection (TP would pair it with the experts and refuse the MLP)."""
    gm = exported("phimoe")[0].module()
    summary = annotate_roles(gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    for layer, name in enumerate(summary.routers):
        router = by_name[name]
        assert router.target == torch.ops.aten.linear.default and router.meta[META_KEY] == NodeRole(layer, Role.FFN)
        assert any(u.target == torch.ops.aten.max.dim for u in router.users)


def test_gate_on_attention_moves_the_router_linear(exported):
    gm = exported("qwen3moe2")[0].module()
    default_ffn = annotate_roles(gm).ffn_nodes_per_layer
    summary = annotate_roles(gm, compute_gate_on_attention=True)
    router = {n.name: n for n in gm.graph.nodes}[summary.routers[0]]
    assert router.meta[META_KEY] == NodeRole(0, Role.ATTENTION, router=True)
    assert all(a < b for a, b in zip(summary.ffn_nodes_per_layer, default_ffn, strict=True))
    # softmax/topk (routing from the logits) stay on the FFN side
    assert any("topk" in t for t in _ffn_targets(gm, 0))


def _strip_module_paths(gm):
    for n in gm.graph.nodes:
        n.meta.pop("nn_module_stack", None)
    return gm


def test_structural_policy_finds_the_same_llama_regions(exported):
    by_path = exported("llama2")[0].module()
    annotate_roles(by_path, module_path_policy)
    by_structure = _strip_module_paths(exported("llama2")[0].module())
    with pytest.raises(NoStructureError, match="no nn_module_stack"):
        module_path_policy(by_structure)
    annotate_roles(by_structure)  # default policy falls back to structure
    assert [n.meta[META_KEY] for n in by_structure.graph.nodes if n.meta[META_KEY].role is Role.FFN] == [
        n.meta[META_KEY] for n in by_path.graph.nodes if n.meta[META_KEY].role is Role.FFN]
    assert [n.name for n in by_structure.graph.nodes if n.meta[META_KEY].role is Role.FFN] == [
        n.name for n in by_path.graph.nodes if n.meta[META_KEY].role is Role.FFN]


@pytest.mark.parametrize("name", ["gptj", "falcon"])
def test_structural_policy_finds_parallel_blocks_as_module_paths_do(exported, name):
    """GPT-J ``attn + mlp + residual`` and Falcon ``(mlp += attn) + residual`` (through a dropout):
    the MLP reads the layer input's norm and adds beside the attention, not after its residual add
    (a search for that add alone would take the next layer's attention for this layer's MLP)."""
    by_path = exported(name)[0].module()
    annotate_roles(by_path, module_path_policy)
    by_structure = _strip_module_paths(exported(name)[0].module())
    annotate_roles(by_structure, structural_policy)
    ffn = [[(n.name, n.meta[META_KEY]) for n in gm.graph.nodes if n.meta[META_KEY].role is Role.FFN
            and n.target != torch.ops.aten.dropout.default]  # (a trailing eval dropout: either side)
           for gm in (by_path, by_structure)]
    assert ffn[0] == ffn[1]
    assert {r.layer for _, r in ffn[1]} == {0, 1}


def test_structural_policy_on_moe_keeps_router_and_experts_together(exported):
    gm = _strip_module_paths(exported("qwen3moe2")[0].module())
    summary = annotate_roles(gm, structural_policy)
    assert summary.num_layers == 2
    assert summary.routers[0] is not None  # the router linear is inside the found region


class _MLPOnly(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def test_graph_without_attention_fails_naming_the_graph():
    gm = torch.export.export(_MLPOnly(), (torch.randn(2, 8),)).module()
    with pytest.raises(NoStructureError, match=r"mlp_only: no attention/FFN structure found.*no attention op"):
        annotate_roles(gm, graph_name="mlp_only")


class _HybridLayer(torch.nn.Module):
    """A decoder layer whose token mixer is attention or a causal depthwise convolution (as hybrid
    models interleave them), then an MLP."""

    def __init__(self, conv: bool, d: int = 16) -> None:
        super().__init__()
        self.mixer = torch.nn.Conv1d(d, d, 3, padding=2, groups=d) if conv else torch.nn.Linear(d, 3 * d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d))

    def forward(self, x):
        if isinstance(self.mixer, torch.nn.Conv1d):
            h = x + self.mixer(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        else:
            q, k, v = self.mixer(x).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4).unbind(0)
            h = x + torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        return h + self.mlp(h)


class _Hybrid(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_HybridLayer(conv=False), _HybridLayer(conv=True)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_layer_whose_mixer_is_not_attention_keeps_it_on_the_attention_side():
    # hybrid models interleave attention with state-space / convolution mixers (was refused): AFD
    # needs only the FFN region, so the mixer is the attention side's, as attention is
    gm = torch.export.export(_Hybrid(), (torch.randn(2, 5, 16),)).module()
    summary = annotate_roles(gm, graph_name="hybrid")
    assert summary.non_attention == (1,) and "token mixer not attention in layers [1]" in str(summary)
    conv = [n for n in gm.graph.nodes if n.target == torch.ops.aten.conv1d.default]
    assert conv and all(n.meta[META_KEY] == NodeRole(1, Role.ATTENTION) for n in conv)
    ffn = [n for n in gm.graph.nodes if n.meta[META_KEY] == NodeRole(1, Role.FFN)]
    assert sum(n.target == torch.ops.aten.linear.default for n in ffn) == 2  # the MLP, and only it


class _ExplicitAttention(torch.nn.Module):
    """A pre-norm block whose attention is matmul + softmax + matmul, not SDPA."""

    def __init__(self, d=16):
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.o = torch.nn.Linear(d, d, bias=False)
        self.n1 = torch.nn.LayerNorm(d)
        self.n2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        q, k, v = self.qkv(self.n1(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1)
        h = x + self.o(att @ v)
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(self.n2(h))))


def test_explicit_matmul_softmax_attention_without_mlp_module_is_found_structurally():
    gm = torch.export.export(_ExplicitAttention(), (torch.randn(2, 5, 16),)).module()
    summary = annotate_roles(gm)  # no ".N" layer paths: structural fallback
    assert summary.num_layers == 1
    targets = [str(n.target) for n in gm.graph.nodes if n.meta[META_KEY].role is Role.FFN]
    assert targets.count("aten.linear.default") == 2 and "aten.gelu.default" in targets
    assert "aten.layer_norm.default" not in targets


def test_in_place_op_nobody_reads_belongs_with_the_tensor_it_mutates(exported):
    # transformers 5.17's MoE clamps the sorted expert ids in place (``expert_ids_g.clamp_``) and
    # never reads the result: the mutation must stay in the FFN region, not leak to attention
    from afd_compile.passes.split import plan_split

    gm = exported("llama2")[0].module()
    gate = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default
                and "gate_proj" in str(n.meta.get("nn_module_stack", "")))
    with gm.graph.inserting_after(gate):
        clamp = gm.graph.call_function(torch.ops.aten.clamp_.default, (gate, None, 100.0))
    clamp.meta["val"] = gate.meta["val"]
    gm.recompile()
    annotate_roles(gm)
    assert clamp.meta[META_KEY] == gate.meta[META_KEY] == NodeRole(0, Role.FFN)
    assert len(plan_split(gm).cuts) == 2  # the FFN region of layer 0 still has one output


def test_plan_names_the_layers_whose_mixer_is_not_attention(exported):
    import json

    from clirun import run_cli

    path = exported("jamba")[1]
    text = run_cli("plan", path, "-A", "1", "-F", "1", "-q")
    assert text.returncode == 0, text.stderr
    assert "token mixers: layer 0 not attention (a state-space, convolution or linear-attention mixer): run " \
           "whole on the attention ranks" in text.stdout, text.stdout
    js = run_cli("plan", path, "-A", "1", "-F", "1", "--json", "-q")
    assert js.returncode == 0 and json.loads(js.stdout)["non_attention_layers"] == [0], js.stdout[-500:]
    llama = run_cli("plan", exported("llama2")[1], "-A", "1", "-F", "1", "--json", "-q")
    assert "non_attention_layers" not in json.loads(llama.stdout)  # (absent when every mixer is attention)


@pytest.mark.parametrize("kinds,layers", [
    ("AEDMEAD", [0, 0, 1, 2, 2, 3, 3]),   # each per-token block (E MoE, D dense MLP) ends a layer
    ("MAEAD", [0, 0, 0, 1, 1]),           # a Mamba and an attention in one layer
    ("ADM", [0, 0, None]),                # a mixer after the last MLP: no layer (it runs with the head)
    ("MMD", [0, 0, 0]),
])
def test_single_mixer_blocks_group_up_to_each_per_token_block(kinds, layers):
    from afd_compile.passes.mixer_blocks import block_layers

    order = [f"layers.{i}" for i in range(len(kinds))]
    ffn = {p: f"{p}.mixer" if k in "ED" else None for p, k in zip(order, kinds, strict=True)}
    assert list(block_layers(order, ffn).values()) == layers


def test_mixers_as_blocks_make_layers_that_end_at_each_mlp_or_moe_block(exported):
    # Nemotron-H: layers.N.mixer is attention, MoE, MLP, Mamba, MoE, attention, MLP; no MLP child anywhere
    from afd_compile.passes.module_paths import layer_path, module_paths
    from afd_compile.passes.roles import non_attention_layers

    gm = exported("nemotron_h")[0].module()
    summary = annotate_roles(gm)
    assert summary.num_layers == 4 and summary.non_attention == (2,)
    assert [r is not None for r in summary.routers] == [True, False, True, False]
    seen: dict[str, set] = {}
    for n in gm.graph.nodes:
        block = layer_path(module_paths(n))
        if block is not None and n.op == "call_function" and n.target != torch.ops.aten._assert_tensor_metadata.default:
            r = n.meta[META_KEY]  # (an assertion goes with the tensor it checks)
            seen.setdefault(block.rsplit(".", 1)[1], set()).add((r.layer, r.role, module_paths(n)[-1].split(".")[-1]
                                                                 if r.role is Role.FFN else None))
    layer = {b: {x[0] for x in v} for b, v in seen.items()}
    assert layer == {"0": {0}, "1": {0}, "2": {1}, "3": {2}, "4": {2}, "5": {3}, "6": {3}}
    ffn_blocks = sorted(b for b, v in seen.items() if any(x[1] is Role.FFN for x in v))
    assert ffn_blocks == ["1", "2", "4", "6"]
    # the block norms and residual adds stay attention's; the mixer's nodes are the FFN region
    ffn_paths = {p for n in gm.graph.nodes if n.meta[META_KEY].role is Role.FFN for p in module_paths(n)[-1:]}
    assert all(".mixer" in p for p in ffn_paths), ffn_paths
    assert non_attention_layers(gm) == [2]  # layer 1 (an MLP alone) mixes no tokens: not a token mixer


def test_an_moe_beside_the_mlp_module_is_in_the_ffn_region(exported):
    # Gemma-4: each layer's mlp, and beside it an MoE whose router, experts and norms are the layer's own
    # children; by module path alone the MoE stayed on the attention side (not disaggregated)
    from afd_compile.passes.module_paths import module_paths
    from afd_compile.passes.roles import default_policy

    gm = exported("gemma4_moe")[0].module()
    by_path = module_path_policy(gm)
    assert not any(r.role is Role.FFN for n, r in by_path.items() if ".experts" in "".join(module_paths(n)[-1:]))
    roles = default_policy(gm)
    ffn = {p.split(".")[4] for n, r in roles.items() if r.role is Role.FFN
           for p in module_paths(n)[-1:] if p.count(".") >= 4}  # (model.model.layers.N.<child>...)
    assert {"mlp", "router", "experts"} <= ffn, ffn
    summary = annotate_roles(gm)
    assert summary.num_layers == 2 and all(r is not None for r in summary.routers)
