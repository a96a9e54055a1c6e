"""The rate limit of the controller's warnings about rejected messages (kernel/lograte.py), on a fake clock."""

from __future__ import annotations

import logging

import pytest

from monarch_jupyter.kernel import lograte


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_first_few_then_one_count_per_period(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    limit = lograte.RateLimit(burst=3, period=60.0, clock=clock)
    log = logging.getLogger("monarch_jupyter.test_lograte")
    log.addFilter(limit)
    try:
        caplog.set_level(logging.WARNING, logger=log.name)
        flood = lograte.kind("forged messages")
        for i in range(100):
            log.warning("forged %d", i, extra=flood)
        log.warning("unrelated")  # records without a kind pass untouched
        texts = [r.getMessage() for r in caplog.records]
        assert texts[:3] == ["forged 0", "forged 1",
                             "forged 2 (more like this are counted, not logged, for 60 s)"]
        assert texts[3:] == ["unrelated"] and limit.seen["forged messages"] == 100
        caplog.clear()

        clock.now += 30
        limit.flush()
        assert not caplog.records  # the period has not ended
        clock.now += 31
        limit.flush()
        assert [r.getMessage() for r in caplog.records] == [
            "97 more forged messages in the last 60 s (each one rejected)"]
        caplog.clear()

        # The flood goes on: only a count per period, no burst.
        for i in range(50):
            log.warning("forged %d", i, extra=flood)
        assert not caplog.records
        clock.now += 61
        log.warning("forged again", extra=flood)  # ends the period: its count first
        assert [r.getMessage() for r in caplog.records] == [
            "50 more forged messages in the last 60 s (each one rejected)"]
        caplog.clear()

        # A calm period, then a new flood starts with a burst again.
        clock.now += 61
        limit.flush()
        assert [r.getMessage() for r in caplog.records] == [
            "1 more forged messages in the last 60 s (each one rejected)"]
        clock.now += 61
        limit.flush()
        caplog.clear()
        log.warning("forged new", extra=flood)
        assert [r.getMessage() for r in caplog.records] == ["forged new"]
    finally:
        log.removeFilter(limit)
