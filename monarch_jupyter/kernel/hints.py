"""What the controller tells the user, in one place: hints added to a failed cell's error, and the texts of its
refusals and notes (``restart_hint``, ``busy_message``, ``group_down_note``, ``stuck_message``).

Hints from what the notebook knows and the ranks do not:

A ``%%mesh`` cell that uses a name the notebook defined but the ranks never got (a model made in an ordinary cell)
fails on each rank with a bare ``NameError``. ``name_hints`` tells the user, in the error's last lines, that the
name exists in the notebook and what sends it: ``%mesh push NAME`` for a value that can travel, "import it in
the cell" for a module, "create it in the cell" for a value that cannot be pickled. Nothing is sent by itself:
a push copies the value (a model's weights, a dataset), which only the user can decide.

The name comes from the rank's NameError message, as CPython words it (``name 'x' is not defined``); a message
worded otherwise gets no hint.
"""

from __future__ import annotations

import re
import types
from typing import Any

from ..errors import MeshError, RemoteError
from ..ranks import format_ranks, plural, ranks_text

__all__ = ["name_hints", "hint_for", "restart_hint", "busy_message", "group_down_note", "stuck_message"]

_UNDEFINED = re.compile(r"^name '([A-Za-z_][A-Za-z0-9_]*)' is not defined")


def hint_for(name: str, value: Any) -> str:
    """What to tell about notebook variable ``name`` (holding ``value``) that the ranks do not have."""
    if isinstance(value, types.ModuleType):
        return (f"'{name}' is the module {value.__name__} in the notebook, not on the ranks: import it in the cell "
                f"(import {value.__name__}" + (f" as {name})" if name != value.__name__ else ")"))
    try:
        from monarch_worker.serialize import dumps

        dumps(value)
    except Exception as e:  # noqa: BLE001 - any reason it cannot travel
        return (f"'{name}' exists in the notebook but cannot be sent to the ranks ({type(e).__name__}: {e}); create "
                "it in a %%mesh cell instead")
    return (f"'{name}' exists in the notebook, not on the ranks: send it with  %mesh push {name}  "
            f"(mesh.push({name}={name}) in Python), or create it in a %%mesh cell")


def name_hints(error: MeshError, namespace: dict[str, Any]) -> None:
    """Add to ``error.hint`` a line for each NameError of its ranks whose name the notebook's ``namespace`` has."""
    lines: list[str] = []
    for err in error.errors.values():
        if not isinstance(err, RemoteError) or err.ename != "NameError":
            continue
        m = _UNDEFINED.match(err.evalue)
        if m is None or m.group(1) not in namespace:
            continue
        text = "hint: " + hint_for(m.group(1), namespace[m.group(1)])
        if text not in lines:
            lines.append(text)
    if lines:
        error.hint = "\n".join([*([error.hint] if error.hint else []), *lines])


def restart_hint(dead: list[int], world_size: int) -> str:
    """What to run to bring ``dead`` ranks (of a mesh of ``world_size`` ranks) back."""
    if len(set(dead)) >= world_size:  # no survivor keeps state: a fresh mesh is the whole answer
        return (f"every rank is dead ({ranks_text(dead)}): %mesh restart  starts a fresh mesh "
                "(mesh.restart() from Python).")
    them = "them" if len(dead) > 1 else "it"
    return (f"{ranks_text(dead)} {'are' if len(dead) > 1 else 'is'} dead and the process group is down: "
            f"%mesh restart --rank {format_ranks(dead)}  starts fresh processes for {them} "
            "(the other ranks keep their state; mesh.restart(ranks=...)), or  %mesh restart  starts a fresh mesh.")


def busy_message(what: str, busy: list[int], others: list[int], runs_code: bool) -> str:
    """Why ``what`` was not run: ``busy`` ranks still run an abandoned cell (``others``: the chosen ranks that do
    not); for code, on every rank, as its collectives would pair with the stuck one."""
    them, they = plural(busy, "them", "it"), plural(busy, "they are", "it is")
    stuck = (f"{what} was not run: {ranks_text(busy)} still {plural(busy, 'run', 'runs')} an earlier cell that was "
             "interrupted or timed out and did not stop (blocked in a collective?)")
    if not runs_code:  # a push or pull: those ranks would get to it only after the stuck cell
        return (f"{stuck}, and would get to it only after that. Leave {them} out"
                + (f" (--ranks {format_ranks(others)})" if others else "")
                + f", or release {them}:  %mesh interrupt --force --ranks {format_ranks(busy)}  (or  %mesh restart).")
    return (f"{stuck}; a collective of new code on any rank would pair with the one {they} stuck in and give wrong "
            f"results. Run  %mesh stacks  to see where,  %mesh interrupt --force --ranks {format_ranks(busy)}  to "
            f"release {them}, or  %mesh restart  (%mesh inspect  reads values meanwhile).")


def group_down_note(why: str) -> str:
    """The note a cell gets when it runs while the process group is broken (``why``)."""
    return (f"note: the process group is down ({why}): collectives fail until %mesh restart --rank R  "
            "(or  %mesh restart)\n")


def stuck_message(stuck: list[int], grace: float, where: str) -> str:
    """What to tell about ranks that did not stop within ``grace`` seconds of an interrupt (``where``: their
    stacks' summary)."""
    still = "is still running" if len(stuck) == 1 else "are still running"
    return (f"{ranks_text(stuck)} did not stop within {grace:g} s and {still} the cell: {where}\n"
            f"{plural(stuck, 'They', 'It')} may be stuck in C code or in a collective with ranks that stopped. "
            f"%mesh interrupt --force --ranks {format_ranks(stuck)}  tears the process group down (releasing "
            f"collectives) and SIGKILLs ranks still stuck; %mesh restart  starts a fresh mesh.\n")
