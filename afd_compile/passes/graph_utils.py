"""Graph helpers every pass shares: copying a GraphModule, reading and writing dotted attribute
paths, inserting nodes with fake values, and rebuilding symbolic sizes from the graph's inputs.

Public within the package (no pass reaches into another pass's private names).
"""

from __future__ import annotations

import copy
import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..errors import SplitError
from .op_kinds import LINEAR_OPS, MATMUL_OPS, SDPA_OPS, is_attention_op
from .roles import META_KEY, NodeRole, Role, descendants
from .symbolic import emit_with, sym_expr

aten = torch.ops.aten


class Builder:
    """Inserts nodes and gives each a ``meta['val']`` computed under the graph's fake mode."""

    def __init__(self, graph: fx.Graph, fake_mode: object, layer: int | None) -> None:
        self.graph, self.mode, self.layer = graph, fake_mode, layer

    def call(self, target: object, args: tuple, name: str | None = None) -> fx.Node:
        node = self.graph.call_function(target, args)
        if name:
            node._rename(name)
        node.meta[META_KEY] = NodeRole(self.layer, Role.ATTENTION)
        if self.mode is not None:
            fargs = fx.node.map_arg(args, lambda n: n.meta.get("val"))
            if isinstance(target, torch._ops.OpOverload):
                with self.mode:
                    node.meta["val"] = target(*fargs)
            else:  # SymInt arithmetic
                node.meta["val"] = target(*fargs)
        return node


def shape_args(b: Builder, shape: tuple, sources: dict) -> list:
    """``shape`` as graph values: ints for static dims; symbolic dims computed from sym_size
    nodes on the graph's inputs (``sources``: symbol -> (placeholder, dim))."""
    out: list = []
    for size in shape:
        e = sym_expr(size)
        if e.is_Integer:
            out.append(int(e))
            continue
        symbols = {}
        for s in e.free_symbols:
            if s not in sources:
                raise SplitError(f"size {e}: symbol {s} is not a dimension of any graph input")
            ph, d = sources[s]
            symbols[s] = b.call(aten.sym_size.int, (ph, d))
        out.append(emit_with(b.call, e, symbols))
    return out


def symbol_sources(graph: fx.Graph) -> dict:
    out: dict = {}
    for n in graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder" and isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                e = sym_expr(size)
                if e.is_Symbol and e not in out:
                    out[e] = (n, d)
    return out


def _copy_codegen(codegen: fx.graph.CodeGen) -> fx.graph.CodeGen:
    """A copy of a graph's codegen: its pytree specs are immutable and shared (a deep copy pickles
    them, which torch >= 2.12 warns about), the list of argument names is copied."""
    new = copy.copy(codegen)
    info = getattr(new, "pytree_info", None)
    if info is not None:
        new.pytree_info = info._replace(orig_args=list(info.orig_args))
    return new


def copy_graph_module(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    graph._codegen = _copy_codegen(gm.graph._codegen)
    new = fx.GraphModule(gm, graph)
    new.meta.update(gm.meta)  # (what passes recorded about the program, e.g. its token multiple)
    for k in ("_in_spec", "_out_spec"):
        if hasattr(gm, k):
            setattr(new, k, getattr(gm, k))
    return new, env


_CARRIERS = itertools.count()  # (each carrier's source a name of its own)


def row_carrier(mode: Any, name: str, hint: int, device: torch.device) -> torch.Tensor:
    """A ``(rows, 0)`` carrier's fake value in ``mode`` (a fake mode with a shape env): ``rows`` a
    fresh symbol of its own (no duck sizing) whose example value is ``hint``, one row or more, so a
    program compiled for it runs for any count."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    env = mode.shape_env
    source = ConstantSource(f"{name}_{next(_CARRIERS)}")
    sym = env.create_symbol(hint, source=source, dynamic_dim=DimDynamic.DYNAMIC, do_not_specialize_zero_one=True)
    env.constrain_symbol_range(sym, compiler_min=1, compiler_max=sys.maxsize - 1)
    with mode:
        return torch.empty((env.create_symintnode(sym, hint=hint, source=source), 0), device=device)


def del_attr_path(root: torch.nn.Module, dotted: str) -> None:
    *path, leaf = dotted.split(".")
    mod = root
    for p in path:
        mod = getattr(mod, p)
    delattr(mod, leaf)


def set_attr_path(root: torch.nn.Module, dotted: str, value: torch.Tensor | torch.nn.Module) -> None:
    """``root.<dotted> = value``: a parameter, a buffer, or a submodule (a higher-order op's body)."""
    *path, leaf = dotted.split(".")
    mod = root
    for p in path:
        if not hasattr(mod, p):
            mod.add_module(p, torch.nn.Module())
        mod = getattr(mod, p)
    if isinstance(value, torch.nn.Parameter):
        mod.register_parameter(leaf, value)
    elif isinstance(value, torch.nn.Module):
        mod.add_module(leaf, value)
    else:
        mod.register_buffer(leaf, value)


def drop_unused_attrs(gm: fx.GraphModule) -> None:
    """Erase the get_attr nodes nobody reads and delete the parameters and buffers no get_attr reads
    (nor a get_attr of a module holding them), so that a program holds, and moves to a device, only
    the weights it uses."""
    for n in list(gm.graph.nodes):
        if n.op == "get_attr" and not n.users:
            gm.graph.erase_node(n)
    used = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for name, _ in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        if name not in used and not any(name.startswith(u + ".") for u in used):
            del_attr_path(gm, name)


def get_attr_path(root: torch.nn.Module, dotted: str) -> torch.Tensor:
    obj: object = root
    for p in dotted.split("."):
        obj = getattr(obj, p)
    return obj  # type: ignore[return-value]


# --- layers --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    """One layer's nodes (``afd.role`` layer index), in graph order: the one grouping every pass
    uses. The FFN region is the members of role FFN; its output is the last FFN node read
    outside the region (the value added back into the residual stream)."""

    index: int
    members: tuple[fx.Node, ...]

    @property
    def ffn(self) -> list[fx.Node]:
        return [n for n in self.members if n.meta[META_KEY].role is Role.FFN]

    @property
    def ffn_output(self) -> fx.Node | None:
        return region_output(self.ffn)

    @property
    def attention_ops(self) -> list[fx.Node]:
        return [n for n in self.members if n.meta[META_KEY].role is Role.ATTENTION and is_attention_op(n)]

    @property
    def output_projections(self) -> list[fx.Node]:
        """The attention output projection(s): weight-reading linears of attention role (not a
        router) downstream of where q, k and v have all arrived (:func:`attention_output`) and
        not of the FFN region's output (Gemma-4's per-layer-input gate and projection after the
        MLP read the residual, not attention's partial sum); one in every supported layer (o_proj).
        A layer whose token mixer is not attention: its last such projection before the FFN region
        (the mixer's out_proj). Empty with two attention ops or more."""
        attn = self.attention_ops
        if not attn:
            ffn = set(self.ffn)
            end = next((i for i, n in enumerate(self.members) if n in ffn), len(self.members))
            return [n for n in self.members[:end] if n.target in LINEAR_OPS and reads_weight(n)
                    and n.meta[META_KEY].role is Role.ATTENTION and not n.meta[META_KEY].router][-1:]
        if len(attn) != 1:
            return []
        members = set(self.members)
        after = descendants(attention_output(attn[0]), members)
        out = self.ffn_output
        if out is not None:
            after -= descendants(out, members)
        return [n for n in self.members if n in after and n.target in LINEAR_OPS and reads_weight(n)
                and n.meta[META_KEY].role is Role.ATTENTION and not n.meta[META_KEY].router]

    @property
    def output_projection(self) -> fx.Node | None:
        rows = self.output_projections
        return rows[0] if rows else None


def region_output(region: list[fx.Node]) -> fx.Node | None:
    """The last node of ``region`` (graph order) that something outside the region reads."""
    inside = set(region)
    return next((n for n in reversed(region) if any(u not in inside for u in n.users)), None)


def layers_of(gm: fx.GraphModule) -> dict[int, Layer]:
    """Every layer of an ``afd.role``-annotated graph, by index (ascending). Nodes outside any
    layer (embedding, final norm, head) and nodes without a role belong to none."""
    by_layer: dict[int, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        r = n.meta.get(META_KEY)
        if r is not None and r.layer is not None:
            by_layer.setdefault(r.layer, []).append(n)
    return {i: Layer(i, tuple(by_layer[i])) for i in sorted(by_layer)}


def reads_weight(n: fx.Node) -> bool:
    """A projection: one operand is a 2-D graph attribute (directly or transposed)."""
    for a in n.args[:3]:
        while isinstance(a, fx.Node) and a.target in (aten.t.default, aten.numpy_T.default, aten.transpose.int,
                                                      aten.permute.default):
            a = a.args[0]
        if isinstance(a, fx.Node) and a.op == "get_attr" and isinstance(a.meta.get("val"),
                                                                        torch.Tensor) and a.meta["val"].dim() in (0, 2):
            return True
    return False


def attention_output(attn: fx.Node) -> fx.Node:
    """The node where attention's inputs (q, k and v) have all arrived: SDPA itself, or for an
    explicit ``softmax(q @ k^T) @ v`` the first matmul after the softmax (within a few ops)."""
    if attn.target in SDPA_OPS:
        return attn
    frontier = list(attn.users)
    for _ in range(6):
        hit = next((n for n in frontier if n.target in MATMUL_OPS), None)
        if hit is not None:
            return hit
        frontier = [u for n in frontier for u in n.users]
    return attn


def attention_inputs(attn: fx.Node) -> list[fx.Node]:
    """What an attention op's q, k and v are (not its mask: an indexer of sparse attention computes
    one from projections of its own): SDPA's first three arguments; for an explicit ``softmax(q @
    k^T + mask) @ v``, the inputs of the scores' matmul (the one shaped as the softmax's input but
    for its keys, back through the scale, the mask add, casts and joined sinks) and the value side
    of the output's. Falls back to :func:`attention_output` where the scores' matmul is not found."""
    if attn.target in SDPA_OPS:
        return [a for a in attn.args[:3] if isinstance(a, fx.Node)]
    out = attention_output(attn)
    shape = attn.args[0].meta.get("val").shape if isinstance(attn.args[0], fx.Node) and isinstance(
        attn.args[0].meta.get("val"), torch.Tensor) else None
    frontier, scores = [attn.args[0]], None
    for _ in range(6):
        scores = next((n for n in frontier if n.target in MATMUL_OPS and shape is not None and isinstance(
            n.meta.get("val"), torch.Tensor) and n.meta["val"].shape[:-1] == shape[:-1]), None)
        if scores is not None:
            break
        frontier = [a for n in frontier for a in n.all_input_nodes]
    if scores is None or out is attn:
        return [out]
    probs = descendants(attn)
    return [*scores.all_input_nodes, *(a for a in out.all_input_nodes if a not in probs)]


def writes_first_arg(n: fx.Node) -> bool:
    """The op updates its first argument in place (its schema says so: ``index_copy_``, ``add_``)."""
    schema = getattr(n.target, "_schema", None)
    args = schema.arguments if schema is not None else []
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def aliases_first_arg(n: fx.Node) -> bool:
    """The op returns (a view or alias of) its first argument (its schema says so)."""
    schema = getattr(n.target, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None


def drop_dead_writes(graph: fx.Graph) -> list[str]:
    """Erase in-place updates nothing reads of temporaries nothing else reads, then the pure nodes
    that only fed them; returns the erased names. What a rewrite leaves behind: transformers
    5.17's grouped-MM experts ``clamp_`` the sorted expert ids in place, and once the experts are
    one op, ``sort -> getitem -> clamp_`` reads nothing onward, yet an in-place op is impure to
    ``eliminate_dead_code``. A write into an input or an attribute (state), or through a view of
    one, or into a tensor another node reads, is kept.

    Before::

        sort = aten.sort(ids); getitem = sort[1]; clamp_ = aten.clamp_(getitem, None, 3)   # no users

    After: nothing (the three nodes erased)."""
    import operator

    def storage_root(n: fx.Node) -> fx.Node | None:
        """The node whose storage ``n`` is, along single-reader aliases; None when another node
        reads it on the way (the write would be seen)."""
        while n.op == "call_function":
            src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            if n.target is operator.getitem and src is not None:
                if not (src.op == "call_function" and aliases_first_arg(src)):
                    return src  # an output of a multi-output op that makes new tensors (sort)
                n = src.args[0]
            elif src is not None and (aliases_first_arg(n) or writes_first_arg(n)):
                n = src
            else:
                return n
            if len(n.users) > 1:
                return None
        return n

    erased: list[str] = []
    for n in reversed(list(graph.nodes)):
        if n.op != "call_function" or n.users or not writes_first_arg(n) or not isinstance(n.args[0], fx.Node):
            continue
        target = n.args[0]
        if len(target.users) != 1:
            continue
        root = storage_root(target)
        if root is None or root.op in ("placeholder", "get_attr"):
            continue
        feeds = [a for a in n.all_input_nodes]
        erased.append(n.name)
        graph.erase_node(n)
        while feeds:  # the pure nodes that only fed it
            a = feeds.pop()
            for u in [u for u in a.users if u.target is operator.getitem and not u.users]:  # (sort's other output)
                erased.append(u.name)
                graph.erase_node(u)
            if a.users or a.op != "call_function" or a.is_impure():
                continue
            feeds.extend(a.all_input_nodes)
            erased.append(a.name)
            graph.erase_node(a)
    return erased


def written_attrs(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """The attributes (buffers) ``gm`` updates in place, directly or through a view or alias
    (a KV cache and its write position: ``key_cache_0.index_copy_(2, pos, k)``), with the
    nodes that write them, in graph order. Empty for a program without state."""
    out: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or not n.args or not writes_first_arg(n):
            continue
        base = n.args[0]
        while isinstance(base, fx.Node) and base.op == "call_function" and base.args and aliases_first_arg(base):
            base = base.args[0]
        if isinstance(base, fx.Node) and base.op == "get_attr":
            out.setdefault(str(base.target), []).append(n)
    return out


def cache_length(gm: fx.GraphModule) -> int | None:
    """Positions a KV cache of ``gm`` holds: the size along which ``index_copy_`` writes into a
    written attribute (the smallest, over all of them); None when it writes none that way."""
    sizes = []
    for name, writers in written_attrs(gm).items():
        t = get_attr_path(gm, name)
        for w in writers:
            if w.target == torch.ops.aten.index_copy_.default and w.args[0].op == "get_attr":
                sizes.append(int(t.shape[w.args[1]]))
    return min(sizes) if sizes else None


def state_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the buffers ``gm`` updates in place (its KV cache and write positions)."""
    return sum(get_attr_path(gm, name).numel() * get_attr_path(gm, name).element_size() for name in written_attrs(gm))


def batch_symbol_dims(gm: fx.GraphModule) -> tuple[object | None, list[tuple[int, int]]]:
    """The symbol of the first input's dim 0 and every (input, dim) carrying it."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("val") for n in placeholders]
    if not vals or not isinstance(vals[0], torch.Tensor) or vals[0].dim() == 0:
        return None, []
    sym = vals[0].shape[0]
    if not isinstance(sym, torch.SymInt) or sym.node.expr.is_number:  # static (or a symbol specialised)
        return None, []
    key = str(sym.node.expr)
    dims = [
        (i, d)
        for i, v in enumerate(vals)
        if isinstance(v, torch.Tensor)
        for d, s in enumerate(v.shape)
        if isinstance(s, torch.SymInt) and str(s.node.expr) == key
    ]
    return key, dims


def fake_propagate(gm: fx.GraphModule, mode: Any, inputs: Sequence[Any]) -> None:
    """``meta['val']`` of every node of ``gm``: a FakeTensorProp under ``mode`` from ``inputs``
    (fake or symbolic, used as they are), with the Python dispatcher on, as ``torch.export``
    traces. Without it a composite op runs its C++ kernel: torch 2.11's ``aten.linear`` of a
    parameter then reads a symbolic token count as an int, and the count becomes the constant
    of its hint (the program would hold one batch size)."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    with enable_python_dispatcher():
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)


def propagate_meta(gm: fx.GraphModule) -> None:
    """``meta['val']`` of every node again, from the placeholders' (symbolic) values."""
    from torch._guards import detect_fake_mode

    inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode(inputs)
    allow, mode.allow_non_fake_inputs = mode.allow_non_fake_inputs, True
    try:
        fake_propagate(gm, mode, inputs)
    finally:
        mode.allow_non_fake_inputs = allow


def propagate_meta_fresh(gm: fx.GraphModule, hint: int = 16) -> None:
    """:func:`propagate_meta` with each symbolic input size a fresh symbol of a fresh shape env,
    hinted ``hint``. A rank's share of a group's tokens, ``s // 2``, traced at the export's
    example (``s = 3``) is 1, and a size of 1 broadcasts: the trace would specialise the share to
    the constant 1 and the program would hold it for every batch. Dims that are expressions of
    symbols keep the expression, in the new symbols."""
    import sympy
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    fresh: dict[sympy.Symbol, sympy.Symbol] = {}

    def size(d: object) -> object:
        if not isinstance(d, torch.SymInt):
            return int(d)
        expr = d.node.expr
        for sym in sorted(expr.free_symbols, key=str):
            if sym not in fresh:
                fresh[sym] = shape_env.create_symbol(
                    hint, source=ConstantSource(f"afd_{sym}"), dynamic_dim=DimDynamic.DYNAMIC
                )
        new = expr.xreplace(fresh)
        return shape_env.create_symintnode(new, hint=int(new.xreplace({v: hint for v in fresh.values()})))

    inputs = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        val = n.meta["val"]
        if isinstance(val, torch.Tensor):
            with mode:
                inputs.append(torch.empty([size(d) for d in val.shape], dtype=val.dtype, device=val.device))
        else:
            inputs.append(size(val) if isinstance(val, torch.SymInt) else val)
    fake_propagate(gm, mode, inputs)
