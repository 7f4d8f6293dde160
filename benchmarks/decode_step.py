"""Decode step time with a static KV cache: afd TP=2 / AFD 1A1F against one GPU, beside the HBM floor.

    torchrun --nproc-per-node 2 benchmarks/decode_step.py --out out/gpu/decode.json
    torchrun --nproc-per-node 2 benchmarks/decode_step.py --small --shapes 2x32   # the script on CPU

HF Llama with Llama-3-8B-shaped layers (hidden 4096, 32 heads, 8 KV heads of 128, intermediate
14336), ``--layers`` layers, vocab 32000, bf16, random weights, a transformers ``StaticCache``
of ``max_cache_len`` = context C, filled to C - 1 with random keys and values (the values do not
change the time): one decode step is ``model(input_ids [B, 1], past_key_values=cache)``, the token
written at position C - 1 (reset before every step). Per shape (batch B x context C), in one run:

- ``one GPU``: ``torch.compile(model.forward, mode="reduce-overhead")`` on rank 1's GPU alone;
- ``one GPU afd default``: ``torch.compile(model.forward, backend="afd")``, no options (no layout:
  Inductor and CUDA graphs, as reduce-overhead; a user's first try);
- ``one GPU flex``: ``torch.compile(model.forward, backend="afd", options={"decode_attention":
  "flex"})`` on rank 1's GPU alone (no layout: the decode-attention pass, Inductor, CUDA graphs);
- ``afd TP2``: ``torch.compile(model.forward, backend="afd", options={"tp": 2})`` on both GPUs;
- ``afd AFD 1A1F``: rank 1 attention (its forward compiled with ``{"attention": 1, "ffn": 1}``),
  rank 0 FFN (``afd_compile.serve``);
- ``afd AFD 1A1F S=k`` for each ``--stages`` k >= 2: the same with ``"stages": k``: the batch's
  sequences as k micro-batches, each its own rows of the static cache, attention of one overlapping
  the FFN of another (issue 13);
- each afd variant with ``decode_attention`` "sdpa" (HF's masked SDPA over the whole cache) and
  "flex" (the decode-attention pass: FlexAttention over the filled blocks; the table's "flex"
  columns);
- the HBM floors: bytes a step must read (weights, and the KV cache: HF's static-cache attention
  reads all of it, ``C`` positions, whatever is filled) / measured copy bandwidth. One GPU: all of
  it; TP2: per GPU, half of the layer weights and of the KV heads, the LM head whole (the
  embedding is not read whole by a step, so no floor counts it); AFD:
  the attention GPU's bytes then the FFN GPU's (no overlap yet: the two run in turn).

Median wall time per step (CUDA synchronised) on rank 1, us; a table and JSON. On one rank
(``torchrun --nproc-per-node 1``: a one-GPU host) only the one-GPU columns.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import afd_compile
from afd_compile.passes import decode_attention
from afd_compile.runtime import finish, init_distributed, shutdown

VOCAB = 32000


def _config(layers: int, small: bool, context: int) -> object:
    import transformers

    shape = (dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2) if small
             else dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8))
    return transformers.LlamaConfig(vocab_size=VOCAB, num_hidden_layers=layers, max_position_embeddings=context,
                                    **shape)


def _model(cfg: object, dev: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval().to(device=dev, dtype=dtype)


def _cache(model: torch.nn.Module, batch: int, context: int, dev: torch.device, dtype: torch.dtype) -> object:
    """A static cache for ``batch`` sequences of ``context`` positions, lazily initialised by one
    uncompiled step, then filled with random keys and values."""
    import transformers

    cache = transformers.StaticCache(config=model.config, max_cache_len=context)
    with torch.no_grad():
        model(input_ids=torch.zeros(batch, 1, dtype=torch.long, device=dev), past_key_values=cache, use_cache=True)
    g = torch.Generator(device=dev).manual_seed(0)
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            t.copy_(torch.randn(t.shape, generator=g, device=dev, dtype=torch.float32).to(dtype))
    return cache


def _kv_bytes(cache: object) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _profile(one, name: str, path: str) -> None:
    """Append a profile of 5 steps of ``one`` to ``path``: kernels by GPU time, and how many CUDA
    graph launches and kernel launches the host made (graph capture working: few of the latter)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            one()
        _sync(torch.device("cuda"))
    events = prof.key_averages()
    launches = {e.key: e.count for e in events if e.key in ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel",
                                                             "cuLaunchKernelEx", "cudaLaunchKernelExC")}
    with open(path, "a") as f:
        f.write(f"\n=== {name}: 5 steps; host launches {launches}\n")
        f.write(events.table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=70))


def _decode_steps(forward, ids: torch.Tensor, cache: object, context: int, iters: int, barrier: bool,
                  profile: str | None = None, name: str = "", extra: dict | None = None) -> float:
    """Median us of a decode step ``forward(input_ids=ids, past_key_values=cache)`` with every
    layer's write position reset to ``context - 1`` first (``profile``: then profile 5 steps into
    that file). ``extra`` (one rank): also ``host_us``, the median time until a step's call returns
    (the host's share: launches, guards, input binding; the GPU may still be running), and
    ``b2b_us``, the time per step of ``iters`` steps back to back with one synchronisation at the
    end (the GPU's time when the host keeps ahead of it)."""
    dev = ids.device

    def one() -> None:
        for layer in cache.layers:
            layer.cumulative_length.fill_(context - 1)
        forward(input_ids=ids, past_key_values=cache, use_cache=True)

    with torch.no_grad():
        for _ in range(3):  # compile, cudagraph warm-up and record
            one()
        _sync(dev)
        times, host = [], []
        for _ in range(iters):
            if barrier:
                dist.barrier()
            t0 = time.perf_counter()
            one()
            t1 = time.perf_counter()
            _sync(dev)
            times.append((time.perf_counter() - t0) * 1e6)
            host.append((t1 - t0) * 1e6)
        if extra is not None:
            t0 = time.perf_counter()
            for _ in range(iters):
                one()
            _sync(dev)
            extra.update(host_us=statistics.median(host), b2b_us=(time.perf_counter() - t0) * 1e6 / iters)
        if profile and dev.type == "cuda" and not barrier:
            _profile(one, name, profile)
    return statistics.median(times)


def _error(e: Exception) -> str:
    """One line naming what failed (the first line of its message)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def _copy_bandwidth(dev: torch.device) -> float:
    """Bytes per second of a device copy (read + write), 1 GiB."""
    n = (1 << 30) // 2 if dev.type == "cuda" else (1 << 24)
    a = torch.empty(n, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    _sync(dev)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return 2 * a.numel() * a.element_size() / statistics.median(times)


def _weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the attention side's layer weights, the MLPs', the LM head and the rest (norms; the
    embedding is left out: a step reads B of its rows, not the table)."""
    parts = {"attn": 0, "mlp": 0, "head": 0, "other": 0, "embed": 0}
    for name, p in model.named_parameters():
        key = ("attn" if ".self_attn." in name else "mlp" if ".mlp." in name else "head" if "lm_head" in name
               else "embed" if "embed_tokens" in name else "other")
        parts[key] += p.numel() * p.element_size()
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--shapes", default="8x1024,8x4096,64x1024,64x4096", help="batch x context, comma-separated")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default="out/gpu/decode.json")
    parser.add_argument("--small", action="store_true", help="a tiny model (hidden 64), fp32: checks the script on CPU")
    parser.add_argument("--profile", metavar="FILE", help="CUDA only: append a profile of 5 steps of each one-rank "
                        "variant (one GPU, AFD attention rank) to FILE")
    parser.add_argument("--stages", default="2", help="AFD 1A1F micro-batch stages to run besides 1, comma-separated "
                        "('' for none)")
    parser.add_argument("--decode-attention", default="sdpa,flex",
                        help="the backend's decode_attention values to run, comma-separated (sdpa: HF's masked SDPA; "
                             "flex: the decode-attention pass)")
    args = parser.parse_args()
    rank, world = init_distributed()
    if world not in (1, 2):
        raise SystemExit("decode_step.py runs on 2 ranks (torchrun --nproc-per-node 2), or on 1 for the one-GPU "
                         "columns alone")
    last = world - 1  # the rank that runs the one-GPU variants, AFD attention, and prints
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = torch.float32 if args.small else torch.bfloat16
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    stage_list = [int(k) for k in args.stages.split(",") if k.strip()]
    if any(k < 2 for k in stage_list):
        raise SystemExit(f"--stages: give micro-batch counts >= 2 (1 always runs), got {args.stages!r}")
    bandwidth = _copy_bandwidth(dev)
    rows = []
    comm = 0
    for batch, context in shapes:
        cfg = _config(args.layers, args.small, context)
        model = _model(cfg, dev, dtype)
        weights = _weight_bytes(model)
        ids = torch.randint(0, VOCAB, (batch, 1), device=dev)
        row: dict = {"batch": batch, "context": context}
        failures = decode_attention.STATS["compile_failures"]  # flex kernels Inductor could not compile
        # one GPU (rank 1), with the same static cache
        if rank == last:
            cache = _cache(model, batch, context, dev, dtype)
            torch._dynamo.reset()
            fwd = torch.compile(model.forward, mode="reduce-overhead")
            extra: dict = {}
            row["one_gpu_us"] = _decode_steps(fwd, ids, cache, context, args.iters, barrier=False,
                                              profile=args.profile, name=f"one GPU {batch}x{context}", extra=extra)
            row.update({f"one_gpu_{k}": v for k, v in extra.items()})
            kv = _kv_bytes(cache)
            del cache, fwd
            # the backend with no options at all: a user's first try (issue 36)
            torch._dynamo.reset()
            model = _model(cfg, dev, dtype)
            cache = _cache(model, batch, context, dev, dtype)
            model.forward = torch.compile(model.forward, backend="afd")
            extra = {}
            row["one_gpu_default_us"] = _decode_steps(model, ids, cache, context, args.iters, barrier=False,
                                                      name=f"one GPU afd default {batch}x{context}", extra=extra)
            row.update({f"one_gpu_default_{k}": v for k, v in extra.items()})
            del cache
            if "flex" in args.decode_attention.split(","):
                torch._dynamo.reset()
                model = _model(cfg, dev, dtype)
                cache = _cache(model, batch, context, dev, dtype)
                model.forward = torch.compile(model.forward, backend="afd", options={"decode_attention": "flex"})
                extra = {}
                row["one_gpu_flex_us"] = _decode_steps(model, ids, cache, context, args.iters, barrier=False,
                                                       profile=args.profile, name=f"one GPU flex {batch}x{context}",
                                                       extra=extra)
                row.update({f"one_gpu_flex_{k}": v for k, v in extra.items()})
                del cache
        dist.barrier()
        for attn in args.decode_attention.split(",") if world == 2 else ():
            tag = "" if attn == "sdpa" else "_flex"
            # afd TP2: both ranks
            torch._dynamo.reset()
            model = _model(cfg, dev, dtype)
            cache = _cache(model, batch, context, dev, dtype)
            model.forward = torch.compile(model.forward, backend="afd",
                                          options={"tp": 2, "decode_attention": attn})
            try:  # (a variant that fails to compile is reported in the table, and the run goes on)
                row[f"afd_tp2{tag}_us"] = _decode_steps(model, ids, cache, context, args.iters, barrier=True)
            except Exception as e:  # noqa: BLE001
                row[f"afd_tp2{tag}_error"] = _error(e)
                print(f"progress: {batch} x {context}: afd TP2 {attn} failed: {row[f'afd_tp2{tag}_error']}", flush=True)
            del cache
            dist.barrier()
            # afd AFD 1A1F: rank 0 serves the FFN, rank 1 runs attention; S = 1, then each --stages
            for stages in (1, *stage_list):
                key = f"afd_1a1f{tag}" + (f"_s{stages}" if stages > 1 else "")
                torch._dynamo.reset()
                model = _model(cfg, dev, dtype)
                comm += 1
                options = {"attention": 1, "ffn": 1, "comm_id": comm, "decode_attention": attn, "stages": stages}
                if rank == 0:
                    afd_compile.serve(model, options)
                else:
                    cache = _cache(model, batch, context, dev, dtype)
                    model.forward = torch.compile(model.forward, backend="afd", options=options)
                    try:
                        row[f"{key}_us"] = _decode_steps(model, ids, cache, context, args.iters, barrier=False,
                                                         profile=args.profile if stages == 1 else None,
                                                         name=f"AFD 1A1F {attn} {batch}x{context}")
                    except Exception as e:  # noqa: BLE001
                        row[f"{key}_error"] = _error(e)
                        print(f"progress: {batch} x {context}: AFD 1A1F S={stages} {attn} failed: "
                              f"{row[f'{key}_error']}",
                              flush=True)
                    finish()
                    del cache
                dist.barrier()
        row["fell_back_flex"] = decode_attention.STATS["compile_failures"] > failures
        if rank == last:
            floor = lambda nbytes: nbytes / bandwidth * 1e6  # noqa: E731
            layer_w = weights["attn"] + weights["mlp"]
            rest = weights["head"] + weights["other"]
            row["floor_one_gpu_us"] = floor(layer_w + rest + kv)
            # TP2: half the layers and the KV heads; the head whole (the default: not split by vocabulary)
            row["floor_tp2_us"] = floor(layer_w / 2 + rest + kv / 2)
            row["floor_afd_us"] = floor(weights["attn"] + rest + kv) + floor(weights["mlp"])
            row["kv_bytes"] = kv
            rows.append(row)
            print(f"progress: {batch} x {context}: {row}", flush=True)
        dist.barrier()
    if rank == last:
        shape = "tiny (--small), fp32" if args.small else "Llama-8B-shaped, bf16"
        print(f"decode step with a static KV cache (HF SDPA over the whole cache), {shape} x {args.layers} layers, "
              f"{dev.type}, torch {torch.__version__}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; median us per step")
        staged = [f"afd_1a1f{tag}_s{k}" for k in stage_list for tag in ("", "_flex")]
        print("| B x C | KV bytes | floor 1 GPU | 1 GPU reduce-overhead | 1 GPU afd default | 1 GPU flex | floor TP2 | "
              "afd TP2 | afd TP2 flex "
              "| floor AFD | afd AFD 1A1F | afd AFD 1A1F flex |"
              + "".join(f" AFD S={k}{' flex' if key.endswith('_flex_s' + str(k)) else ''} |"
                        for k in stage_list for key in (f"afd_1a1f_s{k}", f"afd_1a1f_flex_s{k}")))
        print("|---" * (12 + len(staged)) + "|")

        def us(r: dict, key: str) -> str:
            mark = "*" if key.endswith("_flex_us") and r.get("fell_back_flex") else ""
            return f"{r[key]:.0f}{mark}" if key in r else "error" if key.replace("_us", "_error") in r else "-"

        for r in rows:
            print(f"| {r['batch']} x {r['context']} | {r['kv_bytes'] / 1e9:.2f} GB | {r['floor_one_gpu_us']:.0f} | "
                  f"{r['one_gpu_us']:.0f} | {us(r, 'one_gpu_default_us')} | {us(r, 'one_gpu_flex_us')} | "
                  f"{r['floor_tp2_us']:.0f} | {us(r, 'afd_tp2_us')} | {us(r, 'afd_tp2_flex_us')} | "
                  f"{r['floor_afd_us']:.0f} | {us(r, 'afd_1a1f_us')} | {us(r, 'afd_1a1f_flex_us')} |"
                  + "".join(f" {us(r, key + '_us')} |" for key in staged))
        print("one GPU, per step (us): wall (synchronised each step) / host (until the call returns) / back to back "
              "(steps queued, one synchronisation)")
        print("| B x C | reduce-overhead | afd default | afd flex |")
        print("|---|---|---|---|")
        for r in rows:
            cols = [" / ".join(f"{r[f'{p}_{k}']:.0f}" if f"{p}_{k}" in r else "-" for k in ("us", "host_us", "b2b_us"))
                    for p in ("one_gpu", "one_gpu_default", "one_gpu_flex")]
            print(f"| {r['batch']} x {r['context']} | " + " | ".join(cols) + " |")
        if any(r.get("fell_back_flex") for r in rows):
            print("* Inductor could not compile the FlexAttention kernel for some shape: it ran masked SDPA "
                  "(the warning above names the error)")
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"layers": args.layers, "small": args.small, "device": dev.type, "torch": torch.__version__,
                       "copy_bandwidth_bytes_per_s": bandwidth, "rows": rows}, f, indent=1)
    shutdown()


if __name__ == "__main__":
    main()
