"""What capturing an FFN rank's compute in pieces costs on one GPU (issue 35), with stand-in ops:
``ffn_capture="compute"`` (once the default) runs the exchange with the peers between
captured pieces (Inductor's graph partition), ``"all"`` keeps it inside one CUDA graph. The real
FFN program, whose exchange ops cost more host work than this stand-in's, is measured by
``ffn_program_step.py`` (it is what made ``"all"`` the default). Without peers (one GPU) the
exchange is a stand-in custom op (a copy: the receive at a layer's start, the send at its end),
so this measures what the partition itself costs a step (the pieces' launches and the op run
eagerly between them), not NCCL's launches. A third column fuses each layer's send with the next
layer's receive (one op where the FFN program holds two adjacent ones: Inductor makes a piece
between them that holds nearly nothing).

The FFN side is ``moe_ffn.py``'s (a Qwen3-30B-A3B-shaped MoE FFN side, 4 layers, bf16, the
experts as one ``afd::moe_experts`` op) at T tokens; per step wall µs of ``--steps`` steps, both
ways side by side in one run, and their outputs compared.

    python benchmarks/ffn_partition.py --json $OUT/ffn_partition.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@torch.library.custom_op("afdbench::exchange", mutates_args=())
def exchange(x: torch.Tensor) -> torch.Tensor:
    """Stand-in for a layer's receive or send: a copy."""
    return x.clone()


@exchange.register_fake
def _(x):
    return torch.empty_like(x)


class ExchangeSide(torch.nn.Module):
    """moe_ffn's layers as an FFN rank runs them: receive, norm, experts, residual, send.
    ``fused``: a layer's send and the next layer's receive as one op (one batched call), what
    the FFN program could run instead of the two adjacent ops it holds."""

    def __init__(self, op_side: torch.nn.Module, fused: bool = False) -> None:
        super().__init__()
        self.op_side, self.fused = op_side, fused

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from afd_compile.moe import moe_experts

        b, s, d = h.shape
        x = exchange(h)
        layers = list(zip(self.op_side.ref.norms, self.op_side.ref.moes, strict=True))
        for i, (norm, moe) in enumerate(layers):
            flat = norm(x).view(-1, d)
            _, weights, ids = moe.gate(flat)
            y = moe_experts(flat, ids, weights, moe.experts.gate_up_proj, moe.experts.down_proj)
            h = exchange(x + y.view(b, s, d))  # (the send)
            if i + 1 < len(layers):
                x = h if self.fused else exchange(h)  # (the next layer's receive)
        return h


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="8,64,256")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("ffn_partition: needs a CUDA GPU", file=sys.stderr)
        return 2
    from moe_ffn import HIDDEN, FFNSide, OpSide, graph_launches, wall_us_per_step

    dev = torch.device("cuda")
    torch._dynamo.config.cache_size_limit = 64
    side = OpSide(FFNSide("grouped_mm").to(dev, torch.bfloat16).eval())
    pieces = {"triton.cudagraphs": True, "graph_partition": True, "custom_should_partition_ops": ["afdbench::exchange"]}
    ways = {"one graph (all)": (ExchangeSide(side), {"triton.cudagraphs": True}),
            "pieces (compute)": (ExchangeSide(side), pieces),
            "pieces, send + next receive fused": (ExchangeSide(side, fused=True), pieces)}
    rows = []
    with torch.no_grad():
        for t in [int(v) for v in args.tokens.split(",")]:
            x = torch.randn(t, 1, HIDDEN, device=dev, dtype=torch.bfloat16)
            row, outs = {"tokens": t}, []
            for name, (model, options) in ways.items():
                torch._dynamo.reset()
                fn = torch.compile(model, options=options, dynamic=False)
                for _ in range(3):
                    fn(x)
                outs.append(fn(x).float().clone())
                row[name] = round(wall_us_per_step(lambda fn=fn, x=x: fn(x), args.steps), 1)
                row[f"{name} graphs/step"] = graph_launches(lambda fn=fn, x=x: fn(x))
            row["pieces_over_one"] = round(row["pieces (compute)"] / row["one graph (all)"], 3)
            row["fused_over_one"] = round(row["pieces, send + next receive fused"] / row["one graph (all)"], 3)
            row["max_abs_diff"] = max(float((o - outs[0]).abs().max()) for o in outs[1:])
            rows.append(row)
    print(f"ffn_partition: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.steps} steps a loop")
    fused = "pieces, send + next receive fused"
    print("| T | one graph, exchange captured (us/step) | pieces, exchange between (us/step) | pieces / one | "
          "pieces, send + next receive fused (us/step) | fused / one | graph launches a step (one / pieces / fused) "
          "| outputs differ by |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['one graph (all)']} | {r['pieces (compute)']} | {r['pieces_over_one']} | "
              f"{r[fused]} | {r['fused_over_one']} | {r['one graph (all) graphs/step']:g} / "
              f"{r['pieces (compute) graphs/step']:g} / {r[fused + ' graphs/step']:g} | {r['max_abs_diff']:.2g} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
