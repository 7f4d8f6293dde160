"""The command line's own checks, apart from the commands: a flag of the other mode, a flag that
``--saved`` makes meaningless, and the stdout wrapper that keeps a run's verdict when its reader
goes away. Nothing here imports torch (``--help`` and a refused flag stay fast)."""

from __future__ import annotations

import argparse
import os

from .errors import AFDCompileError


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
