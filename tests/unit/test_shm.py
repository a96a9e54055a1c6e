"""Shared memory segments: one process writes, others map copy-on-write; release, reuse and limits."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from monarch_worker import shm

pytestmark = pytest.mark.skipif(not shm.supported(), reason="needs Linux memfd_create and /proc")

MiB = 1 << 20


def write(pool: shm.SegmentPool, arrays: list[np.ndarray], holders: list) -> tuple[shm.Segment, dict]:
    layout, total = shm.layout_of(a.nbytes for a in arrays)
    seg = pool.acquire(total)
    seg.write(arrays, layout)
    pool.lend(seg, holders)
    return seg, seg.describe(layout, total)


def test_layout_is_aligned_and_packed() -> None:
    layout, total = shm.layout_of([10, 64, 0, 3])
    assert layout == [[0, 10], [64, 64], [128, 0], [128, 3]]
    assert total == 192 and all(o % shm.ALIGN == 0 for o, _ in layout)


def test_reader_in_another_process_sees_the_bytes_and_writes_privately() -> None:
    pool = shm.SegmentPool(cache_bytes=0)
    a = np.arange(2 * MiB // 8, dtype=np.int64)
    seg, desc = write(pool, [a], ["child"])
    child = textwrap.dedent(f"""
        import numpy as np
        from monarch_worker import shm
        released = []
        (view,) = shm.open_segment({desc!r}, released.append)
        arr = np.frombuffer(view, dtype=np.int64)
        ok = bool((arr == np.arange(arr.size)).all())
        arr[:4] = -1  # copy-on-write: the writer and other readers keep their bytes
        print(ok, len(shm.memfd_mappings()), arr[:2].tolist())
        del arr, view
        import gc; gc.collect()
        print(released, len(shm.memfd_mappings()))
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60, check=True)
    lines = out.stdout.splitlines()
    assert lines[0] == "True 1 [-1, -1]"
    assert lines[1] == f"[{desc['id']}] 0"
    (view,) = shm.open_segment(desc, lambda i: None)
    assert np.frombuffer(view, dtype=np.int64)[:4].tolist() == [0, 1, 2, 3]
    del view
    pool.give_back(seg.id, "child")
    assert pool.stats()["lent"] == 0 and not shm.memfd_fds(), "cache 0: the writer closes the segment at once"


def test_release_callback_fires_when_the_last_view_goes() -> None:
    pool = shm.SegmentPool()
    seg, desc = write(pool, [np.ones(MiB, dtype=np.uint8), np.zeros(MiB, dtype=np.uint8)], ["r"])
    released: list[int] = []
    views = shm.open_segment(desc, released.append)
    first = np.frombuffer(views[0], dtype=np.uint8)
    del views
    gc.collect()
    assert released == [], "a view still refers to the mapping"
    assert first.sum() == MiB
    del first
    gc.collect()
    assert released == [seg.id]
    assert not shm.memfd_mappings(), "the reader's mapping is gone"
    pool.close()


def test_segments_are_reused_only_after_every_holder_released() -> None:
    pool = shm.SegmentPool(cache_bytes=64 * MiB)
    a = np.ones(4 * MiB, dtype=np.uint8)
    seg, _ = write(pool, [a], [0, 1])
    pool.give_back(seg.id, 0)
    assert pool.stats()["lent"] == 1
    other = pool.acquire(a.nbytes)
    assert other is not seg, "still mapped by holder 1: must not be handed out again"
    other.close()
    pool.give_back(seg.id, 1)
    assert pool.stats()["cached"] == 1
    assert pool.acquire(a.nbytes) is seg
    assert pool.stats()["reused"] == 1
    pool.lend(seg, [])  # nobody to wait for: straight back to the cache
    assert pool.stats()["cached"] == 1
    pool.drop_holder(7)  # unknown holders are harmless
    pool.trim(0.0)
    assert pool.stats()["cached"] == 0
    pool.close()
    assert not shm.memfd_fds()


def test_dead_holder_releases_and_close_frees_everything() -> None:
    pool = shm.SegmentPool(cache_bytes=0)
    write(pool, [np.ones(MiB, dtype=np.uint8)], [3])
    write(pool, [np.ones(MiB, dtype=np.uint8)], [3, 4])
    pool.drop_holder(3)
    assert pool.stats()["lent"] == 1
    pool.close()
    assert pool.stats()["lent"] == 0 and not shm.memfd_fds()
    with pytest.raises(shm.ShmError, match="closed"):
        pool.acquire(10)


def test_reused_segment_gets_new_bytes() -> None:
    pool = shm.SegmentPool(cache_bytes=64 * MiB)
    seg, _ = write(pool, [np.full(MiB, 1, dtype=np.uint8)], ["r"])
    pool.give_back(seg.id, "r")
    seg2, desc2 = write(pool, [np.full(MiB, 2, dtype=np.uint8)], ["r"])
    assert seg2 is seg
    (view,) = shm.open_segment(desc2, lambda i: None)
    assert np.frombuffer(view, dtype=np.uint8).min() == 2
    del view
    pool.close()


def test_limit_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONARCH_JUPYTER_SHM_LIMIT", str(MiB))
    assert shm.available_bytes() <= MiB
    pool = shm.SegmentPool()
    with pytest.raises(shm.ShmError, match="available"):
        pool.acquire(2 * MiB)
    pool.close()


def test_open_checks_the_segment_is_the_one_described() -> None:
    pool = shm.SegmentPool(cache_bytes=0)
    _, desc = write(pool, [np.ones(MiB, dtype=np.uint8)], ["r"])
    with pytest.raises(shm.ShmUnavailableError, match="not the shared memory segment"):
        shm.open_segment(dict(desc, ino=desc["ino"] + 1), lambda i: None)
    with pytest.raises(shm.ShmUnavailableError, match="cannot open"):
        shm.open_segment(dict(desc, path=f"/proc/{os.getpid()}/fd/999999"), lambda i: None)
    pool.close()
