"""Which module a node was traced under (``nn_module_stack``), normalised: what the module-path
role policy (``roles.module_path_policy``) reads."""

from __future__ import annotations

import re

import torch
import torch.fx as fx


def _norm_path(path: str) -> str:
    path = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path)
    path = re.sub(r"^L\.self\.?|^L__self__\.?", "", path)
    return path.strip(".")


def module_paths(node: fx.Node) -> list[str]:
    """The module paths ``node`` was traced under; for a higher-order op (``torch.autocast``'s
    region) that a re-export left with the root's only, its body's; for the body's ``get_attr``,
    the op's."""
    own = _own_paths(node)
    if layer_path(own) is not None:
        return own
    body = body_of(node)
    if body is not None:
        return next((p for b in body.graph.nodes if layer_path(p := _own_paths(b)) is not None), own)
    if node.op == "get_attr" and node.users and all(body_of(u) is not None for u in node.users):
        return module_paths(next(iter(node.users)))
    return own


def _own_paths(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else value
        out.append(_norm_path(str(path)))
    return out


def body_of(node: fx.Node) -> fx.GraphModule | None:
    """The submodule a higher-order op node calls (its first ``get_attr`` argument's)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    root = node.graph.owning_module
    for a in node.all_input_nodes:
        if a.op == "get_attr" and root is not None:
            obj = root
            for part in str(a.target).split("."):
                obj = getattr(obj, part, None)
            if isinstance(obj, fx.GraphModule):
                return obj
    return None


def layer_path(paths: list[str]) -> str | None:
    for p in paths:
        if re.search(r"\.\d+$", p):
            return p
    return None
