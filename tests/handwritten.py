"""Decoders written by hand, outside ``transformers``: the constructs hand-written models use that
HF's do not (issue 14). Tiny, random weights, exported as the README says."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class GQAAttention(nn.Module):
    """Grouped-query attention with the K/V heads expanded by ``repeat_interleave`` and the query
    scaled in place (``mul_``), as many hand-written decoders do."""

    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q.contiguous()
        q.mul_(self.head_dim ** -0.5)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
        return self.o(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class BmmMoE(nn.Module):
    """Top-k MoE whose experts are ``bmm`` over stacked weights ``[E, in, out]`` (every expert on
    every token, weighted by the routing weights, zero for experts not chosen), as transformers'
    ``batched_mm`` experts and many hand-written MoEs compute them."""

    def __init__(self, hidden: int, inter: int, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(experts, hidden, 2 * inter) * hidden ** -0.5)
        self.down = nn.Parameter(torch.randn(experts, inter, hidden) * inter ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        t = x.reshape(b * s, h)
        probs = self.router(t).softmax(-1)
        top, idx = probs.topk(self.top_k, dim=-1)
        weights = torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True))  # [T, E]
        xs = t.unsqueeze(0).expand(self.gate_up.shape[0], b * s, h)  # [E, T, H]
        gate, up = torch.bmm(xs, self.gate_up).chunk(2, dim=-1)
        y = torch.bmm(F.silu(gate) * up, self.down)  # [E, T, H]
        return (y * weights.t().unsqueeze(-1)).sum(0).view(b, s, h)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, inter: int, moe: bool = False) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(hidden), GQAAttention(hidden, heads, kv_heads)
        self.mlp_norm, self.mlp = RMSNorm(hidden), (BmmMoE(hidden, inter) if moe else SwiGLU(hidden, inter))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x))
        return h + self.mlp(self.mlp_norm(h))


class GQADecoder(nn.Module):
    def __init__(self, vocab: int = 128, hidden: int = 64, heads: int = 4, kv_heads: int = 2, layers: int = 2,
                 inter: int = 128, seed: int = 0, moe: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, kv_heads, inter, moe) for _ in range(layers))
        self.norm, self.head = RMSNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def export(model: nn.Module, batch: int = 2, seq: int = 5, vocab: int = 128) -> torch.export.ExportedProgram:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    shapes = {"ids": {0: torch.export.Dim("batch", min=1, max=1024), 1: torch.export.Dim.AUTO}}
    with torch.no_grad():
        return torch.export.export(model.eval(), (ids,), dynamic_shapes=shapes)
