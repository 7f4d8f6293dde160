"""The numerical verdict of one output against its reference (what ``verify``, the examples and
the tests compare with)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Comparison:
    """One output compared with its reference: the largest :func:`rel_err` over its tensors, and
    what made the comparison meaningless, if anything (a non-finite value, another
    structure or shape), naming the output. ``max_rel_err`` is ``inf`` then, never NaN: Python's
    ``max(0.0, nan)`` is ``0.0``, so a NaN error would vanish in any running maximum."""

    max_rel_err: float
    problem: str | None = None
    values: int = 0  # elements compared

    def passes(self, tol: float) -> bool:
        return self.problem is None and self.values > 0 and self.max_rel_err <= tol


def _nonfinite(t: torch.Tensor) -> str | None:
    if not t.is_floating_point() and not t.is_complex():
        return None
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    return f"{nan} NaN and {inf} Inf of {t.numel()} values" if nan or inf else None


def compare(out: Any, ref: Any) -> Comparison:
    """Compare a (nested) output with the reference: see :class:`Comparison`."""
    outs, refs = _flat(out), _flat(ref)
    if len(outs) != len(refs):
        return Comparison(math.inf, f"{len(outs)} output tensors, the reference has {len(refs)}")
    err, values = 0.0, 0
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        if o.shape != r.shape:
            return Comparison(math.inf, f"output {i} has shape {tuple(o.shape)}, the reference {tuple(r.shape)}")
        o, r = o.detach(), r.detach()
        bad = _nonfinite(r)
        if bad:
            return Comparison(math.inf, f"the reference output {i} holds {bad}: nothing to compare against")
        bad = _nonfinite(o)
        if bad:
            return Comparison(math.inf, f"output {i} holds {bad}")
        if o.numel():
            err = max(err, rel_err(o, r))
        values += o.numel()
    return Comparison(err, None, values)


#: the quantile of the reference's nonzero magnitudes that sets the floor of :func:`rel_err`
FLOOR_QUANTILE = 0.9


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max_i |out_i - ref_i| / max(|ref_i|, q)``, ``q`` the 90th percentile of the reference's
    nonzero magnitudes: each element's error relative to its own size, with a floor at the
    tensor's typical size. One large element cannot hide the others' errors (``max |d| / max
    |ref|`` let a logit biased by 1e6 pass a split wrong by 19 % everywhere else), and it is judged
    against itself; elements near zero are judged against the typical size, not their own."""
    o, r = out.detach().double().flatten(), ref.detach().double().flatten()
    mag = r.abs()
    nonzero = mag[mag > 0]
    q = 1e-30
    if nonzero.numel():
        k = max(1, min(nonzero.numel(), math.ceil(FLOOR_QUANTILE * nonzero.numel())))
        q = max(float(torch.kthvalue(nonzero, k).values), 1e-30)
    return float(((o - r).abs() / mag.clamp_min(q)).max())


def max_rel_err(out: Any, ref: Any) -> float:
    """The largest :func:`rel_err` over all tensors of a (nested) output; ``inf`` on a structure
    or shape mismatch and on any NaN / Inf (see :func:`compare` for which output)."""
    return compare(out, ref).max_rel_err


def _flat(x: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]
