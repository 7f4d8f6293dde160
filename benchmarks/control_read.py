"""What an FFN rank's per-step control read costs on one GPU (issue 35): the serve loop reading
each step's control message as a device tensor (what it did while the messages travelled on the
NCCL group: the read waits for everything queued on the stream before it, so the host cannot
queue step k+1 before step k has finished) against reading it as a host tensor (the gloo group
beside the exchange's, ``runtime.control_group``) and against no read at all.

The FFN side is ``moe_ffn.py``'s (a Qwen3-30B-A3B-shaped MoE FFN side, 4 layers, bf16, the
experts as one ``afd::moe_experts`` op), compiled with ``mode="reduce-overhead"`` (one CUDA
graph), at T tokens. Each loop runs ``--steps`` steps; wall time per step, measured side by side
in one run. An NCCL receive of the message would add its own launch and wait on top of the device
read modelled here (a copy on the stream, then ``.tolist()``); one GPU cannot run it.

    python benchmarks/control_read.py --json $OUT/control_read.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def loop_us(step, x: torch.Tensor, read: str, steps: int) -> float:
    """Wall µs per step of ``steps`` steps, each reading its control message (``read``) first."""
    from moe_ffn import wall_us_per_step

    host = torch.zeros(2, dtype=torch.int64)
    dev = torch.zeros(2, dtype=torch.int64, device=x.device)
    pinned = torch.zeros(2, dtype=torch.int64).pin_memory()

    def one() -> None:
        if read == "device":  # the message lands on the stream, behind the last step
            dev.copy_(pinned, non_blocking=True)
            n = dev.tolist()[0]
        elif read == "host":
            n = host.tolist()[0]
        else:
            n = 0
        step(x[n:] if n else x)

    return wall_us_per_step(one, steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="8,64")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("control_read: needs a CUDA GPU", file=sys.stderr)
        return 2
    from moe_ffn import HIDDEN, FFNSide, OpSide

    dev = torch.device("cuda")
    torch._dynamo.config.cache_size_limit = 64
    model = OpSide(FFNSide("grouped_mm").to(dev, torch.bfloat16).eval())
    rows = []
    with torch.no_grad():
        for t in [int(v) for v in args.tokens.split(",")]:
            x = torch.randn(t, 1, HIDDEN, device=dev, dtype=torch.bfloat16)
            torch._dynamo.reset()  # (one static capture per T, as moe_ffn.py's columns)
            step = torch.compile(model, mode="reduce-overhead", dynamic=False)
            for _ in range(3):
                step(x)
            res = {read: loop_us(step, x, read, args.steps) for read in ("none", "host", "device")}
            rows.append({"tokens": t, **{f"{k}_us": round(v, 1) for k, v in res.items()},
                         "device_over_host": round(res["device"] / res["host"], 3)})
    print(f"control_read: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.steps} steps a loop")
    print("| T | no read (us/step) | host read (us/step) | device read (us/step) | device / host |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['none_us']} | {r['host_us']} | {r['device_us']} | {r['device_over_host']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
