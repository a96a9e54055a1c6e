"""Splitting rank output into lines and per-cell sync markers."""

from __future__ import annotations

from monarch_worker.protocol import sync_marker
from monarch_jupyter.kernel.output import StreamSplitter


def lines(events: list) -> list:
    return [v for k, v in events if k == "line"]


def test_lines_and_partial_line() -> None:
    s = StreamSplitter()
    assert lines(s.feed(b"a\nb")) == ["a"]
    assert lines(s.feed(b"c\n")) == ["bc"]
    assert lines(s.feed(b"tail")) == []
    assert lines(s.flush()) == ["tail"]


def test_marker_flushes_last_line_without_newline() -> None:
    s = StreamSplitter()
    ev = s.feed(b"x\nno newline" + sync_marker(5) + b"next\n")
    assert ev == [("line", "x"), ("line", "no newline"), ("sync", 5), ("line", "next")]


def test_marker_split_across_reads() -> None:
    s = StreamSplitter()
    data = b"hello\n" + sync_marker(12)
    for cut in range(1, len(data)):
        s = StreamSplitter()
        ev = s.feed(data[:cut]) + s.feed(data[cut:])
        assert ev == [("line", "hello"), ("sync", 12)], cut


def test_utf8_split_across_reads() -> None:
    s = StreamSplitter()
    data = "é✓\n".encode()
    assert lines(s.feed(data[:1]) + s.feed(data[1:])) == ["é✓"]


def test_carriage_return_keeps_what_a_terminal_shows() -> None:
    s = StreamSplitter()
    assert lines(s.feed(b" 10%\r 50%\r100%\r\n")) == ["100%"]
