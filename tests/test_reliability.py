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
