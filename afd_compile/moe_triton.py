"""``afd::moe_experts`` on CUDA as two Triton kernels (the fused path; ``moe.py`` picks it).

The experts are memory-bound in decode (each chosen expert's weights are read for a few rows), so
the path is built to read each chosen expert's weights once per block of its rows and nothing
else twice:

1. **align** (one small kernel, three past :data:`ALIGN_ONE_MAX` pairs; no host synchronisation): the ``T x K``
   (token, expert) pairs grouped by expert, each expert's run padded to a multiple of ``BLOCK_M`` in a buffer
   sized for the worst case (``T K + E (BLOCK_M - 1)`` rows), and the expert of each block of ``BLOCK_M`` rows
   (``E`` for the unused blocks at the end, whose programs return at once). Sizes depend on
   ``T`` only, so a CUDA graph captures it.
2. **up** kernel, per (block, tile of the intermediate size): the block's token rows of ``x``
   (gathered in the kernel) times the expert's gate and up rows, both accumulated in fp32, the
   bias, the routing weight (when the model applies it first), the activation, one store.
3. **down** kernel, per (block, ``TILES`` tiles of the hidden size in one flat loop, so the next
   tile's loads overlap this one's store: its reduction dim, the intermediate size, is short): the
   activated rows times the expert's down projection, the bias, the routing weight, one store per
   (token, expert) pair.
4. each token's ``K`` rows summed in fp32 in order and cast to ``x``'s dtype (one kernel):
   deterministic, no atomics in the sums.

A pair whose expert id is outside ``[0, E)`` takes no expert: align leaves it out (its expert's
rows, and so the weights read and the blocks run, are the real pairs'), and the sum skips it. An
FFN rank's fixed slot marks its padded rows so (their compute then follows the real tokens).

Numbers: fp32 accumulation and activation (the reference rounds to the input dtype after each
projection): equal to the reference to bf16 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: activation codes of the kernels (``moe.ACTIVATIONS`` names and ``swiglu_oai``)
ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "swiglu_oai": 4, "relu2": 5}


def config(pairs: int, num_experts: int) -> dict:
    """Tile sizes by rows per expert (``pairs / E``): decode's few rows take ``BLOCK_M = 16``; the
    ``"down"`` entry, the second kernel's own tiles (its K is the intermediate size; ``TILES``
    output tiles per program); ``TMA``: the weights loaded by TMA descriptors where the GPU has them
    (Hopper on; 2-3% faster at 64+ rows per expert, no different below). Read from
    ``benchmarks/moe_kernels.py --split`` on an H200 (BENCHMARKS.md, the MoE FFN-side sections)."""
    per_expert = pairs / max(num_experts, 1)
    if per_expert <= 8:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    if per_expert <= 24:
        return {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3,
                "down": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}}
    if per_expert <= 48:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4, "TMA": True,
            "down": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3, "TILES": 8}}


#: pairs up to which :func:`align` runs as one program (one launch, no fill kernels); past it,
#: three kernels over many programs. Measured on an H200 (BENCHMARKS.md: align in one program): one program
#: takes 5.7 / 8.0 / 12.1 µs at 64 / 512 / 2048 pairs (three kernels 9.5 / 10.5 / 13.5) but 29.5 at
#: 8192 (13.5): its atomics on a few counters serialise
ALIGN_ONE_MAX = 2048


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair index per padded row, ``T K`` where padding; expert per block, ``E`` where unused).
    Up to :data:`ALIGN_ONE_MAX` pairs one program does it all (fill, count, lay out, place, with a
    barrier between the phases); past it three kernels: count (an atomic per pair, which also gives
    its slot in its expert's run), lay out (the padded runs' starts, each block's expert), place.
    The order of an expert's rows follows the atomics; each row's result does not depend on it."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    dev = flat.device
    blocks = (pairs + num_experts * (block_m - 1) + block_m - 1) // block_m
    e_pow2 = triton.next_power_of_2(num_experts)
    slot = torch.empty(pairs, dtype=torch.int32, device=dev)
    start = torch.empty(num_experts, dtype=torch.int32, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    if pairs <= ALIGN_ONE_MAX:
        counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
        rows = torch.empty(blocks * block_m, dtype=torch.int32, device=dev)
        _align_one_kernel[(1,)](flat, counts, slot, start, rows, block_expert, pairs, blocks * block_m, blocks,
                                E=num_experts, E_POW2=e_pow2, BLOCK_M=block_m, BLOCK=2048, CHUNK=128, num_warps=16)
        return rows, block_expert
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    rows = torch.full((blocks * block_m,), pairs, dtype=torch.int32, device=dev)
    step = 1024
    _count_kernel[(triton.cdiv(pairs, step),)](flat, counts, slot, pairs, E=num_experts, BLOCK=step)
    chunk = 128
    _layout_kernel[(triton.cdiv(blocks, chunk),)](counts, start, block_expert, blocks, E=num_experts,
                                                  E_POW2=e_pow2, BLOCK_M=block_m, CHUNK=chunk)
    _place_kernel[(triton.cdiv(pairs, step),)](flat, slot, start, rows, pairs, E=num_experts, BLOCK=step)
    return rows, block_expert


@triton.jit
def _align_one_kernel(ids_ptr, counts_ptr, slot_ptr, start_ptr, rows_ptr, block_expert_ptr, pairs, n_rows, blocks,
                      E: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                      CHUNK: tl.constexpr):
    # one program: the phases of the three kernels below, a barrier between them (a barrier orders
    # a program's global memory accesses for all its threads)
    offs_e = tl.arange(0, E_POW2)
    real = offs_e < E
    tl.store(counts_ptr + offs_e, tl.zeros((E_POW2,), tl.int32), mask=real)
    for r0 in range(0, n_rows, BLOCK):
        offs = r0 + tl.arange(0, BLOCK)
        tl.store(rows_ptr + offs, tl.zeros((BLOCK,), tl.int32) + pairs, mask=offs < n_rows)
    tl.debug_barrier()
    for p0 in range(0, pairs, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + offs, mask=offs < pairs, other=E)
        ok = (offs < pairs) & (e >= 0) & (e < E)  # (an id outside [0, E): a pair that takes no expert)
        tl.store(slot_ptr + offs, tl.atomic_add(counts_ptr + e, tl.full((BLOCK,), 1, tl.int32), mask=ok), mask=ok)
    tl.debug_barrier()
    c = tl.load(counts_ptr + offs_e, mask=real, other=0)
    padded = (c + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    tl.store(start_ptr + offs_e, end - padded, mask=real)
    ends = tl.where(real, end, 2147483647)  # (padding experts never end)
    for b0 in range(0, blocks, CHUNK):
        offs_b = b0 + tl.arange(0, CHUNK)
        n = tl.sum((ends[None, :] <= (offs_b * BLOCK_M)[:, None]).to(tl.int32), axis=1)  # experts ended before it
        tl.store(block_expert_ptr + offs_b, n, mask=offs_b < blocks)
    tl.debug_barrier()
    for p0 in range(0, pairs, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + offs, mask=offs < pairs, other=E)
        ok = (offs < pairs) & (e >= 0) & (e < E)
        at = tl.load(start_ptr + e, mask=ok, other=0) + tl.load(slot_ptr + offs, mask=ok, other=0)
        tl.store(rows_ptr + at, offs.to(tl.int32), mask=ok)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, slot_ptr, pairs, E: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + offs, mask=offs < pairs, other=E)
    ok = (offs < pairs) & (e >= 0) & (e < E)
    slot = tl.atomic_add(counts_ptr + e, tl.full((BLOCK,), 1, tl.int32), mask=ok)
    tl.store(slot_ptr + offs, slot, mask=ok)


@triton.jit
def _layout_kernel(counts_ptr, start_ptr, block_expert_ptr, blocks, E: tl.constexpr, E_POW2: tl.constexpr,
                   BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    offs_e = tl.arange(0, E_POW2)
    real = offs_e < E
    c = tl.load(counts_ptr + offs_e, mask=real, other=0)
    padded = (c + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    pid = tl.program_id(0)
    tl.store(start_ptr + offs_e, end - padded, mask=real & (pid == 0))
    offs_b = pid * CHUNK + tl.arange(0, CHUNK)
    ends = tl.where(real, end, 2147483647)  # (padding experts never end)
    first_row = offs_b * BLOCK_M
    n = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)  # experts ended before the block
    tl.store(block_expert_ptr + offs_b, n, mask=offs_b < blocks)


@triton.jit
def _place_kernel(ids_ptr, slot_ptr, start_ptr, rows_ptr, pairs, E: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + offs, mask=offs < pairs, other=E)
    ok = (offs < pairs) & (e >= 0) & (e < E)
    at = tl.load(start_ptr + e, mask=ok, other=0) + tl.load(slot_ptr + offs, mask=ok, other=0)
    tl.store(rows_ptr + at, offs.to(tl.int32), mask=ok)


@triton.jit
def _activate(g, u, ACT: tl.constexpr, GATED: tl.constexpr, alpha, limit):
    if ACT == 4:  # swiglu_oai (gated only)
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        out = (uc + 1.0) * (gc * tl.sigmoid(gc * alpha))
    else:
        if ACT == 0:
            a = g * tl.sigmoid(g)
        elif ACT == 1:
            a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
        elif ACT == 2:
            inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = 0.5 * g * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
        elif ACT == 5:
            r = tl.maximum(g, 0.0)
            a = r * r
        else:
            a = tl.maximum(g, 0.0)
        if GATED:
            out = a * u
        else:
            out = a
    return out


@triton.jit
def _up_kernel(x_ptr, w_ptr, w_desc, b_ptr, rows_ptr, block_expert_ptr, rw_ptr, out_ptr,
               pairs, alpha, limit, stride_x, stride_we, stride_wn, stride_be, stride_o,
               hidden: tl.constexpr, inter: tl.constexpr, top_k: tl.constexpr, num_experts: tl.constexpr,
               GATED: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHT_FIRST: tl.constexpr, ACT: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= num_experts:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(rows_ptr + offs_m)
    valid = pair < pairs
    tok = tl.where(valid, pair // top_k, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_x + offs_k[None, :]
    w_base = w_ptr + e.to(tl.int64) * stride_we
    g_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_row = e * (stride_we // stride_wn) + pid_n * BLOCK_N  # (TMA: the tile's first row of the [E N, H] view)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = offs_k < hidden - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        if TMA:  # (rows past the tile's expert or past H read as other weights or zeros: never stored)
            g = tl.trans(w_desc.load([w_row, k0]))
        else:
            g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = tl.dot(a, g, acc_g)
        if GATED:
            if TMA:
                u = tl.trans(w_desc.load([w_row + inter, k0]))
            else:
                u = tl.load(g_ptrs + inter * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_u = tl.dot(a, u, acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
    if WEIGHT_FIRST:  # (x * w) @ W = w * (x @ W), before the bias
        rw = tl.load(rw_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        acc_g = acc_g * rw[:, None]
        acc_u = acc_u * rw[:, None]
    if HAS_BIAS:
        b_base = b_ptr + e.to(tl.int64) * stride_be
        acc_g += tl.load(b_base + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(b_base + inter + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = _activate(acc_g, acc_u, ACT, GATED, alpha, limit)
    o_ptrs = out_ptr + pair[:, None] * stride_o + offs_n[None, :]
    tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, w_desc, b_ptr, rows_ptr, block_expert_ptr, rw_ptr, out_ptr,
                 pairs, stride_h, stride_we, stride_wn, stride_be, stride_o,
                 hidden: tl.constexpr, inter: tl.constexpr, num_experts: tl.constexpr, HAS_BIAS: tl.constexpr,
                 WEIGHT_FIRST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr,
                 TMA: tl.constexpr):
    # one flat loop over TILES output tiles x the K steps of each: the loads of the next tile start
    # while this one is stored (the reduction dim, the intermediate size, is short)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= num_experts:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(rows_ptr + offs_m)
    valid = pair < pairs
    safe = tl.where(valid, pair, 0)
    offs_k = tl.arange(0, BLOCK_K)
    k_steps: tl.constexpr = (inter + BLOCK_K - 1) // BLOCK_K
    w_base = w_ptr + e.to(tl.int64) * stride_we
    rw = tl.load(rw_ptr + safe, mask=valid, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, TILES * k_steps):
        kk = i % k_steps
        n0 = (pid_n * TILES + i // k_steps) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hidden
        k_ok = offs_k < inter - kk * BLOCK_K
        a = tl.load(h_ptr + safe[:, None] * stride_h + kk * BLOCK_K + offs_k[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        if TMA:  # (rows past H read as the next expert's or zeros: never stored)
            w = tl.trans(w_desc.load([e * hidden + n0, kk * BLOCK_K]))
        else:
            w = tl.load(w_base + offs_n[None, :] * stride_wn + kk * BLOCK_K + offs_k[:, None],
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc)
        if kk == k_steps - 1:
            if HAS_BIAS:
                bias = tl.load(b_ptr + e.to(tl.int64) * stride_be + offs_n, mask=n_ok, other=0.0)
                acc += bias.to(tl.float32)[None, :]
            if not WEIGHT_FIRST:
                acc = acc * rw[:, None]
            o_ptrs = out_ptr + safe[:, None] * stride_o + offs_n[None, :]
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


def fused(x, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down, activation, gated, weight_first,
          alpha=1.702, limit=7.0, cfg: dict | None = None) -> torch.Tensor:
    """The op on the fused path (module docstring); ``cfg`` overrides :func:`config` (its ``"down"``
    entry, if any, the second kernel's tiles)."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    pairs = tokens * top_k
    cfg = cfg or config(pairs, w_gate_up.shape[0])
    x = x.contiguous()
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    rw = topk_weights.reshape(-1).contiguous()
    rows, block_expert = align(topk_ids, w_gate_up.shape[0], cfg["BLOCK_M"])
    h = up(x, w_gate_up, b_gate_up, rows, block_expert, rw, top_k, activation, gated, weight_first, alpha, limit,
           cfg)
    y = down(h, w_down, b_down, rows, block_expert, rw, weight_first, {**cfg, **cfg.get("down", {})})
    return token_sum(y, topk_ids, w_gate_up.shape[0])


@triton.jit
def _token_sum_kernel(y_ptr, ids_ptr, out_ptr, hidden, E: tl.constexpr, K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < hidden
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for k in tl.static_range(K):  # (in order: the same sum on every run)
        e = tl.load(ids_ptr + t * K + k)
        took = (e >= 0) & (e < E)  # (a pair that took no expert adds nothing: its row was never written)
        acc += tl.load(y_ptr + (t * K + k) * hidden + offs, mask=ok & took, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * hidden + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def token_sum(y: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, block_h: int = 1024,
              num_warps: int = 4) -> torch.Tensor:
    """Each token's ``top_k`` rows of ``y [T K, H]`` summed in fp32, in order, cast to ``y``'s
    dtype in the same kernel (torch's sum and cast: two kernels and an fp32 ``[T, H]`` between);
    a pair whose id in ``topk_ids [T, K]`` is outside ``[0, num_experts)`` adds nothing."""
    pairs, hidden = y.shape
    top_k = topk_ids.shape[1]
    out = torch.empty(pairs // top_k, hidden, dtype=y.dtype, device=y.device)
    if pairs:
        _token_sum_kernel[(pairs // top_k, triton.cdiv(hidden, block_h))](
            y, topk_ids.reshape(-1).contiguous(), out, hidden, E=num_experts, K=top_k, BLOCK_H=block_h,
            num_warps=num_warps)
    return out


def _launch(cfg: dict) -> dict[str, int]:
    return {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}


def _weight_desc(w: torch.Tensor, cfg: dict) -> object | None:
    """With ``cfg["TMA"]``: a TMA descriptor of the stacked weights ``[E, N, K]`` as ``[E N, K]`` in
    tiles of ``BLOCK_N x BLOCK_K`` (Hopper and later; rows 16-byte aligned), else None: the kernels
    then load the weights through pointers."""
    if not cfg.get("TMA") or torch.cuda.get_device_capability(w.device) < (9, 0):
        return None
    if (w.shape[-1] * w.element_size()) % 16 or w.data_ptr() % 16:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [cfg["BLOCK_N"], cfg["BLOCK_K"]])


def up(x, w_gate_up, b_gate_up, rows, block_expert, rw, top_k, activation, gated, weight_first, alpha, limit,
       cfg: dict) -> torch.Tensor:
    """The first kernel: ``h [T K, I]``, each pair's activated up projection (its routing weight
    applied first if ``weight_first``), rows in pair order."""
    pairs, hidden = x.shape[0] * top_k, x.shape[1]
    num_experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // (2 if gated else 1)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    bu = b_gate_up.contiguous() if b_gate_up is not None else w_gate_up  # (a pointer never read if absent)
    desc = _weight_desc(w_gate_up, cfg)
    _up_kernel[(block_expert.shape[0], triton.cdiv(inter, cfg["BLOCK_N"]))](
        x, w_gate_up, desc, bu, rows, block_expert, rw, h, pairs, float(alpha), float(limit), x.stride(0),
        w_gate_up.stride(0), w_gate_up.stride(1), bu.stride(0) if b_gate_up is not None else 0, h.stride(0),
        hidden=hidden, inter=inter, top_k=top_k, num_experts=num_experts, GATED=gated,
        HAS_BIAS=b_gate_up is not None, WEIGHT_FIRST=weight_first, ACT=ACT_CODES[activation],
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], TMA=desc is not None, **_launch(cfg))
    return h


def down(h, w_down, b_down, rows, block_expert, rw, weight_first, cfg: dict) -> torch.Tensor:
    """The second kernel: ``y [T K, H]``, each pair's down projection (times its routing weight
    unless ``weight_first``), in ``h``'s dtype (rounded as the reference rounds); ``cfg["TILES"]``
    output tiles per program (default 1)."""
    pairs, inter = h.shape
    num_experts, hidden = w_down.shape[0], w_down.shape[1]
    y = torch.empty(pairs, hidden, dtype=h.dtype, device=h.device)
    bd = b_down.contiguous() if b_down is not None else w_down
    tiles = cfg.get("TILES", 1)
    desc = _weight_desc(w_down, cfg)
    _down_kernel[(block_expert.shape[0], triton.cdiv(triton.cdiv(hidden, cfg["BLOCK_N"]), tiles))](
        h, w_down, desc, bd, rows, block_expert, rw, y, pairs, h.stride(0), w_down.stride(0), w_down.stride(1),
        bd.stride(0) if b_down is not None else 0, y.stride(0), hidden=hidden, inter=inter, num_experts=num_experts,
        HAS_BIAS=b_down is not None, WEIGHT_FIRST=weight_first, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], TILES=tiles, TMA=desc is not None, **_launch(cfg))
    return y


@triton.jit
def _topk_kernel(x_ptr, v_ptr, i_ptr, rows, stride_x, E: tl.constexpr, E_POW2: tl.constexpr, K: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, E_POW2)
    ok_t = offs_t < rows
    x = tl.load(x_ptr + offs_t[:, None] * stride_x + offs_e[None, :], mask=ok_t[:, None] & (offs_e < E)[None, :],
                other=float("-inf")).to(tl.float32)
    key = tl.where(x != x, float("inf"), x)  # (NaN ranks above every number, as torch.topk has it)
    alive = (offs_e < E)[None, :] & (offs_t >= 0)[:, None]  # (not yet chosen; padding never)
    for j in tl.static_range(K):
        m = tl.max(tl.where(alive, key, float("-inf")), axis=1)
        idx = tl.min(tl.where(alive & (key == m[:, None]), offs_e[None, :], E_POW2), axis=1)  # ties: the lower index
        chosen = offs_e[None, :] == idx[:, None]
        value = tl.sum(tl.where(chosen, x, 0.0), axis=1)  # (the chosen score itself, NaN or inf included)
        tl.store(v_ptr + offs_t * K + j, value.to(v_ptr.dtype.element_ty), mask=ok_t)
        tl.store(i_ptr + offs_t * K + j, idx.to(tl.int64), mask=ok_t)
        alive = alive & ~chosen


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim=-1)`` of a 2-D ``x`` (``router_topk.py``): one program per 16 rows."""
    x = x.contiguous()
    rows, experts = x.shape
    values = torch.empty(rows, k, dtype=x.dtype, device=x.device)
    indices = torch.empty(rows, k, dtype=torch.int64, device=x.device)
    block = 16
    if rows:
        _topk_kernel[(triton.cdiv(rows, block),)](x, values, indices, rows, x.stride(0), E=experts,
                                                  E_POW2=triton.next_power_of_2(experts), K=k, BLOCK_T=block)
    return values, indices
