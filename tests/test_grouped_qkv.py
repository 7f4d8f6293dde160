"""A projection packed per KV group unpacked into q / k / v blocks (passes/grouped_qkv.py): the
rewrite alone (exact on one process, what it replaces), then the TP numerics of its forms."""

from __future__ import annotations

import pytest
import torch
from handwritten import export, grouped_qkv

from afd_compile.passes.grouped_qkv import unpack_grouped_projections
from afd_compile.scatter import TPLayout
from afd_compile.verify import TPCase, run_tp_cases

aten = torch.ops.aten
FORMS = [(1, "slice"), (2, "slice"), (2, "index"), (1, "split"), (1, "unbind")]


@pytest.mark.parametrize("groups,form", FORMS, ids=[f"{f}-g{g}" for g, f in FORMS])
def test_unpacking_is_exact_and_leaves_blocks(groups, form):
    gm = export(grouped_qkv(groups, form)).module()
    ids = torch.randint(0, 128, (3, 5), generator=torch.Generator().manual_seed(1))
    want = gm(ids)
    records = unpack_grouped_projections(gm)
    slots = [(0, 4), (4, 5), (5, 6)] if form != "unbind" else [(0, 1), (1, 2), (2, 3)]
    if groups == 2:
        slots = [(0, 2), (2, 3), (3, 4)]
    assert [(r.groups, list(r.ranges)) for r in records] == [(4 if form == "unbind" else groups, slots)] * 2
    assert torch.equal(gm(ids), want)  # a permutation of the weight's rows and views of the same values
    nodes = list(gm.graph.nodes)
    assert sum(n.target == aten.split_with_sizes.default for n in nodes) == 2
    assert not any(n.target in (aten.slice.Tensor, aten.select.int, aten.unbind.int, aten.index.Tensor,
                                aten.lift_fresh_copy.default) for n in nodes)
    names = {name for name, _ in gm.named_parameters()}
    assert {"afd_unpacked_layers_0_attn_qkv_weight", "afd_unpacked_layers_0_attn_qkv_bias"} <= names
    assert not any(name.endswith("attn.qkv.weight") for name in names)  # (the packed copy dropped)


def test_a_packed_view_read_whole_elsewhere_is_left_alone():
    gm = export(grouped_qkv()).module()
    view = next(n for n in gm.graph.nodes if n.target == aten.view.default and len(n.args[1]) == 5)
    with gm.graph.inserting_after(view):  # another reader of the whole view: no block layout fits it
        extra = gm.graph.call_function(aten.sum.default, (view,))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = ((*out.args[0], extra),) if isinstance(out.args[0], tuple) else ((out.args[0], extra),)
    gm.recompile()
    records = unpack_grouped_projections(gm)
    assert [r.node for r in records] == ["linear_5"]  # only layer 1's projection


@pytest.fixture(scope="module")
def form_paths(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("grouped_qkv")
    paths = {}
    for groups, form in FORMS[1:]:
        paths[f"{form}{groups}"] = str(folder / f"{form}{groups}.pt2")
        torch.export.save(export(grouped_qkv(groups, form)), paths[f"{form}{groups}"])
    return paths


def test_every_form_shards_with_fewer_kv_groups_than_ranks(form_paths):
    # 2 groups over 4 ranks (K/V replicated twice; sliced or list-indexed), one group over 2 (split),
    # per-head q/k/v (unbind)
    cases = [TPCase(form_paths["slice2"], TPLayout(4, 2), (1, 2)), TPCase(form_paths["index2"], TPLayout(4), (2,)),
             TPCase(form_paths["split1"], TPLayout(2), (2,)), TPCase(form_paths["unbind1"], TPLayout(2), (2,))]
    for case, res in zip(cases, run_tp_cases(cases), strict=True):
        assert res and all(r["compared"] for r in res.values()), (case, res)
        assert max(r["max_rel_err"] for r in res.values()) <= 1e-5, (case, res)


def test_plan_says_which_projections_were_unpacked(form_paths, capsys):
    import json

    from afd_compile.cli import main

    assert main(["plan", form_paths["split1"], "--tp", "2", "-q"]) == 0
    out = capsys.readouterr().out
    assert "q/k/v packed per KV group: 2 projections unpacked into blocks first" in out
    assert "layers.0.attn.qkv.weight packed per group (1 group, slots [(0, 4), (4, 5), (5, 6)])" in out
    assert main(["plan", form_paths["split1"], "--tp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["unpacked_projections"]) == 2


def test_a_list_index_computed_in_the_graph_is_not_read_as_a_slot():
    # a slot picked by qkv[..., idx] with idx a graph input (not a constant), beside slots 1..5:
    # no slot range can be known for it, so the projection is left as the model wrote it
    class Computed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(8, 6 * 4)

        def forward(self, x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            v = self.qkv(x).view(x.shape[0], x.shape[1], 1, 6, 4)
            return v[:, :, :, idx], v[:, :, :, 1:]

    x, idx = torch.randn(2, 3, 8), torch.tensor([3])
    gm = torch.export.export(Computed(), (x, idx)).module()
    want = gm(x, idx)
    assert unpack_grouped_projections(gm) == []
    assert all(torch.equal(a, b) for a, b in zip(gm(x, idx), want, strict=True))
