"""``%mesh run``: run an existing torchrun script (or module) on the ranks (parse, then call ``Mesh.run_script``).

    %mesh run [--ranks SPEC] [--timeout S] [--order arrival|rank] script.py [args ...]
    %mesh run [--ranks SPEC] -m package.module [args ...]

Everything after the script (or module) name goes to it unchanged, as after ``torchrun --nproc-per-node N``.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

if TYPE_CHECKING:
    from . import MeshMagics

__all__ = ["run", "SUBCOMMANDS"]

SUBCOMMANDS = ("run",)


@magic_arguments()
@argument("--ranks", "-r", default=None, help="ranks to run it on: 0 | 0,2 | 1-3 | ::2 (default: all)")
@argument("--timeout", "-t", type=float, default=None, help="seconds before it is interrupted")
@argument("--order", choices=["arrival", "rank"], default=None, help="output order (see stream_order)")
@argument("-m", dest="module", action="store_true", help="run a module (python -m) instead of a file")
@argument("target", help="the script (a path relative to the notebook's folder, or absolute), or with -m a module")
@argument("args", nargs=argparse.REMAINDER, help="the script's own arguments (its sys.argv[1:])")
def run(magics: MeshMagics, rest: str) -> Any:
    """%mesh run [--ranks SPEC] [--timeout S] [-m] script.py [args ...]: run an existing torchrun script unchanged
    on the ranks (__name__ == "__main__", sys.argv == [script, *args]); rank -> exit status."""
    args = magics.parse_args(run, rest, "run")
    m = magics.current()
    try:
        return m.run_script(args.target, *args.args, module=args.module, ranks=args.ranks,
                            timeout=args.timeout if args.timeout is not None else magics.option("timeout"),
                            order=args.order or magics.setting("stream_order"))
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise UsageError(f"%mesh run: {e}") from None
