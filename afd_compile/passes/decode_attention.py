"""Decode attention that reads only the filled part of a static KV cache.

HF's static-cache attention is SDPA over the whole cache with a mask (``max_cache_len`` positions,
whatever is filled): at batch 64 x context 4096 it reads 4.3 GB of K/V per step, most of it
masked out. This pass finds SDPA whose keys and values are a KV cache (a tensor the program
updates in place, read back through HF's ``repeat_kv``) and whose mask is a boolean tensor, and
replaces it with FlexAttention over the cache itself: a block mask built from the same boolean
mask (blocks with no allowed position are never read), grouped-query attention without repeating
the KV heads. The result is the same attention (the same mask, the same scale); Inductor compiles
it to its flex (decoding) kernel (the mask and so the block mask are device tensors, rebuilt in
the graph every step).

The backend runs it on every rank's program with ``options={"decode_attention": "flex"}`` (a
program holding it is compiled through ``torch.compile``: see ``backend.PerLayout``). Not the
default: on 2 x H200 the replaced decode step measured slower end to end than HF's masked SDPA,
though one layer's FlexAttention alone is 1.2-3.8x faster; those runs ran the replaced programs
eagerly (fixed in PerLayout since, not re-measured yet; BENCHMARKS.md). The CLI programs keep
SDPA. Attention written out (matmul of the query with the transposed cached keys, softmax:
Gemma-2's logit soft-capping) is left as is, with a record saying why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.fx as fx

from .graph_utils import writes_first_arg
from .symbolic import sym_expr

aten = torch.ops.aten
log = logging.getLogger("afd_compile.decode_attention")

META_KEY = "afd.decode_attention"

#: ops of HF's ``repeat_kv`` between a cache and SDPA: unsqueeze a group dim, take it whole,
#: expand it to the group size, merge it into the head dim
_REPEAT_OPS = {aten.unsqueeze.default, aten.slice.Tensor, aten.expand.default, aten.reshape.default,
               aten.view.default, aten._unsafe_view.default, aten.clone.default, aten.contiguous.default}


def flex_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA(q, repeat(k), repeat(v), attn_mask=mask, scale) as FlexAttention over the cache: the
    block mask comes from ``mask`` ([b or 1, 1, q_len, kv_len], True = attend), so blocks with no
    allowed position are skipped; K/V heads are shared by ``q_heads // kv_heads`` query heads."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, _, q_len, _ = q.shape
    kv_len = k.shape[2]
    m = mask.expand(b, 1, q_len, kv_len)[:, 0].contiguous()  # [b, q_len, kv_len]

    def mask_mod(bi: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, kvi: torch.Tensor) -> torch.Tensor:
        return m[bi, qi, kvi]

    if q_len == 1:
        block_mask = _decode_block_mask(m, mask_mod)
    else:
        block_mask = create_block_mask(mask_mod, b, None, q_len, kv_len, device=q.device)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def _decode_block_mask(m: torch.Tensor, mask_mod: object, block: int = 128) -> object:
    """The block mask of one query token per sequence straight from its boolean mask
    ``m`` [b, 1, kv_len]: a block is skipped when it allows no position, full when it allows all,
    partial (``mask_mod`` applied) otherwise; the blocks to read come first. Cheaper than
    ``create_block_mask``, which evaluates ``mask_mod`` over every position and sorts."""
    from torch.nn.attention.flex_attention import BlockMask

    b, kv_len = m.shape[0], m.shape[-1]
    nb = -(-kv_len // block)
    rows = torch.nn.functional.pad(m[:, 0, :], (0, nb * block - kv_len)).view(b, nb, block)
    any_, all_ = rows.any(-1), rows.all(-1)

    def pick(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = sel.sum(-1, dtype=torch.int32).view(b, 1, 1)
        order = torch.argsort((~sel).to(torch.int32), dim=-1, stable=True).to(torch.int32).view(b, 1, 1, nb)
        return num, order

    kv_num, kv_idx = pick(any_ & ~all_)
    full_num, full_idx = pick(all_)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(1, kv_len))


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
    """Replace every SDPA over a KV cache with :func:`flex_decode`, in place; returns a record
    per SDPA of the graph (replaced or why not). A graph without a cache is left as it is."""
    state = _state_nodes(gm)
    records = []
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
               f"a prefill (query length {q_len}: SDPA reads what it computes)" if isinstance(q_len, int) and q_len > 1 else
               "no boolean attention mask" if not (isinstance(mask, fx.Node) and isinstance(mask.meta.get("val"), torch.Tensor)
                                                   and mask.meta["val"].dtype == torch.bool) else
               "dropout" if dropout else "is_causal" if causal else
               "enable_gqa" if n.kwargs.get("enable_gqa") else "")
        if why:
            log.info("decode attention: %s left as SDPA: %s", n.name, why)
            records.append(DecodeAttention(n.name, False, why))
            continue
        if scale is None:
            scale = float(q.meta["val"].shape[-1]) ** -0.5
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(flex_decode, (q, kc, vc, mask, float(scale)))
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
