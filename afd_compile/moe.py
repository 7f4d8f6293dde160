"""``afd::moe_experts``: an MoE block's experts as one op (issue 34).

One op for what models write many ways (a loop over experts, gathered weights and ``bmm``,
``torch._grouped_mm`` with offsets, ``einsum`` over stacked weights): the recognition pass that
rewrites those forms into it comes next; this module is the op, its two implementations and its
fake (so export, dynamo, AOT autograd and Inductor keep it as one node).

    out = moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down,
                      activation, gated, weight_first, alpha=1.702, limit=7.0)

- ``x`` ``[T, H]`` tokens; ``topk_ids`` ``[T, K]`` integer expert ids; ``topk_weights`` ``[T, K]``;
- ``w_gate_up`` ``[E, N, H]`` stacked as ``nn.Linear`` weights (``N = 2 I`` gated: the gate is the
  first half, as transformers' ``gate_up_proj`` chunks; ``N = I`` plain), ``w_down`` ``[E, H, I]``;
  ``b_gate_up`` ``[E, N]`` and ``b_down`` ``[E, H]`` optional;
- ``activation`` one of :data:`ACTIVATIONS`; ``gated``: ``act(gate) * up``, else ``act(up)``;
  or ``"swiglu_oai"`` (gated only: GPT-OSS's clamped GLU, ``(clamp(up, -limit, limit) + 1) *
  g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=limit)``; ``alpha`` and ``limit`` are
  read by it alone);
- ``weight_first``: the routing weight scales the expert's input (else its output, the usual).

Per token ``t``: ``out[t] = sum_k expert(topk_ids[t, k], x[t]) * topk_weights[t, k]``, in ``x``'s
dtype; a pair whose id is outside ``[0, E)`` takes no expert and adds nothing (no weights read,
no rows computed for it: how an FFN rank's fixed slot leaves out its padded rows). Linear in ``x`` only when the experts
are (they are not): what TP and EP rely on is that
it is a sum over experts (EP) and, for one expert, a row-parallel sum over ``I`` (TP), which the
sharding rules of the op say once.

Implementations (``implementation()`` picks one per call; ``AFD_MOE_IMPL`` forces one:
``fused``, ``grouped_mm``, ``reference``; ``auto``, the default, takes the first that applies):

- ``fused`` (``moe_triton.py``): on CUDA with bf16 / fp16 and Triton, two Triton kernels over the
  (token, expert) pairs sorted by expert and padded per expert, each chosen expert's weights
  read once per block of its rows, the activation in the first kernel's epilogue; no host
  synchronisation (a CUDA graph captures it whole, sized by ``T x K`` rows);
- ``grouped_mm``: on CUDA with bf16 and ``torch._grouped_mm`` (sm90), the same sort, two grouped
  GEMMs, the activation between (no host synchronisation either);
- ``reference``: anywhere (CPU, fp32): a loop over the experts the tokens chose, equal to
  transformers' ``eager`` experts (it reads the chosen experts on the host: no CUDA graph there).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

#: the activations the op takes, by name (transformers' ``ACT2FN`` names)
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # (Nemotron-H's non-gated experts: ACT2FN's "relu2")
}
#: gated activations of their own (not ``act(gate) * up``), with the op's ``alpha`` and ``limit``
GLU_ACTIVATIONS = ("swiglu_oai",)

def _check(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
           w_down: torch.Tensor, activation: str, gated: bool) -> None:
    where = "afd::moe_experts"
    if activation not in ACTIVATIONS and not (gated and activation in GLU_ACTIVATIONS):
        raise ValueError(f"{where}: activation {activation!r} is not one of {sorted(ACTIVATIONS)}, nor (gated) "
                         f"{list(GLU_ACTIVATIONS)}")
    if x.dim() != 2 or ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"{where}: expected x [T, H], topk_ids and topk_weights [T, K]; got {tuple(x.shape)}, "
                         f"{tuple(ids.shape)}, {tuple(weights.shape)}")
    e, n, h = w_gate_up.shape
    inter = n // 2 if gated else n
    if h != x.shape[1] or tuple(w_down.shape) != (e, h, inter) or (gated and n % 2):
        raise ValueError(f"{where}: expected w_gate_up [E, {'2 I' if gated else 'I'}, H={x.shape[1]}] and w_down "
                         f"[E, H, I]; got {tuple(w_gate_up.shape)}, {tuple(w_down.shape)}")


def _activate(y: torch.Tensor, activation: str, gated: bool, alpha: float, limit: float) -> torch.Tensor:
    """The expert's activation of its up projection ``y`` (gate half first when gated)."""
    if not gated:
        return ACTIVATIONS[activation](y)
    gate, up = y.chunk(2, dim=-1)
    if activation == "swiglu_oai":
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return ACTIVATIONS[activation](gate) * up


def _expert_mlp(h: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, b_gate_up: torch.Tensor | None,
                b_down: torch.Tensor | None, activation: str, gated: bool, alpha: float, limit: float) -> torch.Tensor:
    y = _activate(F.linear(h, w_gate_up, b_gate_up), activation, gated, alpha, limit)
    return F.linear(y, w_down, b_down)


def reference(x, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down, activation, gated, weight_first,
              alpha=1.702, limit=7.0):
    """The experts the tokens chose, one after another (transformers' ``eager`` experts' order)."""
    k = topk_ids.shape[1]
    out = torch.zeros_like(x)
    flat = topk_ids.reshape(-1)
    token = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)
    scale = topk_weights.reshape(-1)
    for e in torch.unique(flat).tolist():
        if not 0 <= e < w_gate_up.shape[0]:  # (a pair that takes no expert)
            continue
        pair = (flat == e).nonzero().squeeze(1)
        rows = token[pair]
        h = x[rows]
        w = scale[pair, None].to(x.dtype)
        if weight_first:
            h = h * w
        y = _expert_mlp(h, w_gate_up[e], w_down[e], None if b_gate_up is None else b_gate_up[e],
                        None if b_down is None else b_down[e], activation, gated, alpha, limit)
        if not weight_first:
            y = y * w
        out.index_add_(0, rows, y.to(out.dtype))
    return out


def grouped(x, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down, activation, gated, weight_first,
            alpha=1.702, limit=7.0):
    """The (token, expert) pairs sorted by expert, two grouped GEMMs, the pairs put back in order
    and summed per token; no host synchronisation (a CUDA graph captures it)."""
    n_experts, k = w_gate_up.shape[0], topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    # (a pair that takes no expert, an id outside [0, E), sorts past the real ones as E)
    experts, perm = torch.sort(torch.where((flat >= 0) & (flat < n_experts), flat, n_experts))
    rows = perm // k
    h = x[rows]
    w = topk_weights.reshape(-1)[perm, None].to(x.dtype)
    took = experts < n_experts
    counts = torch.zeros(n_experts + 1, dtype=torch.int32, device=x.device).scatter_add_(
        0, experts.to(torch.int64), torch.ones_like(experts, dtype=torch.int32))
    offs = torch.cumsum(counts[:n_experts], 0, dtype=torch.int32)
    if weight_first:
        h = h * w
    y = torch._grouped_mm(h, w_gate_up.transpose(-2, -1), offs=offs)
    if b_gate_up is not None:
        y = y + b_gate_up[experts.clamp(max=n_experts - 1)]
    y = _activate(y, activation, gated, alpha, limit)
    y = torch._grouped_mm(y, w_down.transpose(-2, -1), offs=offs)
    if b_down is not None:
        y = y + b_down[experts.clamp(max=n_experts - 1)]
    if not weight_first:
        y = y * w
    y = torch.where(took[:, None], y, 0)  # (rows past the last group: no expert's)
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


@functools.cache
def _has_triton() -> bool:
    try:
        from . import moe_triton  # noqa: F401
    except ImportError:
        return False
    return True


def can_fuse(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """The fused (Triton) path applies: CUDA, one half-precision dtype everywhere, Triton."""
    return x.device.type == "cuda" and len({x.dtype, w_gate_up.dtype, w_down.dtype}) == 1 and \
        x.dtype in (torch.bfloat16, torch.float16) and _has_triton()


#: ``AFD_MOE_IMPL`` values
IMPLEMENTATIONS = ("auto", "fused", "grouped_mm", "reference")


def implementation(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> str:
    """Which implementation runs these operands (module docstring); a forced one that does not
    apply is an error naming why, never a silent fallback."""
    want = os.environ.get("AFD_MOE_IMPL", "auto")
    if want not in IMPLEMENTATIONS:
        raise ValueError(f"afd::moe_experts: AFD_MOE_IMPL={want!r} is not one of {list(IMPLEMENTATIONS)}")
    ok = {"fused": can_fuse(x, w_gate_up, w_down), "grouped_mm": can_group(x, w_gate_up, w_down), "reference": True}
    if want == "auto":
        return next(name for name, applies in ok.items() if applies)
    if not ok[want]:
        raise ValueError(f"afd::moe_experts: AFD_MOE_IMPL={want} does not apply to x {x.dtype} on {x.device} with "
                         f"weights {w_gate_up.dtype} {tuple(w_gate_up.shape)} (fused: CUDA, bf16/fp16, Triton; "
                         "grouped_mm: CUDA sm90, bf16, dims multiple of 8)")
    return want


@torch.library.custom_op("afd::moe_experts", mutates_args=())
def _moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                 w_down: torch.Tensor, b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None, activation: str,
                 gated: bool, weight_first: bool, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    _check(x, topk_ids, topk_weights, w_gate_up, w_down, activation, gated)
    which = implementation(x, w_gate_up, w_down)
    if which == "fused":
        from .moe_triton import fused as impl
    else:
        impl = grouped if which == "grouped_mm" else reference
    return impl(x, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down, activation, gated, weight_first,
                alpha, limit)


@_moe_experts.register_fake
def _moe_experts_fake(x, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down, activation, gated,
                      weight_first, alpha=1.702, limit=7.0):
    _check(x, topk_ids, topk_weights, w_gate_up, w_down, activation, gated)
    return torch.empty_like(x)


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
                activation: str = "silu", gated: bool = True, weight_first: bool = False, alpha: float = 1.702,
                limit: float = 7.0) -> torch.Tensor:
    """``torch.ops.afd.moe_experts`` with keyword defaults (see the module docstring)."""
    return torch.ops.afd.moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down, activation,
                                     gated, weight_first, alpha, limit)
