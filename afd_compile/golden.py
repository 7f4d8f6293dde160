"""Normalised graph text for golden tests: one canonical line per node.

``v7 = aten.linear.default(v6, w:model.layers.0.mlp.gate_proj.weight) [s0,s1,128 float32] L0:ffn``

Normalisation keeps goldens stable across torch versions: call results are numbered ``v0, v1,
...`` in graph order, weights are named by their target, symbols are renamed ``s0, s1, ...`` in
order of first appearance, and version-specific bookkeeping nodes (``_assert_tensor_metadata``,
the export guard module) are dropped. Never ``gm.code``: its formatting changes between versions.
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx

from . import meta_keys
from . import ops as afd_ops  # noqa: F401  (registers torch.ops.afd)
from .passes.roles import META_KEY

_SKIP_TARGETS = {"_assert_tensor_metadata", "_guards_fn"}


def _skip(n: fx.Node) -> bool:
    if n.op == "call_module" and "guards" in str(n.target):
        return True
    return n.op == "call_function" and any(s in str(n.target) for s in _SKIP_TARGETS)


def _target(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._opname}.{t._overloadname}"
    if callable(t):
        mod = getattr(t, "__module__", "") or ""
        return f"{'operator' if mod in ('_operator', 'operator') else mod}.{t.__name__}"
    return str(t)


def _weight_name(target: str) -> str:
    return re.sub(r"^(m|model)\.", "", target, count=1) if target.startswith(("m.model.", "model.model.")) else target


def graph_lines(gm: fx.GraphModule, shapes: bool = True) -> list[str]:
    names: dict[fx.Node, str] = {}
    symbols: dict[str, str] = {}

    def sym(text: str) -> str:
        def sub(m: re.Match) -> str:
            return symbols.setdefault(m.group(0), f"s{len(symbols)}")

        return re.sub(r"\b[su]\d+\b", sub, text)

    def fmt_val(v: object) -> str:
        if not shapes:
            return ""
        if isinstance(v, torch.Tensor):
            dtype = str(v.dtype).removeprefix("torch.")
            return f"[{','.join(sym(str(s)) for s in v.shape)} {dtype}]"
        if isinstance(v, (list, tuple)):
            return "(" + ", ".join(fmt_val(x) for x in v) + ")"
        if isinstance(v, torch.SymInt):
            return f"[{sym(str(v))}]"
        return ""

    def fmt_arg(a: object) -> str:
        if isinstance(a, fx.Node):
            return names.get(a, "?" + a.name)
        if isinstance(a, (list, tuple)):
            inner = ", ".join(fmt_arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner})"
        if isinstance(a, torch.dtype):
            return str(a).removeprefix("torch.")
        if isinstance(a, float):
            return repr(a)
        return str(a)

    lines = []
    count = 0
    for n in gm.graph.nodes:
        if _skip(n):
            continue
        if n.op == "placeholder":
            names[n] = n.name
            lines.append(f"{n.name} = input {fmt_val(n.meta.get('val'))}".rstrip())
            continue
        if n.op == "get_attr":
            names[n] = f"w:{_weight_name(str(n.target))}"
            continue
        if n.op == "output":
            lines.append(f"return {fmt_arg(n.args[0])}")
            continue
        names[n] = f"v{count}"
        count += 1
        args = [fmt_arg(a) for a in n.args] + [f"{k}={fmt_arg(v)}" for k, v in n.kwargs.items()
                                                if k not in ("pin_memory",)]
        role = n.meta.get(META_KEY)
        tail = f" {role}" if role is not None else ""
        lines.append(f"{names[n]} = {_target(n)}({', '.join(args)}) {fmt_val(n.meta.get('val'))}".rstrip() + tail)
    return lines


_AFD_OPS = (torch.ops.afd.p2p_send.default, torch.ops.afd.p2p_recv.default, torch.ops.afd.p2p_send_start.default,
            torch.ops.afd.p2p_recv_start.default, torch.ops.afd.p2p_recv_wait.default)


def graph_text(gm: fx.GraphModule, shapes: bool = True) -> str:
    return "\n".join(graph_lines(gm, shapes)) + "\n"


def cut_window_lines(gm: fx.GraphModule) -> list[str]:
    """The attention program around each cut only: the FFN input, the nodes the split inserted
    (send, recv, reshapes) and the consumers of the restored FFN output. Local names ``a0, a1``;
    a value from outside the window prints as ``<op>``. Robust to changes elsewhere in the model
    graph (e.g. a transformers release that builds the attention mask differently)."""
    out: list[str] = []
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    for send in (
        n for n in nodes if n.target in (torch.ops.afd.p2p_send.default, torch.ops.afd.p2p_send_start.default)
    ):
        stage = send.meta.get(meta_keys.STAGE, 0)  # a staged program: this micro-batch's nodes only

        def ours(n: fx.Node, _stage: int = stage) -> bool:
            return n.meta.get(meta_keys.STAGE, 0) == _stage

        restored = next(n for n in nodes[pos[send] :] if n.name.startswith("afd_ffn_out") and ours(n))
        first = min((a for a in send.args[0][0].all_input_nodes), key=pos.__getitem__)
        window = [first] + [
            n
            for n in nodes[pos[first] + 1 : pos[restored] + 1]
            if ours(n)
            and (
                n.name.startswith("afd_")
                or n.op == "call_function"
                and n.target in (torch.ops.aten.sym_size.int, *_AFD_OPS)
                or (n.target.__module__ in ("_operator", "operator") if callable(n.target) else False)
            )
        ]
        window += sorted(restored.users, key=pos.__getitem__)
        names = {n: f"a{i}" for i, n in enumerate(window)}

        def arg(a: object, _names: dict = names) -> str:
            if isinstance(a, fx.Node):
                return _names.get(a, f"<{_target(a) if a.op == 'call_function' else a.op}>")
            if isinstance(a, (list, tuple)):
                return "[" + ", ".join(arg(x) for x in a) + "]"
            return str(a).removeprefix("torch.")

        layer = send.args[2]
        out.append(f"# cut of layer {layer}" + (f", stage {stage}" if stage else ""))
        for n in window:
            kw = [f"{k}={arg(v)}" for k, v in n.kwargs.items()] if n.target in _AFD_OPS else []
            out.append(f"{names[n]} = {_target(n)}({', '.join([*(arg(a) for a in n.args), *kw])})")
    return out
