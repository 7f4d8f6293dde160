"""Decode attention that reads only the filled part of a static KV cache.

HF's static-cache attention is SDPA over the whole cache with a mask (``max_cache_len`` positions,
whatever is filled): at batch 64 x context 4096 it reads 4.3 GB of K/V per step, most of it
masked out. This pass finds SDPA whose keys and values are a KV cache (a tensor the program
updates in place, read back through HF's ``repeat_kv``) and whose mask is a boolean tensor, and
replaces it with ``afd::decode_attention``: FlexAttention over the cache itself, a block mask built
from the same boolean mask (blocks with no allowed position are never read), grouped-query
attention without repeating the KV heads. The result is the same attention (the same mask, the
same scale).

Before (one layer of a cached decode graph)::

    index_copy_ = aten.index_copy_(k_cache, 2, cache_position, k)
    unsqueeze = aten.unsqueeze(k_cache, 2); expand = aten.expand(unsqueeze, ...); reshape = ...   # repeat_kv
    sdpa = aten.scaled_dot_product_attention(q, reshape, reshape_1, attn_mask=mask, scale=0.088)

After::

    index_copy_ = aten.index_copy_(k_cache, 2, cache_position, k)
    decode_blocks = decode_blocks(q, mask)          # once per step: every layer shares the mask
    getitem = decode_blocks[0] ... getitem_4 = decode_blocks[4]     # m, kv_num, kv_idx, full_num, full_idx
    decode_attention = afd.decode_attention(q, k_cache, v_cache, getitem, ..., getitem_4, 0.088)

The block mask (:func:`decode_blocks`: which 128-position blocks of the cache a sequence reads)
is plain tensor ops the program's compiler compiles with the rest. The op is opaque to it: its
kernel, :func:`flex_over_blocks`, is compiled on its own (``torch.compile``, once per shape,
Inductor's flex decoding kernel) the first time it runs, and lives in CUDA graphs with the rest of
the program. Compiled inside the whole program, Inductor (torch 2.11) failed on 8B-shaped programs
(a Triton ``NameError: XBLOCK`` in the mask subgraph); compiled alone it is the kernel
``benchmarks/decode_attention_kernel.py`` measures. Where even that compile fails (Inductor's CPU
template has no choice for some shapes) the op computes masked SDPA, the attention it replaced,
with a warning, counted in ``STATS["compile_failures"]``; so it does where the compiled kernel,
checked once per shape against masked SDPA on random inputs, disagrees with it
(``STATS["kernel_mismatches"]``: seen with Inductor's CPU template on an AVX2 host).

The backend runs the pass on every rank's program with ``options={"decode_attention": "flex"}``,
and by default (``"auto"``) on CUDA.
The CLI programs keep SDPA. Attention written out (matmul of the query with the transposed cached
keys, softmax: Gemma-2's logit soft-capping) is left as is, with a record saying why.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .. import meta_keys
from .graph_utils import writes_first_arg
from .symbolic import sym_expr

aten = torch.ops.aten
log = logging.getLogger("afd_compile.decode_attention")

META_KEY = meta_keys.DECODE_ATTENTION

#: ``compiled``: shapes whose kernel compiled (and agreed with masked SDPA); ``compile_failures``:
#: shapes that run masked SDPA because the compile failed; ``kernel_mismatches``: because the
#: compiled kernel disagreed with masked SDPA on its first-call check
STATS: dict[str, int] = {"compiled": 0, "compile_failures": 0, "kernel_mismatches": 0}

#: the compiled kernel's first-call check: max |flex - SDPA| / max |SDPA| allowed, by dtype
CHECK_TOL = {torch.float32: 1e-4, torch.float64: 1e-8}
CHECK_TOL_LOW = 3e-2  # bf16 / fp16

#: ops of HF's ``repeat_kv`` between a cache and SDPA: unsqueeze a group dim, take it whole,
#: expand it to the group size, merge it into the head dim
_REPEAT_OPS = {aten.unsqueeze.default, aten.slice.Tensor, aten.expand.default, aten.reshape.default,
               aten.view.default, aten._unsafe_view.default, aten.clone.default, aten.contiguous.default}


BLOCK = 128  # FlexAttention's KV block: the unit the block mask skips


def decode_blocks(q: torch.Tensor, mask: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, ...]:
    """The block mask of one query token per sequence, as tensors, straight from its boolean
    ``mask`` [b or 1, 1, 1, kv_len] (True = attend): ``(m, kv_num, kv_idx, full_num, full_idx)``,
    ``m`` the mask as [b, 1, kv_len]. A block is skipped when it allows no position, full when it
    allows all, partial (the mask applied) otherwise; the blocks to read come first. Plain tensor
    ops (the program's compiler compiles them), computed once per step for every layer that
    shares the mask. Cheaper than ``create_block_mask``, which evaluates a mask function over every
    position and sorts."""
    b, kv_len = q.shape[0], mask.shape[-1]
    m = mask.expand(b, 1, 1, kv_len)[:, 0].contiguous()  # [b, 1, kv_len]
    nb = -(-kv_len // block)
    rows = torch.nn.functional.pad(m[:, 0, :], (0, nb * block - kv_len)).view(b, nb, block)
    any_, all_ = rows.any(-1), rows.all(-1)

    def pick(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = sel.sum(-1, dtype=torch.int32).view(b, 1, 1)
        order = torch.argsort((~sel).to(torch.int32), dim=-1, stable=True).to(torch.int32).view(b, 1, 1, nb)
        return num, order

    return (m, *pick(any_ & ~all_), *pick(all_))


def flex_over_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor, kv_num: torch.Tensor,
                     kv_idx: torch.Tensor, full_num: torch.Tensor, full_idx: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """FlexAttention of one query token per sequence over the cache ``k``/``v`` [b, kv_heads,
    max_len, d] with the block mask :func:`decode_blocks` made; K/V heads shared by
    ``q_heads // kv_heads`` query heads (no repeat)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    def mask_mod(bi: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, kvi: torch.Tensor) -> torch.Tensor:
        return m[bi, qi, kvi]

    kw = {"compute_q_blocks": False} if _COMPUTE_Q_BLOCKS else {}  # (the backward's; not needed)
    block_mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                          seq_lengths=(1, k.shape[2]), **kw)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def _takes_compute_q_blocks() -> bool:
    import inspect

    from torch.nn.attention.flex_attention import BlockMask

    return "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters


_COMPUTE_Q_BLOCKS = _takes_compute_q_blocks()


def flex_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA(q, repeat(k), repeat(v), attn_mask=mask, scale) for one query token per sequence
    (``mask`` [b or 1, 1, 1, kv_len]) as FlexAttention over the cache: :func:`decode_blocks`, then
    :func:`flex_over_blocks`."""
    return flex_over_blocks(q, k, v, *decode_blocks(q, mask), scale)


def _sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor,
                 *blocks_and_scale: object) -> torch.Tensor:
    """The attention the pass replaces: masked SDPA over the whole cache (``m`` [b, 1, kv_len]),
    K/V heads repeated."""
    scale = blocks_and_scale[-1]
    rep = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(rep, 1) if rep > 1 else x for x in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m[:, None], scale=scale)


#: the sequences a freshly compiled kernel is checked on (see _check_kernel)
CHECK_SEQUENCES = 2
#: the kernel per (device type, shapes, dtypes, scale): flex_over_blocks compiled, or masked SDPA
#: where that compile failed
_KERNELS: dict[tuple, Callable[..., torch.Tensor]] = {}


def _kernel(*args: Any) -> Callable[..., torch.Tensor]:
    q, k = args[0], args[1]
    key = (q.device.type, *(tuple(x.shape) for x in args[:-1]), q.dtype, k.dtype, args[-1])
    fn = _KERNELS.get(key)
    if fn is not None:
        return fn
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InductorError

    compiled = torch.compile(flex_over_blocks, fullgraph=True, dynamic=False)
    try:
        with torch._dynamo.config.patch(recompile_limit=1 << 16, accumulated_recompile_limit=1 << 16):
            compiled(*args)  # compiles now (each shape its own entry, past dynamo's usual 8)
        err = _check_kernel(compiled, args)
        if err is None:
            fn = compiled
            STATS["compiled"] += 1
        else:
            log.warning("decode attention: the compiled FlexAttention kernel for q %s, k %s (%s, %s) disagrees with "
                        "masked SDPA on random inputs (max rel err %s); this shape runs masked SDPA over the whole "
                        "cache (the attention the pass replaced)", tuple(q.shape), tuple(k.shape), q.dtype,
                        q.device.type, err)
            STATS["kernel_mismatches"] += 1
            fn = _sdpa_decode
    except (BackendCompilerFailed, InductorError) as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        log.warning("decode attention: Inductor could not compile FlexAttention for q %s, k %s (%s); this shape "
                    "runs masked SDPA over the whole cache (the attention the pass replaced)", tuple(q.shape),
                    tuple(k.shape), first[:300])
        STATS["compile_failures"] += 1
        fn = _sdpa_decode
    _KERNELS[key] = fn
    return fn


def _check_kernel(compiled: Callable[..., torch.Tensor], args: tuple) -> str | None:
    """Run the freshly compiled kernel on random q/k/v of this shape (the real block mask) and
    compare with masked SDPA: None when it agrees, else the error. Measured: Inductor's CPU
    FlexAttention template (torch 2.13, an AVX2 host) returns wrong values or NaN for head_dim 16
    with a 24-long cache; a wrong kernel must never run silently. Random inputs, not the call's
    own: a cache's rows past the mask may hold anything. The first ``CHECK_SEQUENCES`` sequences are
    random and compared (the rest zeros: sequences do not mix), so the reference's repeated K/V stay
    small: over a whole batch of 64 x 32K x 64 heads it would be 32 GB."""
    q, k, v, m = args[:4]
    n = min(q.shape[0], CHECK_SEQUENCES)
    g = torch.Generator(device=q.device).manual_seed(0)
    rq, rk, rv = (torch.zeros(x.shape, device=x.device, dtype=x.dtype) for x in (q, k, v))
    for r, x in ((rq, q), (rk, k), (rv, v)):
        r[:n] = torch.randn((n, *x.shape[1:]), generator=g, device=x.device, dtype=torch.float32).to(x.dtype)
    rest = args[3:]
    got = compiled(rq, rk, rv, *rest)[:n].float()
    want = _sdpa_decode(rq[:n], rk[:n], rv[:n], m[:n], *rest[1:]).float()
    m = m[:n]
    rows = m.any(-1).reshape(m.shape[0], *([1] * (want.dim() - 1)))  # a sequence with no cache position: any value
    got, want = got * rows, want.nan_to_num() * rows
    if not torch.isfinite(got).all():
        return "non-finite values"
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    return None if err <= CHECK_TOL.get(q.dtype, CHECK_TOL_LOW) else f"{err:.3g}"


@functools.cache
def _outside_exclude(raw: int) -> torch._C.DispatchKeySet:
    """The excluded dispatch keys ``raw`` (as inside an op) with all but autocast's removed."""
    exclude = torch._C.DispatchKeySet.from_raw_repr(raw)
    for name, key in torch._C.DispatchKey.__members__.items():
        if not name.startswith("Autocast") and exclude.has(key):
            exclude = exclude.remove(key)
    return exclude


@torch.library.custom_op("afd::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor, kv_num: torch.Tensor,
                     kv_idx: torch.Tensor, full_num: torch.Tensor, full_idx: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """SDPA(q, repeat_kv(k), repeat_kv(v), attn_mask=m[:, None], scale=scale) over a KV cache
    ``k``/``v`` [b, kv_heads, max_len, d] for one query token per sequence, reading only the
    blocks of :func:`decode_blocks`: :func:`flex_over_blocks`, compiled on its own per shape at
    the first call."""
    # an op's body runs with the keys above it excluded (autograd; under a dispatch mode such as
    # AOT's first-call alias check, functorch and Python too): dynamo tracing FlexAttention's mask
    # (under vmap) and its guards want the dispatch state of code outside any op. Only autocast
    # stays as it was
    exclude = _outside_exclude(torch._C._dispatch_tls_local_exclude_set().raw_repr())
    args = (q, k, v, m, kv_num, kv_idx, full_num, full_idx, scale)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        out = _kernel(*args)(*args)
    # FlexAttention lays its output out as the query (here a transposed view): the op's output is
    # contiguous, as its fake says (one query token: a copy of b x heads x head_dim values)
    return out if out.stride() == _contiguous_strides(out.shape) else out.clone(memory_format=torch.contiguous_format)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


@decode_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor, kv_num: torch.Tensor, kv_idx: torch.Tensor,
      full_num: torch.Tensor, full_idx: torch.Tensor, scale: float) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@dataclass(frozen=True)
class DecodeAttention:
    """One SDPA the pass replaced (or left, with why)."""

    node: str
    replaced: bool
    why: str = ""


def _whole(x: fx.Node) -> bool:
    """A slice that keeps every element (its shape is its input's)."""
    a, b = x.meta.get("val"), x.args[0].meta.get("val") if isinstance(x.args[0], fx.Node) else None
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() != b.dim():
        return False
    return all(sym_expr(p) == sym_expr(q) for p, q in zip(a.shape, b.shape, strict=True))


_MATMUL_OPS = {aten.matmul.default, aten.bmm.default}
_TRANSPOSE_OPS = {aten.transpose.int, aten.permute.default}


def _cache_read(x: object, state: set[fx.Node]) -> fx.Node | None:
    """The cache tensor ``x`` reads through HF's repeat_kv (or directly), else None."""
    while isinstance(x, fx.Node) and x not in state and x.op == "call_function" and x.target in _REPEAT_OPS:
        if x.target == aten.slice.Tensor and not _whole(x):
            return None  # a slice that drops positions is not a whole-cache read
        x = x.args[0]
    return x if isinstance(x, fx.Node) and x in state else None


def _state_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes that hold a KV cache: every in-place write (its schema says it writes its first
    argument: ``index_copy_`` into a buffer or an input) and the tensor it writes."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node) and writes_first_arg(n):
            out.update((n, n.args[0]))
    return out


def replace_decode_attention(gm: fx.GraphModule) -> list[DecodeAttention]:
    """Replace every SDPA over a KV cache with ``afd::decode_attention``, in place; returns a record
    per SDPA of the graph (replaced or why not). A graph without a cache is left as it is."""
    state = _state_nodes(gm)
    records: list[DecodeAttention] = []
    blocks: dict[fx.Node, list[fx.Node]] = {}
    if not state:
        return records
    for n in list(gm.graph.nodes):
        if n.target != aten.scaled_dot_product_attention.default:
            continue
        args = list(n.args) + [None] * (7 - len(n.args))
        q, k, v = args[:3]
        mask = n.kwargs.get("attn_mask", args[3])
        dropout = n.kwargs.get("dropout_p", args[4] or 0.0)
        causal = n.kwargs.get("is_causal", args[5] or False)
        scale = n.kwargs.get("scale", args[6])
        kc, vc = _cache_read(k, state), _cache_read(v, state)
        q_len = q.meta["val"].shape[2] if isinstance(q.meta.get("val"), torch.Tensor) else None
        why = ("keys/values are not read from a KV cache" if kc is None or vc is None else
               f"not a decode step (query length {q_len}: a prefill, SDPA reads what it computes)"
               if not (isinstance(q_len, int) and q_len == 1) else
               "no boolean attention mask"
               if not (isinstance(mask, fx.Node) and isinstance(mask.meta.get("val"), torch.Tensor)
                                                   and mask.meta["val"].dtype == torch.bool) else
               "dropout" if dropout else "is_causal" if causal else
               "enable_gqa" if n.kwargs.get("enable_gqa") else "")
        if why:
            log.info("decode attention: %s left as SDPA: %s", n.name, why)
            records.append(DecodeAttention(n.name, False, why))
            continue
        if scale is None:
            scale = float(q.meta["val"].shape[-1]) ** -0.5
        if mask not in blocks:  # the block mask once per step, for every layer that shares the mask
            with gm.graph.inserting_before(n):
                made = gm.graph.call_function(decode_blocks, (q, mask))
                blocks[mask] = [gm.graph.call_function(operator.getitem, (made, i)) for i in range(5)]
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(torch.ops.afd.decode_attention.default,
                                         (q, kc, vc, *blocks[mask], float(scale)))
        new.meta.update(n.meta)
        new.meta[META_KEY] = True
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
        for x in (k, v):  # the repeat chains, now unread
            while isinstance(x, fx.Node) and not x.users and x.target in _REPEAT_OPS and x not in state:
                up = x.args[0]
                gm.graph.erase_node(x)
                x = up
        records.append(DecodeAttention(n.name, True))
    for n in gm.graph.nodes:  # attention written out: a matmul of the query with the cached keys, transposed
        keys = n.args[1] if n.target in _MATMUL_OPS and len(n.args) > 1 else None
        if isinstance(keys, fx.Node) and keys.target in _TRANSPOSE_OPS and _cache_read(keys.args[0], state):
            why = ("explicit attention (matmul + softmax, e.g. logit soft-capping or an eager attention "
                   "implementation): only SDPA is replaced")
            log.info("decode attention: %s left as is: %s", n.name, why)
            records.append(DecodeAttention(n.name, False, why))
    gm.graph.lint()
    gm.recompile()
    return records
