"""What the wire check header costs: the AFD layer exchange with ``check_wire`` off and on.

    python benchmarks/wire_check.py [--hidden 4096] [--layers 32] [--tokens 1,8,64,512]

Two local gloo processes (CPU): rank 0 plays the FFN side, rank 1 the attention side of a 1:1 AFD
layout, and run ``--layers`` layer exchanges through our ops (``afd::p2p_send`` + ``afd::p2p_recv``
against ``afd::p2p_recv_group`` + ``afd::p2p_send_group``), the way the split programs call them,
once with plain transfers and once with a check header ahead of every transfer (verify's and the
tests' mode). Prints a table (us per layer exchange, median of ``--reps`` runs, side by side in
one run) and writes JSON. The GPU version of the exchange (inside CUDA graphs, where the check is
off) is ``benchmarks/gpu_exchange.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def _rank(rank: int, world: int, hidden: int, layers: int, tokens: list[int], reps: int) -> list[dict]:
    import torch.distributed as dist

    from afd_compile.comm import AFDCommunicator, register_communicator

    afd = torch.ops.afd
    spec_in, spec_out = f"hidden:float32[{hidden}]", f"ffn_out:float32[{hidden}]"
    rows = []
    for T in tokens:
        row: dict = {"tokens": T, "bytes_each_way": T * hidden * 4}
        for check in (False, True):
            comm = AFDCommunicator("ffn" if rank == 0 else "attention", rank, (1 - rank,), check_wire=check)
            comm.set_step({0: (T,)})
            register_communicator(comm, 5)
            x, slots = torch.randn(T, hidden), torch.empty(T, 0)
            times = []
            for _ in range(reps + 1):
                dist.barrier()
                t = time.perf_counter()
                for layer in range(layers):
                    if rank == 0:
                        (got,) = afd.p2p_recv_group(slots, 5, layer, 0, T, spec_in)
                        afd.p2p_send_group([got], 5, layer, 0, spec_out)
                    else:
                        tok = afd.p2p_send([x], 5, layer, 0, spec_in)
                        afd.p2p_recv(tok, 5, layer, 0, T, spec_out)
                times.append((time.perf_counter() - t) * 1e6 / layers)
            row["checked_us" if check else "plain_us"] = statistics.median(times[1:])
        rows.append(row)
    return rows


def main() -> None:
    from afd_compile.runtime import run_local

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", default="1,8,64,512")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/wire_check.json")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = run_local(_rank, 2, args.hidden, args.layers, tokens, args.reps, timeout_s=120)[1]
    print(f"AFD layer exchange on 2 local gloo processes (CPU), hidden {args.hidden} fp32, {args.layers} layers, "
          f"median of {args.reps}, torch {torch.__version__}")
    print("| tokens | bytes each way | plain (us) | with check headers (us) | checked / plain |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['bytes_each_way']} | {r['plain_us']:.1f} | {r['checked_us']:.1f} | "
              f"{r['checked_us'] / r['plain_us']:.2f} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"hidden": args.hidden, "layers": args.layers, "torch": torch.__version__, "rows": rows}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
