"""Mesh events (kernel/events.py): "output" events wait for the events thread's next batch; every event still
reaches every listener once, in the order emitted, and ``flush`` delivers what waits at once."""

from __future__ import annotations

import threading

from monarch_jupyter.kernel.events import EventBus


def test_output_events_and_the_events_around_them_arrive_once_in_order() -> None:
    bus = EventBus()
    seen: list[tuple[str, int]] = []
    done = threading.Event()

    def listen(kind: str, data: dict) -> None:
        seen.append((kind, data["i"]))
        if kind == "cell_done":
            done.set()

    bus.add(listen)
    sent = []
    for i in range(2000):
        kind = "output" if i % 500 else "rank_state"
        bus.emit(kind, i=i)
        sent.append((kind, i))
    bus.emit("cell_done", i=2000)
    sent.append(("cell_done", 2000))
    assert done.wait(10.0)
    assert bus.flush(10.0)
    assert seen == sent


def test_flush_delivers_waiting_output_events() -> None:
    """Output events that wait for the next batch are delivered by ``flush`` (the waiter of a cell calls it before
    it returns: the views saw everything the cell printed)."""
    bus = EventBus()
    seen: list[int] = []
    bus.add(lambda kind, data: seen.append(data["i"]))
    for rounds in range(20):
        for i in range(50):
            bus.emit("output", i=rounds * 50 + i)
        assert bus.flush(10.0)
        assert seen == list(range((rounds + 1) * 50))
