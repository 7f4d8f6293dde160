"""Lifting dynamo's graph: its parameters and buffers (inputs to dynamo) become attributes of
a module again, found by dynamo's sources, and the graph is re-exported to ATen."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.fx import traceback as fx_traceback

from ..passes.graph_utils import get_attr_path, set_attr_path

log = logging.getLogger("afd_compile.backend")


_SEGMENT = re.compile(r"(?:^|_)(?:modules|parameters|buffers)_")


#: dynamo's name prefixes of the compiled module's own inputs (``torch.compile(model)``: self;
#: ``torch.compile(model.forward)``: the bound method's module is its first argument) and of the
#: Python globals the model reads (``g_import_transformers_dot_activations_math_pi``: ``math.pi``
#: in GPT-2's GELU, a float dynamo passes as a 0-d tensor under dynamic=True)
#: (torch 2.11 names a config attribute read as
#: ``object_getattribute_l_self_modules_model_config_hidden_dropout_``: Falcon's dropout p)
_CONSTANT_SOURCE = re.compile(r"(?:^|_)l_(?:self|args_0)_|^g_", flags=re.IGNORECASE)


#: dynamo's source of a lifted parameter or buffer (``node.meta["grapharg"].source``): a root
#: (the compiled module under whatever name its ``forward`` gives ``self``, an argument, a global),
#: then the module tree: ``L['s']._modules['layers']._modules['0']._parameters['weight']``
_SOURCE_PATH = re.compile(r"((?:L|G)\['[^']+'\](?:\[\d+\])?)((?:\._modules\['[^']+'\])*)"
                          r"\._(?:parameters|buffers)\['([^']+)'\]")


_SOURCE_KEY = re.compile(r"\._modules\['([^']+)'\]")


def _source_of(p: fx.Node) -> str | None:
    """Dynamo's source of graph input ``p`` (``L['ids']``, ``L['self']._modules['head']...``)."""
    src = getattr(p.meta.get("grapharg"), "source", None)
    if src is None:
        return None
    name = src.name
    return name() if callable(name) else name  # (a method in older torch releases)


def _source_path(source: str | None) -> tuple[str, str] | None:
    """``(root, path)`` of a parameter or buffer's source:
    ``L['s']._modules['layers']._modules['0']._parameters['weight']`` -> ``("L['s']", "layers.0.weight")``."""
    m = _SOURCE_PATH.fullmatch(source) if source else None
    if m is None:
        return None
    parts = [*_SOURCE_KEY.findall(m.group(2)), m.group(3)]
    return (m.group(1), ".".join(parts)) if all(x.isidentifier() or x.isdigit() for x in parts) else None


def _module_path(placeholder: str) -> str | None:
    """``l_self_modules_model_modules_layers_modules_0_modules_q_proj_parameters_weight_`` ->
    ``model.layers.0.q_proj.weight`` (dynamo's names for lifted parameters and buffers; also
    ``l_args_0_...`` when ``model.forward`` was compiled)."""
    m = re.fullmatch(r"l_(?:self|args_0)_(.*)_", placeholder, flags=re.IGNORECASE)
    if not m or not re.search(r"_(parameters|buffers)_", m.group(1)):
        return None
    parts = [p for p in _SEGMENT.split(m.group(1)) if p]
    return ".".join(parts) if all(p.isidentifier() or p.isdigit() for p in parts) else None


class Lifted(torch.nn.Module):
    """Dynamo's graph with its parameter/buffer inputs held as attributes again."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        super().__init__()
        self.gm = gm
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(example_inputs):
            raise RuntimeError(f"afd backend: {len(placeholders)} graph inputs but {len(example_inputs)} examples")
        # per graph input: ("attr", path) | ("user", i) | ("size", (i, d)) | ("const", value) | ("drop", None)
        self.slots: list[tuple[str, Any]] = []
        self.user_positions: list[int] = []
        #: graph inputs that are ints no input tensor carries (``logits_to_keep``): the program is
        #: compiled for their values (the caller compiles again for other values: ``const_key``)
        self.const_positions: list[int] = []
        #: inputs the graph updates in place or the caller marked as at a fixed address
        #: (``torch._dynamo.mark_static_address``: HF's static KV cache): exported with static shapes (a cache is
        #: allocated once; a head count
        #: must stay a constant for TP) and compiled as static inputs (CUDA graphs neither copy nor
        #: refuse their in-place updates); another shape compiles again (``const_key``)
        self.static_positions: list[int] = []
        used: set[str] = set()
        # the module's parameters and buffers by dynamo's sources (whatever the module's forward
        # names its self), else by dynamo's placeholder names (l_self_modules_...); a 0-d input read
        # off the module (the roots its parameters hang from) or a global is a constant below
        sources = [_source_of(p) for p in placeholders]
        roots = {found[0] for found in map(_source_path, sources) if found is not None}
        for i, (p, x) in enumerate(zip(placeholders, example_inputs, strict=True)):
            found = _source_path(sources[i])
            path = found[1] if found is not None else _module_path(p.name)
            of_model = bool(_CONSTANT_SOURCE.search(p.name)) or (sources[i] is not None and (
                sources[i].startswith("G[") or any(sources[i].startswith(r) for r in roots)))
            if isinstance(x, torch.Tensor) and path is not None and path not in used:
                used.add(path)
                set_attr_path(self, path, x)
                self.slots.append(("attr", path))
            elif isinstance(x, torch.Tensor) and x.dim() == 0 and of_model and (_only_item(p) or not p.users):
                # a float module attribute (an RMSNorm eps) or global (math.pi) dynamo passes as a
                # 0-d tensor under dynamic=True: a constant of this graph, never a symbolic float
                # that export would make unbacked (or that would cross an AFD cut as a scalar)
                for u in list(p.users):
                    u.replace_all_uses_with(x.item())
                    gm.graph.erase_node(u)
                self.slots.append(("drop", None))
            elif isinstance(x, torch.Tensor):
                if is_static_address(x) or _mutated_in_place(p):
                    self.static_positions.append(i)
                self.slots.append(("user", len(self.user_positions)))
                self.user_positions.append(i)
            else:
                self.slots.append(("size", None))
        gm.recompile()
        # a SymInt input (dynamo's automatic dynamic shapes) is read back from a user tensor's size
        user_vals = [placeholders[i].meta.get("example_value") for i in self.user_positions]
        for k, (kind, _) in enumerate(self.slots):
            if kind != "size":
                continue
            sym = placeholders[k].meta.get("example_value")
            found = next(((u, d) for u, v in enumerate(user_vals) if isinstance(v, torch.Tensor)
                          for d, s in enumerate(v.shape)
                          if isinstance(s, torch.SymInt) and isinstance(sym, torch.SymInt)
                          and s.node.expr == sym.node.expr), None)
            if found is not None:
                self.slots[k] = ("size", found)
            elif isinstance(example_inputs[k], (int, torch.SymInt)):
                # an int argument dynamo made symbolic: a constant of this program
                self.slots[k] = ("const", _hint(example_inputs[k]))
                self.const_positions.append(k)
            else:
                raise RuntimeError(f"afd backend: graph input {placeholders[k].name} "
                                   f"({type(example_inputs[k]).__name__})"
                                   " is neither a tensor, a size of one, nor an int")

    def const_key(self, args: Sequence[Any]) -> tuple:
        """What this program was compiled for, read from a call's args: the values of the int
        inputs, the shapes of the static-address ones."""
        return (tuple(int(args[k]) for k in self.const_positions),
                tuple(tuple(args[k].shape) for k in self.static_positions))

    def forward(self, *user: torch.Tensor) -> Any:
        args = []
        for kind, ref in self.slots:
            if kind == "attr":
                args.append(get_attr_path(self, ref))
            elif kind == "user":
                args.append(user[ref])
            elif kind == "drop":
                args.append(None)
            elif kind == "const":
                args.append(ref)
            else:
                u, d = ref
                args.append(user[u].shape[d])
        # run node by node with each node's meta current: the export records dynamo's
        # nn_module_stack (module paths: the layers the role policy reads) on the ATen nodes,
        # which running the generated code would lose
        with fx_traceback.preserve_node_meta():
            return fx.Interpreter(self.gm).run(*args)


def is_static_address(x: torch.Tensor) -> bool:
    """Marked with ``torch._dynamo.mark_static_address`` (transformers does it for its static KV cache)."""
    return bool(getattr(x, "_dynamo_static_input_type", None))


def _mutated_in_place(p: fx.Node) -> bool:
    """Does dynamo's graph update input ``p`` in place (``cache.index_copy_(...)``, ``n.add_(1)``)?"""
    def name(u: fx.Node) -> str:
        return u.target if isinstance(u.target, str) else getattr(u.target, "__name__", "")

    return any(u.op in ("call_method", "call_function") and u.args and u.args[0] is p and name(u).endswith("_")
               and not name(u).endswith("__") for u in p.users)


def _hint(x: int | torch.SymInt) -> int:
    return int(x.node.hint) if isinstance(x, torch.SymInt) else int(x)


def _only_item(p: fx.Node) -> bool:
    return bool(p.users) and all(u.op == "call_method" and u.target == "item" for u in p.users)


def export_lifted(lifted: Lifted, user_inputs: Sequence[torch.Tensor]) -> torch.export.ExportedProgram:
    """Export to ATen with the same dims dynamic as in dynamo's graph (``Dim.AUTO`` on every
    dim dynamo made symbolic; a static dynamo graph exports static)."""
    placeholders = [n for n in lifted.gm.graph.nodes if n.op == "placeholder"]
    shapes: list[Any] = []
    for i in lifted.user_positions:
        v = placeholders[i].meta.get("example_value")
        if i in lifted.static_positions:
            shapes.append(None)
            continue
        dyn = {d: torch.export.Dim.AUTO for d, s in enumerate(v.shape) if isinstance(s, torch.SymInt)} \
            if isinstance(v, torch.Tensor) else {}
        shapes.append(dyn or None)
    with torch.no_grad():
        return torch.export.export(lifted, tuple(user_inputs), dynamic_shapes=(tuple(shapes),))  # forward(*user)


def is_dynamic(ep: torch.export.ExportedProgram) -> bool:
    return any(isinstance(s, torch.SymInt) for n in ep.graph.nodes if n.op == "placeholder"
               and isinstance(n.meta.get("val"), torch.Tensor) for s in n.meta["val"].shape)
