"""Trust in every verdict (issue 11): nothing passes that was not compared, bad input is refused
before any process starts, a failed rank ends the run fast and is named, output is written whole."""

from __future__ import annotations

import math
import os
import re
import signal
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_compile import cli
from afd_compile.compare import compare, max_rel_err
from afd_compile.deploy import load_rewritten_worker
from afd_compile.programs import ProgramLoadError
from afd_compile.runtime import RankFailure, run_local
from afd_compile.verify import (
    ProgramFacts,
    VerifyInputError,
    VerifyReport,
    check_verify_inputs,
)

# --- the comparison: NaN / Inf / shape are failures, never a small error ------------------------


@pytest.mark.parametrize(
    ("out", "problem"),
    [
        (torch.tensor([1.0, float("nan")]), "output 0 holds 1 NaN and 0 Inf of 2 values"),
        (torch.tensor([1.0, float("inf")]), "output 0 holds 0 NaN and 1 Inf of 2 values"),
        (torch.full((2,), float("nan")), "output 0 holds 2 NaN"),
        (torch.ones(1, 2), "output 0 has shape (1, 2), the reference (2,)"),
        ((torch.ones(2), torch.ones(2)), "2 output tensors, the reference has 1"),
    ],
)
def test_non_finite_or_misshapen_output_is_a_problem_never_a_small_error(out, problem):
    c = compare(out, torch.tensor([1.0, 2.0]))
    assert problem in c.problem
    assert c.max_rel_err == math.inf and max(0.0, max_rel_err(out, torch.tensor([1.0, 2.0]))) == math.inf
    assert not c.passes(1e9)


def test_a_non_finite_reference_cannot_pass():
    c = compare(torch.tensor([1.0, 2.0]), torch.tensor([1.0, float("nan")]))
    assert "the reference output 0 holds 1 NaN" in c.problem and not c.passes(1.0)


def test_verify_fails_a_model_whose_outputs_are_nan(tmp_path, capsys):
    # NaN everywhere used to print "verify: OK max_rel_err=0" (max(0.0, nan) is 0.0)
    from afd_compile.models import build_hf, export_lm

    model = build_hf("llama", num_layers=1)
    with torch.no_grad():
        model.model.model.layers[0].mlp.down_proj.weight.fill_(float("nan"))
    path = tmp_path / "nan.pt2"
    torch.export.save(export_lm(model), path)
    assert cli.main(["verify", str(path), "-A", "1", "-F", "1", "--tokens", "2", "--steps", "1"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("verify: FAIL max_rel_err=inf tol=1e-05 (rank 1 step 0: the reference output 0 holds 1280 "
                           "NaN"), last


def test_finite_outputs_compare_by_relative_error():
    c = compare(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0]))
    assert c.problem is None and c.max_rel_err == pytest.approx(0.25) and c.values == 2
    assert c.passes(0.25) and not c.passes(0.2)
    assert not compare(torch.empty(0), torch.empty(0)).passes(1.0)  # nothing compared


def _report(**rank0):
    from afd_compile.layout import AFDLayout

    return VerifyReport(AFDLayout(1, 1), {0: {"role": "ffn", "steps": 1},
                                          1: {"role": "attention", "max_rel_err": 0.0, "compared": 1,
                                              "problem": None, **rank0}}, 1e-5, 0.0)


def test_report_is_ok_only_when_something_finite_was_compared():
    assert _report().ok and _report().line() == "verify: OK max_rel_err=0 tol=1e-05"
    nan = _report(max_rel_err=math.inf, problem="step 1: output 0 holds 3 NaN and 0 Inf of 6 values")
    assert not nan.ok
    assert nan.line() == ("verify: FAIL max_rel_err=inf tol=1e-05 (rank 1 step 1: output 0 holds 3 NaN and 0 Inf of 6 "
                          "values)")
    assert not _report(compared=0).ok


# --- input checks, one path for AFD and TP, before any process starts --------------------------

FACTS = ProgramFacts(batch_range=(1, 1024), default_tol=1e-5)


def _check(**kw):
    args = dict(units=2, unit="attention rank", world_size=3, batches=(1, 2), steps=2, tol=None)
    return check_verify_inputs(FACTS, **{**args, **kw})


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"steps": 0}, "--steps must be an integer >= 1"),
        ({"tol": -1.0}, "--tol must be a finite number >= 0"),
        ({"tol": float("nan")}, "--tol must be a finite number >= 0"),
        ({"tol": float("inf")}, "--tol must be a finite number >= 0"),
        ({"batches": (0, 0)}, "every attention rank has zero tokens, so nothing would be compared"),
        ({"batches": (1, -1)}, "--tokens must be integers in [0, 1048576], got [1, -1]"),
        ({"batches": (1, 2, 3)}, "--tokens has 3 entries, one per attention rank (2) expected"),
        ({"batches": (5000, 1)}, "batch size 5000 is outside the range the program was exported for ([1, 1024]"),
        ({"world_size": 1001}, "the layout needs 1001 local processes"),
    ],
)
def test_verify_inputs_are_refused_before_any_process_starts(kw, message):
    with pytest.raises(VerifyInputError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        _check(**kw)


def test_a_zero_token_dp_group_runs_a_dummy_that_must_be_in_range():
    facts = ProgramFacts((2, 1024), 1e-5)
    with pytest.raises(VerifyInputError, match="zero tokens runs a one-sequence dummy"):
        check_verify_inputs(facts, units=2, unit="attention DP group", world_size=2, batches=(0, 3), steps=1,
                            tol=None, zero_runs_dummy=True)
    static = ProgramFacts(None, 1e-5)
    with pytest.raises(VerifyInputError, match="the program's batch dimension is static, its inputs "
                       "cannot be resized; drop --tokens"):
        check_verify_inputs(static, units=1, unit="attention rank", world_size=2, batches=(3,), steps=1, tol=None)
    assert check_verify_inputs(static, units=1, unit="attention rank", world_size=2, batches=None, steps=1,
                               tol=None).batches is None


@settings(max_examples=300, deadline=None)
@given(units=st.integers(1, 4), sizes=st.lists(st.integers(-3, 1500), min_size=0, max_size=5),
       steps=st.integers(-2, 6), tol=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
       dummy=st.booleans())
def test_accepted_verify_inputs_always_compare_something_within_range(units, sizes, steps, tol, dummy):
    try:
        got = check_verify_inputs(FACTS, units=units, unit="unit", world_size=units + 1, batches=sizes,
                                  steps=steps, tol=tol, zero_runs_dummy=dummy)
    except VerifyInputError:
        return
    assert got.steps >= 1 and math.isfinite(got.tol) and got.tol >= 0
    assert len(got.batches) == units and sum(got.batches) > 0
    assert all(1 <= b <= 1024 for b in got.batches if b) and min(got.batches) >= 0
    # step 0 gives every unit its own entry, so a positive entry is compared in step 0
    assert any(got.batches[u % len(got.batches)] for u in range(units))


# --- the CLI: flags of the other mode, impossible layouts, bad numbers: exit 2 up front --------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["verify", "{m}", "-A", "2", "-F", "1", "--attn-dp", "3"], "--attn-dp applies only to a TP layout"),
        (["verify", "{m}", "-A", "2", "-F", "1", "--moe-a2a"], "--moe-a2a applies only to a TP layout"),
        (["plan", "{m}", "--dense-dp"], "--dense-dp applies only to a TP layout"),
        (["verify", "{m}", "--tp", "2", "--gate-on-attention"], "not both"),
        (["verify", "{m}", "-A", "2", "-F", "1", "--tokens", "0,0"], "nothing would be compared"),
        (["verify", "{m}", "-A", "2", "-F", "1", "--steps", "0"], "argument --steps: must be in [1, 100000], got 0"),
        (["verify", "{m}", "-A", "2", "-F", "1", "--tol", "nan"], "--tol must be a finite number"),
        (["verify", "{m}", "-A", "2", "-F", "1", "--tokens", "5000,1"], "outside the range"),
        (["verify", "{m}", "-A", "1000", "-F", "1"], "the layout needs 1001 local processes"),
        (["verify", "{m}", "--tp", "2", "--tokens", "0"], "nothing would be compared"),
        (["verify", "{m}", "--tp", "2", "--attn-dp", "2", "--tokens", "0,1"], None),  # accepted: checked below
        (["plan", "{m}", "--tp", "3"], "which 3 attention-TP ranks cannot divide"),
        (["plan", "{m}", "--tp", "2", "--attn-dp", "0"], "argument --attn-dp: must be in [1, 65536], got 0"),
        (["verify", "{m}", "--tp", "2", "--moe-a2a"], "the graph has no MoE layer"),
    ],
)
def test_cli_refuses_bad_input_with_exit_2_before_spawning(exported, capsys, monkeypatch, argv, message):
    spawned = []
    monkeypatch.setattr("afd_compile.verify.run_local", lambda *a, **k: spawned.append(a) or {})
    code = cli.main([a.format(m=exported("llama2")[1]) for a in argv])
    err = capsys.readouterr().err
    if message is None:  # a valid zero-token DP group reaches the (stubbed) launch
        assert spawned
        return
    assert code == 2 and message in err and not spawned, err


class _KeywordLM(torch.nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, *, input_ids):
        return self.lm(input_ids)


def test_keyword_input_programs_verify_and_rewrite(tmp_path, capsys):
    # transformers' exporters take keyword inputs: verify runs them flattened in the program's
    # input order (they used to be refused; verify --tp used to fail only after starting workers);
    # rewrite writes programs with positional inputs in that order
    from afd_compile.models import build_hf

    path = tmp_path / "kw.pt2"
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    dims = {"input_ids": {0: torch.export.Dim("batch", min=1, max=1024), 1: torch.export.Dim.AUTO}}
    with torch.no_grad():
        ep = torch.export.export(_KeywordLM(build_hf("llama", 1)), (), {"input_ids": ids}, dynamic_shapes=dims)
    torch.export.save(ep, path)
    for layout in (["--tp", "2"], ["-A", "2", "-F", "1"]):
        assert cli.main(["verify", str(path), *layout]) == 0
        assert capsys.readouterr().out.strip().splitlines()[-1].startswith("verify: OK")
    assert cli.main(["rewrite", str(path), "-o", str(tmp_path / "out"), "-A", "1", "-F", "1"]) == 0
    assert cli.main(["rewrite", str(path), "-o", str(tmp_path / "tp"), "--tp", "2"]) == 0


def test_timeout_flag_must_be_positive(capsys):
    code = cli.main(["verify", "x.pt2", "-A", "1", "-F", "1", "--timeout", "0"])
    assert code == 2 and "--timeout: must be a finite number of seconds > 0" in capsys.readouterr().err


# --- faults end runs: a killed or stopped rank is named, every process is gone ------------------


def _faulty(rank: int, world: int, how: str, pid_dir: str) -> int:
    import torch.distributed as dist

    with open(os.path.join(pid_dir, str(rank)), "w") as f:
        f.write(str(os.getpid()))
    x = torch.ones(4)
    for step in range(50):
        if rank == 1 and step == 3:
            os.kill(os.getpid(), getattr(signal, how))
        dist.all_reduce(x)
        time.sleep(0.02)
    return step


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_killed_or_stopped_rank_ends_the_run_and_is_named(tmp_path, how):
    timeout = 30.0
    t = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_local(_faulty, 3, how, str(tmp_path), timeout_s=timeout)
    took = time.monotonic() - t
    assert e.value.rank == 1, str(e.value)
    assert ("killed by signal 9" if how == "SIGKILL" else "is stopped") in str(e.value)
    assert took < timeout + 10, took
    for name in os.listdir(tmp_path):
        pid = int((tmp_path / name).read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _stuck(rank: int, world: int) -> None:
    import torch.distributed as dist

    if rank == 0:
        time.sleep(60)  # never joins the all-reduce: the others time out
    dist.all_reduce(torch.ones(1))


def test_a_rank_waiting_on_a_silent_peer_fails_after_the_timeout():
    t = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_local(_stuck, 2, timeout_s=3, deadline_s=20)
    assert time.monotonic() - t < 20
    assert e.value.rank == 1 and ("timed out" in str(e.value).lower() or "timeout" in str(e.value).lower())


def _fails_mid_step(rank: int, world: int, path: str) -> None:
    """A user's torchrun script: the attention rank's step raises after its control message went
    out (token ids outside the vocabulary), and its ``finally`` calls ``stop()`` and ``shutdown()``
    as a clean end would; the FFN rank serves."""
    from afd_compile.deploy import make_worker
    from afd_compile.layout import AFDLayout
    from afd_compile.programs import load_program
    from afd_compile.runtime import AttentionWorker, shutdown

    worker = make_worker(load_program(path).module(), AFDLayout(1, 1), rank)
    try:
        if isinstance(worker, AttentionWorker):
            worker.step(torch.full((2, 5), 10_000))
        else:
            worker.serve()
    finally:
        if isinstance(worker, AttentionWorker):
            worker.stop()
        shutdown()


def test_a_step_that_raises_is_reported_at_once_even_when_the_script_shuts_down_cleanly(exported, monkeypatch):
    # the failed rank exchanges nothing more (no STOP its FFN peer, mid-step, would misread; no
    # barrier it would wait on): its own error is the verdict, well before the peers' timeout.
    # Wire checks off, as deployed (with them the FFN rank refuses the STOP's header at once)
    monkeypatch.setenv("AFD_CHECK_WIRE", "0")
    timeout = 40.0
    t = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_local(_fails_mid_step, 2, exported("llama2")[1], timeout_s=timeout)
    assert e.value.rank == 1 and "index out of range" in str(e.value), str(e.value)
    assert time.monotonic() - t < timeout, "the run waited for the timeout"


def _fails_before_its_message(rank: int, world: int, path: str) -> None:
    """The attention rank's step raises before its control message (no inputs to count tokens
    of); the rank then stays up a while, as a server that logs the error would."""
    from afd_compile.deploy import make_worker
    from afd_compile.layout import AFDLayout
    from afd_compile.programs import load_program
    from afd_compile.runtime import AttentionWorker

    worker = make_worker(load_program(path).module(), AFDLayout(1, 1), rank)
    if not isinstance(worker, AttentionWorker):
        worker.serve()
        return
    with pytest.raises(IndexError):
        worker.step()
    time.sleep(20)


def test_an_ffn_rank_ends_at_once_naming_an_attention_rank_whose_step_failed(exported):
    # the failed step sends FAILED on the control group: the FFN rank waiting for its message
    # ends naming it, while the failed rank is still up (else it would hear the connection close)
    with pytest.raises(RankFailure) as e:
        run_local(_fails_before_its_message, 2, exported("llama2")[1], timeout_s=60)
    assert e.value.rank == 0 and "attention rank 1 failed its step" in str(e.value), str(e.value)


def _fails_mid_step_and_stays(rank: int, world: int, path: str) -> None:
    """The attention rank's step raises mid-program (token ids outside the vocabulary, after its
    control message); the rank stays up: the FFN rank waits on its data until the timeout."""
    from afd_compile.deploy import make_worker
    from afd_compile.layout import AFDLayout
    from afd_compile.programs import load_program
    from afd_compile.runtime import AttentionWorker

    worker = make_worker(load_program(path).module(), AFDLayout(1, 1), rank)
    if not isinstance(worker, AttentionWorker):
        worker.serve()
        return
    with pytest.raises(IndexError):
        worker.step(torch.full((2, 5), 10_000))
    time.sleep(30)


def test_an_ffn_rank_waiting_on_a_failed_peers_data_names_it_at_the_timeout(exported, monkeypatch):
    monkeypatch.setenv("AFD_CHECK_WIRE", "0")
    with pytest.raises(RankFailure) as e:
        run_local(_fails_mid_step_and_stays, 2, exported("llama2")[1], timeout_s=5)
    assert e.value.rank == 0, str(e.value)
    assert "TransferError" in str(e.value) and "attention rank(s) 1 did not complete" in str(e.value), str(e.value)
    assert "Timed out waiting 5000ms" in str(e.value), str(e.value)  # (its timeout, before the peer left)


def _peer_reports_first(rank: int, world: int) -> None:
    # rank 0 reports a peer-gone symptom at once; rank 1's own error reaches the queue later
    if rank == 0:
        raise RuntimeError("[pair.cc:547] Connection closed by peer [127.0.0.1]:1234")
    time.sleep(0.3)
    raise ValueError("the real cause")


def test_the_rank_with_its_own_error_is_blamed_over_a_peer_that_saw_it_go():
    with pytest.raises(RankFailure) as e:
        run_local(_peer_reports_first, 2, timeout_s=20)
    assert e.value.rank == 1
    assert e.value.short.startswith("ValueError: the real cause (rank 0 then raised: "), str(e.value)


# --- rewrite writes whole or not at all ---------------------------------------------------------


def test_rewrite_refuses_a_non_empty_folder_and_force_replaces_it_whole(exported, tmp_path, capsys):
    path = exported("llama2")[1]
    out = tmp_path / "out"
    assert cli.main(["rewrite", path, "-o", str(out), "--tp", "2"]) == 0  # an earlier rewrite's rank programs
    with pytest.raises(ProgramLoadError, match="written by rewrite --tp"):
        load_rewritten_worker(str(out), 0)
    assert cli.main(["rewrite", path, "-o", str(out), "-A", "1", "-F", "1"]) == 2
    assert "not empty; pass --force" in capsys.readouterr().err
    assert cli.main(["rewrite", path, "-o", str(out), "-A", "1", "-F", "1", "--force"]) == 0
    assert sorted(os.listdir(out)) == ["attention.pt2", "ffn.pt2", "plan.json"]  # no stale rank<r>.pt2
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary sibling left
    (tmp_path / "file").write_text("x")
    assert cli.main(["rewrite", path, "-o", str(tmp_path / "file"), "-A", "1", "-F", "1"]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err
    assert cli.main(["rewrite", path, "-o", str(tmp_path / "no" / "such" / "out"), "-A", "1", "-F", "1"]) == 2
    assert "cannot write in" in capsys.readouterr().err and sorted(os.listdir(tmp_path)) == ["file", "out"]


def test_a_refused_layout_leaves_nothing_behind(exported, tmp_path):
    # a full disk mid-write: tests/test_safety.py (a real short write, not a mocked error)
    assert cli.main(["rewrite", exported("llama2")[1], "-o", str(tmp_path / "new"), "--tp", "3"]) == 2
    assert os.listdir(tmp_path) == []


# --- the receiving side checks the wire (real gloo processes) -----------------------------------

H = "hidden:float32[64]"


def _exchange(rank: int, world: int, case: str) -> str:
    """Rank 0 is an FFN rank expecting 10 tokens of float32[64] at layer 0 from rank 1, and
    answers with ffn_out; rank 1 sends what ``case`` says, then expects float32[64] back."""
    from afd_compile.comm import AFDCommunicator, register_communicator

    afd = torch.ops.afd
    sent = {"ok": (H, 10, 0), "transposed": ("hidden:float32[10]", 64, 0), "int32": ("hidden:int32[64]", 10, 0),
            "fewer": (H, 9, 0), "layer": (H, 10, 1)}.get(case, (H, 10, 0))
    if rank == 0:
        comm = AFDCommunicator("ffn", 0, (1,), check_wire=True)
        comm.set_step({0: (10,)})
        register_communicator(comm, 0)
        (x,) = afd.p2p_recv_group(torch.empty(0), 0, 0, 0, 10, H)
        back = x.to(torch.int32) if case == "reply_int32" else x * 2
        afd.p2p_send_group([back], 0, 0, 0, "ffn_out:int32[64]" if case == "reply_int32" else "ffn_out:float32[64]")
        return "ffn done"
    spec, tokens, layer = sent
    comm = AFDCommunicator("attention", 1, (0,), check_wire=True)
    comm.set_step({0: (tokens,)})
    register_communicator(comm, 0)
    dtype = torch.int32 if "int32" in spec else torch.float32
    width = int(spec.split("[")[1].rstrip("]"))
    x = torch.ones(tokens, width, dtype=dtype)
    tok = afd.p2p_send([x], 0, layer, 0, spec)
    (out,) = afd.p2p_recv(tok, 0, layer, 0, tokens, "ffn_out:float32[64]")
    return f"attention got {tuple(out.shape)}"


@pytest.mark.parametrize(
    ("case", "rank", "message"),
    [
        ("transposed", 0, "from peer rank 1: expected layer 0 stage 0 hidden float32 (10, 64), received layer 0 "
                          "stage 0 hidden float32 (64, 10)"),
        ("int32", 0, "expected layer 0 stage 0 hidden float32 (10, 64), received layer 0 stage 0 hidden "
                     "int32 (10, 64)"),
        ("fewer", 0, "expected layer 0 stage 0 hidden float32 (10, 64), received layer 0 stage 0 hidden "
                     "float32 (9, 64)"),
        ("layer", 0, "expected layer 0 stage 0 hidden float32 (10, 64), received layer 1 stage 0"),
        ("reply_int32", 1, "afd.p2p_recv (attention rank 1, layer 0, stage 0): from peer rank 0: expected layer 0 "
                           "stage 0 ffn_out float32 (10, 64), received layer 0 stage 0 ffn_out int32 (10, 64)"),
    ],
)
def test_a_receiver_refuses_what_it_did_not_expect(case, rank, message):
    with pytest.raises(RankFailure) as e:
        run_local(_exchange, 2, case, timeout_s=20)
    assert e.value.rank == rank and "WireMismatch" in str(e.value) and message in str(e.value), str(e.value)


def test_a_matching_exchange_passes_its_header_checks():
    assert run_local(_exchange, 2, "ok", timeout_s=20) == {0: "ffn done", 1: "attention got (10, 64)"}


def _control(rank: int, world: int, message: list[int]) -> object:
    import torch.distributed as dist

    from afd_compile.comm import AFDCommunicator
    from afd_compile.runtime import FFNWorker

    if rank == 1:
        dist.send(torch.tensor(message, dtype=torch.int64), 0)
        return None
    worker = FFNWorker(lambda slots: None, AFDCommunicator("ffn", 0, (1,), check_wire=True), torch.device("cpu"))
    return worker.serve_one()


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ([-5, 1], "attention rank 1 announced -5 tokens for the next step"),
        ([3, 0], "FFN rank 0 runs with wire checks on, attention rank 1 with them off"),
        ([3, 1], (3,)),
    ],
)
def test_control_messages_are_checked(message, expected):
    if isinstance(expected, tuple):
        assert run_local(_control, 2, message, timeout_s=20)[0] == expected
        return
    with pytest.raises(RankFailure) as e:
        run_local(_control, 2, message, timeout_s=20)
    assert e.value.rank == 0 and "ControlError" in str(e.value) and expected in str(e.value)


# --- backend options are checked, never trusted -------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tp": "2"}, "option tp='2' (str) must be an int in [1, 65536]"),
        ({"tp": 0}, "option tp=0 (int) must be an int in [1, 65536]"),
        ({"tp": True}, "option tp=True (bool) must be an int in [1, 65536]"),
        ({"attention": -1, "ffn": 1}, "option attention=-1 (int) must be an int in [0, 65536]"),
        ({"tp": 2, "inductor": "yes"}, "option inductor='yes' (str) must be a bool"),
        ({"tp": 2, "timeout_s": 0}, "option timeout_s=0 (int) must be None or seconds in (0, 604800] (a week)"),
        ({"tp": 2, "rank": -1}, "option rank=-1 (int) must be None or an int in [0, 65536)"),
        ({"attn_dp": 2}, "attn_dp=2 applies to a TP layout (tp > 1) only"),
        ({"moe_a2a": True}, "moe_a2a=True applies to a TP layout"),
        ({"tp": 2, "check_wire": True}, "check_wire=True applies to an AFD layout (attention, ffn) only"),
        ({"stages": 2}, "stages=2 applies to an AFD layout"),
    ],
)
def test_backend_options_are_type_and_range_checked(options, message):
    from afd_compile.backend import BackendOptionError, BackendOptions

    with pytest.raises(BackendOptionError, match=re.escape(message)):
        BackendOptions.parse(options)


def _backend_in_group(rank: int, world: int, options: dict) -> str:
    from afd_compile.backend import BackendOptionError, afd_backend

    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    try:
        afd_backend(gm, [torch.ones(2, 4)], options)
    except BackendOptionError as e:
        return str(e)
    return "ran"


def test_backend_options_must_agree_with_the_live_process_group():
    # a one-process group told it is rank 0 of 2 used to run and return wrong numbers (rel err 0.79)
    (msg,) = run_local(_backend_in_group, 1, {"tp": 2, "world_size": 2, "rank": 0}, timeout_s=30).values()
    assert msg == "afd backend: option world_size=2, but this process is world_size 1 of the initialised process group"


def _groups_twice(rank: int, world: int) -> bool:
    from afd_compile.runtime import process_group, tp_groups
    from afd_compile.scatter import TPLayout

    a = tp_groups(world, [TPLayout(2)], timeout_s=30)[("tp", 2)]
    b = tp_groups(world, [TPLayout(2)], timeout_s=30)[("tp", 2)]  # a second compile asks again
    return a is b and process_group(range(2), 30) is a and process_group(range(2), 31) is not a


def test_a_timeout_group_is_created_once_per_process():
    assert run_local(_groups_twice, 2, timeout_s=30) == {0: True, 1: True}


# --- the launcher: preload once, ranks forked from it ------------------------------------------

_PRELOADED_IN: int | None = None  # the pid of the process that ran _preload_here


def _preload_here() -> None:
    global _PRELOADED_IN
    _PRELOADED_IN = os.getpid()


def _preload_fails() -> None:
    raise OSError("no such program: /nowhere.pt2")


def _what_the_rank_finds(rank: int, world: int) -> tuple[int | None, int, int]:
    return _PRELOADED_IN, os.getppid(), os.getpid()


def test_preload_runs_once_in_the_launcher_and_every_rank_finds_it():
    found = run_local(_what_the_rank_finds, 3, timeout_s=30, preload=_preload_here)
    launchers = {ppid for _, ppid, _ in found.values()}
    assert len(launchers) == 1 and len({pid for *_, pid in found.values()}) == 3
    assert {pre for pre, _, _ in found.values()} == launchers  # ran in the ranks' parent, before the fork
    assert run_local(_what_the_rank_finds, 2, timeout_s=30)[0][0] is None  # (no preload: nothing there)


def test_a_preload_that_raises_fails_the_run_before_any_rank_starts():
    with pytest.raises(RuntimeError, match=r"preload\(\) raised in the launcher, no rank was started: "
                                           r"OSError: no such program: /nowhere.pt2"):
        run_local(_what_the_rank_finds, 2, timeout_s=30, preload=_preload_fails)
