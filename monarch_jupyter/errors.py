"""Errors raised in the notebook. One base class; errors are picklable and never matched by message text.

The shape follows ipyparallel.error (RemoteError, CompositeError) and torch.distributed.elastic's failure
records: a rank's exception (``RemoteError``) is a different thing from a rank's death (``RankDiedError``), and
many ranks' failures fold into one ``MeshError`` whose root cause is the first failure the controller saw.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any

from .ranks import RankMap, plural, ranks_text

__all__ = [
    "MonarchError",
    "MeshStartError",
    "MeshNotRunningError",
    "RemoteError",
    "RankDiedError",
    "RankAbortedError",
    "MeshError",
    "MeshTimeoutError",
    "TrialFailedError",
    "MeshInterrupt",
    "RankBusyError",
    "CellSyntaxError",
    "mesh_interrupt",
]


class MonarchError(Exception):
    """Base of every monarch_jupyter error.

    IPython shows these as their message only (``_render_traceback_``), not the controller's frames, which say
    nothing to a user; errors that carry ranks' tracebacks render those instead.
    """

    def _render_traceback_(self) -> list[str]:
        return f"{type(self).__name__}: {self}".splitlines()

    def report(self) -> str:
        """The whole report, as a notebook shows it (each rank's traceback, the hint): for a script or a log, where
        ``str()`` is its first line only."""
        return "\n".join(self._render_traceback_())


class CellSyntaxError(MonarchError):
    """A ``%%mesh`` cell does not compile; raised by the magic, before anything runs on the ranks.

    Not a SyntaxError subclass on purpose: IPython prints every SyntaxError with the frames it passed through,
    which here are the controller's. ``error`` is the original SyntaxError (``Mesh.run`` raises that one).
    """

    def __init__(self, error: SyntaxError) -> None:
        super().__init__(error)
        self.error = error
        line = (error.text or "").lstrip()
        self.hint = ("" if not line.startswith(("%", "!")) else
                     "IPython's magics and ! shell commands do not run on the ranks: a %%mesh cell is plain Python "
                     "(there, subprocess.run(...) runs a command, time.perf_counter() times code)")

    def __str__(self) -> str:
        return f"{self.error}\n{self.hint}" if self.hint else str(self.error)

    def _render_traceback_(self) -> list[str]:
        import traceback

        text = "".join(traceback.format_exception_only(type(self.error), self.error)).rstrip("\n").splitlines()
        return text + ([self.hint] if self.hint else [])


class RankBusyError(MonarchError):
    """Code was sent while ranks still run an earlier cell that was interrupted or timed out and did not stop
    (typically blocked in a collective): a collective of more code, on any rank, could pair with the stuck one and
    give wrong results. ``ranks`` are the stuck ranks."""

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = list(ranks or [])

    def __reduce__(self) -> tuple:
        return (type(self), (self.args[0], self.ranks))


class MeshNotRunningError(MonarchError):
    """No mesh is running (the message says how to start one)."""


class MeshStartError(MonarchError):
    """The mesh did not start: a rank failed to start or to join within the start timeout.

    Attributes: ``rank`` (the first rank that failed, or -1), ``detail`` (its error and last output).
    """

    def __init__(self, message: str, rank: int = -1, detail: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.detail = detail

    def __reduce__(self) -> tuple:
        return (type(self), (self.args[0], self.rank, self.detail))

    def __str__(self) -> str:
        return self.args[0] + (f"\n{self.detail}" if self.detail else "")


def describe_returncode(returncode: int | None) -> str:
    """'exit code 3' or 'signal SIGKILL' for a process return code (negative: killed by that signal)."""
    if returncode is None:
        return "unknown exit status"
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


class RemoteError(MonarchError):
    """An exception raised by user code on one rank.

    Attributes: ``rank``, ``ename`` (exception type name), ``emodule``, ``evalue`` (its message),
    ``traceback`` (the rank's formatted traceback, with the cell's own source lines), ``frames`` (that
    traceback as (filename, lineno, function, source line), outermost first) and ``interrupted`` (True: a
    KeyboardInterrupt from an interrupt that reached the rank; one the cell's code raised itself is False).
    """

    def __init__(self, rank: int, ename: str, evalue: str, traceback: str = "", emodule: str = "",
                 frames: list | None = None, interrupted: bool = False) -> None:
        super().__init__(rank, ename, evalue, traceback, emodule, frames, interrupted)
        self.rank = rank
        self.ename = ename
        self.evalue = evalue
        self.traceback = traceback
        self.emodule = emodule
        self.frames = list(frames or [])
        self.interrupted = interrupted

    def __str__(self) -> str:
        return f"[rank{self.rank}] {self.ename}: {self.evalue}"

    def render(self) -> list[str]:
        body = self.traceback.rstrip("\n") or f"{self.ename}: {self.evalue}"
        return [f"[rank{self.rank}] {line}" for line in body.splitlines()]

    def _render_traceback_(self) -> list[str]:
        return self.render()


_SIGNAL_HINTS = {
    "SIGKILL": "SIGKILL is sent by the out-of-memory killer (see `dmesg`), a job scheduler or a user",
    "SIGSEGV": "a crash in C/C++ code (torch, an extension, ctypes); its Python stack is in its last output",
    "SIGBUS": "a crash in C/C++ code, or shared memory (/dev/shm) is full",
    "SIGABRT": "a C/C++ assertion or an uncaught C++ exception (its message is in its last output)",
}


class RankDiedError(MonarchError):
    """A rank's process ended, or was lost, while it had work.

    Attributes: ``rank``; ``returncode`` (negative: killed by that signal; None: unknown, e.g. a remote rank
    lost by heartbeat); ``last_output`` (its last lines of output); ``pid``; ``reason`` (why, when the
    controller knows better than the exit status, e.g. "no heartbeat for 30 s" or "killed by %mesh interrupt
    --force"); ``output_earlier`` (True: the cell that failed wrote nothing, and ``last_output`` is what earlier
    cells wrote).
    """

    def __init__(self, rank: int, returncode: int | None, last_output: str = "", pid: int | None = None,
                 reason: str = "", output_earlier: bool = False) -> None:
        super().__init__(rank, returncode, last_output, pid, reason, output_earlier)
        self.rank = rank
        self.returncode = returncode
        self.last_output = last_output
        self.pid = pid
        self.reason = reason
        self.output_earlier = output_earlier

    def __str__(self) -> str:
        if self.returncode is None and self.reason:
            return f"[rank{self.rank}] lost ({self.reason})"
        status = describe_returncode(self.returncode)
        return f"[rank{self.rank}] died ({status}{'; ' + self.reason if self.reason else ''})"

    def render(self) -> list[str]:
        lines = [str(self)]
        hint = _SIGNAL_HINTS.get(describe_returncode(self.returncode).removeprefix("signal "))
        if hint and not self.reason:
            lines.append(f"[rank{self.rank}] note: {hint}")
        if self.last_output:
            lines.append(f"[rank{self.rank}] its last output"
                         + (" (from earlier cells: this one wrote nothing):" if self.output_earlier else ":"))
            lines += [f"[rank{self.rank}]   {line}" for line in self.last_output.rstrip("\n").splitlines()]
        return lines

    def _render_traceback_(self) -> list[str]:
        return self.render()


class RankAbortedError(MonarchError):
    """A rank stopped its cell because of other ranks: they died, and it was interrupted, released from a
    collective with them, or did not stop in time (``still_running``); or they raised (``raised``: their
    exception's type) before a collective it waited for them in, and it was released from that collective
    (``collective``: "gloo:all_reduce #5") when the process group was torn down.

    Attributes: ``rank``; ``dead`` (the ranks that died, or raised); ``error`` (the RemoteError the rank
    reported, if any: ``error.traceback`` has its frames); ``still_running`` (True: it had not stopped when the
    cell ended); ``raised``, ``collective`` (see above; "" after a death).
    """

    def __init__(self, rank: int, dead: list[int], error: RemoteError | None = None,
                 still_running: bool = False, raised: str = "", collective: str = "") -> None:
        super().__init__(rank, list(dead), error, still_running, raised, collective)
        self.rank = rank
        self.dead = list(dead)
        self.error = error
        self.still_running = still_running
        self.raised = raised
        self.collective = collective

    def summary(self) -> str:
        """What happened, without the rank number (ranks with the same summary are shown on one line)."""
        who = ranks_text(self.dead)
        if self.raised:
            they = plural(self.dead, "they", "it")
            return (f"released from {self.collective or 'a collective'}, which {who} never joined ({they} raised "
                    f"{self.raised}): the process group was torn down")
        if self.still_running:
            return (f"still running when {who} died (stuck in C code?): see  %mesh stacks ;  "
                    "%mesh interrupt --force  stops it")
        if self.error is None:
            return f"stopped because {who} died"
        if self.error.interrupted:
            return f"interrupted because {who} died"
        first = (self.error.evalue.strip().splitlines() or [""])[0]
        if len(first) > 160:
            first = first[:157] + "..."
        return f"stopped because {who} died ({self.error.ename}: {first})"

    def __str__(self) -> str:
        return f"[rank{self.rank}] {self.summary()}"

    def render(self) -> list[str]:
        return [str(self)]

    def _render_traceback_(self) -> list[str]:
        return self.render()


class MeshError(MonarchError):
    """A cell failed on some ranks. One error for all of them.

    Attributes
    ----------
    errors:
        rank -> RemoteError or RankDiedError, in the order the controller saw them; the first is the root cause.
    results:
        rank -> value of the cell's last expression on the ranks that finished (None where there was none).
    hint:
        What to do next (e.g. how to bring dead ranks back), shown last; also a note (PEP 678), which a script's
        traceback prints under the message.
    not_run:
        True: nothing ran, as chosen ranks are dead (``errors`` holds their RankDiedErrors, whose last output was
        shown when they died, and is not shown again).
    """

    def __init__(self, errors: dict[int, MonarchError], results: dict[int, Any] | None = None,
                 what: str = "the cell", hint: str = "", not_run: bool = False) -> None:
        super().__init__(errors, results, what, hint, not_run)
        self.errors = dict(errors)
        self.results = dict(results or {})
        self.what = what
        self.hint = hint
        self.not_run = not_run
        if hint:  # a script's traceback prints it under the message (PEP 678); a notebook renders it last, itself
            self.add_note(hint)

    @property
    def root_cause(self) -> MonarchError:
        return next(iter(self.errors.values()))

    def __str__(self) -> str:
        if self.not_run:
            dead = "; ".join(str(e) for e in self.errors.values())
            needs = plural(self.errors, "ranks it needs are dead", "a rank it needs is dead")
            return f"{self.what} was not run, since {needs}: {dead}"
        return f"{self.what} failed on {ranks_text(self.errors)}; first failure: {self.root_cause}"

    def _render_traceback_(self) -> list[str]:
        if self.not_run:
            return [f"MeshError: {self}", *([self.hint] if self.hint else [])]
        root_rank = next(iter(self.errors))
        # Ranks that failed identically (same exception, same traceback) are shown once, as %mesh stacks does.
        same: dict[int, list[int]] = {}
        keys: dict[tuple, int] = {}
        for rank, err in self.errors.items():
            if isinstance(err, RemoteError):
                first = keys.setdefault((err.ename, err.evalue, err.traceback), rank)
                if first != rank:
                    same.setdefault(first, []).append(rank)
        grouped = {r for rs in same.values() for r in rs}

        def also(rank: int) -> str:
            rs = same.get(rank)
            return f"; {ranks_text(rs)} failed the same way" if rs else ""

        lines = [f"MeshError: {self}"]
        lines.append(f"--- root cause: rank {root_rank} (first failure seen){also(root_rank)} ---")
        lines += self.errors[root_rank].render()  # type: ignore[attr-defined]
        aborted: dict[str, list[int]] = {}  # ranks stopped by others' deaths: one line per kind
        for rank, err in self.errors.items():
            if rank == root_rank or rank in grouped:
                continue
            if isinstance(err, RankAbortedError):
                aborted.setdefault(err.summary(), []).append(rank)
                continue
            lines.append(f"--- rank {rank}{also(rank)} ---")
            lines += err.render()  # type: ignore[attr-defined]
        for summary, ranks in aborted.items():
            lines.append(f"--- {ranks_text(ranks)}: {summary} ---")
        return lines + self._tail()

    def _tail(self) -> list[str]:
        """The last lines of the rendering: where the finished ranks' values are, and the hint."""
        lines = []
        if self.results:
            lines.append(f"({ranks_text(self.results)} finished; "
                         f"{plural(self.results, 'their results are', 'its result is')} in .results of this error)")
        if self.hint:
            lines.append(self.hint)
        return lines


class MeshTimeoutError(MeshError):
    """A cell ran past its timeout; ``stacks`` is the report of where each rank was, ``late`` the ranks that had
    not finished it. A rank that failed before the timeout (it raised, or died: often why the others waited) is
    the root cause: first in ``errors``, shown first, and named in the message."""

    def __init__(self, errors: dict[int, MonarchError], results: dict[int, Any] | None = None,
                 what: str = "the cell", stacks: str = "", timeout: float = 0.0, hint: str = "",
                 late: list[int] | None = None) -> None:
        late = sorted(errors) if late is None else sorted(late)
        failed = {r: e for r, e in errors.items() if r not in late}
        errors = {**failed, **{r: e for r, e in errors.items() if r in late}}
        super().__init__(errors, results, what, hint)
        self.stacks = stacks
        self.timeout = timeout
        self.late = late
        self.failed = list(failed)
        self.args = (errors, results, what, stacks, timeout, hint, late)

    def __str__(self) -> str:
        text = f"{self.what} did not finish within {self.timeout:g} s on {ranks_text(self.late)}"
        if self.failed:
            text += f"; first failure: {self.errors[self.failed[0]]}"
        return text

    def _render_traceback_(self) -> list[str]:
        lines = [f"MeshTimeoutError: {self}"]
        for rank in self.failed:
            root = " (root cause: it failed before the timeout)" if rank == self.failed[0] else ""
            lines.append(f"--- rank {rank}{root} ---")
            lines += self.errors[rank].render()  # type: ignore[attr-defined]
        if self.stacks:
            lines += ["Where each rank was:", *self.stacks.splitlines()]
        return lines + self._tail()


class TrialFailedError(MeshError):
    """A sweep trial's cell failed (``monarch_jupyter.sweep``): the trial's MeshError told in one short line, for
    Optuna's warning of a failed trial (it shows the exception's repr). The full error is its ``__cause__``; its
    ``errors``, ``results``, ``what`` and ``hint`` are the MeshError's (rank numbers: the mesh's).

    ``str`` is "trial 2 on sub-mesh trial0 (mesh ranks 0,1): the cell failed on rank 1: ValueError: a bad trial":
    the first line of each failed rank's error (ranks with the same line together), each cut at ``LINE`` characters.
    """

    LINE = 160  # characters of one rank's error line kept

    def __init__(self, trial: int, errors: dict[int, MonarchError], results: dict[int, Any] | None = None,
                 what: str = "the cell", hint: str = "", where: str = "") -> None:
        super().__init__(errors, results, what, hint)
        self.trial = trial
        self.where = where  # "sub-mesh trial0 (mesh ranks 0,1)", or ""
        self.args = (trial, errors, results, what, hint, where)

    @classmethod
    def of(cls, trial: int, error: MeshError, where: str = "") -> TrialFailedError:
        """The short error of trial number ``trial`` whose cell raised ``error`` (to be raised ``from error``)."""
        return cls(trial, error.errors, error.results, error.what, error.hint, where)

    def __str__(self) -> str:
        lines: dict[str, list[int]] = {}  # first line of the error -> the ranks that had it
        for rank, err in self.errors.items():
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            first = first.removeprefix(f"[rank{rank}] ")
            if len(first) > self.LINE:
                first = first[: self.LINE - 3] + "..."
            lines.setdefault(first, []).append(rank)
        told = "; ".join(f"{ranks_text(ranks)}: {line}" for line, ranks in lines.items())
        where = f" on {self.where}" if self.where else ""
        return f"trial {self.trial}{where}: {self.what} failed on {told}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


class MeshInterrupt(KeyboardInterrupt):
    """The KeyboardInterrupt a cell raises when the notebook's interrupt stopped it on the ranks.

    A KeyboardInterrupt (so "Run All" stops and ``except KeyboardInterrupt`` works), which IPython shows as one
    line (its message: where each rank stopped) instead of the controller's own frames. ``results`` (a RankMap)
    holds the values of the ranks that finished the cell before it was interrupted on the others.
    """

    def __init__(self, message: str, results: Mapping[int, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.results = RankMap(dict(results or {}))

    def __reduce__(self) -> tuple:
        return (type(self), (self.message, dict(self.results)))

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self.message}"]


# The notebook names an error by its type's __name__ (the execute_reply's ename): an interrupt reads as one.
# Pickling finds the class by its __qualname__, which stays MeshInterrupt.
MeshInterrupt.__name__ = "KeyboardInterrupt"


def mesh_interrupt(message: str, results: Mapping[int, Any] | None = None) -> MeshInterrupt:
    """A ``MeshInterrupt`` with ``message`` and the finished ranks' ``results``."""
    return MeshInterrupt(message, results)
