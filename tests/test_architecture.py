"""The package's shape (issue 16): no import cycle between its modules, no private name imported
from another module, one error base for every bad-input error."""

from __future__ import annotations

import ast
import pathlib

import pytest

import afd_compile

PKG = pathlib.Path(afd_compile.__file__).parent


def _module(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, list[tuple[str, list[str]]]]:
    """module -> [(imported module, names)] for every import anywhere in it (lazy ones too)."""
    out: dict[str, list[tuple[str, list[str]]]] = {}
    for path in PKG.rglob("*.py"):
        mod = _module(path)
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        found = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [a.name for a in node.names]
                # from .pkg import x: x may be a module of pkg
                base = PKG.parent / target.replace(".", "/")
                modules = [n for n in names if (base / n).with_suffix(".py").exists()]
                found += [(f"{target}.{n}", []) for n in modules]
                if len(modules) < len(names):
                    found.append((target, [n for n in names if n not in modules]))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                name = node.module if isinstance(node, ast.ImportFrom) else None
                for a in ([ast.alias(name)] if name else node.names):
                    if a.name.startswith("afd_compile"):
                        found.append((a.name, [x.name for x in getattr(node, "names", [])]))
        out[mod] = found
    return out


def test_the_import_graph_has_no_cycle():
    graph = {m: {t for t, _ in deps if t in _imports_cache and t != m} for m, deps in _imports_cache.items()}
    seen, stack, cycles = set(), [], []

    def visit(m: str) -> None:
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for t in sorted(graph[m]):
            visit(t)
        stack.pop()

    for m in sorted(graph):
        visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_private_name_crosses_a_module_boundary():
    crossing = [(m, t, n) for m, deps in _imports_cache.items() for t, names in deps
                for n in names if n.startswith("_") and not n.startswith("__") and t != m]
    assert not crossing, crossing


def test_every_bad_input_error_derives_from_one_base():
    from afd_compile.backend import BackendOptionError
    from afd_compile.cli import UsageError
    from afd_compile.comm import WireMismatch
    from afd_compile.errors import AFDCompileError, SplitError, TPRewriteError
    from afd_compile.layout import LayoutError
    from afd_compile.limits import LaunchConfigError
    from afd_compile.outdir import OutputError
    from afd_compile.passes.roles import NoStructureError
    from afd_compile.passes.scattered import ScatteredRewriteError
    from afd_compile.passes.schedule import ScheduleError
    from afd_compile.passes.shard import ShardError
    from afd_compile.programs import ProgramLoadError
    from afd_compile.runtime import ControlError
    from afd_compile.saved import SavedFolderError
    from afd_compile.scatter import TransitionError
    from afd_compile.verify import VerifyInputError

    for e in (BackendOptionError, OutputError, UsageError, WireMismatch, SplitError, TPRewriteError, LayoutError,
              NoStructureError, ScatteredRewriteError, ScheduleError, ShardError, ProgramLoadError, ControlError,
              TransitionError, VerifyInputError, SavedFolderError, LaunchConfigError):
        assert issubclass(e, AFDCompileError) and issubclass(e, ValueError), e


_imports_cache = _imports()


def test_the_cache_id_follows_the_source(tmp_path, monkeypatch):
    import shutil

    from afd_compile import pipeline as backend  # (the backend's cache id: pipeline.pipeline_id)

    copy = tmp_path / "afd_compile"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(backend, "__file__", str(copy / "pipeline.py"))
    backend.source_id.cache_clear()
    before = backend.source_id()
    (copy / "passes" / "split.py").write_text((copy / "passes" / "split.py").read_text() + "\n# changed\n")
    backend.source_id.cache_clear()
    assert backend.source_id() != before
    monkeypatch.undo()
    backend.source_id.cache_clear()


def test_each_pipeline_times_its_passes_and_the_cli_prints_them(exported, capsys):
    from afd_compile import cli

    path = exported("llama2")[1]
    assert cli.main(["plan", path, "-A", "2", "-F", "1", "--timings"]) == 0
    out = capsys.readouterr().out
    for name in ("annotate_roles", "plan_split", "build_attention_program", "build_ffn_program", "verify_schedule",
                 "total"):
        assert f"\n{name} " in out, out
    assert cli.main(["plan", path, "--tp", "2", "--timings", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.out.lstrip().startswith("{")  # the JSON stays clean: timings go to stderr
    for name in ("plan_tp", "annotate_dist_states", "plan_shards", "apply_shards", "insert_all_reduces", "fuse_norm"):
        assert f"\n{name} " in captured.err, captured.err


def test_layers_of_groups_members_and_finds_the_ffn_output(exported):
    from afd_compile.passes.graph_utils import layers_of
    from afd_compile.passes.roles import META_KEY, Role, annotate_roles

    gm = exported("llama2")[0].module()
    annotate_roles(gm)
    layers = layers_of(gm)
    assert list(layers) == [0, 1]
    for i, layer in layers.items():
        assert all(n.meta[META_KEY].layer == i for n in layer.members)
        assert [n.name for n in layer.attention_ops] and len(layer.attention_ops) == 1
        ffn = layer.ffn
        assert ffn and all(n.meta[META_KEY].role is Role.FFN for n in ffn)
        out = layer.ffn_output
        assert out is ffn[-1] and any(u not in ffn for u in out.users)  # the MLP's down_proj, read by the add
        (o_proj,) = layer.output_projections
        assert layer.output_projection is o_proj
        assert list(o_proj.meta["nn_module_stack"].values())[-1][0] == f"model.model.layers.{i}.self_attn.o_proj"


def test_every_planned_transition_has_an_emitter_and_a_missing_one_is_named(exported, monkeypatch):
    from afd_compile.deploy import tp_rank_program
    from afd_compile.errors import TPRewriteError
    from afd_compile.passes import emitters
    from afd_compile.passes.dist_states import plan_tp
    from afd_compile.passes.roles import annotate_roles
    from afd_compile.scatter import Collective, ScatterMode, TPLayout

    gm = exported("qwen3moe3_mixed")[0].module()  # MoE, dense, MoE layers
    annotate_roles(gm)
    seen = set()
    for layout in (TPLayout(4), TPLayout(4, 2), TPLayout(4, 4), TPLayout(2, moe_a2a=True),
                   TPLayout(4, 2, moe_a2a=True), TPLayout(4, 2, dense_dp=True),
                   TPLayout(4, 2, moe_a2a=True, dense_dp=True)):
        for _, _, key in emitters.planned(plan_tp(gm, layout)):
            assert key in emitters.EMITTERS, key
            seen.add(key)
    assert seen == set(emitters.EMITTERS)  # no emitter is dead
    key = emitters.JunctionKey("prepare_mlp", Collective.ALL_GATHER, True, ScatterMode.FULL)
    monkeypatch.delitem(emitters.EMITTERS, key)
    with pytest.raises(TPRewriteError, match=r"layer 0 prepare_mlp: all_gather \(settling a partial sum\) with a "
                                             r"FULL MLP: planned, but no emitter is registered"):
        tp_rank_program(gm, TPLayout(4, 2), 0)


# --- size and layering (issue 33) ----------------------------------------------------------------

MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 80
#: modules over the limit, each with the most lines it may have until it is split (a ratchet:
#: growing past it fails, and so does an entry no longer needed): splits owed, not exceptions.
#: Empty: every module and function is within the limits.
PENDING_MODULES = {
}
PENDING_FUNCTIONS = {
}


def _sources():
    for path in sorted(PKG.rglob("*.py")):
        yield path.relative_to(PKG).as_posix(), path.read_text()


def test_no_module_defines_a_top_level_name_twice():
    # a second def of a name replaces the first for every caller, those before it included (ruff's
    # F811 misses it when the first is used in between): shard/follow.py once had two
    # _broadcast_heads, the later one called with the earlier one's arguments
    import ast

    twice = {}
    for name, text in _sources():
        seen: set[str] = set()
        for node in ast.parse(text).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name != "_":
                if node.name in seen:  # ("_": the registrations a decorator keeps, register_fake's)
                    twice.setdefault(name, []).append(node.name)
                seen.add(node.name)
    assert not twice, f"names defined twice at a module's top level: {twice}"


def test_no_module_over_600_lines_but_the_pending_ones():
    over = {name: len(text.splitlines()) for name, text in _sources() if len(text.splitlines()) > MAX_MODULE_LINES}
    grown = {n: (lines, PENDING_MODULES[n][0]) for n, lines in over.items() if n in PENDING_MODULES
             and lines > PENDING_MODULES[n][0]}
    new = {n: lines for n, lines in over.items() if n not in PENDING_MODULES}
    assert not new and not grown, f"modules over {MAX_MODULE_LINES} lines: new {new}, grown past their mark {grown}"
    done = sorted(set(PENDING_MODULES) - set(over))
    assert not done, f"no longer over the limit: remove {done} from PENDING_MODULES"


def test_no_function_over_80_lines_but_the_pending_ones():
    over = {}
    for name, text in _sources():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    over[f"{name}:{node.name}"] = lines
    bad = {k: v for k, v in over.items() if k not in PENDING_FUNCTIONS or v > PENDING_FUNCTIONS[k][0]}
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines (or grown past their mark): {bad}"
    done = sorted(set(PENDING_FUNCTIONS) - set(over))
    assert not done, f"no longer over the limit: remove {done} from PENDING_FUNCTIONS"


def test_the_runtime_imports_no_pass_and_composes_nothing():
    # the runtime only runs programs: what a rank runs is built by afd_compile.deploy
    bad = [(m, t) for m, deps in _imports_cache.items() if m.startswith("afd_compile.runtime")
           for t, _ in deps if t.startswith(("afd_compile.passes", "afd_compile.deploy", "afd_compile.split_api"))]
    assert not bad, bad


#: the modules a user calls (the command line, the printed plan, verify, the backend, the runtime):
#: they take their programs from afd_compile.deploy and afd_compile.pipeline, never from a pass
ENTRY_POINTS = ("afd_compile.cli", "afd_compile.cli_checks", "afd_compile.plan_view", "afd_compile.figures",
                "afd_compile.verify", "afd_compile.verify_inputs", "afd_compile.backend", "afd_compile.runtime")
#: what an entry point may read from afd_compile.passes: records' keys, errors, role policies and
#: helpers that read a graph (none of them rewrites one)
READ_FROM_PASSES = {
    "afd_compile.passes.roles": {"POLICIES", "META_KEY", "FusedLayerError", "NoStructureError", "non_attention_layers"},
    "afd_compile.passes.graph_utils": {"batch_symbol_dims", "cache_length", "written_attrs", "state_bytes",
                                       "aliases_first_arg", "writes_first_arg", "get_attr_path", "set_attr_path"},
    "afd_compile.passes.pipeline": {"timings_table"},
    "afd_compile.passes.moe": {"RECORDS_KEY"},
    "afd_compile.passes.grouped_qkv": {"RECORDS_KEY"},
    "afd_compile.passes.stages": {"static_batch", "static_rows"},
    "afd_compile.passes.router": {"selects_by_name"},
}


def test_entry_points_import_no_rewriting_pass():
    # issue 51: what a rank runs, and through which passes, has one answer (deploy + pipeline);
    # an entry point that imported a rewriting pass would compose programs of its own
    bad = []
    for m, deps in _imports_cache.items():
        if not m.startswith(ENTRY_POINTS):
            continue
        for t, names in deps:
            if not t.startswith("afd_compile.passes"):
                continue
            allowed = READ_FROM_PASSES.get(t, set())
            bad += [(m, t, n) for n in (names or ["(the module)"]) if n not in allowed]
    assert not bad, f"entry points importing passes: {bad}"


#: the modules that run a pipeline's portable stage (afd_compile.portable): deploy (what rank r of a
#: layout runs) and the Python API (split, the whole split at once)
COMPOSERS = {"afd_compile.deploy", "afd_compile.split_api"}


def test_one_module_composes_a_ranks_program():
    # issue 51: "what does rank r of layout L run" is answered by afd_compile.deploy through the
    # pipeline (portable.run over the declared passes); the CLI, verify and the backend call deploy
    importers = {m for m, deps in _imports_cache.items() for t, _ in deps if t == "afd_compile.portable"}
    assert importers <= COMPOSERS, f"a rank's program composed outside afd_compile.deploy: {importers - COMPOSERS}"
    steps = {m for m, deps in _imports_cache.items() for t, names in deps
             if t == "afd_compile.passes.tp_rewrite" and {"TP_STEPS", "TPWork"} & set(names or [])}
    assert steps <= {"afd_compile.portable"}, steps


def test_build_rank_answers_for_a_tp_layout_and_refuses_afd_options_there(exported):
    from afd_compile.deploy import build_rank
    from afd_compile.programs import fresh_module
    from afd_compile.scatter import TPLayout
    from afd_compile.split_api import SplitConfig

    ep = exported("llama2")[0]
    built = build_rank(fresh_module(ep), TPLayout(2), 1, SplitConfig(graph_name="llama2"))
    assert built.role == "tp" and built.worker is None and built.tp is not None
    assert built.tp.shards.weights  # the rank's slices of the projections
    with pytest.raises(TypeError, match=r"options \['stages'\] apply to an AFD layout"):
        build_rank(fresh_module(ep), TPLayout(2), 0, stages=2)


def test_every_meta_key_is_named_in_one_module():
    # issue 51: afd.* keys were spelled in 13 modules (afd.dist defined twice); now meta_keys.py
    # names each once and every other module uses the name (an "afd.x" literal elsewhere is an
    # op's name, as a message spells it)
    import re

    import torch

    import afd_compile.ops  # noqa: F401  (registers torch.ops.afd)

    found = []
    for path in PKG.rglob("*.py"):
        if path.name == "meta_keys.py":
            continue
        tree = ast.parse(path.read_text())
        docs = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                for key in re.findall(r"^afd\.([a-z_]+)$", node.value):
                    if not hasattr(torch.ops.afd, key):
                        found.append((path.relative_to(PKG).as_posix(), node.lineno, node.value))
    assert not found, f"meta keys spelled outside afd_compile/meta_keys.py: {found}"
    from afd_compile import meta_keys

    keys = [v for k, v in vars(meta_keys).items() if k.isupper()]
    assert len(keys) == len(set(keys)), keys


def test_no_module_sets_a_workers_fields_after_constructing_it():
    # issue 51: a worker is constructed once from its programs, groups and runner (deploy), and
    # only the worker itself changes its per-step state; before, make_worker set 8 fields on a
    # constructed worker and the backend 3 more
    found = []
    for path in PKG.rglob("*.py"):
        if path.relative_to(PKG).parts[0] == "runtime":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                else []
            )
            for t in targets:
                for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if (
                        isinstance(el, ast.Attribute)
                        and isinstance(el.value, ast.Name)
                        and el.value.id.endswith("worker")
                    ):
                        found.append((path.relative_to(PKG).as_posix(), node.lineno, f"{el.value.id}.{el.attr}"))
    assert not found, f"worker fields set outside the worker: {found}"
