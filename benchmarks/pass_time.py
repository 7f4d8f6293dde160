"""Time of each afd-compile pass on Llama-70B-shaped graphs (8, 32, 80 layers), no real weights.

The model is built on the meta device (shapes only), exported with dynamic batch/sequence, then
split for 2 attention : 1 FFN. Prints a table and writes JSON. No assertion on time.

    python benchmarks/pass_time.py [--layers 8,32,80] [--out benchmarks/results/pass_time.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")

LLAMA_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                 num_key_value_heads=8, max_position_embeddings=8192)


def export_meta_llama(layers: int) -> torch.export.ExportedProgram:
    import transformers

    from afd_compile.models import LogitsOnly

    cfg = transformers.LlamaConfig(**LLAMA_70B, num_hidden_layers=layers)
    with torch.device("meta"):
        model = LogitsOnly(transformers.LlamaForCausalLM(cfg).eval())
        ids = torch.zeros(2, 16, dtype=torch.long)
    dims = {"input_ids": {0: torch.export.Dim("batch", min=1, max=1024), 1: torch.export.Dim("seq", min=1, max=4096)}}
    with torch.no_grad():
        return torch.export.export(model, (ids,), dynamic_shapes=dims)


def tp_timings(gm, layout) -> dict[str, float]:
    """The scatter-mode passes for one TP rank, from the program's own pass timings
    (``PassTimings``, what ``afd-compile plan --tp --timings`` prints)."""
    from afd_compile.deploy import tp_rank_program

    prog = tp_rank_program(gm, layout, 0)  # prepares, plans, copies the graph, slices weights, inserts collectives
    out = {k: prog.timings[k] for k in ("plan_tp", "annotate_dist_states", "plan_shards")}
    # (the TP rewrite proper: every pass after the preparation the AFD split shares)
    out["shard_for_rank"] = sum(s for k, s in prog.timings.items()
                                if k not in ("recognise_moe", "unpack_grouped_projections", "annotate_roles"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="8,32,80")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "pass_time.json"))
    args = parser.parse_args()
    from afd_compile.layout import AFDLayout
    from afd_compile.scatter import TPLayout
    from afd_compile.split_api import split

    rows = []
    for n in [int(x) for x in args.layers.split(",")]:
        print(f"pass_time: exporting a {n}-layer Llama-70B-shaped model on the meta device ...", flush=True)
        t = time.perf_counter()
        ep = export_meta_llama(n)
        export_s = time.perf_counter() - t
        t = time.perf_counter()
        gm = ep.module()
        module_s = time.perf_counter() - t
        result = split(gm, layout=AFDLayout(2, 1))
        nodes = len(gm.graph.nodes)
        tp = tp_timings(ep.module(), TPLayout(8))
        # SCATTERED dense MLPs inside attention-TP groups of 4 (scattered.py's rewrite on top)
        gm_dp = ep.module()
        from afd_compile.deploy import tp_rank_program

        dp = tp_rank_program(gm_dp, TPLayout(8, 2, dense_dp=True), 1)
        tp["dp2_dense_dp_shard_for_rank"] = sum(s for k, s in dp.timings.items() if k not in (
            "recognise_moe", "unpack_grouped_projections", "annotate_roles"))
        row = {"layers": n, "graph_nodes": nodes, "export_s": export_s, "unlift_s": module_s,
               **{f"{k}_s": v for k, v in result.timings.items()},
               "passes_total_s": sum(result.timings.values()),
               **{f"tp8_{k}_s": v for k, v in tp.items()}}
        rows.append(row)
        print(f"pass_time: {n} layers done ({nodes} nodes, passes {row['passes_total_s']:.2f}s)", flush=True)
    keys = ["annotate_roles_s", "plan_split_s", "build_attention_program_s", "build_ffn_program_s",
            "verify_schedule_s", "passes_total_s", "tp8_plan_tp_s", "tp8_annotate_dist_states_s",
            "tp8_plan_shards_s", "tp8_shard_for_rank_s", "tp8_dp2_dense_dp_shard_for_rank_s"]
    head = ["layers", "nodes", "export (s)", *[k.removesuffix("_s") + " (s)" for k in keys]]
    table = [head] + [[str(r["layers"]), str(r["graph_nodes"]), f"{r['export_s']:.2f}",
                       *[f"{r[k]:.3f}" for k in keys]] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    print()
    for row in table:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) + " |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "python": sys.version.split()[0], "machine": platform.machine(),
                   "cpus": os.cpu_count(), "rows": rows}, f, indent=2)
    print(f"\npass_time: wrote {args.out}")


if __name__ == "__main__":
    main()
