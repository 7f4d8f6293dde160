"""Distribution states and the collective each boundary needs (DESIGN §3, seed 004).

A tensor's :class:`DistState` is a :class:`ScatterMode` (how many ranks hold the same data: its
*group size*) plus ``partial`` (a sum is still owed across that group, e.g. after a row-parallel
linear) and ``split_last`` (each rank of the group holds a slice of the last dim, e.g. after a
column-parallel LM head: its slice of the vocabulary). Group sizes come from the :class:`TPLayout`:

=================  ==========================================
SCATTERED          1: each rank its own tokens
TP_ATTN_FULL       attn_tp = tp / attn_dp: the attention TP group shares its tokens
FULL               tp: every TP rank holds every token
=================  ==========================================

:func:`transition` is the one place a collective is chosen, from the (src, dst) pair alone::

    same size,  partial      -> all_reduce
    small->large, not partial -> all_gather
    small->large, partial     -> all_gather that also reduces (SGLang's dp_gather_partial)
    large->small, partial     -> reduce_scatter
    large->small, not partial -> scatter (take the local slice, no communication)
    same size,  not partial  -> nothing (no record; like DTensor, no-op transforms are refused)
    same size,  split_last -> whole   -> all_gather along the last dim (``dim="last"``)
    same size,  whole -> split_last   -> scatter along the last dim (take the local slice)

A split last dim changes only within one mode and never with a partial sum pending (two steps,
each its own record); over a group of one rank it is no split at all.

Standard TP (attn_dp == 1) makes TP_ATTN_FULL and FULL the same size, so every mode change
vanishes and only the in-block all-reduces remain: the Megatron pattern, nothing special-cased.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .errors import AFDCompileError
from .layout import LayoutError
from .limits import MAX_RANKS


class ScatterMode(enum.Enum):
    SCATTERED = "SCATTERED"
    TP_ATTN_FULL = "TP_ATTN_FULL"
    FULL = "FULL"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TPLayout:
    """``tp`` ranks in one TP group, ``attn_dp`` data-parallel attention groups inside it.

    ``moe_a2a``: MoE layers dispatch tokens with all-to-all (their MLP mode is SCATTERED).
    ``dense_dp``: dense MLPs run fully data-parallel (mode SCATTERED, weights not sharded).
    ``vocab_parallel``: the LM head is split by vocabulary over the attention TP group, its
    logits all-gathered (``passes/vocab_head.py``); off (the default: measured no faster at
    decode on 2 H200s, BENCHMARKS.md): every rank holds the whole head.
    """

    tp: int
    attn_dp: int = 1
    moe_a2a: bool = False
    dense_dp: bool = False
    vocab_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "attn_dp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise LayoutError(f"TP layout: {name} must be an integer, got {v!r} ({type(v).__name__})")
        for name in ("moe_a2a", "dense_dp", "vocab_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise LayoutError(f"TP layout: {name} must be True or False, got {getattr(self, name)!r}")
        if self.tp > MAX_RANKS:
            raise LayoutError(f"TP layout: tp={self.tp} ranks, more than the {MAX_RANKS} a layout may have")
        if self.tp < 1 or self.attn_dp < 1:
            raise LayoutError(f"TP layout needs tp >= 1 and attn_dp >= 1, got tp={self.tp} attn_dp={self.attn_dp}")
        if self.tp % self.attn_dp:
            raise LayoutError(f"attn_dp={self.attn_dp} does not divide tp={self.tp}")

    def __str__(self) -> str:
        extra = "".join([" moe_a2a" if self.moe_a2a else "", " dense_dp" if self.dense_dp else "",
                         " vocab_parallel" if self.vocab_parallel else ""])
        return f"tp={self.tp} attn_dp={self.attn_dp}{extra}"

    @property
    def attn_tp(self) -> int:
        return self.tp // self.attn_dp

    def group_size(self, mode: ScatterMode) -> int:
        return {ScatterMode.SCATTERED: 1, ScatterMode.TP_ATTN_FULL: self.attn_tp, ScatterMode.FULL: self.tp}[mode]

    def attn_dp_rank(self, rank: int) -> int:
        """Which attention DP group ``rank`` is in."""
        return rank // self.attn_tp

    def attn_tp_rank(self, rank: int) -> int:
        return rank % self.attn_tp

    def attn_tp_group(self, rank: int) -> tuple[int, ...]:
        start = self.attn_dp_rank(rank) * self.attn_tp
        return tuple(range(start, start + self.attn_tp))


@dataclass(frozen=True)
class DistState:
    mode: ScatterMode
    partial: bool = False
    split_last: bool = False

    def __str__(self) -> str:
        return f"{self.mode.value}{'+P' if self.partial else ''}{'+S' if self.split_last else ''}"

    def __repr__(self) -> str:
        split = ", split_last=True" if self.split_last else ""
        return f"DistState({self.mode.value}, partial={self.partial}{split})"


class Collective(enum.Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    SCATTER = "scatter"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Transition:
    """One collective: from ``src`` to ``dst`` over groups of ``src_size`` -> ``dst_size`` ranks.
    ``reduces``: the collective also settles a pending partial sum."""

    src: DistState
    dst: DistState
    collective: Collective
    src_size: int
    dst_size: int
    reduces: bool
    dim: str = "tokens"  # which dim the collective joins or cuts: "tokens" | "last"

    def __str__(self) -> str:
        r = "(reduce)" if self.reduces and self.collective is Collective.ALL_GATHER else ""
        d = "(last)" if self.dim == "last" else ""
        return f"{self.collective}{r}{d} {self.src}[{self.src_size}] -> {self.dst}[{self.dst_size}]"


class TransitionError(AFDCompileError):
    pass


def transition(src: DistState, dst: DistState, layout: TPLayout) -> Transition | None:
    """The collective that takes a tensor from ``src`` to ``dst``; None when nothing is needed."""
    if dst.partial:
        raise TransitionError(f"cannot move {src} into a partial state {dst}: partial sums are produced, not targeted")
    a, b = layout.group_size(src.mode), layout.group_size(dst.mode)
    if src.split_last or dst.split_last:
        return _last_dim(src, dst, a, b)
    if a == b:
        if not src.partial:
            return None
        return Transition(src, dst, Collective.ALL_REDUCE, a, b, True)
    if a < b:
        return Transition(src, dst, Collective.ALL_GATHER, a, b, src.partial)
    if src.partial:
        return Transition(src, dst, Collective.REDUCE_SCATTER, a, b, True)
    return Transition(src, dst, Collective.SCATTER, a, b, False)


def _last_dim(src: DistState, dst: DistState, a: int, b: int) -> Transition | None:
    if src.mode is not dst.mode or src.partial:
        raise TransitionError(f"cannot move {src} to {dst} in one collective: a split last dim changes only "
                              "within one mode with no partial sum pending (settle the sum, change the mode, "
                              "then gather or split the last dim)")
    if src.split_last == dst.split_last or a == 1:
        return None
    kind = Collective.ALL_GATHER if src.split_last else Collective.SCATTER
    return Transition(src, dst, kind, a, b, False, "last")


# --- per-layer modes (SGLang's LayerScatterModes) ---------------------------------------------

LAYER_MODE_NAMES = ("layer_input", "attn", "mlp", "middle_residual", "layer_output")
JUNCTIONS = ("prepare_attn", "prepare_mlp", "postprocess_layer")


@dataclass(frozen=True)
class LayerModes:
    index: int
    kind: str  # "dense" | "moe"
    layer_input: ScatterMode
    attn: ScatterMode
    mlp: ScatterMode
    middle_residual: ScatterMode
    layer_output: ScatterMode

    def modes(self) -> dict[str, str]:
        return {name: str(getattr(self, name)) for name in LAYER_MODE_NAMES}


def mlp_mode(kind: str, layout: TPLayout) -> ScatterMode:
    """The free variable: MoE with all-to-all or a fully data-parallel dense MLP is SCATTERED,
    anything else FULL."""
    if kind == "moe":
        return ScatterMode.SCATTERED if layout.moe_a2a else ScatterMode.FULL
    return ScatterMode.SCATTERED if layout.dense_dp else ScatterMode.FULL


def infer_layer_modes(kinds: list[str], layout: TPLayout) -> list[LayerModes]:
    """Five modes per layer. ``attn`` is pinned to TP_ATTN_FULL; the residual and output follow
    the MLP (SCATTERED stays SCATTERED, FULL returns to TP_ATTN_FULL); a layer's input is the
    previous layer's output, the first layer's TP_ATTN_FULL. The last layer returns to
    TP_ATTN_FULL so the final norm and lm head see their group's tokens."""
    out = []
    prev = ScatterMode.TP_ATTN_FULL
    for i, kind in enumerate(kinds):
        mlp = mlp_mode(kind, layout)
        residual = ScatterMode.SCATTERED if mlp is ScatterMode.SCATTERED else ScatterMode.TP_ATTN_FULL
        output = residual if i < len(kinds) - 1 else ScatterMode.TP_ATTN_FULL
        out.append(LayerModes(i, kind, prev, ScatterMode.TP_ATTN_FULL, mlp, residual, output))
        prev = output
    return out


@dataclass(frozen=True)
class JunctionPlan:
    """The collectives of one layer's three junctions, in order."""

    layer: int
    prepare_attn: tuple[Transition, ...]
    prepare_mlp: tuple[Transition, ...]
    postprocess_layer: tuple[Transition, ...]

    def names(self) -> dict[str, list[str]]:
        return {j: [str(t.collective) for t in getattr(self, j)] for j in JUNCTIONS}


def plan_junctions(modes: LayerModes, layout: TPLayout) -> JunctionPlan:
    """Attention and MLP outputs are partial when their row-parallel linear is sharded over a
    group larger than one; the pending sum is settled at the junction that follows it."""
    def one(src: DistState, dst: DistState) -> tuple[Transition, ...]:
        t = transition(src, dst, layout)
        return () if t is None else (t,)

    attn_partial = layout.group_size(modes.attn) > 1
    mlp_partial = layout.group_size(modes.mlp) > 1 and modes.mlp is not ScatterMode.SCATTERED
    prepare_attn = one(DistState(modes.layer_input), DistState(modes.attn))
    prepare_mlp = one(DistState(modes.attn, attn_partial), DistState(modes.mlp))
    postprocess = one(DistState(modes.mlp, mlp_partial), DistState(modes.layer_output))
    return JunctionPlan(modes.index, prepare_attn, prepare_mlp, postprocess)
