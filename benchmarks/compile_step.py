"""Step time of the afd backend: compiled + CUDA-graphed vs the eager FX programs, side by side.

    torchrun --nproc-per-node 2 benchmarks/compile_step.py --mode tp --out out/gpu/step_tp.json
    torchrun --nproc-per-node 2 benchmarks/compile_step.py --mode afd --out out/gpu/step_afd.json

HF Llama with Llama-3-8B-shaped layers (hidden 4096, 32 heads, 8 KV heads, intermediate 14336),
``--layers`` layers, vocab 32000, bf16, random weights, no KV cache; input T sequences x 1 token.
Both variants go through ``torch.compile(model, backend="afd")`` with the same layout (tp=2, or 1
attention : 1 FFN); ``eager`` sets ``inductor=False`` (the FX programs run as they are), ``compiled``
uses Inductor + CUDA graphs (on CUDA each junction's all-reduce one-shot over symmetric memory
where the message is small, afd_compile/symm_mem.py); under TP also ``compiled`` with
``vocab_parallel=True`` (the LM head split by vocabulary, logits all-gathered) beside the default
whole head, and with ``symm_mem=False`` (every all-reduce over NCCL). Reference: the same model on one GPU, eager and
``torch.compile`` (Inductor default mode) in the same run. Median wall time per step (CUDA synchronised), us.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from afd_compile.runtime import init_distributed, shutdown

VOCAB = 32000


def _model(layers: int, dev: torch.device, small: bool) -> torch.nn.Module:
    import transformers

    from afd_compile.models import LogitsOnly

    shape = (dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2) if small
             else dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8))
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, num_hidden_layers=layers, max_position_embeddings=4096, **shape)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return LogitsOnly(transformers.LlamaForCausalLM(cfg).eval()).to(device=dev, dtype=dtype)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _steps(fn, ids: torch.Tensor, iters: int) -> float:
    with torch.no_grad():
        for _ in range(3):  # compile, cudagraph warm-up and record
            fn(ids)
        _sync(ids.device)
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            fn(ids)
            _sync(ids.device)
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _profile(fn, ids: torch.Tensor, show: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.device.type == "cuda" else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        for _ in range(3):
            fn(ids)
        _sync(ids.device)
    if show:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def _dtensor_tp(layers: int, dev: torch.device, small: bool, world: int) -> torch.nn.Module:
    """The user's alternative: the same model with DTensor ``parallelize_module``, the Megatron plan
    (Colwise q, k, v, gate, up; Rowwise o, down), the head and embedding whole on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = _model(layers, dev, small)
    mesh = init_device_mesh(dev.type, (world,))
    plan = {**{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
            "self_attn.o_proj": RowwiseParallel(),
            **{f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")}, "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.model.layers:
        parallelize_module(layer, mesh, plan)
    return model


def _floors(model: torch.nn.Module, dev: torch.device, world: int) -> dict[str, float]:
    """HBM floors (us): bytes a step reads / copy bandwidth measured here. One GPU: every weight but the
    embedding table (a step reads T rows of it); TP: the layers' weights / world, the head whole."""
    from decode_step import _copy_bandwidth, _weight_bytes

    w = _weight_bytes(model)
    bandwidth = _copy_bandwidth(dev)
    layers, rest = w["attn"] + w["mlp"], w["head"] + w["other"]
    return {"floor_one_gpu_us": (layers + rest) / bandwidth * 1e6,
            "floor_tp_us": (layers / world + rest) / bandwidth * 1e6, "copy_bandwidth": bandwidth}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["tp", "afd"], default="tp")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", default="8,64,256,1x512",
                        help="inputs, comma-separated: T (T sequences x 1 token, decode-like) or BxS (prefill)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default="out/gpu/step.json")
    parser.add_argument("--profile", action="store_true",
                        help="profile 3 steps of the compiled variant (first token count) on the measured rank and "
                             "print the top host-side ops (shows cudaGraphLaunch and what else a step costs)")
    parser.add_argument("--small", action="store_true", help="a tiny model (hidden 64): checks the script on CPU")
    args = parser.parse_args()
    rank, world = init_distributed()
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    model = _model(args.layers, dev, args.small)
    layout = {"tp": 2} if args.mode == "tp" else {"attention": 1, "ffn": 1}
    measured_rank = 0 if args.mode == "tp" else 1  # the attention rank in AFD (FFN ranks come first)
    rows = []
    for i, spec in enumerate(args.tokens.split(",")):
        batch, _, seq = spec.partition("x")
        ids = torch.randint(0, VOCAB, (int(batch), int(seq or 1)), device=dev)
        row: dict = {"tokens": spec if seq else f"{batch} x 1"}
        variants = [("eager", {"inductor": False}), ("compiled", {"inductor": True})]
        if args.mode == "tp":  # the LM head split by vocabulary against whole on every rank (the default)
            variants.append(("compiled_vocab_parallel", {"inductor": True, "vocab_parallel": True}))
            # every junction over NCCL against the default (small messages one-shot over symmetric memory)
            variants.append(("compiled_nccl", {"inductor": True, "symm_mem": False}))
        for name, extra in variants:
            torch._dynamo.reset()
            fn = torch.compile(model, backend="afd", dynamic=True,
                               options={**layout, **extra, "comm_id": 10 * i + len(row)})
            row[f"{name}_us"] = _steps(fn, ids, args.iters)
            if args.profile and name == "compiled" and i == 0:
                _profile(fn, ids, rank == measured_rank)
        if args.mode == "tp":  # the user's alternative, the same input on both ranks
            torch._dynamo.reset()
            row["dtensor_reduce_overhead_us"] = _steps(torch.compile(_dtensor_tp(args.layers, dev, args.small, world),
                                                                     mode="reduce-overhead"), ids, args.iters)
        references = [("one_gpu_eager", lambda: model), ("one_gpu_compiled", lambda: torch.compile(model)),
                      ("one_gpu_reduce_overhead", lambda: torch.compile(model, mode="reduce-overhead"))]
        if rank == measured_rank:  # one GPU, same model, same input
            for name, make in references:
                torch._dynamo.reset()
                row[f"{name}_us"] = _steps(make(), ids, args.iters)
            row.update(_floors(model, dev, world))
        else:
            for _ in range(len(references) * args.iters):  # the reference timings barrier once per timed step
                dist.barrier()
        rows.append(row)
    if rank == measured_rank:
        shape = "tiny (--small)" if args.small else "Llama-8B-shaped"
        print(f"afd backend step time, {args.mode} ({layout}), {shape} x {args.layers} layers, {dev.type}, "
              f"torch {torch.__version__}; median us per step (rank {rank}); floors: weight bytes / copy bandwidth "
              f"{rows[0]['copy_bandwidth'] / 1e12:.2f} TB/s")
        tp = args.mode == "tp"
        cols = [("floor 1 GPU", "floor_one_gpu_us"), ("1 GPU eager", "one_gpu_eager_us"),
                ("1 GPU compile", "one_gpu_compiled_us"), ("1 GPU reduce-overhead", "one_gpu_reduce_overhead_us")]
        if tp:
            cols += [("floor TP", "floor_tp_us"), ("DTensor TP + reduce-overhead", "dtensor_reduce_overhead_us")]
        cols += [("afd eager FX", "eager_us"), ("afd compiled+graphs", "compiled_us")]
        if tp:
            cols += [("afd, NCCL junctions", "compiled_nccl_us"), ("afd, vocab-parallel head",
                                                                   "compiled_vocab_parallel_us")]
        ratios = [("afd / 1 GPU reduce-overhead", "compiled_us", "one_gpu_reduce_overhead_us")]
        if tp:
            ratios += [("afd / floor TP", "compiled_us", "floor_tp_us"),
                       ("afd / NCCL junctions", "compiled_us", "compiled_nccl_us"),
                       ("afd / DTensor", "compiled_us", "dtensor_reduce_overhead_us")]
        print("| input | " + " | ".join(c for c, _ in cols) + " | " + " | ".join(r for r, _, _ in ratios) + " |")
        print("|---" * (1 + len(cols) + len(ratios)) + "|")
        for r in rows:
            print(f"| {r['tokens']} | " + " | ".join(f"{r[k]:.0f}" for _, k in cols) + " | "
                  + " | ".join(f"{r[a] / r[b]:.2f}x" for _, a, b in ratios) + " |")
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"mode": args.mode, "layers": args.layers, "small": args.small, "device": dev.type,
                       "torch": torch.__version__, "rows": rows}, f, indent=1)
    shutdown()


if __name__ == "__main__":
    main()
