"""``%mesh split`` and ``%mesh merge``: sub-meshes of the current mesh (parse, then call ``Mesh.split`` /
``Mesh.merge``; kernel/submesh.py does the work).

    %mesh split K                       K equal sub-meshes of consecutive ranks (sub0, sub1, ...)
    %mesh split 0,1 2,3 [--names a,b]   the groups, each a rank selection (0,1 | 2-3 | ::2)
    %mesh merge                         one process group of the whole mesh again

A cell runs on one sub-mesh with ``%%mesh --mesh NAME`` (its ``--ranks`` in the sub-mesh's numbers); the sub-meshes
are also in the notebook's namespace under their names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from ..errors import MonarchError
from ..ranks import parse_ranks

if TYPE_CHECKING:
    from ..kernel.submesh import SubMesh
    from .host import MagicsHost

__all__ = ["split", "merge", "sub_mesh", "SUBCOMMANDS"]

SUBCOMMANDS = ("split", "merge")


@magic_arguments()
@argument("--names", default=None, help="names of the sub-meshes, comma-separated (default: sub0,sub1,...)")
@argument("groups", nargs="+", help="a number of equal sub-meshes (2), or each group's ranks (0,1 2,3)")
def split(magics: MagicsHost, rest: str) -> list[SubMesh]:
    """%mesh split K | %mesh split RANKS RANKS ... [--names a,b]: split the mesh into sub-meshes, each with its
    own process group (ranks numbered 0..k-1 inside it); namespaces are kept. Binds each sub-mesh under its name in
    the notebook and returns them.

    Raises
    ------
    UsageError
        Groups that do not cover the ranks or overlap, bad names, or a mesh that cannot be split now (a cell runs,
        a rank is dead, already split); the mesh is unchanged.
    """
    args = magics.parse_args(split, rest, "split")
    m = magics.current()
    names = [n.strip() for n in args.names.split(",")] if args.names else None
    try:
        if len(args.groups) == 1 and args.groups[0].strip().isdigit():
            subs = m.split(int(args.groups[0]), names)
        else:
            subs = m.split([parse_ranks(g, m.nproc) for g in args.groups], names)
    except (ValueError, MonarchError) as e:
        raise UsageError(f"%mesh split: {e}") from None
    for s in subs:
        magics.user_ns[s.name] = s
    return subs


@magic_arguments()
def merge(magics: MagicsHost, rest: str) -> None:
    """%mesh merge: one process group of the whole mesh again, once no sub-mesh runs a cell.

    Raises
    ------
    UsageError
        The mesh is not split, a sub-mesh runs a cell, or a rank is dead.
    """
    magics.parse_args(merge, rest, "merge")
    m = magics.current()
    names = list(m.subs)
    try:
        m.merge()
    except MonarchError as e:
        raise UsageError(f"%mesh merge: {e}") from None
    print(f"merged {', '.join(names)}: one process group of {m.nproc} ranks")


def sub_mesh(m: Any, name: str) -> SubMesh:
    """The sub-mesh ``name`` of mesh ``m`` (``%%mesh --mesh NAME``); UsageError naming the ones there are."""
    subs = m.subs
    if name not in subs:
        there = f"its sub-meshes are {', '.join(subs)}" if subs else "it is not split (%mesh split 2 splits it)"
        raise UsageError(f"%%mesh --mesh {name}: the mesh has no sub-mesh {name!r}; {there}")
    return subs[name]
