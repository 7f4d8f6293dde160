"""Serving a changing batch (issues 35, 52): what a request trace costs an FFN rank, with and
without token buckets and with a fixed slot, on CPU (gloo).

A seeded trace of per-peer batch sizes drawn between 0 and ``--max-batch`` (default 64) sequences
of one token (a decode step) runs through AFD 2A1F and 3A1F (one and two micro-batch stages),
8A1F, 4A2F and 4A2F with an FFN TP group of 2 (one stage), each with exact counts on the wire (``buckets=off``), the
default buckets, and a fixed slot of ``--max-batch`` rows (``fixed:N``: every peer sends N rows every
step, its count in a header on the device; runtime/slots.py). Each run is a ``verify`` run:
every step of every attention rank is compared with the unsplit model (fp32), so the table is
also a numerics check. Per run, for the FFN rank that needs the most (4A2F has two):

- ``FFN programs compiled``: the numbers of micro-batch stages its steps ran: the backend compiles
  each stage count's program once, for symbolic rows (a dynamic export), whatever ``ffn_capture``;
- ``CUDA graphs, ffn_capture="all"``: the token layouts it ran a program for (per stage and peer):
  what the backend captures one CUDA graph for by default (the exchange is in the graph, which
  replays the receive sizes it captured); with a fixed slot the sizes never change: one graph
  per set of live peers;
- ``CUDA graphs, "compute"``: the carrier sizes (rows per stage) it ran on: with
  ``ffn_capture="compute"`` the exchange runs between captured pieces, which Inductor records once
  per input shape, at a per-step host cost (BENCHMARKS.md);
- ``row counts touched``: the distinct row counts of any stage;
- ``host messages / step``: control messages (and stage counts) the FFN rank waited for on the
  host before a step: with buckets or exact counts its peers' sizes, which NCCL's receives must
  match (in an FFN TP group also the group's counts, an all-gather); 0 with a fixed slot (its
  counts arrive with the data and are read after the step; a group's ranks all-gather their state
  beside the step, read after it too: runtime/slots.GroupAgreement);
- ``device reads / step``: host messages that waited on the device (an NCCL group; 0 with the
  control group, which every deployment of ``make_worker`` makes);
- ``max rel err``: the worst error of any compared output.

    python benchmarks/serve_trace.py --json $OUT/serve_trace.json          # 200 steps (~5 min)
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


def _layout(lay: tuple[int, ...]) -> object:
    """(attention, FFN[, ffn_tp]) as an AFD layout."""
    from afd_compile.layout import AFDLayout

    return AFDLayout(lay[0], lay[1], ffn_tp=lay[2] if len(lay) > 2 else 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--max-batch", type=int, default=64, help="largest batch (sequences) a peer draws")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON here")
    args = ap.parse_args()

    import torch

    from afd_compile.buckets import TokenBuckets
    from afd_compile.models import build_hf, export_lm
    from afd_compile.verify import Case, run_cases

    rng = random.Random(args.seed)
    # one trace; peer a at step s takes trace[(a + s) % len]: each peer its own phase of it
    trace = tuple(rng.randint(0, args.max_batch) for _ in range(args.steps))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "llama_decode.pt2")
        torch.export.save(export_lm(build_hf("llama", num_layers=2), batch=3, seq=1), path)
        fixed = f"fixed:{args.max_batch}"  # every peer's slot the whole capacity, counts on the device
        runs = [((a, 1), s, b) for a in (2, 3) for s in (1, 2) for b in ("off", "default", fixed)]
        runs += [(lay, 1, b) for lay in ((8, 1), (4, 2), (4, 2, 2)) for b in ("off", "default", fixed)]
        cases = [Case(path, _layout(lay), trace, steps=args.steps, stages=s, buckets=TokenBuckets.parse(b))
                 for lay, s, b in runs]
        results = run_cases(cases, timeout_s=600)
    rows = []
    for (lay, s, b), res in zip(runs, results, strict=True):
        ffn = max((res[f] for f in range(lay[1])), key=lambda r: (len(r["layouts"]), len(r["carriers"])))
        att = [v for v in res.values() if v["role"] == "attention"]
        rows.append(
            {
                "layout": str(_layout(lay)),
                "stages": s,
                "buckets": b,
                "steps": args.steps,
                "graphs_captured": len(ffn["layouts"]),
                "programs_compiled": len({len(c) for c in ffn["carriers"]}),
                "graphs_compute": len(ffn["carriers"]),
                "buckets_touched": len({v for c in ffn["carriers"] for v in c}),
                "host_reads_per_step": ffn["control_reads"] / max(ffn["steps"], 1),
                "device_reads_per_step": ffn["device_reads"] / max(ffn["steps"], 1),
                "compared": sum(v["compared"] for v in att),
                "max_rel_err": max(v["max_rel_err"] for v in att),
            }
        )
    print(
        f"serve_trace: {args.steps} steps, per-peer batch drawn from 0..{args.max_batch} (seed {args.seed}), "
        f"one token per sequence; {time.perf_counter() - t0:.0f} s"
    )
    print(
        '| layout | S | buckets | FFN programs compiled | CUDA graphs, ffn_capture="all" | CUDA graphs, "compute" '
        "| row counts touched | host messages / step | device reads / step | max rel err |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['layout']} | {r['stages']} | {r['buckets']} | {r['programs_compiled']} | "
            f"{r['graphs_captured']} | {r['graphs_compute']} | {r['buckets_touched']} | {r['host_reads_per_step']:.2f} "
            f"| "
            f"{r['device_reads_per_step']:.2f} | {r['max_rel_err']:.2g} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"steps": args.steps, "max_batch": args.max_batch, "seed": args.seed, "trace": trace, "rows": rows},
                f,
                indent=1,
            )
    bad = [r for r in rows if not r["max_rel_err"] <= 1e-5 or not r["compared"]]
    if bad:
        print(f"serve_trace: FAIL: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
