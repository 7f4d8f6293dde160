"""The pass pipeline of each rank kind: which passes build what a rank runs, in which order.

Four rank kinds (:data:`RANK_KINDS`): an AFD attention rank, an AFD FFN rank, a TP rank and a
process with no layout. Each has one ordered list of named passes (:data:`PIPELINES`) in two
stages:

- **portable**: what ``rewrite`` writes and ``verify`` checks by default (MoE recognition, roles,
  the cut or the shard, stages, FFN groups); the same on every device;
- **lowering**: what the backend runs on top for its device and options (the rank's KV cache as
  its slice, decode attention over the cache, the router's top-k kernel, the FFN exchange as one
  op a layer, receives into buffers, the fused norm back to ATen for Inductor); ``verify
  --lowered`` runs it too, so what is checked is what the backend runs.

Every pass follows one convention: it changes the GraphModule it is given in place and returns
its record (what it did; an empty record when nothing matched). Whether a pass applies follows
from the :class:`Build` (the layout and options), never from the graph: a pass that applies and
finds nothing records that. ``plan --passes`` prints the lists (:func:`pipeline_table`), and the
backend's compile cache key folds in :func:`pipeline_id` (the applicable passes' names and the
package's source), as vLLM's pass manager folds each pass's uuid.

::

    build = Build("afd-ffn", device="cuda")
    [p.name for p in passes_for(build, "lowering")]
    # ['router_topk', 'fuse_send_recv', 'receive_into_buffers', 'drop_export_guards', 'lower_for_inductor']
    # (and 'mark_slot_rows' after 'router_topk' with Build(..., fixed_slot=True))
    records = lower(program, build)   # each applicable lowering pass, in order, in place
    # (the backend lowers a rank's programs when it builds them; PerLayout runs what is left,
    # the Inductor lowering of a program built elsewhere, at its first compile)
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from . import meta_keys

log = logging.getLogger("afd_compile.pipeline")

#: the rank kinds, each with its own pipeline
RANK_KINDS = ("afd-attention", "afd-ffn", "tp", "none")
STAGES = ("portable", "lowering")


@dataclass(frozen=True)
class Build:
    """What decides which passes a rank's pipeline runs: its kind and the layout's and options'
    facts the passes depend on (nothing else: two builds with equal fields run the same passes).

    ``device``: "cpu" or "cuda" (the lowering's kernels are CUDA's); ``stages``: micro-batches;
    ``attn_tp`` / ``ffn_tp`` / ``ffn_ep`` / ``fan_in``: attention TP group size, FFN TP and EP group
    sizes, the most attention peers an FFN rank serves (AFD);
    ``attn_dp``: a TP layout's attention DP groups; ``fixed_slot``: the attention ranks' wire is a
    fixed slot (buckets ``"fixed:C"``: runtime/slots.py);
    ``decode_attention``: the backend option ("auto" is FlexAttention on CUDA); ``inductor``:
    the program is compiled by Inductor (its lowering applies); ``moe_op``: with no layout,
    whether the MoE recognition runs (the backend's ``moe_experts``); ``states``: a TP rank's
    sharded KV caches (node names) the lowering holds as the rank's slice."""

    kind: str
    device: str = "cpu"
    stages: int = 1
    attn_tp: int = 1
    ffn_tp: int = 1
    ffn_ep: int = 1
    fan_in: int = 1
    attn_dp: int = 1
    decode_attention: str = "auto"
    inductor: bool = True
    moe_op: bool = True
    fixed_slot: bool = False
    states: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.kind not in RANK_KINDS:
            raise ValueError(f"Build: kind {self.kind!r} is not one of {RANK_KINDS}")

    @property
    def ffn_group(self) -> int:
        """The FFN group's size (TP x EP)."""
        return self.ffn_tp * self.ffn_ep

    @property
    def flex(self) -> bool:
        """Decode attention runs as FlexAttention (option ``decode_attention``)."""
        return self.decode_attention == "flex" or (self.decode_attention == "auto" and self.device == "cuda"
                                                   and self.kind != "none")


@dataclass(frozen=True)
class Pass:
    """One named pass of a pipeline: its stage, what it does, the ``node.meta`` / ``gm.meta`` keys
    it reads and writes, and when it applies (``applies`` decides, ``when`` says it in words)."""

    name: str
    stage: str
    does: str
    meta: str = ""
    when: str = "always"
    applies: Callable[[Build], bool] = field(default=lambda b: True, compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.name} [{self.stage}]"


def _cuda(b: Build) -> bool:
    return b.device == "cuda"


# --- the passes, once each: a pipeline lists them by name -----------------------------------------

_PASSES: dict[str, Pass] = {p.name: p for p in (
    Pass("recognise_moe", "portable", "each MoE block's experts, whatever form, as one afd::moe_experts op",
         "writes gm.meta['afd.moe_records']", "under a layout; with none, moe_experts='op', or 'auto' on CUDA",
         lambda b: b.kind != "none" or b.moe_op),
    Pass("merge_head_pieces", "portable", "per-head modules over the heads split apart merged into one",
         "writes gm.meta['afd.merged_head_pieces']"),
    Pass("unpack_grouped_projections", "portable", "q/k/v packed per KV group unpacked into blocks",
         "writes gm.meta['afd.unpacked_projections']"),
    Pass("annotate_roles", "portable", "every node's layer and attention / FFN role (the router's side)",
         "writes node.meta['afd.role']"),
    Pass("plan_split", "portable", "the cut of each layer: what crosses, token dims (printable SplitPlan)",
         "reads afd.role"),
    Pass("build_attention_program", "portable", "the attention program: FFN regions replaced by send/recv",
         "reads afd.role"),
    Pass("build_ffn_program", "portable", "the FFN program: each layer's region between a group receive and send",
         "reads afd.role"),
    Pass("ffn_tokens_follow_the_carrier", "portable", "a static-token FFN program over any multiple of its tokens",
         "writes gm.meta['afd.token_multiple']", "the FFN rank fans in several peers or is FFN-TP (a no-op on a "
         "dynamic token count)", lambda b: b.fan_in > 1 or b.ffn_tp > 1),
    Pass("verify_schedule", "portable", "both programs' transfers in one order, every send paired"),
    Pass("attention_tp_program", "portable", "the attention program sharded over its attention TP group, MLPs "
         "SCATTERED, then cut", "writes afd.dist, afd.role", "attn_tp > 1",
         lambda b: b.attn_tp > 1),
    Pass("ffn_group_program", "portable", "the FFN program inside its FFN TP / EP group", "",
         "ffn_tp x ffn_ep > 1", lambda b: b.ffn_group > 1),
    Pass("stage_programs", "portable", "the program of each micro-batch count, with its ping-pong schedule checked",
         "", "stages > 1", lambda b: b.stages > 1),
    Pass("plan_tp", "portable", "per layer the scatter modes and junction collectives (TPPlan)", "reads afd.role"),
    Pass("annotate_dist_states", "portable", "every node's distribution state", "writes node.meta['afd.dist']"),
    Pass("plan_shards", "portable", "which weights split along which dim (ShardPlan)", "reads afd.role"),
    Pass("apply_shards", "portable", "the rank's slices of the weights and caches, on a copy", ""),
    Pass("vocab_parallel_head", "portable", "with vocab_parallel, the LM head split by vocabulary and its logits "
         "all-gathered; else the head found and left whole"),
    Pass("expert_parallel", "portable", "MoE experts split over the TP group (all-to-all), where planned"),
    Pass("rewrite_scattered_layers", "portable", "SCATTERED MLPs: their junctions' gathers and reduce-scatters"),
    Pass("rewrite_dp_attention", "portable", "DP attention: each group's tokens gathered and scattered back", "",
         "attn_dp > 1", lambda b: b.attn_dp > 1),
    Pass("insert_all_reduces", "portable", "standard TP: the all-reduce of each planned junction", "",
         "attn_dp == 1", lambda b: b.attn_dp == 1),
    Pass("fuse_norm", "portable", "all-reduce + residual add + RMSNorm as one op", "",
         "attn_dp == 1", lambda b: b.attn_dp == 1),
    Pass("hold_local_states", "lowering", "the rank's KV cache taken and allocated as its slice (HeldState)",
         "", "a sharded KV cache", lambda b: bool(b.states)),
    Pass("replace_decode_attention", "lowering", "SDPA over a static KV cache as FlexAttention over filled blocks",
         "", "decode_attention='flex', or 'auto' on CUDA under a layout", lambda b: b.flex),
    Pass("router_topk", "lowering", "an MoE router's top-k over few experts as afd::router_topk", "", "CUDA",
         _cuda),
    Pass("mark_slot_rows", "lowering", "a fixed slot's padded rows given no expert (from the headers' counts, on "
         "the device)", "writes node.meta['afd.slot_rows']", "a fixed slot (buckets 'fixed:C')",
         lambda b: b.fixed_slot),
    Pass("fuse_send_recv", "lowering", "each layer's send and the next layer's receive as one batched op"),
    Pass("receive_into_buffers", "lowering", "every receive into buffers the program allocates"),
    Pass("drop_export_guards", "lowering", "torch.export's input-shape guard call removed (the caller's guards "
         "stand)", "", "Inductor", lambda b: b.inductor),
    Pass("lower_for_inductor", "lowering", "each fused all-reduce + add + RMSNorm back to its ops for Inductor to "
         "fuse", "", "Inductor", lambda b: b.inductor),
)}

_SPLIT = ("recognise_moe", "annotate_roles", "plan_split", "build_attention_program", "build_ffn_program")
_INDUCTOR = ("drop_export_guards", "lower_for_inductor")

#: each rank kind's passes in order, both stages
PIPELINES: dict[str, tuple[Pass, ...]] = {kind: tuple(_PASSES[n] for n in names) for kind, names in {
    "afd-attention": (*_SPLIT, "verify_schedule", "attention_tp_program", "stage_programs",
                      "router_topk", "replace_decode_attention", *_INDUCTOR),
    "afd-ffn": (*_SPLIT, "ffn_tokens_follow_the_carrier", "verify_schedule", "stage_programs", "ffn_group_program",
                "router_topk", "mark_slot_rows", "fuse_send_recv", "receive_into_buffers", *_INDUCTOR),
    "tp": ("recognise_moe", "merge_head_pieces", "unpack_grouped_projections", "annotate_roles", "plan_tp",
           "annotate_dist_states",
           "plan_shards", "apply_shards", "vocab_parallel_head", "expert_parallel", "rewrite_scattered_layers",
           "rewrite_dp_attention", "insert_all_reduces", "fuse_norm",
           "hold_local_states", "router_topk", "replace_decode_attention", *_INDUCTOR),
    "none": ("recognise_moe", "router_topk", "replace_decode_attention", *_INDUCTOR),
}.items()}


def passes_for(build: Build, stage: str | None = None) -> list[Pass]:
    """The passes ``build``'s rank runs, in order (``stage``: only that stage's)."""
    if stage is not None and stage not in STAGES:
        raise ValueError(f"passes_for: stage {stage!r} is not one of {STAGES}")
    return [p for p in PIPELINES[build.kind] if (stage is None or p.stage == stage) and p.applies(build)]


@functools.cache
def source_id() -> str:
    """A hash of afd-compile's own source (every module of the package): part of the Inductor
    cache key, so a change to any pass, op or rule invalidates cached programs by itself (no
    hand-bumped version string)."""
    root = os.path.dirname(os.path.abspath(__file__))  # the package
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(root)):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


def pipeline_id(build: Build) -> str:
    """What a compiled program of ``build`` depends on besides its graph: the package's source
    and the passes that ran, in order (part of the backend's compile cache key)."""
    names = ",".join(p.name for p in passes_for(build))
    return hashlib.sha256(f"{source_id()}|{build.kind}|{names}".encode()).hexdigest()[:16]


# --- the lowering stage, run -------------------------------------------------------------------------

def _hold_local_states(gm: fx.GraphModule, build: Build) -> Any:
    from .passes.local_state import hold_local_states

    return hold_local_states(gm, list(build.states))


def _decode_attention(gm: fx.GraphModule, build: Build) -> Any:
    from .passes.decode_attention import replace_decode_attention

    return replace_decode_attention(gm)


def _router_topk(gm: fx.GraphModule, build: Build) -> Any:
    from .passes.moe.topk import use_router_topk

    return use_router_topk(gm)


def _slot_rows(gm: fx.GraphModule, build: Build) -> Any:
    from .passes.slot_rows import mark_slot_rows

    return mark_slot_rows(gm)


def _fuse_send_recv(gm: fx.GraphModule, build: Build) -> Any:
    from .passes.fuse_exchange import fuse_send_recv

    return fuse_send_recv(gm)


def _receive_into(gm: fx.GraphModule, build: Build) -> Any:
    from .passes.recv_into import receive_into_buffers

    return receive_into_buffers(gm)


def _drop_guards(gm: fx.GraphModule, build: Build) -> Any:
    from .passes.tp_rewrite import drop_export_guards

    drop_export_guards(gm)
    return None


def _lower_norms(gm: fx.GraphModule, build: Build) -> Any:
    from .passes.fuse_norm import lower_for_inductor

    return lower_for_inductor(gm)


def _decode_lines(record: Any) -> list[str]:
    left = sorted({r.why for r in record if not r.replaced})
    return [f"decode attention: {sum(r.replaced for r in record)} of {len(record)} SDPA over the KV cache run as "
            f"FlexAttention" + (f" (left: {'; '.join(left)})" if left else "")] if record else []


#: per lowering pass: how it runs on a program, and what its record says (log lines)
_LOWERING: dict[str, tuple[Callable[[fx.GraphModule, Build], Any], Callable[[Any], list[str]]]] = {
    "hold_local_states": (_hold_local_states, lambda r: [f"KV cache {held}" for held in r]),
    "replace_decode_attention": (_decode_attention, _decode_lines),
    "router_topk": (_router_topk, lambda r: [f"{len(r)} router top-k as afd::router_topk"] if r else []),
    "mark_slot_rows": (_slot_rows, lambda r: [f"{len(r)} experts ops skip a fixed slot's padded rows"] if r else []),
    "fuse_send_recv": (_fuse_send_recv, lambda r: [f"{len(r)} send/receive pairs as one op each (one batched call)"]),
    "receive_into_buffers": (_receive_into, lambda r: [f"{len(r)} receives into buffers"]),
    "drop_export_guards": (_drop_guards, lambda r: []),
    "lower_for_inductor": (_lower_norms, lambda r: [f"{r} fused all-reduce + add + RMSNorm lowered for Inductor"]
                           if r else []),
}

#: where a lowered program keeps what each lowering pass did (its record, by pass name)
LOWERED_KEY = meta_keys.LOWERED


def lower(gm: fx.GraphModule, build: Build, stop_before: str | None = None,
          log_as: str | None = None) -> dict[str, Any]:
    """Run ``build``'s lowering stage on ``gm``, in place, in order; each pass's record by name.
    ``stop_before``: a pass name; it and the passes after it are left for a later call. A pass
    already run on ``gm`` (its record in ``gm.meta[LOWERED_KEY]``) is not run again. ``log_as``:
    what each pass did is logged at INFO under this name (the rank and its program)."""
    names = [p.name for p in PIPELINES[build.kind]]
    if stop_before is not None and stop_before not in names:
        raise ValueError(f"lower: {stop_before!r} is not a pass of the {build.kind} pipeline")
    done: dict[str, Any] = gm.meta.setdefault(LOWERED_KEY, {})
    records: dict[str, Any] = {}
    for p in passes_for(build, "lowering"):
        if p.name == stop_before:
            break
        if p.name in done:
            continue
        records[p.name] = done[p.name] = _LOWERING[p.name][0](gm, build)
    if log_as is not None:
        for line in record_lines(records):
            log.info("afd: %s: %s", log_as, line)
    return records


def builds_for(layout: object, device: str = "cuda", stages: int = 1, decode_attention: str = "auto",
               inductor: bool = True, moe_op: bool = True, fixed_slot: bool = False) -> list[Build]:
    """The builds of every rank kind ``layout`` has (an ``AFDLayout``: its attention and FFN
    ranks; a ``TPLayout``: its ranks; None: one process, ``moe_op`` whether it recognises MoE
    blocks), for ``device`` and the options (``fixed_slot``: an AFD wire of fixed slots)."""
    from .layout import AFDLayout
    from .scatter import TPLayout

    common = {"device": device, "decode_attention": decode_attention, "inductor": inductor}
    if isinstance(layout, AFDLayout):
        return [Build("afd-attention", stages=stages, attn_tp=layout.attn_tp, fixed_slot=fixed_slot, **common),
                Build("afd-ffn", stages=stages, ffn_tp=layout.ffn_tp, ffn_ep=layout.ffn_ep,
                      fan_in=max(layout.block_sizes()), fixed_slot=fixed_slot, **common)]
    if isinstance(layout, TPLayout):
        return [Build("tp", attn_dp=layout.attn_dp, **common)]
    return [Build("none", moe_op=moe_op, **common)]


def rank_build(layout: object, rank: int, stages: int = 1, device: str = "cpu", **options: Any) -> Build:
    """The build of rank ``rank`` of ``layout`` (:func:`builds_for`: an AFD rank's role's, a TP
    rank's, one process's with no layout)."""
    from .layout import AFDLayout

    builds = builds_for(layout, device, stages, **options)
    return builds[layout.role_of(rank)[0] == "ffn"] if isinstance(layout, AFDLayout) else builds[0]


def pipeline_json(builds: Sequence[Build]) -> list[dict[str, Any]]:
    """``plan --passes --json``: each build's passes as records."""
    out = []
    for build in builds:
        applied = set(passes_for(build))
        out.append({"kind": build.kind, "build": _facts(build),
                    "passes": [{"name": p.name, "stage": p.stage, "applies": p in applied, "when": p.when,
                                "does": p.does, "meta": p.meta} for p in PIPELINES[build.kind]]})
    return out


def record_lines(records: dict[str, Any]) -> list[str]:
    """What each lowering pass of :func:`lower`'s ``records`` did, one line each."""
    return [line for name, record in records.items() for line in _LOWERING[name][1](record)]


def pipeline_table(builds: Sequence[Build]) -> str:
    """``plan --passes``: each build's passes, in order, one line each with its stage, whether it
    applies (and when it would) and what it does."""
    lines = []
    for build in builds:
        lines.append(f"{build.kind} ({_facts(build)}): + runs, - does not; portable: what rewrite writes and "
                     "verify checks, lowering: what the backend runs on top")
        applied = set(passes_for(build))
        width = max(len(p.name) for p in PIPELINES[build.kind])
        for p in PIPELINES[build.kind]:
            mark = "+" if p in applied else "-"
            cond = "" if p.when == "always" else f" [when {p.when}]"
            lines.append(f"  {mark} {p.stage:<8} {p.name:<{width}}  {p.does}{cond}")
    return "\n".join(lines)


def _facts(build: Build) -> str:
    out = [f"device {build.device}"]
    if build.stages > 1:
        out.append(f"stages {build.stages}")
    if build.attn_tp > 1:
        out.append(f"attn_tp {build.attn_tp}")
    if build.ffn_group > 1:
        out.append(f"FFN group {build.ffn_group}")
    if build.fixed_slot:
        out.append("fixed slot")
    out.append(f"decode_attention {build.decode_attention}")
    out.append("inductor" if build.inductor else "no inductor")
    return ", ".join(out)
