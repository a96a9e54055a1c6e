"""A rank that raises never hangs the others: ``Releases`` tears the process group down for ranks that wait in a
collective the raising rank will never join, as torchrun's fail-fast would end them, but keeps every namespace.
The same holds for a rank that an interrupt of the cell stopped (the notebook's, or its timeout): the interrupt's
waiter (waiting.py) asks ``release`` with ``interrupted`` once the grace passed with ranks still running. A cell
abandoned after the grace with ranks still running it is watched on (``watch``): a rank that stops it later (a
``finally`` clause longer than the grace) releases the peers that wait for it then.

While a cell has a rank that raised and others still running it, the waiting thread asks those ranks, at once and
then every ``COLLECTIVE_CHECK`` seconds, which collectives they have issued (their I/O thread answers from torch's
flight recorder, or from each group's own operation count: monarch_worker.recovery.last_collective).
``waiting_for`` decides from those numbers, whatever frame a rank waits in (a Python collective, DDP's C++ reducer,
autograd's engine, ``Work.wait()``, NCCL's later synchronisation). The released ranks' errors then read "released
from gloo:all_reduce #5" after the raising rank's (``fold_released``), and once the cell ended a fresh process group
is made (``renew_group``), unless a rank of the mesh is dead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from monarch_worker import protocol as P

from ..errors import MonarchError, RankAbortedError, RemoteError
from ..ranks import plural, ranks_text
from .cells import CellTable
from .dispatch import Dispatcher
from .hints import restart_hint
from .records import CellRecord
from .stacks import StackRequests
from .state import MeshState, RankState

log = logging.getLogger(__name__)

__all__ = ["Releases", "waiting_for", "unmatched", "failed_ranks", "COLLECTIVE_CHECK", "WATCH_CHECK_MAX"]

COLLECTIVE_CHECK = 0.5
"""Seconds between the questions, to the ranks still running a cell that another rank of it raised in, which
collectives they have issued (``waiting_for``)."""

WATCH_CHECK_MAX = 5.0
"""Seconds between those questions at most, about a cell abandoned after an interrupt's grace (``Releases.watch``):
from ``COLLECTIVE_CHECK`` they double while no rank stops it (a rank that never stops is not asked about forever
twice a second)."""


def waiting_for(failed: dict[int, dict], running: dict[int, dict],
                peers: list[int] | None = None) -> dict[int, str]:
    """Which ranks of ``running`` wait for a rank of ``failed`` in a collective it will never issue.

    ``failed``, ``running``: rank -> its collective summary (``Stacks.collective``, monarch_worker.recovery
    ``last_collective``: ``groups`` maps a process group to ``[seq, ranks, name]``). The ranks of ``failed`` raised
    and left the cell, so their numbers are final. A running rank that has issued collective number ``seq`` on a
    group of which a failed rank is a member, while that failed rank issued fewer there, is in (or past, for a
    collective that completes one-sidedly) a collective that cannot complete: it waits whatever frame it waits
    in (Python, DDP's C++ reducer, autograd's engine, ``Work.wait()``, NCCL's later synchronisation).

    ``failed`` and ``running`` are keyed by mesh rank; a group's ``ranks`` are torch ranks, which are mesh ranks
    on a whole mesh and ``peers[i]`` for torch rank i on a sub-mesh (``peers``: its mesh ranks, sorted; None: the
    whole mesh).

    Returns rank -> the collective it waits in ("gloo:all_reduce #5"); ranks without a summary are left out (the
    caller falls back to their stacks).
    """
    out: dict[int, str] = {}
    for r, c in running.items():
        for group, (seq, members, name) in (c.get("groups") or {}).items():
            if peers is not None:
                members = [peers[i] for i in members if 0 <= i < len(peers)]
            them = [f for f in failed if f in members]
            if not them:  # a group without the raising ranks (or whose ranks are unknown): not waiting for them
                continue
            behind = min(int(((failed[f].get("groups") or {}).get(group) or [0])[0]) for f in them)
            if int(seq) > behind:
                out[r] = f"{name or 'collective'} #{seq}"
                break
    return out


def unmatched(collectives: dict[int, dict], peers: list[int]) -> str:
    """Whether the ranks of one default process group issued different numbers of collectives on a group they
    share: a rank interrupted between issuing a collective and waiting for it (torch enqueues it, gloo sends this
    rank's part) leaves it in flight, and its peers' next collective would pair with it: wrong values, then a hang.

    ``collectives``: rank -> its ``last_collective()`` summary (monarch_worker.recovery), for the ranks that
    answered; ``peers``: the group's mesh ranks, sorted (torch rank i is ``peers[i]``: a sub-mesh numbers its
    ranks 0..k-1). Only torch's flight recorder judges (``source`` "recorder", torch 2.8+ for gloo): it leaves
    point-to-point operations out, which a group's own count holds. A rank with no recorder entry since its group
    was made issued no collective there. A group is not judged when a member did not answer, or when a member's
    recorder dropped entries since the group was made (``complete`` False: its ring buffer is full) and holds none
    of that group. Returns "rank 3 issued gloo:all_reduce #3, which rank 2 never issued", one such phrase per group
    out of step, joined by "; " ("" when the numbers agree or cannot be compared).
    """
    recorded = {r: c for r, c in collectives.items() if c.get("source") == "recorder"}
    if not recorded:  # no flight recorder here: a group's own count holds send/recv too; no evidence
        return ""
    found: list[str] = []
    for name in sorted({g for c in recorded.values() for g in c.get("groups") or {}}):
        entries = [e for c in recorded.values() if (e := c["groups"].get(name))]
        known = next((list(e[1]) for e in entries if e[1]), [])
        members = [peers[i] for i in known if 0 <= i < len(peers)] or sorted(collectives)
        if any(r not in collectives for r in members):
            continue
        seqs: dict[int, int] = {}
        for r in members:
            c = recorded.get(r, {})
            entry = (c.get("groups") or {}).get(name)
            if entry is None and c and not c.get("complete", True):
                break  # its entries of this group may have been dropped: unknown
            seqs[r] = int(entry[0]) if entry else 0
        else:
            top = max(seqs.values())
            behind = [r for r, n in seqs.items() if n < top]
            if behind:
                ahead = [r for r, n in seqs.items() if n == top]
                what = next((str(e[2]) for e in entries if int(e[0]) == top and e[2]), "a collective")
                found.append(f"{ranks_text(ahead)} issued {what} #{top}, which {ranks_text(behind)} never issued")
    return "; ".join(found)


def failed_ranks(rec: CellRecord) -> list[int]:
    """Under the lock: the ranks that finished ``rec`` by raising (not interrupted, not dead)."""
    return sorted(r for r, e in rec.errors.items()
                  if isinstance(e, RemoteError) and not e.interrupted and r in rec.finished)


class Releases:
    """Releases ranks that wait for one that raised (see the module docstring)."""

    def __init__(self, state: MeshState, dispatcher: Dispatcher, cells: CellTable, stacks: StackRequests,
                 regroup: Callable[[list[int], float, list[int] | None], None]) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self.cells = cells
        self.stacks = stacks
        self.regroup = regroup  # a fresh process group for every rank (recovery.Restarts.regroup)
        self._next_check: dict[int, float] = {}  # cell id -> when to ask its ranks next
        self._counts: dict[int, dict[int, dict]] = {}  # cell id -> rank -> its groups' counts at the last question
        self._watched: dict[int, threading.Thread] = {}  # cell id -> the thread of ``watch`` (under the lock)

    def due(self, rec: CellRecord, now: float) -> tuple[list[int], list[int]]:
        """Under the lock: every ``COLLECTIVE_CHECK`` s while a rank of ``rec`` has raised and others still run
        it, (the ranks that raised, the ranks still running it) for ``release``; else ([], [])."""
        self.state.assert_locked()
        if rec.all_done or rec.interrupted or rec.collective_released or not rec.errors:
            self._forget(rec)
            return [], []
        failed = failed_ranks(rec)
        if not failed or now < self._next_check.get(rec.cell_id, 0.0):
            return [], []
        self._next_check[rec.cell_id] = now + COLLECTIVE_CHECK
        if len(self._next_check) > 64:  # cells whose waiter left (interrupted): they are done with
            for cid in [c for c in self._next_check if c not in self.state.cells]:
                self._next_check.pop(cid, None)
                self._counts.pop(cid, None)
        running = [r for r in rec.ranks if r not in rec.finished and self.state.ranks[r].state is not RankState.DEAD]
        return failed, running

    def _forget(self, rec: CellRecord) -> None:
        self._next_check.pop(rec.cell_id, None)
        self._counts.pop(rec.cell_id, None)

    def stopped(self, rec: CellRecord) -> list[int]:
        """Under the lock: the ranks of interrupted ``rec`` whose collective numbers in it are final: they stopped
        it (interrupted, or raised) or had ended it; not the dead, not those given up on, not those that had not
        started it (they skip it)."""
        self.state.assert_locked()
        ranks = self.state.ranks
        return sorted(r for r in rec.ranks if r in rec.finished and r not in rec.queued_on
                      and (info := ranks.get(r)) is not None and info.state is not RankState.DEAD
                      and (r not in rec.errors or isinstance(rec.errors[r], RemoteError)))

    def release(self, rec: CellRecord, failed: list[int], running: list[int], interrupted: bool = False) -> None:
        """When ranks of ``running`` wait in a collective that ranks of ``failed`` (which raised in
        ``rec``; ``interrupted``: which an interrupt stopped) never issued (``waiting_for``; from their Python
        stacks where a rank reports no numbers), tear the process group down (``Abort`` to every rank) to release
        them; the waiter makes a fresh group once the cell ended (``renew_group``)."""
        self.state.assert_unlocked()
        try:
            report = self.stacks.ask(failed + running, 1.0)
        except MonarchError:
            return
        replies = report.replies
        known = {r: replies[r].collective for r in failed if r in replies}
        recorded = {r: replies[r].collective for r in running if r in replies and "groups" in replies[r].collective}
        with self.state.lock:  # a sub-mesh numbers its torch ranks 0..k-1
            peers = self.state.peers(rec.ranks) if self.state.partition else None
        waiting = waiting_for(known, recorded, peers) if len(known) == len(failed) else {}
        for r in running:  # no numbers there: a collective's Python frames
            if r in replies and r not in recorded and any(
                    "torch/distributed/" in str(f[0]) or "torch/nn/parallel/" in str(f[0]) for f in replies[r].frames):
                waiting[r] = "a collective"
        # A group's own count (no flight recorder: torch before 2.8 with gloo) holds point-to-point operations
        # too, which another peer may be serving: such a rank waits only when its count stood still since the
        # last question (COLLECTIVE_CHECK s before).
        counts = {r: c["groups"] for r, c in recorded.items() if c.get("source") == "sequence"}
        state = self.state
        with state.lock:
            seen = self._counts.get(rec.cell_id, {})
            waiting = {r: w for r, w in waiting.items() if r not in counts or seen.get(r) == counts[r]}
            self._counts[rec.cell_id] = counts
            failed = ([r for r in failed if r in rec.finished] if interrupted else failed_ranks(rec))
            waiting = {r: w for r, w in waiting.items() if r not in rec.finished}
            if (not waiting or not failed or rec.all_done or (rec.interrupted and not interrupted) or state.stopping
                    or rec.collective_released):  # released already (by the grace, or by ``watch``)
                return
            if interrupted:  # stopped by the interrupt (or raised after it), or ended the cell before it
                stopped = [r for r in failed if getattr(rec.errors.get(r), "interrupted", False)]
                raised = [r for r in failed if r in rec.errors and r not in stopped]
                ended = [r for r in failed if r not in rec.errors]
                did = " and ".join(
                    [*([f"{ranks_text(stopped)} {plural(stopped, 'were', 'was')} interrupted"] if stopped else []),
                     *([f"{ranks_text(raised)} raised {getattr(rec.errors[raised[0]], 'ename', 'an error')}"]
                       if raised else []),
                     *([f"{ranks_text(ended)} had ended the cell"] if ended else [])])
            else:
                did = f"{ranks_text(failed)} raised {getattr(rec.errors[failed[0]], 'ename', 'an error')}"
            reason = (f"{did} while {ranks_text(sorted(waiting))} waited for "
                      f"{plural(failed, 'them', 'it') if interrupted else 'it'} in a collective")
            self.cells.mark_released(rec, reason, waiting)
            self._forget(rec)
            group = state.peers(rec.ranks)  # the cell's process group (split: its sub-mesh's)
            state.mark_down(group, reason)
            state.unrenewed.update(group)  # made again by renew_group, or before the next cell
            for other in state.cells.values():  # cells of the group's other ranks (--async ones) lose it too
                if other is not rec and not other.all_done and not set(other.ranks).isdisjoint(group):
                    other.torn_down = reason
            alive = [info.rank for info in state.ranks.values() if info.identity is not None and info.alive
                     and info.rank in group]
        for r in alive:
            self.dispatcher.post(r, P.Abort(reason=reason))
        log.info("cell %d: %s: process group torn down to release them", rec.cell_id, reason)

    def fold_released(self, rec: CellRecord, errors: dict[int, Any]) -> dict[int, Any]:
        """After ``release``: the ranks that raised first (the root cause), then the released ranks' errors (their
        collective failed as the group was torn down) as RankAbortedError."""
        if not rec.released:
            return errors
        failed = [r for r in errors if r not in rec.released and isinstance(errors[r], RemoteError)]
        raised = getattr(errors[failed[0]], "ename", "an error") if failed else "an error"
        out = {r: errors[r] for r in failed}
        for r, e in errors.items():
            if r in out:
                continue
            if r in rec.released and isinstance(e, RemoteError) and not isinstance(e, RankAbortedError):
                e = RankAbortedError(r, failed, e, raised=raised, collective=rec.released[r])
            out[r] = e
        return out

    def renew_group(self, rec: CellRecord) -> None:
        """After ``release``'s cell ended, a fresh process group for every rank (as
        ``%mesh interrupt --force`` makes one), and the hint for the cell's error (``rec.collective_hint``)."""
        self.state.assert_unlocked()
        them = plural(rec.released, "them", "it")
        with self.state.lock:  # split: only the cell's sub-mesh regroups, the others run on
            only = self.state.peers(rec.ranks) if self.state.partition else None
        dead = [r for r in self.state.dead() if only is None or r in only]
        if dead:  # a rank of its process group died meanwhile: no group can be made without it (its restart makes one)
            hint = (f"{rec.collective_released}: the process group was torn down to release {them}; no fresh one "
                    f"was made, since {ranks_text(dead)} {plural(dead, 'are', 'is')} dead")
        else:
            try:
                self.regroup([], time.monotonic() + self.state.options.start_timeout, only)
                hint = (f"{rec.collective_released}: the process group was torn down to release {them} and a fresh "
                        "one was made (every rank kept its namespace; groups made with dist.new_group, and DDP "
                        "models, must be made again)")
            except MonarchError as e:
                hint = (f"{rec.collective_released}: the process group was torn down to release {them}, and a "
                        f"fresh one could not be made ({e}); %mesh restart  starts a fresh mesh")
        with self.state.lock:
            self.cells.set_hint(rec, hint)

    def hint_pending(self, rec: CellRecord) -> None:
        """Under the lock: after ``release``, while a rank of ``rec`` still ran it: its error's hint says when the
        fresh process group comes (``Restarts.renew``: before the next cell, once every rank of it stopped)."""
        state = self.state
        state.assert_locked()
        dead = [r for r in state.peers(rec.ranks) if state.ranks[r].state is RankState.DEAD]
        torn = f"{rec.collective_released}: the process group was torn down to release " + plural(
            rec.released, "them", "it")
        self.cells.set_hint(rec, f"{torn}; no fresh one is made while {ranks_text(dead)} "
                                 f"{plural(dead, 'are', 'is')} dead ({restart_hint(dead, state.nproc)})" if dead
                            else f"{torn}; a fresh one is made before the next cell, once every rank stopped "
                                 "(every rank keeps its namespace)")

    # ------------------------------------------------------------------ after the interrupt's grace

    def watch(self, rec: CellRecord) -> None:
        """After an interrupt's grace (waiting.py): ``rec`` was abandoned with ranks still running it. Go on asking,
        on a thread of its own (``monarch-release-ID``), whether ranks that still run it wait in a collective for
        ranks that stopped it since (``stopped``: a ``finally`` clause longer than the grace), and release them as
        the grace would have (``release``); their group is made again before the next cell (``Restarts.renew``).
        Asked as soon as a rank stops it, then every ``COLLECTIVE_CHECK`` s, doubling up to ``WATCH_CHECK_MAX`` s
        while no rank stops. The thread ends with the cell (every rank stopped it or died), a release, or the
        mesh's generation (``close`` waits for it)."""
        state = self.state
        with state.lock:
            if rec.cell_id in self._watched or rec.all_done or rec.collective_released or not state.running:
                return
            thread = threading.Thread(target=self._watch, args=(rec, state.generation),
                                      name=f"monarch-release-{rec.cell_id}", daemon=True)
            self._watched[rec.cell_id] = thread
        thread.start()

    def _watch(self, rec: CellRecord, generation: int) -> None:
        state = self.state
        seen, interval, due = 0, COLLECTIVE_CHECK, 0.0
        try:
            while True:
                with state.lock:
                    if (rec.all_done or rec.collective_released or not state.running or state.stopping
                            or state.generation != generation):
                        if rec.collective_released and not rec.collective_hint:
                            self.hint_pending(rec)  # for a handle's result() (block=False)
                        return
                    stopped = self.stopped(rec)
                    running = [r for r in rec.ranks if r not in rec.finished and r not in rec.queued_on
                               and (info := state.ranks.get(r)) is not None and info.state is not RankState.DEAD]
                    now = time.monotonic()
                    if len(stopped) > seen:  # a rank stopped it since the last look: ask at once
                        seen, interval, due = len(stopped), COLLECTIVE_CHECK, now
                    if not (stopped and running) or now < due:
                        state.cond.wait(min(COLLECTIVE_CHECK, due - now) if now < due else COLLECTIVE_CHECK)
                        continue
                self.release(rec, stopped, running, interrupted=True)
                due, interval = time.monotonic() + interval, min(2 * interval, WATCH_CHECK_MAX)
        except Exception:  # noqa: BLE001 - a watch that fails leaves the cell as the grace did (RankBusyError)
            log.exception("cell %d: watching the ranks that still run it failed", rec.cell_id)
        finally:
            with state.lock:
                self._watched.pop(rec.cell_id, None)
                self._forget(rec)

    def close(self, timeout: float = 2.0) -> None:
        """The mesh stopped: wait up to ``timeout`` s for the threads of ``watch`` to end (each sees the stop at its
        next look, within ``release``'s question of 1 s at most)."""
        self.state.assert_unlocked()
        with self.state.lock:
            threads = list(self._watched.values())
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread.ident is not None and thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
