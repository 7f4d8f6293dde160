"""Infer a DistState for every node and plan the junction collectives of every layer.

Reads ``afd.role`` (layers, roles); writes ``node.meta["afd.dist"] = DistState``. Per layer, the
kind (``moe`` when its FFN region routes tokens with topk, else ``dense``) picks the MLP mode; the
other four modes follow (:func:`afd_compile.scatter.infer_layer_modes`), and the junctions come
from :func:`afd_compile.scatter.plan_junctions`. Node by node, in one layer::

    layer input ... q/k/v, attention ........ attn                (TP_ATTN_FULL)
    o_proj (row-parallel) ................... attn + partial      (settled at prepare_mlp)
    residual add, post-attention norm ....... middle_residual
    MLP / MoE region ........................ mlp, its output + partial (settled at postprocess_layer)
    residual add after the MLP ............... layer_output
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from .. import meta_keys
from ..scatter import (
    DistState,
    JunctionPlan,
    LayerModes,
    ScatterMode,
    TPLayout,
    infer_layer_modes,
    plan_junctions,
)
from .graph_utils import layers_of, region_output
from .roles import Role, role_of
from .router import routes_experts
from .vocab_head import HeadPlan, plan_head

META_KEY = meta_keys.DIST


@dataclass(frozen=True)
class TPPlan:
    graph_name: str
    layout: TPLayout
    layers: tuple[tuple[LayerModes, JunctionPlan], ...]
    head: HeadPlan | None = None  # the LM head's vocabulary split (vocab_head.py); None: no head found
    #: bytes of one token's hidden state (the residual stream's row: what each collective moves
    #: per token); None when the graph holds no shape for it
    hidden_bytes: int | None = None

    def collective_bytes(self, m: LayerModes, j: JunctionPlan) -> dict[str, int] | None:
        """Per junction of a layer, the bytes its collectives move per token: one hidden row per
        token and collective (an all-reduce's ring moves it twice over the wire; an MoE's
        all-to-all sends a row to each rank among its top-k experts' ranks: counted once here)."""
        if self.hidden_bytes is None:
            return None
        names = {**j.names(), "inside_mlp": self.inside_mlp(m)}
        return {k: len(v) * self.hidden_bytes for k, v in names.items() if v}

    def to_json(self) -> dict:
        return {
            "graph": self.graph_name,
            "layout": {"tp": self.layout.tp, "attn_dp": self.layout.attn_dp, "attn_tp": self.layout.attn_tp,
                       "moe_a2a": self.layout.moe_a2a, "dense_dp": self.layout.dense_dp,
                       "vocab_parallel": self.layout.vocab_parallel},
            "layers": [{"layer": m.index, "kind": m.kind, "modes": m.modes(), "junctions": j.names(),
                        "inside_mlp": self.inside_mlp(m), "bytes_per_token": self.collective_bytes(m, j)}
                       for m, j in self.layers],
            "hidden_bytes_per_token": self.hidden_bytes,
            "head": None if self.head is None else self.head.to_json(),
        }

    def inside_mlp(self, m: LayerModes) -> list[str]:
        """Collectives inside the MLP itself: an MoE with all-to-all dispatches its tokens to the
        experts' ranks and combines the results back (``afd.ep_dispatch`` / ``afd.ep_combine``)."""
        if m.kind == "moe" and m.mlp is ScatterMode.SCATTERED and self.layout.tp > 1:
            return ["all_to_all_dispatch", "all_to_all_combine"]
        return []

    def table(self) -> str:
        head = ("layer", "kind", "layer_input", "attn", "mlp", "middle_residual", "layer_output",
                "prepare_attn", "prepare_mlp", "inside_mlp", "postprocess_layer")
        rows = [head]
        for m, j in self.layers:
            names = j.names()
            rows.append((str(m.index), m.kind, *m.modes().values(),
                         *[", ".join(names[k]) or "-" for k in ("prepare_attn", "prepare_mlp")],
                         ", ".join(self.inside_mlp(m)) or "-", ", ".join(names["postprocess_layer"]) or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        head = [str(self.head)] if self.head is not None else []
        per_layer = [sum((self.collective_bytes(m, j) or {}).values()) for m, j in self.layers]
        traffic = ([f"collective traffic: {self.hidden_bytes} B per token and collective (one hidden row); per step "
                    f"{sum(per_layer)} B per token over {len(per_layer)} layers (per layer: "
                    f"{', '.join(map(str, per_layer))})"] if self.hidden_bytes is not None else [])
        return "\n".join([f"plan: {self.graph_name}: {self.layout} (attn_tp={self.layout.attn_tp})", *lines, *head,
                          *traffic])


def layer_kinds(gm: fx.GraphModule) -> list[str]:
    """``moe`` for layers whose FFN region chooses experts (a top-k, or the recognised op), else ``dense``."""

    kinds: dict[int, str] = {}
    for n in gm.graph.nodes:
        r = role_of(n)
        if r.layer is None:
            continue
        kinds.setdefault(r.layer, "dense")
        if (r.role is Role.FFN or r.router) and routes_experts(n):
            kinds[r.layer] = "moe"
    return [kinds[i] for i in sorted(kinds)]


def plan_tp(gm: fx.GraphModule, layout: TPLayout, graph_name: str = "graph") -> TPPlan:
    modes = infer_layer_modes(layer_kinds(gm), layout)
    last = modes[-1].layer_output if modes else ScatterMode.TP_ATTN_FULL
    return TPPlan(graph_name, layout, tuple((m, plan_junctions(m, layout)) for m in modes),
                  plan_head(gm, layout, last), _hidden_bytes(gm))


def _hidden_bytes(gm: fx.GraphModule) -> int | None:
    """Bytes of one token's row of the residual stream: the first layer's FFN output's last dim."""
    for layer in layers_of(gm).values():
        out = layer.ffn_output
        val = out.meta.get("val") if out is not None else None
        if val is not None and hasattr(val, "shape") and val.dim():
            return int(val.shape[-1]) * val.element_size()
    return None


def annotate_dist_states(gm: fx.GraphModule, plan: TPPlan) -> None:
    """Stamp ``afd.dist`` on every node (in place; the graph is not changed)."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    layers = layers_of(gm)
    by_layer = {i: list(layer.members) for i, layer in layers.items()}
    modes = {m.index: (m, j) for m, j in plan.layers}
    first = ScatterMode.TP_ATTN_FULL
    for n in nodes:
        n.meta[META_KEY] = DistState(first)
    for layer, members in by_layer.items():
        m, j = modes[layer]
        ffn = [n for n in members if role_of(n).role is Role.FFN]
        ffn_set = set(ffn)
        start_ffn = pos[ffn[0]] if ffn else len(nodes)
        ffn_out = region_output(ffn)
        end_ffn = pos[ffn_out] if ffn_out is not None else start_ffn
        o_proj = layers[layer].output_projection
        attn_partial = plan.layout.group_size(m.attn) > 1
        mlp_partial = plan.layout.group_size(m.mlp) > 1 and m.mlp is not ScatterMode.SCATTERED
        for n in members:
            p = pos[n]
            if n in ffn_set:
                state = DistState(m.mlp, mlp_partial and n is ffn_out)
            elif p > end_ffn:
                state = DistState(m.layer_output)
            elif o_proj is not None and p > pos[o_proj]:
                state = DistState(m.middle_residual)
            elif n is o_proj:
                state = DistState(m.attn, attn_partial)
            else:
                state = DistState(m.attn) if p > pos[members[0]] else DistState(m.layer_input)
            n.meta[META_KEY] = state
    last = plan.layers[-1][0].layer_output if plan.layers else first
    tail = max((pos[n] for ms in by_layer.values() for n in ms), default=-1)
    for n in nodes[tail + 1:]:
        n.meta[META_KEY] = DistState(last)
    if plan.head is not None and plan.head.transition is not None:  # its slice of the vocabulary
        head = next(n for n in nodes if n.name == plan.head.node)
        head.meta[META_KEY] = plan.head.transition.src
