"""The public split entry point: the AFD pipeline's split passes (``afd_compile.portable``) on a
graph, both programs out."""

from __future__ import annotations

import torch
import torch.fx as fx

from .config import SplitConfig
from .layout import AFDLayout
from .passes.split import SplitResult

__all__ = ["SplitConfig", "as_graph_module", "split", "split_graph_module"]


def as_graph_module(program: torch.export.ExportedProgram | fx.GraphModule) -> fx.GraphModule:
    if isinstance(program, torch.export.ExportedProgram):
        return program.module()
    if isinstance(program, fx.GraphModule):
        return program
    raise TypeError(f"expected an ExportedProgram or GraphModule, got {type(program).__name__}")


def split_graph_module(gm: fx.GraphModule, config: SplitConfig | None = None, *,
                       layout: AFDLayout | None = None) -> SplitResult:
    """Split ``gm`` (annotated in place with ``afd.role``; its graph is not changed, its MoE
    experts recognised on a copy, ``passes/moe``) into the attention and FFN programs, and check
    their send/recv schedule: the afd-ffn pipeline of ``layout``'s FFN ranks (its fan-in and
    groups) through ``verify_schedule``."""
    from .pipeline import builds_for
    from .portable import Work, run

    build = builds_for(layout or AFDLayout(1, 1), "cpu")[1]
    result = run(Work(build, gm, layout, config=config or SplitConfig()), until="verify_schedule").split
    assert result is not None
    return result


def split(program: torch.export.ExportedProgram | fx.GraphModule, config: SplitConfig | None = None, *,
          layout: AFDLayout | None = None) -> SplitResult:
    """Split an exported program (or a GraphModule) into attention and FFN programs."""
    return split_graph_module(as_graph_module(program), config, layout=layout)
