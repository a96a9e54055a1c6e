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
from ..ranks import format_ranks, n_ranks, plural, ranks_text

__all__ = ["name_hints", "hint_for", "restart_hint", "busy_message", "group_down_note", "stuck_message",
           "healed_note", "give_up_note", "not_restartable_note", "heal_failed_note", "replay_failed_note",
           "healing_wait_note", "healing_interrupted_note", "lighthouse_note", "heal_hint"]

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


# ---------------------------------------------------------------------------------------------------- self-healing


def healed_note(ranks: list[int], why: str, seconds: float, sent: str, rejoined: list[str], grouped: bool,
                blocked: list[int] | None = None, sub_mesh: bool = False) -> str:
    """The one line the notebook gets when ``ranks`` died (``why``) and were restarted (on_rank_death="restart")
    within ``seconds``; ``sent``: what they got back; ``rejoined``: the cells they rejoined; ``grouped``: they are
    in the process group already (else once those cells end); ``blocked``: ranks that stay dead, so no group was
    made; ``sub_mesh``: the group is their sub-mesh's (a split mesh), not the whole mesh's."""
    them = plural(ranks, "they", "it")
    if blocked:
        group = (f"{plural(ranks, 'are', 'is')} in no process group, as {ranks_text(blocked)} "
                 f"{plural(blocked, 'stay', 'stays')} dead (collectives fail until  %mesh restart --rank "
                 f"{format_ranks(blocked)}  makes a group of every rank)")
    else:
        others = "the others of its sub-mesh" if sub_mesh else "the others"
        group = (f"joined a fresh process group with {others}" if grouped
                 else f"{plural(ranks, 'join', 'joins')} a fresh process group with {others} when "
                      f"{'those cells end' if len(rejoined) > 1 else 'that cell ends'}")
    text = (f"{ranks_text(ranks)} died ({why}) and {plural(ranks, 'were', 'was')} restarted (on_rank_death=restart) "
            f"in {seconds:.1f} s: {them} {group}" + (f"; got back {sent}" if sent else ""))
    if rejoined:
        text += f"; rejoined {', '.join(rejoined)}"
    return text


def heal_hint(dead: list[int]) -> str:
    """A cell's error when ``dead`` ranks died under on_rank_death="restart": the mesh restarts them."""
    return (f"{ranks_text(dead)} {plural(dead, 'are', 'is')} restarted by the mesh (on_rank_death=restart): the next "
            f"cells on {plural(dead, 'them', 'it')} wait for that, then run with a fresh process group (objects bound "
            "to the old one, such as a DistributedDataParallel model, must be made again)")


def give_up_note(rank: int, deaths: int, limit: int, window: float) -> str:
    """``rank`` died ``deaths`` times within ``window`` seconds, more than ``limit``: it stays dead."""
    return (f"rank {rank} died {deaths} {'time' if deaths == 1 else 'times'} within {window:g} s (restart_limit "
            f"{limit}): it is not restarted "
            f"again and stays dead. Its last output is above; fix the cause, then  %mesh restart --rank {rank}  "
            "starts it by hand (or raise restart_limit).")


def not_restartable_note(ranks: list[int], why: str) -> str:
    """``ranks`` died under on_rank_death="restart", but their launcher cannot start them again (``why``)."""
    return (f"{ranks_text(ranks)} died and cannot be restarted from here ({why}); on_rank_death=restart needs a "
            "launcher that starts ranks (local, or host agents: %mesh start --launcher agent|torchrun|slurm, or the "
            "agent command  %mesh listen  prints). %mesh restart  starts a fresh mesh.")


def heal_failed_note(ranks: list[int], error: str, world_size: int) -> str:
    """Restarting ``ranks`` (of ``world_size``) failed (``error``); they stay dead."""
    return f"restarting {ranks_text(ranks)} failed: {error}. {restart_hint(ranks, world_size)}"


def replay_failed_note(rank: int, what: str, error: str) -> str:
    """The replacement of ``rank`` raised while it got back ``what``; it runs on without it."""
    return (f"rank {rank} was restarted, but {what} failed there ({error}): what it defines is missing on rank "
            f"{rank} (%mesh status; run it again with  %%mesh --ranks {rank})")


def healing_wait_note(ranks: list[int], what: str) -> str:
    """A cell waits until ``ranks`` are restarted and have got back what the notebook sent."""
    return (f"note: {what} waits until {ranks_text(ranks)} {plural(ranks, 'are', 'is')} restarted and in a fresh "
            "process group (on_rank_death=restart; the notebook's interrupt stops the wait)\n")


def healing_interrupted_note(ranks: list[int], what: str) -> str:
    """The notebook's interrupt stopped a cell that waited for ``ranks`` to be restarted (nothing was sent)."""
    return (f"interrupted while {what} waited for {ranks_text(ranks)} to be restarted (on_rank_death=restart): it "
            "did not run. The restart goes on (%mesh status shows it); run the cell again to wait for it, or leave "
            f"{plural(ranks, 'those ranks', 'that rank')} out (--ranks)")


def healing_timeout_note(ranks: list[int], what: str, timeout: float) -> str:
    """``what`` waited ``timeout`` seconds for ``ranks`` to be restarted, in vain (nothing was sent)."""
    return (f"{what} did not run: {ranks_text(ranks)} {plural(ranks, 'were', 'was')} still being restarted "
            f"(on_rank_death=restart) after its timeout of {timeout:g} s. %mesh status shows the restart; run the cell "
            f"again to wait for it, or leave {plural(ranks, 'those ranks', 'that rank')} out (--ranks)")


def lighthouse_note(pid: int, returncode: int | None, address: str, error: str) -> str:
    """The torchft Lighthouse (``pid``) exited with ``returncode``: started again at ``address``, or not (``error``)."""
    gone = f"the torchft Lighthouse (pid {pid}) exited with code {returncode}"
    if address:
        return f"{gone}; it was started again at {address}, and torchft's quorums go on from there"
    return (f"{gone} and could not be started again ({error}): torchft loops wait for a quorum. %mesh restart  "
            "starts a fresh mesh with a fresh Lighthouse")


def restarted_note(ranks: list[int], world_size: int, ended: list[str], sent: str, kept: bool) -> str:
    """The one line of ``%mesh restart --rank``: the fresh ranks, what they got back (``sent``, in words; ``kept``:
    the mesh keeps what the notebook sent, on_rank_death=restart), and the split it ended (``ended``: sub-meshes)."""
    it = "they" if len(ranks) > 1 else "it"
    if ended:
        out = (f"restarted {ranks_text(ranks)}, which ended the split: {', '.join(ended)} merged into one process "
               f"group of {world_size} ranks (%mesh split  splits it again)")
    else:
        out = (f"restarted {ranks_text(ranks)} (a fresh process); the other ranks kept their namespaces; a fresh "
               f"process group of {n_ranks(world_size)}")
    if sent:
        return f"{out}; {it} got back {sent}"
    if kept:
        return out
    return (f"{out}; {it} start{'' if len(ranks) > 1 else 's'} with a fresh namespace: what the notebook pushed or "
            "ran before is not there (push or run it again; a mesh started with  --on-rank-death restart  sends it "
            "back)")
