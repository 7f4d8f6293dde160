"""afd-compile: torch.fx passes that split a traced transformer for attention-FFN disaggregation."""

from . import ops  # noqa: F401  (registers the afd:: custom ops)
from .comm import AFDCommunicator, TransferMetadata, get_communicator, register_communicator
from .layout import AFDLayout, LayoutError
from .passes.roles import NodeRole, NoStructureError, Role, annotate_roles
from .passes.schedule import ScheduleError, verify_schedule
from .passes.split import LayerCut, SplitError, SplitPlan, SplitResult
from .split_api import SplitConfig, split, split_graph_module
from .wire import WireSpec, WireTensor

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
    "register_communicator",
    "split",
    "split_graph_module",
    "verify_schedule",
]
