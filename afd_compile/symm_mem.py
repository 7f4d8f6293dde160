"""One-shot all-reduce over PyTorch symmetric memory for the TP junctions' small (decode) messages.

A TP group of GPUs on one host that can read each other's memory (NVLink peer access) gets, once,
at setup (:func:`prepare`, collective over the group), one symmetric buffer of ``max_bytes``
(``AFD_SYMM_MEM_MAX_BYTES``, default 2 MiB). From then on ``afd::all_reduce`` (and so every
``afd::all_reduce_add_rms_norm`` junction) sums a message that fits into it with
``torch.ops.symm_mem.one_shot_all_reduce_copy``: one kernel copies the local tensor into this
rank's buffer, waits on the peers' signal pads, reads every peer's buffer over NVLink and writes the
sum; it is CUDA-graph capturable. A larger message, another dtype, or a group where symmetric
memory is off takes NCCL (``dist.all_reduce``). Which path a message takes is decided by
:func:`junction_path` from its size and dtype alone, so every rank of a group takes the same one.

Off, logged once per group with the reason: CPU / gloo groups (the composite path), a torch without
the ``symm_mem`` ops, the one switch off (the backend's option ``symm_mem=False``, or
``make_worker(symm_mem=False)``), a rank whose device cannot reach a peer, or a rendezvous that
failed on any rank (the group agrees: one rank off turns it off for all). NVLink multicast
(``multimem_*``) is never used.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("afd_compile.symm_mem")

#: dtypes the one-shot kernel reduces (torch's AT_DISPATCH_FLOAT_AND_BFLOAT16)
DTYPES = (torch.float32, torch.bfloat16)
#: the kernel loads 16-byte vectors at best and needs 4-byte ones at least
ALIGN = 4
DEFAULT_MAX_BYTES = 2 << 20


def max_bytes_from_env() -> int:
    """``AFD_SYMM_MEM_MAX_BYTES``: the largest message the one-shot path takes (and the buffer size)."""
    raw = os.environ.get("AFD_SYMM_MEM_MAX_BYTES", "")
    try:
        value = int(raw) if raw else DEFAULT_MAX_BYTES
    except ValueError:
        raise ValueError(f"AFD_SYMM_MEM_MAX_BYTES={raw!r}: expected a byte count (an integer)") from None
    if value < 0:
        raise ValueError(f"AFD_SYMM_MEM_MAX_BYTES={value}: expected a byte count >= 0")
    return value


def junction_path(nbytes: int, dtype: torch.dtype, ready: bool, max_bytes: int) -> str:
    """``"symm"`` (one-shot over symmetric memory) or ``"nccl"`` for one message: a pure function of
    the message's size and dtype and the group's readiness, the same on every rank of the group."""
    if ready and dtype in DTYPES and 0 < nbytes <= max_bytes and nbytes % ALIGN == 0:
        return "symm"
    return "nccl"


@dataclass
class SymmGroup:
    """A group's symmetric buffer (None when off) and why it is off."""

    group_name: str
    max_bytes: int
    buffer: torch.Tensor | None
    why_off: str = ""

    @property
    def ready(self) -> bool:
        return self.buffer is not None

    def __str__(self) -> str:
        if self.ready:
            return f"symmetric memory on: one-shot all-reduce up to {self.max_bytes} bytes, NCCL above"
        return f"symmetric memory off ({self.why_off}): the group's own all-reduce"


_GROUPS: dict[int, SymmGroup] = {}


def local_reason(group: dist.ProcessGroup, device: torch.device) -> str:
    """Why this rank cannot use symmetric memory for ``group`` ('' when it can), without communicating."""
    if device.type != "cuda":
        return f"tensors on {device.type}, not CUDA"
    if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        return f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError as e:
        return f"torch.distributed._symmetric_memory: {e}"
    if dist.get_backend(group) != "nccl":
        return f"a {dist.get_backend(group)} group, not NCCL"
    return ""


def prepare(group_id: int, group: dist.ProcessGroup, device: torch.device, enabled: bool = True,
            max_bytes: int | None = None) -> SymmGroup:
    """Set up the one-shot path for ``group`` (collective on CUDA: every rank of the group calls it,
    in the same order as its other collectives). The ranks agree: the path is on only where it is
    on for all of them. ``enabled=False`` (the backend's ``symm_mem=False``): NCCL for every message."""
    max_bytes = (max_bytes_from_env() if max_bytes is None else max_bytes) // 16 * 16
    why = ("symm_mem=False" if not enabled else local_reason(group, device)
           or ("AFD_SYMM_MEM_MAX_BYTES < 16" if max_bytes == 0 else ""))
    buffer = None
    collective = device.type == "cuda" and dist.get_backend(group) == "nccl"  # (else off on every rank alike)
    if collective and _agree(not why, group, device):
        try:
            import torch.distributed._symmetric_memory as symm

            buffer = symm.empty(max_bytes, dtype=torch.uint8, device=device)
            symm.rendezvous(buffer, group.group_name)
        except Exception as e:  # noqa: BLE001  (any failure turns the path off, for the whole group)
            why, buffer = f"rendezvous failed: {type(e).__name__}: {e}".splitlines()[0], None
        if not _agree(buffer is not None, group, device):
            why, buffer = why or "another rank's rendezvous failed", None
    elif not why:
        why = "another rank cannot use it"
    state = SymmGroup(group.group_name, max_bytes, buffer, why)
    _GROUPS[group_id] = state
    log.info("afd: group %d (%d ranks): %s", group_id, dist.get_world_size(group), state)
    return state


def prepare_groups(groups: dict[int, dist.ProcessGroup | None], device: torch.device, enabled: bool = True) -> None:
    """:func:`prepare` each group in id order (a group registered under two ids is set up once)."""
    done: dict[int, SymmGroup] = {}
    for gid in sorted(groups):
        group = groups[gid]
        if group is None:
            continue
        if id(group) in done:
            _GROUPS[gid] = done[id(group)]
            continue
        done[id(group)] = prepare(gid, group, device, enabled)


def _agree(ok: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def state_of(group_id: int) -> SymmGroup | None:
    return _GROUPS.get(group_id)


def release(group_id: int | None = None) -> None:
    """Forget the group's buffer (all groups when None)."""
    for gid in [group_id] if group_id is not None else list(_GROUPS):
        _GROUPS.pop(gid, None)


def try_all_reduce(x: torch.Tensor, group_id: int) -> torch.Tensor | None:
    """The one-shot sum of ``x`` over the group, or None when the message takes NCCL."""
    state = _GROUPS.get(group_id)
    if state is None or not x.is_cuda:
        return None
    nbytes = x.numel() * x.element_size()
    if junction_path(nbytes, x.dtype, state.ready, state.max_bytes) != "symm":
        return None
    assert state.buffer is not None
    window = state.buffer.view(x.dtype)[: x.numel()]
    local = x.contiguous()
    if local.data_ptr() % 16:  # the kernel wants the buffer's alignment (16 B) on the local tensor too; a
        local = local.clone()  # copy is aligned (where a slice may not be, on some rank: never a per-rank path)
    out = torch.ops.symm_mem.one_shot_all_reduce_copy(window, local.view(-1), "sum", state.group_name)
    return out.view(x.shape)
