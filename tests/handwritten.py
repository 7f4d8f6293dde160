"""Decoders written by hand, outside ``transformers``: the constructs hand-written models use that
HF's do not (issue 14). Tiny, random weights, exported as the README says."""

from __future__ import annotations

from collections.abc import Callable

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


class Relu2MoE(BmmMoE):
    """Non-gated experts with a squared ReLU (``relu(x @ up) ** 2 @ down``, Nemotron-H's experts),
    over stacked weights as :class:`BmmMoE`."""

    def __init__(self, hidden: int, inter: int, experts: int = 4, top_k: int = 2) -> None:
        super().__init__(hidden, inter, experts, top_k)
        self.gate_up = nn.Parameter(torch.randn(experts, hidden, inter) * hidden ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        t = x.reshape(b * s, h)
        top, idx = self.router(t).softmax(-1).topk(self.top_k, dim=-1)
        weights = torch.zeros(t.shape[0], self.gate_up.shape[0], dtype=t.dtype).scatter(-1, idx, top)  # [T, E]
        xs = t.unsqueeze(0).expand(self.gate_up.shape[0], b * s, h)
        y = torch.bmm(F.relu(torch.bmm(xs, self.gate_up)).square(), self.down)  # [E, T, H]
        return (y * weights.t().unsqueeze(-1)).sum(0).view(b, s, h)


class LoopMoE(nn.Module):
    """Top-k MoE looping over its experts, each run only on the tokens routed to it (selected by
    ``torch.where`` on the routing mask) and scattered back with ``index_add_``: the older
    Mixtral-style loop many hand-written MoEs keep (data-dependent token counts per expert)."""

    def __init__(self, hidden: int, inter: int, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden, inter) for _ in range(experts))

    def route(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing weights and the chosen experts, ``[T, K]`` each."""
        top, idx = self.router(t).softmax(-1).topk(self.top_k, dim=-1)
        return top / top.sum(-1, keepdim=True), idx

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """What the experts read of the token rows."""
        return t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        t = x.reshape(b * s, h)
        top, idx = self.route(t)
        rows = self.rows(t)
        out = torch.zeros_like(t)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            out.index_add_(0, tok, expert(rows[tok]) * top[tok, slot, None])
        return out.view(b, s, h)


class NormedMoE(LoopMoE):
    """Top-k experts reading their own norm of the rows (an RMSNorm with a weight, the router
    reading the rows as they came) and a learned per-expert scale on the routing weights,
    gathered at the chosen experts (Gemma-4's MoE block)."""

    def __init__(self, hidden: int, inter: int, experts: int = 4, top_k: int = 2) -> None:
        super().__init__(hidden, inter, experts, top_k)
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.per_expert_scale = nn.Parameter(torch.rand(experts) + 0.5)
        nn.init.uniform_(self.norm.weight, 0.5, 1.5)

    def route(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, idx = super().route(t)
        return top * self.per_expert_scale[idx], idx

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        return self.norm(t)


class BiasedRouterMoE(LoopMoE):
    """Top-k over the router's scores plus a score-correction buffer, the router's weight cast to
    fp32 in the forward (``F.linear(x.float(), w.float())``), the chosen scores through a sigmoid
    (DeepSeek-style routing written as Kolibri's router writes it)."""

    def __init__(self, hidden: int, inter: int, experts: int = 4, top_k: int = 2) -> None:
        super().__init__(hidden, inter, experts, top_k)
        self.register_buffer("score_bias", torch.linspace(-0.2, 0.2, experts))

    def route(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(t.float(), self.router.weight.float())
        idx = torch.topk(logits + self.score_bias, self.top_k, dim=-1)[1]
        return logits.gather(1, idx).sigmoid(), idx


class EinsumMoE(nn.Module):
    """Top-k MoE as ``einsum`` over stacked ``[E, I, H]`` / ``[E, H, I]`` weights with a dense
    dispatch: every expert on every token, the outputs weighted by a ``one_hot`` routing matrix
    (weights applied to each expert's output; no renormalisation)."""

    def __init__(self, hidden: int, inter: int, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k, self.experts = top_k, experts
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, inter, hidden) * hidden ** -0.5)  # gate
        self.w3 = nn.Parameter(torch.randn(experts, inter, hidden) * hidden ** -0.5)  # up
        self.w2 = nn.Parameter(torch.randn(experts, hidden, inter) * inter ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        t = x.reshape(b * s, h)
        top, idx = self.router(t).softmax(-1).topk(self.top_k, dim=-1)
        dense = (F.one_hot(idx, self.experts).to(t.dtype) * top[..., None]).sum(1)  # [T, E]
        hid = F.silu(torch.einsum("th,eih->eti", t, self.w1)) * torch.einsum("th,eih->eti", t, self.w3)
        y = torch.einsum("eti,ehi->eth", hid, self.w2)
        return torch.einsum("eth,te->th", y, dense).view(b, s, h)


class PutMoE(nn.Module):
    """Top-k MoE looping over experts found by ``nonzero`` on the routing mask, each expert a
    plain GELU MLP with biases, the result written by ``out[rows] += y`` (``index_put_`` with
    accumulate); a sigmoid router whose choice adds a score bias, the routing weights the
    unbiased scores gathered at the chosen experts and renormalised (DeepSeek-V3's rule)."""

    def __init__(self, hidden: int, inter: int, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.register_buffer("score_bias", torch.linspace(-0.1, 0.1, experts))
        self.ups = nn.ModuleList(nn.Linear(hidden, inter) for _ in range(experts))
        self.downs = nn.ModuleList(nn.Linear(inter, hidden) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        t = x.reshape(b * s, h)
        scores = self.router(t).sigmoid()
        idx = (scores + self.score_bias).topk(self.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(t)
        for e, (up, down) in enumerate(zip(self.ups, self.downs, strict=True)):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            out[rows] += down(F.gelu(up(t[rows]))) * w[rows, slot, None]
        return out.view(b, s, h)


class SortMoE(nn.Module):
    """Top-k by ``sort`` (descending) sliced to its first K, the routing weight scaling each
    expert's input, the experts a ``bmm`` over stacked ``[E, H, 2I]`` / ``[E, I, H]`` weights
    gathered per (token, expert) pair, combined by ``scatter_add`` over the pairs' tokens."""

    def __init__(self, hidden: int, inter: int, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, hidden, 2 * inter) * hidden ** -0.5)
        self.w_out = nn.Parameter(torch.randn(experts, inter, hidden) * inter ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        t = x.reshape(b * s, h)
        vals, order = self.router(t).softmax(-1).sort(-1, descending=True)
        idx, w = order[:, :self.top_k], vals[:, :self.top_k]
        rows = torch.arange(t.shape[0]).repeat_interleave(self.top_k)
        pairs = (t[rows] * w.reshape(-1, 1))[:, None, :]  # [T K, 1, H]
        gate, up = torch.bmm(pairs, self.w_in[idx.reshape(-1)]).squeeze(1).chunk(2, dim=-1)
        y = torch.bmm((F.silu(gate) * up)[:, None, :], self.w_out[idx.reshape(-1)]).squeeze(1)
        return torch.zeros_like(t).scatter_add(0, rows[:, None].expand(-1, h), y).view(b, s, h)


class Top1MoE(nn.Module):
    """One expert per token by ``argmax`` (a ``[T]`` choice, its probability ``[T]`` by ``max``),
    a loop over the experts selecting tokens with ``where``, ReLU experts, ``index_add_``."""

    def __init__(self, hidden: int, inter: int, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(hidden, inter, bias=False), nn.ReLU(),
                                                   nn.Linear(inter, hidden, bias=False)) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        t = x.reshape(b * s, h)
        probs = self.router(t).softmax(-1)
        idx, w = probs.argmax(-1), probs.amax(-1)
        out = torch.zeros_like(t)
        for e, expert in enumerate(self.experts):
            (rows,) = torch.where(idx == e)
            out.index_add_(0, rows, expert(t[rows]) * w[rows, None])
        return out.view(b, s, h)


class PerHeadNormAttention(GQAAttention):
    """q/k LayerNorm per head after the head view: statistics over head_dim, each head its own
    weight and bias ``[heads, head_dim]`` (Chameleon's ``F.layer_norm(x, (D,)) * w + b``, or
    Cohere's mean / variance written out, ``manual``); the keys read by ``.mT``."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, manual: bool = False) -> None:
        super().__init__(hidden, heads, kv_heads)
        d, self.manual = self.head_dim, manual
        self.q_w, self.q_b = nn.Parameter(1 + 0.1 * torch.randn(heads, d)), nn.Parameter(0.1 * torch.randn(heads, d))
        self.k_w, self.k_b = (nn.Parameter(1 + 0.1 * torch.randn(kv_heads, d)),
                              nn.Parameter(0.1 * torch.randn(kv_heads, d)))

    def _norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not self.manual:
            return F.layer_norm(x, (self.head_dim,)) * w + b
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + 1e-5) * w + b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self._norm(self.q(x).view(b, s, self.heads, self.head_dim), self.q_w, self.q_b).transpose(1, 2)
        k = self._norm(self.k(x).view(b, s, self.kv_heads, self.head_dim), self.k_w, self.k_b).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.mT) * self.head_dim ** -0.5  # (explicit attention: the key transposed by .mT)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.o(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


def _with_attention(make: Callable[[], nn.Module]) -> GQADecoder:
    """A :class:`GQADecoder` whose every block's attention is ``make()`` (made after the decoder, in
    block order: the seeded weights of each factory stay as they were)."""
    model = GQADecoder()
    for block in model.layers:
        block.attn = make()
    return model


def per_head_norm() -> GQADecoder:
    """Chameleon-style per-head q/k LayerNorm (``F.layer_norm`` over head_dim, ``[H, D]`` affine)."""
    return _with_attention(lambda: PerHeadNormAttention(64, 4, 2))


def per_head_norm_manual() -> GQADecoder:
    """Cohere-style per-head q/k LayerNorm (mean and variance written out, ``[H, D]`` weights)."""
    return _with_attention(lambda: PerHeadNormAttention(64, 4, 2, manual=True))


class GroupedQKVAttention(nn.Module):
    """q/k/v in one biased linear laid out per KV group (each group's query heads, then its K head,
    then its V head: Falcon's new decoder architecture), taken apart by slicing a ``[B, S, G, Q + 2,
    D]`` view; the K/V heads expanded to the query heads. ``groups=1``: multi-query attention.
    ``form``: ``"slice"`` (as above), ``"index"`` (K and V picked by ``[..., [-2]]``), ``"split"`` (one group,
    ``split([Q, 1, 1])`` of a ``[B, S, Q +
    2, D]`` view: Falcon's old multi-query layout) or ``"unbind"`` (``[q_h, k_h, v_h]`` per head,
    ``unflatten(-2, (H, 3)).unbind(-2)``: Falcon's old multi-head layout)."""

    def __init__(self, hidden: int = 64, heads: int = 4, groups: int = 1, form: str = "slice") -> None:
        super().__init__()
        self.form = form
        self.groups, self.per_group, self.head_dim = groups, heads // groups, hidden // heads
        width = 3 * heads if form == "unbind" else groups * (self.per_group + 2)
        self.qkv = nn.Linear(hidden, width * self.head_dim)
        self.o = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        g, n, d = self.groups, self.per_group, self.head_dim
        if self.form == "unbind":
            return self.qkv(x).view(b, s, 3 * n * g, d).unflatten(-2, (n * g, 3)).unbind(-2)
        if self.form == "split":
            q, k, v = self.qkv(x).view(b, s, n + 2, d).split([n, 1, 1], dim=-2)
            return q, k.expand(b, s, n, d), v.expand(b, s, n, d)
        qkv = self.qkv(x).view(b, s, g, n + 2, d)
        if self.form == "index":  # (transformers 5.24's Falcon: K and V picked by a list index)
            q = qkv[:, :, :, :-2]
            k, v = (torch.broadcast_to(t, q.shape).flatten(2, 3) for t in (qkv[:, :, :, [-2]], qkv[:, :, :, [-1]]))
            return q.flatten(2, 3), k, v
        q = qkv[:, :, :, :n].reshape(b, s, g * n, d)
        k, v = (t.expand(b, s, g, n, d).reshape(b, s, g * n, d) for t in (qkv[:, :, :, n:n + 1], qkv[:, :, :, n + 1:]))
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self._heads(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


def grouped_qkv(groups: int = 1, form: str = "slice") -> GQADecoder:
    """A fused q/k/v packed per KV group, by default with one group (multi-query attention: fewer
    KV heads than any TP layout's ranks)."""
    return _with_attention(lambda: GroupedQKVAttention(groups=groups, form=form))


class BatchMixingMLP(nn.Module):
    """An MLP that is not per token: it adds the mean over the batch (sequences mix)."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))) + x.mean(0, keepdim=True)


def batch_mixing() -> GQADecoder:
    """A decoder whose MLP mixes the sequences of its batch: an FFN rank cannot fan it in."""
    model = GQADecoder()
    for block in model.layers:
        block.mlp = BatchMixingMLP()
    return model


class TokenMixingMLP(nn.Module):
    """An MLP whose output subtracts its mean over every token of the call (batch and sequence):
    on an FFN rank that fans in peers, the mean is over all peers' tokens."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.relu(self.up(x)))
        return y - y.mean(dim=(0, 1), keepdim=True)


class FloatInputDecoder(nn.Module):
    """Decoder blocks on a float input (hidden states in, normed hidden states out: no token ids),
    each MLP a :class:`TokenMixingMLP`."""

    def __init__(self, hidden: int = 64, layers: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(Block(hidden, 4, 2, 128) for _ in range(layers))
        for block in self.layers:
            block.mlp = TokenMixingMLP(hidden)
        self.norm = RMSNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def _lib_moe(hidden: int, inter: int, form: str = "lib") -> nn.Module:
    """tests/moelib.py's experts; ``form``: "lib" (its ops), "aten" (torch._grouped_mm), "in_place"
    (its combine an in-place op)."""
    from moelib import LibMoE  # (registers moelib::scatter_add_rows)

    return LibMoE(hidden, inter, aten_mm=form == "aten", in_place=form == "in_place")


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, inter: int, moe: bool | str = False) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(hidden), GQAAttention(hidden, heads, kv_heads)
        mlp = {False: SwiGLU, True: BmmMoE, "bmm": BmmMoE, "loop": LoopMoE, "einsum": EinsumMoE, "put": PutMoE,
               "sort": SortMoE, "top1": Top1MoE, "relu2": Relu2MoE, "normed": NormedMoE, "biased": BiasedRouterMoE,
               "lib": _lib_moe}[moe]
        self.mlp_norm, self.mlp = RMSNorm(hidden), mlp(hidden, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x))
        return h + self.mlp(self.mlp_norm(h))


class GQADecoder(nn.Module):
    def __init__(self, vocab: int = 128, hidden: int = 64, heads: int = 4, kv_heads: int = 2, layers: int = 2,
                 inter: int = 128, seed: int = 0, moe: bool | str = False) -> None:
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


class Looped(GQADecoder):
    """A looped decoder: its numbered layers run twice over (``for _ in range(2): for layer in
    layers``, as recurrent-depth models reapply theirs): four applications of two layers' weights."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for _ in range(2):
            for layer in self.layers:
                x = layer(x)
        return self.head(self.norm(x))


class SharedBlock(nn.Module):
    """ALBERT-style weight sharing: one block applied as every layer (each weight read by every
    layer: sliced once under TP)."""

    def __init__(self, vocab: int = 128, hidden: int = 64, layers: int = 3, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.block, self.layers = nn.Embedding(vocab, hidden), Block(hidden, 4, 2, 128), layers
        self.norm, self.head = RMSNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for _ in range(self.layers):
            x = self.block(x)
        return self.head(self.norm(x))


class GPTBlock(nn.Module):
    """nanoGPT's block: LayerNorm with bias, fused ``c_attn`` split into q/k/v, GELU MLP."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.c_attn, self.c_proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.c_fc, self.mlp_proj = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (t.view(b, s, self.heads, c // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, s, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """A nanoGPT-style GPT: blocks in ``transformer.h``, learned positions, tied embedding and head."""

    def __init__(self, vocab: int = 128, hidden: int = 64, heads: int = 4, layers: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, hidden), wpe=nn.Embedding(64, hidden),
            h=nn.ModuleList(GPTBlock(hidden, heads) for _ in range(layers)), ln_f=nn.LayerNorm(hidden)))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.transformer.wte(ids) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class Flat(nn.Module):
    """Two decoder layers held as plain attributes (no container, no ``.N`` in any module path):
    only the structural policy can find them."""

    def __init__(self, vocab: int = 128, hidden: int = 64, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.first, self.second = Block(hidden, 4, 2, 128), Block(hidden, 4, 2, 128)
        self.norm, self.head = RMSNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.second(self.first(self.embed(ids)))))


class TorchPostNorm(nn.Module):
    """PyTorch's own ``nn.TransformerEncoderLayer`` (post-norm: ``x = norm(x + block(x))``, the
    original Transformer's order) with a causal mask: ``nn.MultiheadAttention`` with a packed
    ``in_proj`` unflattened into q/k/v, the MLP as ``linear1``/``linear2`` with no MLP module."""

    def __init__(self, vocab: int = 128, hidden: int = 64, layers: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(hidden, 4, 2 * hidden, dropout=0.0, batch_first=True)
                                    for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x, s = self.embed(ids), ids.shape[1]
        mask = torch.full((s, s), float("-inf")).triu(1)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(x)


class ParallelBlock(nn.Module):
    """GPT-J's parallel block written with raw parameters: one norm, ``x + attn(h) + mlp(h)``, every
    projection an ``x @ W`` matmul, the fused q/k/v cut by ``split``; no submodule to name the MLP."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(hidden)
        self.wqkv = nn.Parameter(torch.randn(hidden, 3 * hidden) * 0.05)
        self.wo = nn.Parameter(torch.randn(hidden, hidden) * 0.05)
        self.w1 = nn.Parameter(torch.randn(hidden, 4 * hidden) * 0.05)
        self.w2 = nn.Parameter(torch.randn(4 * hidden, hidden) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        h = self.ln(x)
        q, k, v = ((h @ self.wqkv).split(c, -1))
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, c)
        return x + y @ self.wo + F.gelu(h @ self.w1) @ self.w2


class EinsumBlock(nn.Module):
    """Attention in ``einsum`` with a ``tril`` mask buffer and ``masked_fill`` softmax, the fused
    q/k/v viewed as ``[B, S, 3, H, D]`` and taken apart by ``unbind`` (timm's and many research
    codebases' way), ``nn.RMSNorm``, the MLP an ``nn.Sequential``."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.qkv, self.o = nn.Linear(hidden, 3 * hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
        self.register_buffer("tril", torch.tril(torch.ones(64, 64)).bool(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        q, k, v = self.qkv(self.n1(x)).reshape(b, s, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        att = torch.einsum("bhid,bhjd->bhij", q, k) * (c // self.heads) ** -0.5
        att = att.masked_fill(~self.tril[:s, :s], float("-inf")).softmax(-1)
        y = torch.einsum("bhij,bhjd->bihd", att, v).reshape(b, s, c)
        x = x + self.o(y)
        return x + self.mlp(self.n2(x))


class Stack(nn.Module):
    """Embedding, a list of ``block(hidden, 4)``, a final norm and a head tied to the embedding."""

    def __init__(self, block: type[nn.Module], vocab: int = 128, hidden: int = 64, layers: int = 2,
                 seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(block(hidden, 4) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.t()


def bmm_moe() -> GQADecoder:
    return GQADecoder(moe="bmm")


def loop_moe() -> GQADecoder:
    return GQADecoder(moe="loop")


def einsum_moe() -> GQADecoder:
    return GQADecoder(moe="einsum")


def put_moe() -> GQADecoder:
    return GQADecoder(moe="put")


def sort_moe() -> GQADecoder:
    return GQADecoder(moe="sort")


def top1_moe() -> GQADecoder:
    return GQADecoder(moe="top1")


def relu2_moe() -> GQADecoder:
    return GQADecoder(moe="relu2")


def normed_moe() -> GQADecoder:
    return GQADecoder(moe="normed")


def biased_moe() -> GQADecoder:
    return GQADecoder(moe="biased")


def lib_moe() -> GQADecoder:
    """Experts of another model library (``tests/moelib.py``): its own combine op, an autocast router."""
    return GQADecoder(moe="lib")


class MetaAttention(nn.Module):
    """Meta's reference Llama attention (llama's ``model.py``, gpt-fast, torchtitan): rotary as a
    complex product (``view_as_complex`` of head_dim pairs times ``freqs_cis``, ``view_as_real``
    back), K/V heads repeated by ``expand`` + ``reshape`` (``repeat_kv``), scores by ``matmul`` with
    an additive causal mask, softmax in fp32."""

    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.wq = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False)

    @staticmethod
    def _rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs_cis.view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        b, s, kv, d = x.shape
        rep = self.heads // kv
        return x[:, :, :, None, :].expand(b, s, kv, rep, d).reshape(b, s, kv * rep, d)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self._rotate(self.wq(x).view(b, s, self.heads, self.head_dim), freqs_cis)
        k = self._rotate(self.wk(x).view(b, s, self.kv_heads, self.head_dim), freqs_cis)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), self._repeat_kv(k).transpose(1, 2), self._repeat_kv(v).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3)) / self.head_dim ** 0.5 + mask
        out = torch.matmul(F.softmax(scores.float(), dim=-1).type_as(q), v)
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))


class MetaBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, inter: int) -> None:
        super().__init__()
        self.attention, self.attention_norm = MetaAttention(hidden, heads, kv_heads), RMSNorm(hidden)
        self.feed_forward, self.ffn_norm = SwiGLU(hidden, inter), RMSNorm(hidden)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class MetaLlama(nn.Module):
    """Meta's reference Llama (blocks ``layers.N`` with ``attention`` / ``feed_forward``): a complex
    ``freqs_cis`` buffer, the mask built in ``forward``."""

    def __init__(self, vocab: int = 128, hidden: int = 64, heads: int = 4, kv_heads: int = 2, layers: int = 2,
                 inter: int = 128, seed: int = 0, max_seq: int = 64) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok_embeddings = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(MetaBlock(hidden, heads, kv_heads, inter) for _ in range(layers))
        self.norm, self.output = RMSNorm(hidden), nn.Linear(hidden, vocab, bias=False)
        d = hidden // heads
        freqs = torch.outer(torch.arange(max_seq).float(), 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(freqs), freqs), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        h = self.tok_embeddings(ids)
        mask = torch.full((s, s), float("-inf"), device=ids.device).triu(1)
        for layer in self.layers:
            h = layer(h, self.freqs_cis[:s], mask)
        return self.output(self.norm(h))


#: the hand-written decoders the tests run, by name (each a factory of no arguments:
#: ``examples/compile_backend.py --model tests/handwritten.py:<factory>``)
class CachedAttention(nn.Module):
    """GQA attention over a static KV cache kept as buffers ``[batch, kv_heads, max_len, d]``,
    written in place at ``cache_position`` with ``index_copy_``; the causal mask built from the
    positions (``arange(max_len) <= position``) and broadcast over batch and heads, not expanded."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, batch: int, max_len: int,
                 index_put: bool = False) -> None:
        super().__init__()
        self.attn, self.index_put = GQAAttention(hidden, heads, kv_heads), index_put
        shape = (batch, kv_heads, max_len, hidden // heads)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        a = self.attn
        b, s, _ = x.shape
        q = a.q(x).view(b, s, a.heads, a.head_dim).transpose(1, 2)
        k = a.k(x).view(b, s, a.kv_heads, a.head_dim).transpose(1, 2)
        v = a.v(x).view(b, s, a.kv_heads, a.head_dim).transpose(1, 2)
        if self.index_put:  # gpt-fast's KVCache.update: k_cache[:, :, input_pos] = k
            self.k_cache[:, :, pos] = k
            self.v_cache[:, :, pos] = v
        else:
            self.k_cache.index_copy_(2, pos, k)
            self.v_cache.index_copy_(2, pos, v)
        rep = a.heads // a.kv_heads
        keys = self.k_cache.repeat_interleave(rep, dim=1)
        values = self.v_cache.repeat_interleave(rep, dim=1)
        mask = torch.arange(self.k_cache.shape[2], device=x.device)[None, :] <= pos[:, None]  # [s, max_len]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return a.o(out.transpose(1, 2).reshape(b, s, a.heads * a.head_dim))


class CachedDecoder(nn.Module):
    """A hand-written decoder with its own static KV cache: ``forward(ids, cache_position)``, a
    prefill of the positions given, then decode steps of one token each (the batch is the
    cache's)."""

    def __init__(self, batch: int = 3, max_len: int = 16, vocab: int = 128, hidden: int = 64, heads: int = 4,
                 kv_heads: int = 2, layers: int = 2, inter: int = 128, seed: int = 0, index_put: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.norms = nn.ModuleList(nn.ModuleList([RMSNorm(hidden), RMSNorm(hidden)]) for _ in range(layers))
        self.attns = nn.ModuleList(CachedAttention(hidden, heads, kv_heads, batch, max_len, index_put)
                                   for _ in range(layers))
        self.mlps = nn.ModuleList(SwiGLU(hidden, inter) for _ in range(layers))
        self.norm, self.head = RMSNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for (n1, n2), attn, mlp in zip(self.norms, self.attns, self.mlps, strict=True):
            x = x + attn(n1(x), cache_position)
            x = x + mlp(n2(x))
        return self.head(self.norm(x))


class GptFastDecoder(CachedDecoder):
    """The cached decoder as gpt-fast writes it: ``forward(ids, input_pos)``, the cache updated by
    ``index_put_`` (``k_cache[:, :, input_pos] = k``)."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw, index_put=True)

    def forward(self, ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return super().forward(ids, input_pos)


def export_cached(model: CachedDecoder, seq: int = 4, max_seq: int = 8,
                  vocab: int = 128) -> torch.export.ExportedProgram:
    """The cached decoder exported with its batch static (the cache's) and the sequence dynamic."""
    batch = model.attns[0].k_cache.shape[0]
    ids = torch.randint(1, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    dim = torch.export.Dim("seq", min=1, max=max_seq)
    pos = "input_pos" if isinstance(model, GptFastDecoder) else "cache_position"
    with torch.no_grad():
        return torch.export.export(model.eval(), (ids, torch.arange(seq)),
                                   dynamic_shapes={"ids": {1: dim}, pos: {0: dim}})


def parallel() -> Stack:
    return Stack(ParallelBlock)


def einsum() -> Stack:
    return Stack(EinsumBlock)


def torch_postnorm_fastpath_off() -> TorchPostNorm:
    """TorchPostNorm for torch.compile (examples/compile_backend.py's process): PyTorch's eval fast
    path, one fused kernel per layer that dynamo would trace and the backend refuses, turned off as
    that refusal says (torch.export traces the layer's body either way)."""
    torch.backends.mha.set_fastpath_enabled(False)
    return TorchPostNorm()


class SplitHeadNormAttention(GQAAttention):
    """Per-head q/k norms written as the heads split into one-head pieces, a separate
    ``nn.LayerNorm`` module per piece, and a concatenation back (no ``[H, D]`` weight)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__(hidden, heads, kv_heads)
        self.q_norms = nn.ModuleList(nn.LayerNorm(self.head_dim) for _ in range(heads))
        self.k_norms = nn.ModuleList(nn.LayerNorm(self.head_dim) for _ in range(kv_heads))
        for norm in [*self.q_norms, *self.k_norms]:  # (each head its own affine)
            nn.init.normal_(norm.weight, 1.0, 0.1)
            nn.init.normal_(norm.bias, 0.0, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim)
        k = self.k(x).view(b, s, self.kv_heads, self.head_dim)
        q = torch.cat([norm(p) for norm, p in zip(self.q_norms, q.split(1, dim=2), strict=True)], dim=2)
        k = torch.cat([norm(p) for norm, p in zip(self.k_norms, k.split(1, dim=2), strict=True)], dim=2)
        v = self.v(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class BroadcastMQA(GQAAttention):
    """Multi-query attention: one K/V head ``[B, 1, S, D]`` meeting every query head in SDPA by
    broadcasting (no expand or repeat in the graph)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__(hidden, heads, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, 1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, 1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class SharedExpertMoE(nn.Module):
    """Routed experts (``SortMoE``) beside a shared expert (a SwiGLU every token takes, its output
    scaled by a sigmoid gate of the token, as Qwen2-MoE / DeepSeek's shared experts)."""

    def __init__(self, hidden: int, inter: int, routed: str = "sort") -> None:
        super().__init__()
        self.routed = SortMoE(hidden, inter) if routed == "sort" else _lib_moe(hidden, inter, routed)
        self.shared = SwiGLU(hidden, inter)
        self.shared_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed(x) + torch.sigmoid(self.shared_gate(x)) * self.shared(x)


def split_head_norm() -> GQADecoder:
    """Per-head q/k LayerNorms as one module per head over the heads split apart and concatenated."""
    return _with_attention(lambda: SplitHeadNormAttention(64, 4, 2))


def broadcast_mqa() -> GQADecoder:
    """Multi-query attention, its single K/V head broadcast by SDPA."""
    return _with_attention(lambda: BroadcastMQA(64, 4))


def dense_then_moe(routed: str = "sort") -> GQADecoder:
    """A dense MLP in the first layer, an MoE with a shared expert in the others (DeepSeek's
    ``first_k_dense_replace``); ``routed="lib"``: the routed experts of tests/moelib.py."""
    model = GQADecoder(layers=3)
    for block in model.layers[1:]:
        block.mlp = SharedExpertMoE(64, 32, routed)
    return model


def dense_then_in_place_moe() -> GQADecoder:
    """:func:`dense_then_moe` with tests/moelib.py's experts, combined by its in-place op."""
    return dense_then_moe("in_place")


MODELS = {"gqa": GQADecoder, "bmm_moe": bmm_moe, "loop_moe": loop_moe, "einsum_moe": einsum_moe, "put_moe": put_moe,
          "sort_moe": sort_moe, "top1_moe": top1_moe, "relu2_moe": relu2_moe, "normed_moe": normed_moe,
          "biased_moe": biased_moe, "lib_moe": lib_moe,
          "per_head_norm": per_head_norm, "per_head_norm_manual": per_head_norm_manual, "grouped_qkv": grouped_qkv,
          "nanogpt": NanoGPT, "flat": Flat,
          "meta_llama": MetaLlama, "torch_postnorm": TorchPostNorm, "parallel": parallel, "einsum": einsum,
          "shared": SharedBlock, "looped": Looped, "split_head_norm": split_head_norm, "broadcast_mqa": broadcast_mqa,
          "dense_then_moe": dense_then_moe, "dense_then_lib_moe": lambda: dense_then_moe("lib"),
          "dense_then_aten_moe": lambda: dense_then_moe("aten"),
          "dense_then_in_place_moe": dense_then_in_place_moe}
#: factories for the backend's runs that differ from MODELS' (same model, set up for torch.compile)
COMPILE_FACTORIES = {"torch_postnorm": torch_postnorm_fastpath_off}


def export(model: nn.Module, batch: int = 2, seq: int = 5, vocab: int = 128) -> torch.export.ExportedProgram:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    shapes = {"ids": {0: torch.export.Dim("batch", min=1, max=1024), 1: torch.export.Dim.AUTO}}
    with torch.no_grad():
        return torch.export.export(model.eval(), (ids,), dynamic_shapes=shapes)
