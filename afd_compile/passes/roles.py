"""Layer discovery and role annotation: every node gets ``node.meta["afd.role"] = NodeRole``.

Policy apart from mechanism: a *policy* is a callable ``GraphModule -> {Node: NodeRole}`` that says
which nodes form each layer's FFN region; :func:`annotate_roles` (the mechanism) validates the
answer, applies ``compute_gate_on_attention`` and stamps the meta key.

The FFN region of a layer is the MLP / MoE block, from the post-attention norm's output
(exclusive) to the value added back into the residual stream. Everything else (embedding, norms,
attention, residual adds, final norm, lm head) is attention role. Before / after on a Llama layer::

    mul_14 = post_attention_layernorm(...)          L0:attention
    linear_4 = aten.linear(mul_14, gate_proj)        L0:ffn
    silu = aten.silu(linear_4)                       L0:ffn
    linear_5 = aten.linear(mul_14, up_proj)          L0:ffn
    mul_15 = aten.mul(silu, linear_5)                L0:ffn
    linear_6 = aten.linear(mul_15, down_proj)        L0:ffn
    add_8 = aten.add(to_8, linear_6)                 L0:attention   (the residual add)

Two policies ship: :func:`module_path_policy` (the MLP child of each decoder layer, read from
``nn_module_stack``) and :func:`structural_policy` (attention anchors, residual adds and the
post-attention norm found from the data flow alone, for graphs without module paths).
:func:`default_policy` tries the first and falls back to the second.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from .. import meta_keys
from ..errors import AFDCompileError
from .mixer_blocks import block_layers, mixes_tokens, per_token_child
from .module_paths import body_of, layer_path, module_paths
from .op_kinds import ADD_OPS, LINEAR_OPS, PASSTHROUGH_OPS, is_attention_op
from .router import find_router

META_KEY = meta_keys.ROLE

aten = torch.ops.aten


class Role(enum.Enum):
    ATTENTION = "attention"
    FFN = "ffn"


@dataclass(frozen=True)
class NodeRole:
    """A node's layer index (None outside any layer) and role. ``router`` marks the router-logits
    node moved to the attention side by ``compute_gate_on_attention``."""

    layer: int | None
    role: Role
    router: bool = False

    def __str__(self) -> str:
        where = "-" if self.layer is None else f"L{self.layer}"
        return f"{where}:{self.role.value}{'+router' if self.router else ''}"


class NoStructureError(AFDCompileError):
    """No attention/FFN structure could be found in a graph."""


class FusedLayerError(NoStructureError):
    """A whole layer (or attention block) is one fused op: nothing in it can be cut or sharded."""


#: fused ops that hold a whole layer or attention block: PyTorch's fast path of
#: ``nn.TransformerEncoderLayer`` in eval mode without autograd, which dynamo traces as it runs
#: (torch.export traces the layer's Python body instead), and the fused multi-head attention
#: kernel a graph may hold the same way
FUSED_LAYER_OPS = {
    aten._transformer_encoder_layer_fwd.default: "nn.TransformerEncoderLayer",
    aten._native_multi_head_attention.default: "nn.MultiheadAttention",
}


def refuse_fused_layers(gm: fx.GraphModule, graph_name: str = "graph") -> None:
    """Raise :class:`FusedLayerError` naming the first fused-layer op of ``gm`` and the remedy."""
    fused = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in FUSED_LAYER_OPS]
    if fused:
        n = fused[0]
        raise FusedLayerError(
            f"{graph_name}: node {n.name} ({n.target}) is {FUSED_LAYER_OPS[n.target]}'s fast path, one fused "
            f"kernel for the whole block ({len(fused)} such node(s)): it cannot be cut into attention and FFN or "
            "sharded. PyTorch takes it in eval mode without autograd; call "
            "torch.backends.mha.set_fastpath_enabled(False) before the model's first compiled call")


RolePolicy = Callable[[fx.GraphModule], dict[fx.Node, NodeRole]]

FFN_MODULE_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe", "ff")


# --- module-path policy ------------------------------------------------------------------------


def module_path_policy(gm: fx.GraphModule) -> dict[fx.Node, NodeRole]:
    """The FFN region of decoder layer ``...layers.N`` is the nodes under its MLP child module
    (``mlp``, ``feed_forward``, ``block_sparse_moe``, ...). When no layer has one and some are
    per-token blocks (a model that writes every mixer as its own block), the layers are the
    blocks grouped as ``passes/mixer_blocks.py`` says. Raises NoStructureError when the graph
    has no module paths or a layer has no such child."""
    layer_of = _applications(gm)
    # layers numbered in the order they compute: a get_attr hoisted to the graph's top (a weight a
    # higher-order op's submodule reads, e.g. under autocast) says nothing of when its layer runs
    computing = [lp for n, lp in layer_of.items() if n.op == "call_function"]
    order = list(dict.fromkeys([*computing, *layer_of.values()]))
    if not order:
        raise NoStructureError("no nn_module_stack paths with a layer index (…layers.N)")
    index: dict[str, int | None] = {lp: i for i, lp in enumerate(order)}
    children_of: dict[str, set[str]] = {lp: set() for lp in order}
    for n, owner in layer_of.items():
        for p in module_paths(n):
            if p.startswith(_path(owner) + "."):
                children_of[owner].add(p[len(_path(owner)) + 1 :].split(".")[0])
    named = {lp: next((c for c in FFN_MODULE_NAMES if c in children_of[lp]), None) for lp in order}
    ffn_child = {lp: f"{_path(lp)}.{c}" if c else None for lp, c in named.items()}
    by_blocks = False
    if not any(named.values()):  # single-mixer blocks?
        members: dict[str, list[fx.Node]] = {lp: [] for lp in order}
        for n, lp in layer_of.items():
            members[lp].append(n)
        blocks = {lp: per_token_child(_path(lp), members[lp]) for lp in order}
        by_blocks = any(blocks.values())
        if by_blocks:
            ffn_child, index = blocks, block_layers(order, blocks)
    missing = [lp for lp in order if ffn_child[lp] is None]
    if missing and not by_blocks:
        raise NoStructureError(
            f"layer {missing[0]} has no MLP child module (looked for {FFN_MODULE_NAMES}; children: "
            f"{sorted(children_of[missing[0]])})" + ("" if any(named.values()) else
                                                     ", and no layer is a per-token block (an MLP or MoE alone)"))
    roles: dict[fx.Node, NodeRole] = {}
    for node in gm.graph.nodes:
        lp = layer_of.get(node)
        if lp is None:
            roles[node] = NodeRole(None, Role.ATTENTION)
            continue
        ffn = ffn_child[lp]
        in_ffn = ffn is not None and any(p == ffn or p.startswith(ffn + ".") for p in module_paths(node))
        roles[node] = NodeRole(index[lp], Role.FFN if in_ffn else Role.ATTENTION)
    _residual_adds_out(roles)
    return roles


def _path(layer: str) -> str:
    """A layer's module path (``...layers.N#k``, its k-th application: ``...layers.N``)."""
    return layer.split("#")[0]


def _applications(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Each node's decoder layer, ``...layers.N``. A layer module applied again after another
    layer ran (a looped model that runs its layers several times over: Dory) is a layer again
    each time, ``...layers.N#k`` for its k-th application, when every application computes under
    its MLP child (else it is one layer with a node traced late, as before)."""
    plain: dict[fx.Node, str] = {}
    applied: dict[fx.Node, str] = {}
    runs: dict[str, int] = {}
    last = None
    for node in gm.graph.nodes:
        lp = layer_path(module_paths(node))
        if lp is None:
            continue
        if node.op == "call_function" and lp != last:
            runs[lp] = runs[lp] + 1 if lp in runs else 0
            last = lp
        plain[node] = lp
        applied[node] = f"{lp}#{runs[lp]}" if runs.get(lp) else lp
    if applied == plain:
        return plain
    under_mlp = {key for n, key in applied.items() if n.op == "call_function" and any(
        p[len(plain[n]) + 1 :].split(".")[0] in FFN_MODULE_NAMES for p in module_paths(n)
        if p.startswith(plain[n] + "."))}
    return applied if set(applied.values()) <= under_mlp else plain


def _residual_adds_out(roles: dict[fx.Node, NodeRole]) -> None:
    """An MLP module that adds the residual itself (BLOOM's ``mlp(x, residual)``): the add that
    ends its region and reads a tensor of the attention side is the residual stream's, not the
    FFN's (else the region would read two hidden states). Reassigned in place, repeatedly (an add
    that ends the region once the last one left)."""
    changed = True
    while changed:
        changed = False
        for n, r in roles.items():
            if r.role is not Role.FFN or n.op != "call_function" or n.target not in ADD_OPS:
                continue
            ins = n.all_input_nodes
            outside = [a for a in ins if roles[a].role is Role.ATTENTION and a.op != "get_attr"]
            if len(ins) == 2 and len(outside) == 1 and all(roles[u].role is not Role.FFN for u in n.users):
                roles[n] = replace(r, role=Role.ATTENTION)
                changed = True


# --- structural policy -------------------------------------------------------------------------


def ancestors(nodes: Iterable[fx.Node], stop: Callable[[fx.Node], bool] = lambda n: False,
               within: set[fx.Node] | None = None) -> set[fx.Node]:
    """``nodes`` and every node they read, transitively (not past ``stop``; only inside ``within``)."""
    seen: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n in seen or stop(n) or (within is not None and n not in within):
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def descendants(node: fx.Node, within: set[fx.Node] | None = None) -> set[fx.Node]:
    """``node`` and every node reached through its users (only through ``within`` when given)."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen or (within is not None and n not in within):
            continue
        seen.add(n)
        stack.extend(n.users)
    return seen


def _cast_chain(node: fx.Node) -> set[fx.Node]:
    """``node`` and the nodes reached from it through pass-through ops only."""
    out = {node}
    stack = [node]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u.op == "call_function" and u.target in PASSTHROUGH_OPS and u not in out:
                out.add(u)
                stack.append(u)
    return out


def structural_policy(gm: fx.GraphModule) -> dict[fx.Node, NodeRole]:
    """Layers from the data flow: each attention op (SDPA or explicit matmul-softmax-matmul) opens
    a layer; its residual add ``h1 = x + attn_out`` is the first add joining the attention output
    with a value from before the attention; the MLP residual add ``h2 = h1 + mlp_out`` is the next
    add reading ``h1`` (or a cast of it) and a value computed through a linear op from ``h1``. The
    FFN input is the last node every path from ``h1`` to ``mlp_out`` passes through before the
    first linear op (the post-attention norm's output); its output is the last linear op when
    every later node of the MLP branch reads only that op's output (a post-MLP norm or scale stays
    on the residual branch), else ``mlp_out``."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    anchors = [n for n in nodes if is_attention_op(n)]
    if not anchors:
        raise NoStructureError("no attention op (scaled_dot_product_attention or matmul-softmax-matmul)")
    roles = {n: NodeRole(None, Role.ATTENTION) for n in nodes}
    prev_end = -1
    for li, anchor in enumerate(anchors):
        before = ancestors([anchor])
        after = descendants(anchor)
        h1 = next(
            (
                n
                for n in nodes[pos[anchor] + 1 :]
                if n.op == "call_function"
                and n.target in ADD_OPS
                and len(n.all_input_nodes) == 2
                and any(a in after for a in n.all_input_nodes)
                and any(a in before and a not in after for a in n.all_input_nodes)
            ),
            None,
        )
        if h1 is None:
            raise NoStructureError(f"attention op {anchor.name} has no residual add after it")
        # (the MLP's add precedes the next layer's attention, which reads it)
        end = pos[anchors[li + 1]] if li + 1 < len(anchors) else len(nodes)
        found = _mlp_add(nodes[pos[h1] + 1 : end], h1, before, after)
        if found is None:
            raise NoStructureError(
                f"layer {li} (attention {anchor.name}): no MLP residual add after {h1.name} (looked for "
                f"{h1.name} + mlp(norm({h1.name})), norm({h1.name}) + mlp(norm({h1.name})) as a post-norm "
                "layer has it, and an MLP beside the attention adding into the same residual add)")
        h2, mlp_out, below = found
        region = sorted(ancestors([mlp_out]) & below, key=pos.__getitem__)
        first_linear = next(
            (i for i, n in enumerate(region) if n.op == "call_function" and n.target in LINEAR_OPS), None
        )
        if first_linear is None:
            raise NoStructureError(f"layer {li}: no linear op between {h1.name} and {h2.name}")
        # the last cut vertex before the first linear: no edge of the region jumps over it
        rpos = {n: i for i, n in enumerate(region)}
        max_reach, cut = -1, None
        for i, n in enumerate(region[:first_linear]):
            if max_reach <= i:
                cut = n
            max_reach = max(max_reach, *(rpos[u] for u in n.users if u in rpos), i)
        if cut is None:
            raise NoStructureError(f"layer {li}: cannot find the FFN input between {h1.name} and {h2.name}")
        # and the first cut vertex after the last linear: a dense MLP's down projection, when all
        # that follows it reads only its output (a post-MLP norm, a scale, a cast: Gemma-2's and
        # OLMo-2's sandwich norms) - that tail is the residual branch's, as under module paths;
        # an MoE's combine (several partial sums meeting after their projections) stays inside
        last_linear = max(i for i, n in enumerate(region) if n.op == "call_function" and n.target in LINEAR_OPS)
        reach = max([rpos[u] for n in region[:last_linear] for u in n.users if u in rpos], default=-1)
        end = last_linear + 1 if reach <= last_linear else len(region)
        ffn = set(region[rpos[cut] + 1 : end])
        # constants computed inside the MLP (no data from h1) go with the nodes that use them
        from_cut = descendants(cut)
        upstream = [n for n in ancestors([mlp_out]) if n not in from_cut and n.op == "call_function"]
        changed = True
        while changed:
            changed = False
            for n in upstream:
                if n not in ffn and n.users and all(u in ffn for u in n.users):
                    ffn.add(n)
                    changed = True
        end_pos = max(pos[h1], pos[h2])
        for n in nodes[prev_end + 1 : end_pos + 1]:
            roles[n] = NodeRole(li, Role.FFN if n in ffn else Role.ATTENTION)
        prev_end = end_pos
    return roles


def _has_linear(nodes: Iterable[fx.Node]) -> bool:
    return any(x.op == "call_function" and x.target in LINEAR_OPS for x in nodes)


def _source(n: fx.Node) -> fx.Node:
    """The value ``n`` carries, back through casts, views and (eval-mode) dropout."""
    while n.op == "call_function" and (n.target in PASSTHROUGH_OPS or n.target == aten.dropout.default) \
            and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _mlp_branch(nodes: set[fx.Node]) -> bool:
    """A branch computed through a linear op and no attention op (not the next layer's attention)."""
    return _has_linear(nodes) and not any(is_attention_op(x) for x in nodes)


def _mlp_add(span: list[fx.Node], h1: fx.Node, before: set[fx.Node],
             after: set[fx.Node]) -> tuple[fx.Node, fx.Node, set[fx.Node]] | None:
    """The add that joins the MLP's output into the residual stream of the layer whose attention
    residual add is ``h1``: ``(add, mlp_out, nodes the MLP branch may hold)``, or None. ``span``:
    the nodes after ``h1`` up to the next layer's attention op. Three
    shapes, tried in order::

        pre-norm    h2 = h1 + mlp(norm(h1))             (Llama; a cast of h1 may stand for it)
        post-norm   h2 = norm(h1) + mlp(norm(h1))       (the original Transformer, OPT-350m,
                                                         torch's TransformerEncoderLayer(norm_first=False))
        parallel    h1 = x + attn(norm(x)) + mlp(norm'(x)), the adds in any order
                                                        (GPT-J, GPT-NeoX/Falcon parallel blocks)

    In the parallel shape the MLP branch reads the layer's input, not ``h1``: it is an operand of
    an add around ``h1`` (one of its add inputs, or an add reading it) that the attention does not
    reach, computed through a linear op the attention does not read."""
    chain = _cast_chain(h1)
    below = descendants(h1)
    adds = [n for n in span if n.op == "call_function" and n.target in ADD_OPS and len(n.all_input_nodes) == 2]
    pos = {n: i for i, n in enumerate(span)}
    pos[h1] = -1
    for n in adds:  # pre-norm
        a, b = n.all_input_nodes
        for res, other in ((a, b), (b, a)):
            if res in chain and other in below and other not in chain and _mlp_branch(ancestors([other]) & below):
                return n, other, below
    # post-norm: the residual is a norm of h1: no linear op between them, and nothing of the layer
    # reaches it but through h1 (an add of h1 and a parallel MLP's output is no norm of h1)
    residual = [a for a in h1.all_input_nodes if a in before and a not in after]
    layer_in = descendants(residual[0]) if residual else set()
    through_h1 = below | ancestors([h1])
    for n in adds:
        a, b = n.all_input_nodes
        for res, other in ((a, b), (b, a)):
            if res not in below or res in chain or _has_linear(ancestors([res]) & below):
                continue
            if not ancestors([res]) & layer_in <= through_h1:
                continue
            from_res = descendants(res)
            if other in from_res and other is not res and _mlp_branch(ancestors([other]) & from_res):
                return n, other, from_res
    # parallel: the adds around h1 (through its add inputs the attention computed, and adds reading it)
    group, stack = {h1}, [h1]
    while stack:
        n = stack.pop()
        near = [_source(a) for a in n.all_input_nodes if a in after] + [
            u for c in _cast_chain(n) for u in c.users if u in pos]  # (not past the next attention)
        for m in near:
            if m not in group and m.op == "call_function" and m.target in ADD_OPS and len(m.all_input_nodes) == 2:
                group.add(m)
                stack.append(m)
    if not residual:
        return None
    for n in sorted(group, key=lambda x: pos.get(x, -2)):  # (adds before h1 first)
        for m in n.all_input_nodes:
            if m in after or m in group or m in before or m not in layer_in:
                continue
            if _mlp_branch(ancestors([m]) - before):
                return n, m, layer_in
    return None


def default_policy(gm: fx.GraphModule) -> dict[fx.Node, NodeRole]:
    """Module paths when the graph has them, structure otherwise; structure also where a layer's
    MLP module leaves an MoE router on the attention side (an MoE beside the MLP whose router and
    experts are the layer's own children, Gemma-4's) and the structure's FFN regions hold both."""
    try:
        roles = module_path_policy(gm)
    except NoStructureError as first:
        try:
            return structural_policy(gm)
        except NoStructureError as second:
            raise NoStructureError(f"by module path: {first}; by structure: {second}") from None
    sides: dict[int, list[fx.Node]] = {}
    for n, r in roles.items():
        if r.layer is not None and r.role is Role.ATTENTION:
            sides.setdefault(r.layer, []).append(n)
    left = [router for side in sides.values() if (router := find_router(side)) is not None]
    if not left:
        return roles
    try:
        wider = structural_policy(gm)
    except NoStructureError:
        return roles
    ffn = {n for n, r in roles.items() if r.role is Role.FFN}
    if all(wider[n].role is Role.FFN and wider[n].layer == roles[n].layer for n in [*ffn, *left]):
        return wider
    return roles


#: Policies by name (CLI ``--policy``).
POLICIES: dict[str, RolePolicy] = {
    "default": default_policy,
    "module_path": module_path_policy,
    "structural": structural_policy,
}


# --- the mechanism -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RoleSummary:
    """What :func:`annotate_roles` found: per layer, the FFN node count and the router node; the
    layers whose token mixer is not attention."""

    graph_name: str
    num_layers: int
    ffn_nodes_per_layer: tuple[int, ...]
    routers: tuple[str | None, ...]
    #: layers whose token mixer is not attention (:func:`non_attention_layers`)
    non_attention: tuple[int, ...] = ()

    def __str__(self) -> str:
        mixers = f", token mixer not attention in layers {list(self.non_attention)}" if self.non_attention else ""
        return (
            f"{self.graph_name}: {self.num_layers} layers, FFN nodes per layer "
            f"{list(self.ffn_nodes_per_layer)}, routers {list(self.routers)}{mixers}"
        )


def mutates_first_arg(n: fx.Node) -> bool:
    if not isinstance(n.target, torch._ops.OpOverload):
        return False
    args = n.target._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _attrs_at_first_use(gm: fx.GraphModule) -> None:
    """Move each get_attr that carries a layer's module path (a weight, or the submodule, of a
    higher-order op such as autocast's region) to just before its first user: where export hoists
    it, at the graph's top, it would be its layer's first member and the layer's FFN would seem to
    start before its attention (each pass cutting or sharding there reads the first FFN node)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in [n for n in gm.graph.nodes if n.op == "get_attr" and n.users]:
        if layer_path(module_paths(n)) is not None:
            min(n.users, key=order.__getitem__).prepend(n)


def annotate_roles(
    gm: fx.GraphModule,
    policy: RolePolicy = default_policy,
    *,
    compute_gate_on_attention: bool = False,
    graph_name: str = "graph",
) -> RoleSummary:
    """Stamp ``node.meta["afd.role"]`` on every node of ``gm`` (in place; the graph computes the
    same: a get_attr of a layer's module, hoisted to the graph's top, moves to its first use).

    With ``compute_gate_on_attention`` the router linear of each MoE layer (and the views feeding
    it) move to the attention side; its output, the router logits, then crosses the wire.
    """
    refuse_fused_layers(gm, graph_name)
    _attrs_at_first_use(gm)
    try:
        roles = policy(gm)
    except NoStructureError as e:
        raise NoStructureError(f"{graph_name}: no attention/FFN structure found: {e}") from None
    layers = sorted({r.layer for r in roles.values() if r.layer is not None and r.role is Role.FFN})
    if not layers:
        raise NoStructureError(f"{graph_name}: no attention/FFN structure found: no layer has an FFN region")
    missing = [n.name for n in gm.graph.nodes if n not in roles]
    if missing:
        raise ValueError(f"{graph_name}: role policy left nodes without a role: {missing[:5]}")
    by_layer: dict[int | None, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        by_layer.setdefault(roles[n].layer, []).append(n)
    _share_size_arithmetic(gm, roles)
    for n in gm.graph.nodes:
        # a metadata assertion belongs with the tensor it checks, and an in-place op nobody reads
        # (transformers 5.17's MoE: ``expert_ids.clamp_(...)``) with the tensor it mutates
        if isinstance(n.args[0] if n.args else None, fx.Node) and (
                n.target == aten._assert_tensor_metadata.default or (not n.users and mutates_first_arg(n))):
            roles[n] = roles[n.args[0]]
    routers: list[str | None] = []
    for layer in layers:
        ffn_nodes = [n for n in by_layer.get(layer, []) if roles[n] == NodeRole(layer, Role.FFN)]
        router = find_router(ffn_nodes)
        routers.append(router.name if router else None)
        if compute_gate_on_attention and router is not None:
            moved = ancestors([router]) & set(ffn_nodes)
            # a region op's other outputs go with it (a tuple never crosses the cut)
            moved |= {u for m in moved if body_of(m) is not None for u in m.users if u.target is operator.getitem}
            for n in moved:
                roles[n] = replace(roles[n], role=Role.ATTENTION, router=(n is router))
    if compute_gate_on_attention and not any(routers):
        raise NoStructureError(f"{graph_name}: compute_gate_on_attention (--gate-on-attention): none of the "
                               f"{len(layers)} layers has an MoE router (a linear whose scores a top-k turns into "
                               "expert choices), so there are no router logits to send: a dense model runs without it")
    for node in gm.graph.nodes:
        node.meta[META_KEY] = roles[node]
    return RoleSummary(
        graph_name,
        len(layers),
        tuple(sum(1 for n in by_layer.get(la, []) if roles[n] == NodeRole(la, Role.FFN)) for la in layers),
        tuple(routers),
        tuple(non_attention_layers(gm)),
    )


def non_attention_layers(gm: fx.GraphModule) -> list[int]:
    """The layers of a graph annotated with roles (the whole model, or an AFD attention program)
    whose token mixer is not attention: no attention op (SDPA, or a softmax between two matmuls)
    on their attention side, yet an op there that mixes tokens, as the state-space, convolution and
    linear-attention layers of hybrid models (Jamba, Qwen3-Next, MiniMax). AFD runs such a mixer
    whole on the attention ranks, its recurrent state there as attention's KV cache is (the cut
    only needs the FFN region after it); TP, which splits attention by heads, refuses them
    (passes/shard/plan.py). A layer with no token mixer at all (an MLP block right after another,
    as a layer of its own) is not one."""
    sides: dict[int, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        r = n.meta.get(META_KEY)
        if r is not None and r.layer is not None and r.role is Role.ATTENTION:
            sides.setdefault(r.layer, []).append(n)
    return sorted(layer for layer, side in sides.items()
                  if not any(is_attention_op(n) for n in side) and mixes_tokens(side))


def _is_size(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, int)) and node.op == "call_function"


def _share_size_arithmetic(gm: fx.GraphModule, roles: dict[fx.Node, NodeRole]) -> None:
    """Size arithmetic (SymInt nodes) inside an FFN region that the attention side also uses
    (export CSEs ``s0 * s1`` across layers) stays on the attention side; the FFN program
    recomputes it from its own token count."""
    for node in reversed(list(gm.graph.nodes)):
        r = roles[node]
        if r.role is not Role.FFN or not _is_size(node):
            continue
        if any(roles[u].role is not Role.FFN or roles[u].layer != r.layer for u in node.users):
            stack = [node]
            while stack:
                n = stack.pop()
                if roles[n].role is Role.FFN:
                    if not _is_size(n):
                        raise NoStructureError(
                            f"size {node.name}, used outside the FFN region of layer {r.layer}, is "
                            f"computed from FFN tensor {n.name}"
                        )
                    roles[n] = replace(roles[n], role=Role.ATTENTION)
                    stack.extend(n.all_input_nodes)


def role_of(node: fx.Node) -> NodeRole:
    try:
        return node.meta[META_KEY]
    except KeyError:
        raise KeyError(f"node {node.name} has no {META_KEY!r}; run annotate_roles first") from None
