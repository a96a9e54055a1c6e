"""pdb on real ranks through the Python API: breakpoint(), mesh commands, post-mortem, inspect, interrupts.

The person at the keyboard is a scripted ``mesh.debugger.input``; the real kernel's stdin channel is exercised in
test_debugger_kernel.py.
"""

from __future__ import annotations

import io
import re
import textwrap
import time
from collections.abc import Callable, Iterator

import pytest

from monarch_jupyter import Mesh, MeshError, MeshTimeoutError
from monarch_jupyter.kernel.postmortem import NothingToDebugError

pytestmark = pytest.mark.slow


class Person:
    """Answers pdb prompts from a list; ``on_prompt(prompt)`` runs before each answer (e.g. to check state)."""

    def __init__(self, answers: list[str], on_prompt: Callable[[str], None] | None = None) -> None:
        self.answers = list(answers)
        self.prompts: list[str] = []
        self.on_prompt = on_prompt

    def __call__(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if self.on_prompt is not None:
            self.on_prompt(prompt)
        if not self.answers:
            raise AssertionError(f"unexpected prompt {prompt!r}")
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException) or (isinstance(answer, type) and issubclass(answer, BaseException)):
            raise answer
        print(f"{prompt}{answer}")
        return answer


@pytest.fixture(scope="module")
def mesh4() -> Iterator[Mesh]:
    m = Mesh(4, start_timeout=120)
    yield m
    m.stop()


@pytest.fixture()
def dbg(mesh4: Mesh) -> Iterator[Mesh]:
    """A 4-rank mesh with its debugger settings restored (and its ranks' tracebacks dropped) after each test.

    The first stop of a cell waits for every rank of the cell to stop or finish (not only 0.25 s), so that which
    rank is offered first does not depend on the load of the machine."""
    mesh4.debugger.first_stop_settle = 30.0
    yield mesh4
    mesh4.debugger.first_stop_settle = 0.25
    mesh4.debugger.input = None
    mesh4.debugger.on_interrupt = "continue"
    mesh4.debugger.clear()


def run(mesh: Mesh, code: str, **kw: object) -> object:
    return mesh.run(textwrap.dedent(code), **kw)


def wait_states(mesh: Mesh, want: dict[int, str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = {r: s["state"] for r, s in mesh.status().items()}
        if all(states[r] == s for r, s in want.items()):
            return
        time.sleep(0.05)
    raise AssertionError(f"rank states {states}, expected {want}")


def test_one_rank_stops_while_the_others_finish(dbg: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[dict] = []

    def check(prompt: str) -> None:
        if not seen:  # at the first prompt: the other ranks finished the cell meanwhile
            wait_states(dbg, {0: "idle", 1: "idle", 2: "running", 3: "idle"})
            seen.append(dbg.debugger.stopped())

    dbg.debugger.input = person = Person(["p x", "l", "ll", "w", "n", "p y", "c"], check)
    out = run(dbg, """
        x = rank * 10
        if rank == 2:
            breakpoint()
        y = x + 1
        z = y * 2
        z
    """, filename="<dbg one>")
    assert out == {0: 2, 1: 22, 2: 42, 3: 62}
    assert set(person.prompts) == {"(Pdb rank 2) "} and len(person.prompts) == 7
    assert seen == [{2: "<dbg one> line 5, in <module>"}]
    text = capsys.readouterr().out
    assert "--- rank 2 stopped at <dbg one> line 5, in <module>" in text
    assert "> <dbg one>(5)<module>()\n-> y = x + 1\n(Pdb rank 2) p x\n20\n" in text
    # l and ll show the cell's own source (registered in the rank's linecache), w the cell frame only.
    assert "  5  ->\ty = x + 1" in text and "  2  \tx = rank * 10" in text
    assert "(Pdb rank 2) w\n> <dbg one>(5)<module>()\n-> y = x + 1\n(Pdb rank 2) n" in text
    assert "monarch_worker" not in text and "runtime.py" not in text
    assert "(Pdb rank 2) p y\n21\n" in text
    # Nothing is left traced: later cells run at full speed and pdb's marks are gone from the namespace.
    assert run(dbg, "import sys\n(sys.gettrace(), '__return__' in globals())") == dict.fromkeys(range(4), (None, False))


def test_two_ranks_stopped_at_once(dbg: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    dbg.debugger.input = person = Person(["ranks", "cast 1,2 p x * 2", "cast all p x", "c", "p x", "c"])
    out = run(dbg, """
        x = rank * 10
        dist.barrier()
        if rank in (1, 2):
            breakpoint()
        y = x + 1
        y
    """, filename="<dbg two>")
    assert out == {0: 1, 1: 11, 2: 21, 3: 31}
    assert person.prompts == ["(Pdb rank 1) "] * 4 + ["(Pdb rank 2) "] * 2
    text = capsys.readouterr().out
    assert "--- rank 1 stopped at <dbg two> line 6, in <module>; also stopped: rank 2" in text
    assert "* rank 1: stopped at <dbg two> line 6, in <module>: y = x + 1\n" in text
    assert "  rank 2: stopped at <dbg two> line 6, in <module>: y = x + 1\n" in text
    assert "  ranks 0,3: not stopped\n" in text
    # Each answer is labelled; rank 2's first lines say where it stopped (not shown before: it was not current).
    assert ("(Pdb rank 1) cast 1,2 p x * 2\n[rank1]: 20\n[rank2]: > <dbg two>(6)<module>()\n"
            "[rank2]: -> y = x + 1\n[rank2]: 40\n") in text
    assert "cast: ranks 0,3 not stopped at a prompt; skipped\n[rank1]: 10\n[rank2]: 20\n" in text
    # c lets rank 1 go on; rank 2 is offered next.
    assert "(Pdb rank 1) c\n--- rank 2 stopped at <dbg two> line 6" in text
    assert "(Pdb rank 2) p x\n20\n" in text


def test_stepping_keeps_the_rank_and_attach(dbg: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    dbg.debugger.input = person = Person(["n", "n", "p z", "c", "c"])
    out = run(dbg, "dist.barrier()\nif rank in (1, 2):\n    breakpoint()\nz = 1\nz = 2\nz\n")
    assert out == dict.fromkeys(range(4), 2)
    # n and n again: rank 1 is offered again (although rank 2 waits), until it continues.
    assert person.prompts == ["(Pdb rank 1) "] * 4 + ["(Pdb rank 2) "]
    assert "(Pdb rank 1) p z\n2\n" in capsys.readouterr().out
    # A rank stopped in a cell nobody waits for: attach() talks to it.
    handle = dbg.run("x = rank\nif rank == 3:\n    breakpoint()\nx\n", block=False)
    deadline = time.monotonic() + 30
    while not dbg.debugger.stopped() and time.monotonic() < deadline:
        time.sleep(0.05)
    dbg.debugger.input = person = Person(["p x", "c"])
    assert dbg.debugger.attach()
    assert person.prompts == ["(Pdb rank 3) "] * 2 and "(Pdb rank 3) p x\n3\n" in capsys.readouterr().out
    assert handle.result(timeout=30) == {r: r for r in range(4)}
    assert not dbg.debugger.attach()


def test_switch_continue_all_and_detach(dbg: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    def all_three_stopped(prompt: str) -> None:
        deadline = time.monotonic() + 30
        while len(person.prompts) == 1 and set(dbg.debugger.stopped()) != {0, 2, 3} and time.monotonic() < deadline:
            time.sleep(0.05)

    dbg.debugger.first_stop_settle = 0.25  # rank 1 neither stops nor finishes (it waits in the barrier)
    dbg.debugger.input = person = Person(["rank 1", "rank 3", "p rank", "c all", "detach"], all_three_stopped)
    out = run(dbg, """
        dist.barrier()
        if rank != 1:
            breakpoint()
        dist.barrier()
        breakpoint()
        breakpoint()
        rank
    """, filename="<dbg all>")
    assert out == {r: r for r in range(4)}
    text = capsys.readouterr().out
    first = person.prompts[0]
    assert person.prompts[:4] == [first, first] + ["(Pdb rank 3) "] * 2 and len(person.prompts) == 5
    assert f"{first}rank 1\nrank 1 is not stopped at a prompt (stopped: 0,2,3)\n" in text
    assert f"{first}rank 3\n--- rank 3 stopped at <dbg all> line 5, in <module>; also stopped: ranks 0,2\n" in text
    assert "(Pdb rank 3) p rank\n3\n(Pdb rank 3) c all\nranks 0,2,3 continue\n" in text
    # The second breakpoint stops every rank; detach lets them go and skips the third breakpoint.
    assert "detached: rank" in text
    assert text.count("it continues: the debugger is detached for this cell") >= 4


def test_pdb_commands_work_on_a_rank(dbg: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    answers = ["s", "s", "display a", "n", "u", "d", "r", "b 9", "c", "cl 1", "interact",
               "print('inside', x)", "for i in range(2):", "    print('i', i)", "", "exit()",
               "pp {'k': [1, 2]}", "whatis f", "c"]
    dbg.debugger.input = Person(answers)
    out = run(dbg, """
        def f(a):
            a = a + 1
            return a * 2
        x = rank
        import pdb
        pdb.set_trace(header="stopping here")
        y = f(x)
        w = y + 1
        w
    """, ranks=[0], filename="<dbg cmds>")
    assert out == {0: 3}
    text = capsys.readouterr().out
    assert "stopping here\n> <dbg cmds>(8)<module>()" in text  # pdb.set_trace works, with its header
    assert "--Call--\n> <dbg cmds>(2)f()" in text
    assert "(Pdb rank 0) display a\ndisplay a: 0\n" in text
    assert "display a: 1  [old: 0]" in text
    assert "(Pdb rank 0) u\n> <dbg cmds>(8)<module>()" in text and "(Pdb rank 0) d\n> <dbg cmds>(4)f()" in text
    assert "--Return--\n> <dbg cmds>(4)f()->2" in text
    assert "Breakpoint 1 at <dbg cmds>:9" in text and "(Pdb rank 0) c\n> <dbg cmds>(9)<module>()" in text
    assert "Deleted breakpoint 1 at <dbg cmds>:9" in text
    assert "inside 0\n" in text and "i 0\ni 1\n" in text and "[rank0]: >>> " in text
    assert "{'k': [1, 2]}" in text and "Function f" in text


def test_scripted_commands_then_continue(dbg: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    with dbg.debugger.options(commands="p x; p (x, 'a;b'); c"):
        out = run(dbg, """
            x = rank
            if rank == 1:
                breakpoint()
                x += 1
                breakpoint()
                x += 1
            x
        """, filename="<dbg script>")
    assert out == {0: 0, 1: 3, 2: 2, 3: 3}
    text = capsys.readouterr().out
    assert "(Pdb rank 1) p x\n1\n(Pdb rank 1) p (x, 'a;b')\n(1, 'a;b')\n(Pdb rank 1) c\n" in text
    assert "(Pdb rank 1) (no scripted pdb command left: continue)" in text
    with dbg.debugger.options(commands=["p 1", "p 2"]):
        run(dbg, "1")
    assert "scripted pdb command(s) not used (no prompt asked for them): p 1; p 2" in capsys.readouterr().out


def test_no_stdin_lets_ranks_continue(dbg: Mesh, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # a script without a terminal: nobody to ask
    assert run(dbg, "x = rank\nbreakpoint()\nx") == {r: r for r in range(4)}
    text = capsys.readouterr().out
    assert "no one can answer pdb prompts here (this frontend has no stdin)" in text
    assert text.count("it continues: nobody can answer its prompt here (no stdin)") == 3
    dbg.debugger.input = Person([EOFError])  # an input() that says so itself
    assert run(dbg, "if rank == 0: breakpoint()\nrank") == {r: r for r in range(4)}
    assert "no one can answer pdb prompts here" in capsys.readouterr().out


def test_interrupt_at_the_prompt_continues(dbg: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    dbg.debugger.input = Person([KeyboardInterrupt])
    out = run(dbg, """
        x = rank
        if rank == 3:
            breakpoint()
            x += 1
            breakpoint()
        x
    """, filename="<dbg int>")
    assert out == {0: 0, 1: 1, 2: 2, 3: 4}
    text = capsys.readouterr().out
    assert "interrupted at the debugger prompt: rank 3 continues" in text
    assert "[rank3]: stopped at <dbg int> line 7, in <module>; it continues: the debugger is detached" in text


def test_interrupt_at_the_prompt_raises(dbg: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    dbg.debugger.input = Person([KeyboardInterrupt])
    with dbg.debugger.options(on_interrupt="raise"), pytest.raises(KeyboardInterrupt):
        run(dbg, "x = rank\nif rank == 1: breakpoint()\ny = 1\n", filename="<dbg raise>")
    assert "rank 1 raises KeyboardInterrupt where it stopped" in capsys.readouterr().out
    # Post-mortem sees where rank 1 stopped.
    with dbg.debugger.options(commands="p x"):
        dbg.debugger.post_mortem(1)
    # The KeyboardInterrupt comes from the debugger's answer or from the cell's interrupt, whichever reaches the
    # rank first (its message differs); either way rank 1 stopped where it was, line 3.
    out = capsys.readouterr().out
    assert re.search(r"KeyboardInterrupt(: interrupted at the debugger prompt)?\n> <dbg raise>\(3\)<module>\(\)\n",
                     out), out
    assert run(dbg, "import sys\nsys.gettrace() is None") == dict.fromkeys(range(4), True)


def test_quit_raises_on_that_rank_only(dbg: Mesh) -> None:
    with dbg.debugger.options(commands="q"), pytest.raises(MeshError) as info:
        run(dbg, "if rank == 2: breakpoint()\nrank")
    assert list(info.value.errors) == [2] and info.value.errors[2].ename == "BdbQuit"
    tb = info.value.errors[2].traceback  # it shows the cell's line, not pdb's and bdb's frames
    assert ", line 2, in <module>\n    rank\n" in tb and "bdb.py" not in tb and "monarch_worker" not in tb
    assert info.value.results == {0: 0, 1: 1, 3: 3}


def test_time_at_the_prompt_does_not_count_against_the_cell_timeout(dbg: Mesh) -> None:
    dbg.debugger.input = Person(["c"], on_prompt=lambda prompt: time.sleep(1.5))
    assert run(dbg, "if rank == 0: breakpoint()\nrank", timeout=1.0) == {r: r for r in range(4)}
    with pytest.raises(MeshTimeoutError):  # the timeout still applies to running code
        run(dbg, "import time\ntime.sleep(30)", ranks=[0], timeout=1.0)


def test_pythonbreakpoint_0_turns_breakpoints_off(dbg: Mesh) -> None:
    dbg.debugger.input = Person([])  # any prompt fails the test
    code = "import os\nos.environ['PYTHONBREAKPOINT'] = '0'\nbreakpoint()\ndel os.environ['PYTHONBREAKPOINT']\nrank"
    assert run(dbg, code) == {r: r for r in range(4)}


def test_post_mortem(dbg: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(MeshError):
        run(dbg, """
            def f(a):
                b = a * 2
                return 1 / (a - 1) if a < 3 else [][a]
            f(rank)
        """, filename="<dbg pm>")
    assert dbg.debugger.last_failed_rank() in (1, 3)
    dbg.debugger.post_mortem(1, commands="p a; p b; up; p rank; w")
    text = capsys.readouterr().out
    assert "--- post-mortem of rank 1 at <dbg pm> line 4, in f" in text
    assert "ZeroDivisionError: division by zero\n> <dbg pm>(4)f()" in text
    assert "(Pdb rank 1) p a\n1\n(Pdb rank 1) p b\n2\n(Pdb rank 1) up\n> <dbg pm>(5)<module>()" in text
    assert "(Pdb rank 1) p rank\n1\n" in text
    with pytest.raises(MeshError):  # a failed transfer is not a cell: the kept tracebacks stay
        dbg.pull("no_such_name", ranks=3)
    dbg.debugger.post_mortem(3, commands=["p a", "c"])
    assert "IndexError: list index out of range" in capsys.readouterr().out
    assert dbg.debugger.clear() == [1, 3]
    with pytest.raises(NothingToDebugError, match="keeps no traceback"):
        dbg.debugger.post_mortem(1)
    with pytest.raises(NothingToDebugError, match="no rank keeps a traceback"):
        dbg.debugger.post_mortem()
    # The next cell on a rank drops its traceback.
    with pytest.raises(MeshError):
        run(dbg, "1 / 0", ranks=[2])
    assert dbg.debugger.last_failed_rank() == 2
    run(dbg, "1", ranks=[2])
    with pytest.raises(NothingToDebugError):
        dbg.debugger.post_mortem(2)


def test_inspect_a_busy_rank(dbg: Mesh, tmp_path: object) -> None:
    stop = f"{tmp_path}/stop"
    handle = dbg.run(textwrap.dedent(f"""
        import os, time
        def work():
            step = 0
            while not os.path.exists({stop!r}):
                step += 1
                time.sleep(0.01)
            return step
        progress = 'started'
        work() > 0
    """), ranks=[1], block=False, filename="<dbg busy>")
    try:
        deadline = time.monotonic() + 30
        while (seen := dbg.debugger.inspect("progress", 1)).text != "'started'" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen.ok and seen.state == "running" and "live state" in seen.note
        local = dbg.debugger.inspect("step", 1, frame=True)
        assert local.ok and int(local.text) >= 0 and ", in work" in local.where
        assert local.where.startswith("<dbg busy> line ")
        bad = dbg.debugger.inspect("step", 1)  # a local of work(), not a global
        assert not bad.ok and "NameError" in bad.text
        with pytest.raises(SyntaxError):
            dbg.debugger.inspect("step +", 1)
    finally:
        open(stop, "w").close()
    assert handle.result(timeout=30) == {1: True}
    idle = dbg.debugger.inspect("progress", 1)
    assert idle.state == "idle" and idle.text == "'started'" and idle.note == "rank 1 (idle)"
