"""The printed plan of the CLI: the per-layer AFD table, the legends, and the lines for attention
and FFN TP groups and the KV cache (``plan``, ``rewrite``, ``verify`` print them)."""

from __future__ import annotations

from .layout import AFDLayout

#: ``plan --passes``'s help
#: plan's usage line (argparse's own lists every flag: longer than a one-line error wants)
PLAN_USAGE = ("afd-compile plan MODEL.pt2 [-A A -F F [group flags] | --tp T [TP flags]] [--stages S]\n"
              "       [--json | --mermaid [LAYER|ranks] | --passes [DEVICE] | --estimate PROFILE.json "
              "[estimate flags]] [options] (see -h)")
PASSES_HELP = ("print, instead of the plan, the pass pipeline each rank kind of the layout runs on DEVICE, cpu or cuda "
               "(default "
               "cuda), in order: its portable stage (what rewrite writes and verify checks) and its lowering (what "
               "the backend runs on top); decided by the layout and options, not the model, which is not loaded")


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
    cache = cache_line(result)
    groups = [g for g in (attn_tp_line(layout), ffn_tp_line(result, layout)) if g]
    return "\n".join([head, *lines, *groups, *([cache] if cache else [])])


AFD_LEGEND = """\
legend: attention / ffn nodes: the layer's graph nodes in each role; ffn weights: parameters only the FFN
  program holds; to FFN / to attention: what crosses the wire per token at the layer's cut, kind:dtype[width]
  (hidden states, router logits, int32 token ids, the FFN output); bytes/token: to FFN + back"""

TP_LEGEND = """\
legend: per layer the distribution state of the layer's input, attention, MLP, residual after attention and
  output: SCATTERED = each rank holds its own tokens, TP_ATTN_FULL = the attention TP group shares its tokens,
  FULL = every rank of the TP group holds every token (the tokens, not the weights: a FULL MLP under TP still
  has its weights split column/row-parallel); +P: a partial sum pending, +S: the last dim split over the group.
  prepare_attn / prepare_mlp / postprocess_layer: the collective before attention, before the MLP, after the
  layer; inside_mlp: an MoE's all-to-all dispatch and combine"""


def attn_tp_line(layout: AFDLayout | None) -> str | None:
    """What an attention TP group does around each cut, from the state algebra."""
    if layout is None or layout.attn_tp == 1:
        return None
    from .scatter import DistState, ScatterMode, TPLayout, transition

    lay = TPLayout(layout.attn_tp)
    out = transition(DistState(ScatterMode.TP_ATTN_FULL, partial=True), DistState(ScatterMode.SCATTERED), lay)
    back = transition(DistState(ScatterMode.SCATTERED), DistState(ScatterMode.TP_ATTN_FULL), lay)
    groups = [list(g) for g in layout.attention_groups()]
    return (f"attn tp: groups {groups} (one DP group each); per layer {out} (o_proj's sum settled onto this rank's "
            f"slice of the group's tokens, the slice it sends: each token once), {back} before the next attention")


def ffn_tp_line(result, layout: AFDLayout | None) -> str | None:
    """The first FFN rank's group program (``deploy.AFDPlan``: built by the pipeline, so a layout
    the MLP cannot take was refused before anything runs), in one line."""
    prog = getattr(getattr(result, "ffn_rank", None), "ffn_group", None)
    if layout is None or prog is None:
        return None
    return f"ffn {prog.kind}: groups {[list(g) for g in layout.ffn_groups()]}; {prog}"


def cache_json(result) -> dict | None:
    from .passes.graph_utils import state_bytes, written_attrs

    state = written_attrs(result.attention)
    if not state:
        return None
    return {"buffers": sorted(state), "bytes_per_attention_rank": state_bytes(result.attention),
            "bytes_per_ffn_rank": state_bytes(result.ffn)}


def cache_line(result) -> str | None:
    cache = cache_json(result)
    if cache is None:
        return None
    return (f"KV cache: {len(cache['buffers'])} buffers updated in place, {cache['bytes_per_attention_rank']} bytes on "
            f"each attention rank; {cache['bytes_per_ffn_rank']} on each FFN rank")


def mixer_lines(program: object) -> list[str]:
    """``plan``'s line on layers whose token mixer is not attention (hybrid models; none: nothing),
    from the attention program's roles."""
    from .passes.roles import non_attention_layers

    layers = non_attention_layers(program)
    if not layers:
        return []
    return [f"token mixers: layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))} not attention (a "
            "state-space, convolution or linear-attention mixer): run whole on the attention ranks, their state "
            "there as a KV cache is"]


def afd_plan_notes(result: object, layout: object, gate_on_attention: bool) -> list[str]:
    """The lines ``plan`` prints under an AFD plan's table: token mixers, MoE blocks, their placement."""
    moe = result.moe  # type: ignore[attr-defined]
    return mixer_lines(result.attention) + moe_lines(moe) + moe_placement(moe, layout, gate_on_attention)  # type: ignore[attr-defined]


def mixers_json(program: object) -> dict:
    """``plan --json``'s ``non_attention_layers`` (:func:`mixer_lines`), absent when there are none."""
    from .passes.roles import non_attention_layers

    layers = non_attention_layers(program)
    return {"non_attention_layers": layers} if layers else {}


def moe_lines(records: tuple) -> list[str]:
    """One line per MoE block recognition found (``passes/moe``): the form and the op, or why not."""
    if not records:
        return []
    done = sum(1 for r in records if r.op)
    return [f"MoE experts: {done} of {len(records)} blocks recognised as afd::moe_experts"] + \
        [f"  {r}" for r in records]


def moe_placement(records: tuple, layout: object, gate_on_attention: bool) -> list[str]:
    """Where an AFD layout runs the recognised MoE blocks (``plan``'s lines after :func:`moe_lines`):
    the router's side, and which experts each FFN rank holds (all; each expert's slice in an FFN
    TP group; a range of them per rank of an FFN EP group)."""
    experts = sorted({r.experts for r in records if r.op})
    if not experts or layout is None:
        return []
    router = ("  router: on the attention ranks (--gate-on-attention): its logits cross the wire to the FFN ranks"
              if gate_on_attention else "  router: on the FFN ranks (the gate and its top-k run after the receive)")
    parts, f = max(layout.ffn_tp, layout.ffn_ep), layout.ffn_ranks  # type: ignore[attr-defined]
    if layout.ffn_ep > 1:  # type: ignore[attr-defined]
        per = [e // parts for e in experts]
        held = [f"group rank {r} (FFN rank{'s' if f // parts > 1 else ''} "
                f"{', '.join(str(x) for x in range(r, f, parts))}): experts "
                f"{' / '.join(f'{r * n}-{(r + 1) * n - 1}' for n in per)}" for r in range(parts)]
        return [router, f"  experts over FFN EP groups of {parts} (all-to-all per MoE layer): " + "; ".join(held)]
    if layout.ffn_tp > 1:  # type: ignore[attr-defined]
        return [router, f"  experts: every expert on every rank of an FFN TP group of {parts}, each rank its "
                        f"1/{parts} of each expert's intermediate size"]
    return [router, f"  experts: all {' / '.join(map(str, experts))} on each FFN rank"]


def unpacked_lines(gm: object) -> list[str]:
    """What ``plan`` says of the projections ``passes/grouped_qkv.py`` unpacked and the per-head
    pieces ``passes/head_pieces.py`` merged (none: nothing)."""
    from .meta_keys import HEAD_PIECES
    from .passes.grouped_qkv import RECORDS_KEY

    records, merged = gm.meta.get(RECORDS_KEY, ()), gm.meta.get(HEAD_PIECES, ())
    lines = [f"q/k/v packed per KV group: {len(records)} projections unpacked into blocks first"] + \
        [f"  {r}" for r in records] if records else []
    return lines + ([f"per-head modules over the heads split apart: {len(merged)} merged into one first"] +
                    [f"  {r}" for r in merged] if merged else [])


def moe_records(gm: object) -> tuple:
    """The records the MoE recognition left on ``gm`` (none for a graph it has not seen)."""
    from .passes.moe import RECORDS_KEY

    return gm.meta.get(RECORDS_KEY, ())


def stage_schedule(result: object, ep: object) -> dict:
    """The schedule the staged programs of ``result`` (``deploy.AFDPlan``: built and checked by
    the pipeline) hold, and the micro-batches of the saved example of ``ep``, as a record
    (``plan --json`` prints it; :func:`stage_text` renders it)."""
    from .deploy import token_count_for_graph
    from .layout import micro_batches
    from .passes.stages import static_rows
    from .programs import flat_inputs

    rank = result.ffn_rank  # type: ignore[attr-defined]
    stages, fixed = rank.build.stages, rank.static_batch
    inputs = flat_inputs(ep)  # type: ignore[arg-type]
    tokens = token_count_for_graph(result.attention,
                                   result.plan.cuts[0].token_dims)(inputs)  # type: ignore[attr-defined]
    batch = int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 1
    per_seq = tokens // batch if batch else 0
    return {"stages": stages, "schedule": str(rank.schedule).splitlines(), "schedule_checked": True,
            "example": {"sequences": batch, "tokens_per_sequence": per_seq,
                        "tokens_per_stage": [(end - start) * per_seq
                                             for start, end in micro_batches([per_seq] * batch, stages)]},
            "static_batch": fixed, "static_rows": static_rows(fixed, stages) if fixed is not None else None}


def stage_text(stages: dict) -> str:
    ex = stages["example"]
    return "\n".join([
        *stages["schedule"],
        "schedule: checked (every send paired with its receive in order, each micro-batch through the layers in "
        "order, no deadlock on one communication stream per rank)",
        f"micro-batches of the saved example ({ex['sequences']} sequences of {ex['tokens_per_sequence']} tokens): "
        f"tokens per stage {ex['tokens_per_stage']}",
        *([] if stages["static_batch"] is None else [
            f"static batch {stages['static_batch']} (a static KV cache): fixed micro-batches of "
            f"{stages['static_rows']} sequences, each reading and writing its own cache rows"])])


def print_passes(args: object, layout: object) -> int:
    """``plan --passes [DEVICE]``: the pass pipeline of each rank kind of ``layout`` (the flags':
    an ``AFDLayout``, a ``TPLayout`` or None; ``afd_compile.pipeline``), as a table or (``--json``) records. The model
    is not loaded: the lists follow from the layout and options alone; a missing file is still an error (said
    before, by ``cli_checks.check_arguments``)."""
    import json

    from .cli_checks import UsageError
    from .pipeline import builds_for, pipeline_json, pipeline_table

    if getattr(args, "mermaid", None) is not None:
        raise UsageError("--passes prints the pass lists, --mermaid a picture of the plan: give one of them")
    builds = builds_for(layout, args.passes, args.stages)  # type: ignore[attr-defined]
    print(json.dumps(pipeline_json(builds), indent=2) if args.json
          else pipeline_table(builds))  # type: ignore[attr-defined]
    return 0
