"""What rank r of a layout runs: the one place that composes a rank's program, by running the
rank's pipeline (``afd_compile.pipeline`` declares it, ``afd_compile.portable`` runs its portable
stage, ``pipeline.lower`` its lowering).

``make_worker`` (a rank splitting a graph for itself: verify, the backend, torchrun scripts) and
``load_rewritten_worker`` (a rank running what ``afd-compile rewrite`` saved: its remaining pass,
the staged programs, run here; their schedule was checked when rewrite wrote them) build every
program the rank will run, the programs of each number of micro-batch stages included, and hand
them to a worker of :mod:`afd_compile.runtime`, which only runs them. ``plan_afd`` (plan, rewrite,
verify) and ``prepare_tp_graph`` / ``tp_rank_of`` / ``tp_rank_program`` (TP ranks) run the same
passes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sympy
import torch
import torch.distributed as dist
import torch.fx as fx

from .buckets import TokenBuckets
from .comm import AFDCommunicator, communicator_for, register_communicator, wire_checks_from_env
from .layout import AFDLayout
from .limits import MAX_RANKS, bounded_int
from .meta_keys import TOKEN_MULTIPLE
from .passes.graph_utils import batch_symbol_dims
from .passes.stages import static_batch
from .passes.symbolic import sym_expr
from .pipeline import Build, builds_for, lower
from .portable import Work, fork, run, staged_programs
from .runtime import (
    AttentionWorker,
    FFNWorker,
    GroupSlice,
    TokenCount,
    TPRank,
    control_group,
    group_key,
    process_group,
)
from .runtime.pad_batch import BatchPad
from .runtime.slots import GroupAgreement, check_fixed_slot
from .runtime.slots import prepare as prepare_slots
from .scatter import TPLayout
from .split_api import SplitConfig

if TYPE_CHECKING:
    from .passes.moe import MoERecord
    from .passes.split import SplitPlan, SplitResult
    from .passes.tp_rewrite import TPProgram

#: token buckets are on by default (a serving user should not have to know)
DEFAULT_BUCKETS = TokenBuckets()


def token_count_for_graph(gm: fx.GraphModule, token_dims: Sequence[str]) -> TokenCount:
    """A step's :class:`~afd_compile.runtime.TokenCount` from the plan's token dims (sympy
    expressions over the graph's input symbols)."""
    where: dict[str, tuple[int, int]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, n in enumerate(placeholders):
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                e = sym_expr(size)
                if e.is_Symbol and str(e) not in where:
                    where[str(e)] = (i, d)
    total = sympy.expand(sympy.Mul(*[sympy.sympify(t) for t in token_dims]))
    coeff, rest = total.as_coeff_Mul()
    dims = []
    for factor in sympy.Mul.make_args(rest):
        if factor == 1:
            continue
        if not factor.is_Symbol or str(factor) not in where:
            raise ValueError(f"token count {total}: factor {factor} is not an input dimension")
        dims.append(where[str(factor)])
    return TokenCount(tuple(dims), int(coeff))


@dataclass
class RankProgram:
    """What rank ``rank`` of a layout runs: an AFD ``worker`` (attention or FFN, its programs of
    every stage count built) or a TP rank's program (``tp``: the sharded program and its plans)."""

    rank: int
    role: str  # "attention", "ffn" or "tp"
    worker: AttentionWorker | FFNWorker | None = None
    tp: TPProgram | None = None


def build_rank(gm: fx.GraphModule, layout: AFDLayout | TPLayout, rank: int, config: SplitConfig | None = None,
               **afd_options: Any) -> RankProgram:
    """The one answer to "what does rank ``rank`` of ``layout`` run": an AFD layout's worker
    (:func:`make_worker`, ``afd_options`` its keyword arguments) or a TP layout's rank program
    (:func:`tp_rank_program`)."""
    if isinstance(layout, TPLayout):
        if afd_options:
            raise TypeError(f"build_rank: options {sorted(afd_options)} apply to an AFD layout, not {layout}")
        return RankProgram(rank, "tp", tp=tp_rank_program(gm, layout, rank, config))
    worker = make_worker(gm, layout, rank, config, **afd_options)
    return RankProgram(rank, "ffn" if isinstance(worker, FFNWorker) else "attention", worker=worker)


@dataclass(frozen=True)
class AFDPlan:
    """What ``plan`` / ``rewrite`` / ``verify`` print and check before anything runs: the split
    (``split``: both programs as cut) and the portable stage of the layout's first attention rank
    and first FFN rank (``attention_rank`` / ``ffn_rank``: their attention TP program, FFN group
    program, staged programs and ping-pong schedule, as a worker of that rank builds them)."""

    split: SplitResult
    attention_rank: Work
    ffn_rank: Work

    @property
    def attention(self) -> fx.GraphModule:
        return self.split.attention

    @property
    def ffn(self) -> fx.GraphModule:
        return self.split.ffn

    @property
    def plan(self) -> SplitPlan:
        return self.split.plan

    @property
    def moe(self) -> tuple:
        return self.split.moe

    @property
    def timings(self) -> dict[str, float]:
        """Seconds per pass: the split's, then the ranks' own (attention TP, stages, FFN group)."""
        return {**self.split.timings, **self.attention_rank.timings.seconds, **self.ffn_rank.timings.seconds}


def plan_afd(ep: torch.export.ExportedProgram, layout: AFDLayout | None, config: SplitConfig,
             stages: int = 1) -> AFDPlan:
    """The split of ``ep`` (its inputs flat, in the program's order) for ``layout`` (None: one
    attention rank and one FFN rank), then the first attention rank's and first FFN rank's
    portable stage with ``stages`` micro-batches: a layout the model cannot take is refused here,
    not on a rank."""
    from .programs import fresh_module

    layout = layout or AFDLayout(1, 1)
    attention_build, ffn_build = builds_for(layout, "cpu", stages)
    ffn = run(Work(ffn_build, fresh_module(ep), layout, 0, config), until="verify_schedule")
    assert ffn.split is not None
    attention = run(fork(ffn, attention_build, rank=layout.ffn_ranks))
    return AFDPlan(ffn.split, attention, run(ffn))


def prepare_tp_graph(gm: fx.GraphModule, layout: TPLayout, config: SplitConfig | None = None) -> Work:
    """``gm`` ready for any rank of a TP layout, in place: the tp pipeline through its roles (MoE
    recognised strictly, grouped projections unpacked, roles); then :func:`tp_rank_of` per rank."""
    return run(Work(builds_for(layout, "cpu")[0], gm, layout, 0, config or SplitConfig()), until="annotate_roles")


def tp_rank_of(prepared: Work, rank: int, fuse_norm: bool = True) -> TPProgram:
    """Rank ``rank``'s program from a graph :func:`prepare_tp_graph` prepared (its plans, the
    seconds each pass took); ``fuse_norm``: False stops before it."""
    return run(fork(prepared, rank=rank), until=None if fuse_norm else "insert_all_reduces").tp_program()


def no_layout_program(gm: fx.GraphModule, build: Build) -> list[MoERecord]:
    """A process with no layout: the portable stage of its pipeline on ``gm``, in place (the MoE
    recognition where ``build`` says, else nothing); the blocks' records."""
    if build.kind != "none":
        raise ValueError(f"no_layout_program: a {build.kind} build has a layout")
    return list(run(Work(build, gm)).moe)


def tp_rank_program(gm: fx.GraphModule, layout: TPLayout, rank: int, config: SplitConfig | None = None, *,
                    fuse_norm: bool = True, graph_name: str | None = None) -> TPProgram:
    """Rank ``rank`` of a TP layout: the tp pipeline's portable stage on ``gm`` (its MoE blocks
    recognised and its roles annotated in place, then the sharded program).
    ``graph_name``: the name messages give the graph (default: the config's)."""
    import dataclasses

    config = config or SplitConfig()
    if graph_name is not None:
        config = dataclasses.replace(config, graph_name=graph_name)
    return tp_rank_of(prepare_tp_graph(gm, layout, config), rank, fuse_norm)


def tp_rank_lowered(gm: fx.GraphModule, layout: TPLayout, rank: int, config: SplitConfig, device: torch.device,
                    lowering: Build, examples: Sequence[Any] = ()) -> tuple[fx.GraphModule, Build, tuple]:
    """Rank ``rank`` of a TP layout as the backend runs it: :func:`tp_rank_program` on ``device``
    (with DP attention, checked on ``examples`` to run for any token total of the other groups),
    then its lowering stage (``lowering``, given the rank's sharded KV caches). Returns the
    program, the build it was lowered by and the caches held as the rank's slice
    (``local_state.HeldState``: the caller binds HF's full-size placeholders to them)."""
    import dataclasses

    from .passes.tp_rewrite import check_any_token_total

    tp = tp_rank_program(gm, layout, rank, config)
    program = tp.program.to(device)
    if layout.attn_dp > 1:
        check_any_token_total(program, list(examples), f"rank {rank}")
    build = dataclasses.replace(lowering, states=tuple(s.node for s in tp.shards.states))
    records = lower(program, build, log_as=f"rank {rank} tp")
    return program, build, tuple(records.get("hold_local_states", ()))


def make_worker(gm: fx.GraphModule, layout: AFDLayout, rank: int, config: SplitConfig | None = None,
                device: torch.device | None = None, group: dist.ProcessGroup | None = None,
                check_wire: bool | None = None, stages: int = 1, symm_mem: bool = True,
                buckets: TokenBuckets | None = DEFAULT_BUCKETS,
                before_groups: Callable[[], dist.ProcessGroup | None] | None = None,
                lowering: Build | None = None,
                wrap: Callable[[fx.GraphModule], Callable[..., Any]] | None = None,
                finish_at_shutdown: bool = False) -> AttentionWorker | FFNWorker:
    """Rank ``rank``'s worker: its programs built first (:func:`rank_work`: the rank's pipeline,
    its portable stage, then ``lowering``'s), then its groups and communicator, then the worker,
    constructed once, whole. Registers the communicator under config.comm_id (an attention rank
    reuses the one registered there when it matches: :func:`communicator_for`).
    ``check_wire``: header checks on every transfer (None: ``AFD_CHECK_WIRE``; see AFDCommunicator).
    ``stages``: micro-batches per step (passes/stages.py); every rank of the layout the same.
    ``symm_mem``: an FFN or attention TP group on CUDA all-reduces small messages over symmetric
    memory where it can (symm_mem.py); False: NCCL.
    ``buckets``: an attention rank's tokens cross the wire in bucket slots (buckets.py), and an
    FFN rank's rows are padded to the bucket of their total, so its programs are one per bucket, not
    per exact count; None: exact counts.
    ``before_groups``: called once this rank's programs are built, before any process group is
    made (the backend's agreement of every rank: one that refused its programs stops the others
    here); a group it returns carries the exchange instead of ``group``.
    ``lowering``: this rank's build (``afd_compile.pipeline``: the backend; ``verify --lowered``):
    every program the worker holds goes through its lowering stage too; None: the portable
    programs, as ``rewrite`` writes them.
    ``wrap``: how each of the worker's programs runs (the backend compiles it: ``AttentionWorker.wrap``);
    None: the FX program.
    ``finish_at_shutdown``: an attention rank's ``runtime.shutdown()`` tells its FFN rank it is
    done if ``runtime.finish()`` was not called (the backend's, under ``generate()``)."""
    config = config or SplitConfig()
    role, idx = layout.role_of(rank)
    work = rank_work(gm, layout, rank, config, stages, lowering)
    counter: TokenCount | GroupSlice | None = None
    if role == "ffn":
        assert work.ffn is not None
        static = not ffn_bucket_fields(work.ffn, TokenBuckets())
    else:
        assert work.attention is not None and work.plan is not None
        counter = token_count_for_graph(work.gm, work.plan.cuts[0].token_dims)
        static = False  # (a static count sends its slot as any other)
    slot = check_fixed_slot(buckets, rank=rank, ffn_static_rows=static)
    if before_groups is not None:
        group = before_groups() or group
    groups, attn_groups, control, ffn_controls = layout_groups(layout, *group_key(group))
    device = device or torch.device("cpu")
    check = wire_checks_from_env() if check_wire is None else check_wire
    if role == "ffn":
        assert work.ffn is not None
        comm = communicator_for("ffn", rank, layout.peers_of_ffn(idx), group, check, config.comm_id, control)
        prepare_slots(comm, slot, device, lowering=lowering)
        size = layout.ffn_group_size
        in_group = ffn_group_fields(layout, idx, groups, ffn_controls, device, symm_mem) if size > 1 else {}
        if in_group and slot is not None:  # (every group rank's rows: a slot per peer; agreed in band)
            in_group["slot_group"] = GroupAgreement(in_group["ffn_group"], tuple(
                slot * len(layout.peers_of_ffn(f)) for f in layout.ffn_group(idx)), device)
        program, by_stages = lowered(work.ffn, work.staged, device, lowering, rank)
        return FFNWorker(program, comm, device, stages=stages, static_batch=work.static_batch, staged=by_stages,
                         wrap=wrap, **in_group, **ffn_bucket_fields(work.ffn, None if slot else buckets))
    assert counter is not None and work.split is not None
    if layout.attn_tp > 1:
        from .comm import GROUP_ATTN_TP, GROUP_TP, register_group
        from .symm_mem import prepare_groups

        own = attn_groups[idx // layout.attn_tp]
        for gid in (GROUP_TP, GROUP_ATTN_TP):
            register_group(gid, own)
        prepare_groups({GROUP_TP: own, GROUP_ATTN_TP: own}, device, symm_mem)
        counter = GroupSlice(counter, layout.attn_tp, idx % layout.attn_tp)
    # one communicator per comm id, shared by every graph of this rank (prefill, decode)
    comm = communicator_for("attention", rank, (layout.ffn_of_attention(idx),), group, check, config.comm_id,
                            control, finish_at_shutdown)
    program, by_stages = lowered(work.attention, work.staged, device, lowering, rank)
    wire = _prepare_attention_slots(comm, slot, device, program, by_stages, lowering, stages, work.static_batch)
    return AttentionWorker(program, comm, counter, stages=stages, batch_dim=_stage_batch_dim(work.split.attention,
                                                                                            stages),
                           static=work.static_batch is not None, staged=by_stages, wrap=wrap,
                           batch_pad=_stage_pad(program, slot, stages), **wire,
                           **attention_bucket_fields(counter, None if slot else buckets))


def _prepare_attention_slots(comm: AFDCommunicator, slot: int | None, device: torch.device, program: fx.GraphModule,
                             by_stages: dict[int, fx.GraphModule], lowering: Build | None, stages: int,
                             batch: int | None) -> dict[str, Any]:
    """An attention rank's fixed slot (``slots.prepare``; None: nothing), its worker's fields: over
    a static batch of fewer sequences than stages its program has fewer micro-batches, and the
    others cross in zeros (ghost stages)."""
    from .passes.stages import static_rows

    real = len(static_rows(batch, stages)) if batch is not None and batch < stages else stages
    schedule, ghosts = prepare_slots(comm, slot, device, by_stages.get(real, program), lowering, stages, real)
    return {"wire": schedule, "ghosts": ghosts, "real_stages": real} if slot is not None else {}


def batch_pad(program: fx.GraphModule, buckets: TokenBuckets, static: Sequence[int] = ()) -> BatchPad | str:
    """Where ``program``'s batch is, to pad it to ``buckets`` (runtime/pad_batch.py), or why it
    cannot be padded (a static batch; an input it updates in place, a KV cache, holds it)."""
    from .passes.graph_utils import batch_symbol_dims

    key, dims = batch_symbol_dims(program)
    if key is None:
        return "its batch is static"
    if any(i in static for i, _ in dims):
        return "an input it updates in place (a KV cache) holds the batch"
    out = next(n for n in program.graph.nodes if n.op == "output").args[0]
    carried = []
    for j, node in enumerate(out if isinstance(out, (list, tuple)) else [out]):
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if isinstance(val, torch.Tensor):
            carried += [(j, d) for d, size in enumerate(val.shape) if isinstance(size, torch.SymInt)
                        and str(size.node.expr) == key]
    return BatchPad(buckets, tuple(dims), tuple(carried))


def _stage_pad(program: fx.GraphModule, slot: int | None, stages: int) -> BatchPad | None:
    """A fixed slot's staged attention worker: its batch padded to one sequence a stage when it
    has fewer (every stage crosses)."""
    if slot is None or stages == 1:
        return None
    pad = batch_pad(program, TokenBuckets((stages,)))
    return pad if isinstance(pad, BatchPad) else None


def rank_work(gm: fx.GraphModule, layout: AFDLayout, rank: int, config: SplitConfig, stages: int = 1,
              build: Build | None = None) -> Work:
    """Rank ``rank``'s portable stage on ``gm`` (``build``: the rank's, as :func:`pipeline.rank_build`
    gives it; None: for the CPU): the split (an attention rank's without the layout's fan-in: its
    program may have a static token count, a decode graph of a static cache), then the rank's own
    passes (attention TP, stages, FFN group)."""
    from .passes.stages import check_stages
    from .pipeline import rank_build

    check_stages(stages)
    want = rank_build(layout, rank, stages)
    if build is None:
        build = want
    elif (build.kind, build.stages) != (want.kind, want.stages):
        raise ValueError(f"make_worker: rank {rank} of {layout} with {stages} stages is an {want.kind} rank; the "
                         f"build given is an {build.kind} one of {build.stages} stages")
    return run(Work(build, gm, layout, rank, config))


def ffn_group_fields(layout: AFDLayout, idx: int, groups: list[dist.ProcessGroup],
                     controls: list[dist.ProcessGroup], device: torch.device, symm_mem: bool) -> dict[str, Any]:
    """FFN rank ``idx`` of an FFN TP / EP group: the group registered and prepared, and the
    worker's group fields (its program is the group's: the pipeline's ``ffn_group_program``)."""
    from .comm import GROUP_FFN_TP, register_group
    from .symm_mem import prepare_groups

    size = layout.ffn_group_size
    register_group(GROUP_FFN_TP, groups[idx // size])
    prepare_groups({GROUP_FFN_TP: groups[idx // size]}, device, symm_mem)
    return {"ffn_group": groups[idx // size], "ffn_control_group": controls[idx // size], "group_rank": idx % size,
            "group_size": size, "group_input": layout.ffn_tp > 1}


def lowered(program: fx.GraphModule, staged: dict[int, fx.GraphModule], device: torch.device,
            lowering: Build | None, rank: int) -> tuple[fx.GraphModule, dict[int, fx.GraphModule]]:
    """A worker's programs (the unstaged one and each stage count's) on ``device``, each through
    ``lowering``'s lowering stage (``pipeline.lower``, in place; what each pass did logged; None:
    as built)."""
    program, staged = program.to(device), {k: p.to(device) for k, p in staged.items()}
    if lowering is not None:
        for k, prog in [(1, program), *sorted(staged.items())]:
            lower(prog, lowering, log_as=f"rank {rank} {lowering.kind}" + (f" ({k} stages)" if k > 1 else ""))
    return program, staged


def layout_groups(layout: AFDLayout, ranks: Sequence[int], timeout_s: float | None = None) -> tuple[
        list[dist.ProcessGroup], list[dist.ProcessGroup], dist.ProcessGroup, list[dist.ProcessGroup]]:
    """Every process group the ranks of ``layout`` use when the group over ``ranks`` (made with
    ``timeout_s``: runtime.group_key names it) carries the AFD exchange: its FFN groups, its
    attention TP groups, the gloo group the control messages travel on beside the exchange's
    (runtime.control_group), and one beside each FFN group for its token counts. Collective:
    every rank of the world calls it in the same order (each group is made once per process and
    reused)."""
    ffn = [process_group(g) for g in layout.ffn_groups()]
    attn = [process_group(g) for g in layout.attention_groups()]
    ffn_controls = [control_group(g) for g in layout.ffn_groups()]
    return ffn, attn, control_group(ranks, timeout_s), ffn_controls


def ffn_bucket_fields(program: fx.GraphModule, buckets: TokenBuckets | None) -> dict[str, Any]:
    """An FFN worker's token buckets when its program takes any token count (a symbolic carrier):
    each stage's rows are its tokens padded to a bucket, in units of what every token count of the
    program is a multiple of. A program of static tokens keeps its exact rows (no fields)."""
    ph = next((n for n in program.graph.nodes if n.op == "placeholder"), None)
    val = ph.meta.get("val") if ph is not None else None
    if buckets is None or not isinstance(val, torch.Tensor) or isinstance(val.shape[0], int):
        return {}
    unit = program.meta.get(TOKEN_MULTIPLE) or int(sym_expr(val.shape[0]).as_coeff_Mul()[0])
    return {"buckets": buckets, "token_unit": max(int(unit), 1)}


def attention_bucket_fields(count_tokens: TokenCount | GroupSlice, buckets: TokenBuckets | None) -> dict[str, Any]:
    """An attention worker's token buckets when its token count changes (a dims term in its
    count); a static count never changes and keeps its exact size (no fields). The slot is counted
    in units of the count's static factor (a static batch: the FFN program views its tokens per
    sequence)."""
    count = count_tokens.total if isinstance(count_tokens, GroupSlice) else count_tokens
    if not isinstance(count, TokenCount) or not count.dims or (isinstance(count_tokens, GroupSlice)
                                                                and count.factor != 1):
        return {}
    return {"buckets": buckets, "slot_unit": count.factor}


def _stage_batch_dim(program: fx.GraphModule, stages: int) -> tuple[int, int] | None:
    """(input, dim) of the batch that micro-batch stages split: the dynamic batch symbol's first
    place, or a static batch's (the first input's dim 0); None with one stage."""
    if stages == 1:
        return None
    dims = batch_symbol_dims(program)[1]
    return dims[0] if dims else (0, 0)


def load_rewritten_worker(outdir: str, rank: int, device: torch.device | None = None,
                          buckets: TokenBuckets | None = DEFAULT_BUCKETS,
                          group: dist.ProcessGroup | None = None,
                          lowering: Build | None = None) -> AttentionWorker | FFNWorker:
    """This rank's worker from the files ``afd-compile rewrite`` wrote (plan.json + role .pt2),
    exchanging on ``group`` (None: the world); ``lowering`` as :func:`make_worker`'s. With the process group joined,
    every rank of the world calls it in the same order: the gloo group its control messages travel on beside
    ``group`` is made collectively (runtime.control_group).

    plan.json is checked field by field and each program against the sha256 it records
    (:func:`afd_compile.saved.read_saved_plan`): a folder runs only the programs rewrite wrote
    into it. A ``.pt2`` is code (torch unpickles it): load only folders you trust."""
    from .programs import ProgramLoadError, load_program
    from .saved import check_saved_program, read_saved_plan

    bounded_int("load_rewritten_worker: rank", rank, 0, MAX_RANKS - 1)
    plan = read_saved_plan(outdir)
    if plan.kind != "afd":
        raise ProgramLoadError(f"{outdir}: plan.json was written by rewrite --tp (layout {plan['layout']}): load "
                               "its ranks with afd_compile.deploy.load_rewritten_rank, not as an AFD deployment")
    layout = AFDLayout(plan["layout"]["attention_ranks"], plan["layout"]["ffn_ranks"])
    role, idx = layout.role_of(rank)
    device = device or torch.device("cpu")
    comm_id = int(plan["comm_id"])
    # rewrite --stages S saves the unstaged programs and S; the staged ones are built here
    stages = int(plan.get("stages", 1))
    control = control_group(*group_key(group)) if dist.is_initialized() else None
    if role == "ffn":
        comm = AFDCommunicator("ffn", rank, layout.peers_of_ffn(idx), group, control_group=control)
        register_communicator(comm, comm_id)
        program = load_program(plan.path("ffn")).module()
        check_saved_program(plan, "ffn", program)
        # what every token count is a multiple of (a static sequence or batch): the saved program checks it
        # (a guard), and node meta does not survive the save
        program.meta[TOKEN_MULTIPLE] = int(plan["token_count"]["factor"])
        batch = plan.get("static_batch")
        slot = check_fixed_slot(buckets, rank=rank, ffn_static_rows=not ffn_bucket_fields(program, TokenBuckets()))
        prepare_slots(comm, slot, device, lowering=lowering)
        fields = ffn_bucket_fields(program, None if slot else buckets)
        program, by_stages = lowered(program, staged_programs(program, "afd-ffn", stages, batch), device,
                                     lowering, rank)
        return FFNWorker(program, comm, device, stages=stages, static_batch=batch, staged=by_stages, **fields)
    comm = AFDCommunicator("attention", rank, (layout.ffn_of_attention(idx),), group, control_group=control)
    register_communicator(comm, comm_id)
    program = load_program(plan.path("attention")).module()
    check_saved_program(plan, "attention", program)
    batch = static_batch(program) if stages != 1 else None
    counter, batch_dim = TokenCount.from_json(plan["token_count"]), _stage_batch_dim(program, stages)
    slot = check_fixed_slot(buckets, rank=rank)
    program, by_stages = lowered(program, staged_programs(program, "afd-attention", stages, batch), device,
                                 lowering, rank)
    wire = _prepare_attention_slots(comm, slot, device, program, by_stages, lowering, stages, batch)
    return AttentionWorker(program, comm, counter, stages=stages, batch_dim=batch_dim, static=batch is not None,
                           staged=by_stages, batch_pad=_stage_pad(program, slot, stages), **wire,
                           **attention_bucket_fields(counter, None if slot else buckets))


def load_rewritten_rank(outdir: str, rank: int, device: torch.device | None = None,
                        buckets: TokenBuckets | None = DEFAULT_BUCKETS) -> AttentionWorker | FFNWorker | TPRank:
    """Rank ``rank`` of what ``afd-compile rewrite`` wrote into ``outdir``, whichever kind:
    an AFD folder's worker (:func:`load_rewritten_worker`), or a TP folder's rank program with
    the process groups its collectives name created and registered (every rank of the layout
    calls this, in the same order: groups are created collectively), run as a
    :class:`~afd_compile.runtime.TPRank` (with attention DP groups each call first exchanges the
    groups' token counts). Needs the process group joined (``init_distributed`` or ``run_local``)."""
    from .programs import ProgramLoadError, load_program
    from .runtime import register_tp_groups, tp_groups
    from .saved import read_saved_plan

    bounded_int("load_rewritten_rank: rank", rank, 0, MAX_RANKS - 1)
    plan = read_saved_plan(outdir)
    if plan.kind == "afd":
        return load_rewritten_worker(outdir, rank, device, buckets)
    layout = plan.layout()
    world = dist.get_world_size() if dist.is_initialized() else None
    if world is None or world < layout.tp or not 0 <= rank < layout.tp:
        raise ProgramLoadError(f"{outdir}: a TP layout of {layout.tp} ranks needs rank in [0, {layout.tp}) of a joined "
                               f"process group of at least {layout.tp} processes (rank {rank}, world {world})")
    register_tp_groups(tp_groups(world, [layout]), layout, rank)
    program = load_program(plan.path(f"rank{rank}")).module().to(device or torch.device("cpu"))
    return TPRank(program, layout, rank)
