"""Throttled progress reports (monarch_worker.live): a report held back by the throttle goes out once its interval
is over, without waiting for another report or the end of the cell, and reports are numbered in the order made.

Each case runs in a fresh interpreter: ``live.install`` routes this process's reports and hooks tqdm for good.
"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, threading, time
from monarch_worker import live
sent, lock = [], threading.Lock()
def send(msg):
    with lock:
        sent.append((msg.n, msg.postfix, msg.seq, threading.current_thread().name))
def wait_for(count, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with lock:
            if len(sent) >= count:
                return
        time.sleep(0.005)
    raise SystemExit(f"only {len(sent)} reports after {timeout} s")
live.install(send, lambda: 7)
"""


def _run(body: str) -> list:
    code = SCRIPT + body + "\nprint(json.dumps(sent))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_held_back_report_goes_out_when_its_interval_is_over() -> None:
    sent = _run("""
live.progress(1, 10, loss=1.0)
live.progress(1, 10, loss=0.5)  # within the interval: held back, and nothing else follows (a long step)
wait_for(2)
""")
    assert [(n, postfix) for n, postfix, _, _ in sent] == [(1.0, "loss=1"), (1.0, "loss=0.5")]
    assert sent[1][3] == "monarch-progress"  # the timer thread sent it
    assert [seq for _, _, seq, _ in sent] == [1, 2]


def test_a_burst_sends_few_reports_and_always_its_last() -> None:
    sent = _run("""
for i in range(1, 2001):
    live.progress(i, None)
wait_for(1)
t = time.monotonic()
while time.monotonic() - t < 5 and sent[-1][0] != 2000.0:
    time.sleep(0.01)
""")
    assert sent[-1][0] == 2000.0
    assert len(sent) < 200  # throttled: a tight loop costs a time check per call, not a message
    seqs = [seq for _, _, seq, _ in sent]
    assert seqs == sorted(seqs) and seqs[-1] == 2000


def test_flush_at_the_end_of_a_cell_sends_the_held_report_once() -> None:
    sent = _run("""
live.progress(1, 10)
live.progress(2, 10)
live.flush()  # the runtime's end of cell
time.sleep(0.3)  # past the interval: the timer finds nothing left to send
""")
    assert [n for n, _, _, _ in sent] == [1.0, 2.0]


def test_an_interrupt_that_lands_as_the_timer_starts_leaves_later_reports_flowing() -> None:
    """The cell's interrupt can land after the timer of a held-back report was made but before it started: every
    later report held back waited for the end of the cell then, in every later cell too (helper-58, by reading)."""
    sent = _run("""
live.MIN_INTERVAL = 1.0
start = threading.Timer.start
def interrupted(self):
    threading.Timer.start = start
    raise KeyboardInterrupt
threading.Timer.start = interrupted
live.progress(1, 10)
try:
    live.progress(2, 10)  # held back: its timer is made, and the interrupt lands as it starts
except KeyboardInterrupt:
    pass
live.progress(3, 10)  # held back too (within the interval): its timer sends it
wait_for(2)
""")
    assert [n for n, _, _, _ in sent] == [1.0, 3.0]
