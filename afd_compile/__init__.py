"""afd-compile: torch.fx passes that split a traced transformer for attention-FFN disaggregation.

The names below are imported on first use (PEP 562), so ``afd-compile --help`` and argument
errors do not pay for importing torch. Importing any of them (or ``afd_compile.ops``) registers
the ``afd::`` custom ops.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public name -> the module that defines it
_EXPORTS = {
    "AFDCommunicator": ".comm",
    "TransferMetadata": ".comm",
    "get_communicator": ".comm",
    "register_communicator": ".comm",
    "AFDLayout": ".layout",
    "LayoutError": ".layout",
    "NodeRole": ".passes.roles",
    "NoStructureError": ".passes.roles",
    "Role": ".passes.roles",
    "annotate_roles": ".passes.roles",
    "ScheduleError": ".passes.schedule",
    "verify_schedule": ".passes.schedule",
    "LayerCut": ".passes.split",
    "SplitError": ".passes.split",
    "SplitPlan": ".passes.split",
    "SplitResult": ".passes.split",
    "SplitConfig": ".split_api",
    "split": ".split_api",
    "split_graph_module": ".split_api",
    "held_state_bytes": ".state_store",
    "WireSpec": ".wire",
    "WireTensor": ".wire",
}

if TYPE_CHECKING:
    from .comm import AFDCommunicator, TransferMetadata, get_communicator, register_communicator
    from .layout import AFDLayout, LayoutError
    from .passes.roles import NodeRole, NoStructureError, Role, annotate_roles
    from .passes.schedule import ScheduleError, verify_schedule
    from .passes.split import LayerCut, SplitError, SplitPlan, SplitResult
    from .split_api import SplitConfig, split, split_graph_module
    from .state_store import held_state_bytes
    from .wire import WireSpec, WireTensor


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'afd_compile' has no attribute {name!r}")
    importlib.import_module(".ops", __name__)  # the afd:: ops, before anything that runs them
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def compile(model: object, options: dict | None = None, **kwargs: object) -> object:  # noqa: A001
    """``torch.compile(model, backend="afd", options=options, **kwargs)`` with the options checked
    first (:func:`afd_compile.backend.check_options`: types, the layout, the live process group):
    a bad option raises BackendOptionError here, in one line of your traceback, instead of inside
    dynamo's first compile."""
    import torch

    from .backend import BackendOptionError, check_options

    if not callable(model):
        raise BackendOptionError(f"afd_compile.compile: model must be a torch.nn.Module or a callable, got {model!r} "
                                 f"({type(model).__name__})")
    check_options(options)
    return torch.compile(model, backend="afd", options=options, **kwargs)


def serve(model: object, options: dict, example_inputs: tuple | None = None,
          example_kwargs: dict | None = None) -> int:
    """Run an FFN rank of an AFD deployment until every attention rank has finished (see
    :func:`afd_compile.backend.serve`); returns the steps served."""
    from .backend import serve as serve_ffn

    return serve_ffn(model, options, example_inputs, example_kwargs)  # type: ignore[arg-type]


__all__ = [
    "AFDCommunicator",
    "AFDLayout",
    "LayerCut",
    "LayoutError",
    "NoStructureError",
    "NodeRole",
    "Role",
    "ScheduleError",
    "SplitConfig",
    "SplitError",
    "SplitPlan",
    "SplitResult",
    "TransferMetadata",
    "WireSpec",
    "WireTensor",
    "annotate_roles",
    "get_communicator",
    "held_state_bytes",
    "register_communicator",
    "serve",
    "split",
    "split_graph_module",
    "verify_schedule",
]
