"""The debugger's pieces in-process: the rank's remote pdb against a fake rank, command splitting, messages."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import pytest

from monarch_jupyter.kernel.debugger import MESH_HELP, split_commands
from monarch_worker import protocol as P
from monarch_worker.debugger import RankDebugger


class FakeRank:
    """What RankDebugger uses of a Rank: its number, current cell, namespace, an outbox, and the cells whose
    KeyboardInterrupt is an interrupt (note_interrupt)."""

    def __init__(self) -> None:
        self.rank = 3
        self.current_cell = 5
        self.ns = None
        self._main_ident = threading.get_ident()
        self.sent: queue.Queue = queue.Queue()
        self.interrupted: set[int] = set()

    def send(self, msg: P.Message, value: Any = None, *, with_value: bool = False) -> None:
        self.sent.put(msg)

    def note_interrupt(self, cell_id: int) -> None:
        self.interrupted.add(cell_id)


def converse(target: Callable[[RankDebugger], Any], answers: list[Any]) -> tuple[Any, list[P.Message]]:
    """Run ``target(debugger)`` in a thread (the debugged thread) and answer its prompts from this one, as the
    rank's I/O thread would; an answer ("action", name) sends an action instead of a line."""
    rank = FakeRank()
    dbg = RankDebugger(rank)  # type: ignore[arg-type]
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            with dbg.keeping():
                outcome["value"] = target(dbg)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            outcome["error"] = e
            outcome["kept"] = dbg.error
        finally:
            dbg.cell_finished()
            rank.sent.put(None)

    thread = threading.Thread(target=run)
    thread.start()
    seen: list[P.Message] = []
    while (msg := rank.sent.get(timeout=10)) is not None:
        seen.append(msg)
        if isinstance(msg, P.DebugPrompt):
            answer = answers.pop(0)
            if isinstance(answer, tuple):
                dbg.on_input(P.DebugInput(msg.prompt_id, action=answer[1]), b"", [])
            elif answer == "interrupt":
                assert dbg.on_interrupt(rank.current_cell)
            else:
                dbg.on_input(P.DebugInput(msg.prompt_id + 100, line="p 'stale'"), b"", [])  # dropped
                dbg.on_input(P.DebugInput(msg.prompt_id, line=answer), b"", [])
    thread.join(10)
    assert not answers
    return outcome.get("value", outcome.get("error")), seen


def output(seen: list[P.Message]) -> str:
    return "".join(m.text for m in seen if isinstance(m, P.DebugOutput))


def stops_then_returns(dbg: RankDebugger) -> int:
    x = 41
    dbg.set_trace()
    y = x + 1
    return y


def test_prompts_output_and_how_the_rank_resumes() -> None:
    value, seen = converse(stops_then_returns, ["p x", "n", "p y", "c"])
    assert value == 42
    prompts = [m for m in seen if isinstance(m, P.DebugPrompt)]
    assert [p.prompt for p in prompts] == ["(Pdb) "] * 4
    assert prompts[0].function == "stops_then_returns" and prompts[0].cell_id == 5
    assert prompts[2].lineno == prompts[0].lineno + 1  # after n
    assert [m.how for m in seen if isinstance(m, P.DebugResumed)] == ["step", "continue"]
    text = output(seen)
    assert "-> y = x + 1" in text and "41\n" in text and "42\n" in text and "stale" not in text


def test_continue_action_and_raise_action() -> None:
    value, seen = converse(stops_then_returns, [("action", "continue")])
    assert value == 42 and [m.how for m in seen if isinstance(m, P.DebugResumed)] == ["continue"]
    error, seen = converse(stops_then_returns, [("action", "raise")])
    assert isinstance(error, KeyboardInterrupt)  # (kept for post-mortem: it is dbg.error, checked below)
    assert [m.how for m in seen if isinstance(m, P.DebugResumed)] == ["raise"]
    # The kept traceback ends in the user's frame, not in pdb's.
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_name == "stops_then_returns"


def test_interrupt_at_the_prompt_raises_there() -> None:
    error, seen = converse(stops_then_returns, ["interrupt"])
    assert isinstance(error, KeyboardInterrupt)


def test_pythonbreakpoint_0(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONBREAKPOINT", "0")
    value, seen = converse(lambda dbg: (dbg.breakpointhook(), 7)[1], [])
    assert value == 7 and seen == []


def test_split_commands() -> None:
    assert split_commands("p x; up; p y") == ["p x", "up", "p y"]
    assert split_commands("p 'a;b'; p f(1, [2; 3]) ; c;") == ["p 'a;b'", "p f(1, [2; 3])", "c"]
    assert split_commands(["p x", "c"]) == ["p x", "c"]
    assert split_commands("") == [] and split_commands(None) is None


def test_mesh_help_names_the_mesh_commands() -> None:
    for command in ("ranks", "rank K", "cast SPEC CMD", "c all", "detach"):
        assert command in MESH_HELP


def test_debug_messages_roundtrip() -> None:
    tx, rx = P.Signer(b"k" * 32), P.Signer(b"k" * 32)
    for msg in (P.DebugOutput("text\n"), P.DebugPrompt(3, "(Pdb) ", "pdb", 7, "<mesh In[2]>", 4, "<module>"),
                P.DebugResumed("step"), P.DebugInput(3, "p x"), P.DebugInput(3, action="raise"),
                P.DebugPostMortem(9), P.Inspect(11, "loss.item()", True), P.DebugClear(12),
                P.DebugReply(11, True, "0.5", "running", "<mesh In[2]> line 4, in <module>", 7)):
        assert rx.unpack(tx.pack(msg))[0] == msg
