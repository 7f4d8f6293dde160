"""Serving a changing batch (issue 35): what a request trace costs an FFN rank, with and without
token buckets, on CPU (gloo).

A seeded trace of per-peer batch sizes drawn between 0 and ``--max-batch`` (default 64) sequences
of one token (a decode step) runs through AFD 2A1F and 3A1F, one and two micro-batch stages, each
with exact counts on the wire (``buckets=off``), with the default buckets, and with one bucket of
the whole capacity. Each run is a
``verify`` run: every step of every attention rank is compared with the unsplit model (fp32), so
the table is also a numerics check. Per run it reports:

- ``FFN programs compiled``: the numbers of micro-batch stages its steps ran: the backend compiles
  each stage count's program once, for symbolic rows (a dynamic export), whatever ``ffn_capture``;
- ``CUDA graphs, ffn_capture="all"``: the token layouts it ran a program for (per stage and peer):
  what the backend captures one CUDA graph for by default (``ffn_capture="all"``: the exchange is
  in the graph, which replays the receive sizes it captured); a capture of a compiled program, no
  compile;
- ``CUDA graphs, "compute"``: the carrier sizes (rows per stage) it ran on: with
  ``ffn_capture="compute"`` the exchange runs between captured pieces, which Inductor records once
  per input shape, at a per-step host cost (BENCHMARKS.md: an FFN rank's real program);
- ``row counts touched``: the distinct row counts of any stage (with buckets: the buckets the
  FFN rank's totals touched: the issue's target for the programs compiled);
- ``host messages / step``: messages the FFN rank read on the host per step (control messages,
  stage counts): they travel on a gloo group beside the exchange's (``runtime.control_group``),
  host to host; token buckets do not change their number (the per-step control message stays:
  NCCL's receive sizes must match the sends, see docs/backend.md);
- ``device reads / step``: those of them that waited on the device (an NCCL group; 0 with the
  control group, which every deployment of ``make_worker`` makes);
- ``max rel err``: the worst error of any compared output.

The third bucket list is one size, ``--max-batch``: a fixed slot, every peer's tokens padded to the
whole capacity, so the tuples of per-peer slots are only which peers had tokens; with
``ffn_capture="all"`` that is what an FFN rank captures a graph per.

    python benchmarks/serve_trace.py --json $OUT/serve_trace.json          # 200 steps (~2 min)
    python benchmarks/serve_trace.py --steps 20 --max-batch 16             # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--max-batch", type=int, default=64, help="largest batch (sequences) a peer draws")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON here")
    args = ap.parse_args()

    import torch

    from afd_compile.buckets import TokenBuckets
    from afd_compile.layout import AFDLayout
    from afd_compile.models import build_hf, export_lm
    from afd_compile.verify import Case, run_cases

    rng = random.Random(args.seed)
    # one trace; peer a at step s takes trace[(a + s) % len]: each peer its own phase of it
    trace = tuple(rng.randint(0, args.max_batch) for _ in range(args.steps))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "llama_decode.pt2")
        torch.export.save(export_lm(build_hf("llama", num_layers=2), batch=3, seq=1), path)
        fixed = str(args.max_batch)  # one size: every peer's slot is the whole capacity (a fixed slot)
        runs = [(a, s, b) for a in (2, 3) for s in (1, 2) for b in ("off", "default", fixed)]
        cases = [Case(path, AFDLayout(a, 1), trace, steps=args.steps, stages=s, buckets=TokenBuckets.parse(b))
                 for a, s, b in runs]
        results = run_cases(cases, timeout_s=600)
    rows = []
    for (a, s, b), res in zip(runs, results, strict=True):
        ffn = res[0]
        att = [v for v in res.values() if v["role"] == "attention"]
        rows.append({"layout": f"{a}A1F", "stages": s, "buckets": b, "steps": args.steps,
                     "graphs_captured": len(ffn["layouts"]), "programs_compiled": len({len(c) for c in ffn["carriers"]}),
                     "graphs_compute": len(ffn["carriers"]),
                     "buckets_touched": len({v for c in ffn["carriers"] for v in c}),
                     "host_reads_per_step": ffn["control_reads"] / max(ffn["steps"], 1),
                     "device_reads_per_step": ffn["device_reads"] / max(ffn["steps"], 1),
                     "compared": sum(v["compared"] for v in att),
                     "max_rel_err": max(v["max_rel_err"] for v in att)})
    print(f"serve_trace: {args.steps} steps, per-peer batch drawn from 0..{args.max_batch} (seed {args.seed}), "
          f"one token per sequence; {time.perf_counter() - t0:.0f} s")
    print("| layout | S | buckets | FFN programs compiled | CUDA graphs, ffn_capture=\"all\" | CUDA graphs, \"compute\" "
          "| row counts touched | host messages / step | device reads / step | max rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['stages']} | {r['buckets']} | {r['programs_compiled']} | "
              f"{r['graphs_captured']} | {r['graphs_compute']} | {r['buckets_touched']} | {r['host_reads_per_step']:.2f} | "
              f"{r['device_reads_per_step']:.2f} | {r['max_rel_err']:.2g} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "max_batch": args.max_batch, "seed": args.seed, "trace": trace,
                       "rows": rows}, f, indent=1)
    bad = [r for r in rows if not r["max_rel_err"] <= 1e-5 or not r["compared"]]
    if bad:
        print(f"serve_trace: FAIL: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
