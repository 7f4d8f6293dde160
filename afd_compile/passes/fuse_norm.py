"""Keep all-reduce + residual add + RMSNorm as one unit a fused kernel can replace.

``find_allreduce_add_rmsnorm`` returns typed matches; ``fuse_allreduce_add_rmsnorm`` rewrites
each into one ``afd::all_reduce_add_rms_norm`` call (``collectives.py``) whose implementation is the composite
(all-reduce, add, RMSNorm in float32, cast back, scale): a platform with a fused kernel registers
it for the op, and no path skips the reduction. Before / after (standard TP, prepare_mlp; ``dt``
the model's dtype, bfloat16 or float32)::

    ar = afd.all_reduce(o, group)               h, n = afd.all_reduce_add_rms_norm(o, x, w, 1e-6, group, dt)
    h = add(x, ar)                              # h: the residual stream, in the add's dtype
    h32 = to(h, float32)                        # n: the normed hidden states
    var = mean(pow(h32, 2), [-1], keepdim)      # (a user of h32 outside the norm reads to(h, float32))
    n = mul(w, to(mul(h32, rsqrt(add(var, eps))), dt))

The pass warns when a program with all-reduces has none of these units (a norm of another shape).
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .. import meta_keys
from .. import ops as _ops  # noqa: F401  (afd::all_reduce, afd::all_reduce_add_rms_norm: collectives.py)

log = logging.getLogger(__name__)

aten = torch.ops.aten


@dataclass(frozen=True)
class AllReduceAddRMSNorm:
    all_reduce: fx.Node
    add: fx.Node
    residual_in: fx.Node
    cast: fx.Node
    normed: fx.Node
    weight: fx.Node
    eps: float
    norm_dtype: torch.dtype  # the norm's cast back before the scale (the model's dtype)
    interior: tuple[fx.Node, ...]


def _only(users: dict, target: object) -> fx.Node | None:
    found = [u for u in users if u.target == target]
    return found[0] if len(found) == 1 else None


def _match(ar: fx.Node) -> AllReduceAddRMSNorm | None:
    users = [u for u in ar.users if u.target != aten._assert_tensor_metadata.default]
    if len(users) != 1 or users[0].target != aten.add.Tensor:
        return None
    add = users[0]
    residual = next((a for a in add.args if a is not ar), None)
    cast = _only(add.users, aten.to.dtype)  # (the sum's other users, the next residual add, read h)
    if cast is None or cast.args[1] != torch.float32 or not isinstance(residual, fx.Node):
        return None
    pw = _only(cast.users, aten.pow.Tensor_Scalar)
    mean = pw and _only(pw.users, aten.mean.dim)
    eps_add = mean and _only(mean.users, aten.add.Tensor)
    rs = eps_add and _only(eps_add.users, aten.rsqrt.default)
    mul = rs and _only(rs.users, aten.mul.Tensor)
    back = mul and _only(mul.users, aten.to.dtype)
    scale = back and _only(back.users, aten.mul.Tensor)
    if not (pw and pw.args[1] == 2 and mean and list(mean.args[1]) == [-1] and eps_add and rs and mul and back
            and scale and mul.args[0] is cast and isinstance(eps_add.args[1], float)):
        return None
    weight = next((a for a in scale.args if a is not back), None)
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr") or not isinstance(back.args[1], torch.dtype):
        return None
    interior = (pw, mean, eps_add, rs, mul, back)
    # every interior node must feed only the unit (bookkeeping asserts aside)
    for n in interior:
        if any(u not in (*interior, scale) and u.target != aten._assert_tensor_metadata.default for u in n.users):
            return None
    return AllReduceAddRMSNorm(ar, add, residual, cast, scale, weight, float(eps_add.args[1]), back.args[1],
                               interior)


def _dtype(n: fx.Node) -> torch.dtype | None:
    v = n.meta.get("val")
    return v.dtype if isinstance(v, torch.Tensor) else None


def find_allreduce_add_rmsnorm(gm: fx.GraphModule) -> list[AllReduceAddRMSNorm]:
    ars = [n for n in gm.graph.nodes if n.target == torch.ops.afd.all_reduce.default]
    return [m for m in (_match(a) for a in ars) if m is not None]


def fuse_allreduce_add_rmsnorm(gm: fx.GraphModule) -> int:
    """Rewrite every match in place; returns how many units were fused."""
    matches = find_allreduce_add_rmsnorm(gm)
    if not matches and any(n.target == torch.ops.afd.all_reduce.default for n in gm.graph.nodes):
        # (a LayerNorm model, GPT-2 or MPT: nothing to fuse is expected, not worth a warning)
        log.info("fuse_allreduce_add_rmsnorm: all-reduces present but no all-reduce + add + RMSNorm unit "
                 "matched; the graph is left as it is")
    g = gm.graph
    fused_count = 0
    while matches:  # one unit at a time: a fused unit's residual output feeds the next unit
        m = matches[0]
        fused_count += 1
        partial, group = m.all_reduce.args
        with g.inserting_before(m.add):
            fused = g.call_function(torch.ops.afd.all_reduce_add_rms_norm.default,
                                    (partial, m.residual_in, m.weight, m.eps, group, m.norm_dtype))
            h = g.call_function(operator.getitem, (fused, 0))
            normed = g.call_function(operator.getitem, (fused, 1))
            outside = [
                u for u in m.cast.users if u not in m.interior and u.target != aten._assert_tensor_metadata.default
            ]
            h32 = h
            if outside and _dtype(m.add) != torch.float32:  # the float32 sum read beyond the norm
                h32 = g.call_function(aten.to.dtype, (h, torch.float32))
        for n in {fused, h, normed, h32}:
            n.meta[meta_keys.ROLE] = m.add.meta.get(meta_keys.ROLE)
        m.normed.replace_all_uses_with(normed)
        m.cast.replace_all_uses_with(h32)
        m.add.replace_all_uses_with(h)  # the residual stream and bookkeeping users of the sum
        for n in (m.normed, *reversed(m.interior), m.cast, m.add, m.all_reduce):
            for u in list(n.users):
                if u.target == aten._assert_tensor_metadata.default:
                    g.erase_node(u)
            g.erase_node(n)
        matches = find_allreduce_add_rmsnorm(gm)
    g.lint()
    gm.recompile()
    return fused_count


def lower_for_inductor(gm: fx.GraphModule) -> int:
    """Before Inductor: each ``afd::all_reduce_add_rms_norm`` back into ``afd::all_reduce`` and the
    composite's ATen ops, so Inductor fuses the residual add, the norm and both casts into one
    kernel beside the all-reduce (a custom op is opaque to Inductor: kept whole, its composite
    would run as separate kernels). The all-reduce picks its transport per message (symm_mem.py:
    one-shot over symmetric memory for small messages, NCCL above). Returns how many were lowered::

        h, n = afd.all_reduce_add_rms_norm(o, x, w, eps, group, dt)
                                          ->  ar = afd.all_reduce(o, group); h = add(x, ar)
                                              h32 = to(h, float32); var = mean(pow(h32, 2), [-1], keepdim)
                                              n = mul(w, to(mul(h32, rsqrt(add(var, eps))), dt))
    """
    g = gm.graph
    lowered = 0
    for fused in [n for n in g.nodes if n.target == torch.ops.afd.all_reduce_add_rms_norm.default]:
        partial, residual, weight, eps, group, norm_dtype = fused.args
        with g.inserting_before(fused):
            ar = g.call_function(torch.ops.afd.all_reduce.default, (partial, group))
            h = g.call_function(aten.add.Tensor, (residual, ar))
            h32 = g.call_function(aten.to.dtype, (h, torch.float32))
            var = g.call_function(aten.mean.dim, (g.call_function(aten.pow.Tensor_Scalar, (h32, 2)), [-1], True))
            rs = g.call_function(aten.rsqrt.default, (g.call_function(aten.add.Tensor, (var, eps)),))
            back = g.call_function(aten.to.dtype, (g.call_function(aten.mul.Tensor, (h32, rs)), norm_dtype))
            normed = g.call_function(aten.mul.Tensor, (weight, back))
        for u in list(fused.users):
            if u.target is operator.getitem:
                u.replace_all_uses_with((h, normed)[u.args[1]])
                g.erase_node(u)
        g.erase_node(fused)
        lowered += 1
    if lowered:
        g.lint()
        gm.recompile()
    return lowered
