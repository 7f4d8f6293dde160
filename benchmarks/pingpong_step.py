"""AFD 1A1F step time with micro-batch stages (ping-pong) against each role alone and one GPU.

    torchrun --nproc-per-node 2 benchmarks/pingpong_step.py --out out/gpu/pingpong.json
    torchrun --nproc-per-node 2 benchmarks/pingpong_step.py --small --tokens 8 --iters 3   # on CPU

HF Llama with Llama-3-8B-shaped layers (as ``compile_step.py``), ``--layers`` layers, bf16, no KV
cache; a decode-like step of T sequences x 1 token. In one run, per T:

- ``AFD S=k``: ``torch.compile(model, backend="afd", dynamic=True, options={"attention": 1,
  "ffn": 1, "stages": k})`` (Inductor + CUDA graphs), rank 1 attention, rank 0 FFN, for each
  ``--stages`` k;
- ``attention only`` / ``FFN only``: on rank 1's GPU alone, the same model with every MLP (resp.
  every attention) replaced by zeros, ``torch.compile(mode="reduce-overhead")``: each role's work
  with no exchange (the lower bound of a step that overlaps perfectly is their max);
- ``one GPU``: the whole model, ``torch.compile(mode="reduce-overhead")``.

Median wall time per step (CUDA synchronised, both ranks barriered before each step), us, on
rank 1; a table and JSON. ``--trace FILE``: a torch-profiler Chrome trace of 3 steps of the S=2
variant on rank 1 (kernels of both stages and the NCCL transfers on their streams) and a summary
of it in the log.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from compile_step import VOCAB, _model, _steps  # noqa: E402

from afd_compile.runtime import init_distributed, shutdown  # noqa: E402


class _Zeros(torch.nn.Module):
    """A role removed from a layer: zeros where its output was (the residual passes through)."""

    def __init__(self, attention: bool) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> object:
        z = torch.zeros_like(hidden_states)
        return (z, None) if self.attention else z


def _without(model: torch.nn.Module, role: str) -> torch.nn.Module:
    m = copy.deepcopy(model)
    for layer in m.model.model.layers:  # LogitsOnly(LlamaForCausalLM)
        if role == "mlp":
            layer.mlp = _Zeros(attention=False)
        else:
            layer.self_attn = _Zeros(attention=True)
    return m


def _trace(fn, ids: torch.Tensor, path: str) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.device.type == "cuda" else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        for _ in range(3):
            dist.barrier()
            fn(ids)
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    key = "self_cuda_time_total" if ids.device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", default="64,256")
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default="out/gpu/pingpong.json")
    parser.add_argument("--trace", metavar="FILE", help="Chrome trace of 3 S=2 steps on the attention rank")
    parser.add_argument("--small", action="store_true", help="a tiny model (hidden 64): checks the script on CPU")
    args = parser.parse_args()
    rank, world = init_distributed()
    if world != 2:
        raise SystemExit("pingpong_step.py runs on 2 ranks (torchrun --nproc-per-node 2)")
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    model = _model(args.layers, dev, args.small)
    stages = [int(s) for s in args.stages.split(",")]
    rows, comm = [], 0
    for T in (int(t) for t in args.tokens.split(",")):
        ids = torch.randint(0, VOCAB, (T, 1), device=dev)
        row: dict = {"tokens": T}
        for s in stages:
            torch._dynamo.reset()
            comm += 1
            fn = torch.compile(model, backend="afd", dynamic=True,
                               options={"attention": 1, "ffn": 1, "stages": s, "comm_id": comm})
            row[f"afd_s{s}_us"] = _steps(fn, ids, args.iters)
            if args.trace and s == 2 and T == int(args.tokens.split(",")[-1]):
                table = _trace(fn, ids, args.trace) if rank == 1 else None
                if rank == 0:
                    for _ in range(3):
                        dist.barrier()
                        fn(ids)
                if table:
                    print(f"profile of 3 AFD S=2 steps, T={T}, attention rank (trace: {args.trace}):\n{table}",
                          flush=True)
        if rank == 1:  # one GPU: each role alone, and the whole model
            for key, m in (("attention_only_us", _without(model, "mlp")), ("ffn_only_us", _without(model, "attn")),
                           ("one_gpu_us", model)):
                torch._dynamo.reset()
                row[key] = _steps(torch.compile(m, mode="reduce-overhead"), ids, args.iters)
            print(f"progress: {row}", flush=True)
        else:
            for _ in range(3 * args.iters):  # the one-GPU timings barrier once per timed step
                dist.barrier()
        rows.append(row)
    if rank == 1:
        shape = "tiny (--small)" if args.small else "Llama-8B-shaped, bf16"
        print(f"AFD 1A1F step with micro-batch stages, {shape} x {args.layers} layers, {dev.type}, torch "
              f"{torch.__version__}; median us per step (attention rank)")
        cols = [f"AFD S={s}" for s in stages]
        print("| T x 1 token | 1 GPU reduce-overhead | attention only | FFN only | " + " | ".join(cols)
              + " | S=2 / max(attention, FFN) | S=2 / 1 GPU |")
        print("|---" * (6 + len(stages)) + "|")
        for r in rows:
            bound = max(r["attention_only_us"], r["ffn_only_us"])
            s2 = r.get("afd_s2_us")
            ratio = f"{s2 / bound:.2f}x | {s2 / r['one_gpu_us']:.2f}x" if s2 else "- | -"
            print(f"| {r['tokens']} | {r['one_gpu_us']:.0f} | {r['attention_only_us']:.0f} | {r['ffn_only_us']:.0f} | "
                  + " | ".join(f"{r[f'afd_s{s}_us']:.0f}" for s in stages) + f" | {ratio} |")
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"layers": args.layers, "small": args.small, "device": dev.type, "torch": torch.__version__,
                       "stages": stages, "rows": rows}, f, indent=1)
    shutdown()


if __name__ == "__main__":
    main()
