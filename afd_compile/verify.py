"""Run the original program and the split deployment on local gloo processes and compare.

Every process loads the same ``.pt2`` and splits it for its own rank. Each attention rank gets its
own batch size (the saved example input resized along its batch dimension), runs ``steps`` steps
(the sizes rotate between steps so every FFN rank sees several token layouts), and compares its
output with the original program run on the same input in the same process.
Error measure: ``max |split - original| / max |original|`` per output, max over steps.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from .layout import AFDLayout
from .passes.roles import POLICIES
from .programs import example_inputs, load_program
from .runtime import AttentionWorker, make_worker, max_rel_err, run_local
from .scatter import TPLayout
from .split_api import SplitConfig


class VerifyInputError(ValueError):
    pass


def batch_symbol_dims(gm: fx.GraphModule) -> tuple[object | None, list[tuple[int, int]]]:
    """The symbol of the first input's dim 0 and every (input, dim) carrying it."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("val") for n in placeholders]
    if not vals or not isinstance(vals[0], torch.Tensor) or vals[0].dim() == 0:
        return None, []
    sym = vals[0].shape[0]
    if not isinstance(sym, torch.SymInt):
        return None, []
    key = str(sym.node.expr)
    dims = [(i, d) for i, v in enumerate(vals) if isinstance(v, torch.Tensor)
            for d, s in enumerate(v.shape) if isinstance(s, torch.SymInt) and str(s.node.expr) == key]
    return key, dims


def resize_inputs(inputs: Sequence[torch.Tensor], dims: list[tuple[int, int]], batch: int,
                  salt: int) -> tuple[torch.Tensor, ...]:
    """Tile the example rows along the batch dim to ``batch`` rows; integer inputs with values
    beyond 0/1 (token ids) are shifted by ``salt`` so ranks see different tokens."""
    out = list(inputs)
    for i, d in dims:
        t = inputs[i]
        idx = torch.arange(batch) % t.shape[d]
        out[i] = t.index_select(d, idx)
    for i, t in enumerate(out):
        if not t.is_floating_point() and t.dtype != torch.bool and t.numel() and int(t.max()) > 1:
            hi = int(inputs[i].max()) + 1
            out[i] = (t + salt) % hi
    return tuple(out)


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


def _loaded(path: str, cache: dict) -> tuple:
    """(program, original module, example inputs), loaded once per process and path."""
    if path not in cache:
        ep = load_program(path)
        cache[path] = (ep, ep.module(), example_inputs(ep))
    return cache[path]


def _run_case(rank: int, case: Case, group: object, cache: dict) -> dict:
    ep, original, inputs = _loaded(case.path, cache)
    config = SplitConfig(compute_gate_on_attention=case.gate, policy=POLICIES[case.policy], graph_name=case.path)
    worker = make_worker(ep.module(), case.layout, rank, config, group=group)
    if not isinstance(worker, AttentionWorker):
        return {"role": "ffn", "steps": worker.serve()}
    a = case.layout.role_of(rank)[1]
    _, dims = batch_symbol_dims(original)
    err, sizes = 0.0, []
    try:
        for step in range(case.steps):
            if case.batches is None:
                x = inputs
            else:
                x = resize_inputs(inputs, dims, case.batches[(a + step) % len(case.batches)], salt=7 * a + step)
            sizes.append(int(x[0].shape[0]) if x[0].dim() else 0)
            with torch.no_grad():
                out = worker.step(*x)
                if out is None:  # zero tokens this step
                    continue
                err = max(err, max_rel_err(out, original(*x)))
    finally:
        worker.stop()
    return {"role": "attention", "batches": sizes, "max_rel_err": err}


def _verify_cases(rank: int, world: int, cases: Sequence[Case]) -> list[dict | None]:
    """Run every case on one set of processes: case c uses world ranks [0, its world size)
    through its own process group; the other ranks wait at a barrier."""
    import torch.distributed as dist

    sizes = sorted({c.layout.world_size for c in cases})
    groups = {w: (dist.group.WORLD if w == world else dist.new_group(list(range(w)))) for w in sizes}
    cache: dict = {}
    out: list[dict | None] = []
    for case in cases:
        w = case.layout.world_size
        out.append(_run_case(rank, case, groups[w], cache) if rank < w else None)
        dist.barrier()
    return out


def run_cases(cases: Sequence[Case], timeout_s: float = 600.0) -> list[dict[int, dict]]:
    """Verify several cases with one spawn; per case, {rank: result}."""
    world = max(c.layout.world_size for c in cases)
    results = run_local(_verify_cases, world, list(cases), timeout_s=timeout_s)
    return [{r: results[r][i] for r in results if results[r][i] is not None} for i in range(len(cases))]


@dataclass
class VerifyReport:
    layout: AFDLayout
    per_rank: dict[int, dict]
    max_rel_err: float
    tol: float
    seconds: float

    @property
    def ok(self) -> bool:
        return self.max_rel_err <= self.tol

    def line(self) -> str:
        return f"verify: {'OK' if self.ok else 'FAIL'} max_rel_err={self.max_rel_err:.3g}"


def verify_afd(path: str, layout: AFDLayout, *, batches: list[int] | None = None, gate: bool = False,
               steps: int = 2, tol: float | None = None, policy: str = "default",
               log: Callable[[str], None] = lambda s: None) -> VerifyReport:
    """Verify the AFD split of the ``.pt2`` at ``path``; ``batches`` per attention rank (None:
    default sizes 1, 2, 3, ... when the batch dim is dynamic, the saved example otherwise)."""
    ep = load_program(path)
    inputs = example_inputs(ep)
    sym, dims = batch_symbol_dims(ep.module())
    if batches is not None and len(batches) != layout.attention_ranks:
        raise VerifyInputError(f"--tokens has {len(batches)} entries, layout {layout} has "
                               f"{layout.attention_ranks} attention ranks")
    if sym is None:
        if batches is not None:
            raise VerifyInputError(f"{path}: the batch dimension is static, cannot resize inputs to {batches}")
        log(f"verify: {path} has a static batch dimension; every attention rank uses the saved example input")
    elif batches is None:
        batches = [1 + a for a in range(layout.attention_ranks)]
    if tol is None:
        dtypes = {t.dtype for t in inputs if t.is_floating_point()} | {
            p.dtype for p in ep.state_dict.values() if p.is_floating_point()}
        tol = 1e-5 if dtypes <= {torch.float32, torch.float64} else 1e-2
    log(f"verify: {layout} on {layout.world_size} local gloo processes (FFN ranks 0..{layout.ffn_ranks - 1}), "
        f"batch per attention rank {batches if batches is not None else 'as saved'}, {steps} steps")
    t = time.perf_counter()
    case = Case(path, layout, tuple(batches) if batches is not None else None, gate, steps, policy)
    results = run_cases([case])[0]
    seconds = time.perf_counter() - t
    for r in sorted(results):
        res = results[r]
        if res["role"] == "ffn":
            log(f"  rank {r} ffn: served {res['steps']} steps from peers {list(layout.peers_of_ffn(r))}")
        else:
            log(f"  rank {r} attention: batches {res['batches']} max_rel_err={res['max_rel_err']:.3g}")
    err = max((res["max_rel_err"] for res in results.values() if res["role"] == "attention"), default=0.0)
    return VerifyReport(layout, results, err, tol, seconds)


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


def _tp_groups(world: int, layouts: Sequence[TPLayout]) -> dict:
    """Every process group the cases need, created in the same order on every rank."""
    import torch.distributed as dist

    groups: dict = {}
    for lay in layouts:
        key = ("tp", lay.tp)
        if key not in groups:
            groups[key] = dist.group.WORLD if lay.tp == world else dist.new_group(list(range(lay.tp)))
        for g in range(lay.attn_dp):
            ranks = tuple(range(g * lay.attn_tp, (g + 1) * lay.attn_tp))
            k = ("attn", ranks)
            if k not in groups:
                groups[k] = groups[key] if lay.attn_tp == lay.tp else dist.new_group(list(ranks))
    return groups


def _run_tp_case(rank: int, case: TPCase, groups: dict, cache: dict) -> dict:
    from .comm import GROUP_ATTN_TP, GROUP_TP, register_group
    from .passes.roles import annotate_roles
    from .passes.tp_rewrite import shard_for_rank

    ep, original, inputs = _loaded(case.path, cache)
    lay = case.layout
    register_group(GROUP_TP, groups[("tp", lay.tp)])
    register_group(GROUP_ATTN_TP, groups[("attn", lay.attn_tp_group(rank))])
    if case.saved is not None:  # the saved rank program, re-loaded: what `rewrite --tp` wrote
        from .programs import load_program

        program, sharded = load_program(os.path.join(case.saved, f"rank{rank}.pt2")).module(), None
    else:
        gm = ep.module()
        annotate_roles(gm, POLICIES[case.policy], graph_name=case.path)
        prog = shard_for_rank(gm, lay, rank, graph_name=case.path)
        program, sharded = prog.program, len(prog.shards.weights)
    _, dims = batch_symbol_dims(original)
    err, seen = 0.0, []
    g = lay.attn_dp_rank(rank)
    for step in range(case.steps):
        if case.batches is None:
            x = inputs
        else:  # DP groups rotate their batch sizes between steps; ranks of one group share tokens
            x = resize_inputs(inputs, dims, case.batches[(g + step) % len(case.batches)], salt=7 * g + step)
        empty = x[0].shape[0] == 0
        if empty:
            if lay.attn_dp == 1:
                raise ValueError("a TP group with zero tokens has nothing to run")
            # padding rule: a DP group with no tokens runs a one-sequence dummy (its rows take part
            # in the collectives like any others) and drops the output
            x = resize_inputs(inputs, dims, 1, salt=0)
        with torch.no_grad():
            if lay.attn_dp > 1:
                out = _dp_step(program, x, lay, rank)
            else:
                out = program(*x)
            if not empty:
                err = max(err, max_rel_err(out, original(*x)))
        seen.append(0 if empty else int(x[0].shape[0]))
    return {"max_rel_err": err, "sharded_weights": sharded, "batches": seen}


def _dp_step_counts(x: Sequence[torch.Tensor], lay: TPLayout, rank: int) -> tuple[int, ...]:
    """All TP ranks exchange their token counts (one small all-gather per step) and record the
    step's per-DP-group counts for the DP collectives; returns them."""
    import torch.distributed as dist

    from .comm import GROUP_TP, TPStep, get_group, set_tp_step

    own = int(x[0].numel())  # tokens of this rank's input (batch x sequence)
    group = get_group(GROUP_TP)
    dev = x[0].device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    counts = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(lay.tp)]
    dist.all_gather(counts, torch.tensor([own], device=dev), group=group)
    per_rank = [int(c) for c in counts]
    groups = [per_rank[i * lay.attn_tp] for i in range(lay.attn_dp)]
    for r, c in enumerate(per_rank):
        if c != groups[lay.attn_dp_rank(r)]:
            raise RuntimeError(f"ranks of attention DP group {lay.attn_dp_rank(r)} disagree on tokens: {per_rank}")
    set_tp_step(TPStep(lay.attn_dp_rank(rank), tuple(groups)))
    return tuple(groups)


def _dp_step(program: fx.GraphModule, x: tuple, lay: TPLayout, rank: int) -> object:
    """One DP-attention step: exchange token counts, then run with a carrier of the total."""
    groups = _dp_step_counts(x, lay, rank)
    return program(*x, torch.empty(sum(groups), 0))


def _verify_tp_cases(rank: int, world: int, cases: Sequence[TPCase]) -> list[dict | None]:
    import torch.distributed as dist

    groups = _tp_groups(world, [c.layout for c in cases])
    cache: dict = {}
    out: list[dict | None] = []
    for case in cases:
        out.append(_run_tp_case(rank, case, groups, cache) if rank < case.layout.tp else None)
        dist.barrier()
    return out


def run_tp_cases(cases: Sequence[TPCase], timeout_s: float = 600.0) -> list[dict[int, dict]]:
    world = max(c.layout.tp for c in cases)
    results = run_local(_verify_tp_cases, world, list(cases), timeout_s=timeout_s)
    return [{r: results[r][i] for r in results if results[r][i] is not None} for i in range(len(cases))]
