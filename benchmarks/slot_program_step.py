"""An MoE FFN rank's real program under a fixed wire slot, per step on one GPU (issue 52): two
peers each send C rows a step holding n real tokens.

The program is the real one: a Qwen3-30B-A3B-shaped decoder (hidden 2048, 128 experts, top 8,
moe_intermediate 768; ``--layers`` layers, bf16, random weights) exported, split for AFD 2A1F, the
FFN rank's program lowered for CUDA as the backend does (``pipeline.lower``: the router's top-k
kernel, the exchange fused and received into buffers; with a fixed slot ``mark_slot_rows``) and
compiled by ``PerLayout`` with the exchange inside one CUDA graph (``ffn_capture="all"``): a step
is one replay. Three ways, side by side in one run:

- ``exact``: a step sized for the real tokens (2 x n rows);
- ``slot``: 2 x C rows, each peer's rows past its n repeating its last row (the attention side's
  padding), the program lowered without the mark;
- ``slot, marked``: the same rows, the program lowered for a fixed slot: its padded rows take no
  expert (their ids set to E from the headers' counts, on the device).

One GPU has no peers: the process group is torch's no-op one (``"fake"``, world 3, this rank the
FFN rank 2 serving ranks 0 and 1), and the batched call is a stand-in that fills each receive
from a fixed tensor of that peer's rows (a device copy, captured with the graph; each header from
the peer's count) and sends nothing: the routing is real (random tokens), the wire is not
(LIMITS.md has NCCL's). Per step: the runtime's ``set_step``, then the program; wall µs over
``--steps`` steps, with CUDA graph launches per step.

    python benchmarks/slot_program_step.py --json $OUT/slot_program_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.fx as fx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PEERS = (0, 1)


def ffn_program(layers: int, dev: torch.device) -> fx.GraphModule:
    """The FFN rank's (portable) program of an AFD 2A1F split of a Qwen3-30B-A3B-shaped decoder."""
    from afd_compile.layout import AFDLayout
    from afd_compile.models import build_hf, export_lm
    from afd_compile.split_api import split

    model = build_hf("qwen3_moe", num_layers=layers, hidden_size=2048, num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=768, intermediate_size=6144, num_attention_heads=32, head_dim=128,
                     num_key_value_heads=4, vocab_size=1024, norm_topk_prob=True)
    ep = export_lm(model.to(torch.bfloat16), vocab_size=1024)
    ffn = split(ep, layout=AFDLayout(2, 1)).ffn
    if not any(n.target == torch.ops.afd.moe_experts.default for n in ffn.graph.nodes):
        raise SystemExit("slot_program_step: the FFN program holds no afd::moe_experts (MoE recognition missed it)")
    return ffn.to(dev)


def compiled(ffn: fx.GraphModule, marked: bool, name: str):
    from afd_compile.backend import PerLayout
    from afd_compile.pipeline import Build, lower

    prog = fx.GraphModule(ffn, ffn.graph.__deepcopy__(), class_name="AFDFFNProgram")
    prog.meta.update(ffn.meta)
    build = Build("afd-ffn", device="cuda", fan_in=2, fixed_slot=marked)
    lower(prog, build, stop_before="drop_export_guards")  # (PerLayout runs the rest at its compile)
    return PerLayout(prog, f"slot_program_step-{marked}", True, True, name, step_graphs=True, build=build)


class StandIn:
    """``dist.batch_isend_irecv`` on one GPU: each receive filled from its peer's rows (or header)."""

    rows: dict[int, torch.Tensor] = {}
    heads: dict[int, torch.Tensor] = {}

    def __call__(self, ops: list) -> list:
        import torch.distributed as dist

        for op in ops:
            if op.op is dist.irecv:
                src = self.heads[op.peer] if op.tensor.dtype == torch.int64 else self.rows[op.peer]
                op.tensor.copy_(src[: op.tensor.shape[0]].view_as(op.tensor))
        return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="8:256,64:256,1:256", help="n:C pairs (real tokens a peer : slot rows)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("slot_program_step: needs a CUDA GPU", file=sys.stderr)
        return 2
    import torch.distributed as dist
    from moe_ffn import graph_launches, wall_us_per_step
    from slot_padding import slot_rows
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from afd_compile.comm import AFDCommunicator, register_communicator

    dev = torch.device("cuda")
    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=3)
    stand_in = StandIn()
    dist.batch_isend_irecv = stand_in
    ffn = ffn_program(args.layers, dev)
    progs = {"exact": compiled(ffn, False, "ffn (exact)"), "slot": compiled(ffn, False, "ffn (slot)"),
             "slot, marked": compiled(ffn, True, "ffn (slot, marked)")}
    g = torch.Generator(dev).manual_seed(0)
    cases = [tuple(int(v) for v in case.split(":")) for case in args.cases.split(",")]
    # what the stand-in copies from: static buffers (a captured copy reads them at each replay), each
    # case's rows copied in; one communicator a way (its headers' buffers are what a graph captured)
    most = max(max(n, c) for n, c in cases)
    stand_in.rows = {p: torch.empty(most, 2048, device=dev, dtype=torch.bfloat16) for p in PEERS}
    stand_in.heads = {p: torch.zeros(2, dtype=torch.int64, device=dev) for p in PEERS}
    comms = {way: AFDCommunicator("ffn", 2, PEERS) for way in progs}
    rows = []
    with torch.no_grad():
        for n, c in cases:
            real = torch.randn(2 * n, 2048, device=dev, generator=g).to(torch.bfloat16)
            padded = slot_rows(real, 2, n, c)
            row: dict = {"n": n, "C": c}
            for way, prog in progs.items():
                size = n if way == "exact" else c
                comm = comms[way]
                comm.fixed_slot = c if way == "slot, marked" else None
                src = real if way == "exact" else padded
                for i, p in enumerate(PEERS):
                    stand_in.rows[p][:size].copy_(src[i * size:(i + 1) * size])
                    stand_in.heads[p].copy_(torch.tensor([n, 0]))
                carrier = torch.empty(2 * size, 0, device=dev)

                def step(prog=prog, comm=comm, size=size, carrier=carrier):
                    register_communicator(comm, 0)
                    comm.set_step({0: (size, size)})  # (the runtime's, each step)
                    key = (("carriers", (2 * size,)), ("peers", ((size, size), ())))  # (as backend.ffn_key)
                    return prog(key, carrier)

                for _ in range(3):  # (compile, warm up, capture)
                    step()
                row[way] = round(wall_us_per_step(step, args.steps), 1)
                row[f"{way} graphs/step"] = graph_launches(step)
            row["slot_over_exact"] = round(row["slot"] / row["exact"], 3)
            row["marked_over_exact"] = round(row["slot, marked"] / row["exact"], 3)
            rows.append(row)
    print(f"slot_program_step: {torch.cuda.get_device_name()}, torch {torch.__version__}; the FFN rank of AFD 2A1F "
          f"of a Qwen3-30B-A3B-shaped decoder, {args.layers} layers, bf16, its exchange in one CUDA graph; a "
          f"stand-in transport (each receive a device copy of its peer's rows); {args.steps} steps a loop")
    print("| n real a peer | slot C | exact (µs/step) | slot (µs/step) | slot, marked (µs/step) | slot / exact "
          "| marked / exact | graph launches a step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['C']} | {r['exact']} | {r['slot']} | {r['slot, marked']} | {r['slot_over_exact']}x | "
              f"{r['marked_over_exact']}x | {r['slot, marked graphs/step']:g} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
                       "steps": args.steps, "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
