"""Reliability, round three (issue 50): rewrite never deletes what it did not write (judged by
content, at the moment of replacement), verify never says OK on what it did not exercise, no input
sizes work out of proportion, every exit says what happened."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

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
