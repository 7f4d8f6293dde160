"""An AFD attention rank's CUDA graphs over a changing batch, on one GPU (issue 52): the program
compiled once for the symbolic batch (as the backend compiles it), run over a seeded trace of
batch sizes, its batch as it came or padded to the next bucket (backend option
``batch_buckets``, runtime/pad_batch.py).

The program is the real one: an HF Llama-shaped decoder (random weights, bf16, ``--layers``
layers, hidden 2048) exported with a dynamic batch, split for AFD 1A1F, the attention rank's
program lowered for CUDA and compiled by ``PerLayout`` with Inductor's CUDA graph trees, run by an
``AttentionWorker`` on a fixed wire slot. One GPU has no FFN peer: the process group is torch's
no-op one (``"fake"``, world 2, this rank the attention rank 1) and the batched call a stand-in
that zeroes each receive and sends nothing. Per way: the CUDA graphs the trees recorded over the
trace (one per distinct batch size a step brought), and the wall µs a step of the last ``--steps``
steps (the trace run twice first: every graph recorded by then).

    python benchmarks/attention_graphs.py --json $OUT/attention_graphs.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import re
import sys
import time

import torch
import torch.fx as fx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def graphs_recorded() -> int:
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
    return 0 if manager is None else int(re.search(r"\d+", repr(manager.graph_counter)).group())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--trace", type=int, default=120, help="steps of the trace (batch drawn from 1..max)")
    parser.add_argument("--steps", type=int, default=40, help="the last steps, timed")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("attention_graphs: needs a CUDA GPU", file=sys.stderr)
        return 2
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from afd_compile.backend import PerLayout
    from afd_compile.buckets import TokenBuckets
    from afd_compile.comm import AFDCommunicator, register_communicator
    from afd_compile.deploy import batch_pad, token_count_for_graph
    from afd_compile.layout import AFDLayout
    from afd_compile.models import build_hf, export_lm
    from afd_compile.pipeline import Build, lower
    from afd_compile.runtime import AttentionWorker
    from afd_compile.runtime.slots import prepare
    from afd_compile.split_api import split

    dev = torch.device("cuda")
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)

    def stand_in(ops: list) -> list:
        for op in ops:
            if op.op is dist.irecv:
                op.tensor.zero_()
        return []

    dist.batch_isend_irecv = stand_in
    model = build_hf("llama", num_layers=args.layers, hidden_size=2048, intermediate_size=6144,
                     num_attention_heads=16, num_key_value_heads=4, vocab_size=1024)
    # exported on the GPU (the rotary positions the trace makes live there); decode steps: one token a sequence
    ep = export_lm(model.to(dev, torch.bfloat16), vocab_size=1024, batch=4, seq=1, device=dev)
    result = split(ep, layout=AFDLayout(1, 1))
    base = result.attention
    counter = token_count_for_graph(base, result.plan.cuts[0].token_dims)
    slot = args.max_batch
    rng = random.Random(0)
    trace = [rng.randint(1, args.max_batch) for _ in range(args.trace)]
    rows = []
    with torch.no_grad():
        for way in ("as it came", "padded to buckets"):
            prog = fx.GraphModule(base, copy.deepcopy(base.graph), class_name="AFDAttentionProgram")
            prog.meta.update(base.meta)
            build = Build("afd-attention", device="cuda", fixed_slot=True)
            lower(prog, build, stop_before="drop_export_guards")
            compiled = PerLayout(prog, f"attention_graphs-{way}", True, True, f"attention ({way})", build=build)
            comm = AFDCommunicator("attention", 1, (0,))
            register_communicator(comm, 0)
            prepare(comm, slot, dev, prog)
            worker = AttentionWorker(prog, comm, counter, wrap=lambda p, c=compiled: (
                lambda *x: c(tuple(tuple(t.shape) for t in x), *x)))
            pad = batch_pad(prog, TokenBuckets()) if way != "as it came" else None
            assert not isinstance(pad, str), pad

            def step(b: int, worker=worker, pad=pad):
                ids = torch.randint(0, 1024, (b, 1), device=dev)
                if pad is None:
                    return worker.step(ids)
                padded, batch = pad.pad([ids])
                return pad.cut(worker.step(*padded), batch)

            before = graphs_recorded()
            for b in trace + trace:  # twice: the trees warm a size up on its first run, record on its second
                step(b)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for b in trace[-args.steps:]:
                step(b)
            torch.cuda.synchronize()
            us = (time.perf_counter() - t0) * 1e6 / args.steps
            touched = len({TokenBuckets().slot(b) for b in trace}) if pad is not None else len(set(trace))
            rows.append({"way": way, "graphs_recorded": graphs_recorded() - before, "sizes_touched": touched,
                         "compiles": len(compiled.compiled), "us_per_step": round(us, 1)})
            comm.stopped = True  # (nothing to tell: no FFN peer)
    print(f"attention_graphs: {torch.cuda.get_device_name()}, torch {torch.__version__}; the attention rank of AFD "
          f"1A1F of a Llama-shaped decoder, {args.layers} layers, bf16, decode steps; a trace of {args.trace} "
          f"batch sizes from 1..{args.max_batch} (seed 0); wire: a fixed slot of {slot}, stand-in transport")
    print("| batch | programs compiled | CUDA graphs recorded | batch sizes (or buckets) touched | µs a step "
          f"(last {args.steps}) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['way']} | {r['compiles']} | {r['graphs_recorded']} | {r['sizes_touched']} | {r['us_per_step']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "trace": trace,
                       "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
