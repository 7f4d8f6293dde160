"""What crosses the wire between an attention rank and its FFN rank (DESIGN §4).

Per layer and stage the attention rank sends, in this order: hidden states ``(tokens, hidden)``,
then router logits ``(tokens, experts)`` when routing runs on the attention side, then token ids
``(tokens,)`` int32 when the FFN needs them. The FFN rank answers with its output ``(tokens,
hidden)``. A :class:`WireSpec` is that list, printable as one short string so it can travel as a
``str`` argument of a custom op (a custom op cannot take a Python object)::

    hidden:float32[64],router_logits:float32[4],token_ids:int32[]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The order of kinds on the wire. A spec lists a subset of these, in this order.
WIRE_ORDER: tuple[str, ...] = ("hidden", "router_logits", "token_ids", "ffn_out")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"afd wire: dtype {dtype} cannot cross the wire (known: {sorted(_DTYPES)})")
    return _DTYPE_NAMES[dtype]


@dataclass(frozen=True)
class WireTensor:
    """One token-aligned tensor on the wire: ``(tokens,)`` when ``width`` is None, else ``(tokens, width)``."""

    kind: str
    dtype: torch.dtype
    width: int | None

    def __post_init__(self) -> None:
        if self.kind not in WIRE_ORDER:
            raise ValueError(f"afd wire: unknown tensor kind {self.kind!r} (known: {WIRE_ORDER})")

    def __str__(self) -> str:
        w = "" if self.width is None else str(self.width)
        return f"{self.kind}:{dtype_name(self.dtype)}[{w}]"

    def shape(self, tokens: int) -> tuple[int, ...]:
        return (tokens,) if self.width is None else (tokens, self.width)

    @property
    def bytes_per_token(self) -> int:
        return (self.width or 1) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class WireSpec:
    tensors: tuple[WireTensor, ...]

    def __post_init__(self) -> None:
        kinds = [t.kind for t in self.tensors]
        if not kinds:
            raise ValueError("afd wire: a spec needs at least one tensor")
        if kinds != sorted(kinds, key=WIRE_ORDER.index) or len(set(kinds)) != len(kinds):
            raise ValueError(f"afd wire: tensors {kinds} are not in wire order {WIRE_ORDER}")

    def __str__(self) -> str:
        return ",".join(str(t) for t in self.tensors)

    @staticmethod
    def parse(text: str) -> WireSpec:
        out = []
        for item in text.split(","):
            try:
                kind, rest = item.split(":")
                dname, width = rest.rstrip("]").split("[")
                out.append(WireTensor(kind, _DTYPES[dname], int(width) if width else None))
            except (ValueError, KeyError) as e:
                raise ValueError(f"afd wire: cannot parse spec item {item!r} of {text!r}: {e}") from e
        return WireSpec(tuple(out))

    @property
    def bytes_per_token(self) -> int:
        return sum(t.bytes_per_token for t in self.tensors)


# --- the check header (debug mode) --------------------------------------------------------------

#: slots of a check header: magic, layer, stage, kind, dtype, ndim, dim 0, dim 1
HEADER_SLOTS = 8
HEADER_MAGIC = 0xAFD
_DTYPE_LIST = list(_DTYPES)


def wire_header(kind: str, dtype: torch.dtype, shape: tuple[int, ...], layer_idx: int, stage_idx: int) -> list[int]:
    """What a transfer is, as the int64 slots that travel ahead of it when wire checks are on:
    the receiver compares them with what it expects before it receives the data."""
    dims = list(shape) + [0] * (2 - len(shape))
    return [HEADER_MAGIC, layer_idx, stage_idx, WIRE_ORDER.index(kind), _DTYPE_LIST.index(dtype_name(dtype)),
            len(shape), *dims[:2]]


def describe_header(slots: list[int]) -> str:
    """``layer 1 stage 0 hidden float32 (10, 64)`` (or what is wrong with the header)."""
    if len(slots) != HEADER_SLOTS or slots[0] != HEADER_MAGIC:
        return f"no afd wire header (got {slots}: the peer does not run with wire checks, or sent other data)"
    _, layer, stage, kind, dtype, ndim, *dims = slots
    k = WIRE_ORDER[kind] if 0 <= kind < len(WIRE_ORDER) else f"kind#{kind}"
    d = _DTYPE_LIST[dtype] if 0 <= dtype < len(_DTYPE_LIST) else f"dtype#{dtype}"
    return f"layer {layer} stage {stage} {k} {d} {tuple(dims[:ndim])}"
