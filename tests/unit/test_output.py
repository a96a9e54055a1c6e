"""Splitting rank output into lines and per-cell sync markers."""

from __future__ import annotations

from monarch_jupyter.kernel.output import StreamSplitter
from monarch_worker.protocol import sync_marker


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


# ---- records: signed messages a local rank writes into its stdout pipe (protocol.RECORD_PREFIX)

from monarch_worker import protocol as P  # noqa: E402

KEY = b"k" * 32


def record_bytes(msg: P.Message, sync: bool = True, payload: bytes = b"") -> bytes:
    return b"".join(P.records(P.pack_frames(P.Signer(KEY).pack(msg, payload)), sync))


def msgs(events: list) -> list:
    return [v for k, v in events if k == "msg"]


def test_record_alone_and_after_a_partial_line() -> None:
    rec = record_bytes(P.Result(7, "ok"))
    s = StreamSplitter()
    ev = s.feed(rec)
    assert [k for k, _ in ev] == ["msg"]
    flags, body = ev[0][1]
    assert flags & P.RECORD_SYNC and not flags & P.RECORD_MORE
    msg, _, _ = P.Signer(KEY).unpack(P.unpack_frames(body))
    assert msg == P.Result(7, "ok")
    # A sync record ends the cell: the line it interrupts is complete; what follows is the next line.
    s = StreamSplitter()
    ev = s.feed(b"a\nno newline" + rec + b"next\n")
    assert [k for k, _ in ev] == ["line", "line", "msg", "line"]
    assert lines(ev) == ["a", "no newline", "next"]


def test_record_split_across_reads_at_every_byte() -> None:
    data = b"before\n" + record_bytes(P.Result(3, "ok"), payload=b"\n\x1b]monarch-" * 20) + b"after\n"
    for cut in range(1, len(data)):
        s = StreamSplitter()
        ev = s.feed(data[:cut]) + s.feed(data[cut:])
        assert lines(ev) == ["before", "after"], cut
        assert len(msgs(ev)) == 1, cut


def test_progress_record_inside_a_line_keeps_the_line_whole() -> None:
    rec = record_bytes(P.Progress(1, 3, 10), sync=False)
    s = StreamSplitter()
    ev = s.feed(b"epoch " + rec + b"1 done\n")
    assert lines(ev) == ["epoch 1 done"] and len(msgs(ev)) == 1


def test_long_message_is_cut_into_atomic_records() -> None:
    body = P.pack_frames(P.Signer(KEY).pack(P.Result(1, "ok", True), b"x" * 20000))
    recs = P.records(body, sync=True)
    assert len(recs) > 1 and all(len(r) <= P.PIPE_BUF for r in recs)
    s = StreamSplitter()
    ev = s.feed(b"".join(recs))
    parts = msgs(ev)
    assert [bool(f & P.RECORD_MORE) for f, _ in parts] == [True] * (len(recs) - 1) + [False]
    assert b"".join(b for _, b in parts) == body


def test_text_that_only_looks_like_a_record_is_text() -> None:
    s = StreamSplitter()
    ev = s.feed(b"\x1b]monarch-nothing\n\x1b]monarch-msg\n")
    assert lines(ev) == ["\x1b]monarch-nothing", "\x1b]monarch-msg"] and not msgs(ev)


def test_malformed_frames_are_rejected() -> None:
    import pytest

    body = P.pack_frames([b"a", b"bc"])
    assert P.unpack_frames(body) == [b"a", b"bc"]
    for bad in (body[:-1], body + b"x", b"\xff"):
        with pytest.raises(P.ProtocolError):
            P.unpack_frames(bad)


def test_work_reader_splits_messages_across_reads() -> None:
    msgs_in = [b"".join(P.work_message([b"m", bytes([i]) * i])) for i in range(1, 30)]
    data = b"".join(msgs_in)
    r = P.WorkReader()
    out = []
    for i in range(0, len(data), 7):
        out += r.feed(data[i:i + 7])
    assert [P.unpack_frames(b) for b in out] == [[b"m", bytes([i]) * i] for i in range(1, 30)]


def test_stderr_embedded_in_stdout_keeps_its_place_at_every_split() -> None:
    """A rank's Python-level stderr travels in its stdout pipe (protocol.err_pieces): its lines come out as
    ("errline", text) between the stdout lines they were written between, however the reads cut the bytes."""
    data = (b"out 1\n" + b"".join(P.err_pieces("err é 1\nerr par".encode())) + b"out 2\n"
            + b"".join(P.err_pieces(b"tial\n")) + b"out 3\n" + b"".join(P.err_pieces(b"no newline")) + sync_marker(4))
    expected = [("line", "out 1"), ("errline", "err é 1"), ("line", "out 2"), ("errline", "err partial"),
                ("line", "out 3"), ("errline", "no newline"), ("sync", 4)]
    for step in (1, 2, 3, 7, len(data)):
        s = StreamSplitter()
        events = []
        for i in range(0, len(data), step):
            events += s.feed(data[i:i + step])
        assert events == expected, step


def test_text_that_only_looks_like_embedded_stderr_is_text() -> None:
    s = StreamSplitter()
    assert s.feed(P.ERR_PREFIX + b"zz12 not a piece\n") == [("line", "\x1b]monarch-err;zz12 not a piece")]
    # On a stderr pipe the prefix is text too.
    assert StreamSplitter(records=False).feed(b"".join(P.err_pieces(b"x\n"))) == [
        ("line", "\x1b]monarch-err;0002x")]


def test_a_flood_comes_as_runs_of_lines_with_embedded_stderr_in_its_place() -> None:
    """``feed_runs``: the lines of a read come as one ("lines", [...]) event (no event per line), embedded stderr as
    ("errlines", [...]) in place; flattened, they are exactly what ``feed`` gives, however the reads cut the bytes."""
    data = (b"".join(f"L {i}\n".encode() for i in range(5000)) + b"".join(P.err_pieces(b"e1\ne2\n"))
            + b"bar 10%\r bar 99%\r\nafter\n" + sync_marker(7) + b"next\n")
    whole = StreamSplitter().feed_runs(data)
    assert [k for k, _ in whole] == ["lines", "errlines", "lines", "sync", "lines"]
    assert whole[0][1] == [f"L {i}" for i in range(5000)] and whole[1][1] == ["e1", "e2"]
    assert whole[2][1] == [" bar 99%", "after"] and whole[4][1] == ["next"]
    for step in (3, 4096, 1 << 16):
        runs, single = StreamSplitter(), StreamSplitter()
        flat, expected = [], []
        for i in range(0, len(data), step):
            for kind, value in runs.feed_runs(data[i:i + step]):
                if kind in ("lines", "errlines"):
                    flat += [(kind[:-1], text) for text in value]
                else:
                    flat.append((kind, value))
            expected += single.feed(data[i:i + step])
        assert flat == expected, step


def test_lines_for_a_cell_are_written_while_another_thread_writes_in_that_cells_context() -> None:
    """A note for a cell (a rank's death, queued to the writer with the cell's context) came while the thread that
    waits for the cell was itself writing in that context (blocked on a slow stdout): ``Context.run`` refuses a
    context entered in another thread, and the note was lost ("cannot enter context ... already entered")."""
    import contextvars
    import threading

    from monarch_jupyter.kernel.output import OUTPUT_SINK, OutputWriter, write_lines

    got: list = []
    ctx = contextvars.copy_context()
    ctx.run(OUTPUT_SINK.set, lambda lines: bool(got.extend(lines)) or True)
    inside, release = threading.Event(), threading.Event()

    def waiter_writing() -> None:
        inside.set()
        release.wait(30)

    waiter = threading.Thread(target=ctx.run, args=(waiter_writing,))
    waiter.start()
    try:
        assert inside.wait(30)
        writer = OutputWriter()
        writer.put([(0, "stderr", "rank 0 died")], ctx)
        assert writer.flush(30)
        write_lines([(1, "stdout", "from another thread")], ctx)
    finally:
        release.set()
        waiter.join(30)
    assert got == [(0, "stderr", "rank 0 died"), (1, "stdout", "from another thread")], got
