"""Run the original program and the split or sharded deployment on local gloo processes and compare.

Every process loads the same ``.pt2`` and builds its own rank's program. Each attention rank (AFD)
or attention DP group (TP) gets its own batch size (the saved example input resized along its
batch dimension), runs ``steps`` steps (the sizes rotate between steps so every FFN rank sees
several token layouts), and compares its output with the original program run on the same input
in the same process. Error measure: per output, each element's error relative to its own size
floored at the tensor's 90th-percentile magnitude, max over elements and steps
(:func:`afd_compile.compare.rel_err`). Every input differs per rank and step (float inputs too:
:func:`vary_inputs`), and a layout feature no step would exercise (fan-in, stages) is refused
before anything runs (:func:`check_exercised`).

A verdict is only given on something compared: the inputs are checked before any process starts
(:func:`check_verify_inputs`, one path for AFD and TP), a NaN or Inf in any output fails the run
naming the rank, step and output, and a run that compared nothing is an error, never an OK.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .buckets import TokenBuckets
from .compare import Comparison, compare
from .deploy import DEFAULT_BUCKETS, layout_groups, load_rewritten_worker, make_worker
from .layout import AFDLayout
from .limits import MAX_STAGES
from .passes.graph_utils import batch_symbol_dims
from .passes.roles import POLICIES
from .pipeline import LOWERED_KEY, rank_build
from .programs import flat_inputs, fresh_module, load_program, positional_module
from .runtime import (
    AttentionWorker,
    TPRank,
    group_key,
    process_group,
    progress,
    run_local,
    tp_groups,
)
from .scatter import TPLayout
from .split_api import SplitConfig
from .verify_inputs import (  # noqa: F401  (re-exported: the checks a verify request passes first)
    LOW_PRECISION_TOL,
    DecodeSpec,
    ProgramFacts,
    VerifyInputError,
    VerifyInputs,
    check_decode_steps,
    check_exercised,
    check_verify_inputs,
    default_tolerance,
    output_dtypes,
    position_input,
    resize_inputs,
    shift_token_ids,
    unit_batch,
    vary_inputs,
)

log = logging.getLogger("afd_compile.verify")

#: the communication timeout of a verify run (seconds a rank waits for a peer before failing)
DEFAULT_TIMEOUT_S = 300.0


@dataclass
class Tally:
    """One rank's comparisons over its steps: the worst error, how many steps compared
    something, and the first problem (non-finite output, shape mismatch) with its step."""

    max_rel_err: float = 0.0
    compared: int = 0
    problem: str | None = None

    def add(self, step: int, c: Comparison) -> None:
        self.compared += c.values > 0 or c.problem is not None  # a NaN output was examined: a FAIL, not nothing
        self.max_rel_err = max(self.max_rel_err, c.max_rel_err)
        if c.problem is not None and self.problem is None:
            self.problem = f"step {step}: {c.problem}"

    def to_json(self) -> dict:
        return {"max_rel_err": self.max_rel_err, "compared": self.compared, "problem": self.problem}


@dataclass(frozen=True)
class Case:
    """One verification: a saved program, a layout, batch sizes per attention rank (None: as
    saved), the router side and the number of steps."""

    path: str
    layout: AFDLayout
    batches: tuple[int, ...] | None = None
    gate: bool = False
    steps: int = 2
    policy: str = "default"
    decode_steps: int = 0  # a program with a KV cache: a prefill, then this many decode steps
    stages: int = 1  # micro-batches per step (passes/stages.py)
    buckets: TokenBuckets | None = DEFAULT_BUCKETS  # the attention ranks' wire slots (buckets.py); None: exact
    saved: str | None = None  # a folder written by ``afd-compile rewrite`` (AFD): run its programs
    lowered: bool = False  # each rank's programs through its pipeline's lowering stage (on the CPU)


#: programs :func:`preload_programs` loaded in the launcher of a local run, before the ranks
#: were forked from it (path -> what :func:`_load` returns)
_PRELOADED: dict[str, tuple] = {}


def _load(path: str) -> tuple:
    ep = load_program(path)
    return ep, positional_module(ep), flat_inputs(ep), DecodeSpec.of(ep)


def preload_programs(paths: Sequence[str]) -> None:
    """Load each program once in the launcher of a local run (``run_local(preload=...)``): the
    ranks forked from it find them in memory (loading is seconds of CPU per program and process).
    A program that fails to load is left out: the ranks load it themselves and report the error
    as they would without the preload."""
    for path in dict.fromkeys(paths):
        try:
            _PRELOADED[path] = _load(path)
        except Exception as e:
            log.debug("preload of %s failed (%s): the ranks load it themselves", path, e)


def _loaded(path: str, cache: dict) -> tuple:
    """(program, a reference module, example inputs), loaded once per process and path (or
    preloaded: :func:`preload_programs`); the reference of a program with a KV cache is fresh
    per call (its own cache)."""
    if path not in cache:
        cache[path] = _PRELOADED[path] if path in _PRELOADED else _load(path)
    ep, original, inputs, spec = cache[path]
    return ep, (fresh_module(ep) if spec is not None else original), inputs, spec


def _step_inputs(inputs: Sequence[torch.Tensor], spec: DecodeSpec | None, decode_steps: int,
                 batches: Sequence[int] | None, dims: list, unit: int, step: int) -> tuple[torch.Tensor, ...]:
    """One step's inputs for ``unit`` (an attention rank or DP group)."""
    if decode_steps:
        return spec.inputs(inputs, step, salt=7 * unit)
    if batches is None:  # the saved shapes, the values still differing per unit and step
        return vary_inputs(inputs, inputs, salt=7 * unit + step)
    return resize_inputs(inputs, dims, unit_batch(batches, unit, step), salt=7 * unit + step)


def _run_case(rank: int, case: Case, group: object, cache: dict) -> dict:
    ep, original, inputs, spec = _loaded(case.path, cache)
    config = SplitConfig(compute_gate_on_attention=case.gate, policy=POLICIES[case.policy], graph_name=case.path)
    report = progress if rank == case.layout.ffn_ranks else (lambda _text: None)  # the first attention rank
    report(f"{case.layout.world_size} processes up (torch imported, process group formed)")
    lowering = None
    if case.lowered:  # (what the backend runs on a CPU rank, its Inductor lowering aside: verify runs FX)
        lowering = rank_build(case.layout, rank, case.stages, inductor=False,
                              fixed_slot=case.buckets is not None and case.buckets.fixed)
    if case.saved is not None:  # what `rewrite` wrote (plan.json and the programs' sha256 checked)
        worker = load_rewritten_worker(case.saved, rank, buckets=case.buckets, group=group, lowering=lowering)
    else:
        worker = make_worker(fresh_module(ep), case.layout, rank, config, group=group, check_wire=True,
                             stages=case.stages, buckets=case.buckets, lowering=lowering)
    lowered = {name: len(r) if isinstance(r, (list, tuple)) else r
               for name, r in worker.program.meta.get(LOWERED_KEY, {}).items()}
    if not isinstance(worker, AttentionWorker):
        return {"role": "ffn", "steps": worker.serve(), "layouts": sorted(map(repr, worker.layouts)),
                "carriers": sorted(worker.carriers), "control_reads": worker.control_reads,
                "device_reads": worker.device_reads, "lowered": lowered}
    a = case.layout.role_of(rank)[1] // case.layout.attn_tp  # an attention TP group shares its tokens
    _, dims = batch_symbol_dims(original)
    tally, sizes = Tally(), []
    steps = 1 + case.decode_steps if case.decode_steps else case.steps
    report("programs built")
    # (a step that raises is reported as it is, at once: no STOP after it, which the FFN rank, mid-step,
    # would not hear: this rank would wait on it until the timeout and report that instead)
    for step in range(steps):
        x = _step_inputs(inputs, spec, case.decode_steps, case.batches, dims, a, step)
        sizes.append(int(x[0].shape[0]) if x[0].dim() else 0)
        with torch.no_grad():
            out = worker.step(*x)
            if out is not None:  # (zero tokens this step: nothing to compare)
                tally.add(step, compare(out, original(*x)))
        report(f"step {step + 1}/{steps} done")
    worker.stop()
    stages = dict(sorted(worker.comm.stage_transfers.items()))
    return {"role": "attention", "batches": sizes, "stage_transfers": stages, "bytes_sent": worker.comm.bytes_sent,
            "lowered": lowered, **tally.to_json()}


def _verify_cases(rank: int, world: int, cases: Sequence[Case]) -> list[dict | None]:
    """Run every case on one set of processes: case c uses world ranks [0, its world size)
    through its own process group; the other ranks wait at a barrier."""
    import torch.distributed as dist

    sizes = sorted({c.layout.world_size for c in cases})
    groups = {w: (dist.group.WORLD if w == world else process_group(range(w))) for w in sizes}
    for c in cases:  # the groups of every case, made by every rank (new_group is collective)
        if isinstance(c.layout, AFDLayout):
            w = c.layout.world_size  # (a rank outside the case's group names it as its members do)
            layout_groups(c.layout, *(group_key(None) if w == world else (tuple(range(w)), None)))
    cache: dict = {}
    out: list[dict | None] = []
    for case in cases:
        w = case.layout.world_size
        out.append(_run_case(rank, case, groups[w], cache) if rank < w else None)
        dist.barrier()
    return out


def run_cases(cases: Sequence[Case], timeout_s: float = DEFAULT_TIMEOUT_S,
              deadline_s: float | None = None,
              on_progress: Callable[[int, str], None] | None = None) -> list[dict[int, dict]]:
    """Verify several cases with one spawn; per case, {rank: result}. ``timeout_s``: how long a
    rank waits for a peer; ``deadline_s``: the whole run (see :func:`run_local`); ``on_progress``:
    the first attention rank's lines (programs built, each step)."""
    world = max(c.layout.world_size for c in cases)
    results = run_local(_verify_cases, world, list(cases), timeout_s=timeout_s, deadline_s=deadline_s,
                        on_progress=on_progress, preload=functools.partial(preload_programs, [c.path for c in cases]))
    return [{r: results[r][i] for r in results if results[r][i] is not None} for i in range(len(cases))]


@dataclass
class VerifyReport:
    """The verdict of a verify run. OK only when something was compared, no output held a
    NaN / Inf or had the wrong shape, and the worst error is within ``tol``."""

    layout: AFDLayout | TPLayout
    per_rank: dict[int, dict]
    tol: float
    seconds: float

    @property
    def compared(self) -> int:
        """Rank-steps that compared an output."""
        return sum(r.get("compared", 0) for r in self.per_rank.values())

    @property
    def max_rel_err(self) -> float:
        return max((r["max_rel_err"] for r in self.per_rank.values() if "max_rel_err" in r), default=math.inf)

    @property
    def problem(self) -> str | None:
        """The first problem, naming its rank and step (None when every output was finite)."""
        return next((f"rank {r} {res['problem']}" for r, res in sorted(self.per_rank.items())
                     if res.get("problem")), None)

    @property
    def ok(self) -> bool:
        return self.compared > 0 and self.problem is None and self.max_rel_err <= self.tol

    def line(self) -> str:
        why = f" ({self.problem})" if self.problem else ""
        return f"verify: {'OK' if self.ok else 'FAIL'} max_rel_err={self.max_rel_err:.3g} tol={self.tol:.3g}{why}"


def _report(layout: AFDLayout | TPLayout, results: dict[int, dict], tol: float, seconds: float) -> VerifyReport:
    report = VerifyReport(layout, results, tol, seconds)
    if not report.compared:  # the input checks make this unreachable; a verdict on nothing is never OK
        raise VerifyInputError(f"verify compared no output on any rank ({layout}): nothing to judge")
    return report


def _decode_line(spec: DecodeSpec, decode_steps: int) -> str:
    return (f"a prefill of {spec.prefill} positions and {decode_steps} decode steps of {spec.step_tokens} "
            f"(KV cache: {len(spec.state)} buffers, {spec.cache_len} positions), logits compared at every step")


def verify_afd(path: str, layout: AFDLayout, *, batches: Sequence[int] | None = None, gate: bool = False,
               steps: int = 2, tol: float | None = None, policy: str = "default",
               timeout_s: float = DEFAULT_TIMEOUT_S, decode_steps: int = 0, stages: int = 1,
               buckets: TokenBuckets | None = DEFAULT_BUCKETS, log: Callable[[str], None] = lambda s: None,
               on_progress: Callable[[int, str], None] | None = None,
               program: torch.export.ExportedProgram | None = None, saved: str | None = None,
               lowered: bool = False) -> VerifyReport:
    """Verify the AFD split of the ``.pt2`` at ``path``; ``batches`` per attention rank (None:
    default sizes 1, 2, 3, ... when the batch dim is dynamic, the saved example otherwise);
    ``stages`` micro-batches per step (passes/stages.py); ``buckets``: the attention ranks' wire
    slots (buckets.py; None: exact counts); ``lowered``: each rank runs its programs through its
    pipeline's lowering stage for the CPU (``afd_compile.pipeline``: the FFN exchange fused, receives
    into buffers), as the backend would, instead of the portable programs ``rewrite`` writes.
    ``program``: the program at ``path`` when the caller already loaded it (not loaded again here).
    Raises VerifyInputError (before any process starts) on inputs :func:`check_verify_inputs` refuses."""
    ep = load_program(path) if program is None else program
    facts = ProgramFacts.of(ep)
    spec = DecodeSpec.of(ep)
    check_decode_steps(spec, decode_steps, batches, path)
    if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= MAX_STAGES:
        raise VerifyInputError(f"--stages must be an integer in [1, {MAX_STAGES}], got {stages!r}")
    groups = layout.attention_ranks // layout.attn_tp  # the ranks of an attention TP group share their tokens
    if batches is None and facts.batch_range is not None and spec is None:  # (with stages: enough rows for them)
        batches = [min(stages + a, facts.batch_range[1]) for a in range(groups)]
    unit = "attention rank" if layout.attn_tp == 1 else "attention TP group"
    checked = check_verify_inputs(facts, units=groups, unit=unit,
                                  world_size=layout.world_size, batches=batches, steps=steps, tol=tol)
    example = flat_inputs(ep)
    check_exercised(layout, checked.batches, int(example[0].shape[0]) if example and example[0].dim() else None,
                    1 + decode_steps if decode_steps else checked.steps, stages)
    if checked.batches is None:
        log(f"verify: {path} has a static batch dimension; every attention rank uses the saved example input")
    log(f"verify: {layout} on {layout.world_size} local gloo processes (FFN ranks 0..{layout.ffn_ranks - 1}), "
        f"batch per {unit} {list(checked.batches) if checked.batches is not None else 'as saved'}, "
        + (_decode_line(spec, decode_steps) if decode_steps else f"{checked.steps} steps")
        + (f", {stages} micro-batch stages" if stages > 1 else "")
        + (f", token buckets {buckets}" if buckets is not None else ", exact token counts (no buckets)"))
    few = sorted({b for b in checked.batches or () if 0 < b < stages})
    if few and not decode_steps:  # a step runs as many micro-batches as it has sequences, up to S
        log(f"verify: note: batch sizes {few} are under --stages {stages}: those steps run "
            f"{'/'.join(map(str, few))} micro-batch(es), not {stages} (a micro-batch is whole sequences)")
    t = time.perf_counter()
    case = Case(path, layout, checked.batches, gate, checked.steps, policy, decode_steps, stages, buckets, saved,
                lowered)
    results = run_cases([case], timeout_s=timeout_s, on_progress=on_progress)[0]
    for r in sorted(results):
        res = results[r]
        ran = (f"; lowered by {', '.join(f'{n} ({k})' for n, k in res['lowered'].items()) or 'no pass'}"
               if lowered else "")
        if res["role"] == "ffn":
            log(f"  rank {r} ffn: served {res['steps']} steps from peers {list(layout.peers_of_ffn(r))}, "
                f"{len(res['layouts'])} token layout(s) (one program each once compiled){ran}")
        else:
            staged = (f", transfers per stage {res['stage_transfers']}" if stages > 1 else "")
            log(f"  rank {r} attention: batches {res['batches']} max_rel_err={res['max_rel_err']:.3g}{staged}{ran}")
    return _report(layout, results, checked.tol, time.perf_counter() - t)


# --- tensor parallelism ------------------------------------------------------------------------


@dataclass(frozen=True)
class TPCase:
    """One TP verification: every rank of the TP group runs its shard on the same tokens
    (attn_dp == 1) and compares with the original program."""

    path: str
    layout: TPLayout
    batches: tuple[int, ...] | None = None  # one batch size per attention DP group
    steps: int = 2
    policy: str = "default"
    saved: str | None = None  # a directory written by ``afd-compile rewrite --tp``: run its rank<r>.pt2
    decode_steps: int = 0  # a program with a KV cache: a prefill, then this many decode steps


def _run_tp_case(rank: int, case: TPCase, groups: dict, cache: dict) -> dict:
    from .deploy import tp_rank_program
    from .runtime import register_tp_groups

    ep, original, inputs, spec = _loaded(case.path, cache)
    lay = case.layout
    report = progress if rank == 0 else (lambda _text: None)
    report(f"{lay.tp} processes up (torch imported, process group formed)")
    register_tp_groups(groups, lay, rank)
    if case.saved is not None:  # the saved rank program, re-loaded: what `rewrite --tp` wrote (checked)
        from .programs import load_program
        from .saved import read_saved_plan

        saved = read_saved_plan(case.saved)
        if saved.kind != "tp" or f"rank{rank}" not in saved.programs:
            raise VerifyInputError(f"{case.saved}: plan.json holds no TP program for rank {rank} "
                                   f"(kind {saved.kind}, programs {sorted(saved.programs)})")
        program, sharded = load_program(saved.path(f"rank{rank}")).module(), None
    else:
        gm = fresh_module(ep)
        prog = tp_rank_program(gm, lay, rank, SplitConfig(policy=POLICIES[case.policy], graph_name=case.path))
        program, sharded = prog.program, len(prog.shards.weights)
    _, dims = batch_symbol_dims(original)
    tally, seen = Tally(), []
    g = lay.attn_dp_rank(rank)
    steps = 1 + case.decode_steps if case.decode_steps else case.steps
    report("programs built")
    for step in range(steps):
        # DP groups rotate their batch sizes between steps; ranks of one group share tokens
        x = _step_inputs(inputs, spec, case.decode_steps, case.batches, dims, g, step)
        empty = x[0].shape[0] == 0
        if empty:
            if lay.attn_dp == 1:
                raise ValueError("a TP group with zero tokens has nothing to run")
            # padding rule: a DP group with no tokens runs a one-sequence dummy (its rows take part
            # in the collectives like any others) and drops the output
            x = resize_inputs(inputs, dims, 1, salt=0)
        with torch.no_grad():
            if lay.attn_dp > 1:
                out = TPRank(program, lay, rank)(*x)
            else:
                out = program(*x)
            if not empty:
                tally.add(step, compare(out, original(*x)))
        seen.append(0 if empty else int(x[0].shape[0]))
        report(f"step {step + 1}/{steps} done")
    return {"sharded_weights": sharded, "batches": seen, **tally.to_json()}


def _verify_tp_cases(rank: int, world: int, cases: Sequence[TPCase]) -> list[dict | None]:
    import torch.distributed as dist

    groups = tp_groups(world, [c.layout for c in cases])
    cache: dict = {}
    out: list[dict | None] = []
    for case in cases:
        out.append(_run_tp_case(rank, case, groups, cache) if rank < case.layout.tp else None)
        dist.barrier()
    return out


def run_tp_cases(cases: Sequence[TPCase], timeout_s: float = DEFAULT_TIMEOUT_S,
                 deadline_s: float | None = None,
                 on_progress: Callable[[int, str], None] | None = None) -> list[dict[int, dict]]:
    world = max(c.layout.tp for c in cases)
    results = run_local(_verify_tp_cases, world, list(cases), timeout_s=timeout_s, deadline_s=deadline_s,
                        on_progress=on_progress, preload=functools.partial(preload_programs, [c.path for c in cases]))
    return [{r: results[r][i] for r in results if results[r][i] is not None} for i in range(len(cases))]


def verify_tp(path: str, layout: TPLayout, *, batches: Sequence[int] | None = None, steps: int = 2,
              tol: float | None = None, policy: str = "default", timeout_s: float = DEFAULT_TIMEOUT_S,
              decode_steps: int = 0, log: Callable[[str], None] = lambda s: None,
              on_progress: Callable[[int, str], None] | None = None,
              program: torch.export.ExportedProgram | None = None, saved: str | None = None) -> VerifyReport:
    """Verify the TP sharding of the ``.pt2`` at ``path`` on ``layout.tp`` local processes;
    ``batches`` per attention DP group (None: 1, 2, ... with DP attention, else as saved). The
    same input checks and ``program`` as :func:`verify_afd`."""
    ep = load_program(path) if program is None else program
    facts = ProgramFacts.of(ep)
    spec = DecodeSpec.of(ep)
    check_decode_steps(spec, decode_steps, batches, path)
    if batches is None and layout.attn_dp > 1 and spec is None:  # (a cached program's batch is its cache's)
        batches = [1 + g for g in range(layout.attn_dp)]
    checked = check_verify_inputs(facts, units=layout.attn_dp, unit="attention DP group", world_size=layout.tp,
                                  batches=batches, steps=steps, tol=tol, zero_runs_dummy=layout.attn_dp > 1)
    log(f"verify: {layout} on {layout.tp} local gloo processes, batch per DP group "
        f"{list(checked.batches) if checked.batches is not None else 'as saved'}, "
        + (_decode_line(spec, decode_steps) if decode_steps else f"{checked.steps} steps"))
    t = time.perf_counter()
    case = TPCase(path, layout, checked.batches, checked.steps, policy, saved=saved, decode_steps=decode_steps)
    (results,) = run_tp_cases([case], timeout_s=timeout_s, on_progress=on_progress)
    for r in sorted(results):
        log(f"  rank {r}: batches {results[r]['batches']} max_rel_err={results[r]['max_rel_err']:.3g}")
    return _report(layout, results, checked.tol, time.perf_counter() - t)


def verify_saved(path: str, outdir: str, **options: Any) -> VerifyReport:
    """Verify the programs ``afd-compile rewrite`` wrote into ``outdir`` against the original
    ``.pt2`` at ``path``: plan.json checked field by field and each program against its sha256
    (:func:`afd_compile.saved.read_saved_plan`), then the folder's own layout (and, AFD, its
    router side and micro-batch stages) run as :func:`verify_afd` / :func:`verify_tp` run a
    layout, each rank its saved program. ``options``: theirs (batches, steps, tol, ...)."""
    from .saved import check_saved_program, read_saved_plan

    plan = read_saved_plan(outdir)
    layout = plan.layout()
    if plan.kind == "afd":  # each program what plan.json says it is (before any process starts)
        for role in ("attention", "ffn"):
            check_saved_program(plan, role, load_program(plan.path(role)).module())
    options.get("log", lambda _s: None)(
        f"verify: the programs of {outdir} (plan.json and each program's sha256 checked), "
        f"layout {layout}, against {path}"
    )
    if plan.kind == "tp":
        options.pop("buckets", None)
        if options.pop("lowered", False):
            raise VerifyInputError(
                f"{outdir}: a TP folder; lowered=True runs an AFD layout's lowering stage (a TP "
                "rank's, its KV cache held as its slice, only the torch.compile backend runs)"
            )
        return verify_tp(path, layout, saved=outdir, **options)
    return verify_afd(
        path,
        layout,
        gate=bool(plan.get("compute_gate_on_attention")),
        stages=int(plan.get("stages", 1)),
        saved=outdir,
        **options,
    )
