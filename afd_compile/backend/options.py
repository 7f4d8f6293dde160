"""The backend's options: their types and ranges (:data:`_OPTION_TYPES`), the parsed
:class:`BackendOptions`, and :func:`check_options` (every check that needs no graph)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import AFDCompileError
from ..limits import MAX_RANKS, MAX_STAGES, MAX_TIMEOUT_S

if TYPE_CHECKING:
    from ..buckets import TokenBuckets
    from ..layout import AFDLayout
    from ..scatter import TPLayout


class BackendOptionError(AFDCompileError):
    pass


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ranks(lo: int) -> tuple[Callable[[Any], bool], str]:
    """A count of ranks (or a rank, ``lo`` 0): an int in [lo, MAX_RANKS]."""
    return (lambda v: _is_int(v) and lo <= v <= MAX_RANKS), f"an int in [{lo}, {MAX_RANKS}]"


def _buckets_ok(value: Any) -> bool:
    from ..buckets import BucketError, TokenBuckets

    if not isinstance(value, (str, bool, list, tuple)):
        return False
    try:
        TokenBuckets.parse(value)
    except BucketError:
        return False
    return True


#: per option: (check, what it must be)
_OPTION_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tp": _ranks(1),
    "attn_dp": _ranks(1),
    "moe_a2a": (lambda v: isinstance(v, bool), "a bool"),
    "dense_dp": (lambda v: isinstance(v, bool), "a bool"),
    "vocab_parallel": (lambda v: isinstance(v, bool), "a bool"),
    "attention": _ranks(0),
    "ffn": _ranks(0),
    "rank": (lambda v: v is None or (_is_int(v) and 0 <= v < MAX_RANKS), f"None or an int in [0, {MAX_RANKS})"),
    "world_size": (lambda v: v is None or (_is_int(v) and 1 <= v <= MAX_RANKS), f"None or an int in [1, {MAX_RANKS}]"),
    "inductor": (lambda v: isinstance(v, bool), "a bool"),
    "cudagraphs": (lambda v: v is None or isinstance(v, bool), "None or a bool"),
    "policy": (lambda v: isinstance(v, str), "a str"),
    "comm_id": (lambda v: _is_int(v) and 0 <= v < 1 << 63, "an int in [0, 2**63)"),
    "timeout_s": (lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                          and math.isfinite(v) and 0 < v <= MAX_TIMEOUT_S),
                  f"None or seconds in (0, {MAX_TIMEOUT_S:.0f}] (a week)"),
    "check_wire": (lambda v: v is None or isinstance(v, bool), "None or a bool"),
    "decode_attention": (lambda v: v in ("auto", "flex", "sdpa"), "'auto', 'flex' or 'sdpa'"),
    "moe_experts": (lambda v: v in ("auto", "op"), "'auto' or 'op'"),
    "stages": (lambda v: _is_int(v) and 1 <= v <= MAX_STAGES, f"an int in [1, {MAX_STAGES}]"),
    "ffn_tp": _ranks(1),
    "ffn_ep": _ranks(1),
    "attn_tp": _ranks(1),
    "symm_mem": (lambda v: isinstance(v, bool), "a bool"),
    "ffn_capture": (lambda v: v in ("compute", "all"), "'compute' or 'all'"),
    "buckets": (_buckets_ok, "'default', 'off', 'fixed:N', a bool, or an ascending list of token counts >= 1"),
    "batch_buckets": (lambda v: v == "auto" or (_buckets_ok(v) and not str(v).strip().lower().startswith("fixed")),
                      "'auto', 'default', 'off', a bool, or an ascending list of sequence counts >= 1"),
}


@dataclass(frozen=True)
class AFDOptions:
    """The options of an AFD layout (``attention`` and ``ffn`` ranks, both given): its groups,
    micro-batch stages, the attention ranks' token buckets, what an FFN rank's CUDA graphs hold,
    the wire checks."""

    attention: int
    ffn: int
    ffn_tp: int = 1
    ffn_ep: int = 1
    attn_tp: int = 1
    stages: int = 1
    #: token buckets of the attention ranks (buckets.py): "default", "off" / False, or the sizes;
    #: each attention rank's tokens cross the wire padded to a bucket, an FFN rank's rows to the
    #: bucket of their total, so it compiles one program per bucket, not per exact count
    buckets: str | bool | tuple[int, ...] = "default"
    #: what an FFN rank's CUDA graphs hold: "all" (its whole program, the exchange inside: compiled
    #: once per bucket of its rows, captured once per tuple of its peers' sizes: a step is one replay),
    #: "compute" (the exchange with its peers and its group runs between the captured pieces, reading
    #: each step's per-peer sizes: one graph per bucket of rows, host work every layer; for an FFN
    #: rank of many peers, docs/backend.md)
    ffn_capture: str = "all"
    check_wire: bool | None = None
    #: an attention rank's batch padded to the next of these numbers of sequences before its step,
    #: the outputs cut back (runtime/pad_batch.py): its CUDA graphs are one per bucket, not per
    #: batch size; "auto": the default buckets when its program is captured in CUDA graphs
    batch_buckets: str | bool | tuple[int, ...] = "auto"

    def layout(self) -> AFDLayout:
        from ..layout import AFDLayout

        return AFDLayout(self.attention, self.ffn, self.ffn_tp, self.ffn_ep, self.attn_tp)

    @property
    def token_buckets(self) -> TokenBuckets | None:
        """The parsed :class:`~afd_compile.buckets.TokenBuckets` (None: off)."""
        from ..buckets import TokenBuckets

        return TokenBuckets.parse(self.buckets)


@dataclass(frozen=True)
class TPOptions:
    """The options of a TP layout (``tp`` > 1 ranks): attention DP groups and the SCATTERED /
    vocabulary-parallel choices."""

    tp: int
    attn_dp: int = 1
    moe_a2a: bool = False
    dense_dp: bool = False
    vocab_parallel: bool = False

    def layout(self) -> TPLayout:
        from ..scatter import TPLayout

        return TPLayout(self.tp, self.attn_dp, moe_a2a=self.moe_a2a, dense_dp=self.dense_dp,
                        vocab_parallel=self.vocab_parallel)


#: what a layout's defining options are when the layout is not given
_ABSENT = {"attention": 0, "ffn": 0, "tp": 1}

#: each layout's options (the flat ``options={...}`` names), and the words its errors use
_LAYOUT_OPTIONS = {"afd": (AFDOptions, "an AFD layout (attention, ffn)"), "tp": (TPOptions, "a TP layout (tp > 1)")}


@dataclass(frozen=True)
class BackendOptions:
    """The parsed options: ``afd`` / ``tp`` hold a layout's options when that layout is given
    (None otherwise: an option of a layout not given is refused by :meth:`parse`, so what applies
    follows from which record holds it); the rest apply to every process."""

    afd: AFDOptions | None = None
    tp: TPOptions | None = None
    rank: int | None = None
    world_size: int | None = None
    inductor: bool = True
    cudagraphs: bool | None = None
    policy: str = "default"
    comm_id: int = 0
    timeout_s: float | None = None
    decode_attention: str = "auto"
    moe_experts: str = "auto"
    symm_mem: bool = True

    @staticmethod
    def parse(options: dict[str, Any] | None) -> BackendOptions:
        if options is not None and not isinstance(options, Mapping):
            raise BackendOptionError(f"afd backend: options must be a dict of option names to values (or None), got "
                                     f"{options!r} ({type(options).__name__}): e.g. "
                                     f"options={{'attention': 2, 'ffn': 1}}")
        if any(not isinstance(k, str) for k in options or {}):
            raise BackendOptionError(f"afd backend: option names are strings, got {sorted(map(repr, options))}")
        options = dict(options or {})
        unknown = sorted(set(options) - set(_OPTION_TYPES))
        if unknown:
            raise BackendOptionError(f"afd backend: unknown option(s) {unknown}; known: {sorted(_OPTION_TYPES)}")
        for name, value in options.items():
            ok, what = _OPTION_TYPES[name]
            if not ok(value):
                raise BackendOptionError(
                    f"afd backend: option {name}={value!r} ({type(value).__name__}) must be {what}"
                )
        for name in ("buckets", "batch_buckets"):
            if isinstance(options.get(name), list):
                options[name] = tuple(options[name])
        given = {"afd": bool(options.get("attention") or options.get("ffn")), "tp": options.get("tp", 1) > 1}
        if given["afd"] and given["tp"]:
            raise BackendOptionError(
                "afd backend: give either a TP layout (tp, attn_dp) or an AFD layout (attention, ffn), not both"
            )
        if given["afd"] and not (options.get("attention") and options.get("ffn")):
            raise BackendOptionError(
                f"afd backend: AFD needs both attention and ffn ranks (attention="
                f"{options.get('attention', 0)}, ffn={options.get('ffn', 0)})"
            )
        groups: dict[str, Any] = {}
        for kind, (cls, words) in _LAYOUT_OPTIONS.items():
            mine = {f.name: f for f in dataclasses.fields(cls)}
            if given[kind]:
                groups[kind] = cls(**{k: v for k, v in options.items() if k in mine})
                continue
            for name, value in options.items():  # (its default changes nothing: not refused)
                if name in mine and value != _ABSENT.get(name, mine[name].default):
                    raise BackendOptionError(f"afd backend: {name}={value!r} applies to {words} only")
        grouped = {f.name for cls, _ in _LAYOUT_OPTIONS.values() for f in dataclasses.fields(cls)}
        rest = {k: v for k, v in options.items() if k not in grouped}
        from ..passes.roles import POLICIES

        if rest.get("policy", "default") not in POLICIES:
            raise BackendOptionError(f"afd backend: unknown policy {rest['policy']!r} (known: {sorted(POLICIES)})")
        return BackendOptions(**groups, **rest)

    def layout(self) -> AFDLayout | TPLayout | None:
        """The layout the options describe: an ``AFDLayout`` (attention, ffn and their groups), a
        ``TPLayout`` (tp, attn_dp and the SCATTERED / vocabulary options), or None (one process)."""
        return self.afd.layout() if self.afd else self.tp.layout() if self.tp else None

    @property
    def mode(self) -> str:
        return "afd" if self.afd else "tp" if self.tp else "none"

    def resolved(self) -> tuple[int, int]:
        """(rank, world size): the live process group's when there is one (a ``rank`` /
        ``world_size`` option must then agree with it), else the options, else RANK / WORLD_SIZE."""
        import torch.distributed as dist

        if dist.is_initialized():
            live = {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
            for name, value in live.items():
                given = getattr(self, name)
                if given is not None and given != value:
                    raise BackendOptionError(
                        f"afd backend: option {name}={given}, but this process is {name} "
                        f"{value} of the initialised process group"
                    )
            return live["rank"], live["world_size"]
        rank = self.rank if self.rank is not None else int(os.environ.get("RANK", "0"))
        world = self.world_size if self.world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        return rank, world


def check_options(options: dict[str, Any] | None) -> BackendOptions:
    """Every check of the options that needs no graph: types and ranges, the layout itself, the
    live process group against it (initialised, rank and world size). Raises BackendOptionError.
    :func:`afd_compile.compile` runs it before ``torch.compile``, so a bad option is one error in the
    caller's frame, not a failure dynamo wraps at the first call."""
    import torch.distributed as dist

    opts = BackendOptions.parse(options)
    rank, world = opts.resolved()
    if opts.mode != "none" and not dist.is_initialized():
        raise BackendOptionError(
            f"afd backend: layout {opts.mode} needs torch.distributed initialised on every "
            "rank first (torchrun + afd_compile.runtime.init_distributed())"
        )
    if opts.tp is not None and opts.tp.tp != world:
        raise BackendOptionError(f"afd backend: tp={opts.tp.tp} must equal the world size ({world})")
    if opts.afd is not None:
        from ..layout import LayoutError

        try:
            layout = opts.layout()
        except LayoutError as e:
            raise BackendOptionError(f"afd backend: {e}") from None
        if layout.world_size != world:
            raise BackendOptionError(
                f"afd backend: attention={opts.afd.attention} + ffn={opts.afd.ffn} ranks must "
                f"equal the world size ({world})"
            )
    return opts
