"""Graph structure of the split: op counts, weights per role, schedule check, goldens."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from afd_compile.golden import cut_window_lines, graph_text
from afd_compile.layout import AFDLayout
from afd_compile.passes.schedule import ScheduleError, transfers, verify_schedule
from afd_compile.passes.split import SplitError
from afd_compile.split_api import SplitConfig, split

afd = torch.ops.afd
GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "golden")


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def _weights(gm):
    return {str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and n.users}


@pytest.mark.parametrize("name", ["llama2", "qwen3moe2"])
def test_op_counts_and_weight_ownership(exported, name):
    ep = exported(name)[0]
    original = ep.module()
    before = str(original.graph)
    result = split(original)
    assert str(original.graph) == before, "split must not change the caller's graph"
    att, ffn = result.attention, result.ffn
    assert _count(att, afd.p2p_send.default) == _count(att, afd.p2p_recv.default) == 2
    assert _count(ffn, afd.p2p_recv_group.default) == _count(ffn, afd.p2p_send_group.default) == 2
    assert _count(att, afd.p2p_recv_group.default) == _count(ffn, afd.p2p_send.default) == 0
    original_linears = _count(original, torch.ops.aten.linear.default)
    assert _count(att, torch.ops.aten.linear.default) + _count(ffn, torch.ops.aten.linear.default) == original_linears
    ffn_weights = _weights(ffn)
    assert ffn_weights and all(".mlp." in w for w in ffn_weights)
    assert not any(".mlp." in w for w in _weights(att))
    assert ffn_weights | _weights(att) == _weights(original)
    assert set(result.timings) >= {"annotate_roles", "plan_split", "build_attention_program",
                                    "build_ffn_program", "verify_schedule"}


def test_ffn_program_sizes_stay_symbolic_in_every_layer(exported):
    """Every projection of the FFN program (dense and MoE layers) holds the token count as a symbol
    in its ``meta['val']``: passes that read sizes from meta (the FFN EP rewrite) must not see the
    trace's hint as a constant. (torch 2.11's C++ ``aten.linear`` of a parameter specialised it
    unless the fake propagation runs under the Python dispatcher: ``make test-torch211``.)"""
    ffn = split(exported("qwen3moe3_mixed")[0]).ffn
    linears = [n for n in ffn.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert {n.meta["afd.role"].layer for n in linears} == {0, 1, 2}
    for n in linears:
        rows = n.meta["val"].shape[:-1]
        assert any(isinstance(d, torch.SymInt) and not d.node.expr.is_number for d in rows), (n.name, rows)


def test_gate_on_attention_sends_router_logits_in_wire_order(exported):
    result = split(exported("qwen3moe2")[0], SplitConfig(compute_gate_on_attention=True))
    sends = [t for t in transfers(result.attention) if t.direction == "to_ffn"]
    assert [t.spec for t in sends] == ["hidden:float32[64],router_logits:float32[4]"] * 2
    att_weights = _weights(result.attention)
    assert any(w.endswith("mlp.gate.weight") for w in att_weights)
    assert not any("experts" in w for w in att_weights)


def test_schedule_check_catches_mismatched_programs(exported):
    result = split(exported("llama2")[0])
    assert len(verify_schedule(result.attention, result.ffn)) == 4
    # a FFN program that serves layer 1 before layer 0
    bad = copy.deepcopy(result.ffn)
    groups = [n for n in bad.graph.nodes if n.target in (afd.p2p_recv_group.default, afd.p2p_send_group.default)]
    for n in groups:
        args = list(n.args)
        args[2] = 1 - args[2]
        n.args = tuple(args)
    with pytest.raises(ScheduleError, match=r"transfer #0: attention program has to_ffn L0/S0.*FFN program has to_ffn "
                       r"L1/S0"):
        verify_schedule(result.attention, bad)
    # a FFN program missing its last send
    short = copy.deepcopy(result.ffn)
    last = [n for n in short.graph.nodes if n.target == afd.p2p_send_group.default][-1]
    short.graph.output_node().args = (last.args[0][0],)
    short.graph.erase_node(last)
    with pytest.raises(ScheduleError, match="transfer #3.*FFN program has nothing"):
        verify_schedule(result.attention, short)


def test_static_graph_fans_in_when_its_ffn_is_per_token(exported):
    from afd_compile.models import build_hf, export_lm

    ep = export_lm(build_hf("llama", num_layers=1), dynamic=False)  # tokens [2, 5]
    alone = split(ep, layout=AFDLayout(1, 1)).ffn  # one peer: the static token count
    assert [2, 5, 64] in [n.args[1] for n in alone.graph.nodes if n.target == torch.ops.aten.view.default]
    fan_in = split(ep, layout=AFDLayout(2, 1)).ffn  # 2 peers: rows = T // 5, whatever T
    views = [n.args[1] for n in fan_in.graph.nodes if n.target == torch.ops.aten.view.default]
    assert all(isinstance(v[0], torch.fx.Node) and v[1:] in ([5, 64], [64]) for v in views), views
    from handwritten import batch_mixing

    mixing = torch.export.export(batch_mixing().eval(), (torch.randint(0, 128, (2, 5)),))
    split(mixing, layout=AFDLayout(1, 1))
    with pytest.raises(SplitError, match=r"FFN program: the batch dim: mean\w* \(aten.mean.dim\) reduces over the "
                                         r"batch dim 0: .*static token dims.*several attention peers.*per token; "
                                         r"layout 2A1F has an FFN rank fanning in 2"):
        split(mixing, layout=AFDLayout(2, 1))


def _golden_text(ep, layout: AFDLayout, gate: bool) -> str:
    result = split(ep, SplitConfig(compute_gate_on_attention=gate), layout=layout)
    peers = "; ".join(f"ffn rank {f} <- attention ranks {list(layout.peers_of_ffn(f))}"
                      for f in range(layout.ffn_ranks))
    return "\n".join([
        f"# layout {layout}: {peers}",
        "# the programs do not depend on the layout: per-peer token counts arrive once per step",
        *[f"# layer {c.layer}: {len(c.ffn_nodes)} FFN nodes, {len(c.params)} weights, wire {c.wire_in} -> {c.wire_out}"
          for c in result.plan.cuts],
        "## attention program, around each cut (the rest is the model's graph, unchanged)",
        *cut_window_lines(result.attention),
        "## ffn program (structure; its fake shapes differ between torch releases)",
        graph_text(result.ffn, shapes=False).rstrip("\n"),
    ]) + "\n"


GOLDENS = [("llama2", 1, 1, False), ("llama2", 2, 1, False), ("qwen3moe2", 1, 1, False),
           ("qwen3moe2", 2, 1, False), ("qwen3moe2", 2, 1, True)]


@pytest.mark.parametrize("case", GOLDENS, ids=lambda c: f"{c[0]}-{c[1]}A{c[2]}F{'-gate' if c[3] else ''}")
def test_golden_graphs(exported, update_goldens, case):
    name, a, f, gate = case
    text = _golden_text(exported(name)[0], AFDLayout(a, f), gate)
    suffix = ""
    if name.startswith("qwen3moe"):
        # the experts' graph is transformers' own code and changes between its releases (5.17 emits
        # 51 FFN nodes per layer, 5.24 45); record it per transformers minor version
        import transformers

        suffix = ".transformers-" + ".".join(transformers.__version__.split(".")[:2])
    path = os.path.join(GOLDEN_DIR, f"afd_{name}_{a}A{f}F{'_gate' if gate else ''}{suffix}.txt")
    if suffix and not update_goldens and not os.path.exists(path):
        pytest.skip(f"no MoE golden recorded for this transformers release ({path}); run --update-goldens to add one")
    if update_goldens or not os.path.exists(path):
        if not update_goldens:
            pytest.fail(f"missing golden {path}; run pytest --update-goldens and review the diff")
        os.makedirs(GOLDEN_DIR, exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)
    with open(path) as fh:
        expected = fh.read()
    assert text == expected, f"{path} changed; if intended, rerun with --update-goldens and explain it in the commit"


def test_transfers_appear_in_order_filecheck_style(exported):
    """What must survive torch upgrades even if goldens are regenerated: the ordered op sequence."""
    result = split(exported("llama2")[0])
    lines = graph_text(result.attention).splitlines()
    wanted = ["afd.p2p_send.default(", "afd.p2p_recv.default(", "afd.p2p_send.default(", "afd.p2p_recv.default("]
    pos = 0
    for w in wanted:
        pos = next(i for i in range(pos, len(lines)) if w in lines[i]) + 1
    ffn_lines = graph_text(result.ffn).splitlines()
    assert ffn_lines[0].startswith("token_slots = input [")
    assert ffn_lines[-1].startswith("return v")


def test_a_view_of_the_hidden_state_the_ffn_also_reads_is_rebuilt_not_sent():
    # the router moved to the attention side reads view(h, [T, H]) (and a cast of it), the shared
    # expert reads h itself: one tensor crosses, the FFN program rebuilds the view and the cast
    from afd_compile.passes.split import _one_hidden

    g = torch.fx.Graph()
    h = g.placeholder("h")
    flat = g.call_function(torch.ops.aten.view.default, (h, [6, 4]))
    cast = g.call_function(torch.ops.aten._to_copy.default, (flat,), {"dtype": torch.float64})
    moved = g.call_function(torch.ops.aten._to_copy.default, (flat,), {"device": torch.device("meta")})
    other = g.placeholder("other")
    h.meta["val"], other.meta["val"] = torch.empty(2, 3, 4), torch.empty(2, 3, 4)
    flat.meta["val"], cast.meta["val"] = torch.empty(6, 4), torch.empty(6, 4, dtype=torch.float64)
    moved.meta["val"] = torch.empty(6, 4)
    assert _one_hidden([flat, h, cast]) is h
    assert _one_hidden([h]) is h
    assert _one_hidden([h, other]) is None  # two different tensors: refused
    assert _one_hidden([h, moved]) is None  # a device move is not a cast
