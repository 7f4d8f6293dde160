"""Pictures of a plan as Mermaid flowcharts (``afd-compile plan --mermaid``; GitHub renders them in
Markdown): one layer of an AFD split (the attention and FFN programs and what crosses the wire),
or one layer of a TP plan (the distribution state of each part and the junction collectives).
Everything in them comes from the plan records, so the README's pictures are regenerated, not drawn.
"""

from __future__ import annotations

from typing import Any

from .layout import AFDLayout


def _q(text: str) -> str:
    return '"' + text.replace('"', "'") + '"'


def afd_mermaid(result: Any, layout: AFDLayout | None, layer: int = 0) -> str:
    """One layer of the AFD split (``result``: :class:`afd_compile.split_api.SplitResult`)."""
    cuts = {c.layer: c for c in result.plan.cuts}
    if layer not in cuts:
        raise ValueError(f"--mermaid: no layer {layer} in the plan (layers {sorted(cuts)})")
    cut = cuts[layer]
    layout = layout or AFDLayout(1, 1)
    peers = list(layout.peers_of_ffn(0))
    last = layer == max(cuts)
    down = f"{'final norm, LM head' if last else f'layer {layer + 1}'}"
    send = "<br/>".join(f"{w}: {w.bytes_per_token} B/token" for w in cut.wire_in.tensors)
    back = "<br/>".join(f"{w}: {w.bytes_per_token} B/token" for w in cut.wire_out.tensors)
    fan = f"concatenate the tokens of attention ranks {peers}" if len(peers) > 1 else f"tokens of attention rank {peers[0]}"
    lines = [
        "flowchart LR",
        f"  subgraph ATT[{_q(f'attention rank {peers[0]} (each attention rank: its own sequences, its KV cache)')}]",
        f"    a0[{_q(f'layer {layer}: attention program<br/>(norm, q/k/v, attention, o_proj, residual add)')}]",
        f"    a1[{_q(f'residual add, then {down}')}]",
        "  end",
        f"  subgraph FFN[{_q('FFN rank 0')}]",
        f"    f0[{_q(f'{fan}<br/>FFN program: the MLP, {len(cut.params)} weights<br/>split back per peer')}]",
        "  end",
        f"  a0 -- {_q(f'afd::p2p_send<br/>{send}')} --> f0",
        f"  f0 -- {_q(f'afd::p2p_send<br/>{back}')} --> a1",
    ]
    return "\n".join(lines)


def tp_mermaid(plan: Any, layer: int = 0) -> str:
    """One layer of a TP plan (``plan``: :class:`afd_compile.passes.dist_states.TPPlan`): the five
    distribution states and the collectives of its three junctions."""
    layers = {m.index: (m, j) for m, j in plan.layers}
    if layer not in layers:
        raise ValueError(f"--mermaid: no layer {layer} in the plan (layers {sorted(layers)})")
    m, j = layers[layer]
    lay = plan.layout

    def edge(junction: str) -> str:
        ts = getattr(j, junction)
        what = ", ".join(str(t) for t in ts) if ts else "no collective"
        return _q(f"{junction}: {what}")

    def state(name: str, label: str) -> str:
        mode = getattr(m, name)
        return _q(f"{label}<br/>{mode} (group of {lay.group_size(mode)})")

    lines = [
        "flowchart LR",
        f"  x[{state('layer_input', f'layer {layer} input')}]",
        f"  a[{state('attn', f'attention, heads split over {lay.attn_tp}')}]",
        f"  r[{state('middle_residual', 'residual + post-attention norm')}]",
        f"  f[{state('mlp', f'{m.kind} MLP')}]",
        f"  y[{state('layer_output', 'layer output')}]",
        f"  x -- {edge('prepare_attn')} --> a",
        f"  a -- {edge('prepare_mlp')} --> f",
        f"  f -- {edge('postprocess_layer')} --> y",
        "  a -.-> r -.-> y",
    ]
    if plan.head is not None and plan.head.transition is not None and layer == max(layers):
        lines.append(f"  y --> h[{_q(f'LM head: vocabulary split over {plan.head.parts}<br/>{plan.head.transition}')}]")
    return "\n".join(lines)
