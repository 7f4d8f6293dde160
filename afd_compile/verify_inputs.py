"""What a verify run's inputs are: the facts read from a saved program (batch range, output dtypes,
a KV cache's decode spec), the tolerance its precision allows, and the checks that refuse a bad
request (batch sizes, decode steps, process count) before anything is launched.
:mod:`afd_compile.verify` runs the cases; this module decides what they may be.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from .errors import AFDCompileError
from .layout import AFDLayout
from .limits import MAX_BATCH, MAX_STEPS
from .passes.graph_utils import batch_symbol_dims, cache_length, written_attrs
from .programs import flat_inputs, positional_module
from .runtime import LOCAL_PROCESS_LIMIT_RULE, max_local_processes


class VerifyInputError(AFDCompileError):
    pass


@dataclass(frozen=True)
class ProgramFacts:
    """What the input checks need to know of a saved program, read once."""

    batch_range: tuple[int, int | float] | None  # the export's [min, max] for the batch; None when static
    default_tol: float  # see default_tolerance

    @staticmethod
    def of(ep: torch.export.ExportedProgram) -> ProgramFacts:
        # checks the saved inputs (keyword ones in the program's order): ProgramLoadError before any process
        flat_inputs(ep)
        sym, _ = batch_symbol_dims(positional_module(ep))
        rng = None
        if sym is not None:
            rng = (1, math.inf)
            for s, vr in ep.range_constraints.items():
                if str(s) == sym:
                    rng = (int(vr.lower), math.inf if _unbounded(vr.upper) else int(vr.upper))
        return ProgramFacts(rng, default_tolerance(ep))


def _unbounded(bound: object) -> bool:
    """A range's upper bound is none: sympy's ``oo``, or torch's ``int_oo`` (which sympy counts as a
    finite integer: a ``Dim`` exported without ``max``)."""
    import sympy
    from torch.utils._sympy.numbers import int_oo

    return bound in (int_oo, sympy.oo) or not getattr(bound, "is_number", True)


#: the default ``--tol``: 1e-5 when every floating output compared is fp32 / fp64, else this
LOW_PRECISION_TOL = 1e-2


def output_dtypes(ep: torch.export.ExportedProgram) -> set[torch.dtype]:
    """The dtypes of the program's user outputs (what verify compares; buffer writes excluded)."""
    return {n.meta["val"].dtype for n in _user_outputs(ep)}


def _user_outputs(ep: torch.export.ExportedProgram) -> list[fx.Node]:
    user = set(ep.graph_signature.user_outputs)
    out = next(n for n in reversed(ep.graph.nodes) if n.op == "output")
    leaves = torch.utils._pytree.tree_leaves(out.args[0])
    return [n for n in leaves
            if isinstance(n, fx.Node) and n.name in user and isinstance(n.meta.get("val"), torch.Tensor)]


#: ops whose output dtype is the precision a model computes in (a GEMM, an attention)
_COMPUTE_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "einsum", "convolution",
                "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu"}


def computation_dtypes(ep: torch.export.ExportedProgram) -> set[torch.dtype]:
    """The floating dtypes that carry the model's computation: those of the user outputs and of
    the GEMM / attention ops that depend on a user input. An output computed from no input (a
    constant side output, an fp16 ``torch.zeros(1)``) and a buffer nothing computes with do not
    count."""
    inputs = set(ep.graph_signature.user_inputs)
    dependent: set[fx.Node] = set()
    found: set[torch.dtype] = set()
    for n in ep.graph.nodes:
        if n.op == "placeholder":
            if n.name in inputs:
                dependent.add(n)
            continue
        if not any(a in dependent for a in n.all_input_nodes):
            continue
        dependent.add(n)
        name = getattr(getattr(n.target, "_overloadpacket", None), "__name__", "")
        val = n.meta.get("val")
        if name in _COMPUTE_OPS and isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
            found.add(val.dtype)
    found |= {n.meta["val"].dtype for n in _user_outputs(ep) if n in dependent
              and n.meta["val"].dtype.is_floating_point}
    return found


def default_tolerance(ep: torch.export.ExportedProgram) -> float:
    """1e-5 when every dtype that carries the model's computation (:func:`computation_dtypes`) is
    fp32 or fp64, else :data:`LOW_PRECISION_TOL`: never loosened by a tensor that computes
    nothing from the inputs (an unused fp16 buffer, a constant fp16 side output)."""
    return 1e-5 if computation_dtypes(ep) <= {torch.float32, torch.float64} else LOW_PRECISION_TOL


#: in-place cache writes and the argument that holds the positions they write at
_POSITIONED_WRITES = {torch.ops.aten.index_copy_.default: 2, torch.ops.aten.index_put_.default: 1}


def position_input(gm: fx.GraphModule, placeholders: Sequence[fx.Node]) -> int | None:
    """Index (among ``placeholders``) of the input that positions the cache writes: the one 1-D
    integer input the write positions are computed from (``index_copy_(2, pos, k)``, gpt-fast's
    ``k_cache[:, :, input_pos] = k``), whatever its name; else the input named ``cache_position``
    (transformers' exporter); None when neither is found."""
    inputs = {n: i for i, n in enumerate(placeholders)}
    found: set[int] = set()
    for writers in written_attrs(gm).values():
        for w in writers:
            arg = _POSITIONED_WRITES.get(w.target)
            if arg is None or len(w.args) <= arg:
                continue
            at = w.args[arg]
            stack = [a for a in (at if isinstance(at, (list, tuple)) else [at]) if isinstance(a, fx.Node)]
            seen: set[fx.Node] = set()
            while stack:
                n = stack.pop()
                if n in seen:
                    continue
                seen.add(n)
                val = n.meta.get("val")
                if n in inputs and isinstance(val, torch.Tensor) and val.dim() == 1 and not val.is_floating_point():
                    found.add(inputs[n])
                stack.extend(n.all_input_nodes)
    if len(found) == 1:
        return found.pop()
    return next((i for i, n in enumerate(placeholders) if n.name == "cache_position"), None)


@dataclass(frozen=True)
class DecodeSpec:
    """How verify steps a program that carries a KV cache (buffers it updates in place, as
    transformers' ``TorchExportableModuleForDecoderOnlyLM`` exports them, with a
    ``cache_position`` input, or any input that positions the writes: :func:`position_input`):
    step 0 is the saved example (a prefill of its positions); each
    decode step then writes the next positions: one token when the position dim is dynamic
    (every input along it is cut to its first entry), else as many as the example."""

    state: tuple[str, ...]  # the buffers the program writes in place
    position_input: int | None  # index of the input that positions the cache writes
    seq_dims: tuple[tuple[int, int], ...]  # (input, dim) carrying the position dim's symbol
    prefill: int  # positions of the saved example
    step_tokens: int
    cache_len: int | None

    @staticmethod
    def of(ep: torch.export.ExportedProgram) -> DecodeSpec | None:
        """None for a program without state."""
        gm = positional_module(ep)
        state = tuple(written_attrs(gm))
        if not state:
            return None
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        pos = position_input(gm, placeholders)
        seq_dims: tuple[tuple[int, int], ...] = ()
        prefill = step = 0
        if pos is not None:
            val = placeholders[pos].meta["val"]
            prefill = step = int(val.shape[0]) if val.dim() == 1 and not isinstance(val.shape[0], torch.SymInt) else 0
            if val.dim() == 1 and isinstance(val.shape[0], torch.SymInt):
                key = str(val.shape[0].node.expr)
                seq_dims = tuple((i, d) for i, n in enumerate(placeholders)
                                 if isinstance(n.meta.get("val"), torch.Tensor)
                                 for d, size in enumerate(n.meta["val"].shape)
                                 if isinstance(size, torch.SymInt) and str(size.node.expr) == key)
                prefill, step = int(flat_inputs(ep)[pos].shape[0]), 1
        return DecodeSpec(state, pos, seq_dims, prefill, step, cache_length(gm))

    def positions_needed(self, decode_steps: int) -> int:
        return self.prefill + decode_steps * self.step_tokens

    def inputs(self, example: Sequence[torch.Tensor], step: int, salt: int) -> tuple[torch.Tensor, ...]:
        """The inputs of ``step`` (0: the saved example's shapes), varied by ``salt + step``
        (:func:`vary_inputs`; the positions are the step's own)."""
        x = list(vary_inputs(example, example, salt + step))
        if step == 0 or self.position_input is None:
            if self.position_input is not None:
                x[self.position_input] = example[self.position_input]
            return tuple(x)
        for i, d in self.seq_dims:
            x[i] = x[i].narrow(d, 0, 1)
        start = self.prefill + (step - 1) * self.step_tokens
        x[self.position_input] = torch.arange(start, start + self.step_tokens, dtype=example[self.position_input].dtype)
        return tuple(x)


def check_decode_steps(spec: DecodeSpec | None, decode_steps: int, batches: Sequence[int] | None, path: str) -> None:
    """``--decode-steps``: a program with a KV cache and a ``cache_position`` input, positions
    that fit its cache, and no ``--tokens`` (the batch of a cached program is its cache's)."""
    if isinstance(decode_steps, bool) or not isinstance(decode_steps, int) or not 0 <= decode_steps <= MAX_STEPS:
        raise VerifyInputError(f"--decode-steps must be an integer in [0, {MAX_STEPS}], got {decode_steps!r}")
    if not decode_steps:
        return
    if spec is None:
        raise VerifyInputError(
            f"--decode-steps {decode_steps}: {path} updates no buffer in place, so it holds no KV cache to decode "
            "with; export the model with its cache (transformers.integrations.executorch."
            "TorchExportableModuleForDecoderOnlyLM(model, batch_size=..., max_cache_len=...).export(...))")
    if spec.position_input is None:
        raise VerifyInputError(f"--decode-steps: {path} writes buffers {list(spec.state)} in place but no 1-D "
                               "integer input positions the writes (index_copy_ / index_put_ at the positions; "
                               "nor is one named cache_position) to advance between steps")
    if batches is not None:
        raise VerifyInputError(f"--decode-steps: --tokens {list(batches)} cannot resize the batch of a program "
                               "whose KV cache fixes it")
    need = spec.positions_needed(decode_steps)
    if spec.cache_len is not None and need > spec.cache_len:
        raise VerifyInputError(f"--decode-steps {decode_steps}: the prefill ({spec.prefill} positions) and "
                               f"{decode_steps} steps of {spec.step_tokens} need {need} cache positions, the cache "
                               f"holds {spec.cache_len}")


@dataclass(frozen=True)
class VerifyInputs:
    """A verify run's inputs after :func:`check_verify_inputs`: one batch size per unit (attention
    rank or attention DP group; None: every unit runs the saved example), steps, tolerance."""

    batches: tuple[int, ...] | None
    steps: int
    tol: float


def check_verify_inputs(facts: ProgramFacts, *, units: int, unit: str, world_size: int,
                        batches: Sequence[int] | None, steps: int, tol: float | None,
                        zero_runs_dummy: bool = False) -> VerifyInputs:
    """Check what a verify run is asked to do, before any process starts; the one path for AFD
    (``unit="attention rank"``) and TP (``unit="attention DP group"``).

    Refused (VerifyInputError): more processes than :func:`~afd_compile.runtime.max_local_processes`,
    ``steps < 1``, a negative or non-finite ``tol``, a batch list of the wrong length, negative
    sizes, all sizes zero (nothing would be compared), sizes beyond the export's range for the
    batch dimension, sizes on a static batch dimension. ``zero_runs_dummy``: a unit with zero
    tokens still runs a one-sequence dummy (DP attention), so 1 must be in range too.
    """
    limit = max_local_processes()
    if world_size > limit:
        raise VerifyInputError(f"the layout needs {world_size} local processes, more than this machine can hold "
                               f"({limit}: {LOCAL_PROCESS_LIMIT_RULE}); use a smaller layout, or set "
                               "AFD_MAX_LOCAL_PROCESSES")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise VerifyInputError(f"--steps must be an integer >= 1, got {steps!r}: a run of no steps compares nothing")
    if steps > MAX_STEPS:
        raise VerifyInputError(f"--steps must be at most {MAX_STEPS}, got {steps}")
    if tol is None:
        tol = facts.default_tol
    elif isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol) or tol < 0:
        raise VerifyInputError(f"--tol must be a finite number >= 0, got {tol!r}")
    if batches is None:
        return VerifyInputs(None, steps, float(tol))
    batches = tuple(batches)
    if len(batches) != units:
        raise VerifyInputError(f"--tokens has {len(batches)} entries, one per {unit} ({units}) expected")
    if any(isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= MAX_BATCH for b in batches):
        raise VerifyInputError(f"--tokens must be integers in [0, {MAX_BATCH}], got {list(batches)}")
    if not sum(batches):
        raise VerifyInputError(f"--tokens {list(batches)}: every {unit} has zero tokens, so nothing would be compared")
    if facts.batch_range is None:
        raise VerifyInputError(f"--tokens {list(batches)}: the program's batch dimension is static, its inputs "
                               "cannot be resized; drop --tokens (every rank runs the saved batch), or re-export "
                               "with the batch dynamic (torch.export.export(..., dynamic_shapes={'input_ids': "
                               "{0: torch.export.Dim('batch')}}))")
    lo, hi = facts.batch_range
    sizes = {b for b in batches if b} | ({1} if zero_runs_dummy and 0 in batches else set())
    outside = sorted(b for b in sizes if not lo <= b <= hi)
    if outside:
        dummy = "; a DP group with zero tokens runs a one-sequence dummy" if zero_runs_dummy and 0 in batches else ""
        raise VerifyInputError(
            f"--tokens {list(batches)}: batch size {outside[0]} is outside the range the program was exported "
            f"for ([{lo}, {hi if math.isfinite(hi) else 'inf'}]{dummy}); "
            "re-export with a wider torch.export.Dim for the batch"
        )
    return VerifyInputs(batches, steps, float(tol))


def resize_inputs(
    inputs: Sequence[torch.Tensor], dims: list[tuple[int, int]], batch: int, salt: int
) -> tuple[torch.Tensor, ...]:
    """Tile the example rows along the batch dim to ``batch`` rows, then vary them by ``salt``
    (:func:`vary_inputs`) so that ranks, steps and the tiled rows all differ."""
    out = list(inputs)
    for i, d in dims:
        t = inputs[i]
        idx = torch.arange(batch) % t.shape[d]
        out[i] = t.index_select(d, idx)
    return vary_inputs(out, inputs, salt)


def shift_token_ids(
    inputs: Sequence[torch.Tensor], example: Sequence[torch.Tensor], salt: int
) -> tuple[torch.Tensor, ...]:
    """Integer inputs with values beyond 0/1 (token ids) shifted by ``salt``, modulo the largest
    id of the ``example`` + 1, so ranks and steps see different tokens within the vocabulary."""
    out = list(inputs)
    for i, t in enumerate(out):
        if not t.is_floating_point() and t.dtype != torch.bool and t.numel() and int(t.max()) > 1:
            out[i] = (t + salt) % (int(example[i].max()) + 1)
    return tuple(out)


#: the relative size of the noise :func:`vary_inputs` adds to a float input (of its mean magnitude)
FLOAT_NOISE = 0.1


def vary_inputs(inputs: Sequence[torch.Tensor], example: Sequence[torch.Tensor], salt: int) -> tuple[torch.Tensor, ...]:
    """Every input made to differ per rank, step and row, reproducibly from ``salt``: token ids
    shifted (:func:`shift_token_ids`), and each float input with more than two distinct values
    given seeded noise of :data:`FLOAT_NOISE` times its mean finite magnitude (a mask, two values
    such as 0 / -inf or 0 / 1, is kept as it is; non-finite entries stay). Identical inputs on every
    rank would hide an FFN that mixes tokens of different peers (each would see the same rows)."""
    out = list(shift_token_ids(inputs, example, salt))
    gen = torch.Generator().manual_seed(1000003 * salt + 12345)
    for i, t in enumerate(out):
        if not t.is_floating_point() or not t.numel():
            continue
        finite = t[torch.isfinite(t)]
        if finite.numel() < 3 or torch.unique(finite).numel() <= 2:
            continue
        scale = float(finite.abs().double().mean()) or 1.0
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32) * (FLOAT_NOISE * scale)
        out[i] = torch.where(torch.isfinite(t), t + noise.to(t.dtype), t)
    return tuple(out)


def unit_batch(batches: Sequence[int], unit: int, step: int) -> int:
    """The batch of ``unit`` at ``step``: the sizes rotate one unit a step, so every FFN rank
    sees several token layouts (``batches[(unit + step) % len(batches)]``)."""
    return batches[(unit + step) % len(batches)]


def check_exercised(
    layout: AFDLayout, batches: Sequence[int] | None, example_batch: int | None, steps: int, stages: int
) -> None:
    """Refuse (VerifyInputError) a run whose steps would not exercise what the layout claims, so
    that a ``verify: OK`` never stands for a feature no step ran:

    - fan-in: an FFN rank (or FFN group) serving attention peers of two or more units (attention
      ranks, or attention TP groups) must get tokens from at least two of them in some step;
    - stages: with ``stages > 1`` some unit's batch must have at least ``stages`` sequences in some
      step (a micro-batch is whole sequences: fewer rows run fewer micro-batches).

    ``batches``: one size per unit (None: every unit runs the saved example, of ``example_batch``
    sequences, None when its batch is not known)."""
    units = layout.attention_ranks // layout.attn_tp
    sizes = list(batches) if batches is not None else None

    def batch(u: int, s: int) -> int:
        return unit_batch(sizes, u, s) if sizes is not None else (example_batch or 1)

    shown = f"--tokens {sizes}" if sizes is not None else f"the saved example ({example_batch} sequence(s) a rank)"
    fans = [(f"FFN rank {f}", layout.peers_of_ffn(f)) for f in range(layout.ffn_ranks)]
    fans += [(f"FFN group {list(g)}", tuple(p for f in g for p in layout.peers_of_ffn(f))) for g in layout.ffn_groups()]
    for who, peers in fans:
        peer_units = sorted({(p - layout.ffn_ranks) // layout.attn_tp for p in peers})
        if len(peer_units) < 2:
            continue
        if not any(sum(1 for u in peer_units if batch(u, s) > 0) >= 2 for s in range(steps)):
            raise VerifyInputError(
                f"{shown} over {steps} step(s): {who} fans in attention ranks {list(peers)}, but no step gives "
                "two of them tokens (the sizes rotate one rank a step), so fan-in would never run and a split "
                "that mixes peers' tokens would pass unseen; give two or more of its peers a nonzero size"
            )
    if stages > 1:
        most = max(batch(u, s) for u in range(units) for s in range(steps))
        if most < stages:
            raise VerifyInputError(
                f"--stages {stages} with {shown}: no step has {stages} sequences on any rank, so no step would "
                f"run {stages} micro-batches (a micro-batch is whole sequences; at most {most} here); give a "
                f"rank at least {stages} sequences" + ("" if sizes is not None else " (re-export with a larger batch)")
            )
