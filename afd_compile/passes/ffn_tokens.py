"""An FFN program of a graph exported with static token dims, made to take any multiple of them.

A program exported with every shape static (transformers' ``TorchExportableModuleForDecoderOnlyLM``
by default: ``input_ids`` ``[B, 1]``) gives an FFN program that views what it receives as the
static ``[B, s, H]`` and says ``B`` in its reshapes. Its work is per token, so an FFN rank that
fans in ``k`` attention peers (or serves an FFN TP group) can run it on ``k * B * s`` tokens as
``[T // s, s, H]``: the batch dim follows the step's token count. This pass follows the batch dim
from each receive through the program (``passes/batch_dims.py``, whose rules refuse an op that
mixes tokens, naming it) and rewrites every constant that is the batch.

Before (``B = 2``, ``s = 1``)::

    total_tokens = sym_size(token_slots, 0)
    view = aten.view(getitem, [2, 1, 64])
    ...
    view_3 = aten.view(moe_out, [2, 1, 64])

After::

    total_tokens = sym_size(token_slots, 0)
    rows = total_tokens // 1                      # (s = 1: total_tokens itself)
    view = aten.view(getitem, [rows, 1, 64])
    ...
    view_3 = aten.view(moe_out, [rows, 1, 64])
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from ..errors import AFDCompileError
from .batch_dims import BatchError, plan_batch

aten = torch.ops.aten


class StaticTokensError(AFDCompileError):
    """A static-token FFN program that cannot take another token count, and where."""


def _recv_views(ffn: fx.GraphModule) -> list[fx.Node]:
    """The views that shape each receive's rows back into the model's token dims."""
    out = []
    for n in ffn.graph.nodes:
        if n.target != aten.view.default or not isinstance(n.args[0], fx.Node):
            continue
        src = n.args[0]
        if src.target == operator.getitem and isinstance(src.args[0], fx.Node) and \
                src.args[0].target == torch.ops.afd.p2p_recv_group.default:
            out.append(n)
    return out


def tokens_follow_the_carrier(ffn: fx.GraphModule, name: str = "FFN program") -> int:
    """Rewrite, in place, a static-token FFN program (``[B, s, ..., H]`` at each receive) to view
    its rows as ``[T // (s * ...), s, ..., H]``; returns the factor its token count is a multiple
    of (``s * ...``). The program's meta is not refreshed (``split.propagate_ffn_meta`` does)."""
    views = _recv_views(ffn)
    if not views:
        raise StaticTokensError(f"{name}: no receive of the tokens found")
    dims = {tuple(v.args[1][:-1]) for v in views if v.args[1][0] != -1}
    if len({d[0] for d in dims}) != 1 or not all(isinstance(x, int) for d in dims for x in d) \
            or len({math.prod(d[1:]) for d in dims}) != 1:
        raise StaticTokensError(f"{name}: the receives view their rows as different static token dims {sorted(dims)}")
    batch, factor = next(iter(dims))[0], math.prod(next(iter(dims))[1:])
    total = next(n for n in ffn.graph.nodes if n.target == aten.sym_size.int)
    for n in list(total.users):  # the [T, H] each send flattens into: written as the static count, a site
        if n.target == aten.view.default and n.args[1][0] is total:
            n.args = (n.args[0], [batch * factor, *n.args[1][1:]])
    try:
        plan = plan_batch(ffn, batch, {v.name: 0 for v in views}, name,
                          why="the program was exported with static token dims, and an FFN rank runs the tokens "
                              "of several attention peers through it as one batch: its work must be per token")
    except BatchError as e:
        raise StaticTokensError(str(e)) from None
    with ffn.graph.inserting_after(total):
        rows = total if factor == 1 else ffn.graph.call_function(operator.floordiv, (total, factor))
    by_name = {n.name: n for n in ffn.graph.nodes}

    def times(k: int) -> object:
        if k == 1:
            return rows
        with ffn.graph.inserting_after(rows):
            return ffn.graph.call_function(operator.mul, (rows, k))

    for v in views:
        v.args = (v.args[0], [rows, *v.args[1][1:]])
    for site in plan.sites:
        n = by_name[site.node]
        args = list(n.args)
        sizes = list(args[site.arg])
        sizes[site.index] = times(site.value // batch)
        args[site.arg] = sizes
        n.args = tuple(args)
    ffn.graph.lint()
    ffn.recompile()
    return factor
