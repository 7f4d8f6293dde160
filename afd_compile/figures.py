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


def mermaid_flag(text: str) -> int | str:
    """``plan --mermaid``'s value: a layer index, or ``ranks`` (the whole layout)."""
    import argparse

    if text == "ranks":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give a layer index or 'ranks', got {text!r}") from None


def afd_mermaid(result: Any, layout: AFDLayout | None, layer: int | str = 0) -> str:
    """One layer of the AFD split (``result``: :class:`afd_compile.split_api.SplitResult`), or
    with ``layer="ranks"`` the whole layout (:func:`afd_ranks_mermaid`)."""
    if layer == "ranks":
        return afd_ranks_mermaid(result, layout or AFDLayout(1, 1))
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
    fan = (
        f"concatenate the tokens of attention ranks {peers}"
        if len(peers) > 1
        else f"tokens of attention rank {peers[0]}"
    )
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


def afd_ranks_mermaid(result: Any, layout: AFDLayout) -> str:
    """Every rank of an AFD layout: the attention ranks (in their TP groups), the FFN ranks (in
    their TP / EP groups), and per link what crosses it per token and step (every layer's wire,
    both ways)."""
    cuts = result.plan.cuts
    to_ffn = sum(w.bytes_per_token for c in cuts for w in c.wire_in.tensors)
    back = sum(w.bytes_per_token for c in cuts for w in c.wire_out.tensors)
    lines = ["flowchart LR"]
    groups = layout.attention_groups() or [(r,) for r in range(layout.ffn_ranks, layout.world_size)]
    for g in groups:
        label = f"attention TP group {list(g)}" if len(g) > 1 else f"attention rank {g[0]}"
        lines.append(f"  subgraph A{g[0]}[{_q(label + ': its own sequences and KV cache')}]")
        lines += [f"    r{r}[{_q(f'rank {r}: attention')}]" for r in g]
        lines.append("  end")
    kind = "TP" if layout.ffn_tp > 1 else "EP"
    for g in layout.ffn_groups() or [(f,) for f in range(layout.ffn_ranks)]:
        label = f"FFN {kind} group {list(g)}" if len(g) > 1 else f"FFN rank {g[0]}"
        lines.append(f"  subgraph F{g[0]}[{_q(label)}]")
        lines += [f"    r{f}[{_q(f'rank {f}: FFN, fans in {list(layout.peers_of_ffn(f))}')}]" for f in g]
        lines.append("  end")
    for f in range(layout.ffn_ranks):
        for a in layout.peers_of_ffn(f):
            lines.append(f"  r{a} <-- {_q(f'{to_ffn} + {back} B/token per step ({len(cuts)} layers)')} --> r{f}")
    label = _ffn_group_traffic(result, layout, cuts[0].wire_in.tensors[0].bytes_per_token if cuts else 0)
    for g in layout.ffn_groups():
        lines += [f"  r{a} <-. {_q(label)} .-> r{b}" for a, b in zip(g, g[1:], strict=False)]
    return "\n".join(lines)


def _ffn_group_traffic(result: Any, layout: AFDLayout, hidden: int) -> str:
    """What an FFN group's collectives move, per token: TP's all-gather of the hidden states and
    reduce-scatter of the partial sums at every layer; EP's all-to-all of each token to the ranks
    of its experts (up to top-k copies) and back, at every MoE layer."""
    parts = layout.ffn_group_size
    if layout.ffn_tp > 1:
        return (
            f"FFN TP: all-gather + reduce-scatter, {2 * (parts - 1) * hidden} B/token per layer "
            f"(its {hidden} B to {parts - 1} other rank(s), the partial sums back)"
        )
    moe = [r for r in getattr(result, "moe", ()) if r.op]
    k = max((r.top_k for r in moe), default=1)
    return (
        f"FFN EP: all-to-all, up to {2 * min(k, parts) * hidden} B/token per MoE layer ({len(moe)} layers: "
        f"a token to the ranks of its top-{k} experts and back)"
    )


def tp_ranks_mermaid(plan: Any) -> str:
    """Every rank of a TP layout: the attention TP groups (each a DP group with its own tokens)
    inside the TP group, and the collectives of a step with their bytes per token."""
    lay = plan.layout
    per_layer = [sum((plan.collective_bytes(m, j) or {}).values()) for m, j in plan.layers]
    kinds = sorted({t for m, j in plan.layers for v in {**j.names(), "x": plan.inside_mlp(m)}.values() for t in v})
    title = f"TP group of {lay.tp}: {', '.join(kinds) or 'no collective'}; {sum(per_layer)} B/token per step"
    lines = [
        "flowchart LR",
        f"  subgraph TP[{_q(title)}]",
    ]
    for g in range(lay.attn_dp):
        ranks = list(range(g * lay.attn_tp, (g + 1) * lay.attn_tp))
        lines.append(f"    subgraph D{g}[{_q(f'attention TP group {ranks}: DP group {g}, its own tokens')}]")
        lines += [f"      r{r}[{_q(f'rank {r}')}]" for r in ranks]
        lines.append("    end")
    lines.append("  end")
    return "\n".join(lines)


def tp_mermaid(plan: Any, layer: int | str = 0) -> str:
    """One layer of a TP plan (``plan``: :class:`afd_compile.passes.dist_states.TPPlan`): the five
    distribution states and the collectives of its three junctions; ``layer="ranks"``: the ranks
    (:func:`tp_ranks_mermaid`)."""
    if layer == "ranks":
        return tp_ranks_mermaid(plan)
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
