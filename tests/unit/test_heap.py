"""When a rank or the kernel gives freed heap memory back (monarch_worker.heap.IdleTrim): only once idle after work,
once per idle spell."""

from __future__ import annotations

from monarch_worker import heap


def test_nothing_is_due_before_any_work() -> None:
    idle = heap.IdleTrim(delay=0.0)
    assert idle.timeout() is None
    assert not idle.maybe_trim()
    assert idle.trims == 0


def test_a_trim_waits_for_the_delay_and_runs_once() -> None:
    idle = heap.IdleTrim(delay=3600.0)
    idle.worked()
    timeout = idle.timeout()
    assert timeout is not None and timeout > 3000
    assert not idle.maybe_trim()  # not idle long enough
    idle.delay = 0.0
    idle.worked()  # more work: the delay counts from now
    assert idle.timeout() == 0.0
    assert idle.maybe_trim()
    assert not idle.maybe_trim()  # once per idle spell
    assert idle.timeout() is None and idle.trims == 1
