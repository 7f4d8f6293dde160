"""The command line's own checks, apart from the commands: a flag of the other mode, a flag that
``--saved`` makes meaningless, and the stdout wrapper that keeps a run's verdict when its reader
goes away. Nothing here imports torch (``--help`` and a refused flag stay fast)."""

from __future__ import annotations

import argparse
import os

from .errors import AFDCompileError
from .layout import AFDLayout


class UsageError(AFDCompileError):
    pass


_TP_FLAGS = {"attn_dp": "--attn-dp", "moe_a2a": "--moe-a2a", "dense_dp": "--dense-dp",
             "vocab_parallel": "--vocab-parallel", "shards": "--shards"}
_AFD_FLAGS = {"attention_ranks": "-A/--attention-ranks", "ffn_ranks": "-F/--ffn-ranks",
              "gate_on_attention": "--gate-on-attention"}
_AFD_VALUED = {"stages": ("--stages", 1), "ffn_tp": ("--ffn-tp", 1), "ffn_ep": ("--ffn-ep", 1),
               "attn_tp": ("--attn-tp", 1), "buckets": ("--buckets", "default")}  # AFD flags with a default


def check_mode_flags(args: argparse.Namespace) -> None:
    """A flag of the other mode is an error, never silently ignored."""
    if getattr(args, "decode_steps", 0) and getattr(args, "steps", None) is not None:
        raise UsageError(f"--steps {args.steps} with --decode-steps {args.decode_steps}: a decode run's steps are "
                         "its prefill and the decode steps; give one of them")
    if hasattr(args, "steps") and args.steps is None:
        args.steps = 2
    if getattr(args, "lowered", False) and getattr(args, "tp", None) is not None:
        raise UsageError("--lowered runs an AFD layout's lowering stage; a TP rank's lowering on the CPU is its KV "
                         "cache held as its slice, which only the torch.compile backend runs: drop --lowered")
    if getattr(args, "tp", None) is None:
        given = [flag for dest, flag in _TP_FLAGS.items() if getattr(args, dest, None) not in (None, False)]
        if given:
            raise UsageError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to a TP layout: "
                             "add --tp T")
        return
    given = [flag for dest, flag in _AFD_FLAGS.items() if getattr(args, dest, None) not in (None, False)]
    given += [flag for dest, (flag, default) in _AFD_VALUED.items() if getattr(args, dest, default) != default]
    if given == ["--attn-tp"]:
        raise UsageError("--attn-tp sizes the attention TP groups of an AFD layout (-A/-F); under --tp the "
                         "attention TP group is tp / attn-dp ranks: give --attn-dp instead")
    if given:
        raise UsageError(f"give either an AFD layout ({', '.join(given)}) or a TP layout (--tp ...), not both")


def check_arguments(args: argparse.Namespace) -> None:
    """What the arguments alone decide, answered before torch is imported (a second, not the
    seconds a load takes): ``--tokens``, the layout itself (built: its counts and groups checked),
    then the model file, the files ``--import`` names, ``--saved``'s folder, ``-o``'s (rewrite)."""
    from .limits import parse_tokens
    from .saved import program_file_problem

    if getattr(args, "tokens", None) is not None:
        parse_tokens(args.tokens)
    if getattr(args, "tp", None):
        tp_layout(args)
    elif hasattr(args, "attention_ranks"):
        afd_layout(args, False)
    model = getattr(args, "model", None)
    problem = program_file_problem(model) if model is not None else None
    if problem is not None:
        raise UsageError(problem)
    for spec in getattr(args, "imports", None) or ():
        if (spec.endswith(".py") or os.sep in spec) and not os.path.isfile(spec):
            raise UsageError(f"--import {spec}: no such file")
    saved = getattr(args, "saved", None)
    if saved is not None and not os.path.isdir(saved):
        raise UsageError(f"--saved {saved}: {'is not a folder' if os.path.exists(saved) else 'no such folder'} "
                         "(the folder `afd-compile rewrite -o` wrote)")
    if args.command == "rewrite":
        from .outdir import OutputFolder

        OutputFolder(args.output, args.force, inputs=[args.model])  # (its checks only: nothing is written)


def afd_layout(args: argparse.Namespace, required: bool) -> AFDLayout | None:
    """The AFD layout the flags give (None: none given and not ``required``)."""
    if args.attention_ranks is None and args.ffn_ranks is None:
        if required:
            raise UsageError("give a layout: an AFD one (-A/--attention-ranks A -F/--ffn-ranks F) or a TP one "
                             "(--tp T)")
        return None
    if args.attention_ranks is None or args.ffn_ranks is None:
        raise UsageError("give both --attention-ranks and --ffn-ranks")
    return AFDLayout(args.attention_ranks, args.ffn_ranks, getattr(args, "ffn_tp", 1), getattr(args, "ffn_ep", 1),
                     getattr(args, "attn_tp", 1))




def tp_layout(args: argparse.Namespace):
    """The TP layout the flags give (``--tp`` and its options)."""
    from .scatter import TPLayout

    return TPLayout(args.tp, 1 if args.attn_dp is None else args.attn_dp, moe_a2a=args.moe_a2a,
                    dense_dp=args.dense_dp, vocab_parallel=args.vocab_parallel)


def check_saved_flags(args: argparse.Namespace, kind: str) -> None:
    """``verify --saved``: the folder's plan.json fixes the layout, the roles, the router side and the
    stages, so a flag that would choose them again is refused (never silently ignored). ``kind`` is
    the folder's ("afd" / "tp")."""
    given = [f for f, v in (("-A/-F", args.attention_ranks or args.ffn_ranks), ("--tp", args.tp),
                            ("--attn-tp", args.attn_tp != 1), ("--ffn-tp", args.ffn_tp != 1),
                            ("--ffn-ep", args.ffn_ep != 1), ("--stages", args.stages != 1),
                            ("--gate-on-attention", args.gate_on_attention),
                            ("--policy", args.policy != "default")) if v]
    if given:
        raise UsageError(f"--saved {args.saved}: its plan.json gives the layout, the roles (the programs are split "
                         f"already), router side and stages; drop {', '.join(given)}")
    if args.lowered and kind == "tp":
        raise UsageError(f"--saved {args.saved}: --lowered runs an AFD layout's lowering stage, and this is a TP "
                         "folder (its lowering on the CPU, the KV cache held as a rank's slice, only the torch.compile "
                         "backend runs): drop --lowered")
    if args.buckets != "default" and kind == "tp":
        raise UsageError(f"--saved {args.saved}: a TP folder has no attention-FFN wire, so --buckets "
                         f"{args.buckets} does not apply; drop it")


class ClosedTolerant:
    """``sys.stdout`` while a command runs: a reader that went away (``| head``, a closed pipe)
    ends the output, not the run; what the run decides is still its exit code. Later writes go
    nowhere (the descriptor is pointed at /dev/null, so the flush at exit is quiet too)."""

    def __init__(self, stream: object) -> None:
        self._stream, self.lost = stream, False

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                return self._stream.write(text)  # type: ignore[attr-defined]
            except (BrokenPipeError, ValueError):  # (ValueError: a stream already closed)
                self._lose()
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self._stream.flush()  # type: ignore[attr-defined]
            except (BrokenPipeError, ValueError):
                self._lose()

    def _lose(self) -> None:
        self.lost = True
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())  # type: ignore[attr-defined]
            os.close(null)
        except (OSError, ValueError, AttributeError):  # (a stream with no descriptor: nothing to quiet)
            pass

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)
