"""Where the parts of a layer are, for the TP rewrites: the attention output projection (and the
ops its partial sum passes unchanged), the residual add after it, and the token sizes an MLP reads.

Shared by ``tp_rewrite`` (DP attention) and ``scattered`` (SCATTERED MLPs).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..errors import TPRewriteError


def rebind_token_sizes(b: object, ffn: list[fx.Node], sizes: list[fx.Node], dims: list[object],
                        total: fx.Node, where: str, share: bool = False) -> None:
    """The MLP runs on other tokens than it was traced with (``dims``: its input's token dims):
    re-express the sizes it reads (computed from the batch and sequence symbols) in the new count
    ``total``, binding the token symbols as the AFD FFN program does (all but one to 1, the last to
    ``total // c``, ``c`` the product of the static token dims). ``share``: ``total`` is a rank's
    share of the tokens, not a multiple of ``c``: a size that is a multiple of the token count
    becomes that multiple of ``total``; any other is refused (a static batch of 2: ``[2, s, H]``
    cannot hold 3 rows)."""
    import operator

    import sympy

    from .symbolic import TokenBinding, emit_with, sym_expr

    try:
        binding = TokenBinding.for_token_dims(dims, where)
    except ValueError as e:
        raise TPRewriteError(str(e)) from None
    graph = ffn[0].graph
    count = binding.coeff * binding.sigma if binding.sigma is not None else None
    with graph.inserting_before(ffn[0]):
        sigma = total if binding.coeff == 1 else b.call(operator.floordiv, (total, binding.coeff))
        for sz in sizes:
            val = sz.meta.get("val")
            expr = binding.substitute(sym_expr(val)) if isinstance(val, (int, torch.SymInt)) else None
            if expr is None or not binding.known(expr):
                raise TPRewriteError(f"{where}: the MLP reads {sz.name} ({val}), which is not a function of the "
                                     "token count")
            times = sympy.simplify(expr / count) if count is not None else None
            if share and binding.coeff > 1 and times is not None and times.is_Integer and int(times) > 0:
                new = total if int(times) == 1 else b.call(operator.mul, (total, int(times)))
            elif share and binding.coeff > 1:
                raise TPRewriteError(
                    f"{where}: the MLP reads {sz.name} ({val}), a size made from the token dims {list(dims)} that "
                    f"is not a multiple of their product: a rank's share of the tokens need not be a multiple of "
                    f"{binding.coeff} (the static ones among them: a static batch); export with a dynamic batch, "
                    "or run this layout without a SCATTERED MLP (--moe-a2a / --dense-dp)")
            else:
                new = emit_with(b.call, expr, {binding.sigma: sigma} if binding.sigma is not None else {})
            for u in ffn:
                u.replace_input_with(sz, new)


def attention_row(members: list[fx.Node], where: str, first_ffn: fx.Node | None = None) -> fx.Node:
    """The attention output projection (the first weight-reading linear after the attention op,
    before ``first_ffn`` if given), followed through ops its partial sum passes unchanged."""
    from .graph_utils import Layer
    from .roles import META_KEY as RKEY

    pos = {n: i for i, n in enumerate(members)}
    end = pos[first_ffn] if first_ffn is not None else 1 << 30
    layer = Layer(members[0].meta[RKEY].layer, tuple(members))
    rows = [n for n in layer.output_projections if pos[n] < end]
    if not rows:
        raise TPRewriteError(f"{where}: no output projection after the attention op")
    row = rows[0]
    # dropout in eval, the view back to [batch, seq, hidden] after a 2-D addmm (GPT-2), a scalar
    # multiplier (Granite's residual_multiplier): linear, so the partial sum passes through them
    while len(row.users) == 1 and passes_partial(next(iter(row.users)), row):
        row = next(iter(row.users))
    return row


def residual_add_after_attention(members: list[fx.Node], first_ffn: fx.Node, where: str):
    """The add joining the attention output projection with the residual: (add, o, x), or
    (add, o, None) when something non-linear (a norm) sits between o and the add."""
    from .op_kinds import ADD_OPS
    from .roles import descendants

    pos = {n: i for i, n in enumerate(members)}
    row = attention_row(members, where, first_ffn)
    for u in row.users:
        if u.target in ADD_OPS and len(u.all_input_nodes) == 2:
            other = next(a for a in u.all_input_nodes if a is not row)
            return _one_stream(u, row, where), row, other
    # a norm between the projection and the residual add (Gemma-2, OLMo-2): the first add that
    # joins a value computed from the projection with one that is not (the residual)
    inside = set(members)
    down = descendants(row, inside)
    for n in members[pos[row] + 1:]:
        if n in down and n.target in ADD_OPS and len(n.all_input_nodes) == 2 and (
                sum(a in down for a in n.all_input_nodes) == 1):
            return _one_stream(n, row, where), row, None
    raise TPRewriteError(f"{where}: the attention output projection {row.name} never reaches a residual add "
                         f"(it feeds {[f'{u.name} ({u.target})' for u in row.users]})")


def _one_stream(h1: fx.Node, row: fx.Node, where: str) -> fx.Node:
    """``h1``, the residual sum after attention, when it holds one hidden state a token as the
    attention output ``row`` does; else (several residual streams, as hyper-connections keep:
    ``[b, s, streams, H]``) a refusal: moving a rank's tokens moves rows of one stream."""
    from .moe.block import rows_of, same

    mine, attention = rows_of(h1.meta.get("val")), rows_of(row.meta.get("val"))
    if mine is not None and attention is not None and not same(mine, attention):
        raise TPRewriteError(
            f"{where}: the residual sum after attention {h1.name} {list(h1.meta['val'].shape)} holds more than one "
            f"hidden state a token (several residual streams, as hyper-connections keep) beside the attention "
            f"output {row.name} {list(row.meta['val'].shape)}: DP attention and SCATTERED MLPs move a rank's tokens "
            "as rows of one stream, and do not take it yet; standard TP (--attn-dp 1, no --moe-a2a / --dense-dp) "
            "and AFD run it")
    return h1


def parallel_residual(members: list[fx.Node], mlp_inputs: list[fx.Node]) -> bool:
    """A parallel-residual block (GPT-J, GPT-NeoX, Phi, Falcon, Cohere: ``h = x + attn(ln1(x)) +
    mlp(ln2(x))``): the MLP, reading ``mlp_inputs``, reads nothing the layer's attention computed."""
    from .roles import ancestors, is_attention_op

    attn = next((n for n in members if is_attention_op(n)), None)
    return attn is not None and attn not in ancestors(mlp_inputs, within=set(members))


VIEW_OPS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


def passes_partial(n: fx.Node, src: fx.Node) -> bool:
    scalar_mul = n.target in (torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar, torch.ops.aten.div.Tensor) and (
        n.args[0] is src and isinstance(n.args[1], (int, float)))
    scalar_mul |= n.target == torch.ops.aten.mul.Tensor and n.args[1] is src and isinstance(n.args[0], (int, float))
    return is_identity(n) or n.target in VIEW_OPS or scalar_mul


def is_identity(n: fx.Node) -> bool:
    if n.target == torch.ops.aten.dropout.default:
        return n.args[1] == 0 or not n.args[2]
    return n.target in (torch.ops.aten.alias.default, torch.ops.aten.clone.default)
