"""Re-express a region's symbolic sizes in terms of the FFN program's token count.

An exported graph computes shapes from symbols of its inputs (``s0`` = batch, ``s1`` = sequence).
The FFN program sees one flat token count ``T`` (the sum over its attention peers), so the FFN
region's view/reshape sizes must be rewritten: all token symbols but one are bound to 1 and the
last to ``T // c`` (``c`` the static part of the token dims), which keeps every token-wise op
valid. This module binds the symbols and emits FX nodes that compute a sympy expression.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from torch.utils._sympy.functions import FloorDiv


def sym_expr(value: object) -> sympy.Expr:
    """The sympy expression of an int or SymInt."""
    if isinstance(value, torch.SymInt):
        return sympy.sympify(value.node.expr)
    if isinstance(value, int):
        return sympy.Integer(value)
    raise TypeError(f"not an int or SymInt: {value!r}")


@dataclass(frozen=True)
class TokenBinding:
    """How the original token dims map onto the FFN program's flat count ``T``.

    ``ones`` are bound to 1; ``sigma`` (if any) to ``T // coeff``. With no symbols (a static
    graph) the token count is fixed at ``coeff``.
    """

    sigma: sympy.Symbol | None
    coeff: int
    ones: tuple[sympy.Symbol, ...]

    @staticmethod
    def for_token_dims(dims: list[object], where: str) -> TokenBinding:
        exprs = [sym_expr(d) for d in dims]
        symbols: list[sympy.Symbol] = []
        for e in exprs:
            for s in sorted(e.free_symbols, key=str):
                if s not in symbols:
                    symbols.append(s)
        total = sympy.Mul(*exprs)
        if not symbols:
            return TokenBinding(None, int(total), ())
        sigma, ones = symbols[-1], tuple(symbols[:-1])
        reduced = sympy.expand(total.subs({s: 1 for s in ones}))
        coeff = sympy.simplify(reduced / sigma)
        if not coeff.is_Integer or int(coeff) < 1:
            raise ValueError(
                f"{where}: token dims {[str(e) for e in exprs]} are not a product of symbols and "
                "constants; cannot map them onto a flat token count"
            )
        return TokenBinding(sigma, int(coeff), ones)

    def substitute(self, expr: sympy.Expr) -> sympy.Expr:
        return expr.subs({s: 1 for s in self.ones})

    def known(self, expr: sympy.Expr) -> bool:
        allowed = set(self.ones) | ({self.sigma} if self.sigma is not None else set())
        return expr.free_symbols <= allowed


def emit_expr(graph: fx.Graph, expr: sympy.Expr, sigma: sympy.Symbol | None, sigma_node: object) -> object:
    """FX nodes (``operator`` calls on SymInts) computing ``expr`` with ``sigma -> sigma_node``.
    Returns an int for constant expressions."""
    return emit_with(graph, expr, {} if sigma is None else {sigma: sigma_node})


def emit_with(graph: fx.Graph | Callable[[object, tuple], fx.Node], expr: sympy.Expr, symbols: dict) -> object:
    """Like :func:`emit_expr` with any number of symbols bound to graph values. ``graph`` may be
    a callable ``(target, args) -> Node`` that creates (and annotates) the nodes."""
    if isinstance(graph, fx.Graph):
        g = graph

        def graph(target: object, args: tuple) -> fx.Node:
            return g.call_function(target, args)

    expr = sympy.sympify(expr)
    if expr.is_Integer:
        return int(expr)
    if expr in symbols:
        return symbols[expr]
    if isinstance(expr, (sympy.Mul, sympy.Add)):
        fn = operator.mul if isinstance(expr, sympy.Mul) else operator.add
        parts = [emit_with(graph, a, symbols) for a in expr.args]
        acc = parts[0]
        for p in parts[1:]:
            acc = graph(fn, (acc, p))
        return acc
    if isinstance(expr, FloorDiv):
        a, b = (emit_with(graph, x, symbols) for x in expr.args)
        return graph(operator.floordiv, (a, b))
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and int(expr.exp) > 0:
        base = emit_with(graph, expr.base, symbols)
        acc = base
        for _ in range(int(expr.exp) - 1):
            acc = graph(operator.mul, (acc, base))
        return acc
    raise ValueError(f"cannot emit symbolic size expression {expr} ({type(expr).__name__})")
