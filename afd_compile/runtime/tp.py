"""A TP rank as it runs: with attention DP groups, the per-step token counts of the groups first."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..comm import TPStep
from ..scatter import TPLayout


def dp_step_counts(x: Sequence[torch.Tensor], lay: TPLayout, rank: int) -> TPStep:
    """All TP ranks exchange their token counts (one small all-gather per step): the step's
    per-DP-group counts, for the DP collectives of the program run inside
    ``comm.step_counts(...)`` (:class:`TPRank` does)."""
    from ..comm import GROUP_TP, GROUP_TP_CONTROL, TPStep, get_group

    own = int(x[0].numel())  # tokens of this rank's input (batch x sequence)
    try:  # (a gloo group beside the TP group: no device-to-host wait on NCCL)
        group = get_group(GROUP_TP_CONTROL)
    except KeyError:
        group = get_group(GROUP_TP)
    dev = x[0].device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    counts = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(lay.tp)]
    dist.all_gather(counts, torch.tensor([own], device=dev), group=group)
    per_rank = [int(c) for c in counts]
    groups = [per_rank[i * lay.attn_tp] for i in range(lay.attn_dp)]
    for r, c in enumerate(per_rank):
        if c != groups[lay.attn_dp_rank(r)]:
            raise RuntimeError(f"ranks of attention DP group {lay.attn_dp_rank(r)} disagree on tokens: {per_rank}")
    return TPStep(lay.attn_dp_rank(rank), tuple(groups))


@dataclass
class TPRank:
    """A TP rank's program as it runs: with attention DP groups every step first exchanges the
    groups' token counts (:func:`dp_step_counts`) and passes the program its carrier of the
    total; else the program alone. The process groups its collectives name are registered first
    (:func:`afd_compile.deploy.load_rewritten_rank` does)."""

    program: Callable[..., Any]
    layout: TPLayout
    rank: int

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if self.layout.attn_dp > 1:
            from ..comm import step_counts

            step = dp_step_counts(inputs, self.layout, self.rank)
            with step_counts(step):
                return self.program(*inputs, torch.empty(step.total, 0, device=inputs[0].device))
        return self.program(*inputs)
