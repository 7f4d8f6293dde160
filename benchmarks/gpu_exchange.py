"""AFD exchange inside CUDA graphs vs the bare NCCL floor (2 GPUs, torchrun, NCCL).

    torchrun --nproc-per-node 2 benchmarks/gpu_exchange.py --out out/gpu/exchange.json

Rank 0 plays the FFN side, rank 1 the attention side of a 1:1 AFD layout. One "layer exchange"
is what every AFD layer does: the attention rank sends T x hidden bf16 to the FFN rank and
receives T x hidden back (two batched transfers, one after the other). Per token count T, a CUDA
graph of ``--layers`` exchanges is captured and replayed:

- ``bare``: ``dist.batch_isend_irecv`` directly (the floor: the same bytes, nothing else);
- ``afd``: our ops (``afd::p2p_send`` + ``afd::p2p_recv`` on the attention rank,
  ``afd::p2p_recv_group`` + ``afd::p2p_send_group`` on the FFN rank), as the split programs call them;
- ``bare_1batch``: send and receive in one batched call (the shared LIMITS.md measurement: 12.9 us at T=32);
- ``afd_eager`` / ``afd_eager_checked``: our ops outside a graph, with the wire check header off / on
  (the header's comparison runs on the host, so checked mode never runs inside a graph).

Prints a table (us per layer exchange, median of 5 timed replays) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

from afd_compile.comm import AFDCommunicator, register_communicator
from afd_compile.runtime import init_distributed, shutdown


def _graph(fn, warmup: int = 2) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    dist.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def _time(g: torch.cuda.CUDAGraph, layers: int, reps: int = 5) -> float:
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / layers)
    return statistics.median(times[1:])


def _measure(T: int, args: argparse.Namespace, rank: int, comm: AFDCommunicator, dev: torch.device,
             spec: str) -> dict:
    peer, ffn = 1 - rank, rank == 0
    comm.set_step({0: (T,)})
    x = torch.randn(T, args.hidden, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def bare() -> None:
        for _ in range(args.layers):
            first = [dist.P2POp(dist.irecv if ffn else dist.isend, x if not ffn else y, peer)]
            for w in dist.batch_isend_irecv(first):
                w.wait()
            second = [dist.P2POp(dist.isend if ffn else dist.irecv, y if ffn else x, peer)]
            for w in dist.batch_isend_irecv(second):
                w.wait()

    def one_batch() -> None:
        for _ in range(args.layers):
            ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]
            for w in dist.batch_isend_irecv(ops if rank == 0 else ops[::-1]):
                w.wait()

    slots = torch.empty(T, 0, device=dev)

    def afd() -> None:
        h = x
        for layer in range(args.layers):
            if ffn:
                (got,) = torch.ops.afd.p2p_recv_group(slots, 7, layer, 0, T, spec)
                torch.ops.afd.p2p_send_group([got], 7, layer, 0, spec)
            else:
                tok = torch.ops.afd.p2p_send([h], 7, layer, 0, spec)
                (h,) = torch.ops.afd.p2p_recv(tok, 7, layer, 0, T, spec)

    row = {"tokens": T, "bytes_each_way": T * args.hidden * 2}
    for name, fn in (("bare", bare), ("afd", afd), ("bare_1batch", one_batch)):
        row[f"{name}_us"] = _time(_graph(fn), args.layers)
    for check in (False, True):  # outside graphs: what the wire check header costs (verify's mode)
        comm.check_wire = check
        row[f"afd_eager{'_checked' if check else ''}_us"] = _time_eager(afd, args.layers)
    comm.check_wire = False
    return row


def _time_eager(fn, layers: int, reps: int = 5) -> float:
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / layers)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", default="1,8,32,128,512")
    parser.add_argument("--out", default="out/gpu/exchange.json")
    args = parser.parse_args()
    rank, world = init_distributed()
    assert world == 2 and dist.get_backend() == "nccl", "needs 2 GPUs and NCCL"
    dev = torch.device("cuda", torch.cuda.current_device())
    comm = AFDCommunicator("ffn" if rank == 0 else "attention", rank, (1 - rank,))
    register_communicator(comm, 7)
    spec = f"hidden:bfloat16[{args.hidden}]"
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        rows.append(_measure(T, args, rank, comm, dev, spec))
    if rank == 1:
        print(f"AFD layer exchange in CUDA graphs, hidden {args.hidden} bf16, {args.layers} layers per graph, "
              f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
        print("| tokens | bytes each way | bare send+recv (us) | afd ops (us) | afd / bare | bare 1 batch (us) "
              "| afd eager (us) | afd eager, wire checks (us) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['tokens']} | {r['bytes_each_way']} | {r['bare_us']:.1f} | {r['afd_us']:.1f} | "
                  f"{r['afd_us'] / r['bare_us']:.2f} | {r['bare_1batch_us']:.1f} | {r['afd_eager_us']:.1f} | "
                  f"{r['afd_eager_checked_us']:.1f} |")
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"hidden": args.hidden, "layers": args.layers, "torch": torch.__version__, "rows": rows}, f,
                      indent=1)
    shutdown()


if __name__ == "__main__":
    main()
