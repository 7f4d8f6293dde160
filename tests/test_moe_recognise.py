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
EXPERT_OPS = ("bmm", "grouped_mm", "index_add", "index_put", "einsum", "nonzero", "where.default", "histc",
              "scatter_add")

#: (form id, how to export it, words the record's form names, activation)
FORMS = [
    ("hf-grouped_mm", lambda: export_lm(build_hf("qwen3_moe", experts_implementation="grouped_mm")),
     "grouped_mm", "silu"),
    ("hf-batched_mm", lambda: export_lm(build_hf("qwen3_moe", experts_implementation="batched_mm")),
     "gathered-weight bmm", "silu"),
    # sigmoid router, group-limited top-k, score bias, weights gathered after top-k, shared experts
    ("hf-deepseek_v3", lambda: export_lm(build_hf("deepseek_v3", num_layers=2, experts_implementation="grouped_mm")),
     "grouped_mm", "silu"),
    # PhiMoE's sparsemixer: one expert at a time by max over the masked scores, concatenated
    ("hf-phimoe-sparsemixer", lambda: export_lm(build_hf("phimoe", experts_implementation="batched_mm")),
     "gathered-weight bmm", "silu"),
    ("loop-index_add", lambda: export(MODELS["loop_moe"]()), "loop over experts (index_add_)", "silu"),
    ("sort-sliced-weights-first", lambda: export(MODELS["sort_moe"]()), "gathered-weight bmm", "silu"),
    ("argmax-top1-where-relu", lambda: export(MODELS["top1_moe"]()), "loop over experts (index_add_)", "relu"),
    ("dense-bmm", lambda: export(MODELS["bmm_moe"]()), "stacked-weight bmm", "silu"),
    # non-gated experts with a squared ReLU (Nemotron-H's)
    ("dense-bmm-relu2", lambda: export(MODELS["relu2_moe"]()), "stacked-weight bmm", "relu2"),
    ("dense-einsum", lambda: export(MODELS["einsum_moe"]()), "stacked-weight bmm", "silu"),
    # the experts' own norm of the rows (a weight of its own), a per-expert scale on the routing weights (Gemma-4's)
    ("loop-normed-rows-expert-scale", lambda: export(MODELS["normed_moe"]()), "loop over experts (index_add_)",
     "silu"),
    ("loop-index_put-gelu-bias", lambda: export(MODELS["put_moe"]()), "loop over experts (index_put_)", "gelu"),
    # GPT-OSS: a clamped GLU (alpha, limit read from the graph), gate/up interleaved, expert biases
    ("hf-gpt_oss-clamped-glu", lambda: export_lm(build_hf("gpt_oss", experts_implementation="grouped_mm")),
     "grouped_mm", "swiglu_oai(alpha=1.702, limit=7)"),
    # another library's experts: its own grouped-GEMM and scatter-add ops, its router under autocast
    ("lib-custom-ops-autocast", lambda: export(MODELS["lib_moe"]()), "grouped_mm", "silu"),
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


def test_bf16_experts_combined_in_fp32_are_recognised():
    """DeepSeek-V3 in bf16: its experts compute in bf16 and combine under fp32 routing weights (an fp32
    output): the expert forms are told apart at bf16's tolerance, not fp32's (no form matched before)."""
    model = build_hf("deepseek_v3", num_layers=2, experts_implementation="grouped_mm").to(torch.bfloat16)
    ep = export_lm(model)
    gm = ep.module()
    records = recognise_moe(gm)
    assert records and all(r.op for r in records), [str(r) for r in records]
    with torch.no_grad():
        assert max_rel_err(gm(_ids(3)), ep.module()(_ids(3))) <= 2e-2


class _TanhGLU(torch.nn.Module):
    """The stacked-weight bmm MoE of ``handwritten.BmmMoE`` with a tanh GLU, no activation the op has."""

    def __init__(self, moe: torch.nn.Module) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, (b, s, h) = self.moe, x.shape
        t = x.reshape(b * s, h)
        probs = m.router(t).softmax(-1)
        top, idx = probs.topk(m.top_k, dim=-1)
        weights = torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        gate, up = torch.bmm(t.unsqueeze(0).expand(m.gate_up.shape[0], b * s, h), m.gate_up).chunk(2, dim=-1)
        y = torch.bmm(torch.tanh(gate) * up, m.down)
        return (y * weights.t().unsqueeze(-1)).sum(0).view(b, s, h)


def test_an_unmatched_expert_form_is_named_and_left_or_refused(tmp_path):
    from clirun import run_cli

    model = MODELS["bmm_moe"]()
    for block in model.layers:
        block.mlp = _TanhGLU(block.mlp)
    ep = export(model)
    gm = ep.module()
    records = recognise_moe(gm)
    assert len(records) == 2 and all(r.op is None for r in records)
    assert all("no expert form matched" in r.reason and "mlp.moe.gate_up" in r.reason for r in records), records
    assert not any(n.target == OP for n in gm.graph.nodes)
    assert max_rel_err(gm(_ids(2)), ep.module()(_ids(2))) == 0.0  # left exactly as the model wrote it
    with pytest.raises(MoERecognitionError, match=rf"combined at {records[0].combine}.*no expert form matched"):
        recognise_moe(ep.module(), strict=True)
    # what shards experts refuses it (no per-form fallback); AFD without FFN groups runs it as written
    path = str(tmp_path / "tanh_glu.pt2")
    torch.export.save(ep, path)
    for layout in (("--tp", "2"), ("-A", "2", "-F", "2", "--ffn-ep", "2"), ("-A", "2", "-F", "2", "--ffn-tp", "2")):
        ran = run_cli("plan", path, *layout)
        assert ran.returncode == 2, (layout, ran.stdout, ran.stderr)
        assert f"MoE block combined at {records[0].combine}" in ran.stderr and "no expert form matched" in ran.stderr
        assert "shard experts only as the recognised afd::moe_experts op" in ran.stderr
    ran = run_cli("plan", path, "-A", "2", "-F", "1")
    assert ran.returncode == 0 and "MoE experts: 0 of 2 blocks recognised" in ran.stdout, ran.stderr
    # profile times it as written, says so, and the estimate says what that leaves out
    prof = str(tmp_path / "p.json")
    ran = run_cli("profile", path, "-o", prof, "--device", "cpu", "--tokens", "1,2", "--contexts", "8",
                  "--kv-batches", "1,2", "--iters", "1", "--no-compile")
    assert ran.returncode == 0 and "2 MoE block(s) not recognised" in ran.stdout + ran.stderr, ran.stderr
    ran = run_cli("plan", path, "--estimate", prof, "-A", "1", "-F", "1", "--batch", "1", "--context", "8")
    assert ran.returncode == 0 and "note: 2 MoE block(s) of the profiled model were not recognised" in ran.stdout \
        and "no EP layout is weighed" in ran.stdout, (ran.stdout, ran.stderr)


@pytest.fixture(scope="module")
def saved(programs, tmp_path_factory) -> dict[str, str]:
    out = {}
    for form, make, _, _ in FORMS:
        if form in ("hf-batched_mm", "hf-deepseek_v3", "dense-einsum", "loop-index_put-gelu-bias",
                    "hf-phimoe-sparsemixer", "sort-sliced-weights-first", "argmax-top1-where-relu",
                    "lib-custom-ops-autocast"):
            path = str(tmp_path_factory.mktemp("moe") / f"{form}.pt2")
            torch.export.save(_program(programs, form, make), path)
            out[form] = path
    return out


def test_recognised_forms_shard_under_tp_and_moe_all_to_all(saved):
    # (each of these was refused by the per-form TP / EP rules)
    cases = [TPCase(saved["hf-batched_mm"], TPLayout(2)), TPCase(saved["dense-einsum"], TPLayout(2)),
             TPCase(saved["loop-index_put-gelu-bias"], TPLayout(2)),
             TPCase(saved["hf-deepseek_v3"], TPLayout(2, moe_a2a=True)),
             TPCase(saved["hf-batched_mm"], TPLayout(4, 2, moe_a2a=True), (3, 1)),
             # routers choosing by max (PhiMoE), by a sliced sort, by argmax (one expert)
             TPCase(saved["hf-phimoe-sparsemixer"], TPLayout(2)),
             TPCase(saved["sort-sliced-weights-first"], TPLayout(4, 2, moe_a2a=True), (2, 1)),
             TPCase(saved["argmax-top1-where-relu"], TPLayout(2, moe_a2a=True))]
    for case, res in zip(cases, run_tp_cases(cases), strict=True):
        assert res and all(r["compared"] for r in res.values()), (case, res)
        assert max(r["max_rel_err"] for r in res.values()) <= 1e-5, (case, res)


def test_recognised_forms_split_for_afd_with_ffn_groups(saved):
    # (DeepSeek-V3 with its router on the attention side: the router reads a flat view of the hidden
    # state its shared expert reads whole: the FFN side rebuilds the view, one tensor crosses)
    cases = [Case(saved["hf-deepseek_v3"], AFDLayout(2, 2, ffn_ep=2), (2, 3)),
             Case(saved["hf-deepseek_v3"], AFDLayout(2, 2, ffn_ep=2), (1, 2), gate=True),
             Case(saved["loop-index_put-gelu-bias"], AFDLayout(2, 2, ffn_tp=2), (1, 2)),
             Case(saved["dense-einsum"], AFDLayout(2, 1), (2, 1), gate=True),
             Case(saved["hf-phimoe-sparsemixer"], AFDLayout(2, 2, ffn_ep=2), (1, 2)),
             Case(saved["argmax-top1-where-relu"], AFDLayout(2, 2, ffn_tp=2), (2, 1), gate=True)]
    for case, res in zip(cases, run_cases(cases), strict=True):
        errs = [r["max_rel_err"] for r in res.values() if r["role"] == "attention"]
        assert len(errs) == 2 and max(errs) <= 1e-5, (case, res)


def test_another_librarys_custom_ops_and_autocast_router_shard_and_split(saved, monkeypatch):
    # its ops load where its module is imported (the local processes import what
    # AFD_COMPILE_IMPORTS names); the autocast region (a higher-order op with a submodule) goes
    # with the router into either program
    import os

    from afd_compile.programs import IMPORTS_ENV

    monkeypatch.setenv(IMPORTS_ENV, os.path.join(os.path.dirname(__file__), "moelib.py"))
    path = saved["lib-custom-ops-autocast"]
    (tp,) = run_tp_cases([TPCase(path, TPLayout(2))])
    assert tp and all(r["compared"] for r in tp.values()) and max(r["max_rel_err"] for r in tp.values()) <= 1e-5
    cases = [Case(path, AFDLayout(2, 1), (2, 3)), Case(path, AFDLayout(2, 2, ffn_ep=2), (1, 2), gate=True)]
    for case, res in zip(cases, run_cases(cases), strict=True):
        errs = [r["max_rel_err"] for r in res.values() if r["role"] == "attention"]
        assert len(errs) == 2 and max(errs) <= 1e-5, (case, res)


def test_a_custom_op_library_is_imported_by_import_or_named(saved):
    # (a fresh process: this one imported the library already)
    import os
    import subprocess
    import sys

    from clirun import run_cli

    path = saved["lib-custom-ops-autocast"]
    env = {k: v for k, v in os.environ.items() if k != "AFD_COMPILE_IMPORTS"}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "afd_compile.cli", *args], capture_output=True, text=True,
                              env=env, timeout=300)

    ran = cli("plan", path, "--tp", "2")
    assert ran.returncode == 2 and "the custom op moelib::grouped_mm" in ran.stderr and "--import MODULE" in ran.stderr
    ran = cli("plan", path, "-A", "2", "-F", "1", "--import", os.path.join(os.path.dirname(__file__), "moelib.py"))
    assert ran.returncode == 0, ran.stderr
    assert "MoE experts: 2 of 2 blocks recognised" in ran.stdout
    ran = run_cli("plan", path, "--tp", "2", "--import", "no_such_library_x")
    assert ran.returncode == 2 and ran.stderr.strip().endswith(
        "--import no_such_library_x: cannot import it: ModuleNotFoundError: No module named 'no_such_library_x'")


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


def test_a_dead_in_place_update_of_a_temporary_is_dropped_and_one_of_state_kept():
    # transformers 5.17's grouped-MM experts clamp_ their sorted ids in place: once the experts are
    # one op, sort -> getitem -> clamp_ reads nothing onward (the FFN program kept a 'sort' that the
    # static-token pass refused under torch 2.11); a write into an input stays
    from torch.fx.experimental.proxy_tensor import make_fx

    from afd_compile.passes.graph_utils import drop_dead_writes

    def f(ids: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        order = torch.sort(ids)[1]
        order.clamp_(max=3)  # read by nothing
        state.view(-1).add_(1)  # state: kept
        return ids + 1

    gm = make_fx(f)(torch.tensor([3, 1, 2]), torch.zeros(2, 2))
    targets = lambda: [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]  # noqa: E731
    assert "aten.sort.default" in targets() and "aten.clamp_.default" in targets()
    erased = drop_dead_writes(gm.graph)
    assert "aten.sort.default" not in targets() and "aten.clamp_.default" not in targets(), (erased, targets())
    assert "aten.add_.Tensor" in targets() or "aten.add_.Scalar" in targets(), targets()


def test_an_moe_output_viewed_back_to_the_residual_outside_the_block_runs_scattered(tmp_path):
    """Llama 4's decoder layer views its MoE's [T, H] output back to the residual's [b, s, H]
    (``view(residual.shape)``, sized by the attention's own sizes), outside the MoE block: under
    ``--moe-a2a`` the MLP's rows are this rank's share, so that view must take them as rows (it
    asked for the whole batch: "shape '[2, 5, 64]' is invalid for input of size 320")."""
    import transformers

    from afd_compile.models import LogitsOnly

    cfg = transformers.Llama4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=1,
        max_position_embeddings=64)
    torch.manual_seed(0)
    path = str(tmp_path / "llama4.pt2")
    torch.export.save(export_lm(LogitsOnly(transformers.Llama4ForCausalLM(cfg).eval())), path)
    cases = [TPCase(path, TPLayout(2, moe_a2a=True)), TPCase(path, TPLayout(4, 2, moe_a2a=True), (3, 1))]
    for case, res in zip(cases, run_tp_cases(cases), strict=True):
        assert res and all(r["compared"] for r in res.values()), (case, res)
        assert max(r["max_rel_err"] for r in res.values()) <= 1e-5, (case, res)
