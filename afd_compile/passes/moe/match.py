"""Which ``afd::moe_experts`` call a found block computes (:func:`match_block`).

The block is evaluated once, router included, on random token rows (the probe); then each way of
reading its expert weights as the op's stacked ``[E, N, H]`` / ``[E, H, I]`` (as they are or
transposed; gate and up as halves, swapped halves, interleaved rows or separate weights; per-expert
weights of numbered submodules stacked), each activation the expert path applies, the routing
weight applied before or after the experts, and each routing-weight tensor ``[T, K]`` (or a dense
``[T, E]`` one, gathered at the chosen experts) is tried until one reproduces the block's output.
Only a match is rewritten: what the op computes is then what the model computed, on the model's
own weights, whatever its code looked like.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ...moe import ACTIVATIONS, GLU_ACTIVATIONS, reference
from ..graph_utils import get_attr_path
from .block import Block, hint, routing_candidates

aten = torch.ops.aten

_ACT_OPS = {aten.silu.default: "silu", aten.silu_.default: "silu", aten.relu.default: "relu",
            aten.relu_.default: "relu"}


class ProbeError(Exception):
    """The block cannot be evaluated alone (it reads a graph input, an op fails on the probe)."""


@dataclass(frozen=True)
class Weights:
    """The experts' weights as the op reads them, and how they were read from the model's."""

    w_gate_up: torch.Tensor  # [E, N, H]
    w_down: torch.Tensor  # [E, H, I]
    b_gate_up: torch.Tensor | None
    b_down: torch.Tensor | None
    gated: bool
    how: str
    sources: tuple[str, ...]  # the model's attributes read (stacked per expert where numbered)


@dataclass(frozen=True)
class Activation:
    """The op's ``activation`` and, for a GLU of its own (``swiglu_oai``), ``alpha`` / ``limit``."""

    name: str
    alpha: float = 1.702
    limit: float = 7.0

    @property
    def args(self) -> tuple:
        """What the op node reads after ``weight_first`` (nothing for the defaults' users)."""
        return (self.alpha, self.limit) if self.name in GLU_ACTIVATIONS else ()

    def __str__(self) -> str:
        return f"{self.name}(alpha={self.alpha:g}, limit={self.limit:g})" if self.args else self.name


@dataclass(frozen=True)
class Match:
    weights: Weights
    activation: Activation
    weight_first: bool
    routing: fx.Node  # the routing weights the op reads
    dense: bool  # ``routing`` is [T, E]: gathered at the chosen experts
    tried: int


def match_block(gm: fx.GraphModule, block: Block) -> tuple[Match | None, str]:
    """The first op configuration that reproduces the block on the probe, or None and why not."""
    try:
        stacked, leftover = stacked_weights(gm, block)
    except ProbeError as e:
        return None, str(e)
    if leftover:
        return None, f"expert parameters {leftover[:4]} are neither stacked [E={block.num_experts}, ...] nor one " \
                     "per expert of a numbered container"
    try:
        with torch.no_grad():
            try:
                env = probe(gm, block, few_rows=True)
            except ProbeError:  # (a size relation the model assumes may need the traced rows)
                env = probe(gm, block, few_rows=False)
    except ProbeError as e:
        return None, str(e)
    want = env[block.end]
    x, ids = env[block.x], env[block.ids]
    ids = ids if ids.dim() == 2 else ids[:, None]  # (one expert per token)
    acts = activations(block)
    # (the tolerance of the narrowest dtype the experts compute in: a combine in fp32 over bf16 experts, as
    # DeepSeek's fp32 routing weights give, is as exact as bf16)
    wide = (torch.float32, torch.float64)
    tol = 1e-4 if want.dtype in wide and x.dtype in wide and all(t.dtype in wide for _, t in stacked) else 3e-2
    scale = want.abs().max().clamp_min(1e-30)
    layouts = list(weight_layouts(stacked, x.shape[-1]))
    routing = routing_candidates(block)
    tried = 0
    for (node, dense), w, act, first in itertools.product(routing, layouts, acts, (False, True)):
        if act.args and not w.gated:
            continue
        tried += 1
        r = env[node].gather(1, ids) if dense else env[node]
        r = r if r.dim() == 2 else r[:, None]
        with torch.no_grad():
            got = reference(x, ids, r, w.w_gate_up, w.w_down, w.b_gate_up, w.b_down, act.name, w.gated, first,
                            *act.args)
        if got.shape == want.shape and float((got.to(want.dtype) - want).abs().max() / scale) <= tol:
            return Match(w, act, first, node, dense, tried), ""
    return None, (f"no expert form matched: {tried} tried ({len(layouts)} weight layouts of "
                  f"{[s for s, _ in stacked]}, activations {[str(a) for a in acts]}, routing weights "
                  f"{[n.name for n, _ in routing]}, applied before or after the experts)")


def activations(block: Block) -> list[Activation]:
    """The activations the expert path applies (each of :data:`ACTIVATIONS` when it names none):
    its activation ops, and a clamped GLU (``sigmoid(g * alpha)`` beside a ``clamp(max=limit)``)
    with the model's constants."""
    acts = [Activation(a) for a in sorted({_activation(n) for n in block.experts} - {None})]
    for n in block.experts:
        scaled = n.args[0] if n.target == aten.sigmoid.default and isinstance(n.args[0], fx.Node) else None
        if scaled is None or scaled.target != aten.mul.Tensor:
            continue
        alpha = next((a for a in scaled.args if isinstance(a, (int, float))), None)
        limits = {float(c.args[2]) for c in block.experts if c.target == aten.clamp.default and len(c.args) > 2
                  and isinstance(c.args[2], (int, float))}
        if alpha is not None and len(limits) == 1:
            acts.append(Activation("swiglu_oai", float(alpha), limits.pop()))
    return list(dict.fromkeys(acts)) or [Activation(a) for a in sorted(ACTIVATIONS)]


def _activation(n: fx.Node) -> str | None:
    if n.target in _ACT_OPS:
        squared = any(u.target == aten.square.default or (u.target == aten.pow.Tensor_Scalar and u.args[1] == 2)
                      or (u.target == aten.mul.Tensor and u.args[0] is n and u.args[1] is n) for u in n.users)
        return "relu2" if squared and _ACT_OPS[n.target] == "relu" else _ACT_OPS[n.target]
    if n.target in (aten.gelu.default, aten.gelu_.default):
        return "gelu_tanh" if n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none") == "tanh" \
            else "gelu"
    return None


# --- the weights ------------------------------------------------------------------------------

def stacked_weights(gm: fx.GraphModule, block: Block) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """The expert parameters as ``[E, ...]`` tensors: stacked already, or one per expert in a
    numbered container (``experts.3.w1``) stacked in expert order; and the parameters that are
    neither."""
    e = block.num_experts
    stacked: list[tuple[str, torch.Tensor]] = []
    numbered: dict[str, dict[int, tuple[str, torch.Tensor]]] = {}
    leftover: list[str] = []
    for p in block.params:
        t = get_attr_path(gm, str(p.target))
        if not isinstance(t, torch.Tensor):
            raise ProbeError(f"the experts read {p.target}, which is not a tensor")
        if t.dim() >= 2 and t.shape[0] == e:
            stacked.append((str(p.target), t))
            continue
        keys = _numbered_keys(str(p.target), e)
        if not keys:
            leftover.append(str(p.target))
        for key, idx in keys:
            numbered.setdefault(key, {})[idx] = (str(p.target), t)
    used: set[str] = set()
    for key, per in numbered.items():
        items = [per[i] for i in sorted(per)]
        if sorted(per) == list(range(e)) and len({tuple(t.shape) for _, t in items}) == 1 and \
                not used & {n for n, _ in items}:
            stacked.append((key, torch.stack([t for _, t in items])))
            used |= {n for n, _ in items}
    leftover += sorted({n for per in numbered.values() for n, _ in per.values()} - used)
    return stacked, leftover


def _numbered_keys(target: str, e: int) -> list[tuple[str, int]]:
    """``(name with one integer component as '*', that integer)`` for each integer component < e."""
    parts = re.split(r"([._])", target)
    return [("".join(parts[:j] + ["*"] + parts[j + 1:]), int(p)) for j, p in enumerate(parts)
            if p.isdigit() and int(p) < e]


def weight_layouts(stacked: list[tuple[str, torch.Tensor]], hidden: int) -> Iterator[Weights]:
    """Every reading of the stacked tensors as the op's weights (see the module docstring)."""
    mats = [(n, t) for n, t in stacked if t.dim() == 3]
    vecs = [(n, t) for n, t in stacked if t.dim() == 2]
    if len(mats) == 2:
        for (gn, g), (dn, d) in itertools.permutations(mats):
            for go, gs in _rows(g, hidden):
                for do, ds in _down(d, hidden):
                    yield from _fused(go, do, vecs, f"{gn}{gs} as gate/up, {dn}{ds} as down", (gn, dn))
    elif len(mats) == 3:
        for (dn, d), (an, a), (bn, b) in ((m[0], m[1], m[2]) for m in itertools.permutations(mats)):
            for do, ds in _down(d, hidden):
                for (ao, as_), (bo, bs) in itertools.product(_rows(a, hidden), _rows(b, hidden)):
                    if ao.shape == bo.shape and ao.shape[1] == do.shape[2]:
                        gu = torch.cat([ao, bo], 1)
                        yield from _biased(gu, do, vecs, True, "halves",
                                           f"{an}{as_} as gate, {bn}{bs} as up, {dn}{ds} as down", (an, bn, dn))


def _rows(t: torch.Tensor, hidden: int) -> Iterator[tuple[torch.Tensor, str]]:
    """``t`` as ``[E, n, H]`` (nn.Linear weights per expert)."""
    if t.shape[2] == hidden:
        yield t, ""
    if t.shape[1] == hidden:
        yield t.transpose(1, 2), ".T"


def _down(t: torch.Tensor, hidden: int) -> Iterator[tuple[torch.Tensor, str]]:
    """``t`` as ``[E, H, I]``."""
    if t.shape[1] == hidden:
        yield t, ""
    if t.shape[2] == hidden:
        yield t.transpose(1, 2), ".T"


def _fused(gu: torch.Tensor, down: torch.Tensor, vecs: list, how: str, sources: tuple) -> Iterator[Weights]:
    n, inter = gu.shape[1], down.shape[2]
    if n == 2 * inter:
        for order in ("halves", "swapped", "interleaved"):
            yield from _biased(_arrange(gu, order), down, vecs, True, order, f"{how} ({order})", sources)
    if n == inter:
        yield from _biased(gu, down, vecs, False, "halves", how.replace(" as gate/up", " as up"), sources)


def _arrange(t: torch.Tensor, order: str) -> torch.Tensor:
    """Gate and up rows (dim 1) as the op reads them: gate half first."""
    half = t.shape[1] // 2
    if order == "swapped":
        return torch.cat([t[:, half:], t[:, :half]], 1)
    if order == "interleaved":
        return torch.cat([t[:, 0::2], t[:, 1::2]], 1)
    return t


def _biased(gu: torch.Tensor, down: torch.Tensor, vecs: list, gated: bool, order: str, how: str,
            sources: tuple) -> Iterator[Weights]:
    """With each assignment of the stacked 2-D tensors as the gate/up and down biases."""
    n, hidden = gu.shape[1], down.shape[1]
    if not vecs:
        yield Weights(gu, down, None, None, gated, how, sources)
        return
    if len(vecs) > 3:
        return
    # separate gate and up biases (3-weight experts) concatenate like their weights
    for assign in itertools.product(("gate_up", "down", "gate", "up"), repeat=len(vecs)):
        if len(set(assign)) != len(assign) or ("gate" in assign) != ("up" in assign) or \
                ("gate" in assign and "gate_up" in assign):
            continue
        got = dict(zip(assign, (t for _, t in vecs), strict=True))
        b_down = got.get("down")
        if "gate" in got:
            if got["gate"].shape != got["up"].shape:
                continue
            b_gu = torch.cat([got["gate"], got["up"]], 1)
        else:
            b_gu = got.get("gate_up")
            b_gu = _arrange(b_gu[..., None], order)[..., 0] if b_gu is not None and gated else b_gu
        if (b_gu is not None and b_gu.shape[1] != n) or (b_down is not None and b_down.shape[1] != hidden):
            continue
        names = ", ".join(f"{nm} as {a} bias" for (nm, _), a in zip(vecs, assign, strict=True))
        yield Weights(gu, down, b_gu, b_down, gated, f"{how}; {names}", sources + tuple(nm for nm, _ in vecs))


# --- the probe --------------------------------------------------------------------------------

#: the value a dynamic token dim takes in the probe (a few rows: the traced example may hold
#: thousands, and a gathered-weight form materialises a weight copy per row)
PROBE_ROWS = 3


def _probe_sizes(src: torch.Tensor, few_rows: bool):
    """Sizes in the probe: the symbols of the source's shape (its token dims) at
    :data:`PROBE_ROWS` (at most their hint), every other symbol at its hint."""
    import sympy

    binding = {sym for d in src.shape if isinstance(d, torch.SymInt) for sym in sympy.sympify(d.node.expr).free_symbols
               if few_rows}

    def size(v: object) -> int | None:
        if not isinstance(v, torch.SymInt):
            return hint(v)
        expr = sympy.sympify(v.node.expr)
        if not expr.free_symbols & set(binding):
            return hint(v)
        env = v.node.shape_env
        hints = getattr(env, "backed_var_to_val", None) or env.var_to_val  # (torch 2.13 renames it)
        values = {sym: min(PROBE_ROWS, int(hints[sym])) if sym in binding else hints.get(sym)
                  for sym in expr.free_symbols}
        if any(x is None for x in values.values()):
            return None
        out = expr.xreplace({k: sympy.Integer(int(x)) for k, x in values.items()})
        return int(out) if out.is_number else None

    return size


def probe(gm: fx.GraphModule, block: Block, few_rows: bool = True) -> dict[fx.Node, object]:
    """Every closure node's value on random source rows (seeded), on the weights' device; with
    ``few_rows`` a dynamic token count is :data:`PROBE_ROWS` (else the traced example's)."""
    src = block.source.meta["val"]
    size = _probe_sizes(src, few_rows)
    shape = [size(s) for s in src.shape]
    if None in shape:
        raise ProbeError(f"{block.source.name} has a data-dependent shape {tuple(src.shape)}")
    device = next((get_attr_path(gm, str(p.target)).device for p in block.params), torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    env: dict[fx.Node, object] = {block.source: torch.randn(shape, generator=g).to(src.dtype).to(device)}
    for n in block.closure:
        v = n.meta.get("val")
        if isinstance(v, (torch.SymInt, int, bool)) and not isinstance(v, torch.Tensor) and size(v) is not None:
            env[n] = size(v)
        elif n.op == "get_attr":
            env[n] = get_attr_path(gm, str(n.target))
        elif n.op == "placeholder":
            raise ProbeError(f"the experts read the graph input {n.name}")
        elif n.op in ("call_function", "call_module"):
            fn = gm.get_submodule(str(n.target)) if n.op == "call_module" else n.target
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            try:
                env[n] = fn(*args, **kwargs)
            except Exception as e:  # any op may refuse random rows: the block is then not matched
                raise ProbeError(f"{n.name} ({n.target}) failed on the probe: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}") from None
        else:
            raise ProbeError(f"the experts read {n.name} ({n.op})")
    return env
