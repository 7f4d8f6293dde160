"""``afd::router_topk``: an MoE router's top-k over few experts as one small kernel (issue 34).

``torch.topk`` of a ``[T, E]`` score matrix over its last dim (E up to a few hundred experts, k up
to 32) runs on CUDA as a radix select plus a sort, ~18 µs a layer at T = 1024, E = 128, k = 8 on
an H200 (BENCHMARKS.md: the router's top-k): a tenth of an MoE layer's expert time. This op returns what
``torch.topk(x, k, dim=-1)`` returns (values sorted descending, their indices, int64) from one
Triton program per block of rows: each row's scores held in registers, the maximum taken ``k``
times. Ties go to the lower index (``torch.topk`` does not specify an order for them); a NaN
counts as larger than any number, as in ``torch.topk``.

Anywhere but CUDA with Triton, or past :data:`MAX_EXPERTS` / :data:`MAX_K`, it is ``torch.topk``
itself. ``passes/moe/topk.py`` puts it in the programs the backend compiles for CUDA.
"""

from __future__ import annotations

import torch

#: the largest expert count (last dim) and k the kernel takes; beyond them, torch.topk
MAX_EXPERTS, MAX_K = 512, 32


def applies(x: torch.Tensor, k: int) -> bool:
    """The Triton kernel runs these operands (else ``torch.topk``)."""
    if x.device.type != "cuda" or x.dim() != 2 or not (0 < k <= min(MAX_K, x.shape[-1])):
        return False
    if x.shape[-1] > MAX_EXPERTS or not x.is_floating_point():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@torch.library.custom_op("afd::router_topk", mutates_args=())
def _router_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not applies(x, k):
        values, indices = torch.topk(x, k, dim=-1)
        return values, indices
    from .moe_triton import topk_rows

    return topk_rows(x, k)


@_router_topk.register_fake
def _router_topk_fake(x, k):
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int64)


def router_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.afd.router_topk`` (module docstring)."""
    return torch.ops.afd.router_topk(x, k)
