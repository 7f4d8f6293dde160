"""The public split entry point: annotate roles, plan the cut, build both programs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .layout import AFDLayout
from .passes.ffn_tokens import StaticTokensError, tokens_follow_the_carrier
from .passes.graph_utils import copy_graph_module
from .passes.moe import recognise_moe
from .passes.pipeline import PassTimings
from .passes.roles import RolePolicy, annotate_roles, default_policy
from .passes.schedule import verify_schedule
from .passes.split import (
    TOKEN_MULTIPLE,
    SplitError,
    SplitResult,
    build_attention_program,
    build_ffn_program,
    plan_split,
    propagate_ffn_meta,
)


@dataclass(frozen=True)
class SplitConfig:
    """What the AFD passes depend on. ``policy`` says which nodes are FFN (default: module path,
    then structure); ``compute_gate_on_attention`` puts the MoE router on the attention side."""

    comm_id: int = 0
    compute_gate_on_attention: bool = False
    policy: RolePolicy = field(default=default_policy, compare=False)
    graph_name: str = "graph"


def as_graph_module(program: torch.export.ExportedProgram | fx.GraphModule) -> fx.GraphModule:
    if isinstance(program, torch.export.ExportedProgram):
        return program.module()
    if isinstance(program, fx.GraphModule):
        return program
    raise TypeError(f"expected an ExportedProgram or GraphModule, got {type(program).__name__}")


def split_graph_module(gm: fx.GraphModule, config: SplitConfig | None = None, *,
                       layout: AFDLayout | None = None) -> SplitResult:
    """Split ``gm`` (annotated in place with ``afd.role``; its graph is not changed, its MoE
    experts recognised on a copy, ``passes/moe``) into the
    attention and FFN programs, and check their send/recv schedule."""
    config = config or SplitConfig()
    timings = PassTimings()
    with timings("recognise_moe"):  # (on a copy: the caller's graph stays as it was)
        work, _ = copy_graph_module(gm)
        # (FFN TP / EP groups shard the experts: only the recognised op)
        strict = layout is not None and (layout.ffn_tp > 1 or layout.ffn_ep > 1)
        moe = tuple(recognise_moe(work, strict=strict, graph_name=config.graph_name))
        if any(r.op for r in moe):
            gm = work
    with timings("annotate_roles"):
        annotate_roles(gm, config.policy, compute_gate_on_attention=config.compute_gate_on_attention,
                       graph_name=config.graph_name)
    with timings("plan_split"):
        plan = plan_split(gm, comm_id=config.comm_id, graph_name=config.graph_name)
    with timings("build_attention_program"):
        attention = build_attention_program(gm, plan)
    with timings("build_ffn_program"):
        ffn = build_ffn_program(gm, plan)
    if plan.static_tokens is not None and layout is not None and (max(layout.block_sizes()) > 1 or layout.ffn_tp > 1):
        # an FFN rank fanning in several peers (or an FFN TP group) runs more tokens than the export
        # fixed: its per-token program takes any multiple of the static token dims
        with timings("ffn_tokens_follow_the_carrier"):
            try:
                multiple = tokens_follow_the_carrier(ffn, f"{config.graph_name}: FFN program")
            except StaticTokensError as e:
                raise SplitError(f"{e}; layout {layout} has an FFN rank fanning in {max(layout.block_sizes())} "
                                 "attention peers or an FFN TP group") from None
            ffn.meta[TOKEN_MULTIPLE] = multiple
            propagate_ffn_meta(ffn, None, multiple)
    with timings("verify_schedule"):
        verify_schedule(attention, ffn)
    return SplitResult(attention, ffn, plan, timings.seconds, moe)


def split(program: torch.export.ExportedProgram | fx.GraphModule, config: SplitConfig | None = None, *,
          layout: AFDLayout | None = None) -> SplitResult:
    """Split an exported program (or a GraphModule) into attention and FFN programs."""
    return split_graph_module(as_graph_module(program), config, layout=layout)
