"""The TP junction alone: all-reduce + residual add + RMSNorm, NCCL against the one-shot all-reduce over
symmetric memory, by message size, every variant inside a CUDA graph (as the backend runs it).

    torchrun --nproc-per-node 2 benchmarks/junction.py --out out/gpu/junction.json

Per message size (bf16 rows of ``--hidden``; the decode junction of T tokens is T x hidden x 2
bytes), median us per junction over ``--reps`` replays of a graph holding ``--inner`` junctions:

    nccl_ar          dist.all_reduce alone: the graph-captured NCCL floor
    symm_ar          symm_mem one_shot_all_reduce_copy alone
    nccl_composite   afd::all_reduce_add_rms_norm as the eager FX program runs it: NCCL, then the
                     add and the norm as separate kernels (the issue's baseline)
    nccl_fused       NCCL, then add + RMSNorm fused by Inductor (torch.compile of the lowered junction)
    symm_fused       the backend's path for a small message: one-shot all-reduce, then the Inductor-fused
                     add + RMSNorm

Every variant's output is checked against nccl_composite on the same inputs (max abs difference
printed; the run fails above 1e-2 relative). Prints a table, writes JSON. With one process the
all-reduce sums one partial (a smoke run of capture and dispatch, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

from afd_compile import ops as _ops  # noqa: F401  (torch.ops.afd)
from afd_compile import symm_mem
from afd_compile.comm import register_group
from afd_compile.passes import fuse_norm as _fuse_norm  # noqa: F401  (afd::all_reduce_add_rms_norm)
from afd_compile.runtime import init_distributed, shutdown

GID_SYMM, GID_NCCL = 40, 41
EPS = 1e-6


def _norm_after(ar: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = residual + ar
    h32 = h.float()
    return h, weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)


def _fused(gid: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def junction(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
        return _norm_after(torch.ops.afd.all_reduce(partial, gid), residual, weight)
    return torch.compile(junction, fullgraph=True)


def _variants() -> dict[str, Callable[..., object]]:
    return {
        "nccl_ar": lambda p, r, w: torch.ops.afd.all_reduce(p, GID_NCCL),
        "symm_ar": lambda p, r, w: torch.ops.afd.all_reduce(p, GID_SYMM),
        "nccl_composite": lambda p, r, w: torch.ops.afd.all_reduce_add_rms_norm(p, r, w, EPS, GID_NCCL, p.dtype),
        "nccl_fused": _fused(GID_NCCL),
        "symm_fused": _fused(GID_SYMM),
    }


def _time(fn: Callable[..., object], args: tuple, inner: int, reps: int) -> tuple[float, object]:
    """Median us per call of ``fn`` replayed in a CUDA graph of ``inner`` calls."""
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                out = fn(*args)  # compile and warm up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                out = fn(*args)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000 / inner)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", default="1,4,8,32,64,128,256,512", help="rows per message (T x 1 token)")
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default="out/gpu/junction.json")
    args = parser.parse_args()
    rank, world = init_distributed()
    if dist.get_backend() != "nccl":
        raise SystemExit("junction.py needs CUDA GPUs (NCCL): one process per GPU")
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.new_group(list(range(world)))
    for gid in (GID_SYMM, GID_NCCL):
        register_group(gid, group)
    symm_mem.prepare(GID_SYMM, group, dev, enabled=True, max_bytes=1 << 30)  # every size here one-shot
    symm_mem.prepare(GID_NCCL, group, dev, enabled=False)
    ready = symm_mem.state_of(GID_SYMM)
    if rank == 0:
        print(f"{world} ranks, torch {torch.__version__}: {ready}")
    variants = _variants()
    if not ready.ready:
        variants = {k: v for k, v in variants.items() if not k.startswith("symm")}
    rows, worst = [], 0.0
    gen = torch.Generator(device=dev).manual_seed(rank)
    for T in (int(t) for t in args.tokens.split(",")):
        p = torch.randn(T, args.hidden, device=dev, dtype=torch.bfloat16, generator=gen)
        r = torch.randn(T, args.hidden, device=dev, dtype=torch.bfloat16, generator=gen)
        w = torch.randn(args.hidden, device=dev, dtype=torch.bfloat16, generator=gen)
        row: dict = {"tokens": T, "bytes": p.numel() * p.element_size()}
        outs = {}
        for name, fn in variants.items():
            row[f"{name}_us"], outs[name] = _time(fn, (p, r, w), args.inner, args.reps)
        ref = outs["nccl_composite"][1]
        for name in ("nccl_fused", "symm_fused"):
            if name in outs:
                got = outs[name][1]
                err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                row[f"{name}_rel_err"] = err
                worst = max(worst, err)
        if "symm_ar" in outs:
            err = ((outs["symm_ar"].float() - outs["nccl_ar"].float()).abs().max()).item()
            row["symm_ar_max_abs_diff"] = err
        rows.append(row)
    if rank == 0:
        names = list(variants)
        print(f"junction (all-reduce + add + RMSNorm), hidden {args.hidden}, bf16, {world} GPUs, CUDA graphs; "
              "median us per junction")
        print("| T | bytes | " + " | ".join(names) + " | symm_fused / nccl_composite |")
        print("|---" * (len(names) + 3) + "|")
        for row in rows:
            ratio = (f"{row['symm_fused_us'] / row['nccl_composite_us']:.2f}x" if "symm_fused_us" in row else "-")
            print(f"| {row['tokens']} | {row['bytes']} | " + " | ".join(f"{row[n + '_us']:.1f}" for n in names)
                  + f" | {ratio} |")
        print(f"max rel err of the fused junctions against the composite: {worst:.2e}")
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"world": world, "hidden": args.hidden, "torch": torch.__version__, "symm_mem": str(ready),
                       "rows": rows, "max_rel_err": worst}, f, indent=1)
    symm_mem.release()
    shutdown()
    if worst > 1e-2:
        raise SystemExit(f"FAIL: a fused junction differs from the composite by {worst:.2e} (> 1e-2)")


if __name__ == "__main__":
    main()
