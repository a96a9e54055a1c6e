"""The figures a bench prints, as data: the ``--json PATH`` option the benches share (issue 30).

A bench builds one dict of the figures it prints (seconds, bytes, ratios: the units of the printed table) and, where
it has goals, one entry per goal made by :func:`goal`; :func:`write_json` writes them with the machine's particulars
(CPUs, python, load average) so that two runs can be compared as data.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

__all__ = ["add_json_option", "goal", "write_json"]


def add_json_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--json PATH`` to a bench's argument parser (``args.json``: the path, or None)."""
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write the printed figures, with their goals, to PATH as JSON")


def goal(value: float | None, op: str, target: float, what: str = "") -> dict[str, Any]:
    """One goal as data: ``{"value", "goal", "met"}``.

    Parameters
    ----------
    value: the measured figure, in the unit of ``target``.
    op: ``"<="``, ``"<"``, ``">="`` or ``">"``: how ``value`` must compare with ``target``.
    target: the goal's bound.
    what: the bound's unit or reference, for the reader (``"x import torch"``, ``"s"``).

    Raises
    ------
    ValueError: ``op`` is none of the four.
    """
    compare = {"<=": float.__le__, "<": float.__lt__, ">=": float.__ge__, ">": float.__gt__}
    if op not in compare:
        raise ValueError(f"goal(): op must be one of {sorted(compare)}, not {op!r}")
    met = None if value is None or math.isnan(value) else bool(compare[op](float(value), float(target)))
    return {"value": value, "goal": f"{op} {target:g}{(' ' + what) if what else ''}", "met": met}


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities made None (JSON has no NaN), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(path: str | None, bench: str, figures: dict[str, Any], goals: dict[str, Any] | None = None,
               **params: Any) -> None:
    """Write ``figures`` (and ``goals``) of ``bench`` to ``path`` as JSON; nothing when ``path`` is None.

    The file holds ``{"bench", "params", "cpus", "python", "load_average", "figures", "goals"}``; NaN (a figure
    with no sample) becomes null. ``params`` are the bench's options (ranks, repetitions...).

    Raises
    ------
    OSError: ``path`` cannot be written.
    """
    if not path:
        return
    data = {"bench": bench, "params": params, "cpus": os.cpu_count(), "python": sys.version.split()[0],
            "load_average": os.getloadavg()[0], "figures": figures, "goals": goals or {}}
    with open(path, "w") as f:
        json.dump(_finite(data), f, indent=1)
    print(f"figures written to {path}")
