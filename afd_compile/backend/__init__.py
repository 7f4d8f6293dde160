"""``torch.compile(model, backend="afd", options={...})``: the afd-compile passes as a dynamo backend.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so no import is
needed after ``pip install``. Per graph dynamo captures, on every rank:

1. **lift**: dynamo hands the graph with parameters and buffers as inputs; they become attributes
   of a module again (named after their module path, ``model.layers.0.mlp.up_proj.weight``) and
   the graph is exported to ATen (``torch.export``, batch dim dynamic) — the same IR the CLI reads;
2. **distribute**: the passes for this rank's role: ``tp`` -> the sharded program with its
   collectives (scatter modes), ``attention``/``ffn`` -> this rank's AFD program;
3. **compile**: Inductor compiles the rank's program, once per token layout (input shapes, and
   for DP attention / an FFN rank the step's per-group or per-peer token counts): a new layout is
   compiled (and on CUDA graph-captured) on first sight, logged and counted in
   :data:`STATS`; layouts never share a compiled program, so two layouts cannot replay each
   other's CUDA graph.

Options (all optional)::

    tp, attn_dp        tensor parallelism over all ranks (tp must equal the world size)
    moe_a2a, dense_dp  SCATTERED MLPs: MoE experts split over the TP group with all-to-all, or
                       data-parallel dense MLPs (as the CLI's --moe-a2a / --dense-dp)
    vocab_parallel     TP: split the LM head by vocabulary over the attention TP group, logits
                       all-gathered (default False: the head whole on every rank; as the CLI's
                       --vocab-parallel)
    attention, ffn     AFD: the first `ffn` ranks serve FFN, the rest attention (world = A + F)
    rank, world_size   default: RANK / WORLD_SIZE from the environment (torchrun)
    inductor           compile each program with Inductor (default True; False: run the FX program)
    cudagraphs         capture CUDA graphs (default: on CUDA, yes unless a program holds an op that
                       synchronises with the host (HOST_SYNC_OPS): then that program runs without
                       capture, with a warning, counted in STATS["cudagraphs_off"]; True refuses such a
                       program; False never captures)
    policy             role policy: default | module_path | structural
    comm_id            AFD communicator id (two AFD-compiled models in one process need two ids)
    timeout_s          how long a rank waits for a peer before failing: the backend's process groups
                       get this timeout (default: the initialised group's)
    decode_attention   "auto" (default), "flex" or "sdpa": "flex" runs attention over a static KV cache
                       (a decode program that updates its cache in place) as FlexAttention reading
                       only the filled blocks of the cache (passes/decode_attention.py); "sdpa" keeps
                       the model's attention; "auto" is "flex" for programs on CUDA under a layout
                       (measured 4.8x faster per decode step at batch 64 x context 4096 on an H200,
                       BENCHMARKS.md) and "sdpa" on CPU (Inductor's CPU flex template does not
                       compile many decode shapes). With no layout only "flex" applies the pass
    moe_experts        "auto" (default) or "op": each MoE block's experts become one afd::moe_experts op
                       (passes/moe: recognised by structure, whatever form the model wrote). Under a
                       layout always; with no layout "auto" applies it on CUDA (the op's grouped GEMM
                       path), "op" on CPU too (its reference loop)
    stages             AFD: micro-batches per step (default 1): each step's sequences split into S
                       micro-batches run interleaved layer by layer, the attention rank computing
                       micro-batch s + 1 while the FFN rank computes s (passes/stages.py); every
                       rank the same S; with a KV cache each micro-batch its own cache rows;
                       composes with ffn_tp / ffn_ep and attn_tp
    symm_mem           on CUDA, all-reduce small messages (TP junctions, AFD's TP groups) in one one-shot
                       kernel over symmetric memory where the group's GPUs reach each other, NCCL
                       above AFD_SYMM_MEM_MAX_BYTES (default 2 MiB) (afd_compile/symm_mem.py); where
                       it is unavailable NCCL, logged once per group with the reason (default True;
                       False: NCCL for every all-reduce)
    buckets            AFD: token buckets, "default", "off", ascending sizes or "fixed:N" (buckets.py): an
                       attention rank's tokens cross the wire padded to the next bucket, an FFN rank's
                       rows to the bucket of its peers' total; "fixed:N": N rows a rank every step,
                       counts on the device, no control message (runtime/slots.py)
    batch_buckets      AFD: an attention rank's batch padded to the next of these numbers of sequences
                       before its step, the outputs cut back (runtime/pad_batch.py): its CUDA graphs
                       one per bucket, not per batch size; "auto" (default): the default buckets when
                       its program is captured in CUDA graphs, else none; "off", or sizes
    ffn_capture        AFD on CUDA: "all" (default): an FFN rank compiles one program per bucket of
                       its rows and captures it whole, its exchange inside, once per tuple of its
                       peers' sizes (a capture, no compile): a step is one graph replay; "compute": its
                       CUDA graphs hold its compute only, the exchange with its peers and its group's
                       token collectives run between them on the host each step (Inductor's graph
                       partition): one graph set per bucket, at 85-145 µs more host work a layer
                       (one H200, BENCHMARKS.md: an FFN rank's real program)
    check_wire         AFD: a check header ahead of every transfer (default: AFD_CHECK_WIRE; see
                       afd_compile.comm.AFDCommunicator); every rank must agree; not with CUDA graphs
                       (the comparison runs on the host): needs cudagraphs=False on CUDA

Every option is checked (type, range, rank / world size against the live process group) before
anything runs: a wrong value is a BackendOptionError naming the option.

With no layout (or one process and ``tp=1``) the backend is Inductor itself, on CUDA with its
CUDA graphs as ``mode="reduce-overhead"`` (unless ``cudagraphs=False``), with a log line saying no
distribution was applied; with ``decode_attention="flex"`` it applies that pass alone
(one GPU, no distribution), and on CUDA (or with ``moe_experts="op"``) the MoE recognition. On an FFN rank each call of
the compiled model serves one step for its attention peers (the inputs are ignored) and returns empty tensors.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from ..errors import AFDCompileError
from ..pipeline import LOWERED_KEY, builds_for, lower, rank_build
from .agreement import agree_first, begin_first, tell_peers
from .compiled import (
    HOST_SYNC_OPS,
    STATS,
    PerLayout,
    host_syncs,
    layout_key,
    release,
    returned_state,
    source_id,
)
from .lift import Lifted, export_lifted, is_dynamic, is_static_address
from .options import BackendOptionError, BackendOptions, check_options

log = logging.getLogger("afd_compile.backend")


def _no_layout(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions) -> Callable[..., Any]:
    """Dynamo's graph as ``torch.compile`` would compile it: Inductor, and on CUDA its CUDA graphs
    (``mode="reduce-overhead"``'s) unless ``cudagraphs`` is False, so the backend with no layout is
    never slower than the user's first alternative."""
    graphs = opts.cudagraphs is not False and _device_of(example_inputs).type == "cuda"
    STATS["no_layout"] += 1  # said once per process (as a warning), then per graph at INFO
    (log.warning if STATS["no_layout"] == 1 else log.info)(
        f"afd: no layout given (tp=1, no attention/ffn ranks): no distribution applied; compiling with Inductor"
        f"{' and CUDA graphs (as mode=reduce-overhead)' if graphs else ''}" if opts.inductor
        else "afd: no layout given: no distribution applied")
    if not opts.inductor:
        return gm.forward
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, list(example_inputs), config_patches={"triton.cudagraphs": True} if graphs else None)


def _moe_op(opts: BackendOptions, device: torch.device, gm: fx.GraphModule | None = None) -> bool:
    """With no layout, whether the MoE recognition runs (option ``moe_experts``): on a graph that
    selects by score (a top-k, or a max over a dim as PhiMoE's router: dynamo's, when given), on
    CUDA or asked for."""
    from ..passes.router import selects_by_name

    routed = gm is None or any(selects_by_name(n) for n in gm.graph.nodes)
    return routed and (opts.moe_experts == "op" or device.type == "cuda")


def _device_of(xs: Sequence[Any]) -> torch.device:
    return next((x.device for x in xs if isinstance(x, torch.Tensor)), torch.device("cpu"))


def afd_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None,
                **kwargs: Any) -> Callable[..., Any]:
    """The ``afd`` dynamo backend (see the module docstring for the options). What it refuses
    (an :class:`~afd_compile.errors.AFDCompileError`) reaches the caller of the compiled model as
    that error, its traceback cut at this function, not wrapped in dynamo's
    ``BackendCompilerFailed`` under dynamo's frames (``TORCHDYNAMO_VERBOSE=1`` keeps them all)."""
    try:
        return _compile(gm, example_inputs, options, **kwargs)
    except AFDCompileError as e:
        tell_peers(e)
        raise _past_dynamo(e, inspect.currentframe()) from None
    except Exception as e:  # (not ours: torch's export, a bug) the peers are told as of a refusal
        tell_peers(e)
        raise


def _on_shutdown() -> None:
    """``runtime.shutdown()`` frees this process's compiled programs and CUDA graphs (``release``)
    before it destroys the process group (registered once)."""
    from ..runtime import before_destroy

    before_destroy(release)


_PAST_DYNAMO: dict[type, type] = {}


def _past_dynamo(e: AFDCompileError, frame: Any) -> BaseException:
    """``e`` as an exception dynamo re-raises unwrapped, its traceback starting at ``frame``: an
    instance of ``type(e)`` and of dynamo's ``ShortenTraceback`` (which dynamo lets through and
    cuts below the first useful frame); ``e`` itself where this torch has no such class."""
    try:
        from torch._dynamo.exc import ShortenTraceback
    except ImportError:
        return e
    cls = _PAST_DYNAMO.get(type(e))
    if cls is None:
        cls = _PAST_DYNAMO[type(e)] = type(type(e).__name__, (type(e), ShortenTraceback),
                                           {"__module__": type(e).__module__, "__qualname__": type(e).__qualname__})
    err = cls.__new__(cls)
    Exception.__init__(err, *e.args)
    err.__dict__.update(e.__dict__)
    err.first_useful_frame = frame
    return err


def _compile(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None,
             **kwargs: Any) -> Callable[..., Any]:
    if kwargs:
        raise BackendOptionError(f"afd backend: unexpected arguments {sorted(kwargs)} (use options={{...}})")
    opts = check_options(options)
    rank, world = opts.resolved()
    _on_shutdown()
    begin_first(opts)
    STATS["graphs"] += 1
    device = _device_of(example_inputs)
    plain = opts.mode == "none" and opts.decode_attention != "flex"
    if plain and not _moe_op(opts, device, gm):
        return _no_layout(gm, example_inputs, opts)
    # None on CUDA: capture unless a program holds an op that cannot be captured (PerLayout)
    cudagraphs = (None if device.type == "cuda" else False) if opts.cudagraphs is None else opts.cudagraphs
    from torch._guards import tracing

    # export and the passes run in a context of their own: dynamo's tracing context (its fake
    # mode, its guards) belongs to the frame being compiled
    with tracing(None):
        run, lifted = _distribute(gm, example_inputs, opts, rank, world, device, cudagraphs)
    if run is None:  # (no layout, and no MoE block recognised: Inductor on dynamo's graph, as without)
        return _no_layout(gm, example_inputs, opts)
    runs = {lifted.const_key(example_inputs): (run, lifted.user_positions)}

    def call(*args: Any) -> Any:
        STATS["calls"] += 1
        key = lifted.const_key(args)
        if key not in runs:  # an int argument with a value not compiled yet (dynamo made it symbolic)
            # (no layout: recognition decided on the first call's graph, which these share)
            log.info("afd: rank %d: int inputs / static-address input shapes %s: compiling this graph for them",
                     rank, key)
            with tracing(None):  # (this call's args as examples: the first call's are not kept alive)
                new_run, new_lifted = _distribute(gm, list(args), opts, rank, world, device, cudagraphs)
            if new_run is None:  # (no MoE block recognised at these ints: Inductor on all the args)
                runs[key] = (_no_layout(gm, list(args), opts), list(range(len(args))))
            else:
                runs[key] = (new_run, new_lifted.user_positions)
        run, positions = runs[key]
        return run(*[args[i] for i in positions])

    return call


def _distribute(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions, rank: int, world: int,
                device: torch.device, cudagraphs: bool | None) -> tuple[Callable[..., Any] | None, Lifted]:
    lifted = Lifted(gm, example_inputs)
    user = [example_inputs[i] for i in lifted.user_positions]
    t0 = time.perf_counter()
    ep = export_lifted(lifted, user)
    log.info("afd: rank %d: exported dynamo graph (%d nodes) in %.1fs", rank, len(ep.graph.nodes),
             time.perf_counter() - t0)
    key = layout_key(opts, rank, world)
    ffn_rank = opts.afd is not None and rank < opts.afd.ffn
    if not is_dynamic(ep) and ((opts.tp is not None and opts.tp.attn_dp > 1) or ffn_rank):
        raise BackendOptionError(
            f"afd backend: rank {rank}: {'an AFD FFN rank' if ffn_rank else 'DP attention'} runs programs over a "
            "token count that changes per step (set by other ranks), so it needs a graph with a dynamic batch: "
            "torch.compile(model, backend='afd', dynamic=True, options=...), and a first call whose batch and "
            "sequence are >= 2 (dynamo specialises dims of size 0 and 1)")
    static = [lifted.user_positions.index(p) for p in lifted.static_positions]  # as program inputs
    if opts.mode == "none":  # one process: only the MoE-recognition and decode-attention passes
        from ..deploy import no_layout_program

        prog = ep.module().to(device)
        (build,) = builds_for(None, device.type, decode_attention=opts.decode_attention, inductor=opts.inductor,
                              moe_op=_moe_op(opts, device))
        records = no_layout_program(prog, build)
        for rec in records:
            log.info("afd: one process: %s", rec)
        if build.moe_op and opts.decode_attention != "flex" and not any(r.op for r in records):
            return None, lifted
        lower(prog, build, log_as="one process")
        one = PerLayout(prog, key, opts.inductor, cudagraphs, "one process", static, build=build)
        run = lambda *x: one(tuple(tuple(t.shape) for t in x if isinstance(t, torch.Tensor)), *x)  # noqa: E731
    else:
        from ..passes.roles import FusedLayerError, NoStructureError

        try:
            if opts.mode == "tp":
                run = _tp_runner(ep, opts, rank, world, key, cudagraphs, device, static, user)
            else:
                run = _afd_runner(ep, opts, rank, world, key, cudagraphs, device, gm, static)
        except FusedLayerError:
            raise
        except NoStructureError as e:
            raise NoStructureError(f"{e}. {graph_break_hint()}") from None
    return run, lifted


def graph_break_hint() -> str:
    """Why dynamo's graph may not hold whole layers: the graph breaks it recorded in this process
    (the last few, each with its source line), and what keeps the graph whole."""
    import torch._dynamo

    reasons = list(getattr(torch._dynamo.utils, "graph_break_reasons", []))
    seen: dict[str, None] = {}
    for r in reasons:
        where = ""
        if r.user_stack:
            f = r.user_stack[-1]
            where = f"{os.path.basename(f.filename)}:{f.lineno} `{(f.line or '').strip()}`: "
        why = " ".join(str(r.reason).split())
        seen.setdefault(where + (why if len(why) <= 160 else why[:160].rsplit(" ", 1)[0] + " ..."), None)
    found = list(seen)[-3:]
    text = ("Each graph dynamo hands the backend must hold whole decoder layers: a graph break inside a layer "
            "splits it" + (f"; dynamo broke the graph at: {'; '.join(found)}" if found else
                           " (TORCH_LOGS=graph_breaks lists them)") + ". ")
    config = torch._dynamo.config
    # a tensor's value read on the host (.item(), .tolist(): JetMoE's expert sizes for a split)
    scalar = any("_local_scalar_dense" in str(r.reason) or ".item()" in str(r.reason) for r in reasons)
    if scalar and not config.capture_scalar_outputs:
        return text + ("A tensor's value read as a Python number (.item(), .tolist(): an MoE's expert sizes) stays "
                       "in the graph with torch._dynamo.config.capture_scalar_outputs = True" +
                       ("" if config.capture_dynamic_output_shape_ops else
                        " (and capture_dynamic_output_shape_ops = True for torch.where / nonzero)"))
    if not config.capture_dynamic_output_shape_ops:
        return text + ("A data-dependent op (torch.where or nonzero in an MoE's expert loop) stays in the graph "
                       "with torch._dynamo.config.capture_dynamic_output_shape_ops = True")
    return text + ("A Python loop over a tensor's values (transformers' experts_implementation='eager': `for "
                   "expert_idx in expert_hit`) cannot stay in one graph; write the experts in a form that traces "
                   "(transformers: experts_implementation='grouped_mm' or 'batched_mm'; a loop over "
                   "range(num_experts)): each is recognised as one afd::moe_experts op")


def _tp_runner(ep: torch.export.ExportedProgram, opts: BackendOptions, rank: int, world: int, key: str,
               cudagraphs: bool | None, device: torch.device, static: Sequence[int] = (),
               examples: Sequence[Any] = ()) -> Callable[..., Any]:
    from ..comm import GROUP_ATTN_TP, GROUP_TP, step_counts
    from ..deploy import tp_rank_lowered
    from ..passes.roles import POLICIES
    from ..runtime import dp_step_counts, register_tp_groups, tp_groups
    from ..scatter import TPLayout
    from ..split_api import SplitConfig
    from ..state_store import bind_inputs, bind_outputs
    from ..symm_mem import prepare_groups

    layout = opts.layout()
    assert isinstance(layout, TPLayout)  # (the TP runner: check_options saw a TP layout)
    agree_first(opts)
    groups = tp_groups(world, [layout], timeout_s=opts.timeout_s)
    register_tp_groups(groups, layout, rank)
    prepare_groups({GROUP_TP: groups[("tp", layout.tp)], GROUP_ATTN_TP: groups[("attn", layout.attn_tp_group(rank))]},
                   device, opts.symm_mem)
    gm = ep.module()
    t0 = time.perf_counter()
    (build,) = builds_for(layout, device.type, decode_attention=opts.decode_attention, inductor=opts.inductor)
    # (lowered by the rank's pipeline: its KV cache held as its slice, the rank's heads only)
    prog, build, held = tp_rank_lowered(gm, layout, rank,
                                        SplitConfig(policy=POLICIES[opts.policy], graph_name="dynamo"),
                                        device, build, list(examples))
    log.info("afd: rank %d: %s program in %.1fs", rank, layout, time.perf_counter() - t0)
    compiled = PerLayout(prog, key, opts.inductor, cudagraphs, f"rank {rank} tp", static, build=build)

    def run(*user: torch.Tensor) -> Any:
        shapes = tuple(tuple(x.shape) for x in user)
        inputs = bind_inputs(held, user) if held else user
        if layout.attn_dp == 1:
            out = compiled(shapes, *inputs)
        else:
            step = dp_step_counts(user, layout, rank)  # one small all-gather per step
            with step_counts(step):
                out = compiled((shapes, step.counts), *inputs, torch.empty(step.total, 0, device=device))
        return bind_outputs(held, user, out) if held else out

    return run


def _afd_runner(ep: torch.export.ExportedProgram, opts: BackendOptions, rank: int, world: int, key: str,
                cudagraphs: bool | None, device: torch.device, gm: fx.GraphModule | None,
                static: Sequence[int] = ()) -> Callable[..., Any]:
    from ..deploy import make_worker
    from ..layout import AFDLayout
    from ..passes.roles import POLICIES
    from ..runtime import AttentionWorker
    from ..split_api import SplitConfig

    layout, afd = opts.layout(), opts.afd  # (check_options: a valid AFD layout)
    assert isinstance(layout, AFDLayout) and afd is not None
    from ..comm import wire_checks_from_env

    check = wire_checks_from_env() if afd.check_wire is None else afd.check_wire
    if check and cudagraphs is not False:
        raise BackendOptionError(
            f"afd backend: rank {rank}: wire checks (check_wire / AFD_CHECK_WIRE=1) compare headers on the host, "
            "which a CUDA graph cannot capture nor replay; pass cudagraphs=False with them, or turn them off")
    config = SplitConfig(policy=POLICIES[opts.policy], graph_name="dynamo", comm_id=opts.comm_id)

    def before_groups() -> Any:  # every rank built its program (or one refused): then the groups
        agree_first(opts)
        if opts.timeout_s is None:
            return None
        from ..runtime import process_group

        return process_group(range(world), opts.timeout_s)  # (of its own, with the asked-for timeout)

    role = layout.role_of(rank)[0]
    buckets = afd.token_buckets
    build = rank_build(layout, rank, afd.stages, device.type, decode_attention=opts.decode_attention,
                       inductor=opts.inductor, fixed_slot=buckets is not None and buckets.fixed)
    eager = ffn_step_ops() if afd.ffn_capture == "compute" else ()
    by_step = afd.ffn_capture == "all"

    def wrap(prog: fx.GraphModule) -> Callable[..., Any]:  # one compiled program per input shapes
        compiled = PerLayout(prog, key, opts.inductor, cudagraphs, f"rank {rank} attention", static, build=build)
        return lambda *x: compiled(tuple(tuple(t.shape) for t in x), *x)

    def wrap_ffn(prog: fx.GraphModule) -> Callable[..., Any]:  # see ffn_key: what a program is compiled per
        compiled = PerLayout(prog, key, opts.inductor, cudagraphs, f"rank {rank} ffn", eager_ops=eager,
                             step_graphs=by_step, build=build)
        if prog is worker.program:
            _say_ffn_capture(compiled, rank)
        return lambda *slots: compiled(ffn_key(compiled, worker, slots), *slots)

    # (every program of the worker, each stage count's too, lowered by the rank's pipeline; each
    # compiled by the wrap when it first runs)
    worker = make_worker(ep.module(), layout, rank, config, device=device, check_wire=check,
                         stages=afd.stages, symm_mem=opts.symm_mem, buckets=buckets,
                         before_groups=before_groups, lowering=build, wrap=wrap_ffn if role == "ffn" else wrap,
                         finish_at_shutdown=True)  # (shutdown() tells the FFN rank, if finish() was not called)
    if isinstance(worker, AttentionWorker):
        return _padded_step(worker, afd.batch_buckets, device, cudagraphs, static, rank)
    from ..runtime import serve_at_shutdown

    serve_at_shutdown(worker)  # runtime.shutdown() hears the peers stop
    for prog in (worker.program, *worker.staged.values()):
        STATS["exchanges_fused"] += len(prog.meta[LOWERED_KEY].get("fuse_send_recv", ()))
    worker.program_for(1)  # (its program's capture settings checked now, not at the first step)
    outs = [n for n in (gm or ep.graph_module).graph.nodes if n.op == "output"][0].args[0]
    n_out = len(outs) if isinstance(outs, (list, tuple)) else 1

    def serve_one(*user: torch.Tensor) -> Any:
        worker.serve_one()
        empty = torch.empty(0, device=device)
        return tuple(empty for _ in range(n_out)) if isinstance(outs, (list, tuple)) else empty

    serve_one.worker = worker  # type: ignore[attr-defined]
    return serve_one


def _padded_step(worker: Any, value: Any, device: torch.device, cudagraphs: bool | None, static: Sequence[int],
                 rank: int) -> Callable[..., Any]:
    """The attention worker's step, its batch padded to a bucket of sequences (pad_batch.py) when
    option ``batch_buckets`` asks for it ("auto": the default buckets when its program is captured
    in CUDA graphs); a step whose padded tokens a fixed wire slot cannot hold runs as it came."""
    from ..buckets import TokenBuckets
    from ..deploy import batch_pad
    from ..runtime import GroupSlice
    from ..runtime.pad_batch import BatchPad

    if value == "auto":
        value = device.type == "cuda" and cudagraphs is not False
    buckets = TokenBuckets.parse(value)
    pad = batch_pad(worker.program, buckets, static) if buckets is not None else None
    if isinstance(pad, str):
        log.info("afd: rank %d attention: its batch is not padded to capture sizes: %s", rank, pad)
    if not isinstance(pad, BatchPad):
        return worker.step
    count = worker.count_tokens.total if isinstance(worker.count_tokens, GroupSlice) else worker.count_tokens
    slot = worker.comm.fixed_slot

    def step(*inputs: Any) -> Any:
        padded, batch = pad.pad(inputs)
        if slot is not None and count(padded) > slot:
            padded = list(inputs)
        STATS["batches_padded"] += any(p is not x for p, x in zip(padded, inputs, strict=True))
        return pad.cut(worker.step(*padded), batch)

    return step


def _say_ffn_capture(compiled: PerLayout, rank: int) -> None:
    if compiled.eager_ops:
        log.info("afd: rank %d ffn: the exchange with the attention peers (and the FFN group's collectives) runs "
                 "between CUDA graphs: one captured program per bucket of rows, its pieces replayed and the exchange "
                 "run on the host each step", rank)
    if compiled.step_graphs:
        log.info("afd: rank %d ffn: one program compiled per bucket of rows, one CUDA graph (the exchange in it) "
                 "captured per tuple of the peers' sizes: a step is one replay", rank)


def ffn_step_ops() -> tuple[str, ...]:
    """The FFN program's ops that read a step's per-peer (and FFN group) sizes when they run: the
    exchange with the attention peers and the group collectives that split tokens by rank. With
    ``ffn_capture="compute"`` they run between the captured pieces."""
    from ..collectives import COLLECTIVE_OPS
    from ..ops import AFD_OPS, LOWERED_OPS

    fixed = {torch.ops.afd.all_reduce.default, torch.ops.afd.all_gather_last.default}  # (shapes fixed by the input)
    # (and a fixed slot's real rows: which peers are live is read when it runs)
    ops = AFD_OPS + LOWERED_OPS + COLLECTIVE_OPS + (torch.ops.afd.slot_rows.default,)
    return tuple(sorted({op._schema.name for op in ops if op not in fixed}))


def ffn_key(compiled: PerLayout, worker: Any, carriers: Sequence[torch.Tensor]) -> tuple:
    """What an FFN program is compiled per: the sizes of its carriers (its exchange reads the
    per-peer sizes when it runs: uncaptured, or between the captured pieces), so one per bucket of
    its rows; with ``step_graphs`` (``ffn_capture="all"``) that and the step's per-peer counts,
    which its CUDA graphs (the receives inside) are captured per."""
    rows = ("carriers", tuple(int(c.shape[0]) for c in carriers))
    return (rows, ("peers", worker.step_counts)) if compiled.step_graphs else rows


def _ffn_export(model: torch.nn.Module, example_inputs: tuple | None,
                example_kwargs: dict[str, Any] | None) -> torch.export.ExportedProgram:
    """The FFN rank's graph of ``model``: the same layers and MLPs the attention ranks' graphs
    hold, exported with every input dim of size >= 2 dynamic (the FFN program's token count is
    symbolic). Default example: ``input_ids`` of shape (2, 4) without a cache (``use_cache=False``),
    the call of a transformers causal LM; other models pass ``example_inputs``."""
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    module = model
    if example_inputs is None and example_kwargs is None:
        if not hasattr(model, "config"):
            raise BackendOptionError(
                f"afd serve: {type(model).__name__} is not a transformers model (no .config); pass "
                "example_inputs (a tuple of tensors the model's forward takes, of the kind the attention ranks pass)")
        from ..models import LogitsOnly

        module = LogitsOnly(model)
        example_inputs = (torch.zeros(2, 4, dtype=torch.long, device=device),)
    args = tuple(example_inputs or ())
    kwargs = dict(example_kwargs or {})

    def dims(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return {d: torch.export.Dim.AUTO for d, n in enumerate(x.shape) if n >= 2} or None
        return None

    shapes = (tuple(dims(a) for a in args), {k: dims(v) for k, v in kwargs.items()})
    with torch.no_grad():
        if kwargs:
            return torch.export.export(module, args, kwargs, dynamic_shapes=shapes)
        return torch.export.export(module, args, dynamic_shapes=shapes[0])


def serve(model: torch.nn.Module, options: dict[str, Any], example_inputs: tuple | None = None,
          example_kwargs: dict[str, Any] | None = None) -> int:
    """Run an FFN rank of an AFD deployment: serve the attention ranks step by step until every
    one has finished (:func:`afd_compile.runtime.finish`, or its shutdown), whatever the number of
    steps and wherever each stops (EOS under ``generate()``); returns the steps served.

    ``options`` are the backend's (``attention``, ``ffn``, ``comm_id``, ``inductor``,
    ``cudagraphs``, ``timeout_s``, ``check_wire``, ``policy``), the same as the attention ranks'
    ``torch.compile(..., backend="afd", options=...)``. The FFN rank builds its program from its
    own export of ``model`` (see :func:`_ffn_export`): it never runs attention, so it allocates no
    KV cache; one program serves prefill and decode steps (compiled per token layout). What it
    refuses before its program is built reaches the attention ranks too (they stop at once)."""
    opts = check_options(options)
    _on_shutdown()
    begin_first(opts)
    try:
        return _serve(model, opts, example_inputs, example_kwargs)
    except Exception as e:  # (a refusal, or an error: torch's export, a bug) the peers are told
        tell_peers(e)
        raise


def _serve(model: torch.nn.Module, opts: BackendOptions, example_inputs: tuple | None,
           example_kwargs: dict[str, Any] | None) -> int:
    rank, world = opts.resolved()
    if opts.afd is None:
        raise BackendOptionError(f"afd serve: the options give no AFD layout (mode {opts.mode}); only an FFN rank of "
                                 f"an "
                                 "AFD deployment serves")
    afd = opts.afd
    role, _ = afd.layout().role_of(rank)
    if role != "ffn":
        raise BackendOptionError(f"afd serve: rank {rank} is an attention rank of layout attention={afd.attention}, "
                                 f"ffn={afd.ffn} (FFN ranks are 0..{afd.ffn - 1}); attention ranks run the model "
                                 "(generate()) and call afd_compile.runtime.finish() after it")
    import torch.distributed as dist

    if not dist.is_initialized():
        raise BackendOptionError("afd serve: needs torch.distributed initialised first "
                                 "(torchrun + afd_compile.runtime.init_distributed())")
    t0 = time.perf_counter()
    ep = _ffn_export(model, example_inputs, example_kwargs)
    log.info("afd: rank %d: exported the FFN rank's graph (%d nodes) in %.1fs", rank, len(ep.graph.nodes),
             time.perf_counter() - t0)
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    cudagraphs = (None if device.type == "cuda" else False) if opts.cudagraphs is None else opts.cudagraphs
    run = _afd_runner(ep, opts, rank, world, layout_key(opts, rank, world), cudagraphs, device, None)
    worker = run.worker  # type: ignore[attr-defined]
    steps = worker.serve()
    log.info("afd: rank %d: served %d steps; every attention peer finished", rank, steps)
    return steps


__all__ = ["HOST_SYNC_OPS", "STATS", "BackendOptionError", "BackendOptions", "PerLayout", "afd_backend",
           "check_options", "host_syncs", "is_static_address", "release", "returned_state", "serve", "source_id"]
