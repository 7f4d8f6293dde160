"""An attention rank's token count per step, from its program's inputs: what it tells its FFN
rank (in a control message, or a fixed slot's header) and what the wire slots are sized by."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenCount:
    """A step's token count as ``factor * prod(inputs[i].shape[d] for i, d in dims)``."""

    dims: tuple[tuple[int, int], ...]
    factor: int = 1

    def __call__(self, inputs: Sequence[torch.Tensor]) -> int:
        n = self.factor
        for i, d in self.dims:
            n *= int(inputs[i].shape[d])
        return n

    def to_json(self) -> dict:
        return {"dims": [list(x) for x in self.dims], "factor": self.factor}

    def describe(self, names: Sequence[str]) -> str:
        """``input_ids.shape[0] * input_ids.shape[1]`` (``names``: the program's inputs, in order)."""
        terms = [f"{names[i]}.shape[{d}]" for i, d in sorted(self.dims)]
        return " * ".join(([str(self.factor)] if self.factor != 1 or not terms else []) + terms)

    @staticmethod
    def from_json(data: dict) -> TokenCount:
        return TokenCount(tuple((int(i), int(d)) for i, d in data["dims"]), int(data["factor"]))


@dataclass(frozen=True)
class GroupSlice:
    """An attention-TP rank's token count: its slice of the group's ``total`` tokens (the group
    shares its sequences; ``ops.group_token_sizes``' rule, the first ranks one row more)."""

    total: Callable[[Sequence[torch.Tensor]], int]
    parts: int
    rank: int

    def __call__(self, inputs: Sequence[torch.Tensor]) -> int:
        return self.of(self.total(inputs))

    def of(self, total: int) -> int:
        """This rank's slice of ``total`` group tokens (a step's, or a micro-batch's)."""
        from ..ops import group_token_sizes

        return group_token_sizes(total, self.parts)[self.rank]
