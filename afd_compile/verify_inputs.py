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
        flat_inputs(ep)  # checks the saved inputs (keyword ones in the program's order): ProgramLoadError before any process
        sym, _ = batch_symbol_dims(positional_module(ep))
        rng = None
        if sym is not None:
            rng = (1, math.inf)
            for s, vr in ep.range_constraints.items():
                if str(s) == sym:
                    rng = (int(vr.lower), int(vr.upper) if vr.upper.is_finite else math.inf)
        return ProgramFacts(rng, default_tolerance(ep))


#: the default ``--tol``: 1e-5 when every floating output compared is fp32 / fp64, else this
LOW_PRECISION_TOL = 1e-2


def output_dtypes(ep: torch.export.ExportedProgram) -> set[torch.dtype]:
    """The dtypes of the program's user outputs (what verify compares; buffer writes excluded)."""
    user = set(ep.graph_signature.user_outputs)
    out = next(n for n in reversed(ep.graph.nodes) if n.op == "output")
    leaves = torch.utils._pytree.tree_leaves(out.args[0])
    return {n.meta["val"].dtype for n in leaves if isinstance(n, fx.Node) and n.name in user
            and isinstance(n.meta.get("val"), torch.Tensor)}


def default_tolerance(ep: torch.export.ExportedProgram) -> float:
    """1e-5 when every floating-point output is fp32 or fp64, else :data:`LOW_PRECISION_TOL`:
    chosen from the outputs compared, never from other tensors the program holds (an unused
    fp16 buffer must not loosen the verdict of an fp32 model)."""
    floats = {d for d in output_dtypes(ep) if d.is_floating_point}
    return 1e-5 if floats <= {torch.float32, torch.float64} else LOW_PRECISION_TOL


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
                seq_dims = tuple((i, d) for i, n in enumerate(placeholders) if isinstance(n.meta.get("val"), torch.Tensor)
                                 for d, size in enumerate(n.meta["val"].shape)
                                 if isinstance(size, torch.SymInt) and str(size.node.expr) == key)
                prefill, step = int(flat_inputs(ep)[pos].shape[0]), 1
        return DecodeSpec(state, pos, seq_dims, prefill, step, cache_length(gm))

    def positions_needed(self, decode_steps: int) -> int:
        return self.prefill + decode_steps * self.step_tokens

    def inputs(self, example: Sequence[torch.Tensor], step: int, salt: int) -> tuple[torch.Tensor, ...]:
        """The inputs of ``step`` (0: the saved example), token ids shifted by ``salt + step``."""
        x = list(shift_token_ids(example, example, salt + step))
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
    if isinstance(decode_steps, bool) or not isinstance(decode_steps, int) or decode_steps < 0:
        raise VerifyInputError(f"--decode-steps must be an integer >= 0, got {decode_steps!r}")
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
    if tol is None:
        tol = facts.default_tol
    elif isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol) or tol < 0:
        raise VerifyInputError(f"--tol must be a finite number >= 0, got {tol!r}")
    if batches is None:
        return VerifyInputs(None, steps, float(tol))
    batches = tuple(batches)
    if len(batches) != units:
        raise VerifyInputError(f"--tokens has {len(batches)} entries, one per {unit} ({units}) expected")
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in batches):
        raise VerifyInputError(f"--tokens must be integers >= 0, got {list(batches)}")
    if not sum(batches):
        raise VerifyInputError(f"--tokens {list(batches)}: every {unit} has zero tokens, so nothing would be compared")
    if facts.batch_range is None:
        raise VerifyInputError(f"the batch dimension is static, cannot resize inputs to {list(batches)}")
    lo, hi = facts.batch_range
    sizes = {b for b in batches if b} | ({1} if zero_runs_dummy and 0 in batches else set())
    outside = sorted(b for b in sizes if not lo <= b <= hi)
    if outside:
        raise VerifyInputError(
            f"--tokens {list(batches)}: batch size {outside[0]} is outside the range the program was exported "
            f"for ([{lo}, {hi if math.isfinite(hi) else 'inf'}]{'; a DP group with zero tokens runs a one-sequence dummy' if zero_runs_dummy and 0 in batches else ''}); "
            "re-export with a wider torch.export.Dim for the batch")
    return VerifyInputs(batches, steps, float(tol))


def resize_inputs(inputs: Sequence[torch.Tensor], dims: list[tuple[int, int]], batch: int,
                  salt: int) -> tuple[torch.Tensor, ...]:
    """Tile the example rows along the batch dim to ``batch`` rows; integer inputs with values
    beyond 0/1 (token ids) are shifted by ``salt`` so ranks see different tokens."""
    out = list(inputs)
    for i, d in dims:
        t = inputs[i]
        idx = torch.arange(batch) % t.shape[d]
        out[i] = t.index_select(d, idx)
    return shift_token_ids(out, inputs, salt)


def shift_token_ids(inputs: Sequence[torch.Tensor], example: Sequence[torch.Tensor],
                    salt: int) -> tuple[torch.Tensor, ...]:
    """Integer inputs with values beyond 0/1 (token ids) shifted by ``salt``, modulo the largest
    id of the ``example`` + 1, so ranks and steps see different tokens within the vocabulary."""
    out = list(inputs)
    for i, t in enumerate(out):
        if not t.is_floating_point() and t.dtype != torch.bool and t.numel() and int(t.max()) > 1:
            out[i] = (t + salt) % (int(example[i].max()) + 1)
    return tuple(out)
