"""The ``afd::`` collectives that scatter-mode TP, DP attention and expert parallelism insert.

:mod:`afd_compile.ops` holds the point-to-point ops between attention and FFN ranks; these are the
group collectives (all-reduce, token all-gather / reduce-scatter / scatter, and MoE all-to-all
dispatch / combine), each with a fake implementation so dynamo, AOT and Inductor keep them.
Importing :mod:`afd_compile.ops` registers both.
"""

from __future__ import annotations

import torch

from .oplib import afd_op

# --- scatter-mode collectives ------------------------------------------------------------------


@afd_op("afd::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_id: int) -> torch.Tensor:
    """Sum ``x`` over the process group ``group_id`` (out of place, waited on before returning): a small
    message of a group with symmetric memory in one one-shot kernel (symm_mem.py), else NCCL / gloo."""
    import torch.distributed as dist

    from .comm import get_group
    from .symm_mem import try_all_reduce

    fast = try_all_reduce(x, group_id)
    if fast is not None:
        return fast
    out = x.contiguous().clone()
    dist.all_reduce(out, group=get_group(group_id))
    return out


@all_reduce.register_fake
def _(x, group_id):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@afd_op("afd::all_gather_last", mutates_args=())
def all_gather_last(x: torch.Tensor, group_id: int, size: int) -> torch.Tensor:
    """Join the group's slices of the last dim, in group-rank order, and keep the first ``size``
    (a column-parallel LM head's logits: each rank holds ``ceil(V / parts)`` columns, the last
    rank's padded with zero rows of the weight): ``(..., n) -> (..., size)``."""
    import torch.distributed as dist

    from .comm import get_group

    group = get_group(group_id)
    src = x.contiguous()
    parts, n = dist.get_world_size(group), src.shape[-1]
    if parts * n < size:
        raise ValueError(f"afd.all_gather_last: {parts} slices of {n} columns cannot hold {size}")
    out = src.new_empty((parts * src.shape[0], *src.shape[1:]))  # the slices one after another on dim 0
    dist.all_gather_into_tensor(out, src, group=group)  # one buffer, no per-slice copies
    # [P, ..., n] -> [..., P * n]: one copy
    joined = out.view(parts, *src.shape).movedim(0, -2).reshape(*src.shape[:-1], parts * n)
    return joined[..., :size].contiguous()


@all_gather_last.register_fake
def _(x, group_id, size):
    return x.new_empty((*x.shape[:-1], size))


# all-reduce + residual add + RMSNorm as one unit (passes/fuse_norm.py makes it; a platform with a
# fused kernel registers it for the op; the backend lowers it back before Inductor)
@torch.library.custom_op("afd::all_reduce_add_rms_norm", mutates_args=())
def all_reduce_add_rms_norm(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            group_id: int, norm_dtype: torch.dtype) -> list[torch.Tensor]:
    """Composite: ``h = residual + all_reduce(partial)``; returns ``[h, weight * rmsnorm(h)]``, the
    norm computed in float32 and cast to ``norm_dtype`` before the scale (HF's RMSNorm)."""
    h = residual + torch.ops.afd.all_reduce(partial, group_id)
    h32 = h.to(torch.float32)
    normed = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(norm_dtype)
    return [h, weight * normed]


@all_reduce_add_rms_norm.register_fake
def _(partial, residual, weight, eps, group_id, norm_dtype):
    h = torch.empty_like(residual, dtype=torch.promote_types(residual.dtype, partial.dtype))
    return [h, torch.empty_like(h, dtype=torch.promote_types(weight.dtype, norm_dtype))]


COLLECTIVE_OPS = (torch.ops.afd.all_reduce.default, torch.ops.afd.all_gather_last.default)


def _dp_check(x: torch.Tensor, total: int, where: str, rows: str, stage: int = 0) -> object:
    from .comm import get_tp_step

    step = get_tp_step(where, stage)
    n = step.own if rows == "own" else step.total
    if x.shape[0] != n or step.total != total:
        raise ValueError(f"{where}: shape mismatch: input has {x.shape[0]} rows, expected {n} "
                         f"({rows}); graph total {total} vs step counts {list(step.counts)}")
    return step


@afd_op("afd::all_gather_tokens", mutates_args=())
def all_gather_tokens(x: torch.Tensor, group_id: int, total: int, stage: int = 0) -> torch.Tensor:
    """Every DP group's tokens, in group order: ``(own, H) -> (total, H)``. Each rank is its own
    DP group (attn_tp == 1). Padding rule: every rank pads to the largest count, gathers, and
    drops the padding (so groups with zero tokens take part too). ``stage``: whose per-step
    counts (``comm.step_counts``) to use: a micro-batch's, in an FFN group's staged program."""
    import torch.distributed as dist

    from .comm import get_group

    step = _dp_check(x, total, "afd.all_gather_tokens", "own", stage)
    group = get_group(group_id)
    pad = max(step.counts)
    buf = torch.zeros((pad, *x.shape[1:]), dtype=x.dtype, device=x.device)
    buf[: x.shape[0]] = x
    parts = [torch.empty_like(buf) for _ in step.counts]
    dist.all_gather(parts, buf, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, step.counts, strict=True)], dim=0)


@all_gather_tokens.register_fake
def _(x, group_id, total, stage=0):
    return x.new_empty((total, *x.shape[1:]))


@afd_op("afd::gather_partial_tokens", mutates_args=())
def gather_partial_tokens(x: torch.Tensor, group_id: int, total: int) -> torch.Tensor:
    """Reduce-then-gather (SGLang's dp_gather_partial): ``x`` holds this attention TP rank's
    partial sum of its group's tokens. Padding rule: pad to the sum: a zero buffer of all
    tokens gets ``x`` at the group's offset, then one all-reduce over the TP group."""
    import torch.distributed as dist

    from .comm import get_group

    step = _dp_check(x, total, "afd.gather_partial_tokens", "own")
    buf = torch.zeros((step.total, *x.shape[1:]), dtype=x.dtype, device=x.device)
    buf[step.offset : step.offset + step.own] = x
    dist.all_reduce(buf, group=get_group(group_id))
    return buf


@gather_partial_tokens.register_fake
def _(x, group_id, total):
    return x.new_empty((total, *x.shape[1:]))


@afd_op("afd::reduce_scatter_tokens", mutates_args=())
def reduce_scatter_tokens(x: torch.Tensor, group_id: int, total: int, own: int, stage: int = 0) -> torch.Tensor:
    """Sum a FULL partial tensor over the TP group and keep this rank's DP group's rows (``stage``:
    as in :func:`all_gather_tokens`).
    Implemented as an all-reduce of all rows then the local slice: DP groups of unequal sizes
    need no padding this way (a padded reduce_scatter + attention-group all_gather moves fewer
    bytes; not done yet)."""
    import torch.distributed as dist

    from .comm import get_group

    step = _dp_check(x, total, "afd.reduce_scatter_tokens", "total", stage)
    buf = x.contiguous().clone()
    dist.all_reduce(buf, group=get_group(group_id))
    return buf[step.offset : step.offset + step.own].clone()


@reduce_scatter_tokens.register_fake
def _(x, group_id, total, own, stage=0):
    return x.new_empty((own, *x.shape[1:]))


@afd_op("afd::scatter_tokens", mutates_args=())
def scatter_tokens(x: torch.Tensor, total: int, own: int) -> torch.Tensor:
    """This DP group's rows of a FULL tensor: a local slice, no communication."""
    step = _dp_check(x, total, "afd.scatter_tokens", "total")
    return x[step.offset : step.offset + step.own].clone()


@scatter_tokens.register_fake
def _(x, total, own):
    return x.new_empty((own, *x.shape[1:]))


COLLECTIVE_OPS = COLLECTIVE_OPS + (
    torch.ops.afd.all_gather_tokens.default,
    torch.ops.afd.gather_partial_tokens.default,
    torch.ops.afd.reduce_scatter_tokens.default,
    torch.ops.afd.scatter_tokens.default,
)


# --- SCATTERED inside an attention-TP group (each rank a slice of its group's tokens) ----------


def group_token_sizes(total: int, parts: int) -> list[int]:
    """Rows per attention-TP rank when a group's ``total`` tokens are SCATTERED over its ``parts``
    ranks: ``torch.tensor_split``'s rule, the first ``total % parts`` ranks one row more (so a
    rank may hold zero rows). Rank ``i`` holds ``(total + parts - 1 - i) // parts`` rows."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _group_rank(group_id: int) -> tuple[object, int, int]:
    import torch.distributed as dist

    from .comm import get_group

    group = get_group(group_id)
    return group, dist.get_rank(group), dist.get_world_size(group)


def _group_check(op: str, x: torch.Tensor, rows: int, total: int, own: int, rank: int, parts: int) -> list[int]:
    sizes = group_token_sizes(total, parts)
    if x.shape[0] != rows or sizes[rank] != own:
        raise ValueError(f"afd.{op}: shape mismatch on group rank {rank}/{parts}: input has {x.shape[0]} rows, "
                         f"expected {rows}; {total} tokens split {sizes}, this rank's share {own} in the graph")
    return sizes


@afd_op("afd::scatter_group_tokens", mutates_args=())
def scatter_group_tokens(x: torch.Tensor, group_id: int, total: int, own: int) -> torch.Tensor:
    """TP_ATTN_FULL -> SCATTERED, not partial: this rank's rows of its group's ``(total, H)``
    tokens (:func:`group_token_sizes`); a local slice, no communication."""
    _, rank, parts = _group_rank(group_id)
    sizes = _group_check("scatter_group_tokens", x, total, total, own, rank, parts)
    start = sum(sizes[:rank])
    return x[start : start + own].clone()


@scatter_group_tokens.register_fake
def _(x, group_id, total, own):
    return x.new_empty((own, *x.shape[1:]))


@afd_op("afd::all_gather_group_tokens", mutates_args=())
def all_gather_group_tokens(x: torch.Tensor, group_id: int, total: int, own: int) -> torch.Tensor:
    """SCATTERED -> TP_ATTN_FULL: ``(own, H) -> (total, H)`` over the attention-TP group. Padding
    rule: every rank pads to the largest share (``ceil(total / parts)``), gathers, drops the pad."""
    import torch.distributed as dist

    group, rank, parts = _group_rank(group_id)
    sizes = _group_check("all_gather_group_tokens", x, own, total, own, rank, parts)
    pad = max(sizes)
    buf = x.new_zeros((pad, *x.shape[1:]))
    buf[:own] = x
    out = x.new_empty((parts * pad, *x.shape[1:]))
    dist.all_gather_into_tensor(out, buf, group=group)
    return torch.cat([out[i * pad : i * pad + n] for i, n in enumerate(sizes)], dim=0)


@all_gather_group_tokens.register_fake
def _(x, group_id, total, own):
    return x.new_empty((total, *x.shape[1:]))


@afd_op("afd::reduce_scatter_group_tokens", mutates_args=())
def reduce_scatter_group_tokens(x: torch.Tensor, group_id: int, total: int, own: int) -> torch.Tensor:
    """TP_ATTN_FULL + partial -> SCATTERED: sum ``(total, H)`` over the attention-TP group and keep
    this rank's rows. One ``reduce_scatter_tensor`` over shares padded to ``ceil(total / parts)``
    (not an all-reduce then a slice: each rank receives only its share)."""
    import torch.distributed as dist

    group, rank, parts = _group_rank(group_id)
    sizes = _group_check("reduce_scatter_group_tokens", x, total, total, own, rank, parts)
    pad = max(sizes)
    buf = x.new_zeros((parts * pad, *x.shape[1:]))
    start = 0
    for i, n in enumerate(sizes):
        buf[i * pad : i * pad + n] = x[start : start + n]
        start += n
    out = x.new_empty((pad, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, buf, group=group)
    return out[:own].clone()


@reduce_scatter_group_tokens.register_fake
def _(x, group_id, total, own):
    return x.new_empty((own, *x.shape[1:]))


# --- MoE expert parallelism with all-to-all (the SCATTERED MoE) --------------------------------


def _ep_routes(ids: torch.Tensor, parts: int, num_experts: int) -> tuple[list[torch.Tensor], int]:
    """Per destination rank, the rows (token indices, ascending) with at least one expert there."""
    if num_experts % parts:
        raise ValueError(f"afd.ep_dispatch: {num_experts} experts do not divide over {parts} ranks")
    per = num_experts // parts
    owner = torch.div(ids, per, rounding_mode="floor")
    return [torch.nonzero((owner == d).any(dim=-1)).flatten() for d in range(parts)], per


def _a2a(send: torch.Tensor, send_counts: list[int], recv_counts: list[int], group: object) -> torch.Tensor:
    import torch.distributed as dist

    out = send.new_empty((sum(recv_counts), *send.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts,
                           group=group)
    return out


@afd_op("afd::ep_dispatch", mutates_args=())
def ep_dispatch(payloads: list[torch.Tensor], ids: torch.Tensor, group_id: int, num_experts: int,
                parts: int) -> list[torch.Tensor]:
    """All-to-all dispatch of this rank's tokens to the ranks owning their experts (rank ``d``
    owns experts ``[d * E/P, (d+1) * E/P)``). ``ids`` ``(n, k)`` are the selected experts,
    ``payloads`` per-token rows ``(n, ...)``, ``parts`` the group size the program was built for. A token goes once to
    each rank owning at least one of
    its experts. Returns ``[*payloads received (m, ...), local ids (m, k), valid (m, k) bool,
    received counts per source rank (P,) int64]``: ``valid`` marks the slots whose expert this
    rank owns; the others' local id is ``E/P``, outside the local experts, so ``afd::moe_experts``
    computes no row for them (their routing weight is zeroed too: an id of 0 made expert 0 run
    every received token's other slots, and with the weight applied first, its biases added)."""
    group, rank, size = _group_rank(group_id)
    if size != parts:
        raise ValueError(f"afd.ep_dispatch: the program was sharded for {parts} expert-parallel ranks, the group "
                         f"has {size}")
    for p in payloads:
        if p.shape[0] != ids.shape[0]:
            raise ValueError(f"afd.ep_dispatch: a payload has {p.shape[0]} rows, the routing ids {ids.shape[0]}")
    routes, per = _ep_routes(ids, parts, num_experts)
    send_counts = [int(r.numel()) for r in routes]
    counts = torch.tensor(send_counts, dtype=torch.int64, device=ids.device)
    recv = torch.empty_like(counts)
    import torch.distributed as dist

    dist.all_to_all_single(recv, counts, group=group)
    recv_counts = [int(c) for c in recv.tolist()]
    order = torch.cat(routes)
    out = [_a2a(p[order], send_counts, recv_counts, group) for p in (*payloads, ids)]
    local = out[-1] - rank * per
    valid = (local >= 0) & (local < per)
    return [*out[:-1], torch.where(valid, local, torch.full_like(local, per)), valid, recv]


@ep_dispatch.register_fake
def _(payloads, ids, group_id, num_experts, parts):
    m = torch.library.get_ctx().new_dynamic_size()
    return [*(p.new_empty((m, *p.shape[1:])) for p in payloads), ids.new_empty((m, *ids.shape[1:])),
            ids.new_empty((m, *ids.shape[1:]), dtype=torch.bool), ids.new_empty((parts,), dtype=torch.int64)]


@afd_op("afd::ep_combine", mutates_args=())
def ep_combine(y: torch.Tensor, ids: torch.Tensor, recv_counts: torch.Tensor, group_id: int,
               num_experts: int) -> torch.Tensor:
    """The reverse all-to-all of :func:`ep_dispatch`: each owner's partial output for a token
    (its experts' weighted sum) returns to the token's rank, where the partials are summed."""
    group, _rank, parts = _group_rank(group_id)
    routes, _ = _ep_routes(ids, parts, num_experts)
    send_counts = [int(c) for c in recv_counts.tolist()]
    if sum(send_counts) != y.shape[0]:
        raise ValueError(f"afd.ep_combine: {y.shape[0]} expert output rows, {sum(send_counts)} were dispatched here")
    back = _a2a(y, send_counts, [int(r.numel()) for r in routes], group)
    out = y.new_zeros((ids.shape[0], *y.shape[1:]))
    return out.index_add_(0, torch.cat(routes), back)


@ep_combine.register_fake
def _(y, ids, recv_counts, group_id, num_experts):
    return y.new_empty((ids.shape[0], *y.shape[1:]))


COLLECTIVE_OPS = COLLECTIVE_OPS + (
    torch.ops.afd.scatter_group_tokens.default,
    torch.ops.afd.all_gather_group_tokens.default,
    torch.ops.afd.reduce_scatter_group_tokens.default,
    torch.ops.afd.ep_dispatch.default,
    torch.ops.afd.ep_combine.default,
)
