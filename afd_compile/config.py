"""What the passes that build a rank's program depend on besides the layout (:class:`SplitConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .passes.roles import RolePolicy, default_policy


@dataclass(frozen=True)
class SplitConfig:
    """What the AFD passes depend on. ``policy`` says which nodes are FFN (default: module path,
    then structure); ``compute_gate_on_attention`` puts the MoE router on the attention side;
    ``graph_name``: the name messages give the graph; ``comm_id``: the communicator the
    program's transfers name."""

    comm_id: int = 0
    compute_gate_on_attention: bool = False
    policy: RolePolicy = field(default=default_policy, compare=False)
    graph_name: str = "graph"
