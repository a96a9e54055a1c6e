"""``%mesh run``: run an existing torchrun script (or module) on the ranks (parse, then call ``Mesh.run_script``).

    %mesh run [--ranks SPEC] [--timeout S] [--order arrival|rank] [--env NAME=VALUE ...] [--keep-state]
              script.py [args ...]
    %mesh run [--ranks SPEC] -m package.module [args ...]

Everything after the script (or module) name goes to it unchanged, as after ``torchrun --nproc-per-node N``.
``--env NAME=VALUE`` sets a variable for this run only (as ``NAME=VALUE torchrun ...`` would); ``--keep-state``
keeps frameworks' state (accelerate's) as the cells left it instead of starting fresh.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

if TYPE_CHECKING:
    from .host import MagicsHost

__all__ = ["run", "SUBCOMMANDS"]

SUBCOMMANDS = ("run",)


@magic_arguments()
@argument("--ranks", "-r", default=None, help="ranks to run it on: 0 | 0,2 | 1-3 | ::2 (default: all)")
@argument("--timeout", "-t", type=float, default=None, help="seconds before it is interrupted")
@argument("--order", choices=["arrival", "rank"], default=None, help="output order (see stream_order)")
@argument("--env", "-e", action="append", default=[], metavar="NAME=VALUE",
          help="an environment variable for this run only (repeat for more)")
@argument("--keep-state", action="store_true",
          help="keep frameworks' state (accelerate's) as the cells left it, instead of a fresh process's")
@argument("-m", dest="module", action="store_true", help="run a module (python -m) instead of a file")
@argument("target", help="the script (a path relative to the notebook's folder, or absolute), or with -m a module")
@argument("args", nargs=argparse.REMAINDER, help="the script's own arguments (its sys.argv[1:])")
def run(magics: MagicsHost, rest: str) -> Any:
    """%mesh run [--ranks SPEC] [--timeout S] [--env NAME=VALUE] [--keep-state] [-m] script.py [args ...]: run an
    existing torchrun script unchanged on the ranks (__name__ == "__main__", sys.argv == [script, *args]), in a
    fresh framework state and its own environment; rank -> exit status.

    Raises
    ------
    UsageError
        Bad arguments, a script that does not exist here, a malformed --env.
    """
    args = magics.parse_args(run, rest, "run")
    env = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"%mesh run: --env takes NAME=VALUE, got {item!r}")
        env[name] = value
    m = magics.current()
    try:
        return m.run_script(args.target, *args.args, module=args.module, ranks=args.ranks,
                            timeout=args.timeout if args.timeout is not None else magics.option("timeout"),
                            order=args.order or magics.setting("stream_order"), env=env,
                            keep_state=args.keep_state)
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise UsageError(f"%mesh run: {e}") from None
