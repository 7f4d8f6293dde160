"""A role program with its exchange taken out, for timing it alone on one device (``profile``).

An AFD program exchanges with its peers at every layer; on one GPU there are none. This pass
replaces each receive's tensors: on the attention side by the tensors of the last send before it
(it gets back what it sent); on the FFN side, where no send precedes the first receive, the first
layer's by a new program input of the receive's shape and every later layer's by those same rows
(each layer computes on the rows the attention side sent, not on the previous layer's output: fed
its own output, a random-weight MoE collapsed to top-k experts from its third layer on, 4 of 64
reached against 22-28 in the model). The sends and receives go; the FFN program returns every
layer's output (each is then computed). What is left is each role's compute, in order::

    attention:  h = norm(x + attn(x)); afd_send_L0([h]); y = afd_recv_L0()[0]; x2 = h_res + y ...
            ->  h = norm(x + attn(x)); x2 = h_res + h ...
    FFN:        r0 = afd_recv_L0()[0]; o0 = mlp(r0); afd_send_L0([o0]); r1 = afd_recv_L1()[0]; ...
            ->  r0 = placeholder(afd_loopback_0); o0 = mlp0(r0); o1 = mlp1(r0); ...; return (o0, o1, ...)

The new inputs' sizes follow the program's token count (``profile`` gives each a random tensor of
the rows it runs). Returns the names of the inputs added; records nothing in node.meta.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import ops  # noqa: F401  (registers the afd:: ops)
from ..errors import AFDCompileError

_afd = torch.ops.afd
SENDS = {_afd.p2p_send.default, _afd.p2p_send_group.default}
RECEIVES = {_afd.p2p_recv.default, _afd.p2p_recv_group.default}


class LoopbackError(AFDCompileError):
    """A program whose exchange this pass cannot take out (staged or fused exchange ops)."""


def _matches(sent: fx.Node, got: fx.Node) -> bool:
    a, b = sent.meta.get("val"), got.meta.get("val")
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.dim() == b.dim() and a.shape[1:] == b.shape[1:])


def loopback_exchange(gm: fx.GraphModule, return_first_sent: bool = False) -> list[str]:
    """Take the exchange out of ``gm`` in place (see the module docstring). ``return_first_sent``: the
    program also returns, last, the first tensor its first send carried (an attention program: the
    rows the FFN would have received at layer 0, which ``profile`` feeds the FFN program: an MoE's
    routing then sees the model's own hidden states, not random rows)."""
    graph = gm.graph
    others = [n for n in graph.nodes if n.op == "call_function" and str(n.target).startswith("afd.p2p")
              and n.target not in SENDS | RECEIVES]
    if others:
        raise LoopbackError(f"{others[0].name} ({others[0].target}): profile times unstaged, unfused programs")
    last_sent: list[fx.Node] = []
    every_sent: list[fx.Node] = []
    first_sent: fx.Node | None = None
    added: list[str] = []
    fed: dict[int, fx.Node] = {}  # (the FFN side: the rows its first layer received, by position)
    exchange = [n for n in graph.nodes if n.target in SENDS | RECEIVES]
    ffn_side = bool(exchange) and exchange[0].target in RECEIVES
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for n in list(graph.nodes):
        if n.target in SENDS:
            last_sent = list(n.args[0])
            every_sent += last_sent
            first_sent = first_sent or last_sent[0]
        elif n.target in RECEIVES:
            for user in list(n.users):
                if user.target is not operator.getitem:
                    raise LoopbackError(f"{user.name} reads {n.name} whole; profile takes its tensors one by one")
                i = user.args[1]
                back = fed.get(i) if ffn_side else (last_sent[i] if i < len(last_sent) else None)
                src = back if back is not None and _matches(back, user) else None
                if src is None:
                    with graph.inserting_before(first):
                        src = graph.placeholder(f"afd_loopback_{len(added)}")
                    src.meta["val"] = user.meta["val"]
                    added.append(src.name)
                    fed.setdefault(i, src)
                user.replace_all_uses_with(src)
                graph.erase_node(user)
    out = next(n for n in graph.nodes if n.op == "output")
    returned = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    if any(isinstance(a, fx.Node) and a.target in SENDS for a in returned):  # (the FFN program: what it sent)
        out.args = (tuple(every_sent),)
    elif return_first_sent and first_sent is not None:
        out.args = ((*returned, first_sent),)
        graph._codegen = fx.graph.CodeGen()  # (flat inputs, a tuple out: the export's output structure had one less)
    for n in reversed(list(graph.nodes)):  # (a receive reads the send before it: erased first)
        if n.target in RECEIVES | SENDS:
            graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return added
