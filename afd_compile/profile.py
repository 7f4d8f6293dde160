"""``afd-compile profile``: the programs a layout's ranks run, timed on this machine's device.

From ``MODEL.pt2`` (an export with a dynamic batch, as the quick start's), on one device:

- the AFD split (1A1F: the programs of any A:F are the same per token, fan-in and groups change
  the rows), each role's program with its exchange taken out (``passes/loopback.py``) and put
  through its pipeline's lowering for the device, then compiled as the backend compiles
  (Inductor, on CUDA with CUDA graphs: ``mode="reduce-overhead"``);
- timed over a grid: the attention program at T sequences of one token (decode steps), the FFN
  program at R rows, the model with no layout at T, the LM head alone at T, and one layer's
  attention over a KV cache (``afd::decode_attention`` on CUDA, masked SDPA on CPU) at (batch,
  context);
- each program also with no layer (the residual stream passed through: ``keep_layers(gm, 0)``), at
  the first and last T, so its time splits into its layers and its call (what it costs once a step:
  graph launch, input copies, embedding, the head), which scale apart;
- written as JSON with the device, torch's version, the model's sha256 and the facts the cost model
  needs (layers, weight bytes per layer of each role, KV bytes per token, wire bytes per token).

``profile_read.read_profile`` checks one and turns it into the cost model's parts.
A deep model is timed on a few of its layers (``layers=K``: ``passes/keep_layers.py`` keeps each
program's first K layers of each kind, layers of a kind being identical in structure; their weights
alone go to the device) and the record keeps its depth; a model with layers of several kinds
(dense first layers, then MoE) has each kind timed alone too (``kinds``), which the estimate costs
kind by kind (``estimate.LayerKind``). Or an export of a few layers (its config with fewer) is profiled and
``plan --estimate --layers N`` scales it to the real depth.
"""

from __future__ import annotations

import datetime
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from .estimate import PROFILE_CONTEXTS as CONTEXTS
from .estimate import PROFILE_KV_BATCHES as KV_BATCHES
from .estimate import PROFILE_TOKENS as TOKENS
from .profile_read import PROFILE_FORMAT, ProfileError


def _bytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _attr_bytes(gm: fx.GraphModule) -> dict[str, int]:
    from .passes.graph_utils import get_attr_path

    return {n.target: _bytes(get_attr_path(gm, n.target)) for n in gm.graph.nodes if n.op == "get_attr"}


def kind_bytes(result: Any, kinds: Sequence[int]) -> list[dict[str, int]]:
    """Per kind of layer (``kinds``: each layer's), the weight bytes of one of its layers on each side
    of the split ``result``, the mean over the kind's layers (a dense layer's FFN against an MoE
    layer's experts): what a rank holds of each kind; and whether its FFN is a recognised MoE
    (``afd::moe_experts``: expert parallelism splits it)."""
    from .passes.graph_utils import layers_of

    out = []
    sides = {"attention_bytes": result.attention, "ffn_bytes": result.ffn}
    per_layer = {}
    for key, gm in sides.items():
        sizes = _attr_bytes(gm)
        per_layer[key] = {i: sum(sizes[t] for t in {a.target for n in layer.members for a in n.all_input_nodes
                                                    if a.op == "get_attr"}) for i, layer in layers_of(gm).items()}
    moe = {i for i, layer in layers_of(result.ffn).items()
           if any(n.target is torch.ops.afd.moe_experts.default for n in layer.members)}
    for kind in sorted(set(kinds)):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        out.append({**{key: sum(per_layer[key].get(i, 0) for i in idx) // len(idx) for key in sides},
                    "moe": idx[0] in moe})
    return out


_PRODUCTS = ("aten.matmul.default", "aten.bmm.default", "aten.baddbmm.default")


def attention_shape(gm: fx.GraphModule) -> tuple[int, int, int, int, torch.dtype, str]:
    """(query heads, KV heads, key head size, value head size, dtype, form) of the first attention of
    ``gm``: an SDPA (form "sdpa"), else the eager form ("eager": scores from a matmul / bmm of queries
    and keys, a softmax over [batch, heads, queries, keys], a matmul with the values: soft-capped,
    ALiBi or sink logits on the way, as HF writes Gemma-2, BLOOM, MPT, gpt-oss). The KV heads are the
    fewest heads its key has on the way back through ops of one tensor input (a repeat / expand /
    view, a transpose of the last two dims) up to the transpose into heads: a key concatenated from
    parts (MLA's per-head part and its shared rotary part, as HF traces DeepSeek) has the heads of
    the concatenation."""
    sdpa = next((n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)), None)
    if sdpa is not None:
        q, key, v, form = sdpa.args[0].meta["val"], sdpa.args[1], sdpa.args[2].meta["val"], "sdpa"
        heads = int(q.shape[1])
    else:
        q, key, v, heads = _eager_attention(gm)
        form = "eager"
    kv, node = heads, key
    for _ in range(12):  # back through expand / reshape / transpose to the projection's view
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if isinstance(val, torch.Tensor) and val.dim() >= 4 and isinstance(val.shape[1], int):
            kv = min(kv, int(val.shape[1]))
        tensors = [n for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)] \
            if isinstance(node, fx.Node) else []
        last_two = "transpose" in str(node.target) and isinstance(val, torch.Tensor) and \
            {int(d) % val.dim() for d in node.args[1:3]} == {val.dim() - 2, val.dim() - 1}  # (keys transposed)
        if len(tensors) != 1 or ("transpose" in str(node.target) and not last_two) or "permute" in str(node.target):
            break  # (sizes aside: a dynamic view reads the batch's size node too; past a transpose, no heads dim)
        node = tensors[0]
    return heads, kv, int(q.shape[-1]), int(v.shape[-1]), q.dtype, form


def _eager_attention(gm: fx.GraphModule) -> tuple[torch.Tensor, fx.Node, torch.Tensor, int]:
    """(queries' value, the keys' node, values' value, heads) of the first softmax over 4-D scores in
    ``gm`` that a matmul / bmm of queries and keys produced and a matmul with the values reads."""
    def val(n: Any) -> Any:
        return n.meta.get("val") if isinstance(n, fx.Node) else None

    for soft in (n for n in gm.graph.nodes if n.op == "call_function" and "softmax" in str(n.target)):
        scores = val(soft)
        if not (isinstance(scores, torch.Tensor) and scores.dim() == 4):
            continue
        node = soft
        for _ in range(12):  # back through the elementwise ops on the scores to their product
            ins = [a for a in node.all_input_nodes if isinstance(val(a), torch.Tensor)]
            node = next((a for a in ins if val(a).shape == val(node).shape), None) or \
                next((a for a in ins if val(a).dim() == val(node).dim()), None) or (ins[0] if len(ins) == 1 else None)
            if node is None or str(node.target) in _PRODUCTS:
                break
        after, probs = soft, None
        for _ in range(12):  # on through the casts, dropout, slices to the product with the values
            users = [u for u in after.users if u.op == "call_function" and "assert" not in str(u.target)]
            if len(users) != 1:
                break
            if str(users[0].target) in _PRODUCTS[:2] and users[0].args[0] is after:
                probs = users[0]
                break
            after = users[0]
        if node is not None and str(node.target) in _PRODUCTS and probs is not None:
            q, key = (node.args[1], node.args[2]) if "baddbmm" in str(node.target) else (node.args[0], node.args[1])
            return val(q), key, val(probs.args[1]), int(scores.shape[1])
    raise ProfileError("the attention program has no scaled_dot_product_attention and no softmax over [batch, heads, "
                       "queries, keys] between a product of queries and keys and one with the values: profile "
                       "times one layer's KV read by the attention's shape, which it could not find")


def model_facts(result: Any, ep: torch.export.ExportedProgram) -> dict[str, Any]:
    """The cost model's :class:`ModelFacts` of the split ``result`` (``deploy.plan_afd``), as a dict,
    and the attention shape and dtype."""
    cuts = result.plan.cuts
    layers = len(cuts)
    att, ffn = _attr_bytes(result.attention), _attr_bytes(result.ffn)
    head = _head(result.attention)
    other = {head.args[1].target} if head is not None else set()
    other |= {n.args[0].target for n in result.attention.graph.nodes
              if n.target is torch.ops.aten.embedding.default and n.args[0].op == "get_attr"}
    other_bytes = sum(att.get(t, 0) for t in other)
    heads, kv_heads, head_dim, v_head_dim, dtype, form = attention_shape(result.attention)
    moe = [r for r in result.moe if getattr(r, "op", None)]
    size = torch.empty(0, dtype=dtype).element_size()
    return {"layers": layers, "hidden": int(cuts[0].wire_in.tensors[0].width),
            "attention_bytes": (sum(att.values()) - other_bytes) // layers, "ffn_bytes": sum(ffn.values()) // layers,
            "other_bytes": other_bytes, "kv_bytes": kv_heads * (head_dim + v_head_dim) * size,
            "kv_heads": kv_heads, "to_ffn_bytes": cuts[0].wire_in.bytes_per_token,
            "to_attention_bytes": cuts[0].wire_out.bytes_per_token,
            "experts": moe[0].experts if moe else 0, "top_k": moe[0].top_k if moe else 0,
            "moe_unrecognised": [str(r).splitlines()[0] for r in result.moe if not getattr(r, "op", None)],
            "heads": heads, "head_dim": head_dim, "v_head_dim": v_head_dim, "dtype": str(dtype).removeprefix("torch."),
            "attention_form": form}


def inputs_at(gm: fx.GraphModule, example: Sequence[Any], tokens: int, device: torch.device) -> list[Any]:
    """``example`` (the program's inputs) at ``tokens`` sequences of one token: the batch symbol (the
    first input's dim 0) set to ``tokens`` by repeating rows, every other symbolic dim cut to 1. Token
    ids (an integer input an embedding reads) are drawn anew, each sequence its own (seeded): a decode
    batch holds distinct tokens, and an MoE routes distinct tokens to more experts than a repeated few."""
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    first = places[0].meta.get("val")
    if not (isinstance(first, torch.Tensor) and first.dim() and isinstance(first.shape[0], torch.SymInt)):
        raise ProfileError(f"input {places[0].name} has no dynamic batch (dim 0): profile resizes the batch; "
                           "export with torch.export.Dim for it (afd_compile.models.export_lm does)")
    batch = str(first.shape[0].node.expr)
    generator = torch.Generator().manual_seed(tokens)
    out = []
    for n, x in zip(places, example, strict=False):
        val = n.meta.get("val")
        if isinstance(x, torch.Tensor) and isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt):
                    want = tokens if str(size.node.expr) == batch else 1
                    reps = [1] * x.dim()
                    reps[d] = math.ceil(want / x.shape[d])
                    x = x.repeat(*reps).narrow(d, 0, want)
            vocab = _vocabulary(n)
            if vocab and val.dim() > 1 and isinstance(val.shape[1], int) and val.shape[1] > 1:
                raise ProfileError(f"input {n.name} {tuple(val.shape)} fixes its sequence at {val.shape[1]} tokens: "
                                   "profile times decode steps (one token a sequence); export with a dynamic "
                                   "sequence (torch.export.Dim.AUTO for dim 1, as afd_compile.models.export_lm does)")
            if vocab:
                x = torch.randint(0, vocab, x.shape, generator=generator, dtype=x.dtype)
            x = x.to(device)
        out.append(x)
    return out


def _vocabulary(place: fx.Node) -> int | None:
    """The rows of the embedding table ``place`` indexes (None: no embedding reads it as indices)."""
    for user in place.users:
        if user.target is torch.ops.aten.embedding.default and user.args[1] is place:
            weight = user.args[0].meta.get("val") if isinstance(user.args[0], fx.Node) else None
            if isinstance(weight, torch.Tensor) and isinstance(weight.shape[0], int):
                return int(weight.shape[0])
    return None


def time_us(fn: Callable[..., Any], args: Sequence[Any], iters: int, device: torch.device,
            graph: bool = False) -> dict[str, float]:
    """Median and 10th / 90th percentile µs of ``fn(*args)`` after 3 warm-up calls: CUDA events around
    each call on CUDA, the wall clock on CPU. ``graph`` (CUDA): ``fn`` captured in one CUDA graph first
    and the replays timed (the kernels' GPU time, no launch overhead: how a compiled step runs a
    kernel that is not compiled with it)."""
    for _ in range(3):
        fn(*args)
    cuda = device.type == "cuda"
    if cuda and graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # (warm up on a side stream, as capture wants)
            for _ in range(2):
                fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn(*args)
        fn, args = (lambda: captured.replay()), ()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t = time.perf_counter()
            fn(*args)
            times.append((time.perf_counter() - t) * 1e6)
    times.sort()
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]  # noqa: E731
    return {"median_us": round(statistics.median(times), 2), "p10_us": round(pick(0.1), 2),
            "p90_us": round(pick(0.9), 2)}


def role_programs(ep: torch.export.ExportedProgram, device: torch.device,
                  layers: int | Sequence[int] | None = None) -> tuple[dict[str, fx.GraphModule], Any, dict[str, Any]]:
    """The attention and FFN programs of the 1A1F split (exchange taken out, lowered for ``device``)
    and the model with no layout, on ``device``; the split; and :func:`model_facts` of the whole
    model, with ``layer_kinds`` (each layer's kind in the model) and, of several kinds, ``kind_bytes``
    (:func:`kind_bytes`). ``layers``: keep only the first ``layers`` layers of each kind of the model
    (or the layers it lists) in each program (``passes/keep_layers.py``: a deep model timed on a few
    of its layers, its dropped layers' weights never on the device; 0: none, what each program costs
    besides its layers)."""
    from .deploy import no_layout_program, plan_afd
    from .passes.keep_layers import first_of_each_kind, keep_layers, layer_kinds
    from .passes.loopback import loopback_exchange
    from .passes.roles import annotate_roles
    from .pipeline import Build, lower
    from .programs import fresh_module
    from .split_api import SplitConfig

    result = plan_afd(ep, None, SplitConfig())
    _refuse_hybrid(result.attention)
    facts = model_facts(result, ep)
    programs = {"model": fresh_module(ep), "attention": result.attention, "ffn": result.ffn}
    no_layout_program(programs["model"], Build("none", device=device.type))
    annotate_roles(programs["model"], graph_name="the model")
    facts["layer_kinds"] = layer_kinds(programs["model"], "the model")
    if len(set(facts["layer_kinds"])) > 1:
        facts["kind_bytes"] = kind_bytes(result, facts["layer_kinds"])
    keep: Sequence[int] = ()
    if layers is not None:
        keep = first_of_each_kind(facts["layer_kinds"], layers) if isinstance(layers, int) else layers
    for kind, gm in programs.items():
        if kind != "model":  # (no layer kept: none sends)
            loopback_exchange(gm, return_first_sent=kind == "attention" and bool(keep or layers is None))
        if layers is not None:
            keep_layers(gm, keep, f"the {kind} program")
        lower(gm, Build("none" if kind == "model" else f"afd-{kind}", device=device.type))
        programs[kind] = gm.to(device)
    return programs, result, facts


def _compiled(gm: fx.GraphModule, device: torch.device, compile: bool) -> Callable[..., Any]:
    if not compile:
        return gm
    mode = "reduce-overhead" if device.type == "cuda" else None
    return torch.compile(gm, dynamic=True, mode=mode)


def _decode_attention(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, batch: int, context: int,
                      device: torch.device, sdpa: bool = False, v_head_dim: int | None = None,
                      form: str = "sdpa") -> tuple[Callable[..., Any], tuple]:
    """One layer's attention of ``batch`` sequences over a cache of ``context`` positions, all filled:
    ``afd::decode_attention`` (FlexAttention over the filled blocks) on CUDA, as the backend runs a
    cached decode step there; masked SDPA over the cache on CPU or with ``sdpa`` (HF's own, on CUDA
    compiled by Inductor as a program holding it is). Values of ``v_head_dim`` (default: the keys').
    ``form`` "eager" (:func:`attention_shape`: a model that writes its attention out, which the
    backend leaves as it is): the scores' matmul, the masked softmax in fp32 and the values' matmul,
    on CUDA compiled by Inductor (the model's own extra logits, soft-capping, ALiBi, sinks, left out)."""
    from .passes.decode_attention import decode_blocks

    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, heads, 1, head_dim, generator=g, device=device).to(dtype)
    k, v = (torch.randn(batch, kv_heads, context, d, generator=g, device=device).to(dtype)
            for d in (head_dim, v_head_dim or head_dim))
    mask = torch.ones(batch, 1, 1, context, dtype=torch.bool, device=device)
    scale = head_dim ** -0.5
    if device.type == "cuda" and not sdpa and form == "sdpa":
        return (lambda q, k, v, m: torch.ops.afd.decode_attention(q, k, v, *decode_blocks(q, m), scale)), \
            (q, k, v, mask)
    rep = heads // kv_heads

    def written_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        k, v = (x.repeat_interleave(rep, dim=1) for x in (k, v))
        if form == "eager":
            scores = torch.matmul(q, k.transpose(2, 3)).float() * scale
            probs = torch.softmax(scores.masked_fill(~m, float("-inf")), dim=-1).to(q.dtype)
            return torch.matmul(probs, v)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)

    # on CUDA as Inductor compiles HF's attention in a program (what a decode step with SDPA runs)
    return (torch.compile(written_out, dynamic=False) if device.type == "cuda" else written_out), (q, k, v, mask)


def run_profile(path: str, device: torch.device, tokens: Sequence[int] = TOKENS, contexts: Sequence[int] = CONTEXTS,
                kv_batches: Sequence[int] = KV_BATCHES, iters: int = 20, compile: bool = True,
                say: Callable[[str], None] = lambda _s: None, layers: int | None = None,
                rounds: int = 3) -> dict[str, Any]:
    """Profile the model at ``path`` on ``device`` (see the module docstring); returns the JSON record.
    ``layers``: time the first ``layers`` layers of each kind only (the record keeps the model's depth;
    several kinds: :func:`_time_kinds` too); ``rounds``: :func:`timed_rounds`."""
    from .passes.keep_layers import first_of_each_kind
    from .programs import flat_inputs, load_program
    from .saved import sha256_of

    ep = load_program(path)
    _refuse_cache(ep, path)
    example = flat_inputs(ep)
    programs, result, facts = role_programs(ep, device, layers)
    kinds = facts.get("layer_kinds") or []
    kept = len(first_of_each_kind(kinds, layers)) if layers is not None else facts["layers"]
    if facts["moe_unrecognised"]:
        say(f"{len(facts['moe_unrecognised'])} MoE block(s) not recognised ({facts['moe_unrecognised'][0]}): the FFN "
            "program runs the model's own experts, and the estimate weighs no expert parallelism for them")
    if facts["attention_form"] == "eager":
        say("the attention is written out (no SDPA; the backend leaves it so): one layer's KV read is timed as "
            "the scores' matmul, the softmax and the values' matmul (the model's own extra logits left out)")
    say(f"programs of {kept} of {facts['layers']} layers ready" if kept < facts["layers"] else
        f"programs of all {kept} layers ready")
    if len(set(kinds)) > 1:
        say(f"its layers are of {len(set(kinds))} kinds (" + ", ".join(
            f"{kinds.count(c)} from layer {kinds.index(c)}" for c in sorted(set(kinds))) + "): " +
            (f"the first {layers} of each kept; " if kept < facts["layers"] else "") +
            "each kind is timed alone as well")
    timed: dict[str, Any] = {"attention": [], "ffn": [], "no_layout": [], "head": [], "kv": []}
    head_w = _head_weight(result.attention, device)
    head = (_compiled(_Linear(head_w), device, compile), head_w.dtype) if head_w is not None else None
    measure = _measurer(programs, programs, example, facts, device, iters, compile, head)
    keys = ("attention", "no_layout", "ffn") + (("head",) if head is not None else ())

    def progress(t: int, got: dict[str, dict[str, Any]]) -> None:
        say(f"tokens {t}: attention {got['attention']['median_us']:.0f} µs, FFN {got['ffn']['median_us']:.0f} µs, "
            f"no layout {got['no_layout']['median_us']:.0f} µs")

    with torch.no_grad():
        timed.update(timed_rounds(measure, keys, tokens, rounds, progress, say))
        for key in keys:
            _retime_outliers(timed[key], lambda t, k=key: measure(k, t), say, key)
        second = _time_without_layers(ep, programs, example, facts, device, iters, compile,
                                      sorted({tokens[0], tokens[-1]}), say, rounds)
        if second is not None:
            timed["second_depth"] = second
        by_kind = _time_kinds(ep, facts, layers if layers is not None else facts["layers"], example, device,
                              iters, compile, tokens, say, rounds) if len(set(kinds)) > 1 else None
        if by_kind:
            timed["kinds"] = by_kind
        timed["kv"] = kv_times(facts, contexts, kv_batches, iters, device, say=say)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"format": PROFILE_FORMAT, "created": now, "device": _device_record(device), "torch": torch.__version__,
            "compiled": compile, "iters": iters, "rounds": rounds,
            "model": {"file": os.path.basename(path), "sha256": sha256_of(path), **facts,
                      "profiled_layers": kept}, **timed}


def _measurer(programs: dict[str, fx.GraphModule], senders: dict[str, fx.GraphModule], example: Sequence[Any],
              facts: dict[str, Any], device: torch.device, iters: int, compile: bool,
              head: tuple[Callable[..., Any], torch.dtype] | None) -> Callable[[str, int], dict[str, Any]]:
    """``measure(key, t)``: one of ``programs`` (compiled) at one size; the FFN program is fed the
    rows ``senders``' attention program sends at layer 0 for t sequences; ``head``: the LM head
    (compiled) and its weight's dtype."""
    calls = {k: _compiled(gm, device, compile) for k, gm in programs.items()}
    dtype = getattr(torch, facts["dtype"])

    def measure(key: str, t: int) -> dict[str, Any]:
        if key in ("attention", "no_layout"):
            kind = "model" if key == "no_layout" else key
            return time_us(calls[kind], inputs_at(programs[kind], example, t, device), iters, device)
        if key == "ffn":
            return time_us(calls["ffn"], ffn_inputs(senders["attention"], example, dtype, t, device), iters, device)
        fn, head_dtype = head
        return time_us(fn, [torch.randn(t, facts["hidden"], device=device).to(head_dtype)], iters, device)

    return measure


def ffn_inputs(attention: fx.GraphModule, example: Sequence[Any], dtype: torch.dtype, t: int,
               device: torch.device) -> list[torch.Tensor]:
    """The FFN program's inputs at ``t`` rows: the rows ``attention`` (an attention program that
    returns what it sends at its first layer, last) sends for ``t`` sequences, in ``dtype``."""
    rows = attention(*inputs_at(attention, example, t, device))[-1]
    return [torch.empty(t, device=device), rows.reshape(t, -1).to(dtype)]


def timed_rounds(measure: Callable[[str, int], dict[str, Any]], keys: Sequence[str], sizes: Sequence[int],
                 rounds: int, progress: Callable[[int, dict[str, dict[str, Any]]], None] | None = None,
                 say: Callable[[str], None] = lambda _s: None) -> dict[str, list[dict[str, Any]]]:
    """Each key's rows: ``measure(key, size)`` at every size, ``rounds`` times, a round going over every
    (size, key) before the next begins, so that a slow spell of the device (clocks, a neighbour) falls on
    one round of each row rather than on every round of a few; a row keeps its quickest round (lowest
    median) and lists every round's median under ``rounds_us``. ``progress(size, rows)`` after each size
    of the first round (it compiles); a line said after each later round."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for r in range(rounds):
        for t in sizes:
            for key in keys:
                got, was = measure(key, t), best.get((key, t))
                medians = [*(was["rounds_us"] if was else []), got["median_us"]]
                best[(key, t)] = {**(got if was is None or got["median_us"] < was["median_us"] else was),
                                  "rounds_us": medians}
            if r == 0 and progress is not None:
                progress(t, {key: best[(key, t)] for key in keys})
        if r:
            spread = max(max(v["rounds_us"]) / min(v["rounds_us"]) for v in best.values()) - 1
            say(f"round {r + 1} of {rounds} timed (the widest spread of a row's rounds: {spread:.0%})")
    return {key: [{"rows" if key == "ffn" else "tokens": t, **best[(key, t)]} for t in sizes] for key in keys}


def _time_without_layers(ep: torch.export.ExportedProgram, senders: dict[str, fx.GraphModule],
                         example: Sequence[Any], facts: dict[str, Any], device: torch.device, iters: int,
                         compile: bool, sizes: Sequence[int], say: Callable[[str], None],
                         rounds: int) -> dict[str, Any] | None:
    """The profile's second depth: the attention, FFN and no-layout programs with no layer (the
    residual stream passed through), timed at ``sizes``: each program's call itself, so a layer is the
    profiled time less it over the layers timed (the noise divided by them; one layer fewer as the
    second depth would multiply it by them). None (said) where the layers cannot be cut so."""
    from .passes.keep_layers import KeepLayersError

    try:
        programs, _, _ = role_programs(ep, device, 0)
    except KeepLayersError as e:
        say(f"not timed with no layer ({e}): each program's call stays in its per-layer times")
        return None
    measure = _measurer(programs, senders, example, facts, device, iters, compile, None)
    out: dict[str, Any] = {"layers": 0, **timed_rounds(measure, ("attention", "ffn", "no_layout"), sizes, rounds)}
    say("with no layer: " + ", ".join(f"{k} {out[k][-1]['median_us']:.0f} µs" for k in
                                            ("attention", "ffn", "no_layout")) + f" at {sizes[-1]}")
    return out


def _time_kinds(ep: torch.export.ExportedProgram, facts: dict[str, Any], k: int, example: Sequence[Any],
                device: torch.device, iters: int, compile: bool, sizes: Sequence[int], say: Callable[[str], None],
                rounds: int) -> list[dict[str, Any]] | None:
    """A model whose layers are of several kinds (``facts["layer_kinds"]``: DeepSeek-V3's dense first
    layers, then its MoE layers), profiled on the first ``k`` of each: the attention, FFN and no-layout
    programs with only that kind's ``k`` layers, timed at ``sizes``, per kind (its count in the model,
    the layers timed, the rows), so that a layer of each kind is its program less the call over ``k``
    (``profile_read``: a :class:`~afd_compile.estimate.LayerKind` each, weighted by its count). The FFN program is
    fed the rows its own attention program sends at its first layer. None (said) where a kind cannot
    be cut out alone: a layer then costs the mean of the layers timed together."""
    from .passes.keep_layers import KeepLayersError, first_of_each_kind

    kinds, out = facts["layer_kinds"], []
    for kind in sorted(set(kinds)):
        keep = [i for i in first_of_each_kind(kinds, k) if kinds[i] == kind]
        try:
            programs, _, _ = role_programs(ep, device, keep)
        except KeepLayersError as e:
            say(f"its kinds of layer not timed apart ({e}): a layer costs the mean of the layers timed together")
            return None
        measure = _measurer(programs, programs, example, facts, device, iters, compile, None)
        rows = timed_rounds(measure, ("attention", "ffn", "no_layout"), sizes, rounds)
        out.append({"kind": kind, "layers": kinds.count(kind), "first": kinds.index(kind), "profiled_layers": len(keep),
                    **rows})
        say(f"the {len(keep)} layer(s) of kind {kind} (layer {keep[0]}, {kinds.count(kind)} in the model) alone: "
            + ", ".join(f"{key} {rows[key][-1]['median_us']:.0f} µs" for key in rows) + f" at {sizes[-1]}")
        del programs, measure
    return out


def _refuse_cache(ep: torch.export.ExportedProgram, path: str) -> None:
    """A program that updates buffers in place (a KV cache) is refused: its cache fixes the batch the
    profile resizes, and the KV read is timed apart, per (batch, context), with the kernel a cached
    decode step runs."""
    from .passes.graph_utils import get_attr_path, written_attrs
    from .programs import positional_module

    gm = positional_module(ep)
    written = sorted(written_attrs(gm), key=lambda name: -get_attr_path(gm, name).numel())
    if written:
        raise ProfileError(f"{path} updates {len(written)} buffers in place (a KV cache: {written[0]}, ...): "
                           "profile times the model at many batches, which a cache fixes; profile the export "
                           "without the cache (use_cache=False, a dynamic batch: afd_compile.models.export_lm): "
                           "the KV read is timed apart, per batch and context")


def _refuse_hybrid(attention: fx.GraphModule) -> None:
    """Layers whose token mixer is not attention (hybrids; ``passes.roles.non_attention_layers``)
    are refused: the cost model reads a KV cache per layer, growing with the context, and a
    state-space or linear-attention layer reads a state of fixed size instead."""
    from .passes.roles import non_attention_layers

    layers = non_attention_layers(attention)
    if layers:
        raise ProfileError(f"layers {layers} mix tokens by something other than attention (a state-space, convolution "
                           "or linear-attention mixer: a hybrid model); the deployment estimate reads a KV cache per "
                           "layer growing with the context, and does not model their fixed-size state yet")


def _retime_outliers(rows: list[dict[str, Any]], measure: Callable[[int], dict[str, Any]],
                     say: Callable[[str], None], what: str) -> None:
    """Time again, once, a size that looks disturbed: one whose median exceeds the next larger size's
    by 20% (a step at more rows is not faster) or whose 90th percentile is twice its 10th; the
    lower median is kept and the row marked ``retimed``."""
    for i, r in enumerate(rows):
        nxt = rows[i + 1]["median_us"] if i + 1 < len(rows) else None
        if (nxt is not None and r["median_us"] > 1.2 * nxt) or r["p90_us"] > 2 * r["p10_us"]:
            size = r.get("tokens", r.get("rows"))
            again = measure(size)
            say(f"{what} at {size}: {r['median_us']:.0f} µs (p10 {r['p10_us']:.0f}, p90 {r['p90_us']:.0f}) looked "
                f"disturbed; timed again: {again['median_us']:.0f} µs")
            if again["median_us"] < r["median_us"]:
                r.update(again)
            r["retimed"] = True


def kv_times(facts: dict[str, Any], contexts: Sequence[int], batches: Sequence[int], iters: int, device: torch.device,
             sdpa: bool = False, say: Callable[[str], None] = lambda _s: None) -> list[dict[str, Any]]:
    """One layer's KV read (:func:`_decode_attention`) timed at every (batch, context); on CUDA its
    kernels' time in a CUDA graph (a decode step replays it inside the step's graph)."""
    out = []
    dtype = getattr(torch, facts["dtype"])
    shape = (facts["heads"], facts["kv_heads"], facts["head_dim"], dtype)
    with torch.no_grad():
        for c in contexts:
            for b in batches:
                fn, args = _decode_attention(*shape, b, c, device, sdpa, facts.get("v_head_dim"),
                                             facts.get("attention_form", "sdpa"))
                out.append({"batch": b, "context": c, **time_us(fn, args, iters, device, graph=True)})
            say(f"context {c}: one layer's KV read at batch {batches[-1]}: {out[-1]['median_us']:.0f} µs")
    return out


class _Linear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


def _head(gm: fx.GraphModule) -> fx.Node | None:
    """The LM head: the last linear of the program, reading a weight attribute (None: no such)."""
    from .passes.op_kinds import LINEAR_OPS

    head = next((n for n in reversed(gm.graph.nodes) if n.op == "call_function" and n.target in LINEAR_OPS), None)
    ok = head is not None and isinstance(head.args[1], fx.Node) and head.args[1].op == "get_attr"
    return head if ok else None


def _head_weight(gm: fx.GraphModule, device: torch.device) -> torch.Tensor | None:
    head = _head(gm)
    if head is None:
        return None
    from .passes.graph_utils import get_attr_path

    return get_attr_path(gm, head.args[1].target).detach().to(device)


def _device_record(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": p.name, "memory_bytes": int(p.total_memory)}
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {"type": "cpu", "name": "cpu", "memory_bytes": int(total)}
