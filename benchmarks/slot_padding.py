"""What a fixed wire slot costs an FFN rank's compute on one GPU (issue 52): P peers each send C
rows a step holding n real tokens; the FFN side computes P x C rows instead of P x n.

Two FFN sides, 4 layers each, bf16, random weights, each step one CUDA graph (its replay timed
with CUDA events, median of ``--iters``):

- ``moe``: Qwen3-30B-A3B-shaped (hidden 2048, 128 experts, top 8, moe_intermediate 768): per
  layer the router (a linear, softmax, top-k), ``afd::moe_experts`` (its default implementation
  on this GPU, the fused Triton kernels), the residual add;
- ``dense``: Llama-3-8B-shaped (hidden 4096, intermediate 14336): gate / up / down and SiLU.

Per (side, n, C) the rows run three ways, side by side in one run:

- ``exact``: P x n rows (a step sized for the real tokens);
- ``slot``: P x C rows, each peer's rows past its n repeating its last real row (what an
  attention rank's padding sends: an MoE routes them to experts the step reads anyway);
- ``slot, masked``: the same rows, the padded rows' expert ids set to E from the per-peer counts
  on the device (``arange(C) < counts``, in the graph): the MoE op leaves them out (no weights
  read, no rows computed; moe_triton.py). A dense FFN has no such cut: its padded cost is the
  ``slot`` column.

    python benchmarks/slot_padding.py --json $OUT/slot_padding.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

LAYERS = 4


def moe_weights(dev: torch.device, g: torch.Generator) -> list[dict]:
    h, e, i = 2048, 128, 768

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=dev, generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)

    return [{"router": w(e, h), "gate_up": w(e, 2 * i, h), "down": w(e, h, i)} for _ in range(LAYERS)]


def dense_weights(dev: torch.device, g: torch.Generator) -> list[dict]:
    h, i = 4096, 14336

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=dev, generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)

    return [{"gate": w(i, h), "up": w(i, h), "down": w(h, i)} for _ in range(LAYERS)]


def moe_step(x: torch.Tensor, layers: list[dict], valid: torch.Tensor | None) -> torch.Tensor:
    from afd_compile.moe import moe_experts

    for lay in layers:
        logits = torch.nn.functional.linear(x, lay["router"])
        weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), 8, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        if valid is not None:  # (the padded rows take no expert)
            ids = torch.where(valid[:, None], ids, lay["gate_up"].shape[0])
        x = x + moe_experts(x, ids, weights, lay["gate_up"], lay["down"])
    return x


def dense_step(x: torch.Tensor, layers: list[dict], valid: torch.Tensor | None) -> torch.Tensor:
    f = torch.nn.functional
    for lay in layers:
        x = x + f.linear(f.silu(f.linear(x, lay["gate"])) * f.linear(x, lay["up"]), lay["down"])
    return x


def slot_rows(real: torch.Tensor, peers: int, n: int, slot: int) -> torch.Tensor:
    """``peers`` slots of ``slot`` rows, each its peer's ``n`` real rows then its last one repeated."""
    per = real.view(peers, n, -1)
    pad = per[:, -1:].expand(peers, slot - n, per.shape[-1])
    return torch.cat([per, pad], dim=1).reshape(peers * slot, -1).contiguous()


def time_graph(fn, iters: int) -> float:
    """Median µs of a CUDA graph replay of ``fn``."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--cases", default="8:256,8:64,64:256,1:256", help="n:C pairs (real tokens a peer : slot rows)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(dev).manual_seed(0)
    sides = {"moe": (moe_step, moe_weights(dev, g), 2048), "dense": (dense_step, dense_weights(dev, g), 4096)}
    rows = []
    for name, (step, weights, hidden) in sides.items():
        for case in args.cases.split(","):
            n, c = (int(v) for v in case.split(":"))
            p = args.peers
            real = torch.randn(p * n, hidden, device=dev, generator=g).to(torch.bfloat16)
            padded = slot_rows(real, p, n, c)
            counts = torch.full((p,), n, device=dev)
            valid = (torch.arange(c, device=dev)[None, :] < counts[:, None]).reshape(-1)
            exact = time_graph(lambda: step(real, weights, None), args.iters)  # noqa: B023
            slot = time_graph(lambda: step(padded, weights, None), args.iters)  # noqa: B023
            masked = time_graph(lambda: step(padded, weights, valid), args.iters) if name == "moe" else None  # noqa: B023
            same = step(padded, weights, valid).view(p, c, -1)[:, :n].reshape(p * n, -1)
            err = float((same.float() - step(real, weights, None).float()).abs().max())
            rows.append({"side": name, "peers": p, "n": n, "slot": c, "exact_us": exact, "slot_us": slot,
                         "masked_us": masked, "slot_x": slot / exact, "masked_x": masked / exact if masked else None,
                         "real_rows_max_abs_diff": err})
    print(f"slot_padding: {torch.cuda.get_device_name()}, {args.peers} peers, {LAYERS} layers, bf16, CUDA graph "
          f"replays (median of {args.iters})")
    print("| FFN side | n real a peer | slot C | exact (µs) | slot (µs) | slot, masked (µs) | slot / exact "
          "| masked / exact |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        masked = f"{r['masked_us']:.1f}" if r["masked_us"] else "-"
        mx = f"{r['masked_x']:.2f}x" if r["masked_x"] else "-"
        print(f"| {r['side']} | {r['n']} | {r['slot']} | {r['exact_us']:.1f} | {r['slot_us']:.1f} | {masked} | "
              f"{r['slot_x']:.2f}x | {mx} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
