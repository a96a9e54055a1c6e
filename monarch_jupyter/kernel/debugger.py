"""``mesh.debugger``: the user's one object for debugging ranks, over the parts that do it.

- pdb prompts of ranks stopped at ``breakpoint()``, served in the cell that waits (prompts.PromptServer): its
  settings (``on_interrupt``, ``input``, ``step_grace``, ``first_stop_settle``), ``options`` for scripted answers,
  ``attach`` for cells nobody waits for, ``stopped``;
- post-mortem at the failing frame of a rank's last failed cell (postmortem.PostMortem);
- ``inspect`` and ``clear``, answered off a rank's busy main thread (postmortem.Inspector).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

from .postmortem import Inspection, Inspector, NothingToDebugError, PostMortem
from .prompts import MESH_HELP, PromptServer, split_commands

__all__ = ["MeshDebugger", "Inspection", "NothingToDebugError", "split_commands", "MESH_HELP"]


class MeshDebugger:
    """Debugging of one mesh's ranks from the notebook; ``mesh.debugger`` (see the module docstring).

    Attributes (those of its prompt server)
    ----------
    on_interrupt:
        "continue" (default) or "raise": what stopped ranks do when the notebook is interrupted at a prompt.
    input:
        ``callable(prompt) -> str`` that asks a person for a line; None (default) uses ``input()``.
    step_grace, first_stop_settle:
        Seconds; see prompts.PromptServer.
    """

    def __init__(self, prompts: PromptServer, post_mortem: PostMortem, inspector: Inspector) -> None:
        self.prompts = prompts
        self._pm = post_mortem
        self._inspector = inspector

    @property
    def on_interrupt(self) -> str:
        return self.prompts.on_interrupt

    @on_interrupt.setter
    def on_interrupt(self, value: str) -> None:
        self.prompts.on_interrupt = value

    @property
    def input(self) -> Callable[[str], str] | None:
        return self.prompts.input

    @input.setter
    def input(self, value: Callable[[str], str] | None) -> None:
        self.prompts.input = value

    @property
    def step_grace(self) -> float:
        return self.prompts.step_grace

    @step_grace.setter
    def step_grace(self, value: float) -> None:
        self.prompts.step_grace = value

    @property
    def first_stop_settle(self) -> float:
        return self.prompts.first_stop_settle

    @first_stop_settle.setter
    def first_stop_settle(self, value: float) -> None:
        self.prompts.first_stop_settle = value

    def options(self, commands: str | Iterable[str] | None = None,
                on_interrupt: str | None = None) -> contextlib.AbstractContextManager[Any]:
        """Settings for the cells waited for inside the ``with`` block; see ``PromptServer.options``.

        Raises ValueError when ``on_interrupt`` is not "continue" or "raise"."""
        return self.prompts.options(commands, on_interrupt)

    def attach(self) -> bool:
        """Talk to ranks stopped in cells nobody waits for (``block=False``); False when none is stopped."""
        return self.prompts.attach()

    def stopped(self) -> dict[int, str]:
        """Rank -> where it is stopped at a pdb prompt."""
        return self.prompts.stopped()

    def last_failed_rank(self) -> int | None:
        """The rank whose error came first in the most recent failed cell (None: no rank keeps one)."""
        return self._inspector.last_failed_rank()

    def post_mortem(self, rank: int | None = None, commands: str | Iterable[str] | None = None,
                    timeout: float | None = None) -> None:
        """Open pdb at the failing frame of ``rank``'s last failed cell; see ``PostMortem.post_mortem`` (it raises
        NothingToDebugError, MonarchError, ValueError)."""
        self._pm.post_mortem(rank, commands, timeout)

    def post_mortem_in_sidebar(self, rank: int | None, connect: Callable[[int, int], None],
                               timeout: float | None = None) -> int:
        """Stop ``rank`` at the failing frame of its last failed cell in the visual debugger; see
        ``PostMortem.in_sidebar`` (it raises as ``post_mortem`` does)."""
        return self._pm.in_sidebar(rank, connect, timeout)

    def inspect(self, expr: str, rank: int, *, frame: bool = False, timeout: float = 10.0) -> Inspection:
        """Evaluate ``expr`` on ``rank`` beside its busy main thread; see ``Inspector.inspect``."""
        return self._inspector.inspect(expr, rank, frame=frame, timeout=timeout)

    def clear(self, ranks: str | int | Iterable[int] | None = None, timeout: float = 5.0) -> list[int]:
        """Drop the tracebacks ranks keep for post-mortem; see ``Inspector.clear``."""
        return self._inspector.clear(ranks, timeout)

    def on_message(self, rank: int, msg: Any, payload: bytes, bufs: list) -> None:
        """A rank's debug message (the prompt server's)."""
        self.prompts.on_message(rank, msg, payload, bufs)

