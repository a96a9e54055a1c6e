"""Errors raised in the notebook. One base class; errors are picklable and never matched by message text.

The shape follows ipyparallel.error (RemoteError, CompositeError) and torch.distributed.elastic's failure
records: a rank's exception (``RemoteError``) is a different thing from a rank's death (``RankDiedError``), and
many ranks' failures fold into one ``MeshError`` whose root cause is the first failure the controller saw.
"""

from __future__ import annotations

import signal
from typing import Any

__all__ = [
    "MonarchError",
    "MeshStartError",
    "MeshNotRunningError",
    "RemoteError",
    "RankDiedError",
    "MeshError",
    "MeshTimeoutError",
]


class MonarchError(Exception):
    """Base of every monarch_jupyter error."""


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

    Attributes: ``rank``, ``ename`` (exception type name), ``emodule``, ``evalue`` (its message) and
    ``traceback`` (the rank's formatted traceback, with the cell's own source lines).
    """

    def __init__(self, rank: int, ename: str, evalue: str, traceback: str = "", emodule: str = "") -> None:
        super().__init__(rank, ename, evalue, traceback, emodule)
        self.rank = rank
        self.ename = ename
        self.evalue = evalue
        self.traceback = traceback
        self.emodule = emodule

    @property
    def interrupted(self) -> bool:
        return self.ename == "KeyboardInterrupt"

    def __str__(self) -> str:
        return f"[rank{self.rank}] {self.ename}: {self.evalue}"

    def render(self) -> list[str]:
        body = self.traceback.rstrip("\n") or f"{self.ename}: {self.evalue}"
        return [f"[rank{self.rank}] {line}" for line in body.splitlines()]

    def _render_traceback_(self) -> list[str]:
        return self.render()


class RankDiedError(MonarchError):
    """A rank's process ended while it had work (exit code or signal, and its last lines of output)."""

    def __init__(self, rank: int, returncode: int | None, last_output: str = "", pid: int | None = None) -> None:
        super().__init__(rank, returncode, last_output, pid)
        self.rank = rank
        self.returncode = returncode
        self.last_output = last_output
        self.pid = pid

    def __str__(self) -> str:
        return f"[rank{self.rank}] died ({describe_returncode(self.returncode)})"

    def render(self) -> list[str]:
        lines = [str(self) + (" -- its last output:" if self.last_output else "")]
        lines += [f"[rank{self.rank}]   {line}" for line in self.last_output.rstrip("\n").splitlines()]
        return lines

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
    """

    def __init__(self, errors: dict[int, MonarchError], results: dict[int, Any] | None = None,
                 what: str = "the cell") -> None:
        super().__init__(errors, results, what)
        self.errors = dict(errors)
        self.results = dict(results or {})
        self.what = what

    @property
    def root_cause(self) -> MonarchError:
        return next(iter(self.errors.values()))

    def __str__(self) -> str:
        failed = ", ".join(str(r) for r in sorted(self.errors))
        return f"{self.what} failed on rank(s) {failed}; first failure: {self.root_cause}"

    def _render_traceback_(self) -> list[str]:
        root_rank = next(iter(self.errors))
        lines = [f"MeshError: {self}"]
        lines.append(f"--- root cause: rank {root_rank} (first failure seen) ---")
        lines += self.errors[root_rank].render()  # type: ignore[attr-defined]
        for rank, err in self.errors.items():
            if rank == root_rank:
                continue
            lines.append(f"--- rank {rank} ---")
            lines += err.render()  # type: ignore[attr-defined]
        if self.results:
            ok = ", ".join(str(r) for r in sorted(self.results))
            lines.append(f"(rank(s) {ok} finished; their results are in .results of this error)")
        return lines


class MeshTimeoutError(MeshError):
    """A cell ran past its timeout; ``stacks`` is the report of where each rank was."""

    def __init__(self, errors: dict[int, MonarchError], results: dict[int, Any] | None = None,
                 what: str = "the cell", stacks: str = "", timeout: float = 0.0) -> None:
        super().__init__(errors, results, what)
        self.stacks = stacks
        self.timeout = timeout
        self.args = (errors, results, what, stacks, timeout)

    def __str__(self) -> str:
        return f"{self.what} did not finish within {self.timeout:g} s on rank(s) " + ", ".join(
            str(r) for r in sorted(self.errors))

    def _render_traceback_(self) -> list[str]:
        lines = [f"MeshTimeoutError: {self}"]
        if self.stacks:
            lines += ["Where each rank was:", *self.stacks.splitlines()]
        return lines
