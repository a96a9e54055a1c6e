"""Rank output: labelled lines written to the notebook (the splitting of raw bytes into lines, sync markers and
records is monarch_worker.streams.StreamSplitter, shared with host agents).

Output reaches the cell that caused it: each cell captures the caller's ``contextvars`` context when it is
submitted (ipykernel keeps the cell's parent header in a ContextVar), and lines are written inside that context,
from whichever thread delivers them (the pattern of ipykernel's IOPubThread and set_parent).
"""

from __future__ import annotations

import contextvars
import sys

from monarch_worker.streams import StreamSplitter

__all__ = ["StreamSplitter", "label", "write_lines"]


def label(rank: int) -> str:
    """The prefix of each output line of ``rank``; the same as torchrun's ``--tee`` line prefix."""
    return f"[rank{rank}]:"


def write_lines(lines: list[tuple[int, str, str]], ctx: contextvars.Context | None = None) -> None:
    """Write (rank, stream, text) lines to sys.stdout / sys.stderr, labelled, inside ``ctx`` if given."""
    if not lines:
        return

    def write() -> None:
        out: list[str] = []
        err: list[str] = []
        for rank, stream, text in lines:
            (out if stream == "stdout" else err).append(f"{label(rank)} {text}\n")
        # Keep stdout and stderr lines in their relative order where both occur.
        if out and err:
            for rank, stream, text in lines:
                target = sys.stdout if stream == "stdout" else sys.stderr
                target.write(f"{label(rank)} {text}\n")
        elif out:
            sys.stdout.write("".join(out))
        else:
            sys.stderr.write("".join(err))
        sys.stdout.flush()
        sys.stderr.flush()

    if ctx is None:
        write()
    else:
        ctx.run(write)
