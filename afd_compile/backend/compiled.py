"""The per-layout compiled program cache: Inductor once per token layout, CUDA graphs and the
static inputs they read, the cache key (the package's source), and :func:`release`."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import re
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from ..pipeline import Build, lower, pipeline_id, source_id
from .options import BackendOptionError, BackendOptions

log = logging.getLogger("afd_compile.backend")


#: counters of this process: graphs compiled per layout, calls, layouts seen
STATS: dict[str, int] = {"graphs": 0, "layouts_compiled": 0, "calls": 0, "no_layout": 0, "cudagraphs_off": 0,
                         "exchanges_fused": 0, "graphs_captured": 0, "batches_padded": 0}


#: ops that synchronise with the host inside (so a CUDA graph cannot capture them), and why
HOST_SYNC_OPS: dict[str, str] = {
    "transformers::grouped_mm_fallback": "copies the per-expert offsets to the host (transformers' MoE fallback "
                                         "for dtypes other than bf16 under torch.compile)",
    "afd::ep_dispatch": "exchanges per-rank token counts and sizes its outputs from them (MoE all-to-all)",
    "afd::ep_combine": "sizes its all-to-all from the dispatch's token counts on the host",
}


#: every PerLayout of this process (weakly), so release() can drop their compiled programs
_LIVE: weakref.WeakSet[PerLayout] = weakref.WeakSet()


def release() -> None:
    """Drop every compiled program and CUDA graph of this process (call before destroying the
    process group: :func:`afd_compile.runtime.shutdown` does).

    NCCL cannot destroy a communicator while a CUDA graph that captured one of its operations is
    alive (``ncclCommDestroy`` waits for the graph's reference, pytorch/pytorch#115388), so a
    process that ran captured collectives and then calls ``destroy_process_group`` hangs at exit
    unless its graphs are freed first. This clears our per-layout programs, resets dynamo (which
    shuts down Inductor's CUDA graph trees) and collects the garbage.
    """
    import gc

    from .. import symm_mem

    for per_layout in list(_LIVE):
        per_layout.compiled.clear()
        per_layout.graphs.clear()
    symm_mem.release()
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _CacheKeyPass:
    """Carries everything the afd passes depend on into Inductor's FX graph cache key (as a
    custom post-grad pass that does nothing to the graph)."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, graph: fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return self.key


def _custom_pass(key: str) -> object:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class AFDKey(_CacheKeyPass, CustomGraphPass):  # type: ignore[misc]
        pass

    return AFDKey(key)


def host_syncs(program: fx.GraphModule) -> list[tuple[str, str]]:
    """(node, why) for every node of ``program`` a CUDA graph cannot capture (:data:`HOST_SYNC_OPS`)."""
    found = []
    for n in program.graph.nodes:
        if isinstance(n.target, torch._ops.OpOverload) and n.target.name() in HOST_SYNC_OPS:
            found.append((n.name, f"{n.target.name()} {HOST_SYNC_OPS[n.target.name()]}"))
    return found


def returned_state(program: fx.GraphModule) -> list[str]:
    """Outputs of ``program`` that it allocates and then updates in place (HF's static cache
    created by a compiled prefill step: ``zeros`` then ``index_copy_``, returned so the caller
    keeps it). A CUDA graph cannot produce them: its outputs live in its memory pool and the
    next replay overwrites them, while the caller reads them every later step. In-place writes
    and aliases are read from the ops' schemas (``graph_utils.writes_first_arg``)."""
    from ..passes.graph_utils import aliases_first_arg, writes_first_arg

    def step(n: fx.Node) -> bool:  # n writes or aliases its first argument
        return n.op == "call_function" and bool(n.args) and isinstance(n.args[0], fx.Node) and (
            writes_first_arg(n) or aliases_first_arg(n))

    def written(n: fx.Node) -> bool:  # written in place, directly or through a view (a TP rank's narrow)
        return any(step(u) and u.args[0] is n and (writes_first_arg(u) or written(u)) for u in n.users)

    out = next((n for n in program.graph.nodes if n.op == "output"), None)
    found = []
    for n in (torch.utils._pytree.tree_leaves(out.args) if out is not None else []):
        if not isinstance(n, fx.Node):
            continue
        base, wrote = n, False
        while step(base):  # a write returns the tensor it wrote; a view, the tensor it views
            wrote |= writes_first_arg(base)
            base = base.args[0]
        if base.op not in ("placeholder", "get_attr") and (wrote or written(base)):
            found.append(n.name)
    return found


class PerLayout:
    """One compiled program per token layout; compiled on first sight, never shared.

    ``cudagraphs``: True / False, or None for "capture unless the program holds an op that
    synchronises with the host" (then capture is off for this program, with a warning naming the
    node, counted in ``STATS["cudagraphs_off"]``); True with such an op is an error.

    ``eager_ops`` (``"namespace::name"``): ops that run between the captured pieces instead of
    inside a CUDA graph (Inductor's graph partition): ops reading per-step sizes when they run
    (an FFN rank's exchange), so one captured program serves every step of the same shapes.
    Kept in :attr:`eager_ops` only when the program is captured.

    ``step_graphs``: compile per layout without Inductor's CUDA graphs and capture the whole
    program by hand, one graph per ``(layout, step key)`` (call with that pair as the layout): an
    FFN rank's program compiled once per bucket of its rows, captured once per tuple of its peers'
    sizes (its exchange, inside the graph, replays the sizes it captured). A step key seen first
    runs the compiled program (the step's exchange happens then), then captures it (a capture runs
    nothing); every later step of that key is one replay. The graphs share one memory pool: they
    replay one at a time on one stream and nothing they return is read after another replays
    (an FFN program returns its last send's token). Kept only when the program is captured."""

    def __init__(self, program: fx.GraphModule, cache_key: str, inductor: bool, cudagraphs: bool | None,
                 name: str, static: Sequence[int] = (), eager_ops: Sequence[str] = (),
                 step_graphs: bool = False, build: Build | None = None, symbolic: bool = True) -> None:
        self.program = program
        #: compiled once for the program's own symbolic sizes (:func:`symbolic_inputs`), whatever
        #: the layout a call names; False (or a program that cannot be): once per layout
        held = symbolic_inputs(program) if symbolic and inductor else "not asked"
        self.symbolic = not isinstance(held, str)
        if isinstance(held, str) and held not in ("not asked", "no input size is symbolic (a static export)"):
            log.info("afd: %s: compiled once per token layout, not for a symbolic batch: %s", name, held)
        #: the pipeline the program was built by: what of its lowering is left runs at the first
        #: compile (a program built elsewhere: the Inductor lowering alone)
        self.build = build or Build("none", inductor=inductor)
        self.static = tuple(static)  # program inputs at fixed addresses (a KV cache): static for AOT / CUDA graphs
        self.cache_key = cache_key
        self.inductor = inductor
        syncs = host_syncs(program) if inductor and cudagraphs is not False else []
        if syncs and cudagraphs:
            raise BackendOptionError(f"afd backend: {name}: cudagraphs=True, but node {syncs[0][0]} cannot be captured "
                                     f"in a CUDA graph: {syncs[0][1]}")
        if syncs:
            STATS["cudagraphs_off"] += 1
            log.warning("afd: %s: no CUDA graphs for this program: node %s %s (%d such nodes); it runs compiled "
                        "without graph capture", name, syncs[0][0], syncs[0][1], len(syncs))
        state = returned_state(program) if inductor and cudagraphs is not False and not syncs else []
        if state and cudagraphs:
            raise BackendOptionError(f"afd backend: {name}: cudagraphs=True, but the program returns {state[0]}, a "
                                     "tensor it allocates and updates in place (a KV cache created in a prefill "
                                     "step): a CUDA graph's outputs are overwritten by its next replay")
        if state:
            STATS["cudagraphs_off"] += 1
            log.info("afd: %s: no CUDA graphs for this program: it returns %s, a tensor it allocates and updates in "
                     "place (a KV cache created in a prefill step), which a graph replay would overwrite", name,
                     state[0])
        self.cudagraphs = bool(cudagraphs is not False and not syncs and not state)
        self.eager_ops = tuple(eager_ops) if self.cudagraphs and inductor else ()
        self.step_graphs = bool(step_graphs and self.cudagraphs and inductor and not self.eager_ops)
        self.name = name
        self.compiled: dict[tuple, Callable[..., Any]] = {}
        #: step_graphs: (layout, step key) -> (graph, what its capture returned)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.pool: Any = None
        self.compile_id = torch._guards.CompileContext.current_compile_id()  # dynamo's, when built in the backend
        self.static_inputs: int | None = None  # inputs Inductor keeps at fixed addresses (weights), once compiled
        _LIVE.add(self)

    def __call__(self, layout: tuple, *inputs: Any) -> Any:
        if self.step_graphs:
            return self._replay(layout, inputs)
        return self._function(layout, inputs)(*inputs)

    def _function(self, layout: tuple, inputs: Sequence[Any]) -> Callable[..., Any]:
        fn = self.compiled.get(("symbolic",) if self.symbolic else layout)
        if fn is None:
            fn = self._compile(inputs)  # (may find the lowered program cannot compile symbolically)
            layout = ("symbolic",) if self.symbolic else layout
            self.compiled[layout] = fn
            STATS["layouts_compiled"] += 1
            log.info("afd: %s: compiled layout %s (%d layouts so far)", self.name, layout, len(self.compiled))
        return fn

    def _replay(self, key: tuple, inputs: Sequence[Any]) -> Any:
        """``step_graphs``: replay the graph of ``key`` = (layout, step key), or run this step
        and capture it (class docstring)."""
        hit = self.graphs.get(key)
        if hit is not None:
            hit[0].replay()
            return hit[1]
        fn = self._function(key[0], inputs)
        result = fn(*inputs)
        graph = torch.cuda.CUDAGraph()
        # thread_local, as Inductor's graph trees capture: another thread's CUDA calls (NCCL's
        # watchdog polling its events) must not invalidate this capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn(*inputs)
        self.pool = self.pool if self.pool is not None else graph.pool()
        self.graphs[key] = (graph, out)
        STATS["graphs_captured"] += 1
        log.info("afd: %s: captured a CUDA graph for %s (%d graphs so far)", self.name, key, len(self.graphs))
        return result

    def _compile(self, inputs: Sequence[Any]) -> Callable[..., Any]:
        if not self.inductor:
            return self.program
        lower(self.program, self.build)  # (its Inductor lowering: each junction's add + RMSNorm then one kernel)
        for n in list(self.program.graph.nodes):  # bound to symbols of the shape env that traced it, not the
            n.meta.pop("unbacked_bindings", None)  # compile's: data-dependent sizes are bound afresh
            if n.target == torch.ops.aten._assert_tensor_metadata.default and not n.users:
                # export's record of a traced dtype: no value for compiled code, and torch 2.11's Inductor
                # met one on a value of another dtype after its own passes (DeepSeek-V3's router)
                self.program.graph.erase_node(n)
        self.program.recompile()
        from torch._guards import TracingContext, tracing
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import PendingUnbackedSymbolNotFound, ShapeEnv

        t0 = time.perf_counter()
        patches = {"post_grad_custom_post_pass": _custom_pass(f"{self.cache_key}/{pipeline_id(self.build)}"),
                   "triton.cudagraphs": self.cudagraphs and not self.step_graphs}
        if self.eager_ops:  # (pieces between them captured apart; torch >= 2.9 has the option)
            patches |= {"graph_partition": True, "custom_should_partition_ops": list(self.eager_ops)}
        # fake inputs with a shape env so the FX graph cache applies: the program's own (its symbolic
        # sizes, as export traced them: one program for every batch), or static (one per layout)
        held = symbolic_inputs(self.program) if self.symbolic else None
        if isinstance(held, str):  # (its lowering left an input without a traced value)
            log.info("afd: %s: compiled once per token layout, not for a symbolic batch: %s", self.name, held)
            self.symbolic = False
        if isinstance(held, tuple):  # (on the inputs' device: a program built on the CPU runs on CUDA)
            mode, vals = held
            with mode:
                fake = [v.to(x.device) if isinstance(v, torch.Tensor) and isinstance(x, torch.Tensor)
                        and v.device != x.device else v for v, x in zip(vals, inputs, strict=False)]
        else:
            mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
            fake = [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x for x in inputs]
        # mark the program as dynamo's: AOT then takes its parameters and buffers as static inputs.
        # Without the mark it finds no static input, and every CUDA graph replay first copies every
        # weight into the graph's input buffers (measured on the GPU host: 41 copies, ~0.7 ms per
        # step of an 8B-shaped 4-layer TP2 program)
        self.program.meta.setdefault("dynamo_compile_id", self.compile_id)
        if "_param_name_to_source" in vars(self.program) and self.program._param_name_to_source is None:
            # torch 2.11's AOT cache key leaves this field behind as None after a compile; the next
            # layout's compile would then take the program for a dynamo graph without its sources
            del self.program._param_name_to_source
        context = TracingContext(mode)
        try:
            with inductor_config.patch(patches), tracing(context), torch.no_grad(), \
                    _static_inputs(self.program, self.static):
                fn = compile_fx(self.program, fake)
        except PendingUnbackedSymbolNotFound as e:
            if not isinstance(held, tuple):
                _dump_program(self.program, inputs, self.name)
                raise
            # (the traced shape environment holds data-dependent sizes its trace never bound: an EP
            # group's all-to-all row counts; a fresh one per layout binds them afresh)
            log.info("afd: %s: compiled once per token layout, not for a symbolic batch: its traced sizes hold "
                     "data-dependent ones the compile cannot bind (%s)", self.name, str(e).splitlines()[0][:120])
            self.symbolic = False
            return self._compile(inputs)
        except Exception:
            _dump_program(self.program, inputs, self.name)
            raise
        if isinstance(held, tuple) and _specialised(mode, fake):  # (its example sizes held: compile per layout)
            log.info("afd: %s: compiled once per token layout, not for a symbolic batch: the compile "
                     "specialised an input size to its example value", self.name)
            self.symbolic = False
            return self._compile(inputs)
        meta = context.fw_metadata
        self.static_inputs = len(meta.static_input_indices) if meta is not None else None
        log.info("afd: %s: Inductor compile %.1fs%s", self.name, time.perf_counter() - t0,
                 "" if self.static_inputs is None else f" ({self.static_inputs} inputs at static addresses: "
                 "weights and caches a CUDA graph reads in place)")
        return fn


def symbolic_inputs(program: fx.GraphModule) -> tuple[Any, list[Any]] | str:
    """The fake tensors ``program``'s inputs were traced with and their fake mode, when some input
    size is symbolic (a dynamic export: ``dynamic=True``, ``mark_dynamic``, dynamo's automatic
    dynamic shapes) and every input has one; else why not (the program compiles per layout)."""
    from torch._guards import detect_fake_mode

    places = [n for n in program.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("val") for n in places]
    if not any(isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape) for v in vals):
        return "no input size is symbolic (a static export)"
    missing = [n.name for n, v in zip(places, vals, strict=True) if v is None]
    if missing:  # (a staged attention program traced with fewer than two sequences a stage: its carriers)
        return f"input {missing[0]} has no traced value"
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None or mode.shape_env is None:
        return "its inputs' fake tensors have no shape environment"
    return mode, vals


def _specialised(mode: Any, fakes: Sequence[Any]) -> bool:
    """Whether compiling fixed a symbolic input size of ``fakes`` to a number (a size traced as 1,
    say): the program would then hold that size, which nothing checks when it runs."""
    env = mode.shape_env
    for v in fakes:
        if isinstance(v, torch.Tensor):
            for d in v.shape:
                if isinstance(d, torch.SymInt) and env.replace(d.node.expr).is_number:
                    return True
    return False


def _dump_program(program: fx.GraphModule, inputs: Sequence[Any], name: str) -> None:
    """With ``AFD_DUMP_DIR`` set: the program Inductor could not compile, and what it was called
    with (each placeholder beside its input's dtype and shape), as ``<dir>/<name>.py``."""
    folder = os.environ.get("AFD_DUMP_DIR")
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, re.sub(r"[^\w.-]+", "_", name) + ".py")
    places = [n for n in program.graph.nodes if n.op == "placeholder"]
    lines = [f"# {n.name}: program {getattr(n.meta.get('val'), 'dtype', '?')} "
             f"{tuple(getattr(n.meta.get('val'), 'shape', ()))}; input {getattr(x, 'dtype', type(x).__name__)} "
             f"{tuple(getattr(x, 'shape', ()))}"
             for n, x in zip(places, list(inputs) + [None] * len(places), strict=False)]
    with open(path, "w") as f:
        f.write(
            "\n".join(
                [
                    f"# {name}: {len(places)} placeholders, {len(inputs)} inputs",
                    *lines,
                    program.print_readable(print_output=False),
                ]
            )
        )
    log.error("afd: %s: Inductor failed; the program and its inputs are in %s", name, path)


@contextlib.contextmanager
def _static_inputs(program: fx.GraphModule, positions: Sequence[int]) -> Iterator[None]:
    """While compiling, the program's inputs at ``positions`` (static-address tensors: a KV cache)
    are static inputs for AOT and CUDA graphs, as dynamo marks them for its own graphs: AOT reads
    them from dynamo's metadata (``_param_name_to_source``, each placeholder's ``_dynamo_source``
    and ``tensor_dict``), which this sets on the program and removes afterwards. Weights stay
    static. Without it a CUDA graph refuses a program that updates its cache in place."""
    if not positions:
        yield
        return
    from torch._dynamo.source import ConstantSource

    keys = [
        *dict(program.named_parameters(remove_duplicate=False)),
        *dict(program.named_buffers(remove_duplicate=False)),
    ]
    program._param_name_to_source = {k: ConstantSource(f"afd_weight_{j}") for j, k in enumerate(keys)}
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    for pos, node in enumerate(placeholders):
        node._dynamo_source = ConstantSource(f"afd_input_{pos}")
        if pos in positions:
            node.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
    try:
        yield
    finally:
        for node in placeholders:
            node.meta.pop("tensor_dict", None)
            if hasattr(node, "_dynamo_source"):
                del node._dynamo_source
        if "_param_name_to_source" in vars(program):
            del program._param_name_to_source


def layout_key(opts: BackendOptions, rank: int, world: int) -> str:
    fields = (
        source_id(),
        torch.__version__,
        opts.mode,
        rank,
        world,
        sorted((k, v) for k, v in dataclasses.asdict(opts).items() if k not in ("rank", "world_size", "timeout_s")),
    )
    return hashlib.sha256(repr(fields).encode()).hexdigest()
