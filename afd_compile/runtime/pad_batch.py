"""An attention rank's batch padded to a capture size (backend option ``batch_buckets``; and,
under a fixed slot with micro-batch stages, to one sequence a stage).

An attention rank's program is compiled once for the symbolic batch, but Inductor's CUDA graphs
record one graph per batch size a step brings (CUDA graph trees key by input shapes). As vLLM
pads a step's batch to its next capture size, the backend pads the model's inputs to the next
bucket of sequences before the worker's step and cuts the outputs back, so the graphs recorded
are bounded by the buckets a trace touches::

    step(input_ids [5, S])  ->  input_ids [8, S] (sequences 5..7 repeat sequence 4)
                            ->  the worker's step (its tokens on the wire: 8 S)
                            ->  logits [8, S, V][:5]

The padded sequences are computed beside the real ones (attention is per sequence; they also
cross the wire as tokens) and dropped. Where it cannot apply (no symbolic batch, a batch the
program updates in place: a KV cache) the batch is not padded, said once at INFO.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..buckets import TokenBuckets


@dataclass(frozen=True)
class BatchPad:
    """Where a program's batch is: the (input, dim) and (output, dim) pairs that carry it, and the
    buckets it is padded to (:func:`afd_compile.deploy.batch_pad` finds them in a program)."""

    buckets: TokenBuckets
    inputs: tuple[tuple[int, int], ...]
    outputs: tuple[tuple[int, int], ...]

    def pad(self, inputs: Sequence[Any]) -> tuple[list[Any], int]:
        """``inputs`` with the batch padded to its bucket (the last sequence repeated); the real
        batch."""
        i0, d0 = self.inputs[0]
        batch = int(inputs[i0].shape[d0])
        want = self.buckets.slot(batch)
        out = list(inputs)
        if want == batch or batch == 0:
            return out, batch
        for i, d in self.inputs:
            x = out[i]
            fill = x.narrow(d, batch - 1, 1).expand(*[want - batch if k == d else s for k, s in enumerate(x.shape)])
            out[i] = torch.cat([x, fill], dim=d)
        return out, batch

    def cut(self, result: Any, batch: int) -> Any:
        """The program's outputs cut back to the real ``batch``."""
        if not self.outputs:
            return result
        single = not isinstance(result, (list, tuple))
        outs = [result] if single else list(result)
        for j, d in self.outputs:
            if isinstance(outs[j], torch.Tensor) and outs[j].shape[d] != batch:
                outs[j] = outs[j].narrow(d, 0, batch)
        return outs[0] if single else type(result)(outs)
