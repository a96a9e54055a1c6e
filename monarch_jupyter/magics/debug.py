"""``%mesh debug`` and ``%mesh inspect``: parse arguments and call ``mesh.debugger`` (kernel/debugger.py).

Breakpoints need no magic: ``breakpoint()`` in a ``%%mesh`` cell opens a pdb prompt in that cell; ``%%mesh
--pdb-commands "p x; c"`` answers it from a list instead.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from .. import errors
from ..kernel import dappostmortem
from ..kernel.postmortem import NothingToDebugError
from ..ranks import ranks_text

if TYPE_CHECKING:
    from .host import MagicsHost

__all__ = ["debug", "inspect"]


@magic_arguments()
@argument("--rank", "-r", type=int, default=None,
          help="rank to debug (default: the first rank that failed in the most recent failed cell)")
@argument("--commands", "-c", default=None,
          help='pdb commands separated by ";" (e.g. "p x; up; p y") answering the prompts instead of a person; '
               "the session ends when they are used up")
@argument("--clear", action="store_true",
          help="drop the tracebacks the ranks keep for post-mortem (and the tensors their frames hold)")
def debug(magics: MagicsHost, rest: str) -> None:
    """%mesh debug [--rank R] [--commands "p x; up"] [--clear]: pdb at the failing frame of a rank's last cell.

    Each rank keeps the traceback of its last failed cell until its next cell (or --clear). Ranks stopped at a
    breakpoint() of a cell nobody waits for (run with block=False) are offered first. While JupyterLab's visual
    debugger is on, the post-mortem opens in its sidebar instead (not with --commands, which are pdb's).
    """
    args = magics.parse_args(debug, rest, "debug")
    m = magics.current()
    try:
        if args.clear:
            had = m.debugger.clear()
            print(f"dropped the tracebacks of {ranks_text(had)}" if had
                  else "no rank kept a traceback")
            return
        if args.rank is None and args.commands is None and m.debugger.attach():
            return
        if args.commands is None and dappostmortem.open_in_sidebar(magics.shell, m, args.rank) is not None:
            return  # the visual debugger is on: the post-mortem was in its sidebar
        m.debugger.post_mortem(args.rank, args.commands)
    except (NothingToDebugError, ValueError) as e:
        raise UsageError(str(e)) from None
    except errors.MeshError:
        raise
    except errors.MonarchError as e:
        raise UsageError(str(e)) from None


_INSPECT_OPTION = re.compile(r"\s*(?:(?:--rank|-r)(?:\s+|=)(?P<rank>\S+)|(?P<frame>--frame)\b|"
                             r"--timeout(?:\s+|=)(?P<timeout>\S+)|(?P<help>--help|-h)\b)")

INSPECT_USAGE = """\
%mesh inspect --rank R [--frame] [--timeout S] EXPR

Evaluate the Python expression EXPR on rank R beside its main thread, even while that thread is busy (a long
cell, a collective): it reads live state, which may change as the rank runs.
  --rank R, -r R   the rank to ask (required)
  --frame          use the locals of the innermost frame of notebook code it runs (or of pdb's frame)
  --timeout S      seconds to wait for the answer (default 10)
"""


def inspect(magics: MagicsHost, rest: str) -> Any:
    """%mesh inspect --rank R [--frame] [--timeout S] EXPR (EXPR is the rest of the line, verbatim)."""
    rank: int | None = None
    frame = False
    timeout = 10.0
    pos = 0
    while m := _INSPECT_OPTION.match(rest, pos):
        if m.group("help"):
            print(INSPECT_USAGE)
            return None
        try:
            if m.group("rank") is not None:
                rank = int(m.group("rank"))
            elif m.group("timeout") is not None:
                timeout = float(m.group("timeout"))
            else:
                frame = True
        except ValueError:
            raise UsageError(f"%mesh inspect: bad option value in {m.group(0).strip()!r}\n{INSPECT_USAGE}") from None
        pos = m.end()
    expr = rest[pos:].strip()
    if rank is None or not expr:
        raise UsageError(f"%mesh inspect needs --rank R and an expression, e.g.  %mesh inspect --rank 1 "
                         f"loss.item()\n{INSPECT_USAGE}")
    mesh = magics.current()
    try:
        return mesh.debugger.inspect(expr, rank, frame=frame, timeout=timeout)
    except SyntaxError as e:
        raise UsageError(f"%mesh inspect: {expr!r} is not a Python expression ({e.msg})") from None
    except (ValueError, errors.MonarchError) as e:
        raise UsageError(str(e)) from None
