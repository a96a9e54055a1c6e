"""Output lines longer than the limit (issue 24, 6b): the head is shown with a note giving the size and the file
that holds the line whole; what a splitter holds stays bounded whatever a rank prints; a batch of lines reaches the
frontend as stream messages of bounded size."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest

from monarch_jupyter.kernel import output
from monarch_worker.protocol import sync_marker
from monarch_worker.streams import StreamSplitter, temp_file_sink

NOTE = re.compile(r" \.\.\. \[line of ([\d,]+) bytes truncated to its first ([\d,]+); the whole line: (\S+)\]$")


def splitter(tmp_path: Path, limit: int = 100) -> StreamSplitter:
    def sink() -> tuple[io.BufferedWriter, str]:
        path = tmp_path / f"line{len(list(tmp_path.iterdir()))}.txt"
        return open(path, "wb"), str(path)
    return StreamSplitter(line_limit=limit, sink=sink)


def lines(events: list) -> list[str]:
    return [v for k, v in events if k == "line"]


def whole(note_line: str) -> tuple[int, int, bytes]:
    m = NOTE.search(note_line)
    assert m, note_line
    return int(m[1].replace(",", "")), int(m[2].replace(",", "")), Path(m[3]).read_bytes()


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_a_long_line_shows_its_head_and_is_whole_in_a_file(tmp_path: Path, chunk: int) -> None:
    line = ("é" * 40 + "x" * 1000 + "end").encode()  # a character cut at the limit stays whole or goes
    data = b"short\n" + line + b"\nafter\n"
    s = splitter(tmp_path)
    out: list[str] = []
    for i in range(0, len(data), chunk):
        out += lines(s.feed(data[i:i + chunk]))
        assert len(s._line.encode()) <= 100  # bounded while the line arrives
    assert out[0] == "short" and out[2] == "after", out
    size, shown, kept = whole(out[1])
    assert (size, kept) == (len(line), line)
    head = out[1][:NOTE.search(out[1]).start()]
    assert len(head.encode()) == shown <= 100 and line.startswith(head.encode())


def test_a_long_line_without_its_newline_ends_with_the_cell(tmp_path: Path) -> None:
    s = splitter(tmp_path)
    assert lines(s.feed(b"y" * 500)) == []
    out = lines(s.feed(sync_marker(3)))
    assert len(out) == 1 and whole(out[0])[2] == b"y" * 500
    assert lines(s.feed(b"next\n")) == ["next"]


def test_short_lines_and_progress_bars_are_untouched(tmp_path: Path) -> None:
    s = splitter(tmp_path)
    bar = "".join(f"\r{i:3d}%" for i in range(100)).encode()  # 500 bytes of updates, one line a terminal shows
    assert lines(s.feed(b"a\n" + bar + b"\nb\n")) == ["a", " 99%", "b"]
    assert list(tmp_path.iterdir()) == []


def test_without_a_file_the_note_says_so(tmp_path: Path) -> None:
    s = StreamSplitter(line_limit=10, sink=None)
    (out,) = lines(s.feed(b"z" * 50 + b"\n"))
    assert out == "z" * 10 + (" ... [line of 50 bytes truncated to its first 10; it was not kept "
                              "(see output_line_limit)]")


def test_the_temp_file_sink_names_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    f, where = temp_file_sink("monarch-rank3-stdout-", "host7")()
    f.close()
    host, path = where.split(":", 1)
    assert host == "host7" and os.path.basename(path).startswith("monarch-rank3-stdout-")
    assert os.path.dirname(path) == str(tmp_path)


class Recorder:
    """A stream that records what each flush would send as one message (as ipykernel's OutStream does)."""

    flush_interval = 0.2

    def __init__(self) -> None:
        self.buffer = ""
        self.messages: list[str] = []

    def write(self, text: str) -> None:
        self.buffer += text

    def flush(self) -> None:
        if self.buffer:
            self.messages.append(self.buffer)
            self.buffer = ""


def test_a_big_batch_is_sent_as_bounded_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    out = Recorder()
    monkeypatch.setattr("sys.stdout", out)
    batch = [(0, "stdout", f"line {i} " + "x" * 50) for i in range(20_000)]
    output.write_lines(batch)
    out.flush()
    assert all(len(m) <= output.MESSAGE_LIMIT for m in out.messages), [len(m) for m in out.messages]
    assert len(out.messages) > 1 and all(m.endswith("\n") for m in out.messages)
    assert "".join(out.messages) == "".join(f"[rank0]: {t}\n" for _, _, t in batch)
