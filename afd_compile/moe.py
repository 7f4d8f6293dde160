"""``afd::moe_experts``: an MoE block's experts as one op (issue 34).

One op for what models write many ways (a loop over experts, gathered weights and ``bmm``,
``torch._grouped_mm`` with offsets, ``einsum`` over stacked weights): the recognition pass that
rewrites those forms into it comes next; this module is the op, its two implementations and its
fake (so export, dynamo, AOT autograd and Inductor keep it as one node).

    out = moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down,
                      activation, gated, weight_first)

- ``x`` ``[T, H]`` tokens; ``topk_ids`` ``[T, K]`` integer expert ids; ``topk_weights`` ``[T, K]``;
- ``w_gate_up`` ``[E, N, H]`` stacked as ``nn.Linear`` weights (``N = 2 I`` gated: the gate is the
  first half, as transformers' ``gate_up_proj`` chunks; ``N = I`` plain), ``w_down`` ``[E, H, I]``;
  ``b_gate_up`` ``[E, N]`` and ``b_down`` ``[E, H]`` optional;
- ``activation`` one of :data:`ACTIVATIONS`; ``gated``: ``act(gate) * up``, else ``act(up)``;
- ``weight_first``: the routing weight scales the expert's input (else its output, the usual).

Per token ``t``: ``out[t] = sum_k expert(topk_ids[t, k], x[t]) * topk_weights[t, k]``, in ``x``'s
dtype. Linear in ``x`` only when the experts are (they are not): what TP and EP rely on is that
it is a sum over experts (EP) and, for one expert, a row-parallel sum over ``I`` (TP), which the
sharding rules of the op say once.

Implementations: on CUDA with bf16 and ``torch._grouped_mm`` (sm90), a grouped GEMM over the
(token, expert) pairs sorted by expert, with no host synchronisation (counts by ``scatter_add``,
offsets by ``cumsum``): a CUDA graph captures it whole, sized by ``T x K`` rows. Elsewhere (CPU,
fp32, older GPUs) the reference: a loop over the experts the tokens chose, equal to transformers'
``eager`` experts (it reads the chosen experts on the host: no CUDA graph there).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

#: the activations the op takes, by name (transformers' ``ACT2FN`` names)
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}

def _check(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
           w_down: torch.Tensor, activation: str, gated: bool) -> None:
    where = "afd::moe_experts"
    if activation not in ACTIVATIONS:
        raise ValueError(f"{where}: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    if x.dim() != 2 or ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"{where}: expected x [T, H], topk_ids and topk_weights [T, K]; got {tuple(x.shape)}, "
                         f"{tuple(ids.shape)}, {tuple(weights.shape)}")
    e, n, h = w_gate_up.shape
    inter = n // 2 if gated else n
    if h != x.shape[1] or tuple(w_down.shape) != (e, h, inter) or (gated and n % 2):
        raise ValueError(f"{where}: expected w_gate_up [E, {'2 I' if gated else 'I'}, H={x.shape[1]}] and w_down "
                         f"[E, H, I]; got {tuple(w_gate_up.shape)}, {tuple(w_down.shape)}")


def _expert_mlp(h: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, b_gate_up: torch.Tensor | None,
                b_down: torch.Tensor | None, act, gated: bool) -> torch.Tensor:
    y = F.linear(h, w_gate_up, b_gate_up)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = act(gate) * up
    else:
        y = act(y)
    return F.linear(y, w_down, b_down)


def reference(x, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down, activation, gated, weight_first):
    """The experts the tokens chose, one after another (transformers' ``eager`` experts' order)."""
    act = ACTIVATIONS[activation]
    k = topk_ids.shape[1]
    out = torch.zeros_like(x)
    flat = topk_ids.reshape(-1)
    token = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)
    scale = topk_weights.reshape(-1)
    for e in torch.unique(flat).tolist():
        pair = (flat == e).nonzero().squeeze(1)
        rows = token[pair]
        h = x[rows]
        w = scale[pair, None].to(x.dtype)
        if weight_first:
            h = h * w
        y = _expert_mlp(h, w_gate_up[e], w_down[e], None if b_gate_up is None else b_gate_up[e],
                        None if b_down is None else b_down[e], act, gated)
        if not weight_first:
            y = y * w
        out.index_add_(0, rows, y.to(out.dtype))
    return out


def grouped(x, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down, activation, gated, weight_first):
    """The (token, expert) pairs sorted by expert, two grouped GEMMs, the pairs put back in order
    and summed per token; no host synchronisation (a CUDA graph captures it)."""
    act = ACTIVATIONS[activation]
    n_experts, k = w_gate_up.shape[0], topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    experts, perm = torch.sort(flat)
    rows = perm // k
    h = x[rows]
    w = topk_weights.reshape(-1)[perm, None].to(x.dtype)
    counts = torch.zeros(n_experts, dtype=torch.int32, device=x.device).scatter_add_(
        0, experts.to(torch.int64), torch.ones_like(experts, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    if weight_first:
        h = h * w
    y = torch._grouped_mm(h, w_gate_up.transpose(-2, -1), offs=offs)
    if b_gate_up is not None:
        y = y + b_gate_up[experts]
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = act(gate) * up
    else:
        y = act(y)
    y = torch._grouped_mm(y, w_down.transpose(-2, -1), offs=offs)
    if b_down is not None:
        y = y + b_down[experts]
    if not weight_first:
        y = y * w
    # back to (token, k) order, then each token's K rows summed: deterministic, no atomics
    pairs = torch.empty_like(y)
    pairs[perm] = y
    return pairs.view(x.shape[0], k, x.shape[1]).sum(dim=1)


def can_group(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """The grouped path applies: CUDA, bf16 everywhere, a torch with ``_grouped_mm`` on this GPU
    (sm90 and up), dims the kernel takes (multiples of 16 bytes' worth of bf16)."""
    if x.device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    if {x.dtype, w_gate_up.dtype, w_down.dtype} != {torch.bfloat16}:
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return all(d % 8 == 0 for d in (x.shape[1], w_gate_up.shape[1], w_down.shape[2]))


@torch.library.custom_op("afd::moe_experts", mutates_args=())
def _moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                 w_down: torch.Tensor, b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None, activation: str,
                 gated: bool, weight_first: bool) -> torch.Tensor:
    _check(x, topk_ids, topk_weights, w_gate_up, w_down, activation, gated)
    impl = grouped if can_group(x, w_gate_up, w_down) else reference
    return impl(x, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down, activation, gated, weight_first)


@_moe_experts.register_fake
def _moe_experts_fake(x, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down, activation, gated,
                      weight_first):
    _check(x, topk_ids, topk_weights, w_gate_up, w_down, activation, gated)
    return torch.empty_like(x)


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
                activation: str = "silu", gated: bool = True, weight_first: bool = False) -> torch.Tensor:
    """``torch.ops.afd.moe_experts`` with keyword defaults (see the module docstring)."""
    return torch.ops.afd.moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down, activation,
                                     gated, weight_first)
