"""The pass pipeline of each rank kind (afd_compile/pipeline.py, issue 51).

Three layers: which passes a build runs, as a table; the declared lists are what the code runs
(the passes each build times, in order, and the lowering the backend applies); ``plan --passes``
prints them (golden).
"""

from __future__ import annotations

import pytest

from afd_compile.pipeline import (
    LOWERED_KEY,
    PIPELINES,
    RANK_KINDS,
    Build,
    lower,
    passes_for,
    pipeline_id,
)


def _names(build: Build, stage: str | None = None) -> list[str]:
    return [p.name for p in passes_for(build, stage)]


@pytest.mark.parametrize(
    ("build", "lowering"),
    [
        (Build("afd-attention"), ["drop_export_guards", "lower_for_inductor"]),
        (Build("afd-attention", device="cuda"),
         ["router_topk", "replace_decode_attention", "drop_export_guards", "lower_for_inductor"]),
        (Build("afd-attention", decode_attention="flex", inductor=False), ["replace_decode_attention"]),
        (Build("afd-attention", device="cuda", decode_attention="sdpa"),
         ["router_topk", "drop_export_guards", "lower_for_inductor"]),
        (Build("afd-ffn"), ["fuse_send_recv", "receive_into_buffers", "drop_export_guards", "lower_for_inductor"]),
        (Build("afd-ffn", device="cuda", inductor=False), ["router_topk", "fuse_send_recv", "receive_into_buffers"]),
        (Build("tp", states=("k_cache",)),
         ["hold_local_states", "drop_export_guards", "lower_for_inductor"]),
        (Build("tp", device="cuda"),
         ["router_topk", "replace_decode_attention", "drop_export_guards", "lower_for_inductor"]),
        (Build("none", device="cuda"), ["router_topk", "drop_export_guards", "lower_for_inductor"]),
        (Build("none", decode_attention="flex", inductor=False), ["replace_decode_attention"]),
    ],
)
def test_the_lowering_a_build_runs_follows_from_its_device_and_options(build, lowering):
    assert _names(build, "lowering") == lowering


@pytest.mark.parametrize(
    ("build", "present", "absent"),
    [
        (Build("afd-attention"), ["recognise_moe", "annotate_roles", "plan_split", "verify_schedule"],
         ["attention_tp_program", "stage_programs", "ffn_tokens_follow_the_carrier"]),
        (Build("afd-attention", attn_tp=2, stages=2), ["attention_tp_program", "stage_programs"], []),
        (Build("afd-ffn"), ["build_ffn_program", "verify_schedule"],
         ["ffn_group_program", "stage_programs", "ffn_tokens_follow_the_carrier"]),
        (Build("afd-ffn", fan_in=2), ["ffn_tokens_follow_the_carrier"], ["ffn_group_program"]),
        (Build("afd-ffn", ffn_tp=2), ["ffn_tokens_follow_the_carrier", "ffn_group_program"], []),
        (Build("afd-ffn", ffn_ep=2), ["ffn_group_program"], ["ffn_tokens_follow_the_carrier"]),
        (Build("tp"), ["unpack_grouped_projections", "insert_all_reduces", "fuse_norm"], ["rewrite_dp_attention"]),
        (Build("tp", attn_dp=2), ["rewrite_dp_attention", "vocab_parallel_head"],
         ["insert_all_reduces", "fuse_norm"]),
        (Build("none", moe_op=False), [], ["recognise_moe"]),
    ],
)
def test_the_portable_passes_a_build_runs_follow_from_its_layout(build, present, absent):
    names = _names(build, "portable")
    assert all(p in names for p in present), (present, names)
    assert not any(p in names for p in absent), (absent, names)


def test_every_pipeline_is_portable_then_lowering_and_names_each_pass_once():
    for kind in RANK_KINDS:
        stages = [p.stage for p in PIPELINES[kind]]
        assert stages == sorted(stages, key=("portable", "lowering").index), kind
        names = [p.name for p in PIPELINES[kind]]
        assert len(names) == len(set(names)), kind
    with pytest.raises(ValueError, match="kind 'moe' is not one of"):
        Build("moe")


def test_the_pipeline_id_changes_with_the_passes_that_run():
    assert pipeline_id(Build("afd-ffn")) == pipeline_id(Build("afd-ffn"))
    assert pipeline_id(Build("afd-ffn")) != pipeline_id(Build("afd-ffn", device="cuda"))
    assert pipeline_id(Build("afd-ffn")) != pipeline_id(Build("afd-attention"))
    # (stages add the portable stage_programs)
    assert pipeline_id(Build("afd-ffn", stages=2)) != pipeline_id(Build("afd-ffn"))


def test_the_split_runs_the_declared_portable_passes_in_order(exported):
    # split runs the afd-ffn pipeline of the layout's FFN ranks through verify_schedule: the passes
    # it times, in order, are the declared ones (a pass that applies and finds nothing still runs)
    from afd_compile.layout import AFDLayout
    from afd_compile.split_api import split

    ep = exported("llama2")[0]
    result = split(ep, layout=AFDLayout(2, 1))
    declared = _names(Build("afd-ffn", fan_in=2), "portable")
    assert list(result.timings) == declared[:declared.index("verify_schedule") + 1]


def test_a_worker_runs_its_ranks_declared_portable_passes(exported):
    # what deploy runs for a rank is its build's list, in order: the attention rank of an
    # attention TP group and the FFN rank of an FFN TP group, both staged
    from afd_compile.deploy import rank_work
    from afd_compile.layout import AFDLayout
    from afd_compile.pipeline import rank_build
    from afd_compile.programs import fresh_module
    from afd_compile.split_api import SplitConfig

    ep = exported("llama2")[0]
    layout = AFDLayout(2, 2, attn_tp=2, ffn_tp=2)
    for rank in (0, 2):
        work = rank_work(fresh_module(ep), layout, rank, SplitConfig(), stages=2)
        assert work.done == list(work.timings.seconds) == _names(rank_build(layout, rank, 2), "portable")
        assert sorted(work.staged) == [2] and work.schedule is not None
        assert (work.ffn_group is not None) == (rank == 0)  # (rank 0: an FFN group's)
    assert work.ffn_group is None and work.attention is not work.split.attention  # (rank 2: attention TP)


def test_a_tp_rank_runs_the_declared_portable_passes_in_order(exported):
    from afd_compile.deploy import tp_rank_program
    from afd_compile.scatter import TPLayout

    ep = exported("llama2")[0]
    for layout in (TPLayout(2), TPLayout(4, 2)):
        prog = tp_rank_program(ep.module(), layout, 0)
        assert list(prog.timings) == _names(Build("tp", attn_dp=layout.attn_dp), "portable")
    with pytest.raises(ValueError, match="'fuse_norm' is not a portable pass of the afd-ffn pipeline"):
        from afd_compile.portable import Work, run
        run(Work(Build("afd-ffn"), ep.module()), until="fuse_norm")


def test_lower_runs_the_ffn_lowering_once_in_place(exported):
    from afd_compile.ops import LOWERED_OPS
    from afd_compile.split_api import split

    ffn = split(exported("llama2")[0]).ffn
    records = lower(ffn, Build("afd-ffn", inductor=False))
    assert list(records) == ["fuse_send_recv", "receive_into_buffers"]
    assert len(records["fuse_send_recv"]) == 1  # (2 layers: one send + next receive pair)
    assert list(ffn.meta[LOWERED_KEY]) == ["fuse_send_recv", "receive_into_buffers"]
    targets = {n.target for n in ffn.graph.nodes}
    assert any(op in targets for op in LOWERED_OPS)
    assert lower(ffn, Build("afd-ffn", inductor=False)) == {}  # (already lowered: nothing runs twice)
    early = split(exported("llama2")[0]).ffn
    assert list(lower(early, Build("afd-ffn"), stop_before="drop_export_guards")) == ["fuse_send_recv",
                                                                                    "receive_into_buffers"]
    assert list(lower(early, Build("afd-ffn"))) == ["drop_export_guards", "lower_for_inductor"]
    with pytest.raises(ValueError, match="'fuse_norm' is not a pass of the afd-ffn pipeline"):
        lower(early, Build("afd-ffn"), stop_before="fuse_norm")


def test_plan_passes_prints_each_rank_kinds_pipeline(tmp_path, capsys, check_golden):
    # the lists follow from the layout and options: the model is not loaded (an empty file will do)
    import json

    from afd_compile import cli

    model = tmp_path / "m.pt2"
    model.write_bytes(b"")
    text = []
    for argv in (["-A", "4", "-F", "2", "--ffn-tp", "2", "--stages", "2", "--passes"],
                 ["--tp", "4", "--attn-dp", "2", "--passes", "cpu"], ["--passes"]):
        assert cli.main(["plan", str(model), *argv]) == 0
        text.append(f"$ plan m.pt2 {' '.join(argv)}\n{capsys.readouterr().out}")
    check_golden("plan_passes.txt", "".join(text))
    assert cli.main(["plan", str(model), "-A", "2", "-F", "1", "--passes", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["kind"] for r in records] == ["afd-attention", "afd-ffn"]
    ffn = {p["name"]: p for p in records[1]["passes"]}
    assert ffn["fuse_send_recv"]["stage"] == "lowering" and ffn["fuse_send_recv"]["applies"]
    assert not ffn["ffn_group_program"]["applies"] and ffn["ffn_tokens_follow_the_carrier"]["applies"]
    assert cli.main(["plan", str(tmp_path / "missing.pt2"), "--passes"]) == 2
    assert "missing.pt2: no such file" in capsys.readouterr().err


def test_verify_lowered_runs_what_the_backend_runs_on_the_cpu_and_matches(exported):
    # the FFN rank's lowering (each send with the next receive as one op, receives into buffers)
    # runs in the real exchange of a 2A1F fan-in with two stages and matches the original
    from afd_compile.layout import AFDLayout
    from afd_compile.verify import verify_afd

    lines: list[str] = []
    report = verify_afd(exported("llama2")[1], AFDLayout(2, 1), batches=[2, 3], stages=2, lowered=True,
                        log=lines.append)
    assert report.ok and report.max_rel_err <= 1e-5, report.line()
    ffn = next(line for line in lines if "rank 0 ffn" in line)
    assert "lowered by fuse_send_recv (1), receive_into_buffers (2)" in ffn, ffn
    attention = [line for line in lines if " attention: " in line]
    assert len(attention) == 2 and all("lowered by no pass" in line for line in attention), attention
    assert all(r["lowered"] == {} for r in report.per_rank.values() if r["role"] == "attention")


def test_verify_lowered_is_refused_for_a_tp_layout(exported):
    from clirun import run_cli

    ran = run_cli("verify", exported("llama2")[1], "--tp", "2", "--lowered")
    assert ran.returncode == 2
    assert ran.stderr.strip().endswith("only the torch.compile backend runs: drop --lowered"), ran.stderr


def test_verify_saved_lowered_lowers_the_programs_rewrite_wrote(exported, tmp_path):
    from clirun import run_cli

    from afd_compile.verify import VerifyInputError, verify_saved

    out = tmp_path / "out"
    ran = run_cli("rewrite", exported("llama2")[1], "-o", str(out), "-A", "2", "-F", "1", "-q")
    assert ran.returncode == 0, ran.stderr
    lines: list[str] = []
    report = verify_saved(exported("llama2")[1], str(out), batches=[1, 2], lowered=True, log=lines.append)
    assert report.ok, report.line()
    assert any("rank 0 ffn" in line and "lowered by fuse_send_recv (1)" in line for line in lines), lines
    tp = tmp_path / "tp"
    assert run_cli("rewrite", exported("llama2")[1], "-o", str(tp), "--tp", "2", "-q").returncode == 0
    with pytest.raises(VerifyInputError, match="a TP folder; lowered=True runs an AFD layout's lowering stage"):
        verify_saved(exported("llama2")[1], str(tp), lowered=True)


def test_every_declared_pass_has_one_runner_and_every_runner_a_declaration():
    # a pass is added where it is declared (pipeline.PIPELINES) with its runner beside the others of
    # its stage (portable._RUNNERS, pipeline._LOWERING): neither can be missing
    from afd_compile import pipeline, portable

    runners = {"portable": portable._RUNNERS, "lowering": pipeline._LOWERING}
    missing = [(kind, p.name) for kind in RANK_KINDS for p in PIPELINES[kind] if p.name not in runners[p.stage]]
    assert not missing, missing
    declared = {p.name for passes in PIPELINES.values() for p in passes}
    assert set(portable._RUNNERS) | set(pipeline._LOWERING) == declared
