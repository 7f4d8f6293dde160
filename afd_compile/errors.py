"""The errors afd-compile raises for input it cannot take.

Every one derives from :class:`AFDCompileError` (itself a ``ValueError``): the CLI turns exactly
these into exit code 2 with one line on stderr, and callers can catch the one base. Each message
names the node / rank / layer and what was expected.
"""

from __future__ import annotations


class AFDCompileError(ValueError):
    """Input afd-compile cannot take: a graph, a layout, an option, a file."""


class SplitError(AFDCompileError):
    """The graph cannot be cut as asked; the message names the layer and node."""


class ProgramLoadError(AFDCompileError):
    """A file or folder cannot be read as the program (or rewrite folder) asked for; the message
    names the path and the cause."""


class TPRewriteError(AFDCompileError):
    """A TP layout's rewrite cannot be built for this graph; the message names the layer."""


def refusal(error: BaseException) -> AFDCompileError | None:
    """The :class:`AFDCompileError` behind ``error``, or None: itself, or one it wraps (what
    ``torch.compile`` raises when the ``afd`` backend refuses a graph is dynamo's
    ``BackendCompilerFailed``, holding ours as ``inner_exception``; a cause or context chain)."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, AFDCompileError):
            return e
        seen.add(id(e))
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    return None
