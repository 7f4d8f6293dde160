"""The KV cache slices a TP rank holds for the caller (see :mod:`afd_compile.passes.local_state`).

A program that allocates a cache returns the rank's slice; the caller (HF's ``StaticCache``)
gets a **placeholder** in its place: a one-element tensor broadcast to the full cache shape
(strides 0), which HF stores, resets (``zero_``) and passes back every step. At the next call the
placeholder is exchanged for the slice. A cache the caller allocated itself (HF's eager
prefill, ``early_initialization``) is not a placeholder: the program then works on its slice as a
view of the caller's tensor, which keeps all heads (logged once).

Slices live as long as their placeholder: when HF drops its cache, the slices go with it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .passes.local_state import HeldState

log = logging.getLogger("afd_compile.state_store")


class StateStore:
    """Placeholders handed to the caller -> the slices this process holds for them."""

    def __init__(self) -> None:
        self._slices: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self._warned: set[tuple[int, ...]] = set()  # cache shapes warned about (once each)

    def placeholder(self, local: torch.Tensor, h: HeldState) -> torch.Tensor:
        """A placeholder of the full shape for ``local`` (a slice the program allocated)."""
        full = h.full_shape(local.shape)
        stand_in = torch.zeros(1, dtype=local.dtype, device=local.device).as_strided(full, [0] * len(full))
        key = id(stand_in)
        self._slices[key] = (weakref.ref(stand_in, lambda _, k=key: self._slices.pop(k, None)), local)
        return stand_in

    def slice_for(self, caller: torch.Tensor, h: HeldState) -> torch.Tensor:
        """The slice behind ``caller`` (a placeholder), or a view of ``caller``'s slice when it is
        a whole cache the caller allocated."""
        held = self.slice_of(caller)
        if held is not None:
            return held
        if caller.shape[h.dim] != h.size:
            raise ValueError(f"afd backend: cache input {h.node} has {caller.shape[h.dim]} entries along dim {h.dim}, "
                             f"expected {h.size} (the whole cache) or a placeholder this rank returned")
        if tuple(caller.shape) not in self._warned:
            self._warned.add(tuple(caller.shape))
            log.warning("afd: a KV cache allocated outside the compiled program (shape %s) holds all %d heads on "
                        "this TP rank, which uses %d of them; let the compiled model allocate it (compile before "
                        "the first generate()) to hold only this rank's heads", tuple(caller.shape), h.size,
                        h.length)
        return caller.narrow(h.dim, h.start, h.length)

    def slice_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """The slice held for ``t`` when ``t`` is a placeholder this process returned, else None."""
        entry = self._slices.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def bytes_held(self) -> int:
        """Bytes of the slices held for live placeholders."""
        return sum(t.numel() * t.element_size() for ref, t in self._slices.values() if ref() is not None)


#: the process's store (placeholders cross programs: a prefill returns them, decode steps take them)
STORE = StateStore()


def held_state_bytes(tensors: Iterable[torch.Tensor] | None = None) -> int:
    """Bytes of the KV cache slices this process holds for its compiled models (TP ranks): for
    ``tensors`` (a cache's tensors: the slices behind those that are placeholders), or for every
    live placeholder."""
    if tensors is None:
        return STORE.bytes_held()
    slices = [STORE.slice_of(t) for t in tensors]
    return sum(t.numel() * t.element_size() for t in slices if t is not None)


def bind_inputs(held: Sequence[HeldState], inputs: Sequence[Any]) -> list[Any]:
    """``inputs`` with each held cache input exchanged for its slice."""
    out = list(inputs)
    for h in held:
        if h.input is not None:
            out[h.input] = STORE.slice_for(out[h.input], h)
    return out


def bind_outputs(held: Sequence[HeldState], inputs: Sequence[Any], result: Any) -> Any:
    """``result`` with each held cache it returns exchanged for the caller's tensor: the input
    it came in as, or a new placeholder for one the program allocated."""
    if not any(h.outputs for h in held):
        return result
    leaves, spec = torch.utils._pytree.tree_flatten(result)
    for h in (h for h in held if h.outputs):
        caller = inputs[h.input] if h.input is not None else STORE.placeholder(leaves[h.outputs[0]], h)
        for i in h.outputs:
            leaves[i] = caller
    return torch.utils._pytree.tree_unflatten(leaves, spec)
