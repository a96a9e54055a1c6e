"""Anyone who can reach the controller's port can send it garbage: every message is rejected and the mesh stays
usable, but the warnings are rate-limited (the first few, then a count per minute), so the notebook's output cannot
be flooded (issue 16, item 6)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import pytest
import zmq

from monarch_jupyter import Mesh
from monarch_jupyter.kernel import lograte

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    """A mesh of its own (the session's is stopped by tests/integration/test_magics.py's unload_ext, which runs
    after this module)."""
    with Mesh(2, start_timeout=120) as m:
        yield m


def test_a_flood_of_forged_messages_is_rejected_and_logged_at_a_bounded_rate(
        mesh: Mesh, caplog: pytest.LogCaptureFixture) -> None:
    what = "messages dropped by the controller"
    # Earlier tests in this process may have spent this period's burst: end their periods first (a flood's, then
    # the calm one after it), so that this flood starts a period of its own.
    start = time.monotonic()
    lograte.REJECTED.flush(start + 2 * lograte.REJECTED.period)
    lograte.REJECTED.flush(start + 4 * lograte.REJECTED.period)
    caplog.set_level(logging.WARNING, logger="monarch_jupyter")
    caplog.clear()
    before = lograte.REJECTED.seen.get(what, 0)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(mesh.address)
        for i in range(250):  # garbage, and frames shaped like ours with a wrong signature
            frames = [os.urandom(40)] if i % 2 else [b"MJ\x01", os.urandom(32), b"header", b"payload"]
            sock.send_multipart(frames)
        deadline = time.monotonic() + 60
        while lograte.REJECTED.seen.get(what, 0) - before < 250 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lograte.REJECTED.seen.get(what, 0) - before == 250, "not every forged message was seen"
    finally:
        sock.close()
        ctx.term()
    logged = [r for r in caplog.records if r.name.startswith("monarch_jupyter") and "dropped" in r.getMessage()]
    assert 1 <= len(logged) <= lograte.REJECTED.burst, [r.getMessage() for r in logged]
    caplog.clear()
    now = time.monotonic()
    lograte.REJECTED.flush(now + lograte.REJECTED.period)  # the minute is over: one count
    counts = [r.getMessage() for r in caplog.records]
    lograte.REJECTED.flush(now + 3 * lograte.REJECTED.period)  # a calm minute after it: the next flood logs again
    assert len(counts) == 1 and f"more {what} in the last 60 s" in counts[0], counts
    assert mesh.run("rank * 2") == {0: 0, 1: 2}  # the mesh is still fine
