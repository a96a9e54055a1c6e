"""The work pipe at full size: a large message crosses a real pipe piecewise (no join on the writer), is read into a
buffer of its own on the reader (no copy), and that buffer is recycled once nothing uses it."""

from __future__ import annotations

import gc
import os
import threading

from monarch_worker import protocol as P
from monarch_worker.pipes import BufferCache, WorkPipe


def _read_all(fd: int, count: int) -> list:
    reader = P.WorkReader()
    out: list = []
    while len(out) < count:
        got = reader.read_from(fd)
        assert got is not None, "end of file before every message arrived"
        out += got
    return out


def test_large_and_small_messages_cross_a_pipe_in_order() -> None:
    r, w = os.pipe()
    pipe = WorkPipe(w)
    big = memoryview(bytes(range(256)) * (12 * 1024))  # 3 MiB, out of band (as tensor memory is)
    messages = [[b"a", b"x" * 10], [b"b", big, b"tail"], [b"c"]]
    out: list = []
    reader = threading.Thread(target=lambda: out.extend(_read_all(r, len(messages))))
    reader.start()
    for frames in messages:
        parts = P.work_message(frames)
        if len(frames[1:2]) and frames[1] is big:
            assert any(p is big for p in parts), "a large frame is written as it is, not joined"
        if not pipe.send(parts):
            while not pipe.flush():
                pass
    reader.join(30)
    assert [P.unpack_frames(b) for b in out] == messages
    large = out[1]
    assert isinstance(large, memoryview) and not large.readonly  # tensors can be built on it without a copy
    pipe.close()
    os.close(r)


def test_buffer_cache_recycles_released_memory() -> None:
    cache = BufferCache(64 << 20)
    view = cache.take(4 << 20)
    view[:3] = b"abc"
    part = view[1:3]
    del view
    gc.collect()
    assert cache.cached_bytes == 0  # a slice still uses it
    del part
    gc.collect()
    assert cache.cached_bytes == 4 << 20
    again = cache.take(3 << 20)  # fits: the same mapping, no new pages
    assert cache.cached_bytes == 0 and len(again) == 3 << 20
    small = BufferCache(1 << 20)
    v = small.take(2 << 20)
    del v
    gc.collect()
    assert small.cached_bytes == 0  # over its limit: back to the OS


def test_writes_to_a_closed_reader_end_are_dropped() -> None:
    r, w = os.pipe()
    os.close(r)
    pipe = WorkPipe(w)
    assert pipe.send(P.work_message([b"x" * (2 << 20)]))  # EPIPE: the rank is gone, nothing waits
    assert pipe.closed and not pipe.pending
    pipe.close()
