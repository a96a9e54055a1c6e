"""Shared memory for large transfers between the controller and the ranks of one host.

A segment is an anonymous shared-memory file (Linux ``memfd_create``). It never has a name in /dev/shm or
anywhere else, so no crash of any process can leak it, and it is not bounded by the size of /dev/shm (64 MiB in a
default Docker container). The writer keeps the file descriptor open; a reader on the same host opens it through
``/proc/<writer pid>/fd/<fd>`` and maps it copy-on-write (``MAP_PRIVATE``): every reader sees the writer's bytes
without a copy, and a reader that modifies its value gets private pages, so each rank's value stays its own. The
operating system frees the memory when the writer has closed the descriptor and the last mapping is gone: the
reader dropped the value, exited or was killed.

This is the POSIX "unlink once everybody has mapped it" pattern with the unlink done before anybody maps: the
name that readers open is the writer's descriptor, which exists exactly as long as the writer process holds it.

Security. Opening ``/proc/<pid>/fd/<n>`` is allowed only to processes of the same user that may inspect the
writer (the ptrace "read" check), the same set of processes that could read a 0600 file in /dev/shm or attach a
debugger to the writer. The message that names a segment (path, inode, size, layout) is signed like every other
message; the segment's bytes are not hashed, for the reason the socket's out-of-band buffers are not: they are
only ever used as array memory, never unpickled (the pickle, which could run code, travels signed on the
socket), and anybody able to change them could change the writer's memory directly.

Recycling. Allocating fresh shared pages costs more than copying into them (page faults and zeroing: 3-10x a
memcpy on a VM). A writer therefore keeps a segment its readers have all released (each reader reports that with
a ``ShmRelease`` message when its mapping goes away) in a small cache, and the next large transfer is one memcpy
into pages that already exist. The cache holds at most ``CACHE_BYTES`` and frees what stayed unused
``CACHE_IDLE`` seconds. A segment is reused only after every reader released it, so no reader ever sees it
change under its value.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "SHM_THRESHOLD",
    "ALIGN",
    "CACHE_BYTES",
    "CACHE_IDLE",
    "ShmError",
    "ShmUnavailableError",
    "Segment",
    "SegmentPool",
    "supported",
    "available_bytes",
    "layout_of",
    "open_segment",
    "memfd_mappings",
]

SHM_THRESHOLD = 1 << 20
"""A value whose out-of-band buffers total at least this many bytes goes through shared memory (same host);
smaller ones stay on the socket, where one message costs less than setting up a mapping."""

ALIGN = 64
"""Byte alignment of each buffer inside a segment (enough for every dtype and for SIMD loads)."""

CACHE_BYTES = int(os.environ.get("MONARCH_JUPYTER_SHM_CACHE") or 1 << 30)
"""Bytes of released segments a writer keeps for reuse (environment: MONARCH_JUPYTER_SHM_CACHE; 0 disables)."""

CACHE_IDLE = 30.0
"""Seconds a cached segment may stay unused before it is freed."""

_PAGE = mmap.PAGESIZE
_FD_PREFIX = "monarch-shm"


class ShmError(OSError):
    """Shared memory could not be used for a transfer (the caller falls back to the socket or says why)."""


class ShmUnavailableError(ShmError):
    """A reader could not open or map a writer's segment (other user, /proc hidden, segment gone)."""


def supported() -> bool:
    """True where segments work: Linux with memfd_create and /proc."""
    return hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")


def available_bytes() -> int:
    """Bytes of memory a new segment may take now: MemAvailable, less the headroom of this cgroup's limit.

    The environment variable MONARCH_JUPYTER_SHM_LIMIT (bytes) lowers it further (a user's cap on shared memory
    use). Segments live in RAM like any anonymous memory, so this is the number that matters, not /dev/shm's size.
    """
    avail = _meminfo_available()
    limit = _cgroup_headroom()
    if limit is not None:
        avail = min(avail, limit)
    cap = os.environ.get("MONARCH_JUPYTER_SHM_LIMIT")
    if cap:
        avail = min(avail, int(cap))
    return max(avail, 0)


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62


def _cgroup_headroom() -> int | None:
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                raw = f.read().strip()
            if raw == "max":
                return None
            with open(usage_file) as f:
                usage = int(f.read().strip())
            limit = int(raw)
            if limit >= 1 << 60:
                return None
            return limit - usage
        except (OSError, ValueError):
            continue
    return None


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def layout_of(sizes: Iterable[int]) -> tuple[list[list[int]], int]:
    """Offsets of buffers of ``sizes`` bytes packed at ``ALIGN``: ([[offset, nbytes], ...], total bytes)."""
    layout, offset = [], 0
    for n in sizes:
        layout.append([offset, n])
        offset = _round_up(offset + n, ALIGN)
    return layout, offset


class Segment:
    """A memfd of ``capacity`` bytes owned by this process (the writer).

    A new segment's pages are allocated by the first ``write`` (``pwrite``: the kernel allocates and copies in one
    pass, about twice as fast as allocating, mapping and then copying). A reused segment gets a writable mapping
    of its existing pages once (pre-faulted) and is filled by plain memcpy from then on.

    Raises ShmError when the memory file cannot be created.
    """

    _ids = itertools.count(1)

    def __init__(self, capacity: int) -> None:
        capacity = max(_round_up(capacity, _PAGE), _PAGE)
        try:
            fd = os.memfd_create(f"{_FD_PREFIX}-{os.getpid()}", os.MFD_CLOEXEC)
        except OSError as e:
            raise ShmError(e.errno, f"cannot create shared memory: {e.strerror}") from e
        try:
            os.ftruncate(fd, capacity)
            self.ino = os.fstat(fd).st_ino
        except OSError as e:
            os.close(fd)
            raise ShmError(e.errno, f"cannot size shared memory to {capacity} bytes: {e.strerror}") from e
        self.fd = fd
        self.capacity = capacity
        self.map: Any = None  # this process's writable mapping (a NumPy uint8 array), made at first reuse
        self._fresh = True
        self.id = (os.getpid() << 32) + next(Segment._ids)  # unique on the host: writers tell theirs apart
        self.holders: set[Hashable] = set()
        self.last_used = time.monotonic()

    @property
    def path(self) -> str:
        """What a reader on this host opens (valid while this process holds the descriptor)."""
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def write(self, buffers: list[Any], layout: list[list[int]]) -> None:
        """Copy ``buffers`` (anything with the buffer protocol) to their ``layout`` offsets: one copy each.

        Raises ShmError when the memory runs out while the pages are allocated (nothing is mapped by anybody
        then; the caller closes the segment and sends over the socket).
        """
        import numpy as np

        if self._fresh:
            self._fresh = False
            try:
                for buf, (offset, nbytes) in zip(buffers, layout, strict=False):
                    view = memoryview(buf).cast("B")
                    done = 0
                    while done < nbytes:
                        done += os.pwrite(self.fd, view[done:], offset + done)
            except OSError as e:
                raise ShmError(e.errno, f"cannot fill {self.capacity} bytes of shared memory: {e.strerror}") from e
            return
        if self.map is None:
            self.map = _map(self.fd, self.capacity, shared=True)
            # Fault the existing pages in with one read per page first: a read fault maps a run of pages at once
            # ("fault-around"), a write fault one page; this halves the cost of the first copy.
            int(self.map[::_PAGE].sum())
        dest = self.map
        for buf, (offset, nbytes) in zip(buffers, layout, strict=False):
            src = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
            np.copyto(dest[offset:offset + nbytes], src)  # releases the GIL for large copies

    def describe(self, layout: list[list[int]], length: int) -> dict:
        """The JSON-able descriptor a reader needs (it travels in a signed message header)."""
        return {"id": self.id, "path": self.path, "ino": self.ino, "length": length, "layout": layout,
                "pid": os.getpid()}

    def close(self) -> None:
        self.map = None  # unmapped when garbage (nothing else refers to it)
        try:
            os.close(self.fd)
        except OSError:
            pass


class SegmentPool:
    """The segments one writer has lent to readers, and the released ones it keeps for reuse.

    Use: ``seg = pool.acquire(n)``, ``seg.write(...)``, ``pool.lend(seg, readers)``; each reader's release
    comes back as ``give_back(seg.id, reader)``. A segment whose ``write`` failed is closed with ``seg.close()``.

    Thread-safe: the caller's thread acquires and lends, the I/O thread gives back (``ShmRelease``), a timer
    thread trims the cache.

    Parameters
    ----------
    cache_bytes:
        Most bytes of released segments kept for reuse (0: free them at once).
    idle:
        Seconds a cached segment may stay unused before it is freed.
    """

    def __init__(self, cache_bytes: int = CACHE_BYTES, idle: float = CACHE_IDLE) -> None:
        self.cache_bytes = cache_bytes
        self.idle = idle
        self._lock = threading.RLock()
        self._lent: dict[int, Segment] = {}
        self._cache: list[Segment] = []
        self._timer: threading.Timer | None = None
        self._closed = False
        self.allocated = 0  # segments created (for tests and benchmarks)
        self.reused = 0  # acquisitions served from the cache

    def acquire_filled(self, buffers: list, layout: Any, nbytes: int) -> Segment:
        """``acquire(nbytes)`` with ``buffers`` written at ``layout`` (``layout_of``); the segment is closed again
        when the write fails. Raises ShmError as ``acquire`` does."""
        seg = self.acquire(nbytes)
        try:
            seg.write(buffers, layout)
        except BaseException:
            seg.close()
            raise
        return seg

    def acquire(self, nbytes: int) -> Segment:
        """A segment of at least ``nbytes`` bytes: a cached one within 25% of the size, else a new one.

        Raises
        ------
        ShmError
            ``nbytes`` exceeds the memory available for shared memory, or allocation failed.
        """
        with self._lock:
            if self._closed:
                raise ShmError("the shared-memory pool is closed (the mesh stopped)")
            fits = [s for s in self._cache if nbytes <= s.capacity <= nbytes + nbytes // 4 + _PAGE]
            if fits:
                seg = min(fits, key=lambda s: s.capacity)
                self._cache.remove(seg)
                self.reused += 1
                return seg
        avail = available_bytes()
        if nbytes > avail:
            self.trim(0.0)  # cached segments count against the same memory
            avail = available_bytes()
            if nbytes > avail:
                raise ShmError(f"{nbytes} bytes needed but only {avail} bytes of memory are available for "
                               "shared memory")
        seg = Segment(nbytes)
        with self._lock:
            self.allocated += 1
        return seg

    def lend(self, seg: Segment, holders: Iterable[Hashable]) -> None:
        """``seg`` now belongs to ``holders`` (each gives it back once); with none it is released at once."""
        with self._lock:
            seg.holders = set(holders)
            self._lent[seg.id] = seg
        if not seg.holders:
            self._retire(seg.id)

    def give_back(self, seg_id: int, holder: Hashable) -> None:
        """``holder`` released ``seg_id`` (its mapping is gone, or it never mapped it)."""
        with self._lock:
            seg = self._lent.get(seg_id)
            if seg is None:
                return
            seg.holders.discard(holder)
            done = not seg.holders
        if done:
            self._retire(seg_id)

    def drop_holder(self, holder: Hashable) -> None:
        """``holder`` is gone (a rank died or stopped): it holds nothing any more."""
        with self._lock:
            ids = [i for i, s in self._lent.items() if holder in s.holders]
        for i in ids:
            self.give_back(i, holder)

    def _retire(self, seg_id: int) -> None:
        with self._lock:
            seg = self._lent.pop(seg_id, None)
            if seg is None:
                return
            keep = not self._closed and seg.capacity + sum(s.capacity for s in self._cache) <= self.cache_bytes
            if keep:
                seg.last_used = time.monotonic()
                self._cache.append(seg)
                self._schedule_trim()
        if not keep:
            seg.close()

    def _schedule_trim(self) -> None:
        """Under the lock: make sure a timer will free cached segments that stay idle."""
        if self._timer is None and self._cache:
            self._timer = threading.Timer(self.idle, self._on_timer)
            self._timer.daemon = True
            self._timer.name = "monarch-shm-trim"
            self._timer.start()

    def _on_timer(self) -> None:
        with self._lock:
            self._timer = None
        self.trim(self.idle)
        with self._lock:
            if not self._closed:
                self._schedule_trim()

    def trim(self, max_idle: float) -> None:
        """Free cached segments unused for more than ``max_idle`` seconds (0: all of them)."""
        now = time.monotonic()
        with self._lock:
            old = [s for s in self._cache if now - s.last_used >= max_idle]
            self._cache = [s for s in self._cache if s not in old]
        for seg in old:
            seg.close()

    def stats(self) -> dict[str, int]:
        """{"lent", "lent_bytes", "cached", "cached_bytes", "allocated", "reused"} (counts and bytes)."""
        with self._lock:
            return {"lent": len(self._lent), "lent_bytes": sum(s.capacity for s in self._lent.values()),
                    "cached": len(self._cache), "cached_bytes": sum(s.capacity for s in self._cache),
                    "allocated": self.allocated, "reused": self.reused}

    def lent_ids(self) -> set[int]:
        """The ids of the segments lent now (some holder has not given them back)."""
        with self._lock:
            return set(self._lent)

    def close(self) -> None:
        """Close every segment this writer holds; readers' mappings stay valid until they drop them."""
        with self._lock:
            self._closed = True
            segs = list(self._lent.values()) + self._cache
            self._lent.clear()
            self._cache = []
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        for seg in segs:
            seg.close()


def _map(fd: int, length: int, shared: bool) -> Any:
    """Map ``length`` bytes of the open file ``fd``: a NumPy uint8 array that owns the mapping.

    ``shared`` False maps copy-on-write. Python's own mmap keeps a duplicate of the descriptor for as long as the
    mapping lives (before Python 3.13), which would cost every held value a descriptor; torch.from_file maps
    the file and closes its descriptor at once, and unmaps when the last view of the array is gone.
    """
    import torch

    t = torch.from_file(f"/proc/self/fd/{fd}", shared=shared, size=max(length, 1), dtype=torch.uint8)
    return t.numpy()


def open_segment(desc: dict, on_release: Callable[[int], None]) -> list[memoryview]:
    """Map a writer's segment copy-on-write; returns one writable memoryview per buffer of ``desc["layout"]``.

    ``on_release(desc["id"])`` is called once when the last view is gone (from the thread that dropped it; the
    mapping goes right after); when opening fails it is not called (the caller releases the segment itself).
    No file descriptor stays open.

    Raises
    ------
    ShmUnavailableError
        The segment cannot be opened or is not the one described (it names the path and why).
    """
    path = desc["path"]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise ShmUnavailableError(e.errno, f"cannot open shared memory {path} of process {desc.get('pid')}: "
                                           f"{e.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_ino != desc["ino"] or st.st_size < desc["length"] or st.st_uid != os.getuid():
            raise ShmUnavailableError(f"{path} is not the shared memory segment the message describes "
                                      f"(inode {st.st_ino}, {st.st_size} bytes, uid {st.st_uid})")
        try:
            whole = _map(fd, desc["length"], shared=False)
        except RuntimeError as e:
            raise ShmUnavailableError(f"cannot map shared memory {path}: {e}") from None
    finally:
        os.close(fd)
    # Every view below refers to ``whole``: it (and with it the mapping) lives exactly as long as they do.
    weakref.finalize(whole, on_release, desc["id"]).atexit = False
    mv = memoryview(whole)
    return [mv[offset:offset + nbytes] for offset, nbytes in desc["layout"]]


def memfd_mappings(pid: int | str = "self") -> list[str]:
    """Lines of /proc/<pid>/maps that map a segment of this module (for tests and diagnostics)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return [line.rstrip("\n") for line in f if f"memfd:{_FD_PREFIX}" in line]
    except OSError:
        return []


def memfd_fds(pid: int | str = "self") -> list[str]:
    """Descriptors of /proc/<pid>/fd that are segments of this module (for tests and diagnostics)."""
    out = []
    base = f"/proc/{pid}/fd"
    try:
        for name in os.listdir(base):
            try:
                target = os.readlink(f"{base}/{name}")
            except OSError:
                continue
            if target.startswith(f"/memfd:{_FD_PREFIX}"):
                out.append(target)
    except OSError:
        pass
    return out
