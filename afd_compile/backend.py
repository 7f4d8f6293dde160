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
    check_wire         AFD: a check header ahead of every transfer (default: AFD_CHECK_WIRE; see
                       afd_compile.comm.AFDCommunicator); every rank must agree; not with CUDA graphs
                       (the comparison runs on the host): needs cudagraphs=False on CUDA

Every option is checked (type, range, rank / world size against the live process group) before
anything runs: a wrong value is a BackendOptionError naming the option.

With no layout (or one process and ``tp=1``) the backend is Inductor itself, with a log line
saying no distribution was applied; with ``decode_attention="flex"`` it applies that pass alone
(one GPU, no distribution). On an FFN rank each call of the compiled model serves one
step for its attention peers (the inputs are ignored) and returns empty tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import math
import os
import re
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx import traceback as fx_traceback

from .errors import AFDCompileError
from .passes.graph_utils import get_attr_path, set_attr_path

log = logging.getLogger("afd_compile.backend")

@functools.cache
def source_id() -> str:
    """A hash of afd-compile's own source (every module of the package): part of the Inductor
    cache key, so a change to any pass, op or rule invalidates cached programs by itself (no
    hand-bumped version string)."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(root)):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]

#: counters of this process: graphs compiled per layout, calls, layouts seen
STATS: dict[str, int] = {"graphs": 0, "layouts_compiled": 0, "calls": 0, "no_layout": 0, "cudagraphs_off": 0}

#: ops that synchronise with the host inside (so a CUDA graph cannot capture them), and why
HOST_SYNC_OPS: dict[str, str] = {
    "transformers::grouped_mm_fallback": "copies the per-expert offsets to the host (transformers' MoE fallback "
                                         "for dtypes other than bf16 under torch.compile)",
    "afd::ep_dispatch": "exchanges per-rank token counts and sizes its outputs from them (MoE all-to-all)",
    "afd::ep_combine": "sizes its all-to-all from the dispatch's token counts on the host",
}


class BackendOptionError(AFDCompileError):
    pass


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

    from . import symm_mem

    for per_layout in list(_LIVE):
        per_layout.compiled.clear()
    symm_mem.release()
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


#: per option: (check, what it must be)
_OPTION_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tp": (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    "attn_dp": (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    "moe_a2a": (lambda v: isinstance(v, bool), "a bool"),
    "dense_dp": (lambda v: isinstance(v, bool), "a bool"),
    "vocab_parallel": (lambda v: isinstance(v, bool), "a bool"),
    "attention": (lambda v: _is_int(v) and v >= 0, "an int >= 0"),
    "ffn": (lambda v: _is_int(v) and v >= 0, "an int >= 0"),
    "rank": (lambda v: v is None or (_is_int(v) and v >= 0), "None or an int >= 0"),
    "world_size": (lambda v: v is None or (_is_int(v) and v >= 1), "None or an int >= 1"),
    "inductor": (lambda v: isinstance(v, bool), "a bool"),
    "cudagraphs": (lambda v: v is None or isinstance(v, bool), "None or a bool"),
    "policy": (lambda v: isinstance(v, str), "a str"),
    "comm_id": (lambda v: _is_int(v) and v >= 0, "an int >= 0"),
    "timeout_s": (lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                          and math.isfinite(v) and v > 0), "None or a finite number of seconds > 0"),
    "check_wire": (lambda v: v is None or isinstance(v, bool), "None or a bool"),
    "decode_attention": (lambda v: v in ("auto", "flex", "sdpa"), "'auto', 'flex' or 'sdpa'"),
    "stages": (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    "ffn_tp": (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    "ffn_ep": (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    "attn_tp": (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    "symm_mem": (lambda v: isinstance(v, bool), "a bool"),
}


@dataclass(frozen=True)
class BackendOptions:
    tp: int = 1
    attn_dp: int = 1
    moe_a2a: bool = False
    dense_dp: bool = False
    vocab_parallel: bool = False
    attention: int = 0
    ffn: int = 0
    rank: int | None = None
    world_size: int | None = None
    inductor: bool = True
    cudagraphs: bool | None = None
    policy: str = "default"
    comm_id: int = 0
    timeout_s: float | None = None
    check_wire: bool | None = None
    decode_attention: str = "auto"
    stages: int = 1
    ffn_tp: int = 1
    ffn_ep: int = 1
    attn_tp: int = 1
    symm_mem: bool = True

    @staticmethod
    def parse(options: dict[str, Any] | None) -> BackendOptions:
        options = dict(options or {})
        names = {f.name for f in dataclasses.fields(BackendOptions)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise BackendOptionError(f"afd backend: unknown option(s) {unknown}; known: {sorted(names)}")
        for name, value in options.items():
            ok, what = _OPTION_TYPES[name]
            if not ok(value):
                raise BackendOptionError(f"afd backend: option {name}={value!r} ({type(value).__name__}) must be {what}")
        opts = BackendOptions(**options)
        if opts.tp > 1 and (opts.attention or opts.ffn):
            raise BackendOptionError("afd backend: give either a TP layout (tp, attn_dp) or an AFD layout "
                                     "(attention, ffn), not both")
        if opts.attn_dp > 1 and opts.tp == 1:
            raise BackendOptionError(f"afd backend: attn_dp={opts.attn_dp} needs a TP layout (tp > 1)")
        if (opts.moe_a2a or opts.dense_dp) and opts.tp == 1:
            raise BackendOptionError("afd backend: moe_a2a / dense_dp need a TP layout (tp > 1)")
        if opts.vocab_parallel and opts.tp == 1:
            raise BackendOptionError("afd backend: vocab_parallel applies to a TP layout (tp > 1) only")
        if bool(opts.attention) != bool(opts.ffn):
            raise BackendOptionError(f"afd backend: AFD needs both attention and ffn ranks (attention="
                                     f"{opts.attention}, ffn={opts.ffn})")
        if opts.check_wire is not None and not opts.attention:
            raise BackendOptionError("afd backend: check_wire applies to an AFD layout (attention, ffn) only")
        for name in ("ffn_tp", "ffn_ep", "attn_tp"):
            if getattr(opts, name) > 1 and not opts.attention:
                raise BackendOptionError(f"afd backend: {name}={getattr(opts, name)} applies to an AFD layout "
                                         "(attention, ffn) only")
        if opts.stages > 1 and not opts.attention:
            raise BackendOptionError(f"afd backend: stages={opts.stages} applies to an AFD layout (attention, ffn) only")
        from .passes.roles import POLICIES

        if opts.policy not in POLICIES:
            raise BackendOptionError(f"afd backend: unknown policy {opts.policy!r} (known: {sorted(POLICIES)})")
        return opts

    @property
    def mode(self) -> str:
        return "afd" if self.attention else "tp" if self.tp > 1 or self.attn_dp > 1 else "none"

    def resolved(self) -> tuple[int, int]:
        """(rank, world size): the live process group's when there is one (a ``rank`` /
        ``world_size`` option must then agree with it), else the options, else RANK / WORLD_SIZE."""
        import torch.distributed as dist

        if dist.is_initialized():
            live = {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
            for name, value in live.items():
                given = getattr(self, name)
                if given is not None and given != value:
                    raise BackendOptionError(f"afd backend: option {name}={given}, but this process is {name} "
                                             f"{value} of the initialised process group")
            return live["rank"], live["world_size"]
        rank = self.rank if self.rank is not None else int(os.environ.get("RANK", "0"))
        world = self.world_size if self.world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        return rank, world


# --- lifting dynamo's graph -------------------------------------------------------------------

_SEGMENT = re.compile(r"(?:^|_)(?:modules|parameters|buffers)_")


#: dynamo's name prefixes of the compiled module's own inputs (``torch.compile(model)``: self;
#: ``torch.compile(model.forward)``: the bound method's module is its first argument) and of the
#: Python globals the model reads (``g_import_transformers_dot_activations_math_pi``: ``math.pi``
#: in GPT-2's GELU, a float dynamo passes as a 0-d tensor under dynamic=True)
#: (torch 2.11 names a config attribute read as
#: ``object_getattribute_l_self_modules_model_config_hidden_dropout_``: Falcon's dropout p)
_CONSTANT_SOURCE = re.compile(r"(?:^|_)l_(?:self|args_0)_|^g_", flags=re.IGNORECASE)


#: dynamo's source of a lifted parameter or buffer (``node.meta["grapharg"].source``): a root
#: (the compiled module under whatever name its ``forward`` gives ``self``, an argument, a global),
#: then the module tree: ``L['s']._modules['layers']._modules['0']._parameters['weight']``
_SOURCE_PATH = re.compile(r"((?:L|G)\['[^']+'\](?:\[\d+\])?)((?:\._modules\['[^']+'\])*)"
                          r"\._(?:parameters|buffers)\['([^']+)'\]")
_SOURCE_KEY = re.compile(r"\._modules\['([^']+)'\]")


def _source_of(p: fx.Node) -> str | None:
    """Dynamo's source of graph input ``p`` (``L['ids']``, ``L['self']._modules['head']...``)."""
    src = getattr(p.meta.get("grapharg"), "source", None)
    if src is None:
        return None
    name = src.name
    return name() if callable(name) else name  # (a method in older torch releases)


def _source_path(source: str | None) -> tuple[str, str] | None:
    """``(root, path)`` of a parameter or buffer's source:
    ``L['s']._modules['layers']._modules['0']._parameters['weight']`` -> ``("L['s']", "layers.0.weight")``."""
    m = _SOURCE_PATH.fullmatch(source) if source else None
    if m is None:
        return None
    parts = [*_SOURCE_KEY.findall(m.group(2)), m.group(3)]
    return (m.group(1), ".".join(parts)) if all(x.isidentifier() or x.isdigit() for x in parts) else None


def _module_path(placeholder: str) -> str | None:
    """``l_self_modules_model_modules_layers_modules_0_modules_q_proj_parameters_weight_`` ->
    ``model.layers.0.q_proj.weight`` (dynamo's names for lifted parameters and buffers; also
    ``l_args_0_...`` when ``model.forward`` was compiled)."""
    m = re.fullmatch(r"l_(?:self|args_0)_(.*)_", placeholder, flags=re.IGNORECASE)
    if not m or not re.search(r"_(parameters|buffers)_", m.group(1)):
        return None
    parts = [p for p in _SEGMENT.split(m.group(1)) if p]
    return ".".join(parts) if all(p.isidentifier() or p.isdigit() for p in parts) else None


class _Lifted(torch.nn.Module):
    """Dynamo's graph with its parameter/buffer inputs held as attributes again."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        super().__init__()
        self.gm = gm
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(example_inputs):
            raise RuntimeError(f"afd backend: {len(placeholders)} graph inputs but {len(example_inputs)} examples")
        # per graph input: ("attr", path) | ("user", i) | ("size", (i, d)) | ("const", value) | ("drop", None)
        self.slots: list[tuple[str, Any]] = []
        self.user_positions: list[int] = []
        #: graph inputs that are ints no input tensor carries (``logits_to_keep``): the program is
        #: compiled for their values (the caller compiles again for other values: ``const_key``)
        self.const_positions: list[int] = []
        #: inputs the graph updates in place or the caller marked as at a fixed address
        #: (``torch._dynamo.mark_static_address``: HF's static KV cache): exported with static shapes (a cache is allocated once; a head count
        #: must stay a constant for TP) and compiled as static inputs (CUDA graphs neither copy nor
        #: refuse their in-place updates); another shape compiles again (``const_key``)
        self.static_positions: list[int] = []
        used: set[str] = set()
        # the module's parameters and buffers by dynamo's sources (whatever the module's forward
        # names its self), else by dynamo's placeholder names (l_self_modules_...); a 0-d input read
        # off the module (the roots its parameters hang from) or a global is a constant below
        sources = [_source_of(p) for p in placeholders]
        roots = {found[0] for found in map(_source_path, sources) if found is not None}
        for i, (p, x) in enumerate(zip(placeholders, example_inputs, strict=True)):
            found = _source_path(sources[i])
            path = found[1] if found is not None else _module_path(p.name)
            of_model = bool(_CONSTANT_SOURCE.search(p.name)) or (sources[i] is not None and (
                sources[i].startswith("G[") or any(sources[i].startswith(r) for r in roots)))
            if isinstance(x, torch.Tensor) and path is not None and path not in used:
                used.add(path)
                set_attr_path(self, path, x)
                self.slots.append(("attr", path))
            elif isinstance(x, torch.Tensor) and x.dim() == 0 and of_model and (_only_item(p) or not p.users):
                # a float module attribute (an RMSNorm eps) or global (math.pi) dynamo passes as a
                # 0-d tensor under dynamic=True: a constant of this graph, never a symbolic float
                # that export would make unbacked (or that would cross an AFD cut as a scalar)
                for u in list(p.users):
                    u.replace_all_uses_with(x.item())
                    gm.graph.erase_node(u)
                self.slots.append(("drop", None))
            elif isinstance(x, torch.Tensor):
                if is_static_address(x) or _mutated_in_place(p):
                    self.static_positions.append(i)
                self.slots.append(("user", len(self.user_positions)))
                self.user_positions.append(i)
            else:
                self.slots.append(("size", None))
        gm.recompile()
        # a SymInt input (dynamo's automatic dynamic shapes) is read back from a user tensor's size
        user_vals = [placeholders[i].meta.get("example_value") for i in self.user_positions]
        for k, (kind, _) in enumerate(self.slots):
            if kind != "size":
                continue
            sym = placeholders[k].meta.get("example_value")
            found = next(((u, d) for u, v in enumerate(user_vals) if isinstance(v, torch.Tensor)
                          for d, s in enumerate(v.shape) if isinstance(s, torch.SymInt) and isinstance(sym, torch.SymInt)
                          and s.node.expr == sym.node.expr), None)
            if found is not None:
                self.slots[k] = ("size", found)
            elif isinstance(example_inputs[k], (int, torch.SymInt)):
                # an int argument dynamo made symbolic: a constant of this program
                self.slots[k] = ("const", _hint(example_inputs[k]))
                self.const_positions.append(k)
            else:
                raise RuntimeError(f"afd backend: graph input {placeholders[k].name} ({type(example_inputs[k]).__name__})"
                                   " is neither a tensor, a size of one, nor an int")

    def const_key(self, args: Sequence[Any]) -> tuple:
        """What this program was compiled for, read from a call's args: the values of the int
        inputs, the shapes of the static-address ones."""
        return (tuple(int(args[k]) for k in self.const_positions),
                tuple(tuple(args[k].shape) for k in self.static_positions))

    def forward(self, *user: torch.Tensor) -> Any:
        args = []
        for kind, ref in self.slots:
            if kind == "attr":
                args.append(get_attr_path(self, ref))
            elif kind == "user":
                args.append(user[ref])
            elif kind == "drop":
                args.append(None)
            elif kind == "const":
                args.append(ref)
            else:
                u, d = ref
                args.append(user[u].shape[d])
        # run node by node with each node's meta current: the export records dynamo's
        # nn_module_stack (module paths: the layers the role policy reads) on the ATen nodes,
        # which running the generated code would lose
        with fx_traceback.preserve_node_meta():
            return fx.Interpreter(self.gm).run(*args)


def is_static_address(x: torch.Tensor) -> bool:
    """Marked with ``torch._dynamo.mark_static_address`` (transformers does it for its static KV cache)."""
    return bool(getattr(x, "_dynamo_static_input_type", None))


def _mutated_in_place(p: fx.Node) -> bool:
    """Does dynamo's graph update input ``p`` in place (``cache.index_copy_(...)``, ``n.add_(1)``)?"""
    def name(u: fx.Node) -> str:
        return u.target if isinstance(u.target, str) else getattr(u.target, "__name__", "")

    return any(u.op in ("call_method", "call_function") and u.args and u.args[0] is p and name(u).endswith("_")
               and not name(u).endswith("__") for u in p.users)


def _hint(x: int | torch.SymInt) -> int:
    return int(x.node.hint) if isinstance(x, torch.SymInt) else int(x)


def _only_item(p: fx.Node) -> bool:
    return bool(p.users) and all(u.op == "call_method" and u.target == "item" for u in p.users)


def _export(lifted: _Lifted, user_inputs: Sequence[torch.Tensor]) -> torch.export.ExportedProgram:
    """Export to ATen with the same dims dynamic as in dynamo's graph (``Dim.AUTO`` on every
    dim dynamo made symbolic; a static dynamo graph exports static)."""
    placeholders = [n for n in lifted.gm.graph.nodes if n.op == "placeholder"]
    shapes: list[Any] = []
    for i in lifted.user_positions:
        v = placeholders[i].meta.get("example_value")
        if i in lifted.static_positions:
            shapes.append(None)
            continue
        dyn = {d: torch.export.Dim.AUTO for d, s in enumerate(v.shape) if isinstance(s, torch.SymInt)} \
            if isinstance(v, torch.Tensor) else {}
        shapes.append(dyn or None)
    with torch.no_grad():
        return torch.export.export(lifted, tuple(user_inputs), dynamic_shapes=(tuple(shapes),))  # forward(*user)


def _is_dynamic(ep: torch.export.ExportedProgram) -> bool:
    return any(isinstance(s, torch.SymInt) for n in ep.graph.nodes if n.op == "placeholder"
               and isinstance(n.meta.get("val"), torch.Tensor) for s in n.meta["val"].shape)


# --- compiling per token layout ---------------------------------------------------------------


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
    from .passes.graph_utils import aliases_first_arg, writes_first_arg

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
    node, counted in ``STATS["cudagraphs_off"]``); True with such an op is an error."""

    def __init__(self, program: fx.GraphModule, cache_key: str, inductor: bool, cudagraphs: bool | None,
                 name: str, static: Sequence[int] = ()) -> None:
        self.program = program
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
        self.name = name
        self.compiled: dict[tuple, Callable[..., Any]] = {}
        self.compile_id = torch._guards.CompileContext.current_compile_id()  # dynamo's, when built in the backend
        self.static_inputs: int | None = None  # inputs Inductor keeps at fixed addresses (weights), once compiled
        _LIVE.add(self)

    def __call__(self, layout: tuple, *inputs: Any) -> Any:
        fn = self.compiled.get(layout)
        if fn is None:
            fn = self._compile(inputs)
            self.compiled[layout] = fn
            STATS["layouts_compiled"] += 1
            log.info("afd: %s: compiled layout %s (%d layouts so far)", self.name, layout, len(self.compiled))
        return fn(*inputs)

    def _compile(self, inputs: Sequence[Any]) -> Callable[..., Any]:
        if not self.inductor:
            return self.program
        from .passes.fuse_norm import lower_for_inductor
        from .passes.tp_rewrite import drop_export_guards

        drop_export_guards(self.program)
        lower_for_inductor(self.program)  # Inductor fuses each junction's add + RMSNorm into one kernel
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
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        t0 = time.perf_counter()
        patches = {"post_grad_custom_post_pass": _custom_pass(self.cache_key), "triton.cudagraphs": self.cudagraphs}
        # fake inputs with a shape env (static: one program per layout) so the FX graph cache applies
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
        except Exception:
            _dump_program(self.program, inputs, self.name)
            raise
        meta = context.fw_metadata
        self.static_inputs = len(meta.static_input_indices) if meta is not None else None
        log.info("afd: %s: Inductor compile %.1fs (%s static inputs)", self.name, time.perf_counter() - t0,
                 self.static_inputs)
        return fn

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
             f"{tuple(getattr(x, 'shape', ()))}" for n, x in zip(places, list(inputs) + [None] * len(places), strict=False)]
    with open(path, "w") as f:
        f.write("\n".join([f"# {name}: {len(places)} placeholders, {len(inputs)} inputs", *lines,
                            program.print_readable(print_output=False)]))
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

    keys = [*dict(program.named_parameters(remove_duplicate=False)), *dict(program.named_buffers(remove_duplicate=False))]
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


def _decode_attention(program: fx.GraphModule, opts: BackendOptions, name: str, device: torch.device) -> None:
    """The decode-attention pass on a rank's program (option ``decode_attention``: "flex", or
    "auto" on CUDA), logged."""
    if not (opts.decode_attention == "flex" or opts.decode_attention == "auto" and device.type == "cuda"):
        return
    from .passes.decode_attention import replace_decode_attention

    records = replace_decode_attention(program)
    if records:
        done = sum(r.replaced for r in records)
        left = sorted({r.why for r in records if not r.replaced})
        log.info("afd: %s: decode attention: %d of %d SDPA over the KV cache run as FlexAttention%s", name, done,
                 len(records), f" (left: {'; '.join(left)})" if left else "")


def _layout_key(opts: BackendOptions, rank: int, world: int) -> str:
    fields = (source_id(), torch.__version__, opts.mode, rank, world,
              sorted((k, v) for k, v in dataclasses.asdict(opts).items() if k not in ("rank", "world_size", "timeout_s")))
    return hashlib.sha256(repr(fields).encode()).hexdigest()


def _device_of(xs: Sequence[Any]) -> torch.device:
    return next((x.device for x in xs if isinstance(x, torch.Tensor)), torch.device("cpu"))


def check_options(options: dict[str, Any] | None) -> BackendOptions:
    """Every check of the options that needs no graph: types and ranges, the layout itself, the
    live process group against it (initialised, rank and world size). Raises BackendOptionError.
    :func:`afd_compile.compile` runs it before ``torch.compile``, so a bad option is one error in the
    caller's frame, not a failure dynamo wraps at the first call."""
    import torch.distributed as dist

    opts = BackendOptions.parse(options)
    rank, world = opts.resolved()
    if opts.mode != "none" and not dist.is_initialized():
        raise BackendOptionError(f"afd backend: layout {opts.mode} needs torch.distributed initialised on every "
                                 "rank first (torchrun + afd_compile.runtime.init_distributed())")
    if opts.mode == "tp" and opts.tp != world:
        raise BackendOptionError(f"afd backend: tp={opts.tp} must equal the world size ({world})")
    if opts.mode == "afd":
        from .layout import AFDLayout, LayoutError

        try:
            layout = AFDLayout(opts.attention, opts.ffn, opts.ffn_tp, opts.ffn_ep, opts.attn_tp)
        except LayoutError as e:
            raise BackendOptionError(f"afd backend: {e}") from None
        if layout.world_size != world:
            raise BackendOptionError(f"afd backend: attention={opts.attention} + ffn={opts.ffn} ranks must equal the "
                                     f"world size ({world})")
    return opts


def afd_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None,
                **kwargs: Any) -> Callable[..., Any]:
    """The ``afd`` dynamo backend (see the module docstring for the options)."""
    if kwargs:
        raise BackendOptionError(f"afd backend: unexpected arguments {sorted(kwargs)} (use options={{...}})")
    opts = check_options(options)
    rank, world = opts.resolved()
    STATS["graphs"] += 1
    if opts.mode == "none" and opts.decode_attention != "flex":
        STATS["no_layout"] += 1  # said once per process (as a warning), then per graph at INFO
        (log.warning if STATS["no_layout"] == 1 else log.info)(
            "afd: no layout given (tp=1, no attention/ffn ranks): no distribution applied; compiling "
            "with Inductor" if opts.inductor else "afd: no layout given: no distribution applied")
        if not opts.inductor:
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, list(example_inputs))
    device = _device_of(example_inputs)
    # None on CUDA: capture unless a program holds an op that cannot be captured (PerLayout)
    cudagraphs = (None if device.type == "cuda" else False) if opts.cudagraphs is None else opts.cudagraphs
    from torch._guards import tracing

    # export and the passes run in a context of their own: dynamo's tracing context (its fake
    # mode, its guards) belongs to the frame being compiled
    with tracing(None):
        run, lifted = _distribute(gm, example_inputs, opts, rank, world, device, cudagraphs)
    runs = {lifted.const_key(example_inputs): (run, lifted.user_positions)}

    def call(*args: Any) -> Any:
        STATS["calls"] += 1
        key = lifted.const_key(args)
        if key not in runs:  # an int argument with a value not compiled yet (dynamo made it symbolic)
            log.info("afd: rank %d: int inputs / static-address input shapes %s: compiling this graph for them",
                     rank, key)
            with tracing(None):  # (this call's args as examples: the first call's are not kept alive)
                new_run, new_lifted = _distribute(gm, list(args), opts, rank, world, device, cudagraphs)
            runs[key] = (new_run, new_lifted.user_positions)
        run, positions = runs[key]
        return run(*[args[i] for i in positions])

    return call


def _distribute(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions, rank: int, world: int,
                device: torch.device, cudagraphs: bool | None) -> tuple[Callable[..., Any], _Lifted]:
    lifted = _Lifted(gm, example_inputs)
    user = [example_inputs[i] for i in lifted.user_positions]
    t0 = time.perf_counter()
    ep = _export(lifted, user)
    log.info("afd: rank %d: exported dynamo graph (%d nodes) in %.1fs", rank, len(ep.graph.nodes),
             time.perf_counter() - t0)
    key = _layout_key(opts, rank, world)
    ffn_rank = opts.mode == "afd" and rank < opts.ffn
    if not _is_dynamic(ep) and (opts.attn_dp > 1 or ffn_rank):
        raise BackendOptionError(
            f"afd backend: rank {rank}: {'DP attention' if opts.attn_dp > 1 else 'an AFD FFN rank'} runs programs over a "
            "token count that changes per step (set by other ranks), so it needs a graph with a dynamic batch: "
            "torch.compile(model, backend='afd', dynamic=True, options=...), and a first call whose batch and "
            "sequence are >= 2 (dynamo specialises dims of size 0 and 1)")
    static = [lifted.user_positions.index(p) for p in lifted.static_positions]  # as program inputs
    if opts.mode == "none":  # one process: only the decode-attention pass
        prog = ep.module().to(device)
        _decode_attention(prog, opts, "one process", device)
        one = PerLayout(prog, key, opts.inductor, cudagraphs, "one process", static)
        run = lambda *x: one(tuple(tuple(t.shape) for t in x if isinstance(t, torch.Tensor)), *x)  # noqa: E731
    else:
        from .passes.roles import FusedLayerError, NoStructureError

        try:
            if opts.mode == "tp":
                run = _tp_runner(ep, opts, rank, world, key, cudagraphs, device, static, user)
            else:
                run = _afd_runner(ep, opts, rank, world, key, cudagraphs, device, gm, static)
        except FusedLayerError:
            raise
        except NoStructureError as e:
            raise NoStructureError(
                f"{e}. Each graph dynamo hands the backend must hold whole decoder layers: a graph break "
                "inside a layer (TORCH_LOGS=graph_breaks lists them; e.g. a data-dependent op such as "
                "torch.where or nonzero in an MoE's expert loop) splits it. "
                "torch._dynamo.config.capture_dynamic_output_shape_ops = True keeps such ops in the graph") from None
    return run, lifted


def _tp_runner(ep: torch.export.ExportedProgram, opts: BackendOptions, rank: int, world: int, key: str,
               cudagraphs: bool | None, device: torch.device, static: Sequence[int] = (),
               examples: Sequence[Any] = ()) -> Callable[..., Any]:
    from .comm import GROUP_ATTN_TP, GROUP_TP, register_group
    from .passes.local_state import hold_local_states
    from .passes.roles import POLICIES, annotate_roles
    from .passes.tp_rewrite import check_any_token_total, shard_for_rank
    from .runtime import dp_step_counts, tp_groups
    from .scatter import TPLayout
    from .state_store import bind_inputs, bind_outputs
    from .symm_mem import prepare_groups

    layout = TPLayout(opts.tp, opts.attn_dp, moe_a2a=opts.moe_a2a, dense_dp=opts.dense_dp,
                      vocab_parallel=opts.vocab_parallel)
    groups = tp_groups(world, [layout], timeout_s=opts.timeout_s)
    register_group(GROUP_TP, groups[("tp", layout.tp)])
    register_group(GROUP_ATTN_TP, groups[("attn", layout.attn_tp_group(rank))])
    prepare_groups({GROUP_TP: groups[("tp", layout.tp)], GROUP_ATTN_TP: groups[("attn", layout.attn_tp_group(rank))]},
                   device, opts.symm_mem)
    gm = ep.module()
    annotate_roles(gm, POLICIES[opts.policy], graph_name="dynamo")
    t0 = time.perf_counter()
    tp = shard_for_rank(gm, layout, rank, graph_name="dynamo")
    prog = tp.program.to(device)
    if layout.attn_dp > 1:
        check_any_token_total(prog, list(examples), f"rank {rank}")
    held = hold_local_states(prog, [s.node for s in tp.shards.states])  # the rank's heads only
    for h in held:
        log.info("afd: rank %d: KV cache %s", rank, h)
    _decode_attention(prog, opts, f"rank {rank} tp", device)
    log.info("afd: rank %d: %s program in %.1fs", rank, layout, time.perf_counter() - t0)
    compiled = PerLayout(prog, key, opts.inductor, cudagraphs, f"rank {rank} tp", static)

    def run(*user: torch.Tensor) -> Any:
        shapes = tuple(tuple(x.shape) for x in user)
        inputs = bind_inputs(held, user) if held else user
        if layout.attn_dp == 1:
            out = compiled(shapes, *inputs)
        else:
            counts = dp_step_counts(user, layout, rank)  # one small all-gather per step
            out = compiled((shapes, counts), *inputs, torch.empty(sum(counts), 0, device=device))
        return bind_outputs(held, user, out) if held else out

    return run


def _afd_runner(ep: torch.export.ExportedProgram, opts: BackendOptions, rank: int, world: int, key: str,
                cudagraphs: bool | None, device: torch.device, gm: fx.GraphModule | None,
                static: Sequence[int] = ()) -> Callable[..., Any]:
    from .deploy import make_worker
    from .layout import AFDLayout
    from .passes.roles import POLICIES
    from .runtime import AttentionWorker
    from .split_api import SplitConfig

    layout = AFDLayout(opts.attention, opts.ffn, opts.ffn_tp, opts.ffn_ep, opts.attn_tp)  # (check_options: valid)
    from .comm import wire_checks_from_env

    check = wire_checks_from_env() if opts.check_wire is None else opts.check_wire
    if check and cudagraphs is not False:
        raise BackendOptionError(
            f"afd backend: rank {rank}: wire checks (check_wire / AFD_CHECK_WIRE=1) compare headers on the host, "
            "which a CUDA graph cannot capture nor replay; pass cudagraphs=False with them, or turn them off")
    config = SplitConfig(policy=POLICIES[opts.policy], graph_name="dynamo", comm_id=opts.comm_id)
    group = None
    if opts.timeout_s is not None:  # a group of its own, with the asked-for timeout (one per process)
        from .runtime import process_group

        group = process_group(range(world), opts.timeout_s)
    worker = make_worker(ep.module(), layout, rank, config, device=device, group=group, check_wire=check,
                         stages=opts.stages, symm_mem=opts.symm_mem)
    if isinstance(worker, AttentionWorker):
        _decode_attention(worker.program, opts, f"rank {rank} attention", device)
        worker.comm.finish_at_shutdown = True  # runtime.shutdown() tells the FFN rank, if finish() was not called

        def wrap(prog: fx.GraphModule) -> Callable[..., Any]:  # one compiled program per input shapes
            compiled = PerLayout(prog, key, opts.inductor, cudagraphs, f"rank {rank} attention", static)
            return lambda *x: compiled(tuple(tuple(t.shape) for t in x), *x)

        worker.wrap = wrap
        return worker.step
    from .runtime import SERVE_AT_SHUTDOWN

    SERVE_AT_SHUTDOWN.append(worker)  # runtime.shutdown() hears the peers stop
    compiled_ffn = PerLayout(worker.program, key, opts.inductor, cudagraphs, f"rank {rank} ffn")
    # one compiled program per per-peer counts (and, in an FFN TP group, the group's counts)
    worker.run_program = lambda counts, *slots: compiled_ffn((counts, worker.group_counts), *slots)  # type: ignore[attr-defined]

    def wrap_ffn(prog: fx.GraphModule) -> Callable[..., Any]:
        # staged: one compiled program per tokens of each stage and peer (not only per stage:
        # a CUDA graph replays the per-peer receive sizes it captured)
        compiled = PerLayout(prog, key, opts.inductor, cudagraphs, f"rank {rank} ffn")
        return lambda *slots: compiled(worker.step_counts, *slots)

    worker.wrap = wrap_ffn
    outs = [n for n in (gm or ep.graph_module).graph.nodes if n.op == "output"][0].args[0]
    n_out = len(outs) if isinstance(outs, (list, tuple)) else 1

    def serve_one(*user: torch.Tensor) -> Any:
        worker.serve_one()
        empty = torch.empty(0, device=device)
        return tuple(empty for _ in range(n_out)) if isinstance(outs, (list, tuple)) else empty

    serve_one.worker = worker  # type: ignore[attr-defined]
    return serve_one


# --- an FFN rank under generate(): serve until every attention peer has finished ----------------


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
        from .models import LogitsOnly

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
    KV cache; one program serves prefill and decode steps (compiled per token layout)."""
    opts = check_options(options)
    rank, world = opts.resolved()
    if opts.mode != "afd":
        raise BackendOptionError(f"afd serve: options {options} give no AFD layout (attention, ffn); only an FFN "
                                 "rank of an AFD deployment serves")
    from .layout import AFDLayout

    role, _ = AFDLayout(opts.attention, opts.ffn, opts.ffn_tp, opts.ffn_ep, opts.attn_tp).role_of(rank)
    if role != "ffn":
        raise BackendOptionError(f"afd serve: rank {rank} is an attention rank of layout attention={opts.attention}, "
                                 f"ffn={opts.ffn} (FFN ranks are 0..{opts.ffn - 1}); attention ranks run the model "
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
    run = _afd_runner(ep, opts, rank, world, _layout_key(opts, rank, world), cudagraphs, device, None)
    worker = run.worker  # type: ignore[attr-defined]
    steps = worker.serve()
    log.info("afd: rank %d: served %d steps; every attention peer finished", rank, steps)
    return steps
