"""A folder ``afd-compile rewrite`` wrote, read back with every field checked.

A ``.pt2`` file is code: ``torch.export.load`` unpickles its constants and example inputs, as
``torch.load(weights_only=False)`` does, so load only folders you trust. What this module adds is
that a folder runs only the programs rewrite wrote into it: plan.json names each program by a
plain file name inside the folder (no path, no link out of it) and records its sha256, which is
checked before the program is loaded (a program copied from another rewrite, or the two roles
swapped, is refused); every other field is checked for its type and range, and a wrong one is a
:class:`SavedFolderError` naming the field.

    plan = read_saved_plan("out")          # plan.json checked, hashes compared
    plan.path("ffn")                        # "out/ffn.pt2"
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from .errors import ProgramLoadError
from .limits import MAX_RANKS, MAX_STAGES


def program_file_problem(path: str) -> str | None:
    """Why ``path`` cannot be a ``.pt2`` program (None: it can be read); decided from the file
    system alone, before torch is imported."""
    if os.path.isdir(path):
        return (f"{path}: is a folder, not a .pt2 file (a rewrite folder: check it with `afd-compile verify "
                f"MODEL.pt2 --saved {path}`, run it with afd_compile.deploy.load_rewritten_rank)")
    if not os.path.exists(path):
        return f"{path}: no such file"
    if not os.path.isfile(path):
        return f"{path}: not a regular file (a .pt2 is a zip archive torch.export.save wrote)"
    return None

#: the largest int an op argument holds (a comm_id is an int64 argument of every afd:: op)
MAX_INT64 = (1 << 63) - 1
#: the largest token count factor, static batch or input index a plan.json may record
MAX_SIZE = (1 << 31) - 1

#: the field of plan.json that says a folder was written by ``rewrite`` (what ``--force`` may replace)
MARKER = ("written_by", "afd-compile rewrite")


def sha256_of(path: str) -> str:
    """The hex sha256 of the file at ``path``, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()

_HEX64 = re.compile(r"^[0-9a-f]{64}$")

#: the largest plan.json read (a rewrite writes a few hundred KiB at most, for a model of 100s of layers)
MAX_PLAN_BYTES = 64 << 20


class SavedFolderError(ProgramLoadError):
    """A rewrite folder that cannot be run as written (the folder, the field, what was expected)."""


def _is_int(v: Any, lo: int, hi: int = MAX_SIZE) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


@dataclass(frozen=True)
class SavedPlan:
    """plan.json of a rewrite folder, checked. ``programs``: role (``attention`` / ``ffn``) or
    ``rank<r>`` -> file name inside ``folder``."""

    folder: str
    kind: str
    plan: dict
    programs: dict[str, str]

    def path(self, role: str) -> str:
        return os.path.join(self.folder, self.programs[role])

    def __getitem__(self, key: str) -> Any:
        return self.plan[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.plan.get(key, default)

    def layout(self) -> Any:
        """The layout the folder was written for: an ``AFDLayout`` or a ``TPLayout``."""
        lay = self.plan["layout"]
        if self.kind == "afd":
            from .layout import AFDLayout

            return AFDLayout(lay["attention_ranks"], lay["ffn_ranks"])
        from .scatter import TPLayout

        return TPLayout(lay["tp"], lay.get("attn_dp", 1), moe_a2a=bool(lay.get("moe_a2a")),
                        dense_dp=bool(lay.get("dense_dp")), vocab_parallel=bool(lay.get("vocab_parallel")))


class _Checker:
    def __init__(self, folder: str, plan: dict) -> None:
        self.folder, self.plan = folder, plan

    def fail(self, field: str, expected: str, got: Any) -> SavedFolderError:
        return SavedFolderError(f"{self.folder}: plan.json field {field!r} must be {expected}, got {got!r}; "
                                "the folder was not written by this version of rewrite or was edited: rewrite again")

    def field(self, obj: dict, key: str, name: str, ok, expected: str, optional: bool = False) -> Any:
        if key not in obj:
            if optional:
                return None
            raise SavedFolderError(f"{self.folder}: plan.json has no field {name!r} ({expected})")
        v = obj[key]
        if not ok(v):
            raise self.fail(name, expected, v)
        return v

    def program_name(self, field: str, name: Any) -> str:
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", "..") \
                or not name.endswith(".pt2"):
            raise self.fail(field, "a file name inside the folder ending in .pt2 (no path)", name)
        full = os.path.join(self.folder, name)
        if os.path.islink(full) or not os.path.isfile(full):
            what = "a symbolic link" if os.path.islink(full) else "missing"
            raise SavedFolderError(f"{self.folder}: {field} names {name}, which is {what}: a rewrite folder holds "
                                   "its programs as plain files")
        return name


def read_saved_plan(folder: str) -> SavedPlan:
    """plan.json of ``folder``, checked (see the module docstring); :class:`SavedFolderError`."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise SavedFolderError(f"{folder}: not a folder (give the folder rewrite wrote)")
    path = os.path.join(folder, "plan.json")
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isfile(path)):
        what = "a symbolic link" if os.path.islink(path) else "not a regular file"
        raise SavedFolderError(f"{folder}: plan.json is {what}: a rewrite folder holds its plan.json as a plain file")
    try:
        if os.path.getsize(path) > MAX_PLAN_BYTES:
            raise SavedFolderError(f"{folder}: plan.json is {os.path.getsize(path)} bytes, more than a rewrite writes "
                                   f"(at most {MAX_PLAN_BYTES}): not a plan.json of rewrite")
        with open(path) as f:
            plan = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise SavedFolderError(f"{folder}: cannot read plan.json: {e}") from None
    c = _Checker(folder, plan)
    if not isinstance(plan, dict):
        raise c.fail("(the whole file)", "a JSON object", type(plan).__name__)
    c.field(plan, MARKER[0], MARKER[0], lambda v: v == MARKER[1], repr(MARKER[1]))
    kind = c.field(plan, "kind", "kind", lambda v: v in ("afd", "tp"), '"afd" or "tp"')
    layout = c.field(plan, "layout", "layout", lambda v: isinstance(v, dict), "an object")
    if kind == "afd":
        for k in ("attention_ranks", "ffn_ranks"):
            c.field(layout, k, f"layout.{k}", lambda v: _is_int(v, 1, MAX_RANKS), f"an integer in [1, {MAX_RANKS}]")
        from .layout import AFDLayout, LayoutError

        try:
            AFDLayout(layout["attention_ranks"], layout["ffn_ranks"])
        except LayoutError as e:
            raise c.fail("layout", "a layout AFDLayout takes", f"{e}") from None
        raw = c.field(plan, "programs", "programs", lambda v: isinstance(v, dict) and set(v) == {"attention", "ffn"},
                      'an object {"attention": FILE, "ffn": FILE}')
        programs = {role: c.program_name(f"programs.{role}", raw[role]) for role in ("attention", "ffn")}
        c.field(plan, "comm_id", "comm_id", lambda v: _is_int(v, 0, MAX_INT64), f"an integer in [0, {MAX_INT64}]")
        c.field(plan, "stages", "stages", lambda v: _is_int(v, 1, MAX_STAGES), f"an integer in [1, {MAX_STAGES}]",
                optional=True)
        c.field(plan, "static_batch", "static_batch", lambda v: v is None or _is_int(v, 1),
                f"null or an integer in [1, {MAX_SIZE}]", optional=True)
        c.field(plan, "compute_gate_on_attention", "compute_gate_on_attention", _is_bool, "true or false",
                optional=True)
        tc = c.field(plan, "token_count", "token_count", lambda v: isinstance(v, dict), "an object")
        c.field(tc, "factor", "token_count.factor", lambda v: _is_int(v, 1), f"an integer in [1, {MAX_SIZE}]")
        c.field(tc, "dims", "token_count.dims", lambda v: isinstance(v, list) and len(v) <= 64 and all(
            isinstance(p, list) and len(p) == 2 and all(_is_int(x, 0, 1 << 16) for x in p) for p in v),
            "a list of at most 64 [input, dim] pairs of integers in [0, 65536]")
    else:
        tp = c.field(layout, "tp", "layout.tp", lambda v: _is_int(v, 1, MAX_RANKS), f"an integer in [1, {MAX_RANKS}]")
        c.field(layout, "attn_dp", "layout.attn_dp", lambda v: _is_int(v, 1, tp) and tp % v == 0,
                f"an integer >= 1 dividing tp={tp}", optional=True)
        for k in ("moe_a2a", "dense_dp", "vocab_parallel"):
            c.field(layout, k, f"layout.{k}", _is_bool, "true or false", optional=True)
        raw = c.field(plan, "programs", "programs", lambda v: isinstance(v, list) and len(v) == layout["tp"],
                      f"a list of {layout['tp']} file names (one per rank)")
        programs = {f"rank{r}": c.program_name(f"programs[{r}]", name) for r, name in enumerate(raw)}
    if len(set(programs.values())) != len(programs):
        raise c.fail("programs", "distinct file names", raw)
    sha = c.field(plan, "sha256", "sha256", lambda v: isinstance(v, dict) and set(v) == set(programs.values())
                  and all(isinstance(h, str) and _HEX64.match(h) for h in v.values()),
                  "an object naming each program's file with its sha256 (64 hex digits)")
    for role, name in programs.items():
        got = sha256_of(os.path.join(folder, name))
        if got != sha[name]:
            raise SavedFolderError(f"{folder}: {name} ({role}) is not the program rewrite wrote there: its sha256 is "
                                   f"{got[:12]}..., plan.json records {sha[name][:12]}... (copied from another "
                                   "rewrite, swapped or edited): rewrite again")
    return SavedPlan(folder, kind, plan, programs)


def check_saved_program(plan: SavedPlan, role: str, program: Any) -> None:
    """The loaded program of ``role`` (``attention`` / ``ffn``) of an AFD folder is what its
    plan.json says it is, judged by the program itself: an attention program sends and receives
    with its one FFN peer (``afd::p2p_send`` / ``p2p_recv``), an FFN program with its group of
    peers (``afd::p2p_recv_group`` / ``p2p_send_group``); every exchange names the folder's
    ``comm_id``; ``token_count.dims`` name inputs and dims the attention program has. A folder
    whose roles were swapped (hashes edited to match) is refused here, before anything runs."""
    calls = [n for n in program.graph.nodes if n.op == "call_function" and str(n.target).startswith("afd.p2p_")]
    names = {str(n.target).split(".")[1] for n in calls}
    own, other = ({"p2p_send", "p2p_recv"}, {"p2p_recv_group", "p2p_send_group"})[:: 1 if role == "attention" else -1]
    if not names & own or names & other:
        raise SavedFolderError(f"{plan.folder}: {plan.programs[role]}, the {role} program of plan.json, exchanges with "
                               f"{sorted(names) or 'no afd:: op'}; a {role} program calls "
                               f"afd::{' / '.join(sorted(own))}"
                               " (roles swapped or another program): rewrite again")
    for n in calls:
        if len(n.args) < 2 or n.args[1] != plan["comm_id"]:
            raise SavedFolderError(f"{plan.folder}: {plan.programs[role]}: node {n.name} exchanges on comm_id "
                                   f"{n.args[1] if len(n.args) > 1 else None!r}, plan.json records comm_id "
                                   f"{plan['comm_id']}: rewrite again")
    if role != "attention":
        return
    inputs = [n for n in program.graph.nodes if n.op == "placeholder"]
    for i, d in plan["token_count"]["dims"]:
        val = inputs[i].meta.get("val") if i < len(inputs) else None
        if i >= len(inputs) or (val is not None and d >= len(getattr(val, "shape", ()))):
            what = (f"input {i} of {len(inputs)}" if i >= len(inputs)
                    else f"dim {d} of {inputs[i].name} ({len(val.shape)} dims)")
            raise SavedFolderError(f"{plan.folder}: plan.json field 'token_count.dims' names {what}, which "
                                   f"{plan.programs[role]} does not have: rewrite again")


def afd_plan_json(result: Any, layout: Any, gate: bool, token_count: dict, cache: dict | None) -> dict:
    """plan.json of an AFD rewrite (before its ``stages`` and ``sha256``): the split plan, the
    layout with each FFN rank's peers, the programs' names, the router side, the token count, the
    KV cache (``plan_view.cache_json``: when the program has one)."""
    plan = result.plan.to_json()
    plan["kind"] = "afd"
    plan["layout"] = {"attention_ranks": layout.attention_ranks, "ffn_ranks": layout.ffn_ranks,
                      "ffn_peers": {str(f): list(layout.peers_of_ffn(f)) for f in range(layout.ffn_ranks)}}
    plan["programs"] = {"attention": "attention.pt2", "ffn": "ffn.pt2"}
    plan["compute_gate_on_attention"] = gate
    plan["token_count"] = token_count
    if cache:
        plan["cache"] = cache
    return plan
