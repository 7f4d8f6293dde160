"""The backend's agreement before a layout's first process groups: every rank of the world says
whether it built its program, so one rank's refusal (an FFN rank handed a static graph, a layout
its graph cannot take) stops every rank at once with that rank's line, instead of leaving the
others in a group creation until the store's timeout; and ``shutdown()`` after it does not wait
at a barrier for a rank that will never arrive."""

from __future__ import annotations

from typing import Any

from ..errors import AFDCompileError
from .options import BackendOptions

#: the first layout graph of this process: (its agreement's tag, whether every rank agreed), set
#: when it is compiled; later graphs (other batch shapes, compiled per rank) agree on nothing
_FIRST: dict[str, Any] = {}


def begin_first(opts: BackendOptions) -> None:
    """Name the agreement of this process group's first layout graph (once per process group:
    a process that joins a new one agrees again)."""
    import torch.distributed as dist

    if opts.mode == "none" or not dist.is_initialized():
        return
    if _FIRST.get("world") is not dist.group.WORLD:
        _FIRST.clear()
        _FIRST.update(world=dist.group.WORLD, tag=f"first-graph/{opts.mode}/{opts.comm_id}", agreed=False)


def agree_first(opts: BackendOptions) -> None:
    """Before this rank makes its first layout graph's process groups: every rank says whether it
    built its program (runtime.agree), so one rank's refusal stops every rank at once instead of
    leaving them in a group creation until the timeout. Later graphs do not agree (an attention
    rank compiles per batch shape: the ranks' graphs differ in number)."""
    from ..runtime import agree

    if _FIRST.get("agreed", True):
        return
    _FIRST["agreed"] = True
    agree(_FIRST["tag"], None, opts.timeout_s or 1800.0)


def tell_peers(e: Exception) -> None:
    """A refusal on this rank (or an error of its compile: its type named): before its first layout
    graph agreed, posted for the other ranks (they raise it as theirs); after (a later graph: an
    attention rank compiles one per batch shape), told to the FFN rank of each of its attention
    communicators (FAILED on the control group: it stops serving at once, naming this rank,
    instead of waiting for its next step until the timeout). Recorded either way, so
    ``shutdown()`` does not wait for the peers at a barrier."""
    import torch.distributed as dist

    from ..comm import registered_communicators
    from ..runtime import PeerRefused, agree, step_failed, tell_failed

    if "tag" not in _FIRST or not dist.is_initialized():
        return
    line = (str(e).splitlines() or [""])[0]
    if not isinstance(e, AFDCompileError):  # (an error, not a refusal: its type says which)
        line = f"{type(e).__name__}: {line}"
    step_failed(f"compile refused: {e}" if isinstance(e, AFDCompileError) else f"compile failed: {line}")
    if _FIRST["agreed"]:
        for comm in registered_communicators().values():  # (an FFN one, or one stopped: nothing to tell)
            tell_failed(comm)
    elif not isinstance(e, PeerRefused):
        _FIRST["agreed"] = True
        agree(_FIRST["tag"], line or type(e).__name__, 0.0)
