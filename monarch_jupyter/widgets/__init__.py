"""Per-rank views of a mesh. The live dashboard listens to Mesh events; outside widget frontends the same
information prints as compact text."""

from __future__ import annotations

from typing import Any

from ..kernel.ranks import format_ranks

__all__ = ["status_view", "StatusText"]


class StatusText:
    """Plain-text status of a mesh: one line per rank. Its text/plain repr is stable (no times, no pids)
    where ``stable`` is set, so notebooks compare under nbval."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self.status = mesh.status()

    def text(self) -> str:
        states: dict[str, list[int]] = {}
        for r, s in self.status.items():
            states.setdefault(s["state"], []).append(r)
        head = f"mesh: world size {len(self.status)}; " + "; ".join(
            f"{state}: {format_ranks(rs)}" for state, rs in states.items())
        rows = [head, f"{'rank':>4}  {'state':<9} {'host':<16} {'device':<8} {'pid':>7} {'rss MiB':>8}"]
        for r, s in self.status.items():
            rss = f"{s['rss'] / 2**20:.0f}" if s["rss"] else "-"
            rows.append(f"{r:>4}  {s['state']:<9} {s['host'][:16]:<16} {s['device']:<8} {s['pid'] or '-':>7} "
                        f"{rss:>8}")
        return "\n".join(rows)

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())


def status_view(mesh: Any) -> StatusText:
    """What ``%mesh status`` shows."""
    return StatusText(mesh)
