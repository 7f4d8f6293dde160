"""Reliability and safety (issue 38): no command deletes what the user did not name, a verdict
never loosens its tolerance silently, a saved folder runs only what rewrite wrote into it."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import textwrap

import proctree
import pytest
import torch

from afd_compile import cli
from afd_compile.outdir import TMP_MARKER, OutputError, OutputFolder

REWRITE = ["-A", "1", "-F", "1"]


def _rewrite(path: str, out: str, *extra: str) -> int:
    return cli.main(["rewrite", path, "-o", out, *REWRITE, *extra])


@pytest.fixture
def model_in_cwd(exported, tmp_path, monkeypatch):
    """A working directory holding the model and a file of the user's: what -o must never delete."""
    src = exported("llama2")[1]
    work = tmp_path / "work"
    work.mkdir()
    (work / "model.pt2").write_bytes(open(src, "rb").read())
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    return work


def _untouched(work) -> None:
    assert sorted(os.listdir(work)) == ["model.pt2", "notes.txt"] and (work / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("", "-o: an empty path (it would name the current directory)"),
        ("   ", "-o: an empty path"),
        (".", "-o .: is the current directory"),
        ("..", "is a folder holding the current directory"),
    ],
)
@pytest.mark.parametrize("force", [False, True])
def test_rewrite_never_replaces_the_current_directory(model_in_cwd, capsys, target, message, force):
    assert _rewrite("model.pt2", target, *(["--force"] if force else [])) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    _untouched(model_in_cwd)


def test_rewrite_never_replaces_a_folder_holding_its_input(model_in_cwd, capsys, tmp_path):
    os.mkdir("sub")
    os.rename("model.pt2", "sub/model.pt2")
    assert _rewrite("sub/model.pt2", "sub", "--force") == 2
    assert "-o sub: holds the input sub/model.pt2" in capsys.readouterr().err
    assert os.listdir("sub") == ["model.pt2"]
    os.symlink(str(model_in_cwd), str(tmp_path / "link"))  # a link that resolves to the cwd
    assert _rewrite("sub/model.pt2", str(tmp_path / "link"), "--force") == 2
    assert f"(a link to {model_in_cwd}): is the current directory" in capsys.readouterr().err
    assert sorted(os.listdir(model_in_cwd)) == ["notes.txt", "sub"]


def test_force_replaces_only_a_folder_rewrite_wrote_and_follows_a_link(model_in_cwd, capsys):
    os.mkdir("mine")
    (model_in_cwd / "mine" / "data.bin").write_text("x")
    assert _rewrite("model.pt2", "mine", "--force") == 2
    assert "--force replaces only a folder rewrite wrote" in capsys.readouterr().err
    assert os.listdir("mine") == ["data.bin"]
    assert _rewrite("model.pt2", "out") == 0
    assert sorted(os.listdir("out")) == ["attention.pt2", "ffn.pt2", "plan.json"]
    (model_in_cwd / "out" / "README").write_text("a file of the user's in the output")
    assert _rewrite("model.pt2", "out", "--force") == 2
    assert "holds files rewrite did not write (README)" in capsys.readouterr().err
    os.remove("out/README")
    os.symlink("out", "link")  # a link to a rewrite folder: the folder is replaced, the link stays
    assert _rewrite("model.pt2", "link", "--force") == 0
    assert os.path.islink("link") and sorted(os.listdir("out")) == ["attention.pt2", "ffn.pt2", "plan.json"]
    assert sorted(os.listdir(model_in_cwd)) == ["link", "mine", "model.pt2", "notes.txt", "out"]  # no .old left


def test_a_full_disk_is_exit_2_and_leaves_the_old_folder(model_in_cwd):
    """A real short write (a file-size limit: the kernel's EFBIG, as a full disk's ENOSPC), not a
    mocked error: torch's archive writer raised RuntimeError and then aborted the process."""
    assert _rewrite("model.pt2", "out") == 0
    before = {f: (model_in_cwd / "out" / f).read_bytes() for f in os.listdir("out")}

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    res = subprocess.run([sys.executable, "-m", "afd_compile.cli", "rewrite", "model.pt2", "-o", "out", *REWRITE,
                          "--force"], capture_output=True, text=True, timeout=300, preexec_fn=small_files)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("afd-compile rewrite: error: -o out: writing ") and "File too large" in line, line
    assert line.endswith("; nothing was written"), line
    assert {f: (model_in_cwd / "out" / f).read_bytes() for f in os.listdir("out")} == before
    assert sorted(os.listdir(model_in_cwd)) == ["model.pt2", "notes.txt", "out"]


def test_sigterm_while_writing_removes_the_temporary_folder(tmp_path):
    from afd_compile.outdir import exit_on_sigterm

    out = OutputFolder(str(tmp_path / "out"), force=False)
    with pytest.raises(SystemExit) as e, exit_on_sigterm(), out as d:
        open(os.path.join(d, "half.pt2"), "w").write("partial")
        os.kill(os.getpid(), signal.SIGTERM)
    assert e.value.code == 128 + signal.SIGTERM and os.listdir(tmp_path) == []


def test_a_killed_runs_temporary_folder_is_removed_and_named(model_in_cwd, capsys):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = model_in_cwd / f".out.tmp-{dead.pid}-abc"
    stale.mkdir()
    (stale / TMP_MARKER).write_text(f'{{"written_by": "afd-compile rewrite", "pid": {dead.pid}}}')  # ours
    (stale / "attention.pt2").write_text("partial")
    live = model_in_cwd / f".out.tmp-{os.getpid()}-def"  # a run still going: left alone
    live.mkdir()
    assert _rewrite("model.pt2", "out") == 0
    assert f"removed {stale}, left by a run that was killed (pid {dead.pid})" in capsys.readouterr().err
    assert sorted(os.listdir(model_in_cwd)) == [live.name, "model.pt2", "notes.txt", "out"]


def test_an_output_folder_refusal_is_a_bad_input_error():
    with pytest.raises(OutputError, match="empty path"):
        OutputFolder("", force=True)


# --- the verdict's tolerance comes from what is compared, and is printed ------------------------


class _MixingMLP(torch.nn.Module):
    """An FFN that mixes the tokens of different sequences (a mean over the batch): not
    equivalent under AFD, where each FFN rank sees its attention peers' tokens together."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(hidden, inter, bias=False), torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))) + 0.05 * x.mean(0, keepdim=True)


def _mixing_model(unused_fp16: bool) -> torch.nn.Module:
    from handwritten import GQADecoder

    model = GQADecoder(layers=1)
    for block in model.layers:
        block.mlp = _MixingMLP(64, 128)
    if unused_fp16:  # one unused 1-element fp16 buffer used to switch the default tolerance to 1e-2
        model.register_buffer("scale", torch.ones(1, dtype=torch.float16))
    return model


@pytest.mark.parametrize("unused_fp16", [False, True])
def test_an_unused_low_precision_buffer_does_not_loosen_the_verdict(tmp_path, capsys, unused_fp16):
    from handwritten import export

    path = str(tmp_path / "mixing.pt2")
    torch.export.save(export(_mixing_model(unused_fp16)), path)
    assert cli.main(["verify", path, "-A", "2", "-F", "1", "--tokens", "2,3"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("verify: FAIL max_rel_err=") and last.endswith(" tol=1e-05"), last


def test_the_default_tolerance_follows_the_output_dtypes():
    from afd_compile.verify import LOW_PRECISION_TOL, default_tolerance

    class Out(torch.nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.register_buffer("w", torch.ones(4, dtype=torch.bfloat16))  # held, whatever the output
            self.dtype = dtype

        def forward(self, x):
            return (x * self.w.float()).to(self.dtype), x.argmax(-1)

    def tol(dtype):
        return default_tolerance(torch.export.export(Out(dtype), (torch.randn(2, 4),)))

    assert tol(torch.float32) == 1e-5 and tol(torch.float64) == 1e-5
    assert tol(torch.bfloat16) == LOW_PRECISION_TOL and tol(torch.float16) == LOW_PRECISION_TOL


# --- a saved folder runs only the programs rewrite wrote into it --------------------------------


@pytest.fixture(scope="module")
def two_rewrites(tmp_path_factory):
    """A rewrite of one model and one of another (the FFN program of a rewrite does not depend on
    the layout, so another model is what a wrong copy looks like)."""
    from handwritten import GQADecoder, export

    root = tmp_path_factory.mktemp("saved")
    for name, seed in (("a", 0), ("b", 1)):
        torch.export.save(export(GQADecoder(layers=1, seed=seed)), str(root / f"{name}.pt2"))
        assert _rewrite(str(root / f"{name}.pt2"), str(root / name)) == 0
    return root


def _tampered(two_rewrites, tmp_path, edit=None, plan_edit=None) -> str:
    import json
    import shutil

    out = tmp_path / "out"
    shutil.copytree(two_rewrites / "a", out)
    if edit:
        edit(out, two_rewrites)
    if plan_edit:
        plan = json.loads((out / "plan.json").read_text())
        plan = plan_edit(plan)
        (out / "plan.json").write_text(json.dumps(plan))
    return str(out)


def _swap_roles(out, _):
    os.rename(out / "ffn.pt2", out / "tmp")
    os.rename(out / "attention.pt2", out / "ffn.pt2")
    os.rename(out / "tmp", out / "attention.pt2")


def _set(path, value):
    def edit(plan):
        obj = plan
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
        return plan
    return edit


@pytest.mark.parametrize(
    ("edit", "plan_edit", "message"),
    [
        (lambda out, src: (out / "ffn.pt2").write_bytes((src / "b" / "ffn.pt2").read_bytes()), None,
         "ffn.pt2 (ffn) is not the program rewrite wrote there: its sha256 is"),
        (_swap_roles, None, "attention.pt2 (attention) is not the program rewrite wrote there"),
        (None, _set(["programs", "ffn"], "../b/ffn.pt2"), "field 'programs.ffn' must be a file name inside the folder"),
        (None, _set(["programs", "ffn"], "/etc/passwd"), "field 'programs.ffn' must be a file name inside the folder"),
        (lambda out, src: (os.remove(out / "ffn.pt2"), os.symlink(src / "b" / "ffn.pt2", out / "ffn.pt2")), None,
         "programs.ffn names ffn.pt2, which is a symbolic link"),
        (None, _set(["token_count", "factor"], 0), 
         "field 'token_count.factor' must be an integer in [1, 2147483647], got 0"),
        (None, _set(["layout", "attention_ranks"], "2"), "field 'layout.attention_ranks' must be an integer in "
                                                          "[1, 65536], got '2'"),
        (None, _set(["stages"], 0), "field 'stages' must be an integer in [1, 64], got 0"),
        (None, lambda plan: [], "field '(the whole file)' must be a JSON object"),
        (None, lambda plan: {k: v for k, v in plan.items() if k != "sha256"}, "plan.json has no field 'sha256'"),
        (None, lambda plan: {k: v for k, v in plan.items() if k != "written_by"}, "no field 'written_by'"),
    ],
)
def test_a_tampered_folder_is_refused_naming_the_field(two_rewrites, tmp_path, edit, plan_edit, message):
    from afd_compile.deploy import load_rewritten_worker
    from afd_compile.saved import SavedFolderError

    out = _tampered(two_rewrites, tmp_path, edit, plan_edit)
    for rank in (0, 1):  # the FFN rank and the attention rank alike
        with pytest.raises(SavedFolderError) as e:
            load_rewritten_worker(out, rank)
        assert message in str(e.value) and str(e.value).startswith(out), str(e.value)


def test_an_untouched_folder_loads(two_rewrites):
    from afd_compile.deploy import load_rewritten_worker
    from afd_compile.runtime import AttentionWorker, FFNWorker

    assert isinstance(load_rewritten_worker(str(two_rewrites / "a"), 0), FFNWorker)
    assert isinstance(load_rewritten_worker(str(two_rewrites / "a"), 1), AttentionWorker)


# --- no process of a run outlives it ------------------------------------------------------------


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    from handwritten import GQADecoder, export

    path = str(tmp_path_factory.mktemp("long") / "tiny.pt2")
    torch.export.save(export(GQADecoder(layers=1)), path)
    return path


@pytest.mark.parametrize(
    ("who", "sig"),
    [("cli", signal.SIGKILL), ("cli", signal.SIGTERM), ("launcher", signal.SIGSTOP), ("launcher", signal.SIGKILL),
     ("forkserver", signal.SIGSTOP), ("forkserver", signal.SIGKILL)],
)
def test_a_signal_to_any_process_of_a_run_ends_every_process_of_it(long_model, who, sig):
    import time

    proc = subprocess.Popen([sys.executable, "-m", "afd_compile.cli", "verify", long_model, "-A", "2", "-F", "1",
                             "--steps", "100000", "--timeout", "20", "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:  # the run is up: the CLI, its forkserver, the launcher and 3 ranks
            tree = proctree.tree(proc.pid)
            server = next((p for p in tree if "forkserver" in proctree.cmdline(p)), None)
            launcher = next((p for p in proctree.children().get(server, [])), None) if server else None
            if launcher is not None and len(proctree.children().get(launcher, [])) == 3:
                break
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        time.sleep(1.0)  # (the ranks are past their start)
        run = proctree.tree(proc.pid)
        os.kill({"cli": proc.pid, "launcher": launcher, "forkserver": server}[who], sig)
        t = time.monotonic()
        if who == "cli":
            proc.wait(timeout=30)
        else:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 1, (out, err)
            assert "Traceback" not in err, err
            what = "launcher process" if who == "launcher" else "forkserver of local runs"
            last = out.strip().splitlines()[-1]
            assert last.startswith("verify: FAIL (the ") and "max_rel_err" not in last, last
            assert what in last, last
        while any(proctree.alive(p) for p in run) and time.monotonic() - t < 15:
            time.sleep(0.2)
        left = [(p, proctree.cmdline(p)) for p in run if proctree.alive(p)]
        assert not left, left
    finally:
        for p in proctree.tree(proc.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        proc.wait()


# --- small cases: exit 2, one line, torch's cause shown -----------------------------------------


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["verify", "{m}", "-A", "2", "-F", "1", "--tokens", ""], {}, "--tokens is empty"),
        (["verify", "{m}", "-A", "2", "-F", "1", "--timeout", "1e300"], {}, "must be at most 604800 seconds"),
        (["verify", "{m}", "-A", "2", "-F", "1"], {"AFD_MAX_LOCAL_PROCESSES": "abc"},
         "AFD_MAX_LOCAL_PROCESSES must be an integer >= 1, got 'abc'"),
        (["verify", "{m}", "-A", "2", "-F", "1"], {"AFD_MAX_LOCAL_PROCESSES": "0"},
         "AFD_MAX_LOCAL_PROCESSES must be an integer >= 1, got '0'"),
        (["plan", "{d}", "-A", "1", "-F", "1"], {}, "is a folder, not a .pt2 file"),
        (["plan", "/dev/null", "-A", "1", "-F", "1"], {}, "/dev/null: not a regular file"),
    ],
)
def test_small_bad_inputs_are_one_line_exit_2(long_model, tmp_path, capsys, monkeypatch, argv, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    (tmp_path / "dir.pt2").mkdir()
    try:
        code = cli.main([a.format(m=long_model, d=tmp_path / "dir.pt2") for a in argv])
    except SystemExit as e:  # argparse's type errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.strip().count("\n") == 0 or (code == 2 and "usage:" in err
                                                                             and message in err), err


def _cut(src: str, dst: str, drop: str) -> None:
    import zipfile

    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w") as out:
        for name in z.namelist():
            if not name.endswith(drop):
                out.writestr(name, z.read(name))


def test_a_load_failure_carries_torchs_cause(long_model, tmp_path, capsys):
    import zipfile

    weights = sorted(n for n in zipfile.ZipFile(long_model).namelist() if "/weights/" in n and not n.endswith("/"))
    bad = str(tmp_path / "cut.pt2")
    _cut(long_model, bad, weights[-1])
    assert cli.main(["plan", bad, "-A", "1", "-F", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"failed locating file {weights[-1].split('/', 1)[1]}" in err, err
    assert "check the warnings above" not in err, err


def test_an_unregistered_custom_op_is_named(tmp_path):
    code = textwrap.dedent(f"""
        import torch
        torch.library.define("afdtestlib::scatter_add", "(Tensor x) -> Tensor")
        torch.library.impl("afdtestlib::scatter_add", "CompositeExplicitAutograd")(lambda x: x * 2)
        torch.library.register_fake("afdtestlib::scatter_add")(lambda x: torch.empty_like(x))
        class M(torch.nn.Module):
            def forward(self, x):
                return torch.ops.afdtestlib.scatter_add(x)
        torch.export.save(torch.export.export(M(), (torch.randn(2, 4),)), {str(tmp_path / "op.pt2")!r})
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    from afd_compile.programs import ProgramLoadError, load_program

    with pytest.raises(ProgramLoadError, match="the program uses the custom op afdtestlib::scatter_add, which nothing "
                                               "imported in this process registers"):
        load_program(str(tmp_path / "op.pt2"))


def test_a_write_failing_without_a_message_is_still_one_clean_error(tmp_path):
    out = OutputFolder(str(tmp_path / "out"), force=False)
    with pytest.raises(OutputError, match=r"writing a file failed: RuntimeError; nothing was written"), out:
        raise RuntimeError()
    assert os.listdir(tmp_path) == []


def test_a_rewrite_folder_takes_the_users_umask(tmp_path):
    # written as a private temporary folder (0700), the finished one is what the user's umask gives
    # a new folder (it was 0700 whatever the umask; a folder --force replaces keeps its own mode)
    old = os.umask(0o027)
    try:
        for mask, mode in ((0o027, 0o750), (0o022, 0o755)):
            os.umask(mask)
            target = str(tmp_path / f"out{mask:o}")
            with OutputFolder(target, False) as tmp:
                open(os.path.join(tmp, "plan.json"), "w").write("{}")
            assert os.stat(target).st_mode & 0o777 == mode and os.listdir(target) == ["plan.json"]
    finally:
        os.umask(old)
