"""What the notebook sent to the ranks, kept to be sent again to a replacement: ``History``.

With ``on_rank_death="restart"`` a rank that dies is started again (healing.py), as a fresh process with an empty
namespace. What it had from the notebook is sent again, in the order it was first sent:

- values pushed or scattered to it (``mesh.push``, ``%mesh push``, ``scatter``: its own part), the last value of
  each name;
- the notebook's functions and classes that cells used (sent with the cells, compiling.notebook_refs), the last
  definition of each name;
- the cells marked replayable (``%%mesh --replay``, ``mesh.run(code, replay=True)``), which define its namespace
  (imports, the model, the data);
- then the ``mesh.on_rejoin(fn)`` hooks: ``fn()`` runs on the replacement.

The history holds references to the values (they stay in the kernel's memory), and is kept only while the option
is "restart" (from the moment it is set), for the current generation (a full restart forgets it).

Threads: written by the caller's thread (cells, transfers), read by the healer's; one small lock of its own.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .state import MeshState

__all__ = ["History", "Replay"]


@dataclass
class Replay:
    """One thing to send again: ``kind`` "push" (``values``, ``device``), "cell" (``code``, ``filename``,
    ``sources``, ``refs``: notebook functions it needs; code "" for the functions alone) or "hook" (``fn``)."""

    kind: str
    seq: int
    values: dict[str, Any] = field(default_factory=dict)
    device: str | None = None
    code: str = ""
    filename: str = ""
    sources: dict = field(default_factory=dict)
    refs: dict[str, Any] = field(default_factory=dict)
    fn: Callable[[], Any] | None = None

    @property
    def what(self) -> str:
        """How messages name it."""
        if self.kind == "push":
            return "the push of " + ", ".join(sorted(self.values))
        if self.kind == "hook":
            return f"the on_rejoin hook {getattr(self.fn, '__qualname__', self.fn)!s}"
        return f"the replay of {self.filename}" if self.code else "the notebook's " + ", ".join(sorted(self.refs))


EVERY = -1  #: the rank key of values pushed to every rank (a rank a resize adds gets them too)


class History:
    """What the notebook sent, per rank, to send again to its replacement (see the module docstring)."""

    def __init__(self, state: MeshState) -> None:
        self.state = state
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._generation = -1
        self._pushes: dict[tuple[int, str], tuple[int, Any, str | None]] = {}  # (rank, name) -> (seq, value, device)
        self._refs: dict[str, tuple[int, Any, dict]] = {}  # name -> (seq, object, its sources)
        # seq, ranks (None: every rank, also ranks a resize adds), code, filename, sources, refs
        self._cells: list[tuple[int, list[int] | None, str, str, dict, dict]] = []
        self.hooks: list[Callable[[], Any]] = []

    @property
    def keeping(self) -> bool:
        """The mesh restarts dead ranks, so what is sent is kept."""
        return self.state.options.on_rank_death == "restart"

    def _fresh(self) -> None:
        """With ``_lock`` held: forget what an earlier generation was sent."""
        if self._generation != self.state.generation:
            self._generation = self.state.generation
            self._pushes, self._refs, self._cells = {}, {}, []

    def pushed(self, values: dict[str, Any], ranks: list[int], device: str | None) -> None:
        """``values`` were bound on ``ranks`` (a push, or one rank's part of a scatter); not the healer's own replay
        of them (which would move them after the cells that use them)."""
        if not self.keeping or self.state.healer is threading.current_thread():
            return
        with self._lock:
            self._fresh()
            seq = next(self._seq)
            everyone = set(ranks) >= set(range(self.state.nproc))
            for r in [*ranks, *([EVERY] if everyone else [])]:  # EVERY: also for ranks a resize adds later
                for name, value in values.items():
                    self._pushes[(r, name)] = (seq, value, device)

    def cell(self, code: str, filename: str, sources: dict, refs: dict[str, Any], ranks: Sequence[int],
             replay: bool) -> None:
        """A cell was sent to ``ranks`` with notebook functions and classes ``refs`` (their ``sources``); a
        ``replay`` cell is itself sent again."""
        if not self.keeping or not (replay or refs):
            return
        with self._lock:
            self._fresh()
            seq = next(self._seq)
            for name, obj in refs.items():
                self._refs[name] = (seq, obj, sources)
            if replay:
                everyone = set(ranks) >= set(range(self.state.nproc))
                self._cells.append((seq, None if everyone else list(ranks), code, filename, dict(sources),
                                    dict(refs)))

    def add_hook(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """``fn()`` runs on every replacement, after the rest (``mesh.on_rejoin``); returns ``fn``."""
        with self._lock:
            self.hooks.append(fn)
        return fn

    def plan(self, rank: int) -> list[Replay]:
        """What ``rank``'s replacement is sent, in order; consecutive pushes with the same device are one."""
        with self._lock:
            if self._generation != self.state.generation:
                items: list[Replay] = []
            else:
                items = [Replay("cell", seq, code=code, filename=filename, sources=sources, refs=refs)
                         for seq, ranks, code, filename, sources, refs in self._cells
                         if ranks is None or rank in ranks]
                replayed = {name for item in items for name in item.refs}
                for name, (seq, obj, sources) in self._refs.items():
                    if name not in replayed:
                        items.append(Replay("cell", seq, sources=sources, refs={name: obj}))
                newest: dict[str, tuple[int, Any, str | None]] = {}  # its own, or the newest sent to every rank
                for (r, name), entry in self._pushes.items():
                    if r in (rank, EVERY) and entry[0] >= newest.get(name, (-1, None, None))[0]:
                        newest[name] = entry
                for name, (seq, value, device) in newest.items():
                    items.append(Replay("push", seq, values={name: value}, device=device))
            hooks = list(self.hooks)
        items.sort(key=lambda item: item.seq)
        merged: list[Replay] = []
        for item in items:
            last = merged[-1] if merged else None
            if last is not None and last.kind == item.kind == "push" and last.device == item.device:
                last.values.update(item.values)
            elif last is not None and last.kind == item.kind == "cell" and not last.code and not item.code:
                last.refs.update(item.refs)
                last.sources = {**last.sources, **item.sources}
            else:
                merged.append(item)
        return merged + [Replay("hook", -1, fn=fn) for fn in hooks]

    def counts(self, plan: list[Replay]) -> str:
        """What ``plan`` sends, in words: "2 pushed values, 1 notebook function and 2 replayed cells"."""
        values = sum(len(item.values) for item in plan if item.kind == "push")
        refs = sum(len(item.refs) for item in plan if item.kind == "cell" and not item.code)
        cells = sum(1 for item in plan if item.kind == "cell" and item.code)
        hooks = sum(1 for item in plan if item.kind == "hook")
        parts = [f"{n} {word}{'' if n == 1 else 's'}" for n, word in ((values, "pushed value"),
                                                                      (refs, "notebook definition"),
                                                                      (cells, "replayed cell"),
                                                                      (hooks, "on_rejoin hook")) if n]
        return " and ".join([", ".join(parts[:-1]), parts[-1]]) if len(parts) > 1 else "".join(parts)
