"""A Lightning callback that reports what a LightningModule logs (``self.log``) as ``progress()`` metrics.

In a cell on the ranks (a sub-mesh of a sweep, say)::

    from monarch_worker.lightning_progress import ReportMetrics
    trainer = lightning.Trainer(..., callbacks=[ReportMetrics()])

After each training batch and each validation run, every rank calls ``monarch_worker.progress(global_step,
max_steps, desc="fit", **numbers)`` with the numbers among ``trainer.callback_metrics`` (what ``self.log`` recorded,
rank 0's view unless ``sync_dist``): the notebook's live view charts them, and a sweep (``monarch_jupyter.sweep(...,
report="val_loss")``) passes them to its Optuna trial (``trial.report``) and prunes on them. Reports are throttled
as every ``progress()`` call is (``live.MIN_INTERVAL``); the last of a fit always goes.

Lightning (the ``lightning`` package) is imported by this module: import it only where Lightning is.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from .live import as_number, progress

__all__ = ["ReportMetrics"]


class ReportMetrics(Callback):
    """Report ``trainer.callback_metrics`` (scalars only) with ``progress()`` after each training batch and each
    validation run (see the module docstring). ``desc``: the label of the progress bar ("fit")."""

    def __init__(self, desc: str = "fit") -> None:
        self.desc = desc

    def _report(self, trainer: Any) -> None:
        numbers = {str(k): x for k, v in trainer.callback_metrics.items() if (x := as_number(v)) is not None}
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if total is None:
            try:
                total = int(trainer.estimated_stepping_batches)
            except Exception:  # noqa: BLE001 - unknown length (an iterable dataset): the count only
                total = None
        progress(int(trainer.global_step), total, desc=self.desc, **numbers)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._report(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self._report(trainer)
