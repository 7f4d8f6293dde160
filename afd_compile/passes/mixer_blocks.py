"""Decoders whose layers are single-mixer blocks: which blocks are per-token, and the layers they form.

Most decoders write a layer as a token mixer then an MLP (``layers.N.self_attn``, ``layers.N.mlp``).
Some hybrids write every mixer as a block of its own, ``x + mixer(norm(x))``, whatever it is
(Nemotron-H: ``layers.N.mixer`` is a Mamba, an attention, an MLP or an MoE, in a pattern such as
``M E M * E``). Their FFN regions are the per-token blocks: an MLP (linears of weights and ops on
one token at a time only) or an MoE (a router); every other block mixes tokens. A layer, for the
cut, is the token-mixing blocks up to the next per-token block, whose mixer is its FFN region::

    block   0 Mamba  1 MoE   2 Mamba  3 attention  4 MoE   5 Mamba
    layer   0        0 ffn   1        1            1 ffn   - (after the last FFN: with the head)

Per-token is decided by structure, and conservatively: a block with any other op (a convolution, a
cumulative sum, a matmul of two activations, a reduction across tokens) mixes tokens, and a block
whose linears sit in more than one child module is not one mixer. Such a block stays on the
attention side, where it runs whole and exact.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx as fx

from .module_paths import module_paths
from .op_kinds import ELEMENTWISE_OPS, PASSTHROUGH_OPS, is_attention_op
from .router import find_router

aten = torch.ops.aten

#: linears of a weight: (op, position of the weight)
_WEIGHT_LINEARS = {aten.linear.default: 1, aten.mm.default: 1, aten.addmm.default: 2}
_LAYOUT = frozenset({aten.t.default, aten.transpose.int, aten.permute.default, aten.unsqueeze.default,
                     aten.squeeze.dim, aten.expand.default, aten.flatten.using_ints})
_BOOKKEEPING = frozenset({operator.getitem, aten.sym_size.int, aten._assert_tensor_metadata.default,
                          aten.sym_constrain_range_for_size.default, aten._assert_scalar.default})
#: reductions that are per token when over the last dim only (a norm inside the MLP)
_LAST_DIM_REDUCTIONS = frozenset({aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.var.correction})


def _weight_of(n: fx.Node) -> fx.Node | None:
    """A linear's weight traced back through layout ops to the parameter, or None."""
    pos = _WEIGHT_LINEARS.get(n.target)
    w = n.args[pos] if pos is not None and len(n.args) > pos else None
    while isinstance(w, fx.Node) and w.op == "call_function" and (w.target in _LAYOUT or w.target in PASSTHROUGH_OPS):
        w = w.args[0]
    return w if isinstance(w, fx.Node) and w.op in ("get_attr", "placeholder") else None


def _per_token_op(n: fx.Node) -> bool:
    t = n.target
    if t in _WEIGHT_LINEARS:
        return _weight_of(n) is not None
    if t in PASSTHROUGH_OPS or t in _LAYOUT or t in _BOOKKEEPING or (t in _LAST_DIM_REDUCTIONS and _last_dim(n)):
        return True
    return t in ELEMENTWISE_OPS or (
        callable(t) and getattr(t, "__module__", None) in ("_operator", "operator"))  # (size arithmetic)


def _last_dim(n: fx.Node) -> bool:
    v = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    if not isinstance(v, torch.Tensor) or not isinstance(dims, (list, tuple)) or len(dims) != 1:
        return False
    return dims[0] in (-1, v.dim() - 1)


def per_token_child(path: str, nodes: Iterable[fx.Node]) -> str | None:
    """The child module of block ``path`` (``...layers.N``) that is a per-token MLP or MoE (its
    path), or None when the block mixes tokens (module docstring)."""
    calls = [n for n in nodes if n.op == "call_function"]
    if any(is_attention_op(n) for n in calls):
        return None

    def child(n: fx.Node) -> str | None:
        return next((p[len(path) + 1:].split(".")[0] for p in module_paths(n) if p.startswith(path + ".")), None)

    owners = {child(n) for n in calls if n.target in _WEIGHT_LINEARS and _weight_of(n) is not None}
    if len(owners) != 1 or None in owners:
        return None
    name = owners.pop()
    inside = [n for n in calls if child(n) == name]
    if find_router(inside) is None and not all(_per_token_op(n) for n in inside):
        return None
    return f"{path}.{name}"


def block_layers(order: list[str], ffn_child: dict[str, str | None]) -> dict[str, int | None]:
    """Each block's layer: the token-mixing blocks up to and including the next per-token one;
    None for the blocks after the last per-token block (they run with the head)."""
    out: dict[str, int | None] = {}
    layer, pending = 0, []
    for lp in order:
        pending.append(lp)
        if ffn_child[lp] is not None:
            out.update(dict.fromkeys(pending, layer))
            layer, pending = layer + 1, []
    out.update(dict.fromkeys(pending))
    return out


def mixes_tokens(nodes: Iterable[fx.Node]) -> bool:
    """Whether ``nodes`` (a layer's attention side) may mix tokens: an attention op, or any op not
    known to act on each token alone (a norm and a residual add do not; a Mamba or a convolution
    does). False for a layer that is only an MLP block's norm and residual add (and, in a rank's
    program, its exchange)."""
    return any(n.op == "call_function" and (is_attention_op(n) or not (_per_token_op(n) or _ours(n))) for n in nodes)


def _ours(n: fx.Node) -> bool:
    """An afd:: op (an exchange, a collective, the MoE op: none of them mixes tokens)."""
    return getattr(n.target, "namespace", None) == "afd"
