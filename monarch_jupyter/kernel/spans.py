"""``RankSpans``: a set of ranks kept as sorted, disjoint ranges, so that what many ranks do alike costs the same
whatever their number.

A host agent reports the ranks that ended a cell alike as one list (a ``done`` event), and those are a host's
ranks: one range. The controller's records of a cell (records.CellRecord: which ranks run it, which have their
result in, which finished it) keep ranks in this form, so that a cell's dispatch, a host's batch and the cell's
end touch no per-rank Python object (docs/scale.md, "Per-cell cost"). Ranks that differ (an error, a value, output)
are kept per rank beside it.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Sequence

__all__ = ["RankSpans", "contiguous", "span_of"]


def contiguous(ranks: Sequence[int]) -> bool:
    """``ranks`` is ``start, start + 1, ..., stop - 1`` (checked in C: no Python step per rank)."""
    n = len(ranks)
    if n == 0:
        return True
    first = ranks[0]
    if ranks[-1] - first + 1 != n:
        return False
    if isinstance(ranks, range):
        return ranks.step == 1
    return list(range(first, first + n)) == (ranks if isinstance(ranks, list) else list(ranks))


def span_of(ranks: Sequence[int]) -> range | None:
    """``ranks`` as one ``range`` when they are a run of consecutive ranks in any order, each once (a host agent
    lists its ranks in the order they finished), else None. Checked in C: no Python step per rank."""
    n = len(ranks)
    if n == 0:
        return None
    if isinstance(ranks, range):
        return ranks if ranks.step == 1 else None
    first, last = ranks[0], ranks[-1]
    if last - first + 1 == n and contiguous(ranks):  # sorted already (a relay's, a quiet host's)
        return range(first, last + 1)
    lo, hi = min(ranks), max(ranks)
    if hi - lo + 1 == n and len(set(ranks)) == n:
        return range(lo, hi + 1)
    return None


class RankSpans:
    """A set of ranks (ints >= 0) as sorted, disjoint half-open ranges ``[start, stop)`` with their count.

    ``add_range`` and ``in`` cost O(log ranges); ``update`` with a contiguous run of ranks (a host's) costs one
    ``add_range`` after a check done in C."""

    __slots__ = ("starts", "stops", "_count")  # starts, stops: the ranges, read-only outside

    def __init__(self, ranks: Iterable[int] = ()) -> None:
        self.starts: list[int] = []
        self.stops: list[int] = []
        self._count = 0
        if ranks:
            self.update(ranks)

    @classmethod
    def of_sorted(cls, ranks: Sequence[int]) -> RankSpans:
        """The set of ``ranks``, sorted and without repeats (a cell's): one range, found in O(1), when they are
        contiguous."""
        spans = cls()
        if ranks and ranks[-1] - ranks[0] + 1 == len(ranks):
            spans.add_range(ranks[0], ranks[-1] + 1)
        elif ranks:
            spans.update(ranks)
        return spans

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __contains__(self, rank: object) -> bool:
        if not isinstance(rank, int):
            return False
        i = bisect_right(self.starts, rank) - 1
        return i >= 0 and rank < self.stops[i]

    def __iter__(self) -> Iterator[int]:
        for start, stop in zip(self.starts, self.stops, strict=True):
            yield from range(start, stop)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RankSpans):
            return self.starts == other.starts and self.stops == other.stops
        if isinstance(other, (set, frozenset)):
            return len(other) == self._count and all(r in self for r in other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return "RankSpans(" + ",".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in self.ranges()) + ")"

    def ranges(self) -> list[tuple[int, int]]:
        """The ranges, ``(start, stop)`` half-open, in order."""
        return list(zip(self.starts, self.stops, strict=True))

    def add(self, rank: int) -> None:
        self.add_range(rank, rank + 1)

    def add_range(self, start: int, stop: int) -> None:
        """Add ranks ``start`` to ``stop - 1``."""
        if start >= stop:
            return
        starts, stops = self.starts, self.stops
        if not starts or start > stops[-1]:  # past the end: the usual case, hosts report in any order but once
            starts.append(start)
            stops.append(stop)
            self._count += stop - start
            return
        lo = bisect_left(stops, start)  # the first range that ends at or after ``start`` (touching merges)
        hi = bisect_right(starts, stop)  # past the last range that starts at or before ``stop``
        if lo < hi:
            removed = sum(b - a for a, b in zip(starts[lo:hi], stops[lo:hi], strict=True))
            start, stop = min(start, starts[lo]), max(stop, stops[hi - 1])
        else:
            removed = 0
        starts[lo:hi] = [start]
        stops[lo:hi] = [stop]
        self._count += stop - start - removed

    def update(self, ranks: Iterable[int]) -> None:
        """Add ``ranks``: a contiguous sorted run (a host's ranks, a ``range``) in one step, others rank by rank."""
        if isinstance(ranks, RankSpans):
            for start, stop in ranks.ranges():
                self.add_range(start, stop)
            return
        if isinstance(ranks, (list, tuple, range)):
            if not ranks:
                return
            if contiguous(ranks):
                self.add_range(ranks[0], ranks[-1] + 1)
                return
        for r in sorted(ranks):
            if self.stops and self.stops[-1] == r:
                self.stops[-1] = r + 1
                self._count += 1
            elif r not in self:
                self.add_range(r, r + 1)

    def discard(self, rank: int) -> None:
        i = bisect_right(self.starts, rank) - 1
        if i < 0 or rank >= self.stops[i]:
            return
        start, stop = self.starts[i], self.stops[i]
        self._count -= 1
        if stop - start == 1:
            del self.starts[i], self.stops[i]
        elif rank == start:
            self.starts[i] = rank + 1
        elif rank == stop - 1:
            self.stops[i] = rank
        else:
            self.stops[i] = rank
            self.starts.insert(i + 1, rank + 1)
            self.stops.insert(i + 1, stop)

    def first_not_in(self, other: RankSpans) -> int | None:
        """The smallest rank of this set that ``other`` lacks, or None (O(ranges))."""
        o_starts, o_stops = other.starts, other.stops
        for start, stop in zip(self.starts, self.stops, strict=True):
            r = start
            while r < stop:
                i = bisect_right(o_starts, r) - 1
                if i < 0 or r >= o_stops[i]:
                    return r
                r = o_stops[i]
        return None

    def without(self, other: RankSpans) -> list[int]:
        """The ranks of this set that ``other`` lacks, in order (O(ranges + the ranks returned))."""
        out: list[int] = []
        o_starts, o_stops = other.starts, other.stops
        for start, stop in zip(self.starts, self.stops, strict=True):
            r = start
            while r < stop:
                i = bisect_right(o_starts, r) - 1
                if i >= 0 and r < o_stops[i]:
                    r = o_stops[i]
                    continue
                nxt = o_starts[i + 1] if i + 1 < len(o_starts) else stop
                end = min(stop, nxt)
                out.extend(range(r, end))
                r = end
        return out
