"""The afd-compile CLI: rewrite -> fresh process -> run, verify exit codes 0/1/2, plan output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from clirun import run_cli as _run

CLI = [sys.executable, "-m", "afd_compile.cli"]


def test_the_console_command_exits_with_mains_status(tmp_path):
    # the tests below call main() in this process; the command itself, once: exit 2, one line
    res = subprocess.run([*CLI, "verify", str(tmp_path / "missing.pt2"), "-A", "1", "-F", "1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"afd-compile verify: error: {tmp_path / 'missing.pt2'}: no such file"], res.stderr


def test_help_and_argument_errors_do_not_import_torch(tmp_path):
    # the CLI and the package import their torch-heavy parts on first use (issue 17: --help paid
    # the full torch import, 14-20 s on a busy machine); what the arguments alone decide (issue 53:
    # a missing file took 16 s to say so, a layout the flags make impossible loaded the model
    # first) is answered before torch is imported, each with its exit 2 and one line
    model = tmp_path / "m.pt2"
    model.write_bytes(b"not read")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "kept").write_text("")
    cases = [(["--help"], None),
             (["verify", "x.pt2", "-A", "1"], "give both --attention-ranks and --ffn-ranks"),
             (["plan", str(tmp_path / "missing.pt2"), "-A", "2", "-F", "1"], "missing.pt2: no such file"),
             (["plan", str(tmp_path), "-A", "2", "-F", "1"], "is a folder, not a .pt2 file"),
             (["rewrite", str(model), "-o", str(tmp_path / "o"), "-A", "2", "-F", "1", "--ffn-tp", "2"],
              "ffn_tp=2 must be >= 1 and divide the 1 FFN ranks"),
             (["plan", str(model), "--tp", "3", "--attn-dp", "2"], "attn_dp=2 does not divide tp=3"),
             (["plan", str(model), "-A", "2", "-F", "1", "--import", str(tmp_path / "lib.py")], "lib.py: no such file"),
             (["verify", str(model), "--saved", str(tmp_path / "nowhere")], "nowhere: no such folder"),
             (["rewrite", str(model), "-o", str(tmp_path / "out"), "-A", "2", "-F", "1"], "is not empty")]
    code = ("import contextlib, io, json, sys, afd_compile.cli as c\n"
            f"got = []\nfor argv, _ in {[(a, w) for a, w in cases]!r}:\n"
            "    err = io.StringIO()\n"
            "    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n            rc = c.main(argv)\n        except SystemExit as e:\n            rc = e.code\n"
            "    got.append((rc, err.getvalue()))\n"
            "print(json.dumps(got))\nprint('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    *_, got, torch_loaded = res.stdout.strip().splitlines()
    for (argv, want), (rc, err) in zip(cases, json.loads(got), strict=True):
        if want is not None:
            assert rc == 2 and want in err and len(err.strip().splitlines()) == 1, (argv, rc, err)
    assert torch_loaded == "False", res.stdout


def test_help_lists_the_subcommands():
    out = _run("--help").stdout
    for cmd in ("rewrite", "plan", "verify", "demo"):
        assert cmd in out
    assert "--tokens" in _run("verify", "--help").stdout


def _readme_flags() -> dict[str, set[str]]:
    """Per subcommand, every flag the README's synopsis lines (``afd-compile CMD ...`` and their
    indented continuations) name."""
    import re

    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    flags: dict[str, set[str]] = {}
    cmd = None
    for line in readme.splitlines():
        m = re.match(r"afd-compile (\w+)", line)
        if m:
            cmd, line = m.group(1), line[m.end():]
        elif not (cmd and line.startswith(" " * 20 + "[")):
            cmd = None
            continue
        flags.setdefault(cmd, set()).update(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", line))
    return flags


def test_readme_synopsis_and_parser_name_the_same_flags():
    from afd_compile.cli import build_parser

    readme = _readme_flags()
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert set(readme) == set(sub.choices), "README synopsis lines vs subcommands"
    for cmd, parser in sub.choices.items():
        options = [a.option_strings for a in parser._actions if a.option_strings and "-h" not in a.option_strings]
        missing = [o[-1] for o in options if not set(o) & readme[cmd]]
        unknown = readme[cmd] - {s for o in options for s in o}
        assert not missing and not unknown, f"afd-compile {cmd}: in --help only {missing}; in README only {unknown}"


#: (model, tp, attn_dp, batches, flags) rewritten and reloaded; plain --tp 2 is rewritten in
#: tests/test_generate.py, with a KV cache
REWRITE_TP = [("llama2", 4, 2, (2, 3), ())]
REWRITE_TP_SLOW = [("qwen3moe2", 2, 1, None, ("--moe-a2a",))]


@pytest.mark.parametrize("rows", [REWRITE_TP, pytest.param(REWRITE_TP_SLOW, marks=pytest.mark.slow)],
                         ids=["default", "moe_a2a"])
def test_rewrite_tp_writes_rank_programs_that_reload_and_match(exported, tmp_path, rows):
    # rewrite --tp: one re-exported program per rank (weight slices, collectives); loaded back
    # from disk on real gloo processes they reproduce the original (with DP attention; with the
    # experts over all-to-all in the slow run)
    from afd_compile.scatter import TPLayout
    from afd_compile.verify import TPCase, run_tp_cases

    cases = []
    for model, tp, dp, batches, flags in rows:
        path = exported(model)[1]
        out = tmp_path / f"{model}tp{tp}dp{dp}"
        res = _run("rewrite", path, "-o", str(out), "--tp", str(tp), "--attn-dp", str(dp), *flags)
        assert res.returncode == 0, res.stderr[-3000:]
        files = [f"rank{r}.pt2" for r in range(tp)]
        assert f"rewrite: wrote {', '.join(files)}, plan.json" in res.stdout
        plan = json.loads((out / "plan.json").read_text())
        assert plan["layout"]["attn_tp"] == tp // dp and plan["programs"] == files
        assert len(plan["scatter_plan"]["layers"]) == 2
        assert plan["layout"]["moe_a2a"] == bool(flags)
        cases.append(TPCase(path, TPLayout(tp, dp, moe_a2a=bool(flags)), batches, saved=str(out)))
    for result in run_tp_cases(cases):
        assert max(r["max_rel_err"] for r in result.values()) <= 1e-5


def test_rewrite_then_load_in_a_fresh_process_and_run(exported, tmp_path):
    _, path = exported("qwen3moe2")
    out = tmp_path / "out"
    res = _run("rewrite", path, "-o", str(out), "--attention-ranks", "2", "--ffn-ranks", "1", "--gate-on-attention")
    assert res.returncode == 0, res.stderr
    assert "rewrite: wrote attention.pt2, ffn.pt2, plan.json" in res.stdout
    plan = json.loads((out / "plan.json").read_text())
    assert plan["layout"]["ffn_peers"] == {"0": [1, 2]}
    assert [w["kind"] for w in plan["layers"][0]["wire"]["to_ffn"]] == ["hidden", "router_logits"]
    script = textwrap.dedent(f"""
        import torch
        from afd_compile.runtime import AttentionWorker, run_local
        from afd_compile.deploy import load_rewritten_worker
        from afd_compile.compare import max_rel_err
        from afd_compile.programs import load_program

        def rank(r, world):
            w = load_rewritten_worker({str(out)!r}, r)
            if not isinstance(w, AttentionWorker):
                return w.serve()
            ids = torch.randint(0, 128, (r, 4), generator=torch.Generator().manual_seed(r))
            try:
                got = w.step(ids)
            finally:
                w.stop()
            return max_rel_err(got, load_program({path!r}).module()(ids))

        if __name__ == "__main__":
            res = run_local(rank, 3)
            print("served", res[0], "errs", res[1], res[2])
            assert res[0] == 1 and max(res[1], res[2]) <= 1e-5
    """)
    script_path = tmp_path / "run_rewritten.py"  # a file, so spawned ranks can import its functions
    script_path.write_text(script)
    proc = subprocess.run([sys.executable, str(script_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _staged_rank(r: int, world: int, out: str, path: str) -> tuple:
    from afd_compile.compare import max_rel_err
    from afd_compile.deploy import load_rewritten_worker
    from afd_compile.programs import load_program
    from afd_compile.runtime import AttentionWorker

    w = load_rewritten_worker(out, r)
    if not isinstance(w, AttentionWorker):
        return w.serve(), w.comm.stage_transfers
    errs = []
    try:
        for step, batch in enumerate([r + 1, 3, 1]):
            ids = torch.randint(0, 128, (batch, 4), generator=torch.Generator().manual_seed(10 * r + step))
            errs.append(max_rel_err(w.step(ids), load_program(path).module()(ids)))
    finally:
        w.stop()
    return max(errs), sorted(w.staged)


def test_rewrite_stages_then_load_runs_staged(exported, tmp_path):
    """rewrite --stages 2 checks and prints the schedule, records the stages; the loaded workers
    run micro-batches (a step of one sequence runs one stage) and match the original (loaded in
    processes of their own; the fresh-interpreter load is the test above)."""
    from afd_compile.runtime import run_local

    _, path = exported("llama2")
    out = tmp_path / "out"
    res = _run("rewrite", path, "-o", str(out), "-A", "2", "-F", "1", "--stages", "2")
    assert res.returncode == 0, res.stderr
    assert "schedule: checked" in res.stdout
    assert json.loads((out / "plan.json").read_text())["stages"] == 2
    ran = run_local(_staged_rank, 3, str(out), path)
    assert ran[0][0] == 3 and ran[0][1].get(1, 0) > 0, ran[0]  # stage 1 transfers happened
    assert max(ran[1][0], ran[2][0]) <= 1e-5 and ran[1][1] == [2] and ran[2][1] == [2], ran


def test_verify_ok_exit_0(exported):
    res = _run("verify", exported("llama2")[1], "-A", "2", "-F", "1", "--tokens", "2,3")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().splitlines()[-1].startswith("verify: OK max_rel_err=")
    assert "batches [2, 3]" in res.stdout and "batches [3, 2]" in res.stdout
    # progress on stderr, one line per phase as it ends (the first attention rank's, rank 1)
    lines = [line.split("] ", 1)[1] for line in res.stderr.splitlines() if line.startswith("afd-compile verify: [")]
    assert lines[0].startswith("loaded and split ") and lines[1:] == [
        "3 processes up (torch imported, process group formed) (rank 1)", "programs built (rank 1)",
        "step 1/2 done (rank 1)", "step 2/2 done (rank 1)"], res.stderr


def test_verify_fail_exit_1(exported):
    # the MoE split differs from the original by float rounding (~1e-7): a tolerance below that fails
    res = _run("verify", exported("qwen3moe2")[1], "-A", "2", "-F", "1", "--tol", "1e-12")
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stdout.strip().splitlines()[-1].startswith("verify: FAIL max_rel_err=")


class _NoAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + self.lin(x)


@pytest.mark.parametrize(
    ("kind", "extra", "message"),
    [
        ("missing", ["-A", "1", "-F", "1"], "no such file"),
        ("garbage", ["-A", "1", "-F", "1"], "not a .pt2 archive"),
        ("no_attention", ["-A", "1", "-F", "1"], "no attention/FFN structure found"),
        ("llama", ["-A", "1", "-F", "2"], "every FFN rank needs at least one attention peer"),
        ("llama", ["-A", "0", "-F", "1"], "argument --attention-ranks/-A: must be in [1, 65536], got 0"),
        ("llama", ["-A", "2", "-F", "1", "--tokens", "1,2,3"], "--tokens has 3 entries"),
        ("static", ["-A", "2", "-F", "1"], "static token dims, and an FFN rank runs the tokens of several"),
    ],
)
def test_verify_bad_input_exit_2_one_line(exported, tmp_path, kind, extra, message):
    path = tmp_path / "model.pt2"
    if kind == "garbage":
        path.write_text("not a model")
    elif kind == "no_attention":
        torch.export.save(torch.export.export(_NoAttention(), (torch.randn(2, 8),)), path)
    elif kind == "llama":
        path = exported("llama2")[1]
    elif kind == "static":  # exported with static shapes, its MLP mixing the sequences: no fan-in
        from handwritten import batch_mixing

        torch.export.save(torch.export.export(batch_mixing().eval(), (torch.randint(0, 128, (2, 5)),)), path)
    res = _run("verify", str(path), *extra)
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in res.stderr
    assert "Traceback" not in res.stderr
    # one line (besides the progress lines of the phases that finished before the check, and
    # argparse's usage block above a flag it refuses)
    lines = [line for line in res.stderr.strip().splitlines() if not line.startswith("afd-compile verify: [")]
    if lines[0].startswith("usage:"):
        lines = [line for line in lines[1:] if not line.startswith(" ")]
    assert len(lines) == 1, lines


def test_plan_json_lists_nodes_and_wire_bytes(exported):
    res = _run("plan", exported("llama2")[1], "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert [layer["layer"] for layer in data["layers"]] == [0, 1] and "index" not in data["layers"][0]
    assert data["tokens_per_step"] == "input_ids.shape[0] * input_ids.shape[1]"
    wire = data["layers"][0]["wire"]
    assert wire["to_ffn"] == [{"kind": "hidden", "dtype": "float32", "shape": ["tokens", 64], "bytes_per_token": 256}]
    assert len(data["layers"][0]["ffn_nodes"]) == 5
    text = _run("plan", exported("llama2")[1], "-A", "3", "-F", "2").stdout
    assert "layout 3A2F (ffn 0 <- attention [2, 3], ffn 1 <- attention [4])" in text
    assert os.linesep.join(text.splitlines()[1:2]).startswith("layer")


def test_torchrun_launch_uses_the_same_workers():
    import shutil

    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "afd_torchrun.py")
    proc = subprocess.run([torchrun, "--nproc-per-node", "3", example, "--attention", "2", "--ffn", "1"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "AFD_BACKEND": "gloo"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("OK max_rel_err=")
    assert "FFN rank 0: served 3 steps (it compares nothing)" in proc.stderr, proc.stderr


@pytest.mark.parametrize("script, args", [("afd_torchrun.py", ["--attention", "2", "--ffn", "1"]),
                                          ("compile_backend.py", ["--attention", "2", "--ffn", "1"]),
                                          ("generate.py", ["--tp", "2"])])
def test_an_example_started_wrong_says_how_to_start_it_before_building_anything(script, args):
    import shutil
    import time

    example = os.path.join(os.path.dirname(__file__), "..", "examples", script)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, example, *args], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    need = str(3 if "--ffn" in args else 2)
    assert proc.stderr.strip().splitlines() == [
        f"{script}: error: examples/{script}: start it with torchrun (no RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
        f"in the environment): torchrun --nproc-per-node {need} examples/{script} {' '.join(args)}"], proc.stderr
    assert time.monotonic() - t0 < 30  # (imports only: no model built)
    if script != "afd_torchrun.py":
        return
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--nproc-per-node", "2", example, *args], capture_output=True, text=True,
                          timeout=120, env={**env, "AFD_BACKEND": "gloo"})
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"{script}: error:")]
    assert lines == [f"{script}: error: layout 2A1F needs 3 processes, torchrun started 2: torchrun --nproc-per-node 3 "
                     f"examples/{script} {' '.join(args)}"], proc.stderr


def test_plan_tp_json_uses_the_relied_on_names(exported):
    res = _run("plan", exported("llama2")[1], "--tp", "4", "--attn-dp", "2", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    layer = data["layers"][0]
    assert "column-parallel model.model.layers.0.self_attn.q_proj.weight dim 0 / 2 over attn" in data["shards"]
    assert "row-parallel model.model.layers.1.mlp.down_proj.weight dim 1 / 4 over mlp" in data["shards"]
    assert layer["layer"] == 0 and layer["kind"] == "dense"
    assert layer["modes"] == {"layer_input": "TP_ATTN_FULL", "attn": "TP_ATTN_FULL", "mlp": "FULL",
                              "middle_residual": "TP_ATTN_FULL", "layer_output": "TP_ATTN_FULL"}
    assert layer["junctions"] == {"prepare_attn": [], "prepare_mlp": ["all_gather"],
                                  "postprocess_layer": ["reduce_scatter"]}


def test_verify_tp_ok_with_uneven_dp_groups(exported):
    res = _run("verify", exported("llama2")[1], "--tp", "2", "--attn-dp", "2", "--tokens", "3,0", "-q")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().splitlines()[-1].startswith("verify: OK max_rel_err=")
    assert "afd-compile verify: [" not in res.stderr  # -q: no progress lines


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tp", "3"], "has 4 attention heads, which 3 attention-TP ranks cannot divide"),
        (["--tp", "4", "--attn-dp", "3"], "attn_dp=3 does not divide tp=4"),
        (["--tp", "2", "-A", "1", "-F", "1"], "not both"),
        (["--tp", "2", "--attn-dp", "2", "--tokens", "1"], "one per attention DP group"),
    ],
)
def test_verify_tp_bad_layout_exit_2(exported, extra, message):
    res = _run("verify", exported("llama2")[1], *extra)
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr


README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def _fenced_after(text: str, marker: str) -> tuple[int, int]:
    """(start, end) of the body of the first fenced block after the line holding ``marker``."""
    at = text.index(marker)
    start = text.index("\n", text.index("```", at)) + 1
    return start, text.index("\n```", start)


def test_readme_figures_are_the_plans_pictures(exported, update_goldens):
    # the README's two pictures are `plan --mermaid` of a real plan (--update-goldens rewrites them)
    from afd_compile.cli import _plan
    from afd_compile.deploy import tp_rank_program
    from afd_compile.figures import afd_mermaid, tp_mermaid
    from afd_compile.layout import AFDLayout
    from afd_compile.passes.roles import annotate_roles
    from afd_compile.scatter import TPLayout

    ep, path = exported("llama2")
    _, result = _plan(path, AFDLayout(2, 1), False)
    gm = ep.module()
    annotate_roles(gm)
    figures = {"-A 2 -F 1 --mermaid": afd_mermaid(result, AFDLayout(2, 1), 0),
               "--tp 4 --attn-dp 2 --mermaid 1": tp_mermaid(tp_rank_program(gm, TPLayout(4, 2), 0).plan, 1)}
    text = open(README).read()
    for flags, figure in figures.items():
        start, end = _fenced_after(text, f"<!-- figure: afd-compile plan llama2.pt2 {flags} ")
        if update_goldens:
            text = text[:start] + figure + text[end:]
        else:
            assert text[start:end] == figure, f"README figure for plan {flags} differs (pytest --update-goldens)"
    if update_goldens:
        with open(README, "w") as f:
            f.write(text)


def test_readme_support_table_is_generated():
    sys.path.insert(0, os.path.dirname(__file__))
    import support_table

    assert support_table.readme_block() == support_table.render(support_table.collect()), \
        "README support table is stale: python tests/support_table.py --write"


def test_readme_quick_start_runs_as_written(tmp_path):
    # the "Your own model" snippet and its verify command, copied from the README, in a fresh folder
    text = open(README).read()
    start, end = _fenced_after(text, "<!-- snippet: tests/test_cli.py runs it as written -->")
    code = text[start:end]
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    command = next(line for line in text[end:].splitlines() if line.startswith("afd-compile verify my_model.pt2 -A"))
    argv = command.split("#")[0].split()[1:]
    res = subprocess.run([*CLI, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1].startswith("verify: OK max_rel_err=")


# --- error paths of the second hour (issue 37): one line, exit 2, before any slow work ---------


@pytest.mark.parametrize(("argv", "message"), [
    (["verify", "{m}", "-A", "2", "-F", "1", "--steps", "3", "--decode-steps", "2"],
     "--steps 3 with --decode-steps 2: a decode run's steps are its prefill and the decode steps"),
    (["verify", "{m}"], "give a layout: an AFD one (-A/--attention-ranks A -F/--ffn-ranks F) or a TP one (--tp T)"),
    (["plan", "{m}", "--tp", "2", "--attn-tp", "2"], "--attn-tp sizes the attention TP groups of an AFD layout"),
    (["plan", "{m}", "-A", "1", "-F", "1", "--mermaid", "5"], "--mermaid: no layer 5 in the plan (layers [0, 1])"),
    (["plan", "{m}", "--tp", "2", "--mermaid", "5"], "--mermaid: no layer 5 in the plan"),
])
def test_a_bad_flag_combination_is_one_line_exit_2(exported, argv, message):
    res = _run(*[a.format(m=exported("llama2")[1]) for a in argv])
    lines = [x for x in res.stderr.strip().splitlines() if "error:" in x or "Traceback" in x]
    assert res.returncode == 2 and len(lines) == 1 and message in lines[0], res.stderr[-2000:]


def test_version_and_the_top_level_help_name_both_modes():
    res = _run("--version")
    assert res.returncode == 0 and res.stdout.startswith("afd-compile "), res
    helptext = "".join(_run("--help").stdout.split())  # (argparse wraps the description, at hyphens too)
    assert "attention-FFNdisaggregation,-A/-F" in helptext and "tensor-parallel(--tp)" in helptext


def _doc_script(name: str) -> str:
    """The python block of docs/cli.md whose first line is ``# <name>``."""
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "cli.md")).read()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    (block,) = [b for b in blocks if b.startswith(f"# {name}")]
    return block


def test_saved_folders_run_and_verify_as_the_docs_say(exported, tmp_path):
    # issue 37: from `rewrite` to running and checking the saved programs by following docs/cli.md
    import shutil

    model = exported("llama2")[1]
    afd, tp = str(tmp_path / "out_afd"), str(tmp_path / "out_tp")
    assert _run("rewrite", model, "-o", afd, "-A", "2", "-F", "1", "-q").returncode == 0
    assert _run("rewrite", model, "-o", tp, "--tp", "2", "-q").returncode == 0
    script = tmp_path / "run_saved.py"
    script.write_text(_doc_script("run_saved.py"))
    env = {**os.environ, "AFD_BACKEND": "gloo"}
    # the AFD folder on local processes (run_local), the TP folder under torchrun
    proc = subprocess.run([sys.executable, str(script), model, afd, "3"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "rank 0: FFN, served 1 steps", lines
    assert [float(ln.split("=")[1]) <= 1e-5 for ln in lines[1:]] == [True, True], lines
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--nproc-per-node", "2", str(script), model, tp], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # (two processes write to one pipe: a line of one can land inside the other's, "5.05e-07rank 0: ...")
    errs = [float(x) for x in re.findall(r"max_rel_err=(\d+(?:\.\d+)?(?:e[-+]\d+)?|nan|inf)", proc.stdout)]
    assert len(errs) == 2 and max(errs) <= 1e-5, proc.stdout
    # verify --saved: both kinds against the original, the folder's layout from its plan.json
    for folder, layout in ((afd, "2A1F"), (tp, "tp=2")):
        res = _run("verify", model, "--saved", folder, "-q")
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"layout {layout}" in res.stdout and res.stdout.strip().splitlines()[-1].startswith("verify: OK"), \
            res.stdout
    res = _run("verify", model, "--saved", afd, "-A", "2", "-F", "1")
    assert res.returncode == 2 and "its plan.json gives the layout" in res.stderr, res.stderr
    # a tampered plan.json is refused, naming the field
    plan = json.loads(open(os.path.join(afd, "plan.json")).read())
    plan["programs"]["ffn"] = "../ffn.pt2"
    with open(os.path.join(afd, "plan.json"), "w") as f:
        json.dump(plan, f)
    res = _run("verify", model, "--saved", afd)
    assert res.returncode == 2 and "programs.ffn" in res.stderr, res.stderr
    res = _run("verify", afd, "-A", "2", "-F", "1")  # the folder given as the model: what to do instead
    assert res.returncode == 2 and f"verify MODEL.pt2 --saved {afd}" in res.stderr, res.stderr


@pytest.mark.parametrize("tokens, message", [("0,0", "every batch size is 0, so nothing would be compared"),
                                             ("2,-1", "a batch size (sequences) is >= 0")])
def test_bad_tokens_are_refused_before_the_program_is_loaded(tmp_path, tokens, message):
    missing = str(tmp_path / "never_loaded.pt2")  # (a load would fail with 'no such file')
    res = _run("verify", missing, "-A", "2", "-F", "1", "--tokens", tokens)
    assert res.returncode == 2 and message in res.stderr and "no such file" not in res.stderr, res.stderr


def test_fewer_sequences_than_stages_is_said_and_no_staged_step_is_refused(exported):
    res = _run("verify", exported("llama2")[1], "-A", "2", "-F", "1", "--stages", "2", "--tokens", "1,2", "-q")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "verify: note: batch sizes [1] are under --stages 2: those steps run 1 micro-batch(es), not 2" in res.stdout
    # no step with two sequences: stages would never run, so an OK would claim what nothing checked
    res = _run("verify", exported("llama2")[1], "-A", "2", "-F", "1", "--stages", "2", "--tokens", "1,1", "-q")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "--stages 2 with --tokens [1, 1]: no step has 2 sequences on any rank" in res.stderr, res.stderr


def test_a_raw_hf_export_says_which_module_to_import_and_then_loads(tmp_path):
    # the output type (CausalLMOutputWithPast) is a pytree node only once transformers' module
    # defining it is imported: a fresh process must be told which, and --import fixes it
    from afd_compile.models import build_hf

    model = build_hf("llama", num_layers=1).model  # the HF model itself, not our logits wrapper
    ids = torch.randint(0, 128, (2, 5))
    path = str(tmp_path / "raw.pt2")
    torch.export.save(torch.export.export(model, (ids,), {"attention_mask": torch.ones_like(ids), "use_cache": False}),
                      path)
    cmd = [sys.executable, "-m", "afd_compile.cli", "plan", path, "-q"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--import transformers.modeling_outputs" in proc.stderr and "export_lm" in proc.stderr, proc.stderr
    proc = subprocess.run([*cmd, "--import", "transformers.modeling_outputs"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_plan_mermaid_ranks_draws_the_whole_layout(exported):
    path = exported("llama2")[1]
    res = _run("plan", path, "-A", "4", "--attn-tp", "2", "-F", "2", "--ffn-tp", "2", "--mermaid", "ranks", "-q")
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert text.startswith("flowchart LR") and 'subgraph A2["attention TP group [2, 3]' in text
    assert 'subgraph F0["FFN TP group [0, 1]"]' in text and 'r1["rank 1: FFN, fans in [4, 5]"]' in text
    # hidden 64 fp32 = 256 B per token and direction per layer, 2 layers
    assert text.count('<-- "512 + 512 B/token per step (2 layers)" -->') == 4, text
    res = _run("plan", path, "--tp", "4", "--attn-dp", "2", "--mermaid", "ranks", "-q")
    assert res.returncode == 0 and "TP group of 4: all_gather, reduce_scatter; 1024 B/token per step" in res.stdout
    res = _run("plan", path, "--mermaid", "all")
    assert res.returncode == 2 and "give a layer index or 'ranks'" in res.stderr, res.stderr


def test_inputs_that_are_not_tensors_are_named_with_how_to_export_without_them():
    # a raw HF export passes use_cache=False as an input: said right after the load, naming it
    import torch

    from afd_compile.errors import ProgramLoadError
    from afd_compile.programs import flat_inputs

    class Flagged(torch.nn.Module):
        def forward(self, x: torch.Tensor, use_cache: bool = True) -> torch.Tensor:
            return x * 2 if use_cache else x

    ep = torch.export.export(Flagged(), (torch.randn(2, 3),), {"use_cache": False})
    with pytest.raises(ProgramLoadError, match=r"not all tensors \(keyword input \['use_cache'\]: a bool, False\); "
                                               r"only tensor inputs are supported: export a wrapper"):
        flat_inputs(ep)


def test_plan_says_where_an_moe_runs(exported, capsys):
    # issue 53: the router's side and which experts each FFN rank holds, per layout
    from afd_compile.cli import main

    path = exported("qwen3moe2")[1]
    assert main(["plan", path, "-A", "4", "-F", "4", "--ffn-ep", "2", "-q"]) == 0
    out = capsys.readouterr().out
    assert "  router: on the FFN ranks (the gate and its top-k run after the receive)" in out, out
    assert ("  experts over FFN EP groups of 2 (all-to-all per MoE layer): group rank 0 (FFN ranks 0, 2): experts 0-1; "
            "group rank 1 (FFN ranks 1, 3): experts 2-3") in out, out
    assert main(["plan", path, "-A", "2", "-F", "1", "--gate-on-attention", "-q"]) == 0
    out = capsys.readouterr().out
    assert "router: on the attention ranks (--gate-on-attention)" in out and "experts: all 4 on each FFN rank" in out
