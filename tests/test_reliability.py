"""Reliability, round three (issue 50): rewrite never deletes what it did not write (judged by
content, at the moment of replacement), verify never says OK on what it did not exercise, no input
sizes work out of proportion, every exit says what happened."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from clirun import run_cli

from afd_compile import cli
from afd_compile.outdir import TMP_MARKER, OutputError, OutputFolder
from afd_compile.saved import SavedFolderError, read_saved_plan

REWRITE = ["-A", "1", "-F", "1"]


@pytest.fixture(scope="module")
def rewritten(exported, tmp_path_factory):
    """(the model's path, a folder rewrite wrote): copied by each test that edits it."""
    src = exported("llama2")[1]
    d = tmp_path_factory.mktemp("rewritten")
    assert cli.main(["rewrite", src, "-o", str(d / "out"), *REWRITE, "-q"]) == 0
    return src, str(d / "out")


def _user_folder(path, files=("a", "b")) -> None:
    os.makedirs(path, exist_ok=True)
    for f in files:
        with open(os.path.join(path, f), "w") as fh:
            fh.write(f"user file {f}")


def _user_files_intact(path, files=("a", "b")) -> None:
    for f in files:
        assert open(os.path.join(path, f)).read() == f"user file {f}"


def _write_result(d: str) -> None:
    with open(os.path.join(d, "plan.json"), "w") as f:
        f.write("{}")


def test_a_folder_made_at_a_new_target_while_rewriting_is_left_whole(tmp_path):
    target = str(tmp_path / "new")
    out = OutputFolder(target, force=False)
    with pytest.raises(OutputError, match="appeared while rewrite ran.*nothing was written"):
        with out as d:
            _write_result(d)
            _user_folder(target)  # made by someone else while the model loads
    _user_files_intact(target)
    assert sorted(os.listdir(target)) == ["a", "b"] and os.listdir(tmp_path) == ["new"]  # no temporary left


def test_two_rewrites_into_one_new_path_keep_the_first(tmp_path):
    target = str(tmp_path / "new")
    first, second = OutputFolder(target, force=False), OutputFolder(target, force=False)
    d1, d2 = first.__enter__(), second.__enter__()  # both started while the path was new
    with open(os.path.join(d1, "first"), "w") as f:
        f.write("1")
    _write_result(d2)
    first.__exit__(None, None, None)  # the first finishes while the second still writes
    with pytest.raises(OutputError, match="appeared while rewrite ran"):
        second.__exit__(None, None, None)
    assert sorted(os.listdir(target)) == ["first"] and sorted(os.listdir(tmp_path)) == ["new"]


def test_an_empty_target_filled_while_rewriting_is_left_whole(tmp_path):
    target = tmp_path / "empty"
    target.mkdir()
    with pytest.raises(OutputError, match="changed while rewrite ran: the folder exists and is not empty"):
        with OutputFolder(str(target), force=False) as d:
            _write_result(d)
            _user_folder(target)
    _user_files_intact(target)
    assert sorted(os.listdir(tmp_path)) == ["empty"]


def test_force_rechecks_the_folder_by_content_when_replacing_it(rewritten, tmp_path):
    target = str(tmp_path / "out")
    shutil.copytree(rewritten[1], target)
    with pytest.raises(OutputError, match=r"changed while rewrite ran: holds files rewrite did not write \(a\)"):
        with OutputFolder(target, force=True) as d:
            _write_result(d)
            _user_folder(target, ["a"])
    _user_files_intact(target, ["a"])
    assert sorted(os.listdir(target)) == ["a", "attention.pt2", "ffn.pt2", "plan.json"]
    assert sorted(os.listdir(tmp_path)) == ["out"]
    os.remove(os.path.join(target, "a"))
    with OutputFolder(target, force=True) as d:  # unchanged: replaced, and nothing of ours left beside it
        _write_result(d)
    assert os.listdir(target) == ["plan.json"] and sorted(os.listdir(tmp_path)) == ["out"]


def _edit_plan(folder: str, **fields) -> None:
    path = os.path.join(folder, "plan.json")
    plan = json.load(open(path))
    plan.update(fields)
    json.dump(plan, open(path, "w"))


@pytest.mark.parametrize(("edit", "message"), [
    ("sha256_string", "field 'sha256' must be an object naming each program"),
    ("sha256_int", "field 'sha256' must be an object naming each program"),
    ("program_dir", "names attention.pt2, which is missing"),
    ("plan_link", "plan.json is a symbolic link"),
    ("hash_of_other", "is not the program rewrite wrote there"),
])
def test_force_replaces_only_a_folder_that_validates_fully(rewritten, tmp_path, capsys, edit, message):
    target = str(tmp_path / "out")
    shutil.copytree(rewritten[1], target)
    if edit == "sha256_string":
        _edit_plan(target, sha256="abc")  # iterated by character, it named user files a, b, c
        _user_folder(target, ["a", "b"])
    elif edit == "sha256_int":
        _edit_plan(target, sha256=5)
    elif edit == "program_dir":  # a folder named like a program, holding a user file
        os.remove(os.path.join(target, "attention.pt2"))
        _user_folder(os.path.join(target, "attention.pt2"), ["a"])
    elif edit == "plan_link":
        os.rename(os.path.join(target, "plan.json"), str(tmp_path / "elsewhere.json"))
        os.symlink(str(tmp_path / "elsewhere.json"), os.path.join(target, "plan.json"))
    elif edit == "hash_of_other":
        shutil.copy(os.path.join(target, "ffn.pt2"), os.path.join(target, "attention.pt2"))
    before = sorted(os.listdir(target))
    assert cli.main(["rewrite", rewritten[0], "-o", target, *REWRITE, "--force", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--force replaces only a folder rewrite wrote" in err and message in err, err
    assert sorted(os.listdir(target)) == before
    if edit == "sha256_string":
        _user_files_intact(target, ["a", "b"])
    if edit == "program_dir":
        _user_files_intact(os.path.join(target, "attention.pt2"), ["a"])


def test_read_saved_plan_refuses_a_plan_json_that_is_not_a_regular_file(rewritten, tmp_path):
    target = str(tmp_path / "out")
    shutil.copytree(rewritten[1], target)
    os.rename(os.path.join(target, "plan.json"), str(tmp_path / "p.json"))
    os.mkdir(os.path.join(target, "plan.json"))
    with pytest.raises(SavedFolderError, match="plan.json is not a regular file"):
        read_saved_plan(target)


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_only_marked_temporary_folders_of_dead_runs_are_cleaned(tmp_path, capsys):
    dead = _dead_pid()
    ours = tmp_path / f".out.tmp-{dead}-abc"
    ours.mkdir()
    (ours / TMP_MARKER).write_text(json.dumps({"written_by": "afd-compile rewrite", "pid": dead}))
    (ours / "attention.pt2").write_text("partial")
    users = tmp_path / f".out.tmp-{dead}-backup"  # a user's folder that only has such a name
    _user_folder(str(users))
    forged = tmp_path / f".out.tmp-{dead}-forged"  # a marker naming another process
    _user_folder(str(forged))
    (forged / TMP_MARKER).write_text(json.dumps({"written_by": "afd-compile rewrite", "pid": os.getpid()}))
    live = tmp_path / f".out.tmp-{os.getpid()}-live"  # a run still going: left alone
    live.mkdir()
    (live / TMP_MARKER).write_text(json.dumps({"written_by": "afd-compile rewrite", "pid": os.getpid()}))
    with OutputFolder(str(tmp_path / "out"), force=False) as d:
        _write_result(d)
    err = capsys.readouterr().err
    assert f"removed {ours}, left by a run that was killed (pid {dead})" in err and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == sorted([users.name, forged.name, live.name, "out"])
    _user_files_intact(str(users))
    assert os.listdir(tmp_path / "out") == ["plan.json"]  # the marker is not part of the result


# -- verify never says OK on what it did not exercise ------------------------------------------


@pytest.fixture(scope="module")
def float_mixing(tmp_path_factory) -> str:
    """A .pt2 of :class:`FloatInputDecoder` (float input, an MLP mixing every token of its call),
    its batch dynamic."""
    import torch
    from handwritten import FloatInputDecoder

    path = str(tmp_path_factory.mktemp("float_mixing") / "fm.pt2")
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(FloatInputDecoder().eval(), (torch.randn(2, 5, 64),), dynamic_shapes=({0: batch},))
    torch.export.save(ep, path)
    return path


def test_float_inputs_differ_per_rank_so_equal_sizes_still_expose_a_token_mixing_ffn(float_mixing):
    # before: both attention ranks got the same float values, the mean over the fanned-in tokens
    # was each rank's own mean, and the run said OK 1.2e-07
    res = run_cli("verify", float_mixing, "-A", "2", "-F", "1", "--tokens", "2,2", "-q")
    assert res.returncode == 1 and "verify: FAIL" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("extra, message", [
    (["-A", "2", "-F", "1", "--tokens", "0,2"],
     "--tokens [0, 2] over 2 step(s): FFN rank 0 fans in attention ranks [1, 2], but no step gives two of them tokens"),
    (["-A", "3", "-F", "1", "--tokens", "0,0,3", "--steps", "3"],
     "FFN rank 0 fans in attention ranks [1, 2, 3], but no step gives two of them tokens"),
    (["-A", "2", "-F", "1", "--tokens", "1,1", "--stages", "3"],
     "--stages 3 with --tokens [1, 1]: no step has 3 sequences on any rank"),
])
def test_a_layout_feature_no_step_would_exercise_is_refused(float_mixing, extra, message):
    res = run_cli("verify", float_mixing, *extra, "-q")
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in res.stderr and res.stderr.count("\n") == 1, res.stderr


def test_check_exercised_counts_attention_tp_groups_as_one_unit():
    from afd_compile.layout import AFDLayout
    from afd_compile.verify_inputs import VerifyInputError, check_exercised

    check_exercised(AFDLayout(4, 1, attn_tp=2), [1, 2], None, 2, 1)  # two groups, both with tokens
    check_exercised(AFDLayout(2, 1, attn_tp=2), [3], None, 2, 1)  # one group: no fan-in to exercise
    check_exercised(AFDLayout(2, 2), [0, 2], None, 1, 1)  # an FFN rank a peer: nothing fans in
    with pytest.raises(VerifyInputError, match=r"FFN group \[0, 1\] fans in attention ranks \[2, 3\]"):
        check_exercised(AFDLayout(2, 2, ffn_tp=2), [0, 2], None, 2, 1)  # the group mixes its ranks' tokens
    with pytest.raises(VerifyInputError, match=r"the saved example \(1 sequence\(s\) a rank\)"):
        check_exercised(AFDLayout(2, 1), None, 1, 2, 2)


def test_one_large_element_does_not_hide_the_error_of_the_others():
    import torch

    from afd_compile.compare import max_rel_err, rel_err

    ref = torch.randn(4, 128, generator=torch.Generator().manual_seed(0))
    wrong = ref * 1.19  # 19 % off everywhere
    ref[0, 0] = wrong[0, 0] = 1e6  # one biased logit, right
    assert rel_err(wrong, ref) > 0.15  # max |d| / max |ref| said 2.7e-07
    assert max_rel_err((wrong,), (ref,)) == rel_err(wrong, ref)
    assert rel_err(ref, ref) == 0.0
    near_zero = ref.clone()
    near_zero[1, 1] = 1e-12
    off = near_zero.clone()
    off[1, 1] = 1e-7  # an element near zero is judged against the tensor's typical size, not its own
    assert rel_err(off, near_zero) < 1e-5
    assert rel_err(torch.zeros(3), torch.zeros(3)) == 0.0 and rel_err(torch.ones(3), torch.zeros(3)) > 1e20


def test_the_tolerance_follows_the_dtype_that_computes_not_a_constant_side_output():
    import torch

    from afd_compile.verify_inputs import default_tolerance

    class SideOutput(torch.nn.Module):
        def __init__(self, half: bool) -> None:
            super().__init__()
            self.lin, self.half = torch.nn.Linear(8, 8), half
            if half:
                self.lin.half()

        def forward(self, x):
            if self.half:  # computed in fp16, returned as fp32: the precision is fp16's
                return self.lin(x.half()).float(), torch.zeros(1)
            return self.lin(x), torch.zeros(1, dtype=torch.float16)  # a constant fp16 beside fp32 logits

    x = torch.randn(2, 8)
    assert default_tolerance(torch.export.export(SideOutput(False), (x,))) == 1e-5
    assert default_tolerance(torch.export.export(SideOutput(True), (x,))) == 1e-2


def test_vary_inputs_differs_per_salt_and_keeps_masks():
    import torch

    from afd_compile.verify_inputs import vary_inputs

    ids, x = torch.randint(0, 100, (2, 5)), torch.randn(2, 5, 8)
    mask = torch.zeros(5, 5).masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf"))
    a, b = vary_inputs((ids, x, mask), (ids, x, mask), 1), vary_inputs((ids, x, mask), (ids, x, mask), 2)
    assert not torch.equal(a[0], b[0]) and not torch.equal(a[1], b[1]) and not torch.equal(a[1], x)
    assert torch.equal(a[2], mask) and torch.equal(b[2], mask)
    assert all(torch.equal(p, q) for p, q in zip(a, vary_inputs((ids, x, mask), (ids, x, mask), 1), strict=True))
    assert int(a[0].max()) <= int(ids.max())  # token ids stay in the vocabulary


# -- every process of a run ends within seconds ------------------------------------------------


def test_a_forkserver_stopped_while_it_preloads_ends_the_run_at_once(tmp_path):
    import signal
    import sys
    import time

    import proctree
    import torch
    from handwritten import GQADecoder, export

    path = str(tmp_path / "tiny.pt2")
    torch.export.save(export(GQADecoder(layers=1)), path)
    proc = subprocess.Popen([sys.executable, "-m", "afd_compile.cli", "verify", path, "-A", "2", "-F", "1",
                             "--timeout", "20", "-q"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        server = None
        while server is None:  # stopped as soon as it exists: it is importing torch (seconds)
            server = next((p for p in proctree.tree(proc.pid)  # (the path names this test: not "forkserver")
                           if "multiprocessing.forkserver import" in proctree.cmdline(p)), None)
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        os.kill(server, signal.SIGSTOP)
        t = time.monotonic()
        out, err = proc.communicate(timeout=60)
        assert time.monotonic() - t < 15, "the run outlived a stopped forkserver"  # (was: past 135 s)
        assert proc.returncode == 1, (out, err)
        last = out.strip().splitlines()[-1]
        assert last.startswith("verify: FAIL (the forkserver of local runs") and "stopped" in last, last
        assert "Traceback" not in err, err
        assert not proctree.alive(server)
    finally:
        for p in proctree.tree(proc.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        proc.wait()


# --- exits: every end of a command says what happened, never 0 without a verdict -----------------

def test_an_import_module_that_calls_sys_exit_is_refused_not_a_silent_exit_0(tmp_path):
    lib = tmp_path / "exits.py"
    lib.write_text("import sys\nsys.exit(0)\n")
    model = tmp_path / "m.pt2"  # (a file: what the arguments alone decide passes, then the import runs)
    model.write_bytes(b"")
    ran = run_cli("verify", str(model), "-A", "1", "-F", "1", "--import", str(lib))
    assert ran.returncode == 2, ran
    assert "the module called sys.exit(0) while it was imported" in ran.stderr and "exits.py" in ran.stderr


def _tiny_pt2(tmp_path) -> str:
    import torch
    from handwritten import GQADecoder, export

    path = str(tmp_path / "tiny.pt2")
    torch.export.save(export(GQADecoder(layers=1)), path)
    return path


def test_a_reader_that_goes_away_ends_the_output_not_the_verdict(tmp_path):
    import sys

    path = _tiny_pt2(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "afd_compile.cli", "plan", path, "-A", "2", "-F", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # (as `| head -0`: every write meets a closed pipe)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert "error" not in err and "Traceback" not in err and "Exception ignored" not in err, err


def test_ctrl_c_ends_a_run_with_one_line_and_exit_130(tmp_path):
    import signal
    import sys
    import time

    import proctree

    path = _tiny_pt2(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "afd_compile.cli", "verify", path, "-A", "2", "-F", "1",
                             "--steps", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # (its own process group: as a terminal's job)
                            # (and Ctrl-C's default action, as a terminal's job has: a test run started in the
                            # background of a shell inherits SIGINT ignored, which Python keeps ignoring)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while len(proctree.tree(proc.pid)) < 5:  # forkserver, launcher, 3 ranks (resource tracker aside)
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(1)
        everyone = proctree.tree(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the signal reaches every process of the group
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, (out, err)
        assert err.strip().splitlines()[-1] == "afd-compile verify: interrupted", err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        time.sleep(1)
        assert not [p for p in everyone if proctree.alive(p) and "forkserver" not in proctree.cmdline(p)]
    finally:
        for p in proctree.tree(proc.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        proc.wait()


# --- bounds: no count sizes work or memory out of proportion ------------------------------------

@pytest.mark.parametrize(("argv", "message"), [
    (["plan", "m.pt2", "-A", "2", "-F", "1", "--stages", "1000000"], "argument --stages: must be in [1, 64]"),
    (["plan", "m.pt2", "-A", "1000000", "-F", "1000000"], "argument --attention-ranks/-A: must be in [1, 65536]"),
    (["plan", "m.pt2", "-A", "1e20", "-F", "1"], "argument --attention-ranks/-A: expected an integer, got '1e20'"),
    (["verify", "m.pt2", "-A", "2", "-F", "1", "--steps", "1000000000"], "argument --steps: must be in [1, 100000]"),
    (["verify", "m.pt2", "--tp", "2", "--attn-dp", "99999999"], "argument --attn-dp: must be in [1, 65536]"),
    (["verify", "m.pt2", "-A", "2", "-F", "1", "--tokens", "1,100000000"], "a batch size is at most 1048576"),
    (["verify", "m.pt2", "-A", "2", "-F", "1", "--buckets", ",".join(map(str, range(1, 5000)))],
     "more than 4096"),
])
def test_counts_that_size_work_are_bounded_before_anything_is_loaded(argv, message):
    ran = run_cli(*argv)
    assert ran.returncode == 2 and message in ran.stderr and ran.stderr.count("\n") <= 12, ran.stderr


def test_a_layout_is_typed_and_bounded_and_its_peer_map_is_arithmetic():
    from afd_compile.layout import AFDLayout, LayoutError

    with pytest.raises(LayoutError, match=r"attention_ranks must be an integer, got '2' \(str\)"):
        AFDLayout("2", 1)
    with pytest.raises(LayoutError, match="ffn_tp must be an integer, got True"):
        AFDLayout(2, 1, ffn_tp=True)
    with pytest.raises(LayoutError, match="more than the 65536 a layout may have"):
        AFDLayout(65536, 1)
    for a, f in [(7, 3), (8, 8), (13, 5), (1, 1), (40000, 25000)]:  # every peer in exactly one block, in order
        lay = AFDLayout(a, f)
        owner = {p: ffn for ffn in range(f) for p in lay.peers_of_ffn(ffn)}
        assert sorted(owner) == [lay.attention_world_rank(i) for i in range(a)]
        assert all(owner[lay.attention_world_rank(i)] == lay.ffn_of_attention(i) for i in range(a))
        assert [len(lay.peers_of_ffn(x)) for x in range(f)] == lay.block_sizes()


def test_a_pt2_whose_members_inflate_is_refused_before_it_is_read(tmp_path):
    import zipfile

    from afd_compile.programs import ProgramLoadError, load_program

    path = str(tmp_path / "bomb.pt2")
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("bomb/models/model.json", b" " * (64 << 20))  # 64 MiB of spaces packs to ~64 KiB
    assert os.path.getsize(path) < 1 << 20
    with pytest.raises(ProgramLoadError, match=r"member bomb/models/model.json unpacks to 67108864 bytes from \d+ "
                                               r"\(\d+x, past 100x\)"):
        load_program(path)


# --- saved folders: every field checked, roles by the programs themselves -----------------------

@pytest.mark.parametrize(("fields", "message"), [
    ({"stages": 10 ** 9}, "field 'stages' must be an integer in [1, 64], got 1000000000"),
    ({"layout": {"attention_ranks": 10 ** 12, "ffn_ranks": 1}}, "field 'layout.attention_ranks' must be an integer"),
    ({"layout": {"attention_ranks": 1, "ffn_ranks": 2}}, "field 'layout' must be a layout AFDLayout takes"),
    ({"token_count": {"factor": 1e30, "dims": [[0, 0]]}}, "field 'token_count.factor' must be an integer in [1, "),
    ({"comm_id": 10 ** 40}, "field 'comm_id' must be an integer in [0, 9223372036854775807]"),
    ({"compute_gate_on_attention": "yes"}, "field 'compute_gate_on_attention' must be true or false"),
])
def test_every_field_of_an_afd_plan_json_is_checked(rewritten, tmp_path, fields, message):
    target = str(tmp_path / "out")
    shutil.copytree(rewritten[1], target)
    _edit_plan(target, **fields)
    with pytest.raises(SavedFolderError) as e:
        read_saved_plan(target)
    assert message in str(e.value), e.value


@pytest.mark.parametrize(("fields", "message"), [
    ({"programs": {"attention": "ffn.pt2", "ffn": "attention.pt2"}},  # hashes still match their files
     "ffn.pt2, the attention program of plan.json, exchanges with ['p2p_recv_group', 'p2p_send_group']"),
    ({"comm_id": 5}, "exchanges on comm_id 0, plan.json records comm_id 5"),
    ({"token_count": {"factor": 1, "dims": [[0, 99]]}}, "names dim 99 of input_ids (2 dims)"),
    ({"token_count": {"factor": 1, "dims": [[7, 0]]}}, "names input 7 of 1"),
])
def test_a_saved_program_is_judged_by_its_own_graph_before_anything_runs(rewritten, tmp_path, fields, message):
    target = str(tmp_path / "out")
    shutil.copytree(rewritten[1], target)
    _edit_plan(target, **fields)
    ran = run_cli("verify", rewritten[0], "--saved", target, "-q")
    assert ran.returncode == 2 and message in ran.stderr and ran.stderr.count("\n") == 1, ran.stderr


@pytest.fixture(scope="module")
def rewritten_tp(exported, tmp_path_factory):
    src = exported("llama2")[1]
    d = tmp_path_factory.mktemp("rewritten_tp")
    assert cli.main(["rewrite", src, "-o", str(d / "out"), "--tp", "2", "-q"]) == 0
    return src, str(d / "out")


@pytest.mark.parametrize(("layout", "message"), [
    ({"attn_dp": "x"}, "field 'layout.attn_dp' must be an integer >= 1 dividing tp=2, got 'x'"),
    ({"attn_dp": 3}, "field 'layout.attn_dp' must be an integer >= 1 dividing tp=2, got 3"),
    ({"moe_a2a": "no"}, "field 'layout.moe_a2a' must be true or false, got 'no'"),
    ({"vocab_parallel": 1}, "field 'layout.vocab_parallel' must be true or false, got 1"),
    ({"dense_dp": None}, "field 'layout.dense_dp' must be true or false, got None"),
])
def test_every_layout_field_of_a_tp_plan_json_is_checked(rewritten_tp, tmp_path, layout, message):
    target = str(tmp_path / "out")
    shutil.copytree(rewritten_tp[1], target)
    plan = json.load(open(os.path.join(target, "plan.json")))
    _edit_plan(target, layout={**plan["layout"], **layout})
    with pytest.raises(SavedFolderError) as e:
        read_saved_plan(target)
    assert message in str(e.value), e.value


# --- flags: one that does not apply is refused, never ignored ------------------------------------

@pytest.mark.parametrize(("extra", "message"), [
    (["--ffn-tp", "2"], "drop --ffn-tp"),
    (["--attn-tp", "2"], "drop --attn-tp"),
    (["--ffn-ep", "2"], "drop --ffn-ep"),
    (["--policy", "structural"], "drop --policy"),
])
def test_verify_saved_refuses_the_flags_its_plan_json_decides(rewritten, extra, message):
    ran = run_cli("verify", rewritten[0], "--saved", rewritten[1], *extra, "-q")
    assert ran.returncode == 2 and message in ran.stderr, ran.stderr


def test_buckets_do_not_apply_to_a_tp_folder(rewritten_tp):
    ran = run_cli("verify", rewritten_tp[0], "--saved", rewritten_tp[1], "--buckets", "8", "-q")
    assert ran.returncode == 2 and "a TP folder has no attention-FFN wire, so --buckets 8 does not apply" in ran.stderr


def test_gate_on_attention_on_a_dense_model_is_refused(rewritten):
    ran = run_cli("plan", rewritten[0], "-A", "2", "-F", "1", "--gate-on-attention")
    assert ran.returncode == 2 and "compute_gate_on_attention (--gate-on-attention): none of the 2 layers has an MoE " \
        "router" in ran.stderr, ran.stderr


def test_a_number_of_buckets_is_one_bucket_of_that_size():
    from afd_compile.buckets import BucketError, TokenBuckets

    assert TokenBuckets.parse("1").sizes == (1,) and TokenBuckets.parse("2").sizes == (2,)
    assert TokenBuckets.parse("default") == TokenBuckets() and TokenBuckets.parse("off") is None
    with pytest.raises(BucketError, match="every size must be an integer in"):
        TokenBuckets.parse("0")


# --- the public API: arguments checked at the boundary, one AFDCompileError line each ------------

def test_public_api_arguments_are_checked_at_the_boundary(rewritten):
    import torch

    import afd_compile
    from afd_compile.backend import BackendOptionError, check_options
    from afd_compile.deploy import load_rewritten_rank
    from afd_compile.errors import AFDCompileError
    from afd_compile.runtime import run_local

    model = torch.nn.Linear(4, 4)
    for call, message in [
        (lambda: afd_compile.compile(model, "tp"), "options must be a dict of option names to values"),
        (lambda: afd_compile.compile(model, 5), "options must be a dict of option names to values"),
        (lambda: afd_compile.compile(5), "model must be a torch.nn.Module or a callable"),
        (lambda: check_options({"timeout_s": 1e300}), "option timeout_s=1e+300 (float) must be None or seconds in"),
        (lambda: check_options({"stages": 10 ** 6}), "option stages=1000000 (int) must be an int in [1, 64]"),
        (lambda: load_rewritten_rank(rewritten[1], "1"), "load_rewritten_rank: rank must be an integer, got '1'"),
        (lambda: run_local(print, 0), "run_local: world_size must be in [1, 65536], got 0"),
    ]:
        with pytest.raises(AFDCompileError) as e:
            call()
        assert message in str(e.value) and "\n" not in str(e.value), e.value
    assert issubclass(BackendOptionError, AFDCompileError)


def test_a_backend_refusal_reaches_the_caller_as_itself_cut_at_the_backend():
    import traceback

    import torch

    from afd_compile.backend import BackendOptionError

    compiled = torch.compile(torch.nn.Linear(4, 4), backend="afd", options={"tp": "x"})
    with pytest.raises(BackendOptionError, match=r"option tp='x' \(str\) must be an int in \[1, 65536\]") as e:
        compiled(torch.randn(2, 4))
    files = [f.filename for f in traceback.extract_tb(e.value.__traceback__)]
    assert not any("output_graph.py" in f or "convert_frame.py" in f for f in files), files
    assert sum("afd_compile" in f for f in files) == 1, files  # (afd_backend's frame: where it was refused)


# --- backend layouts: one rank's refusal ends every rank at once ---------------------------------

def _stay_up_until_told(rank: int, holder: int, done: str, since: float, limit: float) -> None:
    """Of two ranks, ``holder`` stays up (a server catching the error; rank 0 also holds the store)
    until the other has said what it saw (it writes ``done``), or ``limit`` s after ``since``."""
    import time

    if rank != holder:
        open(done, "w").close()
    while rank == holder and not os.path.exists(done) and time.monotonic() - since < limit:
        time.sleep(0.1)


def _refusing_layout(rank: int, world: int, how: str = "refuse", done: str = "") -> tuple:
    """Rank 0 (FFN) refuses its first graph (``how`` = "refuse": a static one) or fails in its compile
    ("error": an error injected where it exports); with ``done`` it stays up until rank 1 has said
    what it saw (it holds the store), or 30 s."""
    import time

    import torch
    from handwritten import GQADecoder

    import afd_compile.backend as backend
    from afd_compile.runtime import protocol, shutdown

    torch.manual_seed(0)
    model = GQADecoder(layers=1).eval()  # no dynamic=True: the FFN rank (0) refuses the static graph
    if how == "error" and rank == 0:  # (dynamic: nothing refused)
        def fail(*args: object, **kwargs: object) -> None:
            raise RuntimeError("injected: the export failed")
        backend._distribute = fail
    compiled = torch.compile(model, backend="afd", dynamic=how == "error",
                             options={"attention": 1, "ffn": 1, "inductor": False})
    try:
        with torch.no_grad():
            compiled(torch.randint(0, 128, (2, 5)))
        said = ("ran", "")
    except Exception as e:  # noqa: BLE001  (what each rank's caller sees)
        said = (type(e).__name__, str(e).splitlines()[0])
    failed = protocol._FAILED_STEP
    if done:
        _stay_up_until_told(rank, 0, done, time.monotonic(), 30)
    t = time.monotonic()
    shutdown()
    return (*said, failed, time.monotonic() - t)


def test_a_refusal_on_one_rank_of_a_backend_layout_stops_every_rank_at_once(tmp_path):
    from afd_compile.runtime import run_local

    # (rank 0 holds the store: it stays up until rank 1 has read its refusal, else rank 1 may read only that
    # the store went away, as the next test allows; without the agreement rank 1 waits 60 s in a group)
    out = run_local(_refusing_layout, 2, "refuse", str(tmp_path / "done"), timeout_s=60)
    ffn, attention = out[0], out[1]
    assert ffn[0] == "BackendOptionError" and "an AFD FFN rank runs programs over a token count" in ffn[1], ffn
    assert attention[0] == "PeerRefused" and attention[1].startswith("rank 0 refused it (afd backend: rank 0: an AFD "
                                                                     "FFN rank"), attention
    assert attention[1].endswith("rank 1 stops too"), attention
    for said in (ffn, attention):  # shutdown() leaves without the barrier its peer would never reach
        assert said[2].startswith("compile refused: "), said
        assert said[3] < 30, said  # (a barrier would wait out the 60 s timeout)


def test_an_error_in_one_ranks_first_compile_stops_every_rank_at_once(tmp_path):
    """Not a refusal but an error (torch's, or a bug of ours) in rank 0's first compile: posted as
    a refusal is, its type named; rank 1 did not wait in the agreement until the timeout."""
    from afd_compile.runtime import run_local

    out = run_local(_refusing_layout, 2, "error", str(tmp_path / "done"), timeout_s=60)
    assert out[0][0] == "BackendCompilerFailed", out[0]  # (dynamo's wrapper of an error not ours)
    assert out[1][:2] == ("PeerRefused", "rank 0 refused it (RuntimeError: injected: the export failed); rank 1 "
                                         "stops too"), out[1]
    assert out[0][2] == "compile failed: RuntimeError: injected: the export failed", out[0]
    # rank 0 ends at once (it held the store): rank 1 says so, not the store's "Broken pipe" as its own
    out = run_local(_refusing_layout, 2, "error", timeout_s=60)
    assert out[1][0] == "PeerRefused" and (out[1][1].startswith("rank 0 refused it (RuntimeError: injected")
                                           or out[1][1].startswith("the store went away while rank 1 waited for "
                                                                   "ranks [0]")), out[1]
    assert out[1][1].endswith("rank 1 stops too"), out[1]


def _serve_fails(rank: int, world: int, done: str) -> tuple:
    """Rank 0 serves as an FFN rank (``afd_compile.serve``) and fails building its program (an error
    injected where it exports the model); rank 1 compiles its attention program. Rank 0 stays up
    (it holds the store) until rank 1 has said what it saw, or 60 s."""
    import time

    import torch
    from handwritten import GQADecoder

    import afd_compile
    import afd_compile.backend as backend
    from afd_compile.runtime import shutdown

    model = GQADecoder(layers=1).eval()
    options = {"attention": 1, "ffn": 1, "inductor": False}
    t = time.monotonic()
    try:
        if rank == 0:
            def fail(*args: object, **kwargs: object) -> None:
                raise RuntimeError("injected: the export failed")
            backend._ffn_export = fail
            afd_compile.serve(model, options)
        else:
            with torch.no_grad():
                torch.compile(model, backend="afd", dynamic=True, options=options)(torch.randint(0, 128, (2, 5)))
        said = ("ran", "")
    except Exception as e:  # noqa: BLE001  (what each rank's caller sees)
        said = (type(e).__name__, str(e).splitlines()[0])
    took = time.monotonic() - t
    _stay_up_until_told(rank, 0, done, t, 60)
    shutdown()
    return (*said, took)


def test_an_error_in_an_ffn_ranks_serve_stops_its_attention_peers_at_once(tmp_path):
    """``afd_compile.serve`` told its peers only of a refusal: an error building the FFN rank's
    program (torch's, or a bug) left the attention rank in the agreement until the timeout."""
    from afd_compile.runtime import run_local

    out = run_local(_serve_fails, 2, str(tmp_path / "done"), timeout_s=60)
    assert out[0][:2] == ("RuntimeError", "injected: the export failed"), out[0]
    assert out[1][:2] == ("PeerRefused", "rank 0 refused it (RuntimeError: injected: the export failed); rank 1 "
                                         "stops too"), out[1]
    assert out[1][2] < 40, out[1]  # (untold, it waits in the agreement until the 60 s timeout)


def _later_refusal(rank: int, world: int, done: str, how: str) -> tuple:
    """Rank 1 (attention) compiles a second graph, for a longer sequence: ``how`` = "break" breaks
    inside its layer (refused), "error" fails in the compile (an error injected where the backend
    exports the graph). It stays up (a server catching the error) until rank 0 has said what it
    saw, or 60 s."""
    import time

    import torch
    from handwritten import GQADecoder

    import afd_compile.backend as backend
    from afd_compile.runtime import shutdown

    class BreaksWhenLong(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = GQADecoder(layers=1).eval()

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.m.embed(ids)
            for layer in self.m.layers:
                h = x + layer.attn(layer.attn_norm(x))
                if ids.shape[1] > 6 and how == "break":  # (either way a guard: a longer sequence, a new graph)
                    torch._dynamo.graph_break()
                x = h + layer.mlp(layer.mlp_norm(h))
            return self.m.head(self.m.norm(x))

    compiled = torch.compile(BreaksWhenLong(), backend="afd", dynamic=True,
                             options={"attention": 1, "ffn": 1, "inductor": False})
    with torch.no_grad():
        compiled(torch.randint(0, 128, (2, 5)))
        if how == "error":
            def fail(*args: object, **kwargs: object) -> None:
                raise RuntimeError("injected: the export failed")
            backend._distribute = fail
        t = time.monotonic()
        try:
            compiled(torch.randint(0, 128, (2, 8 if rank == 1 else 5)))  # (an FFN rank's inputs are not used)
            said = ("ran", "")
        except Exception as e:  # noqa: BLE001  (what each rank's caller sees)
            said = (type(e).__name__, str(e))
    took = time.monotonic() - t
    _stay_up_until_told(rank, 1, done, t, 60)
    shutdown()
    return (*said, took)


@pytest.mark.parametrize("how,message", [("break", "no attention/FFN structure found"),
                                         ("error", "RuntimeError: injected: the export failed")])
def test_a_later_graph_failed_on_an_attention_rank_stops_its_ffn_rank_at_once(tmp_path, how, message):
    """An attention rank compiles a graph per batch shape; one refused (or failed) after the first
    ran was not told to the FFN rank, which waited for the next step until the peer's process
    ended (or the timeout). It is told on the control group, as a failed step is."""
    from afd_compile.runtime import run_local

    out = run_local(_later_refusal, 2, str(tmp_path / "done"), how, timeout_s=60)
    ffn, attention = out[0], out[1]
    assert message in attention[1], attention
    assert ffn[0] == "ControlError" and "attention rank 1 failed its step" in ffn[1], ffn
    assert ffn[2] < 40, ffn  # (untold, it waits until rank 1 ends: 60 s; told, rank 1's compile)


def test_an_export_of_a_fixed_sequence_and_an_unbounded_batch_verifies_from_its_folder(tmp_path):
    # a batch Dim without max (torch's int_oo, which sympy counts finite) failed verify on a traceback;
    # the saved FFN program of a sequence fixed at 5 checks its tokens are a multiple of 5 (a guard), and
    # its rows were padded to buckets of any size (the multiple lived in node meta, which a save drops)
    import torch

    from afd_compile.models import build_hf

    path, out = str(tmp_path / "seq5.pt2"), str(tmp_path / "out")
    ids = torch.randint(0, 128, (2, 5))
    torch.export.save(torch.export.export(build_hf("llama", num_layers=1), (ids,),
                                          dynamic_shapes={"input_ids": {0: torch.export.Dim("batch")}}), path)
    assert run_cli("rewrite", path, "-A", "2", "-F", "1", "-o", out, "-q").returncode == 0
    for args in (["-A", "2", "-F", "1"], ["--saved", out]):
        ran = run_cli("verify", path, *args, "-q")
        assert ran.returncode == 0 and ran.stdout.strip().splitlines()[-1].startswith("verify: OK"), \
            ran.stdout[-800:] + ran.stderr[-800:]
