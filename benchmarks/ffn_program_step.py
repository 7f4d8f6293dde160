"""An FFN rank's own program, as the backend compiles it, per step on one GPU: the three ways its
exchange can sit against its CUDA graphs (issue 35).

The program is the real one: an HF Llama-shaped decoder (random weights, bf16, ``--layers``
layers, ``--hidden`` / ``--inter``) exported, split for AFD 2A1F (``split``), the FFN rank's
program compiled by ``PerLayout`` as the backend does:

- ``all``: ``ffn_capture="all"`` (the default, chosen from this benchmark): compiled once for
  symbolic rows, captured whole by hand (``PerLayout(step_graphs=True)``), the exchange inside, one
  graph per tuple of the peers' sizes; each send fused with the next receive as the backend does;
- ``all, per shape``: the same compiled for each row count apart (``PerLayout(symbolic=False)``:
  what a symbolic compile costs a step, against kernels specialised to the shape);
- ``compute``: the exchange ops run between captured pieces (Inductor's graph partition), each
  send and the next layer's receive as two ops;
- ``compute, fused``: the same with each send and the next receive as one op
  (``afd::p2p_send_recv_group``, passes/fuse_exchange.py), as the backend runs "compute".

In all three every receive writes into buffers the program allocates (passes/recv_into.py), as
the backend's lowering does: without it a piece's input is an op's output list, which CUDA graph
trees refuse (torch 2.11), so ``compute`` did not run at all on a real FFN program before.

One GPU has no peers: the process group is torch's no-op one (backend ``"fake"``, world 3, this
rank the FFN rank 2 serving ranks 0 and 1) and the batched call itself is a stand-in that posts
nothing (``dist.batch_isend_irecv`` returns no works: the fake group's own ``wait`` blocked the
host ~150 µs a call, which NCCL's does not). Every exchange op does the rest of its host work
(the step's sizes, checks, the receive buffers, the padding) and moves nothing, so the buffers
hold whatever memory they were given. A dense FFN computes the same work whatever the values (an
MoE's routing would not): this measures what the program's structure costs a step (graph
launches, the ops' own host work between them), not NCCL's launches (LIMITS.md: ~13 µs replayed
in a graph, ~46 µs eager) or the wire. Per step: the
runtime's ``set_step``, then the program; wall µs over ``--steps`` steps, the three side by side
in one run, with CUDA graph launches per step.

    python benchmarks/ffn_program_step.py --json $OUT/ffn_program_step.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch
import torch.fx as fx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def ffn_program(layers: int, hidden: int, inter: int, dev: torch.device) -> fx.GraphModule:
    """The FFN rank's program of an AFD 2A1F split of a Llama-shaped decoder (bf16, on ``dev``)."""
    from afd_compile.layout import AFDLayout
    from afd_compile.models import build_hf, export_lm
    from afd_compile.split_api import split

    heads = hidden // 128
    model = build_hf("llama", num_layers=layers, hidden_size=hidden, intermediate_size=inter,
                     num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), vocab_size=1024)
    ep = export_lm(model.to(torch.bfloat16), vocab_size=1024)  # (on the CPU, then the FFN program moved)
    return split(ep, layout=AFDLayout(2, 1)).ffn.to(dev)


def compiled_way(ffn: fx.GraphModule, way: str, name: str):
    """``ffn`` compiled the way ``way`` names (module docstring): a fresh graph over the same weights."""
    from afd_compile.backend import PerLayout, ffn_step_ops
    from afd_compile.passes.fuse_exchange import fuse_send_recv
    from afd_compile.passes.recv_into import receive_into_buffers

    prog = fx.GraphModule(ffn, copy.deepcopy(ffn.graph), class_name="AFDFFNProgram")
    prog.meta.update(ffn.meta)
    fused = fuse_send_recv(prog) if way != "compute" else []
    receive_into_buffers(prog)  # (the backend's lowering: a piece reads tensors, not an op's list)
    eager = ffn_step_ops() if not way.startswith("all") else ()
    return PerLayout(prog, f"ffn_program_step-{way}", True, True, name, eager_ops=eager,
                     step_graphs=way.startswith("all"), symbolic=way != "all, per shape"), len(fused)


def op_host_us(hidden: int, dev: torch.device, calls: int = 400) -> dict[str, float]:
    """Host µs a call of one layer's exchange op at T = 8 (two peers of 4 rows, the stand-in
    transport): through the dispatcher as registered (oplib.afd_op), the same kernel registered by
    ``torch.library.custom_op`` (as the ops were once registered), and the kernel as a plain Python call."""
    from moe_ffn import wall_us_per_step

    from afd_compile import ops

    fused = torch.ops.afd.p2p_send_recv_group_into

    x = torch.randn(8, hidden, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    spec_in, spec_out = f"hidden:bfloat16[{hidden}]", f"ffn_out:bfloat16[{hidden}]"
    if not hasattr(torch.ops.afdbench, "send_recv_into"):  # the same kernel as torch.library.custom_op registers it
        torch.library.custom_op("afdbench::send_recv_into", mutates_args=("outs",))(ops.p2p_send_recv_group_into.fn)
    as_custom_op = torch.ops.afdbench.send_recv_into.default
    ways = {"op (dispatcher)": lambda: fused.default([x], [out], 0, 0, 0, spec_out, 1, 0, spec_in),
            "as a custom_op": lambda: as_custom_op([x], [out], 0, 0, 0, spec_out, 1, 0, spec_in),
            "its kernel (Python)": lambda: ops.p2p_send_recv_group_into.fn([x], [out], 0, 0, 0, spec_out, 1, 0,
                                                                            spec_in)}
    return {name: round(wall_us_per_step(fn, calls), 1) for name, fn in ways.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="8,64,256")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=6144)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("ffn_program_step: needs a CUDA GPU", file=sys.stderr)
        return 2
    import torch.distributed as dist
    from moe_ffn import graph_launches, wall_us_per_step
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from afd_compile.comm import AFDCommunicator, register_communicator

    dev = torch.device("cuda")
    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=3)
    dist.batch_isend_irecv = lambda ops: []  # (the stand-in: module docstring)
    ffn = ffn_program(args.layers, args.hidden, args.inter, dev)
    comm = AFDCommunicator("ffn", 2, (0, 1))
    register_communicator(comm, 0)
    ways = ("all", "all, per shape", "compute", "compute, fused")
    compiled = {w: compiled_way(ffn, w, f"ffn ({w})") for w in ways}
    rows = []
    with torch.no_grad():
        for t in [int(v) for v in args.tokens.split(",")]:
            comm.set_step({0: (t // 2, t - t // 2)})
            carrier = torch.empty(t, 0, device=dev)
            row: dict = {"tokens": t}
            for w, (prog, _) in compiled.items():
                def step(prog=prog, t=t, carrier=carrier):
                    comm.set_step({0: (t // 2, t - t // 2)})  # (the runtime's, each step)
                    rows = ("carriers", (t,))  # (as backend.ffn_key keys them)
                    prog((rows, ("peers", (t // 2, t - t // 2))) if prog.step_graphs else rows, carrier)

                for _ in range(3):  # (compile, warm up, record)
                    step()
                row[w] = round(wall_us_per_step(step, args.steps), 1)
                row[f"{w} graphs/step"] = graph_launches(step)
            row["compute_over_all"] = round(row["compute"] / row["all"], 3)
            row["symbolic_over_per_shape"] = round(row["all"] / row["all, per shape"], 3)
            row["fused_over_all"] = round(row["compute, fused"] / row["all"], 3)
            rows.append(row)
        comm.set_step({0: (4, 4)})
        host = op_host_us(args.hidden, dev)
    fused_pairs = compiled["compute, fused"][1]
    print(f"ffn_program_step: {torch.cuda.get_device_name()}, torch {torch.__version__}; Llama-shaped FFN rank "
          f"of AFD 2A1F, {args.layers} layers, hidden {args.hidden}, intermediate {args.inter}, bf16; exchange "
          f"posting nothing (a stand-in); {fused_pairs} send/receive pairs fused; {args.steps} steps a loop")
    print("| T | all: one graph (us/step) | all, compiled per shape | symbolic / per shape | compute: pieces (us/step) "
          "| compute / all | compute, fused (us/step) | fused / all | graph launches a step (all / compute / fused) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tokens']} | {r['all']} | {r['all, per shape']} | {r['symbolic_over_per_shape']} | {r['compute']} | "
            f"{r['compute_over_all']} | {r['compute, fused']} | "
            f"{r['fused_over_all']} | {r['all graphs/step']:g} / {r['compute graphs/step']:g} / "
            f"{r['compute, fused graphs/step']:g} |"
        )
    print(f"host µs a call of afd::p2p_send_recv_group_into (T = 8, two peers): {host}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "layers": args.layers,
                    "hidden": args.hidden,
                    "inter": args.inter,
                    "steps": args.steps,
                    "fused_pairs": fused_pairs,
                    "exchange_op_host_us": host,
                    "rows": rows,
                },
                f,
                indent=1,
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
