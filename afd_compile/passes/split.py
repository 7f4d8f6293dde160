"""Cut every layer at the attention/FFN boundary: plan first, then build the two programs.

:func:`plan_split` reads ``afd.role`` and returns one printable :class:`LayerCut` per layer (what
crosses the wire, which nodes and weights go to the FFN program). :func:`build_attention_program`
and :func:`build_ffn_program` apply it. Neither mutates the input graph.

Attention program, one layer, before / after::

    mul_14 = post_attention_layernorm(add_6)          mul_14 = post_attention_layernorm(add_6)
    linear_4 = linear(mul_14, gate_proj)               view_afd = view(mul_14, [-1, 64])
    ...                                           ->   send_afd = afd.p2p_send([view_afd], 0, L0, S0, spec)
    linear_6 = linear(mul_15, down_proj)               n_afd = sym_size(view_afd, 0)
    add_8 = add(to_8, linear_6)                        recv_afd = afd.p2p_recv(send_afd, 0, L0, S0, n_afd, spec)
                                                       out_afd = view(recv_afd[0], [s0, s1, 64])
                                                       add_8 = add(to_8, out_afd)

FFN program (all layers, in order; ``token_slots`` is a ``(T, 0)`` carrier of the step's total
token count, so one program serves every token layout)::

    T = sym_size(token_slots, 0)
    recv = afd.p2p_recv_group(token_slots, 0, L0, S0, T, spec)  # concat of all peers
    x = view(recv[0], [1, T, 64]) ; <the layer's MLP nodes> ; y = view(mlp_out, [T, 64])
    tok = afd.p2p_send_group([y], 0, L0, S0, spec)              # split back by seq_lens
    recv = afd.p2p_recv_group(tok, 0, L1, S0, T, spec) ...
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from .. import meta_keys
from .. import ops as afd_ops  # noqa: F401  (registers torch.ops.afd)
from ..errors import SplitError
from ..wire import WireSpec, WireTensor
from .graph_utils import (
    Builder,
    copy_graph_module,
    drop_unused_attrs,
    fake_propagate,
    get_attr_path,
    layers_of,
    set_attr_path,
    shape_args,
    symbol_sources,
)
from .roles import NodeRole, Role, role_of
from .symbolic import TokenBinding, emit_expr, sym_expr

aten = torch.ops.aten


@dataclass(frozen=True)
class LayerCut:
    """The plan for one layer: the values that cross, in wire order, and what the FFN owns."""

    layer: int
    hidden: str
    router_logits: str | None
    token_ids: str | None
    output: str
    ffn_nodes: tuple[str, ...]
    params: tuple[str, ...]
    wire_in: WireSpec
    wire_out: WireSpec
    token_dims: tuple[str, ...]
    #: other views (or casts) of the hidden state the FFN region reads, rebuilt from the received
    #: one on the FFN side (a router moved to the attention side reads a flat view of the same rows)
    hidden_views: tuple[str, ...] = ()

    def __str__(self) -> str:
        return (
            f"layer {self.layer}: {len(self.ffn_nodes)} FFN nodes, {len(self.params)} weights; "
            f"in {self.hidden}{' +' + self.router_logits if self.router_logits else ''}"
            f"{' +' + self.token_ids if self.token_ids else ''} -> out {self.output}; "
            f"wire {self.wire_in} / {self.wire_out}"
        )

    def to_json(self) -> dict:
        return {
            "layer": self.layer,
            "ffn_nodes": list(self.ffn_nodes),
            "attention_side": {"hidden": self.hidden, "router_logits": self.router_logits,
                               "token_ids": self.token_ids, "ffn_output": self.output,
                               **({"hidden_views": list(self.hidden_views)} if self.hidden_views else {})},
            "params": list(self.params),
            "wire": {
                "to_ffn": [{"kind": w.kind, "dtype": str(w.dtype).removeprefix("torch."),
                            "shape": ["tokens"] + ([] if w.width is None else [w.width]),
                            "bytes_per_token": w.bytes_per_token} for w in self.wire_in.tensors],
                "to_attention": [{"kind": w.kind, "dtype": str(w.dtype).removeprefix("torch."),
                                  "shape": ["tokens"] + ([] if w.width is None else [w.width]),
                                  "bytes_per_token": w.bytes_per_token} for w in self.wire_out.tensors],
            },
        }


@dataclass(frozen=True)
class SplitPlan:
    graph_name: str
    comm_id: int
    stage: int
    cuts: tuple[LayerCut, ...]
    static_tokens: int | None = None  # token count of a graph exported with static shapes

    def __str__(self) -> str:
        head = f"split plan for {self.graph_name} (comm {self.comm_id}, stage {self.stage})"
        return "\n".join([head] + [f"  {c}" for c in self.cuts])

    def to_json(self) -> dict:
        return {"graph": self.graph_name, "comm_id": self.comm_id, "stage": self.stage,
                "static_tokens": self.static_tokens, "layers": [c.to_json() for c in self.cuts]}


@dataclass
class SplitResult:
    attention: fx.GraphModule
    ffn: fx.GraphModule
    plan: SplitPlan
    timings: dict[str, float] = field(default_factory=dict)
    moe: tuple = ()  # the MoE blocks recognition found (passes/moe MoERecord), recognised or not


def _val(node: object) -> object:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _is_symint_node(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), torch.SymInt) or (
        n.op == "call_function" and n.target in (aten.sym_size.int, operator.mul, operator.add, operator.floordiv)
        and not isinstance(n.meta.get("val"), torch.Tensor)
    )


def plan_split(gm: fx.GraphModule, *, comm_id: int = 0, stage: int = 0, graph_name: str = "graph",
               attention_only: bool = False) -> SplitPlan:
    """One :class:`LayerCut` per layer with an FFN region. Needs ``afd.role`` on every node.
    ``attention_only``: the plan builds only an attention program, so the token dims need not map
    onto a flat count (an attention-TP rank's slice of its group's tokens, ``(b*s + 1) // 2``), as
    long as the FFN region reads no size."""
    ffn_by_layer = {i: layer.ffn for i, layer in layers_of(gm).items() if layer.ffn}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    cuts = []
    static_tokens: int | None = None
    for layer in sorted(ffn_by_layer):
        cut, static = _cut_layer(layer, ffn_by_layer[layer], placeholders, f"{graph_name}: layer {layer}",
                                 attention_only)
        static_tokens = static if static is not None else static_tokens
        cuts.append(cut)
    if not cuts:
        raise SplitError(f"{graph_name}: no layer has an FFN region to cut")
    return SplitPlan(graph_name, comm_id, stage, tuple(cuts), static_tokens)


def _crossing(ffn: list[fx.Node], placeholders: list[fx.Node], where: str) -> tuple[list[fx.Node], ...]:
    """What the FFN region reads from outside it: ``(params, sizes, router logits, token ids,
    [the hidden state])``; refused unless exactly one hidden-state tensor crosses."""
    members = set(ffn)
    externals: list[fx.Node] = []
    for n in ffn:
        for a in n.all_input_nodes:
            if a not in members and a not in externals:
                externals.append(a)
    params = [a for a in externals if a.op == "get_attr"]
    syms = [a for a in externals if a.op != "get_attr" and _is_symint_node(a)]
    tensors = [a for a in externals if a not in params and a not in syms]
    router = [a for a in tensors if role_of(a).router]
    ids = [a for a in tensors if a in placeholders and isinstance(_val(a), torch.Tensor)
           and not _val(a).is_floating_point()]
    hidden = [a for a in tensors if a not in router and a not in ids]
    base = _one_hidden(hidden)
    if base is None:
        raise SplitError(
            f"{where}: the FFN region must read exactly one hidden-state tensor from the attention "
            f"side (or views and casts of one), it reads {[a.name for a in hidden]} (FFN nodes start at "
            f"{ffn[0].name}); only hidden states, router logits and token ids may cross"
        )
    if not isinstance(_val(base), torch.Tensor) or _val(base).dim() < 1:
        raise SplitError(f"{where}: FFN input {base.name} has no tensor metadata (meta['val'])")
    return params, syms, router, ids, [base], [a for a in hidden if a is not base]


#: ops that keep a tensor's rows in order (views, copies, dtype casts): what the FFN side can
#: rebuild from the received hidden state as a view of it, then a cast
_SAME_ROWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
              aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.alias.default,
              aten.contiguous.default, aten.clone.default, aten.to.dtype, aten._to_copy.default}


def _one_hidden(hidden: list[fx.Node]) -> fx.Node | None:
    """The one hidden state the FFN region reads: ``hidden``'s only tensor, or the one every other
    is made from by :data:`_SAME_ROWS` ops with the same width and as many rows (a router on the
    attention side reading ``view(h, [T, H])`` beside experts reading ``h``); None if there is none."""
    def made_from(v: fx.Node, base: fx.Node) -> bool:
        n = v
        while n is not base:
            if (n.op != "call_function" or n.target not in _SAME_ROWS or not n.args
                    or not isinstance(n.args[0], fx.Node)):
                return False
            if n.target == aten._to_copy.default and set(n.kwargs) - {"dtype"}:
                return False  # (a device or layout change is not a cast)
            n = n.args[0]
        bv, vv = _val(base), _val(v)
        return (isinstance(vv, torch.Tensor) and isinstance(bv, torch.Tensor) and vv.dim() >= 1
                and vv.shape[-1] == bv.shape[-1] and sympy_prod(list(vv.shape)) == sympy_prod(list(bv.shape)))

    for cand in hidden:
        if all(v is cand or made_from(v, cand) for v in hidden):
            return cand
    return None


def _ffn_output(ffn: list[fx.Node], layer: int, h: fx.Node, where: str) -> fx.Node:
    """The one FFN node the attention side reads, as many tokens of the hidden width as ``h``."""
    hval = _val(h)
    outs = [n for n in ffn if any(role_of(u) != NodeRole(layer, Role.FFN) for u in n.users)]
    if len(outs) != 1:
        raise SplitError(
            f"{where}: the FFN region must have exactly one output used by the attention side, "
            f"found {[o.name for o in outs]}"
        )
    oval = _val(outs[0])
    if (not isinstance(oval, torch.Tensor) or oval.shape[-1] != hval.shape[-1]
            or sympy_prod(list(oval.shape)) != sympy_prod(list(hval.shape))):
        raise SplitError(
            f"{where}: FFN output {outs[0].name} has shape {getattr(oval, 'shape', None)}, expected as "
            f"many tokens of width {hval.shape[-1]} as the FFN input {h.name} {tuple(hval.shape)}"
        )
    return outs[0]


def _token_binding(token_dims: list[object], syms: list[fx.Node], where: str,
                   attention_only: bool) -> TokenBinding | None:
    """The flat token count of ``token_dims``; every size the FFN region reads must be a function
    of it (None: an attention-only plan whose FFN region reads no size)."""
    try:
        binding: TokenBinding | None = TokenBinding.for_token_dims(token_dims, where)
    except ValueError:
        if not attention_only or syms:
            raise
        binding = None
    for s in syms:
        e = sym_expr(_val(s))
        if binding is None or not binding.known(e):
            raise SplitError(
                f"{where}: FFN node uses size {s.name} = {e}, which is not a function of the token "
                f"dims {[str(sym_expr(d)) for d in token_dims]}"
            )
    return binding


def _wire_in(h: fx.Node, router: list[fx.Node], ids: list[fx.Node], token_dims: list[object],
             where: str) -> WireSpec:
    """Hidden state, then the optional router logits and token ids, each token-aligned."""
    hval = _val(h)
    wire_in = [WireTensor("hidden", hval.dtype, int(hval.shape[-1]))]
    if router:
        rv = _val(router[0])
        if rv.dim() < 1 or sym_expr(rv.numel()) / sym_expr(rv.shape[-1]) != sympy_prod(token_dims):
            raise SplitError(f"{where}: router logits {router[0].name} {tuple(rv.shape)} are not token-aligned")
        wire_in.append(WireTensor("router_logits", rv.dtype, int(rv.shape[-1])))
    if ids:
        iv = _val(ids[0])
        if sympy_prod(list(iv.shape)) != sympy_prod(token_dims):
            raise SplitError(f"{where}: token ids {ids[0].name} {tuple(iv.shape)} are not token-aligned")
        wire_in.append(WireTensor("token_ids", torch.int32, None))
    return WireSpec(tuple(wire_in))


def _cut_layer(layer: int, ffn: list[fx.Node], placeholders: list[fx.Node], where: str,
               attention_only: bool) -> tuple[LayerCut, int | None]:
    """The cut of one layer and, when its tokens are static, their count."""
    params, syms, router, ids, (h,), views = _crossing(ffn, placeholders, where)
    out = _ffn_output(ffn, layer, h, where)
    hval, oval = _val(h), _val(out)
    token_dims = list(hval.shape[:-1])
    binding = _token_binding(token_dims, syms, where, attention_only)
    cut = LayerCut(
        layer=layer,
        hidden=h.name,
        router_logits=router[0].name if router else None,
        token_ids=ids[0].name if ids else None,
        output=out.name,
        ffn_nodes=tuple(n.name for n in ffn),
        params=tuple(str(p.target) for p in params),
        wire_in=_wire_in(h, router, ids, token_dims, where),
        wire_out=WireSpec((WireTensor("ffn_out", oval.dtype, int(hval.shape[-1])),)),
        token_dims=tuple(str(sym_expr(d)) for d in token_dims),
        hidden_views=tuple(v.name for v in views),
    )
    return cut, (binding.coeff if binding is not None and binding.sigma is None else None)


def sympy_prod(dims: list[object]) -> object:
    import sympy

    return sympy.expand(sympy.Mul(*[sym_expr(d) for d in dims]))


# --- building the programs ---------------------------------------------------------------------


def build_attention_program(gm: fx.GraphModule, plan: SplitPlan) -> fx.GraphModule:
    """The original graph with every FFN region replaced by send -> recv; FFN weights dropped."""
    new, env = copy_graph_module(gm)
    by_name = {n.name: n for n in new.graph.nodes}
    fake_mode = detect_fake_mode([n.meta.get("val") for n in new.graph.nodes if "val" in n.meta])
    sources = symbol_sources(new.graph)
    for cut in plan.cuts:
        b = Builder(new.graph, fake_mode, cut.layer)
        h, out = by_name[cut.hidden], by_name[cut.output]
        hval = h.meta["val"]
        with new.graph.inserting_before(out):
            wire = [b.call(aten.view.default, (h, [-1, int(hval.shape[-1])]), "afd_hidden")]
            if cut.router_logits:
                r = by_name[cut.router_logits]
                wire.append(b.call(aten.view.default, (r, [-1, int(r.meta["val"].shape[-1])]), "afd_router_logits"))
            if cut.token_ids:
                ids = b.call(aten.reshape.default, (by_name[cut.token_ids], [-1]))
                wire.append(b.call(aten.to.dtype, (ids, torch.int32), "afd_token_ids"))
            send = b.call(torch.ops.afd.p2p_send.default,
                          (wire, plan.comm_id, cut.layer, plan.stage, str(cut.wire_in)), "afd_send")
            flat_tokens = wire[0].meta["val"].shape[0] if fake_mode is not None else None
            n_tok = int(flat_tokens) if isinstance(flat_tokens, int) else b.call(
                aten.sym_size.int, (wire[0], 0), "afd_tokens")
            recv = b.call(torch.ops.afd.p2p_recv.default,
                          (send, plan.comm_id, cut.layer, plan.stage, n_tok, str(cut.wire_out)), "afd_recv")
            got = b.call(operator.getitem, (recv, 0))
            shaped = b.call(aten.view.default, (got, shape_args(b, tuple(out.meta["val"].shape), sources)),
                            "afd_ffn_out")
        out.replace_all_uses_with(shaped)
        doomed = [by_name[name] for name in cut.ffn_nodes]
        for n in reversed(doomed):
            if n.users:
                raise SplitError(
                    f"layer {cut.layer}: FFN node {n.name} is still used by {[u.name for u in n.users]} "
                    "after the cut"
                )
            new.graph.erase_node(n)
    drop_unused_attrs(new)
    new.graph.lint()
    new.recompile()
    return new


def build_ffn_program(gm: fx.GraphModule, plan: SplitPlan) -> fx.GraphModule:
    """All FFN regions, in layer order, between a group receive and a group send.

    Input: ``token_slots``, a ``(T, 0)`` tensor whose length is the step's total token count over
    this rank's attention peers. Output: the last send's token.
    """
    src = {n.name: n for n in gm.graph.nodes}
    graph = fx.Graph()
    root = torch.nn.Module()
    copied: set[str] = set()  # weight targets already copied into root
    slots = graph.placeholder("token_slots")
    total = graph.call_function(aten.sym_size.int, (slots, 0))
    total._rename("total_tokens")
    dep: fx.Node = slots
    for cut in plan.cuts:
        where = f"{plan.graph_name}: layer {cut.layer}"
        h = src[cut.hidden]
        hval = h.meta["val"]
        binding = TokenBinding.for_token_dims(list(hval.shape[:-1]), where)
        recv = graph.call_function(torch.ops.afd.p2p_recv_group.default,
                                   (dep, plan.comm_id, cut.layer, plan.stage, total, str(cut.wire_in)))
        recv._rename(f"afd_recv_L{cut.layer}")
        sigma_node = graph.call_function(operator.floordiv, (total, binding.coeff)) if binding.coeff != 1 else total

        def sizes(shape: tuple, _b: TokenBinding = binding, _s: object = sigma_node) -> list:
            return [emit_expr(graph, _b.substitute(sym_expr(d)), _b.sigma, _s) for d in shape]

        env: dict[fx.Node, object] = {}
        got_h = graph.call_function(operator.getitem, (recv, 0))
        env[h] = graph.call_function(aten.view.default, (got_h, sizes(tuple(hval.shape))))
        env.update(_rebuilt_views(graph, [src[name] for name in cut.hidden_views], got_h, sizes, hval.dtype))
        idx = 1
        if cut.router_logits:
            r = src[cut.router_logits]
            got = graph.call_function(operator.getitem, (recv, idx))
            env[r] = graph.call_function(aten.view.default, (got, sizes(tuple(r.meta["val"].shape))))
            idx += 1
        if cut.token_ids:
            t = src[cut.token_ids]
            got = graph.call_function(operator.getitem, (recv, idx))
            shaped = graph.call_function(aten.view.default, (got, sizes(tuple(t.meta["val"].shape))))
            env[t] = graph.call_function(aten.to.dtype, (shaped, t.meta["val"].dtype))
        members = [src[name] for name in cut.ffn_nodes]
        member_set = set(members)

        def lookup(a: fx.Node, _env: dict = env, _members: set = member_set, _where: str = where) -> object:
            if a in _env:
                return _env[a]
            if a.op == "get_attr":
                if a.target not in copied:
                    set_attr_path(root, a.target, get_attr_path(gm, a.target))
                    copied.add(a.target)
                _env[a] = graph.get_attr(a.target)
                return _env[a]
            val = a.meta.get("val")
            if isinstance(val, torch.SymInt):
                _env[a] = sizes((val,))[0]
                return _env[a]
            raise SplitError(f"{_where}: FFN node reads {a.name}, which is neither on the wire nor a weight")

        for n in members:  # (a get_attr member: the submodule a higher-order op calls, as torch.autocast's)
            env[n] = new_node = lookup(n) if n.op == "get_attr" else graph.node_copy(n, lookup)
            new_node.meta.pop("val", None)  # stale: its sizes are in the original graph's symbols
            new_node.meta.pop("unbacked_bindings", None)  # (data-dependent sizes: an expert's tokens)
        y = graph.call_function(aten.view.default, (env[src[cut.output]], [total, int(hval.shape[-1])]))
        dep = graph.call_function(torch.ops.afd.p2p_send_group.default,
                                  ([y], plan.comm_id, cut.layer, plan.stage, str(cut.wire_out)))
        dep._rename(f"afd_send_L{cut.layer}")
    graph.output(dep)
    ffn = fx.GraphModule(root, graph, class_name="AFDFFNProgram")
    ffn.graph.lint()
    multiple = 1  # the token count is a multiple of each layer's static token factor (a static sequence length)
    for cut in plan.cuts:
        c = TokenBinding.for_token_dims(list(src[cut.hidden].meta["val"].shape[:-1]), plan.graph_name).coeff
        multiple = multiple * c // math.gcd(multiple, c)
    ffn.meta[TOKEN_MULTIPLE] = multiple
    propagate_ffn_meta(ffn, plan.static_tokens, multiple)
    return ffn


def _rebuilt_views(graph: fx.Graph, views: list[fx.Node], got: fx.Node, sizes: Callable[[tuple], list],
                   dtype: torch.dtype) -> dict[fx.Node, fx.Node]:
    """The hidden state's other views the FFN region reads (``LayerCut.hidden_views``), rebuilt
    from the received rows: a view to each one's shape, then its dtype."""
    out = {}
    for v in views:
        out[v] = graph.call_function(aten.view.default, (got, sizes(tuple(v.meta["val"].shape))))
        if v.meta["val"].dtype != dtype:
            out[v] = graph.call_function(aten.to.dtype, (out[v], v.meta["val"].dtype))
    return out


#: ffn.meta key: what every token count of the FFN program is a multiple of (a static batch B: the
#: program views its tokens as [B, T // B, H])
TOKEN_MULTIPLE = meta_keys.TOKEN_MULTIPLE


def propagate_ffn_meta(ffn: fx.GraphModule, static_tokens: int | None = None, multiple: int | None = None) -> None:
    """``meta['val']`` on every FFN program node, with a symbolic token count (or the fixed
    count of a graph exported with static shapes) per ``(T, 0)`` input (an FFN TP group's
    program has two: its own tokens and the group's), each a ``multiple`` of the program's token
    factor (default: the one :func:`build_ffn_program` recorded, ``ffn.meta[TOKEN_MULTIPLE]``)."""
    multiple = ffn.meta.get(TOKEN_MULTIPLE, 1) if multiple is None else multiple
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    device = next((t.device for t in [*ffn.parameters(), *ffn.buffers()]), torch.device("cpu"))
    inputs = []
    for i, ph in enumerate(n for n in ffn.graph.nodes if n.op == "placeholder"):
        if static_tokens is not None:
            tokens: object = static_tokens
        else:  # a fresh symbol for the token count, made directly so no version specialises it
            source = ConstantSource(ph.name)
            sym = shape_env.create_symbol(8 * (i + 1), source=source, dynamic_dim=DimDynamic.DYNAMIC,
                                          do_not_specialize_zero_one=True)  # (a step of 1 row: the same program)
            shape_env.constrain_symbol_range(sym, compiler_min=1, compiler_max=sys.maxsize - 1)
            tokens = shape_env.create_symintnode(sym, hint=8 * (i + 1), source=source) * multiple
        with mode:
            inputs.append(torch.empty((tokens, 0), device=device))
    fake_propagate(ffn, mode, inputs)
