"""``afd-compile``: rewrite / plan / verify a saved ``.pt2`` graph, or run the demo.

Exit codes: 0 success, 1 verification failed, 2 bad input (unreadable file, no attention/FFN
structure, impossible layout), printed as one line without a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Sequence

from .layout import AFDLayout, LayoutError

EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2


class UsageError(ValueError):
    pass


def _layout(args: argparse.Namespace, required: bool) -> AFDLayout | None:
    if args.attention_ranks is None and args.ffn_ranks is None:
        if required:
            raise UsageError("--attention-ranks and --ffn-ranks are required")
        return None
    if args.attention_ranks is None or args.ffn_ranks is None:
        raise UsageError("give both --attention-ranks and --ffn-ranks")
    return AFDLayout(args.attention_ranks, args.ffn_ranks)


def _add_layout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attention-ranks", "-A", type=int, metavar="A", help="number of attention ranks")
    p.add_argument("--ffn-ranks", "-F", type=int, metavar="F", help="number of FFN ranks (each fans in a block of attention ranks)")
    p.add_argument("--gate-on-attention", action="store_true",
                   help="compute the MoE router on the attention side and send router logits (compute_gate_on_attention)")
    p.add_argument("--policy", choices=["default", "module_path", "structural"], default="default",
                   help="how FFN regions are found: module paths (nn_module_stack), data-flow structure, "
                   "or default (module paths, then structure)")


def _add_tp(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, metavar="T", help="tensor-parallel group size (scatter-mode plan)")
    p.add_argument("--attn-dp", type=int, default=1, metavar="D",
                   help="data-parallel attention groups inside the TP group (attn_tp = T / D; default 1)")
    p.add_argument("--moe-a2a", action="store_true", help="MoE layers dispatch with all-to-all (MLP mode SCATTERED)")
    p.add_argument("--dense-dp", action="store_true", help="dense MLPs run fully data-parallel (MLP mode SCATTERED)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="afd-compile",
        description="Split a traced transformer into attention and FFN programs (attention-FFN "
        "disaggregation) and check the result against the original on local processes.",
        epilog="Exit codes: 0 ok, 1 verification failed, 2 bad input.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("rewrite", help="write attention.pt2, ffn.pt2 and plan.json for an AFD layout (-A/-F), "
                       "or rank<r>.pt2 per TP rank and plan.json for a TP layout (--tp)")
    p.add_argument("model", metavar="MODEL.pt2")
    p.add_argument("-o", "--output", required=True, metavar="OUTDIR")
    _add_layout(p)
    _add_tp(p)

    p = sub.add_parser("plan", help="AFD: per layer, which nodes go to which role and what crosses the wire; "
                       "with --tp: per layer, the five scatter modes and the junction collectives")
    p.add_argument("model", metavar="MODEL.pt2")
    _add_layout(p)
    _add_tp(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")

    p = sub.add_parser("verify", help="run original and split (-A/-F) or sharded (--tp) programs on local "
                       "gloo processes and compare")
    p.add_argument("model", metavar="MODEL.pt2")
    _add_layout(p)
    _add_tp(p)
    p.add_argument("--tokens", metavar="N1,N2,...",
                   help="batch size per attention rank (default: 1,2,3,... when the batch dim is dynamic); "
                   "with --tp: one batch size per attention DP group (default 1,2,...; as saved when attn_dp=1)")
    p.add_argument("--steps", type=int, default=2, help="steps per rank (default 2)")
    p.add_argument("--tol", type=float, help="max relative error (default 1e-5 for fp32, 1e-2 otherwise)")

    sub.add_parser("demo", help="build a small HF Llama, split it 2 attention : 1 FFN, run and verify it")
    return parser


def _plan(model: str, layout: AFDLayout | None, gate: bool, policy: str = "default"):
    from .passes.roles import POLICIES
    from .programs import load_program
    from .split_api import SplitConfig, split

    ep = load_program(model)
    config = SplitConfig(compute_gate_on_attention=gate, policy=POLICIES[policy], graph_name=model)
    result = split(ep, config, layout=layout)
    return ep, result


def plan_table(result, layout: AFDLayout | None) -> str:
    from .passes.roles import META_KEY

    gm_nodes = {}
    for n in result.attention.graph.nodes:
        r = n.meta.get(META_KEY)
        if r is not None and r.layer is not None:
            gm_nodes[r.layer] = gm_nodes.get(r.layer, 0) + 1
    rows = [("layer", "attention nodes", "ffn nodes", "ffn weights", "to FFN", "to attention", "bytes/token")]
    for c in result.plan.cuts:
        rows.append((
            str(c.layer), str(gm_nodes.get(c.layer, 0)), str(len(c.ffn_nodes)), str(len(c.params)),
            " ".join(str(w) for w in c.wire_in.tensors), " ".join(str(w) for w in c.wire_out.tensors),
            f"{c.wire_in.bytes_per_token}+{c.wire_out.bytes_per_token}",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    head = f"plan: {result.plan.graph_name}: {len(result.plan.cuts)} layers cut"
    if layout is not None:
        blocks = ", ".join(f"ffn {f} <- attention {list(layout.peers_of_ffn(f))}" for f in range(layout.ffn_ranks))
        head += f"; layout {layout} ({blocks})"
    return "\n".join([head, *lines])


def _tp_graph(args: argparse.Namespace):
    """The TP layout from the flags and the model's graph with roles annotated."""
    from .passes.roles import POLICIES, annotate_roles
    from .programs import load_program
    from .scatter import TPLayout

    if args.attention_ranks is not None or args.ffn_ranks is not None:
        raise UsageError("give either an AFD layout (-A/-F) or a TP layout (--tp/--attn-dp), not both")
    layout = TPLayout(args.tp, args.attn_dp, moe_a2a=args.moe_a2a, dense_dp=args.dense_dp)
    gm = load_program(args.model).module()
    annotate_roles(gm, POLICIES[args.policy], graph_name=args.model)
    return layout, gm


def cmd_plan_tp(args: argparse.Namespace) -> int:
    import json

    from .passes.dist_states import annotate_dist_states, plan_tp

    layout, gm = _tp_graph(args)
    plan = plan_tp(gm, layout, graph_name=args.model)
    annotate_dist_states(gm, plan)
    print(json.dumps(plan.to_json(), indent=2) if args.json else plan.table())
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    if args.tp is not None:
        return cmd_plan_tp(args)
    layout = _layout(args, required=False)
    _, result = _plan(args.model, layout, args.gate_on_attention, args.policy)
    if args.json:
        import json

        data = result.plan.to_json()
        data["layout"] = str(layout) if layout else None
        data["layers"] = [{"index": c["layer"], **c} for c in data["layers"]]
        print(json.dumps(data, indent=2))
    else:
        print(plan_table(result, layout))
    return EXIT_OK


def cmd_rewrite_tp(args: argparse.Namespace) -> int:
    """One sharded program per TP rank, re-exported: ``rank<r>.pt2`` (its weight slices, its
    collectives with group ids) and ``plan.json`` (layout, groups, the scatter-mode plan)."""
    import torch

    from .passes.tp_rewrite import shard_for_rank
    from .programs import dynamic_shapes_of, example_inputs, load_program, write_json

    t = time.perf_counter()
    layout, gm = _tp_graph(args)
    inputs = example_inputs(load_program(args.model))
    os.makedirs(args.output, exist_ok=True)
    files = []
    for rank in range(layout.tp):
        prog = shard_for_rank(gm, layout, rank, graph_name=args.model)
        x = tuple(inputs)
        if layout.attn_dp > 1:  # the carrier of all DP groups' tokens (equal groups in the example)
            x = (*x, torch.empty(layout.attn_dp * int(inputs[0].numel()), 0))
        with torch.no_grad():
            ep = torch.export.export(prog.program, x, dynamic_shapes=dynamic_shapes_of(prog.program))
        files.append(f"rank{rank}.pt2")
        torch.export.save(ep, os.path.join(args.output, files[-1]))
        print(f"rewrite: rank {rank}: {len(prog.shards.weights)} weights sharded, "
              f"{sum(1 for n in ep.graph.nodes if 'afd.' in str(n.target))} afd collectives", flush=True)
    plan = {"layout": {"tp": layout.tp, "attn_dp": layout.attn_dp, "attn_tp": layout.attn_tp,
                       "attn_tp_groups": [list(range(g * layout.attn_tp, (g + 1) * layout.attn_tp))
                                          for g in range(layout.attn_dp)],
                       "moe_a2a": layout.moe_a2a, "dense_dp": layout.dense_dp},
            "programs": files, "scatter_plan": prog.plan.to_json(),
            "inputs": "the original inputs (this rank's DP group's tokens)" + (
                ", then dp_token_slots: an empty (total tokens of all DP groups, 0) tensor; before each step the "
                "runtime sets the per-group counts (afd_compile.verify._dp_step_counts)" if layout.attn_dp > 1 else "")}
    write_json(os.path.join(args.output, "plan.json"), plan)
    print(prog.plan.table())
    print(f"rewrite: wrote {', '.join(files)}, plan.json to {args.output} ({time.perf_counter() - t:.1f}s)")
    return EXIT_OK


def cmd_rewrite(args: argparse.Namespace) -> int:
    if args.tp is not None:
        return cmd_rewrite_tp(args)
    from .programs import example_inputs, export_split, write_json

    if args.attention_ranks is None and args.ffn_ranks is None:
        raise UsageError("give an AFD layout (--attention-ranks/--ffn-ranks) or a TP layout (--tp)")
    layout = _layout(args, required=True)
    t = time.perf_counter()
    ep, result = _plan(args.model, layout, args.gate_on_attention, args.policy)
    att, ffn = export_split(result.attention, result.ffn, ep.module(), example_inputs(ep))
    os.makedirs(args.output, exist_ok=True)
    import torch

    torch.export.save(att, os.path.join(args.output, "attention.pt2"))
    torch.export.save(ffn, os.path.join(args.output, "ffn.pt2"))
    plan = result.plan.to_json()
    plan["layout"] = {"attention_ranks": layout.attention_ranks, "ffn_ranks": layout.ffn_ranks,
                      "ffn_peers": {str(f): list(layout.peers_of_ffn(f)) for f in range(layout.ffn_ranks)}}
    plan["programs"] = {"attention": "attention.pt2", "ffn": "ffn.pt2"}
    plan["compute_gate_on_attention"] = args.gate_on_attention
    from .runtime import TokenCount

    plan["token_count"] = TokenCount.for_graph(ep.module(), result.plan.cuts[0].token_dims).to_json()
    write_json(os.path.join(args.output, "plan.json"), plan)
    print(plan_table(result, layout))
    print(f"rewrite: wrote attention.pt2, ffn.pt2, plan.json to {args.output} "
          f"({time.perf_counter() - t:.1f}s)")
    return EXIT_OK


def cmd_verify_tp(args: argparse.Namespace) -> int:
    from .passes.tp_rewrite import shard_for_rank
    from .runtime import RankFailure
    from .verify import TPCase, run_tp_cases

    layout, gm = _tp_graph(args)
    prog = shard_for_rank(gm, layout, 0, graph_name=args.model)  # fail fast, before spawning
    print(prog.plan.table())
    print(f"verify: {layout} on {layout.tp} local gloo processes, {len(prog.shards.weights)} weights sharded, "
          f"{len(prog.shards.arg_fixes)} head counts divided")
    batches = None
    if args.tokens:
        try:
            batches = tuple(int(t) for t in args.tokens.split(","))
        except ValueError:
            raise UsageError(f"--tokens must be comma-separated integers, got {args.tokens!r}") from None
        if len(batches) != layout.attn_dp:
            raise UsageError(f"--tokens has {len(batches)} entries, one per attention DP group ({layout.attn_dp}) expected")
    elif layout.attn_dp > 1:
        batches = tuple(1 + g for g in range(layout.attn_dp))
    try:
        (res,) = run_tp_cases([TPCase(args.model, layout, batches, args.steps, args.policy)])
    except RankFailure as e:
        print(f"verify: rank {e.rank} raised {e.short}", file=sys.stderr)
        print("verify: FAIL max_rel_err=nan")
        return EXIT_FAIL
    for r in sorted(res):
        print(f"  rank {r}: max_rel_err={res[r]['max_rel_err']:.3g}")
    err = max(v["max_rel_err"] for v in res.values())
    tol = args.tol if args.tol is not None else 1e-5
    ok = err <= tol
    print(f"verify: {'OK' if ok else 'FAIL'} max_rel_err={err:.3g}")
    return EXIT_OK if ok else EXIT_FAIL


def cmd_verify(args: argparse.Namespace) -> int:
    from .verify import verify_afd

    if args.tp is not None:
        return cmd_verify_tp(args)

    layout = _layout(args, required=True)
    batches = None
    if args.tokens:
        try:
            batches = [int(x) for x in args.tokens.split(",")]
        except ValueError:
            raise UsageError(f"--tokens must be comma-separated integers, got {args.tokens!r}") from None
        if any(b < 0 for b in batches):
            raise UsageError(f"--tokens must be >= 0, got {batches}")
    _, result = _plan(args.model, layout, args.gate_on_attention, args.policy)  # fail fast, before spawning
    print(plan_table(result, layout))
    from .runtime import RankFailure

    try:
        report = verify_afd(args.model, layout, batches=batches, gate=args.gate_on_attention,
                            steps=args.steps, tol=args.tol, policy=args.policy, log=print)
    except RankFailure as e:
        print(f"verify: rank {e.rank} raised {e.short}", file=sys.stderr)
        print("verify: FAIL max_rel_err=nan")
        return EXIT_FAIL
    print(report.line())
    return EXIT_OK if report.ok else EXIT_FAIL


def cmd_demo(args: argparse.Namespace) -> int:
    import tempfile

    import torch

    from .models import build_hf, export_lm
    from .verify import verify_afd

    layout = AFDLayout(2, 1)
    print("demo: building a 2-layer HF Llama (hidden 64, random weights, offline) and exporting it")
    ep = export_lm(build_hf("llama", num_layers=2))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "llama.pt2")
        torch.export.save(ep, path)
        _, result = _plan(path, layout, False)
        print(plan_table(result, layout).replace(path, "llama (demo)", 1))
        report = verify_afd(path, layout, batches=[2, 3], log=print)
    print(report.line())
    return EXIT_OK if report.ok else EXIT_FAIL


def _bad_input_types() -> tuple[type[BaseException], ...]:
    from .passes.roles import NoStructureError
    from .passes.schedule import ScheduleError
    from .passes.shard import ShardError
    from .passes.split import SplitError
    from .passes.tp_rewrite import TPRewriteError
    from .programs import ProgramLoadError
    from .scatter import TransitionError
    from .verify import VerifyInputError

    return (ShardError, TPRewriteError, TransitionError, UsageError, LayoutError, NoStructureError, SplitError, ScheduleError, ProgramLoadError,
            VerifyInputError)


def main(argv: Sequence[str] | None = None) -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    args = build_parser().parse_args(argv)
    handlers = {"plan": cmd_plan, "rewrite": cmd_rewrite, "verify": cmd_verify, "demo": cmd_demo}
    try:
        return handlers[args.command](args)
    except _bad_input_types() as e:
        print(f"afd-compile {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
