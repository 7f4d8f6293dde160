"""torch.compile(model, backend="afd") under torchrun: a small HF model, compiled for a layout.

    torchrun --nproc-per-node 2 examples/compile_backend.py --tp 2
    torchrun --nproc-per-node 2 examples/compile_backend.py --tp 2 --attn-dp 2 --family qwen3_moe
    torchrun --nproc-per-node 3 examples/compile_backend.py --attention 2 --ffn 1
    torchrun --nproc-per-node 2 examples/compile_backend.py --attention 1 --ffn 1 --stages 2
    torchrun --nproc-per-node 2 examples/compile_backend.py --tp 2 --model tests/handwritten.py:NanoGPT

Every rank builds the same small HF model (seeded random weights) and calls
``torch.compile(model, backend="afd", options=...)`` on it; the backend (found through its entry
point; this file imports only its option check, run before the model is built) runs the afd-compile passes for the
rank's role and compiles
the rank's program with Inductor. Each step every rank calls the compiled model on its own tokens
(the ranks of one attention group share them; attention DP groups and AFD attention ranks get
different batch sizes, 2 or 3, so no dim is specialised to 1); an FFN rank's call serves its attention peers.
Attention/TP ranks compare
with the uncompiled model on their tokens; rank 0 prints the last line ``OK max_rel_err=<x>`` or
``FAIL max_rel_err=<x>`` (fp32: 1e-5; bf16 with --dtype bfloat16: 1e-2). gloo on CPU; NCCL when
CUDA is available (AFD_BACKEND=gloo forces gloo); on CUDA the programs are graph-captured (except a
program holding an op that syncs with the host, reported as programs_without_cudagraphs).
``--control`` also reports the error of plain ``torch.compile`` (Inductor, one process) on the same
tokens: the part of the error that compiling alone brings (bf16 MoE routing is sensitive to it);
a run above the tolerance but within 1.1x of that control prints OK with a note saying so.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import re
import sys
import warnings

import torch
import torch.distributed as dist

from afd_compile.backend.options import check_options
from afd_compile.compare import max_rel_err
from afd_compile.errors import refusal
from afd_compile.models import FAMILIES, build_hf
from afd_compile.progress import Progress
from afd_compile.runtime import check_launch, init_distributed, report_launch_error, shutdown


def _graphs_recorded(device: torch.device) -> int | None:
    """CUDA graphs Inductor's graph trees recorded on this device (None off CUDA)."""
    if device.type != "cuda":
        return None
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_container(device.index).tree_manager
    return 0 if manager is None else int(re.search(r"\d+", repr(manager.graph_counter)).group())


def _load_model(spec: str) -> torch.nn.Module:
    """``FILE.py:FACTORY`` -> ``FACTORY()`` (the file's folder is importable, as for a script)."""
    import importlib.util

    path, _, factory = spec.rpartition(":")
    if not path or not factory:
        raise SystemExit(f"--model: expected FILE.py:FACTORY, got {spec!r}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    mod_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    if mod_spec is None or mod_spec.loader is None:
        raise SystemExit(f"--model: cannot import {path}")
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return getattr(module, factory)()


def main() -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--attn-dp", type=int, default=1)
    parser.add_argument("--moe-a2a", action="store_true", help="MoE experts over the TP group, all-to-all")
    parser.add_argument("--dense-dp", action="store_true", help="dense MLPs data-parallel (SCATTERED)")
    parser.add_argument("--vocab-parallel", action="store_true", help="TP: split the LM head by vocabulary")
    parser.add_argument("--attention", type=int, default=0, help="AFD: attention ranks")
    parser.add_argument("--ffn", type=int, default=0, help="AFD: FFN ranks")
    parser.add_argument("--stages", type=int, default=1, help="AFD: micro-batches per step (ping-pong)")
    parser.add_argument("--ffn-tp", type=int, default=1, help="AFD: FFN ranks in tensor-parallel groups of this size")
    parser.add_argument("--ffn-ep", type=int, default=1, help="AFD: FFN ranks in expert-parallel groups of this size")
    parser.add_argument("--attn-tp", type=int, default=1,
                        help="AFD: attention ranks in tensor-parallel groups of this size (a group shares its tokens)")
    parser.add_argument("--family", default="llama", choices=sorted(FAMILIES),
                        help="the small HF model to build (afd_compile.models.FAMILIES)")
    parser.add_argument("--model", metavar="FILE.py:FACTORY",
                        help="instead of --family: a model of your own, FACTORY() from FILE.py (an nn.Module "
                             "taking token ids [batch, seq] and returning logits; ids drawn below 128)")
    parser.add_argument("--dynamic-output-shapes", action="store_true",
                        help="torch._dynamo.config.capture_dynamic_output_shape_ops = True and "
                             "capture_scalar_outputs = True: data-dependent ops (torch.where / nonzero in an MoE's "
                             "expert loop, an expert size read by .tolist()) stay in the graph, no graph break")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4, help="tokens per sequence (1: a decode step)")
    parser.add_argument("--max-batch", type=int, default=0,
                        help="a changing batch: each step's batch drawn (seeded, per attention group) from 1..N "
                        "(default: 2 or 3, alternating)")
    parser.add_argument("--buckets", metavar="LIST",
                        help="AFD: the attention ranks' wire slots (backend option buckets: 'default', 'off', sizes, "
                        "or 'fixed:N': N rows every step, counts on the device, no control message)")
    parser.add_argument("--batch-buckets", metavar="LIST",
                        help="AFD: an attention rank's batch padded to these numbers of sequences (backend option "
                        "batch_buckets; default 'auto': when its program is captured in CUDA graphs)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--no-inductor", action="store_true", help="run the FX programs (no Inductor)")
    parser.add_argument("--check-cache", action="store_true",
                        help="compile a second time after torch._dynamo.reset(); fail unless the FX graph cache hits")
    parser.add_argument("--control", action="store_true",
                        help="also report plain torch.compile (backend='inductor', one process) against the same "
                             "uncompiled model on the same tokens: the error compiling alone introduces")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a rank waits for a peer before failing (process group and backend timeout_s)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the backend does")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if args.dynamic_output_shapes:
        torch._dynamo.config.capture_dynamic_output_shape_ops = True
        torch._dynamo.config.capture_scalar_outputs = True
    # the launch and the options are checked before anything is built (one line, exit 2)
    needed = args.attention + args.ffn if args.attention or args.ffn else args.tp
    what = (f"layout attention={args.attention} + ffn={args.ffn}" if args.attention or args.ffn
            else f"layout tp={args.tp}")
    check_launch(needed, what, " ".join(["examples/compile_backend.py", *sys.argv[1:]]))
    rank, world = init_distributed(timeout_s=args.timeout)
    progress = Progress("compile_backend", quiet=rank != 0)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    options = {"tp": args.tp, "attn_dp": args.attn_dp, "attention": args.attention, "ffn": args.ffn,
               "inductor": not args.no_inductor, "moe_a2a": args.moe_a2a, "dense_dp": args.dense_dp,
               "timeout_s": args.timeout, **({"stages": args.stages} if args.stages != 1 else {}),
               **({"vocab_parallel": True} if args.vocab_parallel else {}),
               **({"ffn_tp": args.ffn_tp} if args.ffn_tp != 1 else {}),
               **({"ffn_ep": args.ffn_ep} if args.ffn_ep != 1 else {}),
               **({"attn_tp": args.attn_tp} if args.attn_tp != 1 else {}),
               **({"buckets": args.buckets} if args.buckets else {}),
               **({"batch_buckets": args.batch_buckets} if args.batch_buckets else {})}
    check_options(options)
    progress.line(f"{world} processes up, options checked")
    with progress.phase(f"built {args.model or args.family}"):
        model = (_load_model(args.model) if args.model else build_hf(args.family, num_layers=args.layers))
        model = model.to(device=device, dtype=dtype).eval()
    # token counts change per step (and per DP group / attention peer): dynamic shapes
    compiled = torch.compile(model, backend="afd", options=options, dynamic=True)
    if args.attention:
        group = (rank - args.ffn) // args.attn_tp  # FFN ranks first; an attention TP group shares its tokens
        ffn_rank = rank < args.ffn
    else:
        attn_tp = args.tp // args.attn_dp
        group, ffn_rank = rank // attn_tp, False
    err, control, seen = 0.0, None, []
    for step in range(args.steps):
        # batch >= 2 on the first call: dynamo specialises dims of size 0/1 (a sequence of 1 is a
        # decode graph, static in the sequence); two token
        # layouts per rank, alternating, so from step 2 on every step replays a compiled layout
        batch = 2 + (max(group, 0) + step) % 2
        if args.max_batch and not ffn_rank:  # (an FFN rank's own tokens only shape its program: its peers' count)
            batch = random.Random(1000 * group + step).randint(1, args.max_batch)
        ids = torch.randint(0, 128, (batch, args.seq), generator=torch.Generator().manual_seed(100 * group + step))
        ids = ids.to(device)
        with torch.no_grad():
            out = compiled(ids)
            if not ffn_rank:
                err = max(err, max_rel_err(out.float(), model(ids).float()))
                seen.append(ids)
        progress.line(f"step {step + 1}/{args.steps} done" + (" (the first compiles)" if step == 0 else ""))
    if args.control and not ffn_rank:
        alone = torch.compile(model, backend="inductor", dynamic=True)
        with torch.no_grad():
            control = max(max_rel_err(alone(ids).float(), model(ids).float()) for ids in seen)
    graphs = _graphs_recorded(device)  # before --check-cache's dynamo reset drops the graph trees
    hits = None
    if args.check_cache:  # a second compile of the same model and layout: Inductor's FX graph cache serves it
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        before = counters["inductor"]["fxgraph_cache_hit"]
        again = torch.compile(model, backend="afd", options=options, dynamic=True)
        with torch.no_grad():
            again(ids)
        hits = counters["inductor"]["fxgraph_cache_hit"] - before
    all_hits: list[int | None] = [None] * world
    dist.all_gather_object(all_hits, hits)
    from torch._dynamo.utils import counters

    from afd_compile.backend import STATS  # imported by the backend already; read its counters

    info = (STATS["layouts_compiled"], STATS["calls"], counters["inductor"]["cudagraph_skips"],
            STATS["cudagraphs_off"], control, graphs, STATS["exchanges_fused"], STATS["batches_padded"])
    infos: list[tuple | None] = [None] * world
    dist.all_gather_object(infos, info)
    errs: list[float | None] = [None] * world
    dist.all_gather_object(errs, None if ffn_rank else err)  # (an FFN rank compares nothing)
    compared = [e for e in errs if e is not None]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    ok = max(compared) <= tol
    note = ""
    controls = [i[4] for i in infos if i is not None and i[4] is not None]
    if not ok and controls and max(compared) <= 1.1 * max(controls):
        # compiling alone (one process, no distribution) is as far from eager: the distribution
        # adds nothing measurable (bf16 MoE: compiled rounding flips near-tied top-k routing)
        ok, note = True, f" (above {tol:g}, within plain torch.compile's own {max(controls):.3g})"
    if args.check_cache:
        ok = ok and all(h for h in all_hits)
    if device.type == "cuda" and not args.no_inductor:  # CUDA graphs: none of our programs may be skipped
        ok = ok and all(i[2] == 0 for i in infos if i is not None)
    if rank == 0:
        print("(per rank: layouts_compiled = programs Inductor compiled, one per token layout a step brought; "
              "calls = compiled calls; an FFN rank serves its attention peers and compares nothing; "
              "exchanges_fused = its programs' send/receive pairs run as one op)")
        for r, e in enumerate(errs):
            cache = f" fx_graph_cache_hits_on_recompile={all_hits[r]}" if args.check_cache else ""
            layouts, calls, skips, off, ctl, graphs, fused, padded = infos[r]
            alone = f" inductor_alone_err={ctl:.3g}" if ctl is not None else ""
            verdict = (f"max_rel_err={e:.3g} batches_padded={padded}" if e is not None
                       else f"ffn (served its attention peers) exchanges_fused={fused}")
            print(f"rank {r}: {verdict}{cache} layouts_compiled={layouts} calls={calls} "
                  f"cuda_graphs_recorded={graphs} cudagraph_skips={skips} programs_without_cudagraphs={off}{alone}")
        print(f"{'OK' if ok else 'FAIL'} max_rel_err={max(compared):.3g}{note}")
    shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # a launch, option or graph the backend refuses: one line, exit 2
        if refusal(e) is None:
            raise
        sys.exit(report_launch_error("compile_backend.py", refusal(e)))
