"""Each ``Trainer.fit`` on the mesh becomes a row of the notebook's experiment table (``monarch_jupyter.experiments``,
issue 29: settings, ranks, final metrics, wall time, checkpoint), beside the trials of sweeps.

The row is written once the fit has ended, in the notebook, from what the notebook's Trainer holds after the ranks'
results came back (``launch._recover``): the module's ``hparams`` as settings, ``trainer.callback_metrics`` as the
final metrics, ``ModelCheckpoint``'s best (else last) path as the checkpoint. A fit that raised or was interrupted is
a ``failed`` row with the error's first line. Lightning's own loggers (CSV, TensorBoard, MLflow) are untouched: this
table is the notebook's overview, they stay the record.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .. import experiments

log = logging.getLogger(__name__)

__all__ = ["record_fit"]


def _plain(value: Any) -> Any:
    """A setting as the table shows it: numbers, strings and bools as they are, anything else as its ``str``."""
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)


def _number(value: Any) -> float | None:
    """A metric (a Python number or a one-element tensor) as a float, or None."""
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError):
        return None


def record_fit(trainer: Any, ranks: list[int], started: float, error: BaseException | None = None) -> None:
    """Add the fit of ``trainer`` to the experiment table. ``ranks``: the mesh's numbers of the ranks it ran on;
    ``started``: ``time.monotonic()`` when it was sent (wall time in seconds is measured from it); ``error``: what
    ended it, if it failed. Never raises: the table is a convenience, a fit's outcome is never changed by it."""
    try:
        module = getattr(trainer, "lightning_module", None)
        hparams = getattr(module, "hparams", None) or {}
        settings = {str(k): _plain(v) for k, v in dict(hparams).items()}
        metrics = {}
        for name, value in dict(getattr(trainer, "callback_metrics", {}) or {}).items():
            number = _number(value)
            if number is not None:
                metrics[str(name)] = number
        checkpoint = None
        callback = getattr(trainer, "checkpoint_callback", None)
        if callback is not None:
            checkpoint = getattr(callback, "best_model_path", "") or getattr(callback, "last_model_path", "") or None
        name = f"fit of {type(module).__name__}" if module is not None else "fit"
        experiments.record(name, settings=settings, ranks=ranks, metrics=metrics,
                           wall_time=time.monotonic() - started, checkpoint=checkpoint,
                           state="failed" if error is not None else "complete")
        if error is not None:
            run = experiments.table().runs[-1]
            run.error = (str(error).splitlines() or [type(error).__name__])[0][:200]
    except Exception:  # noqa: BLE001 - see the docstring
        log.debug("could not add the fit to the experiment table", exc_info=True)
