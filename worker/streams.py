"""Splitting a rank's output stream into lines, sync markers and records (``StreamSplitter``).

The notebook kernel splits the output pipes of its local ranks, and a host agent those of the ranks of its host, with
the same splitter: records (protocol.RECORD_PREFIX) and sync markers (protocol.SYNC_PREFIX) are told apart from text
that merely looks like them.

A line longer than the splitter's ``line_limit`` (bytes) is never held whole: its first
``line_limit`` bytes are kept, everything after them is written to a file as it arrives (``LongLineSink``), and the
line comes out as its head plus a note with its size and that file's path. What a splitter holds is then bounded by
the limit, whatever a rank prints.
"""

from __future__ import annotations

import codecs
import os
import tempfile
from collections.abc import Callable
from typing import BinaryIO

from . import protocol as P

__all__ = ["StreamSplitter", "terminal_view", "LongLineSink", "long_line_note", "temp_file_sink", "LINE_LIMIT"]

#: Opens the file that receives a long line: returns it (binary, writable) and its path; the splitter closes it.
LongLineSink = Callable[[], tuple[BinaryIO, str]]

LINE_LIMIT = 1 << 16
"""Bytes (UTF-8) of one output line shown in the notebook; a longer line shows its first ``LINE_LIMIT`` bytes and
a note, and is written whole to a file (the controller's option ``output_line_limit``; host agents use this)."""


def temp_file_sink(prefix: str, where: str = "") -> LongLineSink:
    """A sink that writes each long line to a new file in the system's temporary folder (``tempfile.mkstemp``,
    named ``prefix...txt``), kept for the user after the line is shown. ``where``: put before the path in the note
    (a host agent's host name: the file is on that host)."""
    def open_file() -> tuple[BinaryIO, str]:
        fd, path = tempfile.mkstemp(prefix=prefix, suffix=".txt")
        return os.fdopen(fd, "wb"), f"{where}:{path}" if where else path
    return open_file

# Markers and records start alike (protocol.SYNC_PREFIX, protocol.RECORD_PREFIX).
_ESCAPE = b"\x1b]monarch-"
_RECORD_MIN = len(P.RECORD_PREFIX) + P.RECORD_HEADER.size
_PREFIX_MAX = max(len(P.SYNC_PREFIX), len(P.RECORD_PREFIX), len(P.ERR_PREFIX))
_HEX = frozenset(b"0123456789abcdef")
_FLAGS_MAX = P.RECORD_MORE | P.RECORD_SYNC
assert P.SYNC_PREFIX.startswith(_ESCAPE) and P.RECORD_PREFIX.startswith(_ESCAPE)


class StreamSplitter:
    """Incremental splitter for one rank's stream: bytes in, complete lines and sync markers out.

    Not thread-safe; each (rank, stream) has one, fed from one thread. ``line_limit``: bytes (UTF-8) a line may
    have before it is cut (0: no limit): its first ``line_limit`` bytes are shown with a note
    (``long_line_note``), and the whole line goes to the file ``sink`` opens (None: nowhere, the note only says
    its size).
    """

    def __init__(self, records: bool = True, line_limit: int = 0, sink: LongLineSink | None = None) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._raw = b""
        self._line = ""
        self._records = records  # only a rank's stdout carries records; on stderr their prefix is text
        self._more = False  # the last record said more parts of its message follow
        self.line_limit = line_limit  # bytes a line may have before it is cut (0: no limit)
        self._sink = sink
        self._spill: BinaryIO | None = None  # the file of the long line being written, while it lasts
        self._spill_path = ""
        self._spill_bytes = 0  # bytes of that line so far (its head included)
        self._spill_head = 0  # bytes of its head (what is shown)
        self._err: StreamSplitter | None = None  # the rank's Python-level stderr, embedded in its stdout (protocol)

    def feed(self, data: bytes) -> list[tuple[str, object]]:
        """Returns events in order: ("line", text) for a complete line, ("sync", cell_id) for a marker,
        ("msg", (flags, body)) for a record (protocol.RECORD_PREFIX: a message the rank wrote into the stream), and,
        on a stdout, ("errline", text) for a line of the rank's Python-level stderr embedded in it, in order with
        the stdout lines around it (protocol.ERR_PREFIX)."""
        return _one_per_line(self.feed_runs(data))

    def feed_runs(self, data: bytes) -> list[tuple[str, object]]:
        """``feed``, with consecutive lines as one event: ("lines", [text, ...]) and ("errlines", [text, ...]) in
        place of runs of ("line", text) and ("errline", text). A flood of output costs a few events per read, not
        one per line (the lines are split in C: no Python work per line unless a line holds a carriage return or
        may be over the limit)."""
        if not self._raw and not self._line and not self._decoder.getstate()[0] and (
                self._err is None or not self._err.pending()):
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
            if self._records and rest.startswith(P.ERR_PREFIX):
                if len(rest) < P.ERR_HEADER_LEN:
                    self._text(raw[:i], events)
                    self._raw = rest
                    break
                size = rest[len(P.ERR_PREFIX):P.ERR_HEADER_LEN]
                n = int(size, 16) if _HEX.issuperset(size) else P.ERR_BODY_MAX + 1
                if n > P.ERR_BODY_MAX:  # not a piece of stderr: text that only looks like one
                    self._text(raw[:i + len(_ESCAPE)], events)
                    raw = raw[i + len(_ESCAPE):]
                    continue
                if len(rest) < P.ERR_HEADER_LEN + n:
                    self._text(raw[:i], events)
                    self._raw = rest
                    break
                self._text(raw[:i], events)
                self._embedded(rest[P.ERR_HEADER_LEN:P.ERR_HEADER_LEN + n], events)
                raw = rest[P.ERR_HEADER_LEN + n:]
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
            if len(rest) < _PREFIX_MAX and (P.SYNC_PREFIX.startswith(rest) or self._records and (
                    P.RECORD_PREFIX.startswith(rest) or P.ERR_PREFIX.startswith(rest))):
                self._text(raw[:i], events)
                self._raw = rest  # the start of a marker or record; the rest comes with the next read
                break
            self._text(raw[:i + len(_ESCAPE)], events)  # text that only looks like ours
            raw = raw[i + len(_ESCAPE):]
        return events

    def _text(self, data: bytes, events: list) -> None:
        if not data:
            return
        if self._spill_bytes:  # inside a long line: its bytes go to its file up to its newline
            j = data.find(b"\n")
            self._spill_write(data if j < 0 else data[:j])
            if j < 0:
                return
            _add(events, "lines", [self._end_long()])
            data = data[j + 1:]
            if not data:
                return
        text = self._line + self._decoder.decode(data)
        *lines, self._line = text.split("\n")
        limit = self.line_limit
        if limit and lines and max(map(len, lines)) * 4 > limit:  # only then can a line be over the limit
            rest = self._line
            shown = []
            for line in lines:
                line = _collapse(line)
                if len(line) * 4 > limit and len(line.encode()) > limit:
                    self._start_long(line, complete=True)
                    shown.append(self._end_long())
                else:
                    shown.append(terminal_view(line))
            _add(events, "lines", shown)
            self._line = rest
        elif lines:
            # Carriage returns (progress bars) are rare: only then is a line looked at one by one.
            _add(events, "lines", list(map(terminal_view, lines)) if "\r" in text else lines)
        if limit and len(self._line) * 4 > limit:
            self._line = _collapse(self._line)  # a progress bar's updates: only its last one shows
            if len(self._line.encode()) > limit:
                self._start_long(self._line, complete=False)

    def _start_long(self, line: str, complete: bool) -> None:
        """``line`` (all of a line, or the start of the one being read) is over the limit: keep its head in
        ``_line``, send all of it to a file."""
        raw = line.encode()
        head = raw[:self.line_limit].decode("utf-8", "ignore")  # cut at a character boundary
        self._line = head
        self._spill_head = len(head.encode())
        self._spill_bytes = 0
        if self._sink is not None:
            try:
                self._spill, self._spill_path = self._sink()
            except OSError:
                self._spill, self._spill_path = None, ""
        self._spill_write(raw)
        if not complete:
            pending = self._decoder.getstate()[0]  # a character cut by the read: its bytes are the line's too
            if pending:
                self._spill_write(pending)
            self._decoder.reset()

    def _spill_write(self, data: bytes) -> None:
        self._spill_bytes += len(data)
        if self._spill is not None and data:
            try:
                self._spill.write(data)
            except OSError:  # the disk is full, or the file was removed: the note says the size only
                self._close_spill()

    def _close_spill(self) -> None:
        spill, self._spill = self._spill, None
        if spill is not None:
            try:
                spill.close()
            except OSError:
                self._spill_path = ""

    def _end_long(self) -> str:
        """The long line ends: its head and the note, as the line to show."""
        self._close_spill()
        text = terminal_view(self._line) + long_line_note(self._spill_bytes, self._spill_head, self._spill_path)
        self._line, self._spill_bytes, self._spill_path = "", 0, ""
        return text

    def _embedded(self, body: bytes, events: list) -> None:
        """A piece of the rank's stderr embedded in this stdout: its complete lines as ("errlines", texts)."""
        if self._err is None:
            self._err = StreamSplitter(records=False, line_limit=self.line_limit, sink=self._sink)
        for kind, texts in self._err.feed_runs(body):
            if kind == "lines":
                _add(events, "errlines", texts)  # type: ignore[arg-type]

    def _flush_err(self, events: list) -> None:
        if self._err is not None:
            _add(events, "errlines", [str(text) for kind, text in self._err.flush() if kind == "line"])

    def _flush_partial(self, events: list) -> None:
        self._flush_err(events)
        if self._spill_bytes:
            _add(events, "lines", [self._end_long()])
            return
        rest = self._line + self._decoder.decode(b"", final=True)
        self._line = ""
        if rest:
            _add(events, "lines", [terminal_view(rest)])

    def end_line(self) -> list[tuple[str, object]]:
        """The line written so far without a newline, as a ("line", text) event (its cell ended): bytes held back
        because they might have begun a marker are part of it."""
        if (not self._line and not self._raw and not self._decoder.getstate()[0] and not self._spill_bytes
                and (self._err is None or not self._err.pending())):
            return []
        events: list[tuple[str, object]] = []
        self._text(self._raw, events)
        self._raw = b""
        self._flush_partial(events)
        return _one_per_line(events)

    def pending(self) -> bool:
        """Bytes of a line without its newline are held (or of a marker not complete yet)."""
        return bool(self._line or self._raw or self._decoder.getstate()[0] or self._spill_bytes
                    or (self._err is not None and self._err.pending()))

    def flush(self) -> list[tuple[str, object]]:
        """The last line without a newline (at exit or when a cell ends without a marker)."""
        events: list[tuple[str, object]] = []
        self._text(self._raw, events)
        self._raw = b""
        self._flush_partial(events)
        return _one_per_line(events)


def _add(events: list, kind: str, texts: list[str]) -> None:
    """Append lines ``texts`` as a ``kind`` run ("lines", "errlines"), to the last event if it is one of that kind."""
    if not texts:
        return
    if events and events[-1][0] == kind:
        events[-1][1].extend(texts)
    else:
        events.append((kind, texts))


_SINGLE = {"lines": "line", "errlines": "errline"}


def _one_per_line(events: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """Events of ``feed_runs`` as ``feed`` gives them: one ("line", text) or ("errline", text) per line."""
    out: list[tuple[str, object]] = []
    for kind, value in events:
        single = _SINGLE.get(kind)
        if single is None:
            out.append((kind, value))
        else:
            out.extend((single, text) for text in value)  # type: ignore[attr-defined]
    return out


def long_line_note(size: int, shown: int, path: str) -> str:
    """What follows the head of a line cut at the limit: its size in bytes, and where it is whole (``path``; "" when
    it could not be written)."""
    where = f"the whole line: {path}" if path else "it was not kept (see output_line_limit)"
    return f" ... [line of {size:,} bytes truncated to its first {shown:,}; {where}]"


def _collapse(line: str) -> str:
    """``line`` without the updates a carriage return overwrote (what ``terminal_view`` shows is unchanged)."""
    k = line.rstrip("\r").rfind("\r")
    return line[k:] if k > 0 else line


def terminal_view(line: str) -> str:
    """What a terminal would show of a line rewritten with carriage returns (progress bars)."""
    line = line.rstrip("\r")
    if "\r" in line:
        line = line.rsplit("\r", 1)[1]
    return line
