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
from collections.abc import Callable, Sequence

from .buckets import BUCKETS_HELP, buckets_flag
from .cli_checks import (
    ClosedTolerant,
    UsageError,
    afd_layout,
    check_arguments,
    check_mode_flags,
    check_saved_flags,
    tp_layout,
)
from .cli_estimate import add_estimate_flags, add_profile_parser, check_estimate_flags, cmd_profile, print_estimate
from .errors import AFDCompileError
from .figures import mermaid_flag
from .layout import AFDLayout
from .limits import MAX_RANKS, MAX_STAGES, MAX_STEPS, count_flag, local_process_override, parse_tokens, positive_seconds
from .outdir import OutputFolder, exit_on_sigterm, save_program
from .plan_view import (
    AFD_LEGEND,
    PASSES_HELP,
    PLAN_USAGE,
    TP_LEGEND,
    afd_plan_notes,
    cache_json,
    mixers_json,
    moe_lines,
    moe_records,
    plan_table,
    print_passes,
    stage_schedule,
    stage_text,
    unpacked_lines,
)
from .saved import MARKER

EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2


_RANKS = count_flag(1, MAX_RANKS)  # a count of ranks (a layout has at most MAX_RANKS)


def _add_layout(p: argparse.ArgumentParser, groups: str = "") -> None:
    g = p.add_argument_group("AFD layout (attention-FFN disaggregation); not with --tp")
    g.add_argument("--attention-ranks", "-A", type=_RANKS, metavar="A", help="number of attention ranks")
    g.add_argument("--ffn-ranks", "-F", type=_RANKS, metavar="F", help="number of FFN ranks (each fans in a block of "
                   "attention ranks)")
    g.add_argument("--attn-tp", type=_RANKS, default=1, metavar="T",
                   help="attention ranks in tensor-parallel groups of T, each group one data-parallel group (its "
                   "own sequences); each rank sends its slice of the group's tokens; T divides A (default 1)" + groups)
    g.add_argument("--ffn-tp", type=_RANKS, default=1, metavar="P",
                   help="FFN ranks in tensor-parallel groups of P (the MLP weights split over each group; every "
                   "token still crosses the wire once); P divides F (default 1)" + groups)
    g.add_argument("--ffn-ep", type=_RANKS, default=1, metavar="P",
                   help="FFN ranks in expert-parallel groups of P (an MoE's experts split over each group, tokens "
                   "routed by all-to-all); P divides F; not with --ffn-tp (default 1)" + groups)
    g.add_argument("--gate-on-attention", action="store_true",
                   help="compute the MoE router on the attention side and send router logits "
                   "(compute_gate_on_attention)")
    p.add_argument("--policy", choices=["default", "module_path", "structural"], default="default",
                   help="how FFN regions are found: module paths (nn_module_stack), data-flow structure, "
                   "or default (module paths, then structure)")


def _add_tp(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TP layout (tensor parallelism, scatter modes); not with -A/-F")
    g.add_argument("--tp", type=_RANKS, metavar="T", help="tensor-parallel group size (scatter-mode plan)")
    g.add_argument("--attn-dp", type=_RANKS, metavar="D",
                   help="data-parallel attention groups inside the TP group (attn_tp = T / D; default 1)")
    g.add_argument("--moe-a2a", action="store_true", help="MoE layers dispatch with all-to-all (MLP mode SCATTERED)")
    g.add_argument("--dense-dp", action="store_true", help="dense MLPs run fully data-parallel (MLP mode SCATTERED)")
    g.add_argument("--vocab-parallel", action="store_true",
                   help="split the LM head by vocabulary over the attention TP group, logits all-gathered (default: "
                   "the head whole on every rank)")


def _add_import(p: argparse.ArgumentParser) -> None:
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE (a module name or a .py file) before loading: the library that registers "
                        "custom ops the program uses (repeatable; the local processes import it too)")


def _add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress lines (by default each phase prints one on stderr as it ends, with its time)")


def _progress(args: argparse.Namespace):
    from .progress import Progress

    return Progress(f"afd-compile {args.command}", quiet=getattr(args, "quiet", False))


def _add_stages(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--stages", type=count_flag(1, MAX_STAGES), default=1, metavar="S",
                   help=f"AFD: {what}; not with --tp")


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--buckets", type=buckets_flag, default="default", metavar="LIST", help=BUCKETS_HELP)
    p.add_argument("--saved", metavar="OUTDIR", help="check the programs `rewrite` wrote into OUTDIR (plan.json and "
                   "each program's sha256 checked; its layout, router side and stages) against MODEL.pt2")
    p.add_argument("--lowered", action="store_true", help="AFD: run each rank's programs through its pipeline's "
                   "lowering stage for the CPU (plan --passes cpu: the FFN exchange fused, receives into buffers), "
                   "as the torch.compile backend runs them, instead of the portable programs rewrite writes")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("afd-compile")
    except PackageNotFoundError:  # (run from a checkout that was not installed)
        return "unknown (not installed)"


TOKENS_HELP = ("batch size (sequences, not tokens) per attention rank (default: 1,2,3,... when the batch dim is "
               "dynamic, S,S+1,... with --stages S); each >= 0, not all 0, two peers of a fan-in with tokens in some "
               "step; with --tp: one batch size per attention DP group (default 1,2,...; "
               "as saved when attn_dp=1)")
TIMINGS_HELP = "print the seconds each pass took (this process's planning; TP: rank 0's program)"
MERMAID_HELP = ("print one layer (default 0) as a Mermaid flowchart instead of the table: the AFD split (both "
                "programs, what crosses the wire) or the TP junctions (states, collectives); 'ranks': the whole "
                "layout (ranks, groups, peers, bytes per token on each link)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="afd-compile",
        description="Distribute a traced transformer (a torch.export .pt2): split it into attention and FFN "
        "programs (attention-FFN disaggregation, -A/-F) or shard it tensor-parallel (--tp), plan, write the "
        "per-rank programs, and check them against the original on local processes.",
        epilog="Exit codes: 0 ok, 1 verification failed, 2 bad input.",
    )
    parser.add_argument("--version", action="version", version=f"afd-compile {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("rewrite", help="write attention.pt2, ffn.pt2 and plan.json for an AFD layout (-A/-F), "
                       "or rank<r>.pt2 per TP rank and plan.json for a TP layout (--tp)")
    p.add_argument("model", metavar="MODEL.pt2")
    p.add_argument("-o", "--output", required=True, metavar="OUTDIR",
                   help="a new or empty folder (written into a temporary sibling, then renamed: never half-written)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUTDIR whole (no stale files are kept)")
    _add_layout(p, "; rewrite: not supported yet (exit 2): plan and verify take it, and the backend")
    _add_tp(p)
    p.add_argument("--timings", action="store_true", help=TIMINGS_HELP)
    _add_import(p)
    _add_quiet(p)
    _add_stages(p, "record S micro-batches per step in plan.json (load_rewritten_worker runs the programs as S "
                "stages); the staged programs and their ping-pong schedule are built and checked now, and printed")

    p = sub.add_parser("plan", help="AFD: per layer, which nodes go to which role and what crosses the wire; "
                       "with --tp: per layer, the five scatter modes and the junction collectives",
                       usage=PLAN_USAGE)
    p.add_argument("model", metavar="MODEL.pt2")
    _add_layout(p)
    _add_tp(p)
    p.add_argument("--timings", action="store_true", help=TIMINGS_HELP)
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    out.add_argument("--mermaid", type=mermaid_flag, nargs="?", const=0, metavar="LAYER|ranks", help=MERMAID_HELP)
    p.add_argument("--passes", nargs="?", const="cuda", choices=("cpu", "cuda"), metavar="DEVICE", help=PASSES_HELP)
    p.add_argument("--shards", action="store_true", help="with --tp: list every sharding record of rank 0's "
                   "program (each weight split column/row-parallel and its blocks, KV cache states, tensors "
                   "read in slices, biases kept on one rank, means all-reduced, size arguments divided); "
                   "without it one line counts them")
    _add_import(p)
    _add_quiet(p)
    _add_stages(p, "also print the ping-pong schedule of S micro-batches per step (for the saved example's "
                "batch on every attention rank) and check it (pairing, order, no deadlock)")
    add_estimate_flags(p)

    p = sub.add_parser("verify", help="run original and split (-A/-F) or sharded (--tp) programs on local gloo "
                       "processes and compare")
    p.add_argument("model", metavar="MODEL.pt2")
    _add_layout(p)
    _add_tp(p)
    p.add_argument("--timings", action="store_true", help=TIMINGS_HELP)
    p.add_argument("--tokens", metavar="N1,N2,...", help=TOKENS_HELP)
    p.add_argument("--steps", type=count_flag(1, MAX_STEPS), default=None, help="steps per rank (default 2, at least "
                   "1; not with --decode-steps, which sets the steps)")
    p.add_argument("--decode-steps", type=count_flag(0, MAX_STEPS), default=0, metavar="N",
                   help="a program with a KV cache (buffers it updates in place at the positions of a 1-D integer "
                   "input: cache_position as transformers' TorchExportableModuleForDecoderOnlyLM exports, gpt-fast's "
                   "input_pos): run its saved example as a prefill, then N decode steps, comparing the logits at every "
                   "step (replaces --steps)")
    _add_stages(p, "run each step as S micro-batches (whole sequences) interleaved layer by layer, the "
                "ping-pong schedule (default 1: one batch); with a KV cache each micro-batch its own cache rows")
    _add_run_flags(p)
    p.add_argument("--tol", type=float, help="max relative error (default 1e-5 when every output compared is "
                   "fp32/fp64, 1e-2 otherwise; printed on the verdict line; finite, >= 0)")
    p.add_argument("--timeout", type=positive_seconds, default=300.0, metavar="SECONDS",
                   help="how long a rank waits for a peer before the run fails (default 300); a rank that dies or is "
                   "stopped fails the run at once")
    _add_import(p)
    _add_quiet(p)

    add_profile_parser(sub, _add_quiet, _add_import)
    p = sub.add_parser("demo", help="build a small HF Llama, split it 2 attention : 1 FFN, run and verify it",
                       description="Build a 2-layer HF Llama (random weights, offline), export it, split it 2 "
                       "attention : 1 FFN, run the split on 3 local gloo processes and compare with the original. Last "
                       "line: verify: OK max_rel_err=<x> tol=<t> (exit 0) or FAIL (exit 1).")
    _add_quiet(p)
    return parser


def _plan(model: str, layout: AFDLayout | None, gate: bool, policy: str = "default", stages: int = 1,
          runs: bool = True):
    from .deploy import plan_afd
    from .passes.roles import POLICIES
    from .programs import flat_inputs, load_program
    from .split_api import SplitConfig

    ep = load_program(model)
    if runs:  # (rewrite, verify: inputs that are not tensors said now, not after planning)
        flat_inputs(ep)
    config = SplitConfig(compute_gate_on_attention=gate, policy=POLICIES[policy], graph_name=model)
    return ep, plan_afd(ep, layout, config, stages)


def _tp_graph(args: argparse.Namespace):
    """The TP layout from the flags, the model's graph prepared for its ranks (deploy's Work:
    ``.gm`` has its roles annotated), and the program."""
    from .deploy import prepare_tp_graph
    from .passes.roles import POLICIES
    from .programs import load_program, positional_module
    from .split_api import SplitConfig

    layout = tp_layout(args)
    ep = load_program(args.model)
    work = prepare_tp_graph(positional_module(ep), layout, SplitConfig(policy=POLICIES[args.policy],
                                                                       graph_name=args.model))
    return layout, work, ep


def _print_timings(args: argparse.Namespace, seconds: dict[str, float]) -> None:
    if getattr(args, "timings", False):
        from .passes.pipeline import timings_table

        print(timings_table(seconds), file=sys.stderr if getattr(args, "json", False) else sys.stdout)


def _shards_summary(shards, listed: bool = False) -> str:
    """One line counting rank 0's sharding records (``plan --tp --shards`` lists them)."""
    kinds: dict[str, int] = {}
    for w in shards.weights:
        kind = "row bias" if w.kind == "row_bias" else w.kind
        kinds[kind] = kinds.get(kind, 0) + 1
    fused = sum(1 for w in shards.weights if len(w.blocks) > 1)
    parts = [f"{len(shards.weights)} weights split ({', '.join(f'{v} {k}' for k, v in kinds.items())}"
             f"{f'; {fused} fused, in blocks' if fused else ''})"]
    for items, what in ((shards.states, "cache states split"), (shards.operands, "tensors read in slices"),
                        (shards.once, "biases kept on group rank 0"), (shards.split_means, "means all-reduced"),
                        (shards.arg_fixes, "size arguments divided")):
        if items:
            parts.append(f"{len(items)} {what}")
    return f"shards (rank 0): {', '.join(parts)}" + ("" if listed or not shards.weights else "; --shards lists them")


def cmd_plan_tp(args: argparse.Namespace) -> int:
    import json

    from .deploy import tp_rank_of

    with _progress(args).phase(f"loaded and sharded {args.model} (rank 0)"):
        layout, work, _ = _tp_graph(args)
        # shard rank 0 as verify and rewrite do: a layout the model cannot take is refused here too
        prog, gm = tp_rank_of(work, 0), work.gm
    from .passes.graph_utils import state_bytes, written_attrs

    cache = None
    if written_attrs(gm):
        cache = {"buffers": sorted(written_attrs(gm)), "bytes_per_rank": state_bytes(prog.program),
                 "bytes_unsharded": state_bytes(gm), "split_by_kv_heads": [str(s) for s in prog.shards.states]}
    if args.mermaid is not None:
        from .figures import tp_mermaid

        try:
            print(tp_mermaid(prog.plan, args.mermaid))
        except ValueError as e:
            raise UsageError(str(e)) from None
    elif args.json:
        print(json.dumps({**prog.plan.to_json(), "shards": str(prog.shards).splitlines(),
                          "moe_blocks": [str(r) for r in moe_records(gm)],
                          **({"unpacked_projections": [ln.strip() for ln in unpacked_lines(gm)[1:]]}
                             if unpacked_lines(gm) else {}),
                          **({"cache": cache} if cache else {})}, indent=2))
    else:
        print(prog.plan.table())
        print(TP_LEGEND)
        for line in moe_lines(moe_records(gm)) + unpacked_lines(gm):
            print(line)
        print(_shards_summary(prog.shards, listed=args.shards))
        if args.shards:
            print(prog.shards)
        if cache:
            print(f"KV cache: {len(cache['buffers'])} buffers updated in place, {cache['bytes_per_rank']} bytes per "
                  f"rank of {cache['bytes_unsharded']} ({len(cache['split_by_kv_heads'])} split by KV heads)")
    _print_timings(args, prog.timings)
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    if args.estimate is not None:
        return print_estimate(args, tp_layout(args) if args.tp is not None else afd_layout(args, required=False))
    if args.passes is not None:
        return print_passes(args, tp_layout(args) if args.tp is not None else afd_layout(args, required=False))
    if args.tp is not None:
        return cmd_plan_tp(args)
    layout = afd_layout(args, required=False)
    with _progress(args).phase(f"loaded and planned {args.model}"):
        ep, result = _plan(args.model, layout, args.gate_on_attention, args.policy, _stages(args), runs=False)
    if args.mermaid is not None:
        from .figures import afd_mermaid

        try:
            print(afd_mermaid(result, layout, args.mermaid))
        except ValueError as e:
            raise UsageError(str(e)) from None
    elif args.json:
        import json

        from .deploy import token_count_for_graph

        data = result.plan.to_json()
        data["layout"] = str(layout) if layout else None
        data["moe_blocks"] = [str(r) for r in result.moe]
        data.update(mixers_json(result.attention))
        names = [n.name for n in result.attention.graph.nodes if n.op == "placeholder"]
        data["tokens_per_step"] = token_count_for_graph(result.attention,
                                                        result.plan.cuts[0].token_dims).describe(names)
        cache = cache_json(result)
        if cache:
            data["cache"] = cache
        if args.stages != 1:
            data["stages"] = stage_schedule(result, ep)
        print(json.dumps(data, indent=2))
    else:
        print(plan_table(result, layout))
        print(AFD_LEGEND)
        for line in afd_plan_notes(result, layout, args.gate_on_attention):
            print(line)
    if args.stages != 1 and not args.json:
        print(stage_text(stage_schedule(result, ep)))
    _print_timings(args, result.timings)
    return EXIT_OK


def _stages(args: argparse.Namespace) -> int:
    if args.stages < 1:
        raise UsageError(f"--stages must be >= 1, got {args.stages}")
    return args.stages


def _export_tp_rank(work, layout, rank: int, inputs: list):
    """(rank's TPProgram, its re-exported program)."""
    import torch

    from .deploy import tp_rank_of
    from .programs import dynamic_shapes_of

    prog = tp_rank_of(work, rank)
    x = tuple(inputs)
    if layout.attn_dp > 1:  # the carrier of all DP groups' tokens (equal groups in the example)
        x = (*x, torch.empty(layout.attn_dp * int(inputs[0].numel()), 0))
    with torch.no_grad():
        return prog, torch.export.export(prog.program, x, dynamic_shapes=dynamic_shapes_of(prog.program))


def cmd_rewrite_tp(args: argparse.Namespace) -> int:
    """One sharded program per TP rank, re-exported: ``rank<r>.pt2`` (its weight slices, its
    collectives with group ids) and ``plan.json`` (layout, groups, the scatter-mode plan)."""

    from .programs import flat_inputs, write_json

    t = time.perf_counter()
    out = OutputFolder(args.output, args.force, inputs=[args.model])
    progress = _progress(args)
    with progress.phase(f"loaded {args.model}"):
        layout, work, ep = _tp_graph(args)
        inputs = flat_inputs(ep)
    programs = []
    for rank in range(layout.tp):  # every rank planned and exported before anything is written
        with progress.phase(f"rank {rank}: sharded and re-exported"):
            prog, ep = _export_tp_rank(work, layout, rank, inputs)
        if rank == 0:
            _print_timings(args, prog.timings)
        programs.append((f"rank{rank}.pt2", ep))
        print(f"rewrite: rank {rank}: {len(prog.shards.weights)} weights sharded, "
              f"{sum(1 for n in ep.graph.nodes if 'afd.' in str(n.target))} afd collectives", flush=True)
    files = [name for name, _ in programs]
    plan = {"kind": "tp",
            "layout": {"tp": layout.tp, "attn_dp": layout.attn_dp, "attn_tp": layout.attn_tp,
                       "attn_tp_groups": [list(range(g * layout.attn_tp, (g + 1) * layout.attn_tp))
                                          for g in range(layout.attn_dp)],
                       "moe_a2a": layout.moe_a2a, "dense_dp": layout.dense_dp,
                       "vocab_parallel": layout.vocab_parallel},
            "programs": files, "scatter_plan": prog.plan.to_json(),
            "inputs": "the original inputs (this rank's DP group's tokens)" + (
                ", then dp_token_slots: an empty (total tokens of all DP groups, 0) tensor; before each step the "
                "runtime sets the per-group counts (afd_compile.runtime.dp_step_counts)" if layout.attn_dp > 1 else "")}
    with out as d:
        plan["sha256"] = {name: save_program(ep, os.path.join(d, name)) for name, ep in programs}
        write_json(os.path.join(d, "plan.json"), {MARKER[0]: MARKER[1], **plan})
    print(prog.plan.table())
    print(f"rewrite: wrote {', '.join(files)}, plan.json to {args.output} ({time.perf_counter() - t:.1f}s)")
    return EXIT_OK


def cmd_rewrite(args: argparse.Namespace) -> int:
    if args.tp is not None:
        return cmd_rewrite_tp(args)

    from .deploy import token_count_for_graph
    from .programs import export_split, flat_inputs, positional_module, write_json
    from .saved import afd_plan_json

    if args.attention_ranks is None and args.ffn_ranks is None:
        raise UsageError("give an AFD layout (--attention-ranks/--ffn-ranks) or a TP layout (--tp)")
    layout = afd_layout(args, required=True)
    if layout.ffn_group_size > 1 or layout.attn_tp > 1:
        raise UsageError("rewrite --ffn-tp/--ffn-ep/--attn-tp: not supported yet (a group's programs are split per "
                         "rank: plan and verify take them, and the backend takes ffn_tp / ffn_ep / attn_tp)")
    t = time.perf_counter()
    out = OutputFolder(args.output, args.force, inputs=[args.model])
    progress = _progress(args)
    with progress.phase(f"loaded and split {args.model}"):
        ep, result = _plan(args.model, layout, args.gate_on_attention, args.policy, _stages(args))
    original = positional_module(ep)
    with progress.phase("attention and FFN programs re-exported"):
        att, ffn = export_split(result.attention, result.ffn, original, flat_inputs(ep))
    plan = afd_plan_json(result, layout, args.gate_on_attention,
                         token_count_for_graph(original, result.plan.cuts[0].token_dims).to_json(), cache_json(result))
    schedule = None
    if args.stages != 1:  # refused before anything is written; the role programs are saved unstaged
        staged = stage_schedule(result, ep)
        schedule = stage_text(staged)
        plan["stages"] = args.stages
        if staged["static_batch"] is not None:
            plan["static_batch"] = staged["static_batch"]
    with out as d:
        plan["sha256"] = {"attention.pt2": save_program(att, os.path.join(d, "attention.pt2")),
                          "ffn.pt2": save_program(ffn, os.path.join(d, "ffn.pt2"))}
        write_json(os.path.join(d, "plan.json"), {MARKER[0]: MARKER[1], **plan})
    print(plan_table(result, layout))
    if schedule is not None:
        print(schedule)
    _print_timings(args, result.timings)
    print(f"rewrite: wrote attention.pt2, ffn.pt2, plan.json to {args.output} "
          f"({time.perf_counter() - t:.1f}s)")
    return EXIT_OK


def _verdict(run: Callable[[], object]) -> int:
    """Run a verify, print its verdict: OK / FAIL with the error and the tolerance; a run that
    ended without a result (a rank, the launcher or its forkserver failed) is FAIL naming what
    failed first, with no error figure."""
    from .runtime import RunFault

    try:
        report = run()
    except RunFault as e:  # a rank, the launcher or its forkserver failed: no figure, nothing was judged
        print(f"verify: FAIL ({e.line()})")
        return EXIT_FAIL
    print(report.line())  # type: ignore[attr-defined]
    return EXIT_OK if report.ok else EXIT_FAIL  # type: ignore[attr-defined]


def cmd_verify_tp(args: argparse.Namespace) -> int:
    from .deploy import tp_rank_of
    from .verify import verify_tp

    batches = parse_tokens(args.tokens)
    progress = _progress(args)
    with progress.phase(f"loaded and sharded {args.model} (rank 0)"):
        layout, work, ep = _tp_graph(args)
        prog = tp_rank_of(work, 0)  # fail fast, before spawning
    print(prog.plan.table())
    _print_timings(args, prog.timings)
    print(f"verify: {len(prog.shards.weights)} weights sharded, {len(prog.shards.arg_fixes)} head counts divided")
    return _verdict(lambda: verify_tp(args.model, layout, batches=batches, steps=args.steps, tol=args.tol,
                                      policy=args.policy, timeout_s=args.timeout, decode_steps=args.decode_steps,
                                      log=print, on_progress=progress.rank, program=ep))


def cmd_verify_saved(args: argparse.Namespace) -> int:
    from .buckets import TokenBuckets
    from .saved import read_saved_plan
    from .verify import verify_saved

    check_saved_flags(args, read_saved_plan(args.saved).kind)
    return _verdict(lambda: verify_saved(args.model, args.saved, batches=parse_tokens(args.tokens), steps=args.steps,
                                         tol=args.tol, timeout_s=args.timeout, decode_steps=args.decode_steps,
                                         buckets=TokenBuckets.parse(args.buckets), log=print,
                                         on_progress=_progress(args).rank, lowered=args.lowered))


def cmd_verify(args: argparse.Namespace) -> int:
    if args.saved is not None:
        return cmd_verify_saved(args)
    if args.tp is not None:
        return cmd_verify_tp(args)
    layout = afd_layout(args, required=True)
    batches = parse_tokens(args.tokens)
    from .buckets import TokenBuckets
    from .verify import verify_afd  # (after the argument checks: they need no torch)
    progress = _progress(args)
    with progress.phase(f"loaded and split {args.model}"):
        # fail fast, before spawning
        ep, result = _plan(args.model, layout, args.gate_on_attention, args.policy, _stages(args))
    print(plan_table(result, layout))
    _print_timings(args, result.timings)
    if args.stages != 1:
        print(stage_text(stage_schedule(result, ep)))
    return _verdict(lambda: verify_afd(args.model, layout, batches=batches, gate=args.gate_on_attention,
                                       steps=args.steps, tol=args.tol, policy=args.policy, timeout_s=args.timeout,
                                       decode_steps=args.decode_steps, stages=args.stages,
                                       buckets=TokenBuckets.parse(args.buckets), log=print,
                                       on_progress=progress.rank, program=ep, lowered=args.lowered))


def cmd_demo(args: argparse.Namespace) -> int:
    import tempfile

    import torch

    from .models import build_hf, export_lm
    from .verify import verify_afd

    layout = AFDLayout(2, 1)
    progress = _progress(args)
    print("demo: building a 2-layer HF Llama (hidden 64, random weights, offline) and exporting it")
    with progress.phase("built and exported"):
        ep = export_lm(build_hf("llama", num_layers=2))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "llama.pt2")
        torch.export.save(ep, path)
        loaded, result = _plan(path, layout, False)
        print(plan_table(result, layout).replace(path, "llama (demo)", 1))
        return _verdict(lambda: verify_afd(path, layout, batches=[2, 3], log=print, on_progress=progress.rank,
                                           program=loaded))


EXIT_INTERRUPTED = 130  # (128 + SIGINT, as a shell reports Ctrl-C)


def main(argv: Sequence[str] | None = None) -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse: --help / --version (0) or a bad flag (2, its one line printed)
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    handlers = {"plan": cmd_plan, "rewrite": cmd_rewrite, "verify": cmd_verify, "demo": cmd_demo,
                "profile": cmd_profile}
    stdout = sys.stdout
    if stdout is not None:
        sys.stdout = ClosedTolerant(stdout)  # type: ignore[assignment]
    try:
        with exit_on_sigterm():  # SIGTERM unwinds: temporary folders and the run's processes are removed
            check_mode_flags(args)
            check_arguments(args)
            if args.command in ("plan", "profile"):
                check_estimate_flags(args)
            if args.command in ("verify", "demo"):
                local_process_override()  # (a bad setting is refused before anything is loaded)
            if getattr(args, "imports", None):
                from .programs import import_libraries

                import_libraries(args.imports)
            code = handlers[args.command](args)
            sys.stdout.flush()
            return code
    except AFDCompileError as e:
        print(f"afd-compile {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # Ctrl-C: the run's processes and temporary folders are gone (finally blocks)
        print(f"afd-compile {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as e:  # a file we read or write (the path and the reason, not a traceback)
        print(f"afd-compile {args.command}: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
