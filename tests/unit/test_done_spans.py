"""A host's ``done`` ranks as one ``span`` event (issue 30, O(hosts) controller): the agent's batch compacts a run of
consecutive ranks, in whatever order they finished, into (start, stop, durations as float64 bytes); the controller's
cell table records it with one range step and gives every rank its own duration back when a view asks."""

from __future__ import annotations

from monarch_jupyter.kernel.cells import CellTable
from monarch_jupyter.kernel.config import MeshOptions
from monarch_jupyter.kernel.events import EventBus
from monarch_jupyter.kernel.output import OutputWriter
from monarch_jupyter.kernel.state import MeshState
from monarch_worker import protocol as P
from monarch_worker.hostlink import EventBatch, compact_done


def _result(cell_id: int, seconds: float) -> P.Result:
    return P.Result(cell_id, "ok", False, None, seconds)


def test_a_hosts_ranks_that_finished_in_any_order_go_as_one_span() -> None:
    batch = EventBatch(hold=0.02)
    for rank, seconds in ((6, 0.6), (4, 0.4), (5, 0.5)):
        batch.result(rank, _result(7, seconds), b"", [])
    msg, _, _ = batch.take()
    (event,) = msg.events
    assert event[:4] == ("span", 7, 4, 7)
    assert P.unpack_durations(event[4]) == [0.4, 0.5, 0.6]  # in rank order, each with its own rank's seconds


def test_ranks_with_a_gap_or_a_line_between_stay_done_events() -> None:
    assert compact_done(("done", 1, [4, 6], [1.0, 2.0])) == ("done", 1, [4, 6], [1.0, 2.0])
    assert compact_done(("done", 1, [3], [1.0])) == ("done", 1, [3], [1.0])
    batch = EventBatch(hold=0.02)
    batch.result(0, _result(2, 0.1), b"", [])
    batch.line(1, "stdout", "hi")  # later results go after the line: a second event
    batch.result(1, _result(2, 0.2), b"", [])
    kinds = [e[0] for e in batch.take()[0].events]
    assert kinds == ["done", "out", "done"]


def test_the_cell_table_takes_a_span_and_gives_per_rank_durations_back() -> None:
    state = MeshState(8, MeshOptions(), EventBus())
    state.new_generation(b"s" * 32)
    table = CellTable(state, OutputWriter())
    handle = table.new(3, list(range(8)), "the cell", "arrival", waiter=None)  # type: ignore[arg-type]
    with state.lock:
        table.register(handle.record)
    table.on_done(3, range(4, 8), P.pack_durations([0.4, 0.5, 0.6, 0.7]))
    assert not handle.done()
    table.on_done(3, [2, 0, 3, 1], [0.2, 0.0, 0.3, 0.1])  # an agent that sent the list form
    assert handle.done()
    snap = handle.snapshot()
    assert snap.finished == set(range(8))
    assert snap.durations == {r: r / 10 for r in range(8)}
    try:
        table.on_done(3, range(2), P.pack_durations([0.1]))
    except ValueError as e:
        assert "2 ranks and 1 durations" in str(e)
    else:
        raise AssertionError("a span whose durations do not match its ranks was taken")
