"""Errors of ``strategy="mesh"`` (all MonarchErrors: the notebook shows their message, not our frames)."""

from __future__ import annotations

import functools

from ..errors import MonarchError

__all__ = ["MeshLightningError", "LightningVersionError", "UnpicklableJobError", "TrainingInterrupted"]


class MeshLightningError(MonarchError):
    """``strategy="mesh"`` cannot run as configured (world size, devices, accelerator); the message says what to
    change."""


class LightningVersionError(MeshLightningError):
    """The installed Lightning is outside the range ``strategy="mesh"`` was tested with."""


class UnpicklableJobError(MeshLightningError):
    """Something ``fit`` (or ``Fabric.launch``) was given cannot be sent to the ranks; the message names the
    attribute. Nothing was sent; the mesh and the notebook's objects are unchanged."""


class TrainingInterrupted(MonarchError):
    """The notebook's interrupt stopped a ``fit`` (``validate``, ``test``, ``predict``) on every rank.

    Not a KeyboardInterrupt on purpose: Lightning answers a KeyboardInterrupt that leaves a launcher by ignoring
    SIGINT for good and calling ``sys.exit(1)``, which would take the notebook's interrupt button away. The
    Trainer is marked interrupted (``trainer.interrupted``), its callbacks' ``on_exception`` ran on the ranks, and
    the ranks keep running for the next ``fit``. ``ranks``: those that were interrupted.
    """

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = list(ranks or [])

    def __reduce__(self) -> tuple:
        return (type(self), (self.args[0], self.ranks))

    def _render_traceback_(self) -> list[str]:
        return [f"TrainingInterrupted: {line}" if i == 0 else line
                for i, line in enumerate(str(self).splitlines())]


def fault_tolerant_missing() -> str:
    """Why ``MeshStrategy(fault_tolerant=True)`` is refused: what a fit that survives a death needs, and the ways
    that work today."""
    return ("MeshStrategy(fault_tolerant=True): a fit that trains through a rank's death needs torchft inside "
            "Lightning's training loop: a torchft Manager that forms a quorum at every step, its "
            "DistributedDataParallel and Optimizer wrappers in place of Lightning's DDP gradient allreduce and "
            "optimizer step, and a load of the healed state in the middle of fit. Lightning's DDP strategy owns all "
            "three and has no hook for them, so this is not available. What works: the loop written with torchft in "
            "a  %%mesh --async --rejoin  cell on a mesh started with  %mesh start --on-rank-death restart --torchft"
            "  (docs/fault_tolerance.md); or strategy='mesh' on a mesh started with --on-rank-death restart, a "
            "ModelCheckpoint, and fit(..., ckpt_path='last') again once the rank is back.")


def render_interrupt(message: str) -> list[str]:
    return [f"KeyboardInterrupt: {message}"]


def fabric_interrupt(message: str) -> KeyboardInterrupt:
    """The KeyboardInterrupt ``Fabric.launch`` raises when interrupted (Fabric has no handler of its own)."""
    exc = KeyboardInterrupt(message)
    exc._render_traceback_ = functools.partial(render_interrupt, message)  # type: ignore[attr-defined]
    return exc
