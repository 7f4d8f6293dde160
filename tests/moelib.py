"""A model library of another kind (neither transformers nor ours): it registers its own custom op
for the MoE combine, runs its router in fp32 under ``torch.autocast`` (export keeps the region as
a ``wrap_with_autocast`` higher-order op holding a submodule) and its experts as two grouped
GEMMs over the (token, expert) pairs sorted by expert, through a grouped-GEMM op of its own
(``torch._grouped_mm`` on the GPUs that have it; its fake takes no fp32, which CPU tests need).

A program using ``moelib::`` loads only where this module is imported first: ``afd-compile
--import tests/moelib.py`` (or ``AFD_COMPILE_IMPORTS``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


@torch.library.custom_op("moelib::scatter_add_rows", mutates_args=())
def scatter_add_rows(base: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``base`` with each row of ``src`` added at row ``index[i]``."""
    return base.index_add(0, index, src)


@scatter_add_rows.register_fake
def _(base: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(base)


@torch.library.custom_op("moelib::index_add_rows_", mutates_args=("out",))
def index_add_rows_(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """Each row of ``src`` added in place at row ``index[i]`` of ``out`` (export writes it as
    ``auto_functionalized``)."""
    out.index_add_(0, index, src)


@torch.library.custom_op("moelib::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of ``x`` times ``w[e]`` (``[E, K, N]``), as ``torch._grouped_mm``."""
    out = x.new_empty(x.shape[0], w.shape[2])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[e]
        start = end
    return out


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[2])


class LibMoE(nn.Module):
    """Top-k softmax router (fp32, autocast off), renormalised weights, gated SiLU experts stacked
    as ``[E, H, 2I]`` / ``[E, I, H]`` (grouped_mm's ``[E, K, N]``), combined by the library's op."""

    def __init__(self, hidden: int, inter: int, experts: int = 4, top_k: int = 2, aten_mm: bool = False,
                 in_place: bool = False) -> None:
        super().__init__()
        self.experts, self.top_k = experts, top_k
        # aten_mm: the grouped GEMMs by torch._grouped_mm itself (its fake takes bf16 only: export in bf16)
        self.mm = (lambda x, w, offs: torch._grouped_mm(x, w, offs=offs)) if aten_mm else grouped_mm
        self.in_place = in_place  # the combine by the library's in-place op
        self.gate = nn.Parameter(torch.randn(experts, hidden) * hidden ** -0.5)
        self.w13 = nn.Parameter(torch.randn(experts, hidden, 2 * inter) * hidden ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, inter, hidden) * inter ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        t = x.reshape(b * s, h)
        with torch.autocast(device_type=t.device.type, enabled=False):
            scores = F.linear(t.float(), self.gate.float()).softmax(-1)
        w, idx = scores.topk(self.top_k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(t.dtype)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        rows = order // self.top_k
        counts = torch.histc(flat.float(), bins=self.experts, min=0, max=self.experts - 1)
        offs = counts.cumsum(0).to(torch.int32)
        y = self.mm(t[rows], self.w13, offs)
        gate, up = y.chunk(2, dim=-1)
        y = self.mm(F.silu(gate) * up, self.w2, offs) * w.reshape(-1)[order, None]
        if self.in_place:
            out = torch.zeros_like(t)
            index_add_rows_(out, rows, y)
            return out.view(b, s, h)
        return scatter_add_rows(torch.zeros_like(t), rows, y).view(b, s, h)
