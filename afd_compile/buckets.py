"""Token buckets: the slot an attention rank's tokens take on the wire.

A serving engine's batch changes every step, and an FFN rank compiles (on CUDA, captures) one
program per row count it runs (per tuple of per-peer sizes if its CUDA graphs hold the exchange:
backend option ``ffn_capture="all"``). With buckets an attention rank sends its ``n`` tokens in a
**slot** of ``slot(n)`` rows (the next bucket; the rows past ``n`` repeat its last row), and the FFN
rank pads its peers' total to a bucket too: the programs it compiles are bounded by the buckets
its totals touch, not by the exact counts. With a bucket list the FFN rank still reads each
peer's slot on the host before a step (a control message): NCCL's receive sizes must match.

Padded rows change no result: an MLP or MoE block works per token, so the padded rows compute
beside the real ones and the attention rank drops them when the FFN output comes back
(:func:`afd_compile.ops.p2p_recv` returns the first ``n`` rows; an FFN region that mixes tokens is
wrong under fan-in already, and ``verify`` reports it). They cost FFN rows, at most the gap to the
next bucket, and, repeating a real row, no expert weights an MoE would not read anyway. An FFN
rank pads the sum of its peers' slots to a bucket the same way (``FFNWorker.rows``).

The default list is vLLM's CUDA-graph capture sizes: 1, 2, 4, then every multiple of 8 up to 256,
every multiple of 16 up to 512; past the last bucket a slot is the next multiple of 256 (a long
prefill pads at most 255 rows).

A **fixed slot** (``"fixed:C"``, :meth:`TokenBuckets.fixed_slot`) is one capacity for every step:
every attention rank sends ``C`` rows a step whatever its count (none included), with its count
and flags in a small header in the same batched exchange (runtime/slots.py), so an FFN rank
knows every receive size in advance: no control message, one captured program for every step.
A step of more than ``C`` tokens on a rank is refused, naming the rank.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import AFDCompileError

#: vLLM's capture sizes (``cuda_graph_sizes``): 1, 2, 4, 8..256 by 8, 272..512 by 16
DEFAULT_SIZES: tuple[int, ...] = (1, 2, 4, *range(8, 257, 8), *range(272, 513, 16))
#: past the last bucket, slots are multiples of this
DEFAULT_CHUNK = 256
#: the most sizes a bucket list has, and the largest size (rows of one slot)
MAX_BUCKETS, MAX_BUCKET_ROWS = 4096, 1 << 24


class BucketError(AFDCompileError):
    """A bucket list that cannot be used (not ascending, not positive, not integers)."""


@dataclass(frozen=True)
class TokenBuckets:
    """Ascending slot sizes; past the last one, multiples of ``chunk``."""

    sizes: tuple[int, ...] = DEFAULT_SIZES
    chunk: int = DEFAULT_CHUNK
    #: one size, a hard capacity: every step's slot, tokens or none (:meth:`fixed_slot`)
    fixed: bool = False

    def __post_init__(self) -> None:
        if not self.sizes:
            raise BucketError("token buckets: the list is empty; give at least one size, or 'off'")
        if len(self.sizes) > MAX_BUCKETS:
            raise BucketError(f"token buckets: {len(self.sizes)} sizes, more than {MAX_BUCKETS} (each bucket is a "
                              "program an FFN rank may compile)")
        if any(not isinstance(s, int) or isinstance(s, bool) or not 1 <= s <= MAX_BUCKET_ROWS for s in self.sizes):
            raise BucketError(f"token buckets {list(self.sizes)}: every size must be an integer in [1, "
                              f"{MAX_BUCKET_ROWS}]")
        if any(a >= b for a, b in zip(self.sizes, self.sizes[1:], strict=False)):
            raise BucketError(f"token buckets {list(self.sizes)}: sizes must be strictly ascending")
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or not 1 <= self.chunk <= MAX_BUCKET_ROWS:
            raise BucketError(f"token buckets: chunk {self.chunk!r} must be an integer in [1, {MAX_BUCKET_ROWS}]")
        if self.fixed and len(self.sizes) != 1:
            raise BucketError(f"token buckets: a fixed slot is one size, got {list(self.sizes)}")

    @property
    def fixed_slot(self) -> int | None:
        """The capacity of a fixed slot (every step's rows a rank sends), else None."""
        return self.sizes[0] if self.fixed else None

    def slot(self, n: int) -> int:
        """The rows ``n`` tokens take: 0 for none, else the first bucket >= n, past the last one
        the next multiple of ``chunk`` (at least the last bucket)."""
        if n < 0:
            raise BucketError(f"token buckets: a token count is >= 0, got {n}")
        if self.fixed:
            if n > self.sizes[0]:
                raise BucketError(f"a fixed slot of {self.sizes[0]} rows cannot hold {n} tokens: give a larger "
                                  "slot ('fixed:N', N the most tokens a rank sends in a step) or a bucket list")
            return self.sizes[0]
        if n == 0:
            return 0
        i = bisect.bisect_left(self.sizes, n)
        if i < len(self.sizes):
            return self.sizes[i]
        return max(-(-n // self.chunk) * self.chunk, self.sizes[-1])

    def padded(self, n: int, unit: int = 1) -> int:
        """The rows ``n`` tokens take in units of ``unit`` tokens (what a program's token count
        is a multiple of): ``unit * slot(ceil(n / unit))``; 0 for none (a fixed slot: its size)."""
        return unit * self.slot(-(-n // unit)) if n or self.fixed else 0

    def __str__(self) -> str:
        if self.fixed:
            return f"a fixed slot of {self.sizes[0]} rows"
        s = self.sizes
        head = ",".join(map(str, s)) if len(s) <= 6 else f"{s[0]},{s[1]},...,{s[-1]} ({len(s)} sizes)"
        return f"{head}; then multiples of {self.chunk}"

    @staticmethod
    def parse(value: str | Sequence[int] | bool | TokenBuckets | None) -> TokenBuckets | None:
        """``None`` / ``True`` / ``"default"`` / ``"on"``: the default list; ``False`` / ``"off"`` /
        ``"none"``: no buckets (each step's exact counts); a list, or a comma-separated string of
        sizes (``"1,2,4,8,16"``; past the last, multiples of the last); ``"fixed:C"``: a fixed
        slot of ``C`` rows (module docstring)."""
        if value is None or value is True:
            return TokenBuckets()
        if value is False:
            return None
        if isinstance(value, TokenBuckets):
            return value
        if isinstance(value, str):
            text = value.strip().lower()
            if text in ("default", "on", "true"):
                return TokenBuckets()
            if text in ("off", "none", "false", "exact"):
                return None  # (a number is a size: "1" is one bucket of 1, "0" no size at all)
            if text.startswith("fixed:"):
                size = text.removeprefix("fixed:").strip()
                if not size.isdigit():
                    raise BucketError(f"token buckets {value!r}: a fixed slot is 'fixed:N', N a row count such as 256")
                return TokenBuckets((int(size),), chunk=max(int(size), 1), fixed=True)
            try:
                sizes = [int(x) for x in text.split(",") if x.strip()]
            except ValueError:
                raise BucketError(f"token buckets {value!r}: give 'default', 'off' or ascending sizes such as "
                                  "'1,2,4,8,16,32,64'") from None
        else:
            sizes = list(value)
            if any(not isinstance(x, int) or isinstance(x, bool) for x in sizes):
                raise BucketError(f"token buckets {sizes}: every size must be an integer in [1, {MAX_BUCKET_ROWS}]")
        if not sizes:
            raise BucketError(f"token buckets {value!r}: no sizes; give 'default', 'off' or ascending sizes")
        return TokenBuckets(tuple(sizes), chunk=sizes[-1])


BUCKETS_HELP = ("AFD: token buckets, the wire slots of the attention ranks: 'default' (1,2,4, multiples of 8 to 256, "
                "of 16 to 512, then of 256), 'off' (exact counts), ascending sizes '1,2,4,8,16' ('N': one bucket of "
                "N, then multiples of N), or 'fixed:N' (every step N rows a rank and stage, counts on the device, no "
                "control message; not with an FFN group); an attention "
                "rank's tokens cross the wire padded to the next bucket, and an FFN rank's rows to the bucket of "
                "their total, so it runs one program per bucket; not with --tp")


def buckets_flag(text: str) -> str:
    """The CLI's ``--buckets``: checked when the arguments are parsed (argparse's one-line error,
    exit 2), parsed with :meth:`TokenBuckets.parse` where it is used."""
    import argparse

    try:
        TokenBuckets.parse(text)
    except BucketError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
