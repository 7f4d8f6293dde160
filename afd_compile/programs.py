"""Loading and saving programs (``.pt2``) with our ops registered first (DESIGN §8)."""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
import zipfile
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from . import moe as _moe  # noqa: F401  (afd::moe_experts)
from . import ops as _ops  # noqa: F401  (torch.export.load needs afd:: registered, collectives too)
from .errors import ProgramLoadError
from .saved import program_file_problem

#: a .pt2's JSON members (the graph, its signature) are read whole, by torch and by the op scan:
#: at most this many bytes unpacked (a graph of thousands of layers is tens of MiB)
MAX_JSON_MEMBER_BYTES = 1 << 28
#: a compressed member may unpack to at most this many times its packed size (torch.export.save
#: stores members uncompressed; a zip bomb inflates by 1000x)
MAX_INFLATION = 100


def _check_members(path: str) -> None:
    """Refuse a ``.pt2`` whose members unpack past the stated limits, from the archive's
    directory alone (before anything is read): a JSON member over :data:`MAX_JSON_MEMBER_BYTES`,
    any member over :data:`MAX_INFLATION` times its packed size (and past 1 MiB)."""
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise ProgramLoadError(f"{path}: not a readable .pt2 archive: {_first_line(e)}") from None
    for info in infos:
        if info.filename.endswith(".json") and info.file_size > MAX_JSON_MEMBER_BYTES:
            raise ProgramLoadError(f"{path}: member {info.filename} unpacks to {info.file_size} bytes, past the "
                                   f"{MAX_JSON_MEMBER_BYTES} a program's JSON may have: not a program "
                                   "torch.export.save wrote")
        if info.file_size > max(1 << 20, MAX_INFLATION * info.compress_size):
            raise ProgramLoadError(f"{path}: member {info.filename} unpacks to {info.file_size} bytes from "
                                   f"{info.compress_size} ({info.file_size // max(info.compress_size, 1)}x, past "
                                   f"{MAX_INFLATION}x): not a program torch.export.save wrote")


def _op_namespaces(path: str) -> set[str]:
    """Custom-op namespaces named in a saved program (``torch.ops.<ns>.``), read from its JSON
    (after :func:`_check_members`: each member's size is bounded)."""
    found: set[str] = set()
    try:
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                if name.endswith(".json"):
                    found |= set(re.findall(rb"torch\.ops\.([A-Za-z_][A-Za-z0-9_]*)\.", z.read(name)))
    except (zipfile.BadZipFile, OSError):
        return set()
    return {ns.decode() for ns in found}


#: the libraries a run imports before loading programs (``--import``; os.pathsep-separated module
#: names or ``.py`` files): set by :func:`import_libraries`, read again by the processes of a
#: local run, which inherit the environment
IMPORTS_ENV = "AFD_COMPILE_IMPORTS"


def import_libraries(specs: Sequence[str] = ()) -> None:
    """Import each library (a module name, or a ``.py`` file) that registers custom ops a
    program uses, and those :data:`IMPORTS_ENV` names; the processes of local runs started after
    this import them too. One that cannot be imported is a :class:`ProgramLoadError` naming it."""
    known = [s for s in os.environ.get(IMPORTS_ENV, "").split(os.pathsep) if s]
    specs = [os.path.abspath(s) if _is_file_spec(s) else s for s in specs]
    for spec in dict.fromkeys(known + specs):
        _import_one(spec)
    if specs:
        os.environ[IMPORTS_ENV] = os.pathsep.join(dict.fromkeys(known + specs))


def _is_file_spec(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec


def _import_one(spec: str) -> None:
    import importlib
    import importlib.util
    import sys

    try:
        if not _is_file_spec(spec):
            importlib.import_module(spec)
            return
        if not os.path.isfile(spec):
            raise ProgramLoadError(f"--import {spec}: no such file")
        name = os.path.splitext(os.path.basename(spec))[0]
        loaded = sys.modules.get(name)
        if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") == spec:
            return  # (imported already, by its module name)
        found = importlib.util.spec_from_file_location(name, spec)
        module = importlib.util.module_from_spec(found)
        sys.modules[name] = module
        found.loader.exec_module(module)
    except ProgramLoadError:
        raise
    except SystemExit as e:  # (a module that ends the process on import: never a verdict of ours)
        raise ProgramLoadError(f"--import {spec}: the module called sys.exit({e.code!r}) while it was imported; "
                               "a library to import must not end the process") from None
    except Exception as e:  # noqa: BLE001  (whatever the library raises while importing)
        raise ProgramLoadError(f"--import {spec}: cannot import it: {_first_line(e)}") from None


def _register_op_libraries(namespaces: set[str]) -> None:
    """Import the libraries that register custom ops a saved graph uses."""
    import_libraries()
    if "transformers" in namespaces:
        try:
            import transformers.integrations.moe  # noqa: F401  (registers transformers::)
        except ImportError as e:
            raise ProgramLoadError(f"the program uses transformers:: ops but transformers cannot be imported: "
                                   f"{e}") from None


class _FirstRecords(logging.Handler):
    """Keeps what torch logs while loading (it logs the real cause, then raises a generic error)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:  # "error when deserializing" + the real one
            self.messages.append(_first_line(record.exc_info[1]))
            return
        try:
            text = record.getMessage().strip()
        except Exception:  # noqa: BLE001  (a record that cannot format is no cause)
            return
        if text:
            self.messages.append(text.splitlines()[0])


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e).strip() else ''}".rstrip(": ")


def load_program(path: str | os.PathLike) -> torch.export.ExportedProgram:
    """``torch.export.load`` with afd:: (and, when needed, transformers::) ops registered. A
    failure is one :class:`ProgramLoadError` line carrying torch's cause: the exception, its
    chained cause, and the first warning torch logged (it logs the reason, then raises a
    generic error). A ``.pt2`` is code (torch unpickles its constants): load only files you trust."""
    path = os.fspath(path)
    problem = program_file_problem(path)
    if problem is not None:
        raise ProgramLoadError(problem)
    if not zipfile.is_zipfile(path):
        raise ProgramLoadError(f"{path}: not a .pt2 archive (torch.export.save writes a zip file)")
    _check_members(path)
    _register_op_libraries(_op_namespaces(path))
    export_log = logging.getLogger("torch.export")
    records = _FirstRecords()
    handlers, propagate = list(export_log.handlers), export_log.propagate
    for h in handlers:  # torch logs the whole traceback as a warning; we raise one line with its cause
        export_log.removeHandler(h)
    export_log.addHandler(records)
    export_log.propagate = False
    try:
        with warnings.catch_warnings():  # torch warns about buffer copies on load; not the user's concern
            warnings.simplefilter("ignore")
            return torch.export.load(path)
    except Exception as e:  # noqa: BLE001  (torch raises many types here)
        raise ProgramLoadError(f"{path}: cannot load as a torch.export program: {_load_cause(e, records.messages)}") \
            from None
    finally:
        export_log.removeHandler(records)
        for h in handlers:
            export_log.addHandler(h)
        export_log.propagate = propagate


#: a custom op torch could not resolve while loading ("target='torch.ops.mylib.scatter_add.default'")
_UNRESOLVED_OP = re.compile(r"torch\.ops\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)")


def _load_cause(e: BaseException, logged: list[str]) -> str:
    """One line for a failed ``torch.export.load``: the cause torch logged (it raises a generic
    "check the warnings above" after), the exception, its chained cause; an op nothing registered
    is named as ``namespace::name``."""
    generic = "check the warnings above" in str(e)
    causes = logged[:1] + ([] if generic and logged else [_first_line(e)])
    if e.__cause__ is not None and _first_line(e.__cause__) not in causes:
        causes.append(f"caused by {_first_line(e.__cause__)}")
    text = " ".join(causes)
    op = _UNRESOLVED_OP.search(text)
    if op and op.group(1) not in ("aten", "prim", "afd") and ("resolve" in text or "Failed deserializing node" in text):
        return (f"the program uses the custom op {op.group(1)}::{op.group(2)}, which nothing imported in this process "
                "registers: import the library that registers it before loading (--import MODULE, or "
                f"{IMPORTS_ENV}=MODULE)")
    pytree = _UNREGISTERED_PYTREE.search(text)
    if pytree:  # a model output type (transformers' CausalLMOutputWithPast) its library registers on import
        module, _, name = pytree.group(1).rpartition(".")
        return (f"the program's inputs or outputs are {name}, a pytree type {module or 'its library'} registers when "
                f"it "
                f"is imported: import it before loading (--import {module or 'MODULE'}, or {IMPORTS_ENV}="
                f"{module or 'MODULE'}), or export the model to return plain tensors (a transformers causal LM: "
                "afd_compile.models.export_lm)")
    return "; ".join(c if len(c) <= 400 else c[:400] + "..." for c in causes)


#: a type torch's pytree could not rebuild ("Deserializing transformers.modeling_outputs.X in pytree is not registered")
_UNREGISTERED_PYTREE = re.compile(r"Deserializing ([\w.]+) in pytree is not registered")


def flat_inputs(ep: torch.export.ExportedProgram) -> tuple[Any, ...]:
    """The saved example inputs, positional and keyword, flattened in the program's input order
    (the order of the placeholders of :func:`positional_module`)."""
    if ep.example_inputs is None:
        raise ProgramLoadError("the program was saved without example inputs")
    args, kwargs = ep.example_inputs
    spec = ep.call_spec.in_spec
    if kwargs and spec is not None and spec.num_children == 2:
        kw = spec.child(1) if hasattr(spec, "child") else spec.children_specs[1]  # (child: torch >= 2.12)
        keys = kw.context
        kwargs = {k: kwargs[k] for k in keys if k in kwargs}
    leaves, got = torch.utils._pytree.tree_flatten((tuple(args), kwargs))
    if spec is not None and got != spec:
        raise ProgramLoadError(f"the saved example inputs do not match the program's input structure ({spec})")
    if not all(isinstance(x, torch.Tensor) for x in leaves):
        raise ProgramLoadError(_not_tensors((tuple(args), kwargs)))
    return tuple(leaves)


def _not_tensors(inputs: object) -> str:
    """Which saved inputs are not tensors (``kwargs['use_cache']: a bool, True``) and how to export
    without them."""
    paths, _ = torch.utils._pytree.tree_flatten_with_path(inputs)
    names = []
    for path, x in paths:
        if not isinstance(x, torch.Tensor):
            where = torch.utils._pytree.keystr(path[1:]) if path else "?"
            where = (f"input {where}" if path and getattr(path[0], "idx", None) == 0 else f"keyword input {where}")
            names.append(f"{where}: a {type(x).__name__}, {x!r}"[:120])
    return (f"the program's inputs are not all tensors ({'; '.join(names[:4])}{'; ...' if len(names) > 4 else ''}); "
            "only tensor inputs are supported: export a wrapper whose forward takes the tensors and passes the "
            "rest itself (a transformers causal LM: afd_compile.models.export_lm, or its LogitsOnly wrapper, which "
            "passes use_cache=False and returns the logits)")


def positional_module(ep: torch.export.ExportedProgram) -> fx.GraphModule:
    """``ep.module()`` called with its inputs flat and positional (keyword inputs included, in
    :func:`flat_inputs` order), returning its outputs flat: what the split and sharded programs
    are built from, so a program exported with keyword inputs (transformers' exporters) runs
    the same way as a positional one. A program with positional tensor inputs is unchanged."""
    gm = ep.module()
    if ep.example_inputs is not None and ep.example_inputs[1]:
        n = sum(1 for node in gm.graph.nodes if node.op == "placeholder")
        gm.graph._codegen = fx.graph.CodeGen()
        # export's input check (a forward pre-hook) reads _in_spec: n positional tensors now
        gm._in_spec = torch.utils._pytree.tree_flatten((tuple(range(n)), {}))[1]
        if hasattr(gm, "_out_spec"):
            delattr(gm, "_out_spec")
        gm.recompile()
    return gm


def fresh_module(ep: torch.export.ExportedProgram) -> fx.GraphModule:
    """:func:`positional_module` with its own copy of every buffer it updates in place (a KV
    cache): ``ep.module()`` shares the program's tensors, so two modules of one program (the
    reference and a split, in one process) would otherwise write one cache twice."""
    from .passes.graph_utils import get_attr_path, set_attr_path, written_attrs

    gm = positional_module(ep)
    for name in written_attrs(gm):
        set_attr_path(gm, name, get_attr_path(gm, name).clone())
    return gm


def dynamic_shapes_of(gm: fx.GraphModule) -> tuple[dict[int, Any], ...]:
    """Dim.DYNAMIC for every dim that is symbolic in the graph's placeholders."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        val = n.meta.get("val")
        dims = {}
        if isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt):
                    dims[d] = torch.export.Dim.DYNAMIC
        out.append(dims)
    return tuple(out)


def export_split(attention: fx.GraphModule, ffn: fx.GraphModule, original: fx.GraphModule,
                 inputs: Sequence[torch.Tensor]) -> tuple[torch.export.ExportedProgram, torch.export.ExportedProgram]:
    """Re-export both role programs so they can be saved as ``.pt2``."""
    import math
    import operator

    # the FFN program views its tokens as [B, T // B, ...] when the batch B is static (a static
    # KV cache): its example token count must be a multiple of every such B
    unit = math.lcm(1, *(n.args[1] for n in ffn.graph.nodes
                         if n.op == "call_function" and n.target == operator.floordiv and isinstance(n.args[1], int)))
    with torch.no_grad():
        att = torch.export.export(attention, tuple(inputs), dynamic_shapes=dynamic_shapes_of(original))
        ffn_ep = torch.export.export(ffn, (torch.empty(unit * max(2, 8 // unit), 0),),
                                     dynamic_shapes=({0: torch.export.Dim.DYNAMIC},))
    return att, ffn_ep


def write_json(path: str | os.PathLike, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
