"""afd-compile: torch.fx passes that split a traced transformer for attention-FFN disaggregation."""

from . import ops  # noqa: F401  (registers the afd:: custom ops)
from .comm import AFDCommunicator, TransferMetadata, get_communicator, register_communicator
from .layout import AFDLayout, LayoutError
from .passes.roles import NodeRole, NoStructureError, Role, annotate_roles
from .passes.schedule import ScheduleError, verify_schedule
from .passes.split import LayerCut, SplitError, SplitPlan, SplitResult
from .split_api import SplitConfig, split, split_graph_module
from .state_store import held_state_bytes
from .wire import WireSpec, WireTensor


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
