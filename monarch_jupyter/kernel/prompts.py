"""The notebook's side of ranks' pdb: ``PromptServer`` serves their prompts in the cell that waits.

When ``breakpoint()`` (or ``pdb.set_trace()``) stops a rank, the rank's pdb (``monarch_worker.debugger``) sends its
output and a ``DebugPrompt``. The thread that waits for the cell (the kernel's main thread in a notebook;
``waiting.Waiter``) notices stopped ranks and calls ``PromptServer.serve``, which asks for lines with ``input()``
(ipykernel turns that into an ``input_request`` on the stdin channel), labelled ``(Pdb rank 2)``, and sends them to
that rank. Lines that are mesh commands (``ranks``, ``rank K``, ``cast SPEC CMD``, ``c all``, ``detach``,
``help mesh``) act on the mesh instead. Ranks that are not stopped keep running meanwhile.

Without a person at the keyboard, prompts are answered from a scripted list (``options(commands=...)``, or
``%%mesh --pdb-commands``); a prompt that finds no answer left, or no stdin to ask (``StdinNotImplementedError``,
``EOFError``, a script without a terminal), lets the rank continue, with a note in the cell.

An interrupt while a rank waits at a prompt lets the stopped ranks continue (``on_interrupt = "continue"``: the
cell then runs to its end, later breakpoints are skipped) or raise KeyboardInterrupt where they stopped
(``"raise"``: the cell is interrupted on every rank as usual).

Threads: ``on_message`` runs on the mesh's I/O thread (or the output reader, for prompts sent as records) and only
records state, under the mesh lock; everything else runs in the thread that waits for the cell. Post-mortem and
inspection (postmortem.py) and the user's ``mesh.debugger`` (debugger.py) build on it.
"""

from __future__ import annotations

import builtins
import contextlib
import linecache
import logging
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from monarch_worker import protocol as P

from ..ranks import format_ranks, parse_ranks, plural, ranks_text
from .cells import CellTable
from .dispatch import Dispatcher
from .output import OutputWriter, label, write_lines
from .records import CellRecord
from .state import MeshState

log = logging.getLogger(__name__)

__all__ = ["PromptServer", "split_commands", "MESH_HELP"]

STEP_GRACE = 1.0  # seconds: after n/s/r/unt, how long the rank we talk to may take to stop again before
#                   another stopped rank is offered
FIRST_STOP_SETTLE = 0.25  # seconds the first stop of a cell waits for the cell's other ranks to stop too
POLL = 0.05  # seconds between checks while waiting for a rank's answer

MESH_HELP = """\
Mesh commands (at any (Pdb rank N) prompt; other lines go to that rank's pdb):
  ranks              list the stopped ranks, where each one is, and the ranks still running
  rank K             talk to stopped rank K from now on
  cast SPEC CMD      send the pdb command CMD to the stopped ranks in SPEC (0-3, 1,3, all) and show each answer
  c all              let every stopped rank go on (they stop again at their next breakpoint)
  detach             let every stopped rank go on and skip the breakpoints of the rest of this cell
  help mesh          this text (help alone adds pdb's own commands)
c lets the rank you talk to go on; the next stopped rank is offered after it. q raises BdbQuit on that rank.
Mesh commands win over Python names: use  p ranks  or  !detach = 1  for variables with those names.
"""

_PDB_PROMPT = re.compile(r"^(\(+)Pdb(\)+)(\s*)$")


def split_commands(commands: str | Iterable[str] | None) -> list[str] | None:
    """``"p x; up; p y"`` -> ``["p x", "up", "p y"]``: split at ``;`` outside quotes and brackets.

    A list (or other iterable) of lines is taken as it is; None stays None.
    """
    if commands is None:
        return None
    if not isinstance(commands, str):
        return [str(c) for c in commands]
    parts: list[str] = []
    cur: list[str] = []
    depth, quote = 0, ""
    for ch in commands:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == ";" and depth <= 0:
            parts.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur).strip())
    return [p for p in parts if p]


@dataclass
class _Stop:
    """What the controller knows of one rank's pdb (guarded by the mesh lock)."""

    rank: int
    state: str = "running"  # "prompt": waits for a line; "busy": a line was sent; "running": not in pdb
    prompt_id: int = 0
    prompt: str = ""
    kind: str = "pdb"
    cell_id: int = -1
    filename: str = ""
    lineno: int = 0
    function: str = ""
    how: str = ""  # how it last resumed (continue, step, quit, raise)
    resumed_at: float = 0.0
    output: list[str] = field(default_factory=list)  # pdb text not shown yet

    @property
    def where(self) -> str:
        return f"{self.filename} line {self.lineno}, in {self.function}"


class PromptServer:
    """The pdb prompts of one mesh's ranks, served from the thread that waits for their cell.

    Attributes
    ----------
    on_interrupt:
        "continue" (default) or "raise": what stopped ranks do when the notebook is interrupted at a prompt.
    input:
        ``callable(prompt) -> str`` that asks a person for a line; None (default) uses ``input()`` where it can
        reach one (a kernel with stdin, or a terminal). It may raise EOFError to say nobody answers.
    step_grace:
        Seconds a stepped rank (n, s, r, unt) may take to stop again before another stopped rank is offered.
    first_stop_settle:
        Seconds the first stop of a cell waits for the cell's other ranks to stop (or finish) too, so that the
        lowest stopped rank is offered first.
    """

    def __init__(self, state: MeshState, dispatcher: Dispatcher, cells: CellTable, writer: OutputWriter) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self.cells = cells
        self.writer = writer
        self.on_interrupt = "continue"
        self.input: Callable[[str], str] | None = None
        self.step_grace = STEP_GRACE
        self.first_stop_settle = FIRST_STOP_SETTLE
        self._stops: dict[int, _Stop] = {}
        self._current: int | None = None
        self._script: list[str] | None = None
        self._detached: set[Any] = set()  # cells whose breakpoints are skipped now
        self._no_stdin: set[Any] = set()  # cells where input() said nobody can answer
        self._greeted: set[Any] = set()
        self._generation = -1  # the mesh generation the stops belong to
        self._sessions: set[int] = set()  # cells that are post-mortem sessions (postmortem.py)

    def post_mortem_session(self, cell_id: int) -> None:
        """Cell ``cell_id`` is a post-mortem session: its stop is greeted as one."""
        self._sessions.add(cell_id)

    # ------------------------------------------------------------------ settings for the cells run inside

    @contextlib.contextmanager
    def options(self, commands: str | Iterable[str] | None = None,
                on_interrupt: str | None = None) -> Iterator[PromptServer]:
        """Settings for the cells waited for inside the ``with`` block.

        Parameters
        ----------
        commands:
            pdb lines answering the first prompts (``"p x; c"`` or a list); once they are used up, a stopped
            rank continues. None: ask a person.
        on_interrupt:
            "continue" or "raise" (see the class docstring); None keeps ``self.on_interrupt``.

        Raises
        ------
        ValueError
            ``on_interrupt`` is not "continue" or "raise".
        """
        if on_interrupt is not None and on_interrupt not in ("continue", "raise"):
            raise ValueError(f"on_interrupt must be 'continue' or 'raise', got {on_interrupt!r}")
        saved = self._script, self.on_interrupt
        self._script = split_commands(commands)
        if on_interrupt is not None:
            self.on_interrupt = on_interrupt
        try:
            yield self
        finally:
            if self._script:
                self._write(f"note: scripted pdb command(s) not used (no prompt asked for them): "
                            f"{'; '.join(self._script)}\n")
            self._script, self.on_interrupt = saved

    # ------------------------------------------------------------------ I/O thread

    def on_message(self, rank: int, msg: P.Message, payload: bytes, bufs: list) -> None:
        """Record a rank's debug message (mesh I/O thread) and wake whoever waits for its cell."""
        state = self.state
        with state.lock:
            self._forget_old_generation()
            stop = self._stops.setdefault(rank, _Stop(rank))
            if isinstance(msg, P.DebugOutput):
                stop.output.append(msg.text)
            elif isinstance(msg, P.DebugPrompt):
                stop.state, stop.prompt_id, stop.prompt, stop.kind = "prompt", msg.prompt_id, msg.prompt, msg.kind
                stop.cell_id, stop.filename, stop.lineno, stop.function = (msg.cell_id, msg.filename, msg.lineno,
                                                                          msg.function)
            elif isinstance(msg, P.DebugResumed):
                stop.state, stop.how, stop.resumed_at = "running", msg.how, time.monotonic()
            rec = state.cells.get(stop.cell_id)
            if rec is not None:
                self.cells.wake_all(rec)
            state.cond.notify_all()
        # The live view shows a rank stopped at a prompt ("breakpoint") and when it goes on ("running").
        if isinstance(msg, P.DebugPrompt):
            state.events.emit("rank_state", rank=rank, state="breakpoint", cell_id=msg.cell_id)
        elif isinstance(msg, P.DebugResumed):
            state.events.emit("rank_state", rank=rank, state="running", cell_id=stop.cell_id)

    def _forget_old_generation(self) -> None:
        """A restarted mesh (a new generation) has no stopped ranks; a dead or stopped rank is no
        longer stopped at a prompt."""
        self.state.assert_locked()
        if self._generation != self.state.generation:
            self._generation = self.state.generation
            self._stops.clear()
            self._current = None
        for r in [r for r in self._stops if r in self.state.ranks and not self.state.ranks[r].alive]:
            del self._stops[r]

    # ------------------------------------------------------------------ the conversation (waiting thread)

    def has_prompt(self, cell: CellRecord) -> bool:
        """True when a rank of ``cell`` waits at a pdb prompt (cheap; called by waiting.Waiter)."""
        stops = list(self._stops.values())
        return any(s.state == "prompt" and s.cell_id == cell.cell_id for s in stops)

    def serve(self, cell: CellRecord) -> float:
        """Talk to the stopped ranks of ``cell`` until none waits at a prompt; returns the seconds it took (the
        cell's timeout does not count them).

        Raises
        ------
        KeyboardInterrupt
            Interrupted with ``on_interrupt == "raise"`` (the stopped ranks raise it too).
        """
        t0 = time.monotonic()
        self._converse(cell.cell_id, cell)
        return time.monotonic() - t0

    def attach(self) -> bool:
        """Talk to ranks stopped in cells nobody waits for (``block=False``); False when none is stopped."""
        with self.state.lock:
            self._forget_old_generation()
            if not any(s.state == "prompt" for s in self._stops.values()):
                return False
        self._converse(None, None)
        return True

    def stopped(self) -> dict[int, str]:
        """rank -> where it waits at a pdb prompt ("<mesh In[3]> line 4, in <module>")."""
        with self.state.lock:
            return {r: s.where for r, s in sorted(self._stops.items()) if s.state in ("prompt", "busy")}

    def _matches(self, key: int | None, stop: _Stop) -> bool:
        return key is None or stop.cell_id == key

    def _converse(self, key: int | None, cell: CellRecord | None) -> None:
        try:
            if key not in self._greeted and cell is not None:
                self._settle(cell)
            while True:
                self._pump(cell)
                with self.state.lock:
                    self._forget_old_generation()
                    at_prompt = sorted(r for r, s in self._stops.items()
                                       if s.state == "prompt" and self._matches(key, s))
                    current = self._stops.get(self._current) if self._current is not None else None
                    stepping = (current is not None and self._matches(key, current) and current.state != "prompt"
                                and (current.state == "busy" or (current.how == "step" and time.monotonic()
                                                                 - current.resumed_at < self.step_grace)))
                    if not at_prompt or stepping:
                        if at_prompt and stepping:  # let the stepped rank stop again before offering another
                            self.state.cond.wait(POLL)
                            continue
                        return
                    r = self._current if self._current in at_prompt and key in self._greeted else at_prompt[0]
                    stop = self._stops[r]
                if self._skip(key, stop):
                    continue
                if r != self._current or key not in self._greeted:
                    self._greet(key, r, at_prompt)
                self._show(r)
                line = self._read(key, cell, self._label(stop))
                if line is None:
                    self._send_action(r, "continue")
                    continue
                self._handle(key, cell, r, line)
        except KeyboardInterrupt:
            self._interrupted(key)

    def _settle(self, cell: CellRecord) -> None:
        """The first stop in a cell: give the cell's other ranks ``first_stop_settle`` s to reach the same
        breakpoint, so that the lowest stopped rank is offered first, as it would be if they all arrived at once."""
        deadline = time.monotonic() + self.first_stop_settle
        while time.monotonic() < deadline:
            self._pump(cell)
            with self.state.lock:
                if all(r in cell.finished or ((s := self._stops.get(r)) is not None and s.state == "prompt"
                                              and s.cell_id == cell.cell_id) for r in cell.ranks):
                    return
                self.state.cond.wait(POLL)

    def _skip(self, key: int | None, stop: _Stop) -> bool:
        """Continue ``stop`` at once when nobody answers prompts here (detached, or no stdin); its pdb text is
        replaced by one line saying where it was."""
        why = ""
        if key in self._detached:
            why = "the debugger is detached for this cell"
        elif key in self._no_stdin:
            why = "nobody can answer its prompt here (no stdin)"
        if not why:
            return False
        self._discard_output(stop.rank)
        self._write(f"{label(stop.rank)} stopped at {stop.where}; it continues: {why}\n")
        self._send_action(stop.rank, "continue")
        return True

    def _greet(self, key: int | None, r: int, at_prompt: list[int]) -> None:
        self._current = r
        others = [o for o in at_prompt if o != r]
        stop = self._stops[r]
        also = f"; also stopped: {ranks_text(others)}" if others else ""
        hint = "" if key in self._greeted else " (help mesh: commands for the mesh)"
        self._greeted.add(key)
        if stop.cell_id in self._sessions:
            head = f"post-mortem of rank {r} at {stop.where}"
        else:
            head = f"rank {r} stopped at {stop.where}"
        self._write(f"--- {head}{also}{hint}\n")

    def _label(self, stop: _Stop) -> str:
        m = _PDB_PROMPT.match(stop.prompt)
        if m:
            return f"{m.group(1)}Pdb rank {stop.rank}{m.group(2)}{m.group(3) or ' '}"
        return f"{label(stop.rank)} {stop.prompt}"

    def _read(self, key: int | None, cell: CellRecord | None, prompt: str) -> str | None:
        """One line for ``prompt``: the next scripted command, or a person's answer. None: nobody answers."""
        if self._script is not None:
            if self._script:
                line = self._script.pop(0)
                self._write(f"{prompt}{line}\n")
                return line
            self._write(f"{prompt}(no scripted pdb command left: continue)\n")
            return None
        ask = self.input or _default_input()
        if ask is not None:
            try:
                with self._live_output(cell):
                    return ask(prompt)
            except EOFError:
                pass
            except Exception as e:  # noqa: BLE001 - StdinNotImplementedError (frontend without stdin)
                if type(e).__name__ != "StdinNotImplementedError":
                    raise
        self._no_stdin.add(key)
        self._write("no one can answer pdb prompts here (this frontend has no stdin), so the stopped ranks "
                    "continue; script the debugger instead:  %%mesh --pdb-commands \"p x; c\"\n")
        return None

    def _handle(self, key: int | None, cell: CellRecord | None, r: int, line: str) -> None:
        cmd = line.strip()
        if cmd == "ranks":
            self._write(self._ranks_text(key, cell))
        elif m := re.fullmatch(r"rank\s+(\d+)", cmd):
            self._switch(key, int(m.group(1)))
        elif m := re.fullmatch(r"cast\s+(\S+)\s+(.+)", cmd):
            self._cast(key, cell, m.group(1), m.group(2))
        elif re.fullmatch(r"(c|cont|continue)\s+all", cmd):
            done = self._continue_all(key)
            self._write(f"{ranks_text(done)} continue\n")
        elif cmd == "detach":
            done = self._continue_all(key)
            self._detached.add(key)
            self._write(f"detached: {ranks_text(done) if done else 'no rank'} continue; the breakpoints of the rest "
                        "of this cell are skipped\n")
        elif re.fullmatch(r"(h|help)\s+mesh", cmd):
            self._write(MESH_HELP)
        else:
            if cmd in ("h", "help"):
                self._write(MESH_HELP + "\npdb's commands:\n")
            self._forward(cell, r, line)

    def _forward(self, cell: CellRecord | None, r: int, line: str) -> None:
        if self._send_line(r, line):
            self._await([r], cell, stream=r)
            self._show(r)

    def _cast(self, key: int | None, cell: CellRecord | None, spec: str, command: str) -> None:
        try:
            targets = parse_ranks(spec, self.state.nproc)
        except ValueError as e:
            self._write(f"cast: {e}\n")
            return
        with self.state.lock:
            ready = [t for t in targets if (s := self._stops.get(t)) is not None and s.state == "prompt"
                     and self._matches(key, s)]
        skipped = [t for t in targets if t not in ready]
        if skipped:
            self._write(f"cast: {ranks_text(skipped)} not stopped at a prompt; skipped\n")
        sent = [t for t in ready if self._send_line(t, command)]
        self._await(sent, cell, stream=None)
        for t in sent:
            text = self._take_output(t)
            if text:  # each rank's answer is part of the conversation: written with it (not into the cell's view)
                self._write("".join(f"{label(t)} {ln}\n" for ln in text.rstrip("\n").split("\n")))

    def _continue_all(self, key: int | None) -> list[int]:
        with self.state.lock:
            ready = sorted(r for r, s in self._stops.items() if s.state == "prompt" and self._matches(key, s))
        for r in ready:
            self._discard_output(r)
            self._send_action(r, "continue")
        return ready

    def _switch(self, key: int | None, k: int) -> None:
        with self.state.lock:
            stop = self._stops.get(k)
            ok = stop is not None and stop.state == "prompt" and self._matches(key, stop)
            at_prompt = sorted(r for r, s in self._stops.items() if s.state == "prompt" and self._matches(key, s))
        if not ok:
            self._write(f"rank {k} is not stopped at a prompt (stopped: {format_ranks(at_prompt) or 'none'})\n")
            return
        self._greet(key, k, at_prompt)

    def _ranks_text(self, key: int | None, cell: CellRecord | None) -> str:
        with self.state.lock:
            stops = {r: s for r, s in self._stops.items() if s.state in ("prompt", "busy") and self._matches(key, s)}
            ranks = cell.ranks if cell is not None else sorted(self.state.ranks)
        out = []
        for r, s in sorted(stops.items()):
            src = linecache.getline(s.filename, s.lineno).strip()
            mark = "*" if r == self._current else " "
            out.append(f"{mark} rank {r}: stopped at {s.where}" + (f": {src}" if src else ""))
        running = [r for r in ranks if r not in stops]
        if running:
            out.append(f"  {ranks_text(running)}: not stopped")
        return "\n".join(out) + "\n"

    def _interrupted(self, key: int | None) -> None:
        """KeyboardInterrupt while talking to ranks: apply ``on_interrupt`` to the ranks stopped in pdb."""
        with self.state.lock:
            mine = sorted(r for r, s in self._stops.items() if s.state in ("prompt", "busy") and self._matches(key, s))
            ready = [r for r in mine if self._stops[r].state == "prompt"]
        if self.on_interrupt == "raise":
            for r in ready:
                self._send_action(r, "raise")
            verb = plural(mine or [0], "raise KeyboardInterrupt where they", "raises KeyboardInterrupt where it")
            self._write(f"\ninterrupted at the debugger prompt: {ranks_text(mine) if mine else 'no rank'} {verb} "
                        "stopped\n")
            raise KeyboardInterrupt("interrupted at the debugger prompt")
        for r in ready:
            self._send_action(r, "continue")
        self._detached.add(key)
        self._write(f"\ninterrupted at the debugger prompt: {ranks_text(mine) if mine else 'no rank'} "
                    f"{plural(mine or [0], 'continue', 'continues')} and the breakpoints of the rest of this cell are "
                    "skipped (interrupt again to stop the cell)\n")

    # ------------------------------------------------------------------ plumbing

    def _send_line(self, r: int, line: str) -> bool:
        with self.state.lock:
            stop = self._stops.get(r)
            gone = stop is None or stop.state != "prompt"
            if stop is not None and not gone:
                stop.state = "busy"
                self._post(r, P.DebugInput(stop.prompt_id, line=line))
        if gone:
            self._write(f"rank {r} is not at its prompt any more\n")
        return not gone

    def _send_action(self, r: int, action: str) -> None:
        with self.state.lock:
            stop = self._stops.get(r)
            if stop is None or stop.state != "prompt":
                return
            stop.state = "busy"
            self._post(r, P.DebugInput(stop.prompt_id, action=action))

    def _post(self, r: int, msg: P.Message) -> None:
        if r in self.state.ranks:
            self.dispatcher.post(r, msg)

    def _await(self, ranks: list[int], cell: CellRecord | None, stream: int | None) -> None:
        """Wait until each rank of ``ranks`` answered (a new prompt, or it resumed, or died); stream the output
        of rank ``stream`` as it comes."""
        while True:
            self._pump(cell)
            if stream is not None:
                self._show(stream)
            with self.state.lock:
                busy = [r for r in ranks if (s := self._stops.get(r)) is not None and s.state == "busy"]
                for r in list(busy):
                    info = self.state.ranks.get(r)
                    if info is None or not info.alive:
                        self._stops[r].state = "running"
                        busy.remove(r)
                if not busy:
                    return
                self.state.cond.wait(POLL)

    def _pump(self, cell: CellRecord | None) -> None:
        """Write the cell's ordinary output lines that arrived meanwhile."""
        if cell is None:
            return
        with self.state.lock:
            lines = self.cells.pop_lines(cell)
        write_lines(lines)

    @contextlib.contextmanager
    def _live_output(self, cell: CellRecord | None) -> Iterator[None]:
        """While this thread waits for a person, the I/O thread writes the cell's other output (as it does for
        cells nobody waits for), so ranks that were not stopped are seen going on."""
        if cell is None:
            yield
            return
        with self.state.lock:
            self.cells.set_waiting(cell, False)
        try:
            yield
        finally:
            with self.state.lock:
                self.cells.set_waiting(cell, True)
            self.writer.flush()  # what the writer took meanwhile comes out before this thread writes again

    def _take_output(self, r: int) -> str:
        with self.state.lock:
            stop = self._stops.get(r)
            if stop is None:
                return ""
            text, stop.output = "".join(stop.output), []
        return text

    def _discard_output(self, r: int) -> None:
        self._take_output(r)

    def _show(self, r: int) -> None:
        text = self._take_output(r)
        if text:
            self._write(text)

    @staticmethod
    def _write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()


def _default_input() -> Callable[[str], str] | None:
    """``input`` when a person can answer it: in a kernel (which replaces it), or at a terminal."""
    ask = builtins.input
    if getattr(ask, "__module__", None) != "builtins":
        return ask  # ipykernel's raw_input (or its StdinNotImplementedError stand-in)
    try:
        return ask if sys.stdin is not None and sys.stdin.isatty() else None
    except (AttributeError, ValueError):
        return None
