"""Micro-batch stages (issue 13): the staged programs' structure (their transfers in the ping-pong
order, a golden around each cut), numerics of S = 2 and 3 against the single-process model on
real gloo processes (1A1F, 2A1F, 3A2F, uneven batches, fewer sequences than stages, a rank with
no tokens, MoE with the router on either side), and clear refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.fx as fx

from afd_compile.golden import cut_window_lines, graph_text
from afd_compile.layout import AFDLayout
from afd_compile.ops import ASYNC_OPS
from afd_compile.passes.schedule import transfers, verify_schedule
from afd_compile.passes.stages import StageError, stage_attention_program, stage_ffn_program
from afd_compile.split_api import split
from afd_compile.verify import Case, run_cases

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "golden")
aten = torch.ops.aten
RECV_START, RECV_WAIT = torch.ops.afd.p2p_recv_start.default, torch.ops.afd.p2p_recv_wait.default


@pytest.fixture(scope="module")
def llama_split(exported):
    return split(exported("llama2")[0], layout=AFDLayout(1, 1))


def test_staged_programs_transfer_layer_major_stage_minor(llama_split):
    attn = stage_attention_program(llama_split.attention, 3)
    ffn = stage_ffn_program(llama_split.ffn, 3)
    seq = [(t.direction, t.layer, t.stage) for t in verify_schedule(attn, ffn)]
    assert seq == [(d, layer, s) for layer in range(2) for s in range(3) for d in ("to_ffn", "to_attention")]
    assert [t.stage for t in transfers(ffn)] == [s for _ in range(2) for s in range(3) for _ in range(2)]
    inputs = [n.name for n in attn.graph.nodes if n.op == "placeholder"]
    assert inputs[-3:] == ["stage_rows_0", "stage_rows_1", "stage_rows_2"]
    assert [n.name for n in ffn.graph.nodes if n.op == "placeholder"] == [f"token_slots_{s}" for s in range(3)]
    # the model's weights are shared by the stages, not copied
    assert len(dict(attn.named_parameters())) == len(dict(llama_split.attention.named_parameters()))
    assert stage_attention_program(llama_split.attention, 1) is llama_split.attention
    # overlap: micro-batch s is waited on only after micro-batch s + 1 has started its transfers
    pos = {(n.target, n.args[2], n.args[3]): i for i, n in enumerate(attn.graph.nodes) if n.target in ASYNC_OPS}
    for layer in range(2):
        for s in range(2):
            assert pos[(RECV_WAIT, layer, s)] > pos[(RECV_START, layer, s + 1)]


def test_golden_of_the_two_stage_programs(llama_split, update_goldens):
    attn = stage_attention_program(llama_split.attention, 2)
    ffn = stage_ffn_program(llama_split.ffn, 2)
    order = [f"{n.target.__name__.split('.')[0].removeprefix('p2p_')} L{n.args[2]}/S{n.args[3]}"
             for n in attn.graph.nodes if n.op == "call_function" and n.target in ASYNC_OPS]
    text = "\n".join(["# llama2 1A1F, 2 micro-batch stages",
                      "## the attention program's transfers, in program order", *order,
                      "## attention program, around each cut (each stage's own nodes)", *cut_window_lines(attn),
                      "## ffn program (structure)", graph_text(ffn, shapes=False).rstrip("\n")]) + "\n"
    path = os.path.join(GOLDEN_DIR, "stages_llama2_1A1F_S2.txt")
    if update_goldens or not os.path.exists(path):
        if not update_goldens:
            pytest.fail(f"missing golden {path}; run pytest --update-goldens and review the diff")
        with open(path, "w") as fh:
            fh.write(text)
    with open(path) as fh:
        assert text == fh.read(), f"{path} changed; if intended, rerun with --update-goldens"


def test_stages_match_the_single_process_model(exported):
    llama, moe = exported("llama2")[1], exported("qwen3moe2")[1]
    cases = [
        Case(llama, AFDLayout(1, 1), (3, 2), stages=2),
        Case(llama, AFDLayout(2, 1), (3, 1), stages=3),         # a step with 1 sequence over 3 stages
        Case(llama, AFDLayout(3, 2), (4, 2, 1), stages=2),      # fan-in, uneven peer blocks and batches
        Case(llama, AFDLayout(2, 1), (3, 0), stages=2),         # a rank with no tokens at a step
        Case(moe, AFDLayout(2, 1), (3, 2), stages=2),
        Case(moe, AFDLayout(2, 1), (3, 2), gate=True, stages=3),  # router logits on the wire
    ]
    for case, res in zip(cases, run_cases(cases), strict=True):
        attn = [r for r in res.values() if r["role"] == "attention"]
        assert len(attn) == case.layout.attention_ranks, (case, res)
        assert all(r["compared"] and r["max_rel_err"] <= 1e-5 for r in attn), (case, res)
        # the stages really ran: transfers of every stage the largest batch fills
        assert all(set(r["stage_transfers"]) == set(range(min(case.stages, max(r["batches"])))) for r in attn), res


def _static_graph(build) -> fx.GraphModule:
    """A static-batch program (``x`` of [2, 3], ``counter`` a scalar buffer-like input) whose
    body ``build(g, x, counter)`` returns the output node's value."""
    g = fx.Graph()
    x, counter = g.placeholder("x"), g.placeholder("counter")
    x.meta["val"], counter.meta["val"] = torch.empty(2, 3), torch.empty(())
    g.output(build(g, x, counter))
    gm = fx.GraphModule(torch.nn.Module(), g)
    from torch.fx.passes.shape_prop import ShapeProp

    ShapeProp(gm).propagate(torch.randn(2, 3), torch.zeros(()))
    for n in gm.graph.nodes:
        if "tensor_meta" in n.meta:
            n.meta["val"] = torch.empty(n.meta["tensor_meta"].shape)
        elif n.target == aten.sym_size.int:
            n.meta["val"] = 2
    return gm


def _counter(g, x, counter):
    g.call_function(aten.add_.Scalar, (counter, g.call_function(aten.sym_size.int, (x, 0))))
    return g.call_function(aten.mul.Tensor, (x, 2.0))


@pytest.mark.parametrize(("build", "message"), [
    (_counter, r"attention program: node add__scalar \(aten.add_.Scalar\) updates counter, which does not hold "
               r"the batch, from each micro-batch's values"),
    (lambda g, x, c: g.call_function(aten.sum.dim_IntList, (x, [0])), r"sum_dim_int_list .* reduces over the batch dim "
     r"0"),
    (lambda g, x, c: g.call_function(aten.flip.default, (x, [1])),
     r"node flip_default \(aten.flip.default\): the batch reaches an op micro-batch stages have no rule for"),
    (lambda g, x, c: g.call_function(aten.sym_size.int, (x, 0)), r"output 0 \(sym_size_int\) is not a tensor"),
])
def test_static_batch_refusals_name_the_node(build, message):
    with pytest.raises(StageError, match=message):
        stage_attention_program(_static_graph(build), 2)


@pytest.mark.parametrize("end", [2, 5, 9223372036854775807, None, "batch"])
def test_a_slice_keeping_every_row_of_the_batch_runs_per_micro_batch(end):
    # x[0:end] along the batch dim keeping every row (graphs of some torch versions keep it, e.g.
    # torch 2.11's of Qwen3-MoE with a static cache): each micro-batch keeps its own rows
    def build(g, x, c):
        stop = g.call_function(aten.sym_size.int, (x, 0)) if end == "batch" else end
        return g.call_function(aten.mul.Tensor, (g.call_function(aten.slice.Tensor, (x, 0, 0, stop)), 2.0))

    gm = _static_graph(build)
    staged = stage_attention_program(gm, 2)
    assert sum(n.target == aten.slice.Tensor for n in staged.graph.nodes) > 2  # each stage's rows, then its slice
    x = torch.randn(2, 3)
    assert torch.equal(staged(x, torch.zeros(())), gm(x, torch.zeros(())))


def test_a_tensor_expanded_to_a_size_read_off_the_batch_carries_it():
    # inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1) (torch 2.11's graph of HF
    # rotary embeddings): each micro-batch's copy expands to its own rows
    def build(g, x, c):
        rows = g.call_function(aten.sym_size.int, (x, 0))
        wide = g.call_function(aten.expand.default, (g.call_function(aten.view.default, (c, [1, 1])), [rows, 3]))
        return g.call_function(aten.mul.Tensor, (x, g.call_function(aten.add.Tensor, (wide, 1.0))))

    gm = _static_graph(build)
    staged = stage_attention_program(gm, 2)
    expands = [n for n in staged.graph.nodes if n.target == aten.expand.default]
    assert len(expands) == 2 and len({e.args[1][0] for e in expands}) == 2  # each stage's own size read
    x, c = torch.randn(2, 3), torch.tensor(0.5)
    assert torch.equal(staged(x, c), gm(x, c))


def test_a_slice_dropping_rows_of_the_batch_is_refused():
    with pytest.raises(StageError, match=r"node slice_tensor \(aten.slice.Tensor\): a slice \[1:2:1\] of the batch "
                                         r"dim 0 \(size 2\) that drops rows"):
        stage_attention_program(_static_graph(lambda g, x, c: g.call_function(aten.slice.Tensor, (x, 0, 1, 2))), 2)


def test_refusals_name_the_reason():
    with pytest.raises(StageError, match="stages must be an integer >= 1, got 0"):
        stage_ffn_program(_static_graph(lambda g, x, c: x), 0)
    g = fx.Graph()
    g.placeholder("x").meta["val"] = torch.empty(())
    g.output(None)
    with pytest.raises(StageError, match="its first input has no batch dim"):
        stage_attention_program(fx.GraphModule(torch.nn.Module(), g), 2)


def test_layouts_stages_do_not_compose_with_yet_are_refused():
    from afd_compile.passes.stages import check_stage_layout

    with pytest.raises(StageError, match="stages of attention TP groups over a static batch .* batch 3"):
        check_stage_layout(AFDLayout(4, 2, attn_tp=2, ffn_tp=2), 2, 3)
    check_stage_layout(AFDLayout(4, 2, attn_tp=2, ffn_tp=2), 1, 3)  # one stage: today's program
    for layout in (AFDLayout(4, 2, attn_tp=2), AFDLayout(2, 2, 2), AFDLayout(2, 2, ffn_ep=2)):
        check_stage_layout(layout, 2, None)  # staged: tests/test_ffn_tp.py
    for layout in (AFDLayout(2, 2, 2), AFDLayout(2, 2, ffn_ep=2)):
        check_stage_layout(layout, 2, 3)  # staged over a static batch: tests/test_generate.py


def test_an_ffn_tp_group_program_is_staged_with_each_stage_s_group_counts(exported):
    from afd_compile.comm import GROUP_FFN_TP
    from afd_compile.passes.ffn_tp import tensor_parallel_ffn
    from afd_compile.split_api import split

    ffn = tensor_parallel_ffn(split(exported("llama2")[0]).ffn, 2, 0).program
    staged = stage_ffn_program(ffn, 3)
    inputs = [n.name for n in staged.graph.nodes if n.op == "placeholder"]
    assert inputs == [f"token_slots_{s}" for s in range(3)] + [f"ffn_group_slots_{s}" for s in range(3)]
    gather, settle = torch.ops.afd.all_gather_tokens.default, torch.ops.afd.reduce_scatter_tokens.default
    colls = [(n.target, n.args[1], n.args[-1]) for n in staged.graph.nodes if n.target in (gather, settle)]
    # layer-major, stage-minor: per stage the gather after its receive, the reduce-scatter before its send,
    # each reading its stage's counts
    assert colls == [(t, GROUP_FFN_TP, s) for _ in range(2) for s in range(3) for t in (gather, settle)]


def test_an_ffn_rank_refuses_a_peer_with_other_stages():
    from afd_compile.comm import AFDCommunicator
    from afd_compile.runtime import ControlError, FFNWorker

    worker = FFNWorker(fx.GraphModule(torch.nn.Module(), fx.Graph()),
                       AFDCommunicator("ffn", 0, (1, 2), check_wire=False),
                       torch.device("cpu"), stages=2)
    assert worker._check_control({1: [4, 0 | 1 << 1], 2: [3, 0 | 1 << 1]}) == (4, 3)
    with pytest.raises(ControlError, match="FFN rank 0 runs 2 micro-batch stage\\(s\\), attention rank 2 1"):
        worker._check_control({1: [4, 1 << 1], 2: [3, 0]})


def test_cli_stages(exported, capsys):
    from afd_compile.cli import main

    path = exported("llama2")[1]
    assert main(["plan", path, "-A", "2", "-F", "1", "--stages", "2"]) == 0
    out = capsys.readouterr().out
    assert "ping-pong schedule 2A1F, 2 layers x 2 stages" in out and "schedule: checked" in out
    assert main(["plan", path, "-A", "2", "-F", "1", "--stages", "2", "--json", "-q"]) == 0
    staged = json.loads(capsys.readouterr().out)["stages"]  # stdout is JSON alone
    assert staged["stages"] == 2 and staged["schedule_checked"] and staged["static_batch"] is None
    assert staged["schedule"][0] == "ping-pong schedule 2A1F, 2 layers x 2 stages"
    assert sum(staged["example"]["tokens_per_stage"]) == staged["example"]["sequences"] * staged["example"][
        "tokens_per_sequence"]
    assert main(["verify", path, "--tp", "2", "--stages", "2"]) == 2
    assert "--stages" in capsys.readouterr().err


def test_the_schedule_the_programs_hold_is_checked(llama_split):
    from afd_compile.passes.pingpong import check_schedule, schedule_of_programs
    from afd_compile.passes.schedule import ScheduleError

    attn = stage_attention_program(llama_split.attention, 2)
    ffn = stage_ffn_program(llama_split.ffn, 2)
    check_schedule(schedule_of_programs(AFDLayout(3, 2), attn, ffn))
    # an FFN program that takes stage 1 of layer 0 before stage 0: every pair mismatches
    recvs = [n for n in ffn.graph.nodes if n.target == torch.ops.afd.p2p_recv_group.default]
    a, b = recvs[0], recvs[1]
    a.args, b.args = (*a.args[:3], 1, *a.args[4:]), (*b.args[:3], 0, *b.args[4:])
    with pytest.raises(ScheduleError, match=r"transfer #0 from rank 1 to rank 0: rank 1 has send L0/S0 hidden -> 0, "
                                            r"rank 0 has recv L0/S1 hidden <- 1"):
        check_schedule(schedule_of_programs(AFDLayout(1, 1), attn, ffn))


@pytest.mark.parametrize(("stages", "batch", "counts"), [
    (1, None, []),          # unstaged: nothing more to build
    (2, None, [2]),         # a step with one sequence runs the unstaged program
    (4, None, [2, 3, 4]),   # a dynamic batch: every count a step can take
    (3, 8, [3]),            # a static batch: its fixed micro-batches only
    (4, 2, [2]),            # fewer static rows than stages
    (2, 1, []),             # one static row: unstaged
])
def test_the_builder_makes_every_stage_count_a_step_can_take(stages, batch, counts):
    from afd_compile.portable import stage_counts

    assert stage_counts(stages, batch) == counts


def test_a_worker_runs_only_programs_the_builder_made():
    from afd_compile.runtime.protocol import program_of

    with pytest.raises(RuntimeError, match=r"no program of 3 micro-batch stages was built \(built: \[2\]\)"):
        program_of({2: object()}, 3, "FFN")
