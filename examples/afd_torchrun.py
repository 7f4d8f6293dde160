"""AFD under torchrun: the same workers the tests and `afd-compile verify` use.

    torchrun --nproc-per-node 3 examples/afd_torchrun.py --attention 2 --ffn 1

Every rank builds the same small HF Llama (seeded random weights), exports it, splits it for its
own role and runs. Attention rank a uses batch size a + 1. Each attention rank compares its output
with the original model on its own input; rank F (the first attention rank) prints the last line
`OK max_rel_err=<x>` or `FAIL max_rel_err=<x>`, and progress lines on stderr as it goes. gloo on CPU; NCCL when CUDA is
available (AFD_BACKEND=gloo forces gloo).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.distributed as dist

from afd_compile.compare import max_rel_err
from afd_compile.deploy import make_worker
from afd_compile.errors import AFDCompileError
from afd_compile.layout import AFDLayout
from afd_compile.models import build_hf, export_lm
from afd_compile.progress import Progress
from afd_compile.runtime import (
    AttentionWorker,
    check_launch,
    init_distributed,
    report_launch_error,
    shutdown,
)


def main() -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # (the flags the other examples use; the long forms are kept as aliases)
    parser.add_argument(
        "--attention",
        "--attention-ranks",
        dest="attention",
        type=int,
        default=2,
        help="attention ranks (world ranks F..F+A-1)",
    )
    parser.add_argument("--ffn", "--ffn-ranks", dest="ffn", type=int, default=1, help="FFN ranks (world ranks 0..F-1)")
    parser.add_argument("--family", default="llama", choices=["llama", "qwen3_moe"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a rank waits for a peer before failing")
    args = parser.parse_args()
    layout = AFDLayout(args.attention, args.ffn)
    check_launch(layout.world_size, f"layout {layout}", " ".join(["examples/afd_torchrun.py", *sys.argv[1:]]))
    rank, world = init_distributed(timeout_s=args.timeout)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    progress = Progress("afd_torchrun", quiet=rank != layout.ffn_ranks)  # the first attention rank's lines
    progress.line(f"{world} processes up")
    with progress.phase(f"built and exported {args.family}"):
        model = build_hf(args.family, num_layers=2)
        ep = export_lm(model)
    if device.type == "cuda":  # the exported graph bakes device=cpu into factory ops: move it
        from torch.export.passes import move_to_device_pass

        ep = move_to_device_pass(ep, device)
    with progress.phase("programs split and built"):
        worker = make_worker(ep.module(), layout, rank, device=device)
    err = 0.0
    if isinstance(worker, AttentionWorker):
        a = layout.role_of(rank)[1]
        reference = ep.module().to(device)
        for step in range(args.steps):
            ids = torch.randint(0, 128, (a + 1, 4 + step), generator=torch.Generator().manual_seed(rank * 100 + step))
            ids = ids.to(device)
            with torch.no_grad():
                err = max(err, max_rel_err(worker.step(ids), reference(ids)))
            progress.line(f"step {step + 1}/{args.steps} done")
        worker.stop()
    else:
        print(f"afd_torchrun: FFN rank {rank}: served {worker.serve()} steps (it compares nothing)", file=sys.stderr)
    errs = [None] * world
    dist.all_gather_object(errs, err if isinstance(worker, AttentionWorker) else None)
    errs = [e for e in errs if e is not None]
    ok = max(errs) <= 1e-5
    if rank == layout.ffn_ranks:
        print(f"{'OK' if ok else 'FAIL'} max_rel_err={max(errs):.3g}")
    shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        code = main()
    except AFDCompileError as e:  # a launch or layout error: one line (from rank 0 only), exit 2
        code = report_launch_error("afd_torchrun.py", e)
    # leave without the interpreter's finalisation: gloo's worker threads, still joinable when C++
    # statics are destroyed, abort a process now and then at exit after a clean shutdown()
    # ("terminate called without an active exception", seen under load in CI; pytorch/pytorch#179291)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
