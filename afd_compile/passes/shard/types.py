"""The records of a sharding plan: which weight is split how, which constant arguments change,
and the error the sharding raises."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import AFDCompileError


class ShardError(AFDCompileError):
    """A layout that does not divide a dimension, or a graph the sharding rules cannot follow."""


@dataclass(frozen=True)
class ShardedWeight:
    """``target`` is split along ``dim`` into ``parts`` slices over the ``group`` (attn|mlp).

    ``blocks``: sizes of the consecutive blocks along ``dim`` that are sliced separately (a fused
    gate_up or qkv weight: each rank gets its slice of every block); ``()`` when unfused.
    ``replicate``: per block, ranks sharing one slice (KV heads replicated when attn_tp exceeds
    their count; rank r takes slice ``r // k`` of ``parts // k``); ``()`` when none is.
    """

    target: str
    dim: int
    parts: int
    group: str
    kind: str  # column | row | row_bias
    blocks: tuple[int, ...] = ()
    replicate: tuple[int, ...] = ()

    def __str__(self) -> str:
        if self.kind == "row_bias":
            return f"row-parallel bias {self.target}: whole on {self.group} rank 0, zeros elsewhere (added once)"
        extra = f" in blocks {list(self.blocks)}" if len(self.blocks) > 1 else ""
        if any(k > 1 for k in self.replicate):
            extra += f", replicated x{list(self.replicate)}" if len(self.replicate) > 1 else \
                f", each slice on {self.replicate[0]} ranks"
        return f"{self.kind}-parallel {self.target} dim {self.dim} / {self.parts} over {self.group}{extra}"


@dataclass(frozen=True)
class ArgFix:
    """Set an int argument of ``node`` from ``old`` to ``new`` (a head count in a reshape, a
    slice bound of a fused projection): ``node.args[arg][index]``, or ``node.args[arg]`` when
    index is None. With ``div``, the argument is a symbolic size computed by node ``old`` and
    becomes ``old // new`` (batch x heads folded into one dim: ``B * 4`` -> ``B * 4 // 2``)."""

    node: str
    index: int | None
    old: int | str  # (str: the node computing a symbolic size)
    new: int
    arg: int = 1
    div: bool = False  # the size becomes ``old // new`` (a node inserted: a symbolic size divided)


class _RankSlices:
    """A dim of ``size`` cut into ``slices`` equal slices over ``parts`` ranks, each slice on
    ``parts // slices`` consecutive ranks (replicated KV heads). Mixed into the records below,
    which hold those fields."""

    size: int
    slices: int
    parts: int

    def local(self, rank: int) -> tuple[int, int]:
        """(start, length) of ``rank``'s slice along the dim."""
        n = self.size // self.slices
        return (rank // (self.parts // self.slices)) * n, n

    def _replicated(self) -> str:
        return f", each slice on {self.parts // self.slices} ranks" if self.slices < self.parts else ""


@dataclass(frozen=True)
class ShardedState(_RankSlices):
    """A state tensor a split tensor is written into in place (a KV cache: ``index_copy_`` of
    this rank's K/V heads): each rank keeps only its slice of ``dim``. ``slices`` distinct slices
    over ``parts`` ranks of ``group`` (fewer when KV heads are replicated: rank r keeps slice
    ``r // (parts // slices)``). A cache attribute (a buffer) is sliced like a weight; a cache the
    program receives or allocates (a graph input, a ``zeros``) is narrowed to this rank's slice
    where it is read and written (the caller's tensor keeps its full shape)."""

    node: str
    dim: int
    size: int
    slices: int
    parts: int
    group: str

    def __str__(self) -> str:
        return f"state {self.node} dim {self.dim} ({self.size}) / {self.slices} over {self.group}{self._replicated()}"


@dataclass(frozen=True)
class SlicedOperand(_RankSlices):
    """An unsplit tensor the graph computes (not a weight) that an elementwise op ``user``
    applies along the split dim: BLOOM's and MPT's ALiBi bias over all heads, added to each
    rank's heads of the attention scores. Every rank computes it whole; ``user`` reads this
    rank's slice of ``dim`` (``narrow(operand, dim, start, n)``), the other readers the whole.
    ``fold``: ``dim`` holds batch x ``size`` heads folded into one (BLOOM's bias for ``baddbmm``
    over batch x heads): the rank reads its heads of every batch entry (unflatten, narrow,
    flatten)."""

    user: str
    operand: str
    dim: int
    size: int
    slices: int
    parts: int
    group: str
    fold: bool = False  # dim is batch x ``size`` heads folded (BLOOM's [batch * heads, 1, keys]): sliced per batch

    def __str__(self) -> str:
        what = f"dim {self.dim} (batch x {self.size} heads)" if self.fold else f"dim {self.dim} ({self.size})"
        return f"{self.user} reads its slice of {self.operand} {what} / {self.slices} " \
               f"over {self.group}{self._replicated()}"


@dataclass(frozen=True)
class OnceOperand:
    """A bias added to the partial sums of a row-parallel projection (GPT-OSS's expert
    ``down_proj_bias``, added after the grouped mm): summed over the group it must count once, so
    ``user``'s operand ``arg`` is kept on group rank 0 and zeros elsewhere (as a row-parallel
    linear's own bias is)."""

    user: str
    arg: int
    group: str

    def __str__(self) -> str:
        return f"{self.user} adds operand {self.arg} to partial sums: on {self.group} rank 0 only"


@dataclass(frozen=True)
class ShardPlan:
    weights: tuple[ShardedWeight, ...]
    arg_fixes: tuple[ArgFix, ...]
    row_outputs: tuple[tuple[str, str, int], ...]  # (node, group, layer): partial sums to settle
    # (node, group, layer, parts): a mean over a split dim (OLMo-2's q/k norm over all heads):
    # each rank's mean of its slice; all-reduced over the group and divided by parts = the full mean
    split_means: tuple[tuple[str, str, int, int], ...] = ()
    states: tuple[ShardedState, ...] = ()  # KV caches written with split heads
    operands: tuple[SlicedOperand, ...] = ()  # unsplit tensors read in slices (an ALiBi bias)
    once: tuple[OnceOperand, ...] = ()  # biases added to partial sums: on group rank 0 only

    def __str__(self) -> str:
        return "\n".join([*(str(w) for w in self.weights), *(str(s) for s in self.states),
                          *(str(o) for o in self.operands), *(str(o) for o in self.once),
                          *(f"{m}: mean over the split dim, all-reduced over {g} / {p}"
                            for m, g, _, p in self.split_means),
                          *(f"{f.node} arg {f.arg}{'' if f.index is None else f'[{f.index}]'}: {f.old} -> "
                            f"{f'{f.old} // {f.new}' if f.div else f.new}" for f in self.arg_fixes)])
