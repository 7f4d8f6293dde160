"""A deployment's step time from a one-GPU profile: the cost model of ``plan --estimate`` / ``--search``.

Pure arithmetic over measured parts (``afd-compile profile`` writes them; :mod:`afd_compile.profile`
reads them into :class:`Costs`), no torch. A decode step (one new token per sequence) of a layout:

- **AFD A:F, S stages** (MegaScale-Infer's ping-pong): per layer and micro-batch of ``b/S`` sequences
  an attention rank takes ``ta`` (its layer at ``b/S`` tokens plus the KV read at the context; in an
  attention TP group of ``t``, the group's ``b/S`` sequences with heads split ``t`` ways, plus a
  reduce-scatter and an all-gather of them, each rank sending ``1/t`` of the rows), the
  exchange ``tc`` each way at the FFN rank's link (it fans in ``A/F`` peers), the FFN rank ``tf`` (its
  layer at ``A/F * b/S`` rows; in a group of ``P`` the group's rows over ``P`` ranks, plus the group's
  collectives). ``S`` micro-batches circulate through attention -> wire -> FFN -> wire: a layer costs
  ``max(S * max(ta, tc_in, tf, tc_out), ta + tc_in + tf + tc_out)`` (each resource serialises its
  ``S`` jobs; one micro-batch cannot go round faster than its own chain). ``S = 1``: the chain.
- **TP t** (DP over ``N / t`` replicas): heads and weights split ``t`` ways, two all-reduces a layer
  (ring: ``2 (t - 1) / t`` of the message); for an MoE also **EP over all N GPUs** (attention TP
  ``t``, experts spread over every GPU, two all-to-alls a layer of up to ``min(k, N)`` copies).

A model with layers of several kinds (dense first layers, then MoE ones: :attr:`Costs.kinds`) has each
kind's layer costed apart, weighted by its share of the layers (under AFD's FFN EP a dense layer runs
whole on each FFN rank's own rows, its weights whole; under TP/EP it is split over the TP group).

Every assumption is a line of :data:`ASSUMPTIONS`, printed with the estimate. Times in µs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from .errors import AFDCompileError


class EstimateError(AFDCompileError):
    """An estimate that cannot be made: a size outside what was profiled, a link that is not one."""


#: the sizes ``afd-compile profile`` measures by default: sequences of one token (and FFN rows), KV
#: cache lengths, and the batches of one layer's KV read
PROFILE_TOKENS = (1, 8, 32, 64, 128, 256)
PROFILE_CONTEXTS = (1024, 4096)
PROFILE_KV_BATCHES = (1, 8, 32, 64, 128)
#: batch sizes (sequences per attention rank / replica) the search tries
BATCHES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
#: the share of device memory a rank may fill (the rest: activations, CUDA graphs, the allocator)
MEMORY_USE = 0.9
#: GPUs of one node (NVLink between them)
GPUS_PER_NODE = 8

ASSUMPTIONS = (
    "decode steps: one new token per sequence a step, so the time per output token is the step time",
    "per-layer times come from the profiled programs: linear between profiled sizes, the first size's "
    "time below it (weight-bound), the line through the last two past it",
    "an MoE FFN between profiled rows follows the experts its rows reach (top-k of E, routed uniformly: "
    "E (1 - (1 - k/E)^R)) and its rows, fitted through the profiled points",
    "an attention layer's KV read grows linearly with the context between / past profiled contexts",
    "a group of P ranks splitting a layer's weights (TP, EP) runs the group's rows in 1/P of the time "
    "one GPU takes for them (the same bytes and FLOPs over P); a TP group of t reads its KV cache split "
    "min(t, KV heads) ways (past the KV heads, each rank reads a whole head)",
    f"a group of up to {GPUS_PER_NODE} GPUs (one node) collects over NVLink; an MoE's FFN EP group over all "
    "the FFN ranks past one node, as EP over all GPUs, dispatches and combines over the link between nodes",
    "AFD S stages: a layer costs max(S x the slowest of attention, FFN, each wire direction; one "
    "micro-batch's attention + wire + FFN + wire); the LM head runs after the last layer, not overlapped",
    "a step adds, once, what each program costs beyond its layers (the call: graph launch, input copies, "
    "embedding, LM head), the attention rank's and the FFN rank's both (one GPU's model measured whole "
    "costs about the sum of its roles'); from a profile that timed each program with no layer too, else "
    "the LM head alone and the rest in the per-layer times",
    "a transfer or collective costs the link's latency plus its bytes at the link's bandwidth; ring "
    "all-reduce moves 2(P-1)/P of its message, all-gather / reduce-scatter (P-1)/P, all-to-all up to "
    "min(top-k, P) copies of each token, (P-1)/P of them off the rank",
    f"a rank holds its weights and KV cache in at most {MEMORY_USE:.0%} of the device's memory",
    "the host's time around a step (dynamo's guards over the model, the backend's runner, sampling) is "
    "not in it: hidden where the host runs ahead of the GPU (an engine's asynchronous scheduling), "
    "added where each step is synchronised (0.2-0.5 ms measured for an 8B-shaped model on an H200)",
)


@dataclass(frozen=True)
class Curve:
    """Measured µs at sizes (tokens or rows): linear between the points; below the first, its value
    (a step at fewer rows costs no less: weight-bound); past the last, the line through the last two
    (one point: its value everywhere).

    ``routing = (E, k)`` (an MoE FFN's rows, each to its top ``k`` of ``E`` experts): between the
    points the time follows :func:`experts_reached` (the expert weights the rows read) and the rows,
    ``a + b * experts_reached(R) + c * R`` fitted by least squares to the points, plus the fit's
    residual interpolated linearly (so the curve still passes through every measured point). A
    straight line between 8 and 64 rows misses the knee where nearly every expert is reached."""

    points: tuple[tuple[int, float], ...]
    routing: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        xs = [x for x, _ in self.points]
        if not self.points or xs != sorted(set(xs)) or any(x < 1 or not math.isfinite(y) or y < 0
                                                            for x, y in self.points):
            raise EstimateError(f"a profile curve needs ascending sizes >= 1 with finite times >= 0, got {self.points}")

    def at(self, x: float) -> float:
        pts = self.points
        if x <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        fit = self._routed_fit
        if fit is not None:
            return self._routed_at(x, fit)
        for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return max(y1, y1 + (y1 - y0) * (x - x1) / (x1 - x0))

    @functools.cached_property
    def _routed_fit(self) -> tuple[float, float, float] | None:  # (once per curve: search reads it ~10^5 times)
        experts, top_k = self.routing
        if experts <= 0 or top_k <= 0 or len(self.points) < 3:
            return None
        rows = [(1.0, experts_reached(x, experts, top_k), float(x)) for x, _ in self.points]
        return _least_squares(rows, [y for _, y in self.points])

    def _routed_at(self, x: float, fit: tuple[float, float, float]) -> float:
        experts, top_k = self.routing
        model = lambda r: fit[0] + fit[1] * experts_reached(r, experts, top_k) + fit[2] * r  # noqa: E731
        pts = self.points
        for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
            if x <= x1:
                r0, r1 = y0 - model(x0), y1 - model(x1)  # (never below 0: a point measured 0 came back -5e-14)
                return max(0.0, model(x) + r0 + (r1 - r0) * (x - x0) / (x1 - x0))
        x1, y1 = pts[-1]
        return max(y1, model(x) + y1 - model(x1))


def experts_reached(rows: float, experts: int, top_k: int) -> float:
    """The distinct experts ``rows`` tokens reach, each routed to ``top_k`` of ``experts`` uniformly:
    ``E (1 - (1 - k/E)^R)`` (every expert once the rows are many)."""
    return experts * (1.0 - (1.0 - min(top_k, experts) / experts) ** rows)


def _least_squares(rows: list[tuple[float, float, float]], ys: list[float]) -> tuple[float, float, float] | None:
    """The least-squares solution of ``rows @ c = ys`` (three unknowns) by the normal equations;
    None when they are singular (the points do not tell the terms apart)."""
    a = [[sum(r[i] * r[j] for r in rows) for j in range(3)] + [sum(r[i] * y for r, y in zip(rows, ys, strict=True))]
         for i in range(3)]
    scale = max(abs(v) for row in a for v in row[:3]) or 1.0
    for col in range(3):  # Gaussian elimination with partial pivoting
        piv = max(range(col, 3), key=lambda i: abs(a[i][col]))
        if abs(a[piv][col]) < 1e-12 * scale:
            return None
        a[col], a[piv] = a[piv], a[col]
        for i in range(3):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [v - f * w for v, w in zip(a[i], a[col], strict=True)]
    return (a[0][3] / a[0][0], a[1][3] / a[1][1], a[2][3] / a[2][2])


@dataclass(frozen=True)
class KVCurves:
    """One layer's attention over a KV cache: a :class:`Curve` over the batch per profiled context;
    linear in the context between and past them (the KV read), proportional below the first."""

    contexts: tuple[int, ...]
    curves: tuple[Curve, ...]

    def at(self, batch: float, context: float) -> float:
        cs = self.contexts
        if context <= cs[0]:
            return self.curves[0].at(batch) * context / cs[0]
        i = next((k for k in range(1, len(cs)) if context <= cs[k]), len(cs) - 1)
        if len(cs) == 1:  # (one context: proportional past it too)
            return self.curves[0].at(batch) * context / cs[0]
        c0, c1 = cs[i - 1], cs[i]
        y0, y1 = self.curves[i - 1].at(batch), self.curves[i].at(batch)
        return max(y0, y0 + (y1 - y0) * (context - c0) / (c1 - c0))


@dataclass(frozen=True)
class ModelFacts:
    """What the estimate needs of the model, per layer unless named otherwise (bytes)."""

    layers: int
    hidden: int
    attention_bytes: int  # weights of one layer's attention side
    ffn_bytes: int  # weights of one layer's FFN side (all experts of an MoE)
    other_bytes: int  # embedding, LM head, final norm: on every attention / TP rank
    kv_bytes: int  # the KV cache of one token in one layer
    kv_heads: int
    to_ffn_bytes: int  # what one token sends to the FFN at a layer (hidden, router logits)
    to_attention_bytes: int  # what comes back
    experts: int = 0
    top_k: int = 0
    heads: int = 0  # query heads (0: unknown)

    @property
    def hidden_bytes(self) -> int:
        """One token's hidden state in the model's dtype (what the FFN sends back; what a TP / EP
        collective moves per token)."""
        return self.to_attention_bytes


@dataclass(frozen=True)
class LayerKind:
    """One kind of layer of a model whose layers differ (dense first layers, then MoE ones): its
    ``share`` of the layers, its per-layer ``attention`` and ``ffn`` curves (as :class:`Costs`'),
    whether its FFN is an MoE (EP splits its experts; a dense FFN runs whole on each EP rank's own
    rows) and one layer's weight bytes on each side."""

    share: float
    attention: Curve
    ffn: Curve
    moe: bool
    attention_bytes: int
    ffn_bytes: int


@dataclass(frozen=True)
class Costs:
    """The profile's measured parts, per layer: ``attention`` (µs at T tokens, one a sequence, the KV
    read excluded), ``kv`` (the KV read), ``ffn`` (µs at R rows), ``head`` (the LM head at T tokens).
    Once a step, where the profile timed its programs with no layer too: ``call_attention``,
    ``call_ffn`` (at R rows) and ``call_model`` (µs at T tokens), what the attention program, the FFN
    program and the model with no layout cost beyond their layers (the call: graph launch, input
    copies, embedding, the LM head); None: not known (then folded into the per-layer times, and the
    head added once a step)."""

    device: str
    memory_bytes: int
    attention: Curve
    ffn: Curve
    head: Curve
    kv: KVCurves
    call_attention: Curve | None = None
    call_ffn: Curve | None = None
    call_model: Curve | None = None
    kinds: tuple[LayerKind, ...] = ()  # a model with layers of several kinds: each apart (else one, these)

    def layer_kinds(self, facts: ModelFacts) -> tuple[LayerKind, ...]:
        """The kinds a step's layers are costed by: :attr:`kinds`, or one of every layer."""
        return self.kinds or (LayerKind(1.0, self.attention, self.ffn, facts.experts > 0, facts.attention_bytes,
                                        facts.ffn_bytes),)

    def once_attention(self, tokens: float) -> float:
        """An attention rank's time once a step, besides its layers, at ``tokens`` sequences."""
        return self.call_attention.at(tokens) if self.call_attention else self.head.at(tokens)

    def once_ffn(self, rows: float) -> float:
        """An FFN rank's time once a step, besides its layers, at ``rows`` rows (0: not known)."""
        return self.call_ffn.at(rows) if self.call_ffn else 0.0

    def once_model(self, tokens: float) -> float:
        """A TP rank's (the model's) time once a step, besides its layers, at ``tokens`` sequences."""
        return self.call_model.at(tokens) if self.call_model else self.head.at(tokens)


@dataclass(frozen=True)
class Link:
    """A link between GPUs: ``gbps`` GB/s each way, ``latency_us`` per transfer or collective."""

    name: str
    gbps: float
    latency_us: float

    def us(self, nbytes: float) -> float:
        return self.latency_us + nbytes / (self.gbps * 1e3) if nbytes > 0 else 0.0

    @classmethod
    def parse(cls, text: str) -> Link:
        """``nvlink``, ``ib`` or ``GBPS,LATENCY_US`` (e.g. ``50,20``)."""
        if text in LINKS:
            return LINKS[text]
        parts = text.split(",")
        try:
            gbps, lat = (float(p) for p in parts)
        except ValueError:
            raise EstimateError(f"--link {text!r}: give nvlink, ib or GBPS,LATENCY_US (e.g. 50,20)") from None
        if not (gbps > 0 and lat >= 0 and math.isfinite(gbps) and math.isfinite(lat)):
            raise EstimateError(f"--link {text!r}: bandwidth must be > 0 GB/s and latency >= 0 µs")
        return cls(text, gbps, lat)


#: NVLink 4 measured on 2 H200s (LIMITS.md: ~300 GB/s at 64 MB eager, ~15 µs a transfer in a CUDA
#: graph); InfiniBand NDR 400 Gb/s per GPU (50 GB/s; latency assumed, not measured here)
LINKS = {"nvlink": Link("nvlink", 300.0, 15.0), "ib": Link("ib", 50.0, 20.0)}


@dataclass(frozen=True)
class AFDCandidate:
    attention: int
    ffn: int
    stages: int = 1
    ffn_tp: int = 1
    ffn_ep: int = 1
    attn_tp: int = 1  # attention TP groups of this many ranks, each a DP group of its own sequences

    def __str__(self) -> str:
        group = f" ffn_tp={self.ffn_tp}" if self.ffn_tp > 1 else f" ffn_ep={self.ffn_ep}" if self.ffn_ep > 1 else ""
        att = f" attn_tp={self.attn_tp}" if self.attn_tp > 1 else ""
        return f"AFD {self.attention}A{self.ffn}F S={self.stages}{att}{group}"


@dataclass(frozen=True)
class TPCandidate:
    gpus: int
    tp: int
    ep: bool = False  # an MoE's experts over every GPU (all-to-all), attention TP tp

    def __str__(self) -> str:
        dp = self.gpus // self.tp
        return f"TP {self.tp}" + (f" x DP {dp}" if dp > 1 else "") + (f", EP {self.gpus}" if self.ep else "")


@dataclass(frozen=True)
class Estimate:
    """One layout at one batch: the parts of a layer, the step, the throughput, the memory."""

    layout: str
    gpus: int
    batch: int  # sequences per attention rank (AFD) or per TP replica
    sequences: int  # sequences a step over every GPU
    context: int
    attention_us: float  # a layer's attention part (per micro-batch under AFD)
    ffn_us: float  # a layer's FFN part (per micro-batch), its group's collectives included
    wire_us: float  # one direction of a layer's exchange (AFD) or its collectives (TP)
    layer_us: float
    step_us: float
    memory: dict[str, int] = field(default_factory=dict)
    fits: bool = True
    unstaged_layer_us: float | None = None  # AFD with stages: the same batch's layer in one stage
    #: the sizes the profile's curves were read at: attention / head tokens, FFN rows, KV batch and context
    reads: dict[str, float] = field(default_factory=dict)

    @property
    def stages_gain(self) -> float | None:
        """What micro-batch stages buy: the unstaged layer's time over this one's (AFD, S > 1)."""
        return self.unstaged_layer_us / self.layer_us if self.unstaged_layer_us else None

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.sequences / self.step_us * 1e6 / self.gpus

    def json(self) -> dict:
        return {"layout": self.layout, "gpus": self.gpus, "batch": self.batch, "sequences": self.sequences,
                "context": self.context, "attention_us": round(self.attention_us, 2), "ffn_us": round(self.ffn_us, 2),
                "wire_us": round(self.wire_us, 2), "layer_us": round(self.layer_us, 2),
                "step_us": round(self.step_us, 1), "tpot_ms": round(self.step_us / 1e3, 3),
                "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 1), "memory_bytes": dict(self.memory),
                "fits": self.fits, "stages_gain": round(self.stages_gain, 3) if self.stages_gain else None,
                "reads": {k: round(v, 2) for k, v in self.reads.items()}}


def past_profile(costs: Costs, e: Estimate) -> list[str]:
    """What ``e`` read of the profile past its largest measured size (extrapolated, see
    :data:`ASSUMPTIONS`): one phrase per curve, e.g. ``"FFN at 512 rows (profiled to 256)"``."""
    kv_batch = max(c.points[-1][0] for c in costs.kv.curves)
    limits = {"attention": (costs.attention.points[-1][0], "tokens"), "FFN": (costs.ffn.points[-1][0], "rows"),
              "head": (costs.head.points[-1][0], "tokens"), "KV read": (kv_batch, "sequences"),
              "context": (costs.kv.contexts[-1], "positions")}
    out = []
    for what, size in e.reads.items():
        top, unit = limits[what]
        if size > top * (1 + 1e-9):
            out.append(f"{what} at {size:g} {unit} (profiled to {top})")
    return out


def _afd_ffn(kind: LayerKind, cand: AFDCandidate, rows: float, facts: ModelFacts, link: Link,
             glink: Link) -> tuple[float, int]:
    """An FFN rank's layer of ``kind`` at ``rows`` rows a micro-batch, and how many ways the group
    splits its weights: over ``P`` ranks (TP, or EP of an MoE) the group's rows in 1/P of one GPU's
    time plus the group's collectives; a dense layer under EP runs whole on the rank's own rows."""
    parts = max(cand.ffn_tp, cand.ffn_ep)
    if cand.ffn_ep > 1 and not kind.moe:
        return kind.ffn.at(rows), 1
    tf = kind.ffn.at(rows * parts) / parts
    if cand.ffn_tp > 1:  # all-gather the group's rows, reduce-scatter the output
        tf += 2 * glink.us(rows * cand.ffn_tp * facts.hidden_bytes * (cand.ffn_tp - 1) / cand.ffn_tp)
    elif cand.ffn_ep > 1:  # dispatch and combine by all-to-all
        copies = min(facts.top_k or 1, cand.ffn_ep) * (cand.ffn_ep - 1) / cand.ffn_ep
        tf += 2 * (link if cand.ffn_ep > GPUS_PER_NODE else glink).us(rows * facts.hidden_bytes * copies)
    return tf, parts


def afd(costs: Costs, facts: ModelFacts, cand: AFDCandidate, batch: int, context: int, link: Link,
        group_link: Link | None = None) -> Estimate:
    """AFD ``cand`` with ``batch`` sequences per attention rank, or per attention TP group (see the
    module docstring): the exchange over ``link``, the groups' collectives over ``group_link``
    (default ``link``) or, an FFN EP group wider than a node, over ``link``. Layers of several kinds
    (:attr:`Costs.kinds`): each kind's layer apart, weighted by its share."""
    s = min(cand.stages, batch)
    micro = batch / s
    t = cand.attn_tp
    kv_split = min(t, max(facts.kv_heads, 1))
    glink = group_link or link
    fan_in = cand.attention / cand.ffn
    rows = fan_in * micro / t  # per FFN rank and micro-batch (each attention rank sends its 1/t of its group's)
    parts = max(cand.ffn_tp, cand.ffn_ep)
    tc_in = link.us(rows * facts.to_ffn_bytes)
    tc_out = link.us(rows * facts.to_attention_bytes)
    ta = tf = layer = att_bytes = ffn_mem = 0.0
    for kind in costs.layer_kinds(facts):
        ta_k = kind.attention.at(micro) / t + costs.kv.at(micro, context) / kv_split
        if t > 1:  # the group's partial sums reduce-scattered at the cut, the tokens all-gathered after it
            ta_k += 2 * glink.us(micro * facts.hidden_bytes * (t - 1) / t)
        tf_k, split = _afd_ffn(kind, cand, rows, facts, link, glink)
        layer += kind.share * max(s * max(ta_k, tf_k, tc_in, tc_out), ta_k + tc_in + tf_k + tc_out)
        ta, tf = ta + kind.share * ta_k, tf + kind.share * tf_k
        att_bytes += kind.share * (kind.attention_bytes // t)
        ffn_mem += facts.layers * kind.share * kind.ffn_bytes // split
    step = facts.layers * layer + costs.once_attention(batch) + costs.once_ffn(rows * s * parts)
    att_mem = facts.layers * (att_bytes + batch * context * facts.kv_bytes // kv_split) + facts.other_bytes
    cap = costs.memory_bytes * MEMORY_USE
    unstaged = afd(costs, facts, replace(cand, stages=1), batch, context, link, group_link).layer_us if s > 1 else None
    reads = {"attention": micro, "KV read": micro, "context": context, "FFN": rows * parts, "head": batch}
    return Estimate(str(cand), cand.attention + cand.ffn, batch, batch * cand.attention // t, context, ta, tf,
                    max(tc_in, tc_out), layer, step, {"attention rank": int(att_mem), "FFN rank": int(ffn_mem)},
                    att_mem <= cap and ffn_mem <= cap, unstaged, reads)


def tp(costs: Costs, facts: ModelFacts, cand: TPCandidate, batch: int, context: int, link: Link,
       fabric: Link | None = None) -> Estimate:
    """TP ``cand.tp`` with ``batch`` sequences per replica (``gpus / tp`` replicas); with ``cand.ep``
    an MoE's experts over every GPU, dispatched by all-to-all over ``fabric`` (``link`` inside a node)."""
    t, n = cand.tp, cand.gpus
    kv_split = min(t, max(facts.kv_heads, 1))
    msg = batch * facts.hidden_bytes  # one all-reduce's message
    ring = link.us(msg * 2 * (t - 1) / t) if t > 1 else 0.0
    share = batch / t  # each rank's tokens (SCATTERED), to the ranks of their experts and back (EP)
    copies = min(facts.top_k or 1, n) * (n - 1) / n
    wire = 2 * (fabric or link).us(share * facts.hidden_bytes * copies)
    ta = tf = collectives = att_bytes = ffn_mem = 0.0
    for kind in costs.layer_kinds(facts):  # (a dense layer's MLP is split over the TP group, EP or not)
        ta += kind.share * (kind.attention.at(batch) / t + costs.kv.at(batch, context) / kv_split)
        ep = cand.ep and kind.moe
        tf += kind.share * (kind.ffn.at(batch * n / t) / n + wire if ep else kind.ffn.at(batch) / t + ring)
        collectives += kind.share * (ring + wire if ep else 2 * ring)
        att_bytes += kind.share * (kind.attention_bytes // t)
        ffn_mem += facts.layers * kind.share * kind.ffn_bytes // (n if ep else t)
    layer = ta + ring + tf
    step = facts.layers * layer + costs.once_model(batch)
    mem = facts.layers * (att_bytes + batch * context * facts.kv_bytes // kv_split) + facts.other_bytes + ffn_mem
    reads = {"attention": batch, "KV read": batch, "context": context, "FFN": batch * n / t if cand.ep else batch,
             "head": batch}
    return Estimate(str(cand), n, batch, batch * (n // t), context, ta, tf, collectives, layer, step,
                    {"GPU": int(mem)}, mem <= costs.memory_bytes * MEMORY_USE, reads=reads)


def candidates(gpus: int, facts: ModelFacts, max_stages: int = 3, max_group: int = GPUS_PER_NODE) -> list:
    """The layouts ``--search`` weighs on ``gpus`` GPUs: every AFD A:F (F <= A), S = 1..max_stages,
    attention TP groups and FFN TP / EP groups of up to ``max_group`` (EP for an MoE, also over all F
    FFN ranks); TP of up to ``max_group`` (one node), with an MoE also EP over all GPUs. A TP group
    (attention or TP) splits the query heads evenly, and the KV heads or holds whole copies of them."""
    out: list = []
    for f in range(1, gpus // 2 + 1):
        groups = [(1, 1)] + [(p, 1) for p in _divisors(f, max_group) if p > 1]
        eps = [p for p in _divisors(f, max_group) if p > 1] + ([f] if f > max_group else [])
        groups += [(1, p) for p in eps if facts.experts and facts.experts % p == 0]
        for s in range(1, max_stages + 1):
            out += [AFDCandidate(gpus - f, f, s, gt, ge, at) for at in _head_groups(gpus - f, facts, max_group)
                    for gt, ge in groups]
    for t in _head_groups(gpus, facts, max_group):
        out.append(TPCandidate(gpus, t))
        if facts.experts and facts.experts % gpus == 0 and gpus > 1:
            out.append(TPCandidate(gpus, t, ep=True))
    return out


def _divisors(n: int, most: int) -> list[int]:
    return [d for d in range(1, min(n, most) + 1) if n % d == 0]


def _head_groups(n: int, facts: ModelFacts, most: int) -> list[int]:
    """The TP group sizes of ``n`` ranks that split the query heads and the KV heads (or hold whole
    copies of these)."""
    kv = max(facts.kv_heads, 1)
    return [t for t in _divisors(n, most) if (kv % t == 0 or t % kv == 0) and (facts.heads or t) % t == 0]


def best(estimate: Callable[[int], Estimate], tpot_ms: float | None,
         batches: Iterable[int] = BATCHES) -> Estimate | None:
    """The estimate of the largest batch that fits in memory (and meets ``tpot_ms``): the most tokens
    a GPU serves under the target; None when even a batch of 1 does not."""
    found = None
    for b in batches:
        e = estimate(b)
        if not e.fits or (tpot_ms is not None and e.step_us > tpot_ms * 1e3):
            break
        if found is None or e.tokens_per_s_per_gpu >= found.tokens_per_s_per_gpu:
            found = e
    return found


def search(costs: Costs, facts: ModelFacts, gpus: int, context: int, tpot_ms: float | None, fabric: Link,
           node: Link | None = None, gpus_per_node: int = 8, max_stages: int = 3) -> list[Estimate]:
    """Every candidate layout at its best batch under ``tpot_ms``, most tokens/s per GPU first. Inside a
    node (``gpus <= gpus_per_node``) every transfer takes ``node`` (NVLink); past one node the AFD
    exchange and EP's all-to-all take ``fabric``, while FFN groups and TP groups stay in a node."""
    node = node or LINKS["nvlink"]
    wide = fabric if gpus > gpus_per_node else node
    found = []
    for cand in candidates(gpus, facts, max_stages):
        if isinstance(cand, AFDCandidate):
            e = best(lambda b, c=cand: afd(costs, facts, c, b, context, wide, node), tpot_ms)
        else:
            e = best(lambda b, c=cand: tp(costs, facts, c, b, context, node, wide), tpot_ms)
        if e is not None:
            found.append(e)
    return sorted(found, key=lambda e: -e.tokens_per_s_per_gpu)


COLUMNS = ("layout", "batch", "attention µs", "FFN µs", "wire µs", "layer µs", "stages buy", "TPOT ms", "tokens/s/GPU",
           "memory GB")


def table(estimates: Sequence[Estimate]) -> str:
    """The estimates as a Markdown table (one row each)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for e in estimates:
        mem = " / ".join(f"{k} {v / 1e9:.1f}" for k, v in e.memory.items()) + ("" if e.fits else " (does not fit)")
        gain = f"{e.stages_gain:.2f}x" if e.stages_gain else "-"
        lines.append(f"| {e.layout} | {e.batch} | {e.attention_us:.1f} | {e.ffn_us:.1f} | {e.wire_us:.1f} | "
                     f"{e.layer_us:.1f} | {gain} | {e.step_us / 1e3:.2f} | {e.tokens_per_s_per_gpu:.0f} | {mem} |")
    return "\n".join(lines)
