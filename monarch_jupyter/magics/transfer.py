"""``%mesh push|pull|scatter|gather``: move notebook variables to and from the ranks (parse, then call the Mesh).

    %mesh push x y [--ranks SPEC] [--device DEV] [--as NAME]
    %mesh pull x [--ranks SPEC] [--as NAME]             notebook x = RankMap rank -> value
    %mesh scatter x [--dim D] [--ranks SPEC] [--device DEV] [--as NAME]
    %mesh gather x [--dim D] [--ranks SPEC] [--as NAME]  notebook x = the parts concatenated in rank order

The variable of the same name is read (push, scatter) or written (pull, gather); ``--as NAME`` names the
destination instead (on the ranks for push/scatter, in the notebook for pull/gather).
"""

from __future__ import annotations

import builtins
import keyword
import types
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from ..kernel.mesh import Mesh

if TYPE_CHECKING:
    from .host import MagicsHost

__all__ = ["push", "pull", "scatter", "gather", "SUBCOMMANDS"]

SUBCOMMANDS = ("push", "pull", "scatter", "gather")

_RANKS_HELP = "ranks: 0 | 0,2 | 1-3 | ::2 (default: all)"
_DEVICE_HELP = "where tensors go on the ranks: rank (each rank's own device), cpu, cuda, cuda:N (default: as sent)"


def _dest(args: Any, names: list[str], sub: str) -> list[str]:
    if args.dest is None:
        return names
    if len(names) != 1:
        raise UsageError(f"%mesh {sub}: --as names one destination; give one variable, got {len(names)}")
    if not args.dest.isidentifier() or keyword.iskeyword(args.dest):
        raise UsageError(f"%mesh {sub}: --as needs a Python name, got {args.dest!r}")
    return [args.dest]


def _notebook_dests(magics: MagicsHost, dests: list[str], sub: str) -> None:
    """Pull and gather bind notebook variables: not a special name, one of IPython's (``get_ipython``, ``In``) or a
    builtin, and not over a module or a mesh handle, which the notebook's own code relies on (``%mesh pull
    torch``)."""
    for dest in dests:
        if dest.startswith("__") and dest.endswith("__"):
            raise UsageError(f"%mesh {sub}: {dest!r} is a special name of the notebook's namespace; store the "
                             "value under another name with  --as NAME")
        hidden = magics.shell.user_ns_hidden if magics.shell is not None else {}  # names IPython put there
        if dest in hidden or hasattr(builtins, dest):
            whose = "IPython's" if dest in hidden else "a Python builtin"
            raise UsageError(f"%mesh {sub}: {dest!r} is {whose}, which the notebook (and every magic) relies on; "
                             "store the value under another name with  --as NAME")
        held = magics.user_ns.get(dest)
        if isinstance(held, (types.ModuleType, Mesh)):
            kind = f"the module {held.__name__}" if isinstance(held, types.ModuleType) else "a Mesh"
            raise UsageError(f"%mesh {sub}: the notebook's {dest!r} is {kind}, which the value would replace; "
                             "store it under another name with  --as NAME")


def _notebook_values(magics: MagicsHost, names: list[str], sub: str) -> list[Any]:
    ns = magics.user_ns
    missing = [n for n in names if n not in ns]
    if missing:
        raise UsageError(f"%mesh {sub}: no notebook variable {', '.join(map(repr, missing))} to send")
    return [ns[n] for n in names]


@magic_arguments()
@argument("names", nargs="+", help="notebook variables to send")
@argument("--ranks", "-r", default=None, help=_RANKS_HELP)
@argument("--device", "-d", default=None, help=_DEVICE_HELP)
@argument("--as", dest="dest", default=None, help="name on the ranks (one variable only)")
@argument("--timeout", "-t", type=float, default=None, help="seconds to wait for every rank")
def push(magics: MagicsHost, rest: str) -> None:
    """%mesh push x [y ...] [--ranks SPEC] [--device DEV] [--as NAME]: bind notebook variables on the ranks."""
    args = magics.parse_args(push, rest, "push")
    values = _notebook_values(magics, args.names, "push")
    dests = _dest(args, args.names, "push")
    m = magics.current()
    try:
        m.push(dict(zip(dests, values, strict=False)), ranks=args.ranks, device=args.device, timeout=args.timeout)
    except ValueError as e:
        raise UsageError(str(e)) from None


@magic_arguments()
@argument("name", help="notebook variable to split")
@argument("--dim", type=int, default=0, help="dimension to split along (default 0)")
@argument("--ranks", "-r", default=None, help=_RANKS_HELP)
@argument("--device", "-d", default=None, help=_DEVICE_HELP)
@argument("--as", dest="dest", default=None, help="name on the ranks")
@argument("--timeout", "-t", type=float, default=None, help="seconds to wait for every rank")
def scatter(magics: MagicsHost, rest: str) -> None:
    """%mesh scatter x [--dim D] [--ranks SPEC] [--device DEV] [--as NAME]: part r of x to the r-th rank."""
    args = magics.parse_args(scatter, rest, "scatter")
    (value,) = _notebook_values(magics, [args.name], "scatter")
    (dest,) = _dest(args, [args.name], "scatter")
    m = magics.current()
    try:
        m.scatter(dest, value, args.dim, ranks=args.ranks, device=args.device, timeout=args.timeout)
    except (ValueError, TypeError) as e:
        if type(e).__name__ == "SerializationError":
            raise
        raise UsageError(str(e)) from None


@magic_arguments()
@argument("names", nargs="+", help="rank variables to fetch")
@argument("--ranks", "-r", default=None, help=_RANKS_HELP)
@argument("--as", dest="dest", default=None, help="notebook variable to store into (one name only)")
@argument("--timeout", "-t", type=float, default=None, help="seconds to wait for every rank")
def pull(magics: MagicsHost, rest: str) -> None:
    """%mesh pull x [y ...] [--ranks SPEC] [--as NAME]: notebook x = RankMap of each rank's x."""
    args = magics.parse_args(pull, rest, "pull")
    dests = _dest(args, args.names, "pull")
    _notebook_dests(magics, dests, "pull")
    m = magics.current()
    for name, dest in zip(args.names, dests, strict=False):
        try:
            values = m.pull(name, ranks=args.ranks, timeout=args.timeout)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if values and all(isinstance(v, types.ModuleType) for v in values.values()):
            module = next(iter(values.values())).__name__
            how = f"import {module}" + (f" as {name}" if module != name else "")
            raise UsageError(f"%mesh pull: {name!r} is a module on the ranks ({module}); import it in the notebook "
                             f"instead ({how})")
        magics.user_ns[dest] = values


@magic_arguments()
@argument("name", help="rank variable to fetch")
@argument("--dim", type=int, default=0, help="dimension to concatenate along (default 0)")
@argument("--ranks", "-r", default=None, help=_RANKS_HELP)
@argument("--as", dest="dest", default=None, help="notebook variable to store into")
@argument("--timeout", "-t", type=float, default=None, help="seconds to wait for every rank")
def gather(magics: MagicsHost, rest: str) -> None:
    """%mesh gather x [--dim D] [--ranks SPEC] [--as NAME]: notebook x = the ranks' x concatenated."""
    args = magics.parse_args(gather, rest, "gather")
    (dest,) = _dest(args, [args.name], "gather")
    _notebook_dests(magics, [dest], "gather")
    m = magics.current()
    try:
        magics.user_ns[dest] = m.gather(args.name, args.dim, ranks=args.ranks, timeout=args.timeout)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
