"""The portable stage, run: each portable pass of a rank kind's pipeline (``pipeline.PIPELINES``)
has one runner here, and :func:`run` calls the ones a :class:`Work`'s build applies, in the
declared order, timing each.

One convention for every runner: it takes the rank's :class:`Work` and changes it in place (the
graph ``work.gm``, or the field that holds what it built); what it found is on the Work, and a
pass that applies and finds nothing leaves its field empty. ::

    work = Work(Build("afd-ffn", fan_in=2), gm, AFDLayout(2, 1), rank=2)
    run(work)
    # recognise_moe, annotate_roles, plan_split, build_attention_program, build_ffn_program,
    # ffn_tokens_follow_the_carrier, verify_schedule   (stage_programs, ffn_group_program: not applied)
    work.ffn, work.split, work.timings.seconds

What each runner reads and writes of the graph:

- the AFD split's MoE recognition works on a copy (the caller's graph is annotated with
  ``afd.role``, never rewritten), the TP and no-layout recognition on ``work.gm`` itself;
- ``unpack_grouped_projections`` and the roles change ``work.gm`` in place;
- every program built (the split's two, an attention TP program, an FFN group program, each
  stage count's) is a new GraphModule: the split's programs stay as cut in ``work.split``.

``deploy`` is the only caller: it builds a rank's Work and then gives the worker its groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from . import meta_keys
from .config import SplitConfig
from .passes.pipeline import PassTimings
from .passes.tp_rewrite import TP_STEPS, TPWork
from .pipeline import PIPELINES, Build, passes_for

if TYPE_CHECKING:
    from .layout import AFDLayout
    from .passes.ffn_tp import FFNTPProgram
    from .passes.split import SplitPlan, SplitResult
    from .passes.tp_rewrite import TPProgram
    from .scatter import TPLayout


@dataclass
class Work:
    """One rank's program as the portable passes build it. ``rank``: the rank in ``layout`` (an
    AFD layout: its world rank; a TP layout: its TP rank). ``done``: the passes run so far (a
    :func:`fork` carries them: a pass is never run twice on one Work)."""

    build: Build
    gm: fx.GraphModule
    layout: AFDLayout | TPLayout | None = None
    rank: int = 0
    config: SplitConfig = field(default_factory=SplitConfig)
    timings: PassTimings = field(default_factory=PassTimings)
    done: list[str] = field(default_factory=list)
    moe: tuple = ()  # the MoE blocks recognition found (passes/moe MoERecord), recognised or not
    plan: SplitPlan | None = None  # AFD: the cut of each layer
    attention: fx.GraphModule | None = None  # AFD: the rank's attention program (an attention TP rank's)
    ffn: fx.GraphModule | None = None  # AFD: the rank's FFN program (an FFN group rank's)
    split: SplitResult | None = None  # AFD: both programs as cut, schedule checked
    ffn_group: FFNTPProgram | None = None  # an FFN TP / EP group rank's program and what it split
    staged: dict[int, fx.GraphModule] = field(default_factory=dict)  # the rank's program per stage count
    schedule: object = None  # the ping-pong schedule of the staged pair, checked
    static_batch: int | None = None  # a staged program's static batch (a static KV cache)
    tp: TPWork | None = None  # a TP rank: its program as tp_rewrite's steps build it

    @property
    def index(self) -> int:
        """An AFD rank's index within its role (``AFDLayout.role_of``)."""
        return self.layout.role_of(self.rank)[1]  # type: ignore[union-attr]

    def tp_program(self) -> TPProgram:
        """A TP rank's program, its plans and the seconds each pass took."""
        assert self.tp is not None, "the tp pipeline has not run"
        return self.tp.program(self.timings.seconds)


def run(work: Work, *, start_at: str | None = None, until: str | None = None) -> Work:
    """The portable passes ``work.build`` applies, in order, from ``start_at`` through ``until``
    (pass names of its pipeline; None: from the first, through the last); a pass ``work`` has
    run is skipped. Returns ``work``."""
    declared = [p.name for p in PIPELINES[work.build.kind] if p.stage == "portable"]
    for name in (start_at, until):
        if name is not None and name not in declared:
            raise ValueError(f"portable.run: {name!r} is not a portable pass of the {work.build.kind} pipeline")
    first = declared.index(start_at) if start_at else 0
    last = declared.index(until) if until else len(declared) - 1
    for p in passes_for(work.build, "portable"):
        if p.name in work.done or not first <= declared.index(p.name) <= last:
            continue
        with work.timings(p.name):
            _RUNNERS[p.name](work)
        work.done.append(p.name)
    return work


def fork(work: Work, build: Build | None = None, rank: int | None = None) -> Work:
    """A copy of ``work`` to go on as another rank (``rank``) or rank kind (``build``), sharing
    what was built so far: one split (or one prepared TP graph) for several ranks."""
    timings = PassTimings()
    timings.seconds.update(work.timings.seconds)
    return dataclasses.replace(work, build=build or work.build, rank=work.rank if rank is None else rank,
                               timings=timings, done=list(work.done), staged=dict(work.staged))


# --- the AFD split ------------------------------------------------------------------------------------

def _recognise_moe(w: Work) -> None:
    from .passes.graph_utils import copy_graph_module
    from .passes.moe import recognise_moe

    name = w.config.graph_name
    if w.build.kind == "none":
        w.moe = tuple(recognise_moe(w.gm))
    elif w.build.kind == "tp":  # (TP shards the experts: only the recognised op)
        w.moe = tuple(recognise_moe(w.gm, strict=True, graph_name=name))
    else:  # (on a copy: the caller's graph stays as it was; FFN TP / EP groups shard the recognised op only)
        work, _ = copy_graph_module(w.gm)
        w.moe = tuple(recognise_moe(work, strict=w.build.ffn_group > 1, graph_name=name))
        if any(r.op for r in w.moe):
            w.gm = work


def _unpack(w: Work) -> None:
    from .passes.grouped_qkv import unpack_grouped_projections

    unpack_grouped_projections(w.gm)


def _merge_heads(w: Work) -> None:
    from .passes.head_pieces import merge_head_pieces

    done = merge_head_pieces(w.gm)
    if done:
        w.gm.meta[meta_keys.HEAD_PIECES] = w.gm.meta.get(meta_keys.HEAD_PIECES, ()) + tuple(done)


def _roles(w: Work) -> None:
    from .passes.roles import annotate_roles

    annotate_roles(w.gm, w.config.policy, compute_gate_on_attention=w.config.compute_gate_on_attention,
                   graph_name=w.config.graph_name)


def _plan_split(w: Work) -> None:
    from .passes.split import plan_split

    w.plan = plan_split(w.gm, comm_id=w.config.comm_id, graph_name=w.config.graph_name)


def _build_attention(w: Work) -> None:
    from .passes.split import build_attention_program

    assert w.plan is not None
    w.attention = build_attention_program(w.gm, w.plan)


def _build_ffn(w: Work) -> None:
    from .passes.split import build_ffn_program

    assert w.plan is not None
    w.ffn = build_ffn_program(w.gm, w.plan)


def _carrier(w: Work) -> None:
    """An FFN rank fanning in several peers (or an FFN TP group) runs more tokens than the export
    fixed: its per-token program takes any multiple of the static token dims."""
    from .passes.ffn_tokens import StaticTokensError, tokens_follow_the_carrier
    from .passes.split import TOKEN_MULTIPLE, SplitError, propagate_ffn_meta

    assert w.plan is not None and w.ffn is not None
    if w.plan.static_tokens is None:
        return
    try:
        multiple = tokens_follow_the_carrier(w.ffn, f"{w.config.graph_name}: FFN program")
    except StaticTokensError as e:
        raise SplitError(f"{e}; layout {w.layout} has an FFN rank fanning in {w.build.fan_in} attention peers or an "
                         "FFN TP group") from None
    w.ffn.meta[TOKEN_MULTIPLE] = multiple
    propagate_ffn_meta(w.ffn, None, multiple)


def _verify_schedule(w: Work) -> None:
    from .passes.schedule import verify_schedule
    from .passes.split import SplitResult

    assert w.attention is not None and w.ffn is not None and w.plan is not None
    verify_schedule(w.attention, w.ffn)
    w.split = SplitResult(w.attention, w.ffn, w.plan, w.timings.seconds, w.moe)


# --- after the split: an AFD rank's own program -----------------------------------------------------

def _attention_tp(w: Work) -> None:
    """The attention program of an attention TP group's rank: the model sharded over the group
    with every MLP SCATTERED over it (the tp pipeline with dense MLPs data-parallel, no fused
    norm), then cut: o_proj's partial sum reduce-scattered to this rank's slice of the group's
    tokens, the slice it sends. MoE layers (whose SCATTERED mode is expert parallelism inside
    the group) are refused for now."""
    from .layout import LayoutError
    from .passes.graph_utils import propagate_meta_fresh
    from .passes.roles import annotate_roles
    from .passes.router import moe_layers
    from .passes.split import build_attention_program, plan_split
    from .scatter import TPLayout

    layout, split = w.layout, w.split
    assert layout is not None and split is not None
    moe = moe_layers(w.gm, meta_keys.ROLE)
    if moe:
        raise LayoutError(f"AFD layout {layout}: attention TP with MoE layers ({moe}: expert routing) is not supported "
                          "yet; use attn_tp=1 (the FFN side can still be ffn_tp / ffn_ep)")
    attn_tp = layout.attn_tp  # type: ignore[union-attr]
    # (the MoE recognition ran with the split; the TP preparation's other passes run again here)
    sub = run(Work(Build("tp"), w.gm, TPLayout(attn_tp, dense_dp=True), w.index % attn_tp, w.config),
              start_at="merge_head_pieces", until="insert_all_reduces")
    program = sub.tp_program().program
    propagate_meta_fresh(program)  # the MLPs now run on this rank's slice: their shapes change
    annotate_roles(program, w.config.policy, compute_gate_on_attention=w.config.compute_gate_on_attention,
                   graph_name=w.config.graph_name)
    plan = plan_split(program, comm_id=w.config.comm_id, graph_name=w.config.graph_name, attention_only=True)
    if [c.wire_in for c in plan.cuts] != [c.wire_in for c in split.plan.cuts]:
        raise LayoutError(f"AFD layout {layout}: the attention TP program's wire {[str(c.wire_in) for c in plan.cuts]} "
                          f"differs from the FFN program's {[str(c.wire_in) for c in split.plan.cuts]}")
    w.attention = build_attention_program(program, plan)


def _stages(w: Work) -> None:
    """Each number of micro-batches the rank's step can run staged (``deploy.stage_counts``), its
    program built; the pair's ping-pong schedule for the layout checked (a program that cannot be
    staged is refused here, not at a step)."""
    from .passes.stages import check_stage_layout, static_batch, static_rows

    assert w.split is not None and w.attention is not None and w.ffn is not None
    stages, batch = w.build.stages, static_batch(w.split.attention)
    check_stage_layout(w.layout, stages, batch)  # type: ignore[arg-type]
    w.static_batch = batch
    attention, ffn, w.schedule = staged_pair(w.attention, w.ffn, w.layout, stages, batch)
    built = len(static_rows(batch, stages)) if batch is not None else stages
    if built > 1:  # (a static batch of one sequence: nothing to stage)
        own, program = (attention, w.attention) if w.build.kind == "afd-attention" else (ffn, w.ffn)
        w.staged = staged_programs(program, w.build.kind, stages, batch, {built: own})


def _ffn_group(w: Work) -> None:
    """The FFN program of group rank ``index % size`` of its FFN TP / EP group (on a copy: the
    split's stays as cut), each stage count's built again from it."""
    from .passes.ffn_tp import ffn_group_program
    from .passes.graph_utils import copy_graph_module

    layout = w.layout
    assert w.ffn is not None and layout is not None
    w.ffn = copy_graph_module(w.ffn)[0]
    w.ffn_group = ffn_group_program(w.ffn, layout.ffn_tp, layout.ffn_ep,  # type: ignore[union-attr]
                                    w.index % w.build.ffn_group)
    if w.staged:
        w.staged = staged_programs(w.ffn, "afd-ffn", w.build.stages, w.static_batch)


def stage_counts(stages: int, batch: int | None) -> list[int]:
    """The numbers of micro-batches (>= 2) a step can run staged: each of 2..stages over a dynamic
    batch (a step with fewer sequences than stages runs fewer); over a static batch (a static KV
    cache) its fixed micro-batches' count."""
    from .passes.stages import static_rows

    if stages == 1:
        return []
    if batch is not None:
        n = len(static_rows(batch, stages))
        return [n] if n > 1 else []
    return list(range(2, stages + 1))


def staged_programs(program: fx.GraphModule, kind: str, stages: int, batch: int | None,
                    built: dict[int, fx.GraphModule] | None = None) -> dict[int, fx.GraphModule]:
    """``program`` (of rank kind ``kind``) as each number of micro-batches :func:`stage_counts`
    allows, by the number (``built``: ones already made). A static batch's program is built for
    ``stages`` (the pass fixes its micro-batches)."""
    import functools

    from .passes.stages import stage_attention_program, stage_ffn_program

    build: Callable[[fx.GraphModule, int], fx.GraphModule] = (
        stage_attention_program if kind == "afd-attention" else functools.partial(stage_ffn_program, batch=batch))
    out = dict(built or {})
    for k in stage_counts(stages, batch):
        if k not in out:
            out[k] = build(program, stages if batch is not None else k)
    return out


def staged_pair(attention: fx.GraphModule, ffn: fx.GraphModule, layout: Any, stages: int,
                batch: int | None) -> tuple[fx.GraphModule, fx.GraphModule, object]:
    """Both roles' programs of ``stages`` micro-batches and the ping-pong schedule they hold for
    ``layout``, checked: the two programs' transfers stage by stage in one order, every send
    paired with its receive, no deadlock. ``batch``: the static batch of a static KV cache."""
    from .passes.pingpong import check_schedule, schedule_of_programs
    from .passes.schedule import verify_schedule
    from .passes.stages import stage_attention_program, stage_ffn_program

    staged = stage_attention_program(attention, stages), stage_ffn_program(ffn, stages, batch=batch)
    verify_schedule(*staged)
    schedule = schedule_of_programs(layout, *staged)
    check_schedule(schedule)
    return staged[0], staged[1], schedule


# --- a TP rank ------------------------------------------------------------------------------------------

def _tp_step(step: Callable[[TPWork], None]) -> Callable[[Work], None]:
    def run_step(w: Work) -> None:
        if w.tp is None:
            w.tp = TPWork(w.gm, w.layout, w.rank, w.config.graph_name)  # type: ignore[arg-type]
        step(w.tp)
    return run_step


#: each portable pass's runner, by its pipeline name
_RUNNERS: dict[str, Callable[[Work], None]] = {
    "recognise_moe": _recognise_moe,
    "unpack_grouped_projections": _unpack,
    "merge_head_pieces": _merge_heads,
    "annotate_roles": _roles,
    "plan_split": _plan_split,
    "build_attention_program": _build_attention,
    "build_ffn_program": _build_ffn,
    "ffn_tokens_follow_the_carrier": _carrier,
    "verify_schedule": _verify_schedule,
    "attention_tp_program": _attention_tp,
    "stage_programs": _stages,
    "ffn_group_program": _ffn_group,
    **{name: _tp_step(step) for name, step in TP_STEPS.items()},
}
