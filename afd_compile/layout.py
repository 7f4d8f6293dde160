"""Rank layout of an AFD deployment (DESIGN §4).

World ranks ``[0, F)`` are FFN ranks and ``[F, F + A)`` attention ranks. FFN rank ``f`` owns a
contiguous block of attention peers; when ``A`` is not a multiple of ``F`` the first ``A % F``
FFN ranks own one peer more (3 attention : 2 FFN gives blocks of 2 and 1).

``ffn_tp``: the FFN ranks form tensor-parallel groups of ``ffn_tp`` consecutive ranks (``[0,
ffn_tp)``, ``[ffn_tp, 2 ffn_tp)``, ...). Each FFN rank still receives its own block's tokens
(every token crosses the wire once); inside the group the MLP runs on the group's tokens
(all-gathered), its weights split over the group, and each rank returns its own tokens' output
(reduce-scattered): ``-A 4 -F 2 --ffn-tp 2`` is one FFN TP group of 2 serving 4 attention ranks.
``ffn_ep``: the same groups, an MoE's experts split over them instead (each rank's tokens go to
their experts' ranks and back by all-to-all; dense layers run on each rank's own tokens).

``attn_tp``: the attention ranks form tensor-parallel groups of ``attn_tp`` consecutive ranks, each
group one data-parallel group (its own sequences): attention weights split over the group, and at
each cut every rank of the group sends its slice of the group's tokens (SCATTERED: each token
crosses the wire once), then gathers the group's tokens back for the next attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import AFDCompileError
from .limits import MAX_RANKS


class LayoutError(AFDCompileError):
    """An impossible layout (no ranks, more FFN ranks than attention ranks, ...)."""


@dataclass(frozen=True)
class AFDLayout:
    attention_ranks: int
    ffn_ranks: int
    ffn_tp: int = 1
    ffn_ep: int = 1
    attn_tp: int = 1

    def __post_init__(self) -> None:
        for name in ("attention_ranks", "ffn_ranks", "ffn_tp", "ffn_ep", "attn_tp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise LayoutError(f"AFD layout: {name} must be an integer, got {v!r} ({type(v).__name__})")
        if self.attention_ranks + self.ffn_ranks > MAX_RANKS:
            raise LayoutError(f"AFD layout {self.attention_ranks}A{self.ffn_ranks}F: "
                              f"{self.attention_ranks + self.ffn_ranks} "
                              f"ranks, more than the {MAX_RANKS} a layout may have")
        if self.attn_tp < 1 or self.attention_ranks % self.attn_tp:
            raise LayoutError(f"AFD layout {self}: attn_tp={self.attn_tp} must be >= 1 and divide the "
                              f"{self.attention_ranks} attention ranks (attention groups of attn_tp consecutive ranks)")
        for name in ("ffn_tp", "ffn_ep"):
            size = getattr(self, name)
            if size < 1 or self.ffn_ranks % size:
                raise LayoutError(f"AFD layout {self}: {name}={size} must be >= 1 and divide the {self.ffn_ranks} "
                                  f"FFN ranks (FFN groups of {name} consecutive FFN ranks)")
        if self.ffn_tp > 1 and self.ffn_ep > 1:
            raise LayoutError(f"AFD layout {self}: ffn_tp and ffn_ep together (TP inside expert groups) are not "
                              "supported yet; give one of them")
        if self.attention_ranks < 1 or self.ffn_ranks < 1:
            raise LayoutError(
                f"AFD layout needs at least 1 attention and 1 FFN rank, got "
                f"{self.attention_ranks}A{self.ffn_ranks}F"
            )
        if self.ffn_ranks > self.attention_ranks:
            raise LayoutError(
                f"AFD layout {self}: {self.ffn_ranks} FFN ranks but only {self.attention_ranks} "
                "attention ranks; every FFN rank needs at least one attention peer"
            )

    def __str__(self) -> str:
        return (f"{self.attention_ranks}A{self.ffn_ranks}F" + (f" attn_tp={self.attn_tp}" if self.attn_tp != 1 else "")
                + (f" ffn_tp={self.ffn_tp}" if self.ffn_tp != 1 else "")
                + (f" ffn_ep={self.ffn_ep}" if self.ffn_ep != 1 else ""))

    def ffn_groups(self) -> list[tuple[int, ...]]:
        """Every FFN group's world ranks, in order (none when each FFN rank is alone)."""
        size = self.ffn_group_size
        return [self.ffn_group(f) for f in range(0, self.ffn_ranks, size)] if size > 1 else []

    def attention_groups(self) -> list[tuple[int, ...]]:
        """Every attention TP group's world ranks, in order (none when ``attn_tp`` is 1)."""
        return (
            [self.attention_group(a) for a in range(0, self.attention_ranks, self.attn_tp)] if self.attn_tp > 1 else []
        )

    def attention_group(self, a: int) -> tuple[int, ...]:
        """World ranks of attention index ``a``'s TP group (one DP group of the attention side)."""
        start = a - a % self.attn_tp
        return tuple(self.attention_world_rank(i) for i in range(start, start + self.attn_tp))

    @property
    def ffn_group_size(self) -> int:
        """Ranks per FFN group (TP or EP); 1: every FFN rank alone."""
        return max(self.ffn_tp, self.ffn_ep)

    def ffn_group(self, f: int) -> tuple[int, ...]:
        """World ranks of FFN rank ``f``'s group (``(f,)`` when it has none)."""
        start = f - f % self.ffn_group_size
        return tuple(range(start, start + self.ffn_group_size))

    @property
    def world_size(self) -> int:
        return self.attention_ranks + self.ffn_ranks

    def block_sizes(self) -> list[int]:
        base, extra = divmod(self.attention_ranks, self.ffn_ranks)
        return [base + (1 if f < extra else 0) for f in range(self.ffn_ranks)]

    def attention_world_rank(self, a: int) -> int:
        return self.ffn_ranks + a

    def peers_of_ffn(self, f: int) -> tuple[int, ...]:
        """World ranks of the attention peers owned by FFN rank ``f``."""
        if not 0 <= f < self.ffn_ranks:
            raise LayoutError(f"FFN rank {f} out of range for layout {self} ({self.ffn_ranks} FFN ranks)")
        base, extra = divmod(self.attention_ranks, self.ffn_ranks)
        start = f * base + min(f, extra)
        return tuple(self.attention_world_rank(a) for a in range(start, start + base + (f < extra)))

    def ffn_of_attention(self, a: int) -> int:
        """World rank of the FFN rank serving attention index ``a`` (the inverse of the blocks of
        :meth:`peers_of_ffn`: the first ``extra`` blocks hold ``base + 1`` peers)."""
        if not 0 <= a < self.attention_ranks:
            raise LayoutError(f"attention index {a} out of range for layout {self}")
        base, extra = divmod(self.attention_ranks, self.ffn_ranks)
        big = extra * (base + 1)  # the peers of the larger blocks
        return a // (base + 1) if a < big else extra + (a - big) // base

    def role_of(self, rank: int) -> tuple[str, int]:
        """``("ffn", f)`` or ``("attention", a)`` for a world rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} out of range for layout {self} (world size {self.world_size})")
        if rank < self.ffn_ranks:
            return ("ffn", rank)
        return ("attention", rank - self.ffn_ranks)


def micro_batches(seq_tokens: Sequence[int], stages: int) -> list[tuple[int, int]]:
    """Split sequences (their token counts, in batch order) into ``stages`` contiguous
    micro-batches of whole sequences, balanced by tokens: ``[(first, end), ...]`` sequence index
    ranges, one per stage; with fewer sequences than stages the last ones are empty."""
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if any(n < 0 for n in seq_tokens):
        raise ValueError(f"sequence token counts must be >= 0, got {list(seq_tokens)}")
    total, bounds, acc, i = sum(seq_tokens), [0], 0, 0
    for s in range(1, stages):
        # the stage ends at the first sequence boundary reaching its share of the tokens, and
        # takes at least one sequence while there are some left
        target = total * s / stages
        start = i
        while i < len(seq_tokens) and (acc < target or i == start):
            acc += seq_tokens[i]
            i += 1
        bounds.append(i)
    bounds.append(len(seq_tokens))
    return [(bounds[s], max(bounds[s], bounds[s + 1])) for s in range(stages)]
