"""How the ``afd::`` communication ops are registered: with little host cost per call.

``torch.library.custom_op`` wraps each call in Python layers of its own (autograd, in-place
version bumps, an aliasing check after the kernel): 20-40 µs a call on top of the kernel (32 µs for
an empty op on this CPU; 20-37 µs for the fused exchange op on the GPU host, whose kernel itself
is 40-55 µs of Python: benchmarks/ffn_program_step.py). An FFN program whose
exchange runs between captured pieces (the backend's ``ffn_capture="compute"``), and every program
not captured in a CUDA graph, pays that once per op and layer each step. Ops registered here are
defined on a ``torch.library.Library`` fragment with their kernel under
``CompositeExplicitAutograd`` (schema inferred from the signature, as ``custom_op`` does): the
dispatcher calls the Python kernel directly (about 8 µs a call for an empty op). What compilers see is the same:
a schema with its mutations, a fake implementation, an op dynamo, AOT and Inductor keep. What
they lose is autograd: no gradient flows through these ops (inference only; the backend compiles
under ``torch.no_grad``).

    @afd_op("afd::p2p_send_group", mutates_args=())
    def p2p_send_group(tensors: list[torch.Tensor], ...) -> torch.Tensor: ...

    @p2p_send_group.register_fake
    def _(tensors, ...): ...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

_LIBS: dict[str, torch.library.Library] = {}


class AfdOp:
    """An op registered by :func:`afd_op`: call it as the op; ``register_fake`` as custom_op's."""

    def __init__(self, qualname: str, fn: Callable[..., Any], mutates_args: Sequence[str]) -> None:
        namespace, self.name = qualname.split("::")
        if namespace not in _LIBS:
            _LIBS[namespace] = torch.library.Library(namespace, "FRAGMENT")
        self.lib, self.qualname, self.fn = _LIBS[namespace], qualname, fn
        self.lib.define(self.name + torch.library.infer_schema(fn, mutates_args=tuple(mutates_args)))
        self.lib.impl(self.name, fn, "CompositeExplicitAutograd")
        self.__doc__ = fn.__doc__
        self.default: torch._ops.OpOverload = getattr(getattr(torch.ops, namespace), self.name).default

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        torch.library.register_fake(self.qualname, fake, lib=self.lib)
        return fake

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.default(*args, **kwargs)


def afd_op(qualname: str, *, mutates_args: Sequence[str]) -> Callable[[Callable[..., Any]], AfdOp]:
    """Register ``fn`` as the op ``qualname`` (module docstring)."""
    return lambda fn: AfdOp(qualname, fn, mutates_args)
