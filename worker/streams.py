"""Splitting a rank's output stream into lines, sync markers and records (``StreamSplitter``).

The notebook kernel splits the output pipes of its local ranks, and a host agent those of the ranks of its host, with
the same splitter: records (protocol.RECORD_PREFIX) and sync markers (protocol.SYNC_PREFIX) are told apart from text
that merely looks like them.
"""

from __future__ import annotations

import codecs

from . import protocol as P

__all__ = ["StreamSplitter", "terminal_view"]

# Markers and records start alike (protocol.SYNC_PREFIX, protocol.RECORD_PREFIX).
_ESCAPE = b"\x1b]monarch-"
_RECORD_MIN = len(P.RECORD_PREFIX) + P.RECORD_HEADER.size
_PREFIX_MAX = max(len(P.SYNC_PREFIX), len(P.RECORD_PREFIX))
_FLAGS_MAX = P.RECORD_MORE | P.RECORD_SYNC
assert P.SYNC_PREFIX.startswith(_ESCAPE) and P.RECORD_PREFIX.startswith(_ESCAPE)


class StreamSplitter:
    """Incremental splitter for one rank's stream: bytes in, complete lines and sync markers out.

    Not thread-safe; each (rank, stream) has one, fed from one thread.
    """

    def __init__(self, records: bool = True) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._raw = b""
        self._line = ""
        self._records = records  # only a rank's stdout carries records; on stderr their prefix is text
        self._more = False  # the last record said more parts of its message follow

    def feed(self, data: bytes) -> list[tuple[str, object]]:
        """Returns events in order: ("line", text) for a complete line, ("sync", cell_id) for a marker, and
        ("msg", (flags, body)) for a record (protocol.RECORD_PREFIX: a message the rank wrote into the stream)."""
        if not self._raw and not self._line and not self._decoder.getstate()[0]:
            # The common cases: one marker or one record, nothing else.
            if data.startswith(P.SYNC_PREFIX) and data.endswith(P.SYNC_SUFFIX):
                body = data[len(P.SYNC_PREFIX):-len(P.SYNC_SUFFIX)]
                if body.isdigit():
                    return [("sync", int(body))]
            elif self._records and data.startswith(P.RECORD_PREFIX) and len(data) >= _RECORD_MIN:
                n, flags = P.RECORD_HEADER.unpack_from(data, len(P.RECORD_PREFIX))
                if (len(data) == _RECORD_MIN + n and n <= P.RECORD_BODY_MAX and flags <= _FLAGS_MAX
                        and (self._more or data.startswith(P.RECORD_BODY_START, _RECORD_MIN + 2))):
                    self._more = bool(flags & P.RECORD_MORE)
                    return [("msg", (flags, data[_RECORD_MIN:]))]
        events: list[tuple[str, object]] = []
        raw = self._raw + data
        self._raw = b""
        while raw:
            i = raw.find(_ESCAPE)
            if i < 0:
                # Keep a tail that may be the start of a marker or record split across reads.
                keep = 0
                for k in range(min(len(_ESCAPE) - 1, len(raw)), 0, -1):
                    if _ESCAPE.startswith(raw[-k:]):
                        keep = k
                        break
                text, self._raw = (raw[:-keep], raw[-keep:]) if keep else (raw, b"")
                self._text(text, events)
                break
            rest = raw[i:]
            if self._records and rest.startswith(P.RECORD_PREFIX):
                head = _RECORD_MIN if self._more else _RECORD_MIN + 2 + len(P.RECORD_BODY_START)
                if len(rest) < head:
                    self._text(raw[:i], events)
                    self._raw = rest
                    break
                n, flags = P.RECORD_HEADER.unpack_from(rest, len(P.RECORD_PREFIX))
                if n > P.RECORD_BODY_MAX or flags > _FLAGS_MAX or not (
                        self._more or rest.startswith(P.RECORD_BODY_START, _RECORD_MIN + 2)):
                    # Not a record (none is longer, and a message's first record starts so): plain text.
                    self._text(raw[:i + len(_ESCAPE)], events)
                    raw = raw[i + len(_ESCAPE):]
                    continue
                if len(rest) < _RECORD_MIN + n:
                    self._text(raw[:i], events)
                    self._raw = rest
                    break
                self._text(raw[:i], events)
                if flags & P.RECORD_SYNC:
                    self._flush_partial(events)
                self._more = bool(flags & P.RECORD_MORE)
                events.append(("msg", (flags, rest[_RECORD_MIN:_RECORD_MIN + n])))
                raw = rest[_RECORD_MIN + n:]
                continue
            if rest.startswith(P.SYNC_PREFIX):
                # A marker is the prefix, up to 19 digits, the suffix; anything else is text that looks like one.
                digits = rest[len(P.SYNC_PREFIX):len(P.SYNC_PREFIX) + 20]
                k = len(digits) - len(digits.lstrip(b"0123456789"))
                if k == len(digits) and len(digits) < 20:  # all digits so far: the rest comes with the next read
                    self._text(raw[:i], events)
                    self._raw = rest
                    break
                j = len(P.SYNC_PREFIX) + k
                if k == 0 or not rest.startswith(P.SYNC_SUFFIX, j):
                    self._text(raw[:i + len(_ESCAPE)], events)
                    raw = raw[i + len(_ESCAPE):]
                    continue
                self._text(raw[:i], events)
                cell_id = int(rest[len(P.SYNC_PREFIX):j])
                self._flush_partial(events)
                events.append(("sync", cell_id))
                raw = rest[j + len(P.SYNC_SUFFIX):]
                continue
            if len(rest) < _PREFIX_MAX and (P.SYNC_PREFIX.startswith(rest)
                                            or self._records and P.RECORD_PREFIX.startswith(rest)):
                self._text(raw[:i], events)
                self._raw = rest  # the start of a marker or record; the rest comes with the next read
                break
            self._text(raw[:i + len(_ESCAPE)], events)  # text that only looks like ours
            raw = raw[i + len(_ESCAPE):]
        return events

    def _text(self, data: bytes, events: list) -> None:
        if not data:
            return
        text = self._line + self._decoder.decode(data)
        *lines, self._line = text.split("\n")
        for line in lines:
            events.append(("line", terminal_view(line)))

    def _flush_partial(self, events: list) -> None:
        rest = self._line + self._decoder.decode(b"", final=True)
        self._line = ""
        if rest:
            events.append(("line", terminal_view(rest)))

    def end_line(self) -> list[tuple[str, object]]:
        """The line written so far without a newline, as a ("line", text) event (its cell ended): bytes held back
        because they might have begun a marker are part of it."""
        if not self._line and not self._raw and not self._decoder.getstate()[0]:
            return []
        events: list[tuple[str, object]] = []
        self._text(self._raw, events)
        self._raw = b""
        self._flush_partial(events)
        return events

    def flush(self) -> list[tuple[str, object]]:
        """The last line without a newline (at exit or when a cell ends without a marker)."""
        events: list[tuple[str, object]] = []
        self._text(self._raw, events)
        self._raw = b""
        self._flush_partial(events)
        return events


def terminal_view(line: str) -> str:
    """What a terminal would show of a line rewritten with carriage returns (progress bars)."""
    line = line.rstrip("\r")
    if "\r" in line:
        line = line.rsplit("\r", 1)[1]
    return line
