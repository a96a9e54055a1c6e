"""Every rank's predictions back in dataloader order (``trainer.predict`` on the mesh).

Each rank predicted an interleaved share of the samples (Lightning's ``UnrepeatedDistributedSampler``) and sent its
batches with their dataset indices (``rank.PredictOutput``); ``assemble_predictions`` cuts them into samples, puts
them in index order and batches them again with the same batch size.
"""

from __future__ import annotations

from typing import Any

from . import rank as rank_side

__all__ = ["assemble_predictions"]


def _split(value: Any, n: int) -> list | None:
    """``value`` (a batch's prediction) as ``n`` per-sample values, or None when it has no batch dimension."""
    import torch

    if isinstance(value, torch.Tensor):
        return list(value.unbind(0)) if value.dim() > 0 and value.shape[0] == n else None
    if isinstance(value, dict):
        split = {k: _split(v, n) for k, v in value.items()}
        cols = {k: p for k, p in split.items() if p is not None}
        if len(cols) < len(split):
            return None
        return [type(value)((k, cols[k][i]) for k in value) for i in range(n)]
    if isinstance(value, (list, tuple)) and not (isinstance(value, list) and len(value) == n and not value):
        pieces = [_split(v, n) for v in value]
        known = [p for p in pieces if p is not None]
        if not pieces or len(known) < len(pieces):
            return list(value) if isinstance(value, list) and len(value) == n else None
        items = [[p[i] for p in known] for i in range(n)]
        return [type(value)(*it) if hasattr(value, "_fields") else type(value)(it) for it in items]
    return None


def _join(samples: list) -> Any:
    import torch

    first = samples[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(samples)
    if isinstance(first, dict):
        return type(first)((k, _join([s[k] for s in samples])) for k in first)
    if isinstance(first, tuple):
        joined = [_join([s[i] for s in samples]) for i in range(len(first))]
        return type(first)(*joined) if hasattr(first, "_fields") else type(first)(joined)
    if isinstance(first, list) and all(isinstance(s, list) and len(s) == len(first) for s in samples):
        if first and isinstance(first[0], torch.Tensor):
            return [_join([s[i] for s in samples]) for i in range(len(first))]
    return list(samples)


def assemble_predictions(outputs: list[rank_side.PredictOutput]) -> Any:
    """Every rank's predictions as one list in dataloader order (a list per dataloader when there are several).

    Each rank predicted an interleaved share of the samples (Lightning's UnrepeatedDistributedSampler); the
    batches are cut into samples along their first dimension, ordered by dataset index and re-batched with the
    ranks' batch size. Predictions without a batch dimension (a float per batch, say) come back batch by batch,
    ordered by their first sample's index.
    """
    if not outputs:
        return None
    first = outputs[0].predictions
    if first is None:
        return None
    several = outputs[0].num_dataloaders > 1
    n_loaders = len(first) if several else 1
    assembled = []
    for d in range(n_loaders):
        batches: list[tuple[list, Any]] = []
        for out in outputs:
            preds = out.predictions[d] if several else out.predictions
            indices = out.batch_indices.get(d, [])
            batches += list(zip(indices, preds or [], strict=False))
        assembled.append(_reorder(batches))
    return assembled if several else assembled[0]


def _reorder(batches: list[tuple[list, Any]]) -> list:
    if not batches:
        return []
    samples: dict[int, Any] = {}
    batch_size = max(len(ix) for ix, _ in batches)
    for indices, pred in batches:
        parts = _split(pred, len(indices)) if indices else None
        if parts is None:
            return [p for _ix, p in sorted(batches, key=lambda b: b[0][0] if b[0] else 0)]
        for i, part in zip(indices, parts, strict=False):
            samples.setdefault(int(i), part)
    order = sorted(samples)
    return [_join([samples[i] for i in order[k:k + batch_size]]) for k in range(0, len(order), batch_size)]

