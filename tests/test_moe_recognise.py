"""MoE recognition (issue 34): every expert form becomes one ``afd::moe_experts`` node.

Three layers: per form, the rewritten graph holds one op per MoE layer and none of the model's
expert ops, and equals the model (fp32, 1e-5) on batches it was not traced with; a form the op
does not cover is recorded (and, strict, refused) naming the block and what was tried; the forms
the per-form rules used to refuse shard under TP, EP and AFD FFN groups on real gloo processes.
"""

from __future__ import annotations

import pytest
import torch
from handwritten import MODELS, export

from afd_compile.compare import max_rel_err
from afd_compile.layout import AFDLayout
from afd_compile.models import build_hf, export_lm
from afd_compile.passes.moe import RECORDS_KEY, MoERecognitionError, recognise_moe
from afd_compile.scatter import TPLayout
from afd_compile.verify import Case, TPCase, run_cases, run_tp_cases

OP = torch.ops.afd.moe_experts.default
#: ops of the model's own experts, none of which may survive recognition
EXPERT_OPS = ("bmm", "grouped_mm", "index_add", "index_put", "einsum", "nonzero", "where.default", "histc")

#: (form id, how to export it, words the record's form names, activation)
FORMS = [
    ("hf-grouped_mm", lambda: export_lm(build_hf("qwen3_moe", experts_implementation="grouped_mm")),
     "grouped_mm", "silu"),
    ("hf-batched_mm", lambda: export_lm(build_hf("qwen3_moe", experts_implementation="batched_mm")),
     "gathered-weight bmm", "silu"),
    # sigmoid router, group-limited top-k, score bias, weights gathered after top-k, shared experts
    ("hf-deepseek_v3", lambda: export_lm(build_hf("deepseek_v3", num_layers=2, experts_implementation="grouped_mm")),
     "grouped_mm", "silu"),
    ("loop-index_add", lambda: export(MODELS["loop_moe"]()), "loop over experts (index_add_)", "silu"),
    ("dense-bmm", lambda: export(MODELS["bmm_moe"]()), "stacked-weight bmm", "silu"),
    ("dense-einsum", lambda: export(MODELS["einsum_moe"]()), "stacked-weight bmm", "silu"),
    ("loop-index_put-gelu-bias", lambda: export(MODELS["put_moe"]()), "loop over experts (index_put_)", "gelu"),
]


@pytest.fixture(scope="module")
def programs() -> dict[str, torch.export.ExportedProgram]:
    return {}


def _program(programs: dict, form: str, make) -> torch.export.ExportedProgram:
    if form not in programs:
        programs[form] = make()
    return programs[form]


def _ids(batch: int, seq: int = 5) -> torch.Tensor:
    return torch.randint(1, 128, (batch, seq), generator=torch.Generator().manual_seed(batch))


@pytest.mark.parametrize("form,make,words,act", FORMS, ids=[f[0] for f in FORMS])
def test_each_expert_form_becomes_one_op_equal_to_the_model(programs, form, make, words, act):
    ep = _program(programs, form, make)
    gm = ep.module()
    records = recognise_moe(gm)
    ops = [n for n in gm.graph.nodes if n.target == OP]
    assert records and all(r.op for r in records), [str(r) for r in records]
    assert len(ops) == len(records) and gm.meta[RECORDS_KEY] == tuple(records)
    assert all(words in r.form and r.activation == act for r in records), [str(r) for r in records]
    left = sorted({str(n.target) for n in gm.graph.nodes if any(k in str(n.target) for k in EXPERT_OPS)})
    assert not left, left
    with torch.no_grad():
        for batch in (1, 3):
            assert max_rel_err(gm(_ids(batch)), ep.module()(_ids(batch))) <= 1e-5
    assert recognise_moe(gm) == [] and gm.meta[RECORDS_KEY] == tuple(records)  # idempotent: no block left


def test_an_unmatched_expert_form_is_named_and_left_or_refused():
    # GPT-OSS's experts: a clamped, interleaved GLU (alpha 1.702, limit 7) the op does not compute
    ep = export_lm(build_hf("gpt_oss", experts_implementation="grouped_mm"))
    gm = ep.module()
    records = recognise_moe(gm)
    assert records and all(r.op is None for r in records)
    assert all("no expert form matched" in r.reason and "gate_up_proj" in r.reason for r in records)
    assert not any(n.target == OP for n in gm.graph.nodes)
    assert max_rel_err(gm(_ids(2)), ep.module()(_ids(2))) == 0.0  # left exactly as the model wrote it
    with pytest.raises(MoERecognitionError, match=rf"combined at {records[0].combine}.*no expert form matched"):
        recognise_moe(ep.module(), strict=True)


@pytest.fixture(scope="module")
def saved(programs, tmp_path_factory) -> dict[str, str]:
    out = {}
    for form, make, _, _ in FORMS:
        if form in ("hf-batched_mm", "hf-deepseek_v3", "dense-einsum", "loop-index_put-gelu-bias"):
            path = str(tmp_path_factory.mktemp("moe") / f"{form}.pt2")
            torch.export.save(_program(programs, form, make), path)
            out[form] = path
    return out


def test_recognised_forms_shard_under_tp_and_moe_all_to_all(saved):
    # (each of these was refused by the per-form TP / EP rules)
    cases = [TPCase(saved["hf-batched_mm"], TPLayout(2)), TPCase(saved["dense-einsum"], TPLayout(2)),
             TPCase(saved["loop-index_put-gelu-bias"], TPLayout(2)),
             TPCase(saved["hf-deepseek_v3"], TPLayout(2, moe_a2a=True)),
             TPCase(saved["hf-batched_mm"], TPLayout(4, 2, moe_a2a=True), (3, 1))]
    for case, res in zip(cases, run_tp_cases(cases), strict=True):
        assert res and all(r["compared"] for r in res.values()), (case, res)
        assert max(r["max_rel_err"] for r in res.values()) <= 1e-5, (case, res)


def test_recognised_forms_split_for_afd_with_ffn_groups(saved):
    cases = [Case(saved["hf-deepseek_v3"], AFDLayout(2, 2, ffn_ep=2), (2, 3)),
             Case(saved["loop-index_put-gelu-bias"], AFDLayout(2, 2, ffn_tp=2), (1, 2)),
             Case(saved["dense-einsum"], AFDLayout(2, 1), (2, 1), gate=True)]
    for case, res in zip(cases, run_cases(cases), strict=True):
        errs = [r["max_rel_err"] for r in res.values() if r["role"] == "attention"]
        assert len(errs) == 2 and max(errs) <= 1e-5, (case, res)


def test_plan_says_which_form_each_block_was(saved):
    from clirun import run_cli

    ran = run_cli("plan", saved["loop-index_put-gelu-bias"], "--tp", "2")
    assert ran.returncode == 0, ran.stderr
    assert "MoE experts: 2 of 2 blocks recognised as afd::moe_experts" in ran.stdout
    assert "loop over experts (index_put_) (E=4, top-2, gelu) from layers.0.mlp.ups.*.weight as up" in ran.stdout
    ran = run_cli("plan", saved["hf-batched_mm"], "-A", "2", "-F", "1", "--json")
    assert ran.returncode == 0, ran.stderr
    import json

    blocks = json.loads(ran.stdout)["moe_blocks"]
    assert len(blocks) == 2 and all("gathered-weight bmm experts" in b for b in blocks)


def test_the_backend_with_no_layout_runs_the_op():
    # one process, no layout: moe_experts="op" recognises on CPU too ("auto": on CUDA only); a
    # graph with no recognised block compiles as without the option
    import afd_compile.backend as backend

    torch._dynamo.reset()
    model = MODELS["bmm_moe"]().eval()
    before = dict(backend.STATS)
    with torch.no_grad():
        out = torch.compile(model, backend="afd", options={"moe_experts": "op", "inductor": False})(_ids(2))
        assert max_rel_err(out, model(_ids(2))) <= 1e-5
    assert backend.STATS["layouts_compiled"] == before["layouts_compiled"] + 1
    assert backend.STATS["no_layout"] == before["no_layout"]
