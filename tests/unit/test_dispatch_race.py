"""The work pipes' waiting set against the pipes' own state, when the I/O thread flushes while another thread sends.

Found by reading (issue 25): ``Dispatcher.flush_pipes`` (I/O thread) flushed a pipe, then dropped it from the set
of pipes with bytes still to write, outside the lock ``_send_work`` (the caller's thread) takes to queue bytes and
add the pipe. Work queued in between stayed in the pipe with nobody to write it: a cell that hangs. The test makes
the window wide and certain: the pipe's flush stops right after it has emptied the pipe, lets another thread send,
and goes on only when that send has returned or had to wait. The pipe is a real pipe, filled so that sends wait.
"""

from __future__ import annotations

import os
import threading

from monarch_jupyter.kernel.cells import CellTable
from monarch_jupyter.kernel.config import MeshOptions
from monarch_jupyter.kernel.dispatch import Dispatcher
from monarch_jupyter.kernel.events import EventBus
from monarch_jupyter.kernel.output import OutputWriter
from monarch_jupyter.kernel.state import MeshState
from monarch_worker import messages as M
from monarch_worker.pipes import WorkPipe


class PausingPipe(WorkPipe):
    """A work pipe whose flush pauses after it emptied the pipe, until ``resume`` (or 2 s: the send is blocked)."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd)
        self.armed = False
        self.flushed = threading.Event()
        self.resume = threading.Event()

    def flush(self) -> bool:
        done = super().flush()
        if done and self.armed and not self.flushed.is_set():
            self.flushed.set()
            self.resume.wait(2.0)  # the sender either ran in this window (the race) or waits for the flush to end
        return done


def test_work_sent_while_the_io_thread_flushes_is_never_forgotten() -> None:
    state = MeshState(1, MeshOptions(), EventBus())
    dispatcher = Dispatcher(state, CellTable(state, OutputWriter()))
    dispatcher.new_generation(b"s" * 32)
    read_fd, write_fd = os.pipe()
    pipe = PausingPipe(write_fd)
    try:
        big = M.Exec(1, "x" * (8 << 20), "<cell>", {})  # more than the pipe holds: part of it waits
        dispatcher._send_work([pipe], big, b"", [])
        assert dispatcher.pipes_waiting and pipe.pending
        while pipe.pending:  # the rank reads what was sent: the pipe empties
            os.read(read_fd, 1 << 20)
            pipe.flush()
        # Left in the waiting set on purpose: the next flush_pipes finds nothing pending and drops it.
        pipe.armed = True
        io = threading.Thread(target=dispatcher.flush_pipes)
        io.start()
        assert pipe.flushed.wait(10)
        sent = threading.Event()

        def send() -> None:
            dispatcher._send_work([pipe], big, b"", [])  # the pipe is empty but too small: part waits again
            sent.set()

        sender = threading.Thread(target=send)
        sender.start()
        if sent.wait(2.0):
            pipe.resume.set()
        io.join(10)
        sender.join(10)
        assert not io.is_alive() and not sender.is_alive()
        assert pipe.pending, "the second message should not fit in the pipe"
        assert dispatcher.pipes_waiting, "bytes wait in the pipe, but the I/O thread no longer knows to write them"
        assert write_fd in dispatcher.waiting_fds()
    finally:
        pipe.close()
        os.close(read_fd)
