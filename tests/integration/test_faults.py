"""Fault injection through the Python API: interrupts, rank deaths, lost ranks, hangs, and recovery.

Every test breaks a real mesh (real processes, sockets, gloo process group) and checks three things: the
message the user sees, that the mesh recovers (a collective works again, survivors kept their namespaces), and
that no process is left behind. Ranks are broken by the cell itself (os._exit, SIGKILL, a segfault, a blocked
SIGINT) or from outside (SIGSTOP), as in jupyter_client's problem kernels.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from monarch_jupyter import Mesh, MeshError, MeshTimeoutError, RankDiedError
from monarch_jupyter.errors import RankAbortedError, RemoteError

pytestmark = pytest.mark.slow

WORLD = 3


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Wait up to ``timeout`` seconds for ``pids`` to exit; returns those still alive."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return left


def pids(mesh: Mesh) -> dict[int, int]:
    return {r: s["pid"] for r, s in mesh.status().items()}


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    m = Mesh(WORLD, interrupt_grace=1.5, start_timeout=120)
    try:
        yield m
    finally:
        every = set(pids(m).values())
        m.stop()
        assert not wait_gone([p for p in every if p]), "ranks outlived mesh.stop()"


@pytest.fixture()
def healthy(mesh: Mesh) -> Iterator[Mesh]:
    """The mesh, with every rank up, in one working process group, and ``marker`` set on each rank."""
    status = mesh.status()
    dead = [r for r, s in status.items() if s["state"] == "dead"]
    if dead:
        mesh.restart(ranks=dead)
    assert mesh.run("t = torch.ones(1); dist.all_reduce(t); int(t.item())") == dict.fromkeys(range(WORLD), WORLD)
    # Hold the process group as a DDP model in the namespace would: releasing ranks blocked in a collective
    # must not depend on the group being freed.
    mesh.run("marker = rank * 10\nheld_group = dist.distributed_c10d._get_default_group()")
    yield mesh


def on_output(mesh: Mesh, text: str, action: Callable[[], None]) -> Callable[[str, dict], None]:
    """Run ``action`` once, from the mesh's reader thread, when a rank prints a line containing ``text``."""
    fired = threading.Event()

    def listener(kind: str, data: dict) -> None:
        if kind == "output" and text in data["text"] and not fired.is_set():
            fired.set()
            action()

    mesh.add_listener(listener)
    return listener


def interrupt_me() -> None:
    """What the notebook's interrupt does to the kernel: SIGINT to this process (its main thread waits)."""
    os.kill(os.getpid(), signal.SIGINT)


def interrupt_when_stacks_show(mesh: Mesh, text: str) -> threading.Thread:
    """SIGINT this process once ``mesh.stacks()`` (asked from another thread) contains ``text``."""
    def poll() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and text not in mesh.stacks().text:
            time.sleep(0.05)
        interrupt_me()  # at the deadline too: the test then fails on what it sees, instead of hanging

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    return thread


def assert_recovered(mesh: Mesh, kept: list[int]) -> None:
    """A collective works on every rank and ``kept`` ranks still have their namespace."""
    assert mesh.run("t = torch.ones(1); dist.all_reduce(t); int(t.item())") == dict.fromkeys(range(WORLD), WORLD)
    got = mesh.run("globals().get('marker')")
    assert {r: got[r] for r in kept} == {r: r * 10 for r in kept}


# ---------------------------------------------------------------------------------------------------- interrupts


def test_interrupt_reaches_ranks_which_keep_their_state(healthy: Mesh) -> None:
    mesh = healthy
    before = pids(mesh)
    poller = interrupt_when_stacks_show(mesh, "ranks 0-2: time.sleep at cell line 3")
    with pytest.raises(KeyboardInterrupt) as info:
        mesh.run("import time\nprint('sleeping', flush=True)\ntime.sleep(600)\n")
    poller.join()
    assert "interrupted ranks 0-2 (they keep their state)" in str(info.value)
    assert "ranks 0-2: time.sleep at cell line 3" in str(info.value)
    assert pids(mesh) == before  # nobody was killed: SIGINT never reaches the ranks' process group
    assert_recovered(mesh, kept=[0, 1, 2])


class SlowStream:
    """A text stream that takes time to write (as ipykernel's OutStream does some work per write), so that an
    interrupt lands in the middle of a batch of lines; it counts the lines written."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.lines = 0

    def write(self, text: str) -> int:
        for start in range(0, len(text), 4096):
            self.parts.append(text[start:start + 4096])
            time.sleep(0.0005)
        self.lines += text.count("\n")
        return len(text)

    def flush(self) -> None:
        time.sleep(0.001)


def interrupt_once_flooding(out: SlowStream, lines: int) -> None:
    """SIGINT this process once ``out`` got ``lines`` lines (at a deadline too: the test then fails on what it
    sees, instead of hanging)."""
    deadline = time.monotonic() + 60
    while out.lines < lines and time.monotonic() < deadline:
        time.sleep(0.01)
    interrupt_me()


def test_the_notebooks_interrupt_loses_no_line_of_a_flood(healthy: Mesh) -> None:
    """The waiter writes a cell's lines in batches; an interrupt that landed in the middle of one dropped the rest
    of it (thousands of lines of a flood, in 4 of 6 tries), and the lines left when the ranks stopped came after
    the cell ended. Every rank's lines now come whole, in order, ahead of the cell's KeyboardInterrupt."""
    mesh = healthy
    for attempt in range(3):
        out = SlowStream()

        poller = threading.Thread(target=interrupt_once_flooding, args=(out, 20000 * (attempt + 1)), daemon=True)
        with contextlib.redirect_stdout(out):  # type: ignore[type-var]
            poller.start()
            with pytest.raises(KeyboardInterrupt) as info:
                mesh.run(f"i = 0\nwhile True:\n    print(f'flood{attempt} {{i}}')  # one write\n    i += 1\n")
            poller.join()
            mesh.run("print('next cell')")
        assert "interrupted ranks 0-2 (they keep their state)" in str(info.value), str(info.value)
        text = "".join(out.parts)
        flood, _, after = text.partition("next cell")
        assert f"flood{attempt}" not in after, f"attempt {attempt}: lines of the interrupted cell came after it"
        for r in range(WORLD):
            numbers = [int(line.rsplit(" ", 1)[1]) for line in flood.splitlines()
                       if line.startswith(f"[rank{r}]: flood{attempt} ")]
            assert numbers == list(range(len(numbers))), (
                f"attempt {attempt}, rank {r}: {len(numbers)} lines up to {max(numbers, default=-1)}: "
                f"{len(set(range(max(numbers, default=-1) + 1)) - set(numbers))} lost")
    assert_recovered(mesh, kept=[0, 1, 2])


def test_interrupt_during_a_collective_releases_the_ranks_that_wait_for_an_interrupted_one(
        healthy: Mesh, capsys: pytest.CaptureFixture) -> None:
    """Rank 2 stops at the interrupt; ranks 0 and 1 wait in gloo for it, where SIGINT cannot reach them, in a
    collective it will never issue in this cell. As for a rank that raises, the process group is torn down to
    release them and a fresh one is made; every rank keeps its namespace. (They used to stay stuck, and the next
    cell was refused until  %mesh interrupt --force.)"""
    mesh = healthy
    before = pids(mesh)
    code = "import time\nt = torch.ones(1)\nprint('in', flush=True)\nif rank == 2:\n    time.sleep(600)\n" \
           "else:\n    dist.all_reduce(t)\n"
    poller = interrupt_when_stacks_show(mesh, "ranks 0,1: all_reduce at cell line 7")
    with pytest.raises(KeyboardInterrupt) as info:
        mesh.run(code)
    poller.join()
    text = str(info.value)
    assert "rank 2: time.sleep at cell line 5" in text, text
    assert ("rank 2 was interrupted while ranks 0,1 waited for it in a collective: the process group was torn down "
            "to release them and a fresh one was made (every rank kept its namespace; groups made with "
            "dist.new_group") in text, text
    assert "did not stop" not in capsys.readouterr().err
    assert mesh.stacks().text == "ranks 0-2: idle"
    assert pids(mesh) == before
    assert_recovered(mesh, kept=[0, 1, 2])


def test_a_handle_interrupted_between_waits_stops_its_ranks_as_result_would(healthy: Mesh) -> None:
    """A loop of handle.wait(0.1) and snapshot() (the Lightning launcher's) can take the notebook's interrupt
    outside the wait, as a bare KeyboardInterrupt: handle.interrupted() then does what result() does with it."""
    mesh = healthy
    handle = mesh.run("import time\ntime.sleep(600)", block=False)
    deadline = time.monotonic() + 30
    while "time.sleep" not in mesh.stacks().text:
        assert time.monotonic() < deadline, mesh.stacks().text
        time.sleep(0.05)
    error = handle.interrupted()
    assert isinstance(error, KeyboardInterrupt)
    assert "interrupted ranks 0-2 (they keep their state): ranks 0-2: time.sleep at cell line 2" in str(error), error
    assert handle.done()
    assert_recovered(mesh, kept=[0, 1, 2])


def test_a_rank_that_raises_before_a_collective_releases_the_others(healthy: Mesh) -> None:
    """Rank 1 raises before the all_reduce the others wait in (it will never join it): instead of hanging until
    the collective's timeout (1,800 s), the controller sees the others' stacks in torch.distributed, tears the
    process group down to release them and makes a fresh one; the cell raises rank 1's error first."""
    mesh = healthy
    before = pids(mesh)
    code = "t = torch.ones(1)\nif rank == 1:\n    raise RuntimeError('rank 1 fails first')\ndist.all_reduce(t)\n"
    with pytest.raises(MeshError) as info:
        mesh.run(code, timeout=120)  # a MeshTimeoutError here would mean the others were never released
    err = info.value
    assert not isinstance(err, MeshTimeoutError)
    assert str(err.errors[1]) == "[rank1] RuntimeError: rank 1 fails first"
    assert "first failure: [rank1] RuntimeError: rank 1 fails first" in str(err)
    assert sorted(err.errors) == list(range(WORLD))
    assert "rank 1 raised RuntimeError while ranks 0,2 waited for it in a collective" in err.hint, err.hint
    assert "a fresh one was made" in err.hint
    assert pids(mesh) == before  # nobody was killed
    assert_recovered(mesh, kept=list(range(WORLD)))


def test_rank_stuck_in_c_code_is_named_then_killed_by_force(healthy: Mesh, capsys: pytest.CaptureFixture) -> None:
    mesh = healthy
    before = pids(mesh)
    # Rank 1 blocks SIGINT: like C code that never returns to Python, an interrupt cannot stop it.
    code = "import signal, time\nif rank == 1:\n    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])\n" \
           "print('go', flush=True)\ntime.sleep(600)\n"
    poller = interrupt_when_stacks_show(mesh, "ranks 0-2: time.sleep at cell line 5")
    with pytest.raises(KeyboardInterrupt):
        mesh.run(code)
    poller.join()
    err = capsys.readouterr().err
    assert ("rank 1 did not stop within 1.5 s and is still running the cell: rank 1: time.sleep at cell line 5"
            in err), err

    report = mesh.interrupt(ranks=1, force=True, grace=0.5)
    assert report.killed == [1], report.text
    assert "killed rank 1" in report.text and "%mesh restart --rank 1" in report.text
    assert mesh.status()[1]["state"] == "dead" and mesh.status()[1]["returncode"] == -signal.SIGKILL
    assert not wait_gone([before[1]])
    not_run = r"^the cell was not run, since a rank it needs is dead: \[rank1\] died \(signal SIGKILL"
    with pytest.raises(MeshError, match=not_run) as info:
        mesh.run("1")
    shown = info.value._render_traceback_()  # the error and what to run: the death was reported already
    assert len(shown) == 2 and "%mesh restart --rank 1" in shown[1], shown

    mesh.restart(ranks=1)
    assert pids(mesh)[0] == before[0] and pids(mesh)[2] == before[2] and pids(mesh)[1] != before[1]
    assert_recovered(mesh, kept=[0, 2])
    assert mesh.run("'marker' in globals()", ranks=1) == {1: False}  # a fresh process, a fresh namespace


def test_interrupt_with_nothing_running(healthy: Mesh) -> None:
    report = healthy.interrupt()
    assert report.idle == [0, 1, 2] and "nothing to interrupt" in report.text
    with pytest.raises(ValueError, match="world size 3"):
        healthy.interrupt(ranks=5)


# ---------------------------------------------------------------------------------------------------- deaths

DEATHS = {
    "exit": ("print('last words', flush=True); os._exit(3)", 3, "exit code 3"),
    "sigkill": ("print('last words', flush=True); os.kill(os.getpid(), signal.SIGKILL)", -9, "signal SIGKILL"),
    "segfault": ("print('last words', flush=True); ctypes.string_at(0)", -11, "signal SIGSEGV"),
    "c-printf": ("ctypes.CDLL(None).printf(b'last words from C\\n'); os._exit(4)", 4, "exit code 4"),
}


@pytest.mark.parametrize("how", sorted(DEATHS))
@pytest.mark.parametrize("survivors", ["collective", "sleeping"])
def test_rank_death_ends_the_cell_and_restart_rank_recovers(healthy: Mesh, how: str, survivors: str) -> None:
    mesh = healthy
    before = pids(mesh)
    die, returncode, status = DEATHS[how]
    wait = "dist.all_reduce(t)" if survivors == "collective" else "time.sleep(600)"
    code = textwrap.dedent(f"""\
        import ctypes, os, signal, time
        t = torch.ones(1)
        if rank == 1:
            time.sleep(0.3)
            {die}
        {wait}
        """)
    with pytest.raises(MeshError) as info:
        mesh.run(code)  # survivors would wait 600 s, or forever in the collective: the cell ends at the death
    e = info.value
    died = e.errors[1]
    assert isinstance(died, RankDiedError) and died.returncode == returncode
    assert "last words" in died.last_output
    assert f"[rank1] died ({status})" in str(e)
    assert next(iter(e.errors)) == 1  # the root cause comes first
    for r in (0, 2):
        assert isinstance(e.errors[r], RankAbortedError) and e.errors[r].dead == [1], e.errors[r]
    text = "\n".join(e._render_traceback_())
    assert "its last output:" in text and "last words" in text and "%mesh restart --rank 1" in text
    if how == "segfault":
        assert "Segmentation fault" in died.last_output and "<mesh cell" in died.last_output, died.last_output
        assert "monarch_worker" not in died.last_output  # the runtime's own frames are left out
    assert not wait_gone([before[1]])

    mesh.restart(ranks=1)
    assert_recovered(mesh, kept=[0, 2])


def test_a_death_report_does_not_pass_earlier_output_off_as_the_cells(healthy: Mesh) -> None:
    mesh = healthy
    mesh.run("if rank == 1:\n    print('from an earlier cell', flush=True)")
    with pytest.raises(MeshError) as info:
        mesh.run("import os\nif rank == 1:\n    os._exit(9)\n")
    shown = "\n".join(info.value._render_traceback_())
    assert "[rank1] its last output (from earlier cells: this one wrote nothing):" in shown, shown
    assert "[rank1]   from an earlier cell" in shown, shown
    mesh.restart(ranks=1)
    mesh.run("if rank == 1:\n    print('an old line', flush=True)")
    with pytest.raises(MeshError) as info:
        mesh.run("import os\nif rank == 1:\n    print('last words', flush=True)\n    os._exit(9)\n")
    shown = "\n".join(info.value._render_traceback_())
    assert "[rank1] its last output:\n[rank1]   last words" in shown and "an old line" not in shown, shown


def test_results_of_finished_ranks_are_kept(healthy: Mesh) -> None:
    mesh = healthy
    code = "import os, time\nif rank == 1:\n    time.sleep(0.5)\n    os._exit(5)\nif rank == 2:\n" \
           "    time.sleep(600)\nrank + 100\n"
    with pytest.raises(MeshError) as info:
        mesh.run(code)
    assert info.value.results == {0: 100}
    assert isinstance(info.value.errors[1], RankDiedError)
    assert isinstance(info.value.errors[2], RankAbortedError)
    assert "rank 0 finished" in "\n".join(info.value._render_traceback_())
    mesh.restart(ranks=1)
    assert_recovered(mesh, kept=[0, 2])


def test_death_while_idle_is_reported_and_full_restart_works(healthy: Mesh, capsys: pytest.CaptureFixture) -> None:
    mesh = healthy
    before = pids(mesh)
    os.kill(before[2], signal.SIGKILL)  # e.g. the out-of-memory killer, between cells
    deadline = time.monotonic() + 10
    while mesh.status()[2]["state"] != "dead" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert mesh.status()[2]["returncode"] == -signal.SIGKILL
    err = ""  # written by the mesh's output thread, once the death is handled: wait for it
    while "[rank2]: died (signal SIGKILL) while idle" not in err and time.monotonic() < deadline + 10:
        err += capsys.readouterr().err
        time.sleep(0.02)
    assert "[rank2]: died (signal SIGKILL) while idle" in err, err
    with pytest.raises(MeshError) as info:
        mesh.run("1")
    assert str(info.value) == "the cell was not run, since a rank it needs is dead: [rank2] died (signal SIGKILL)"
    assert info.value.__notes__ == [info.value.hint] and "%mesh restart --rank 2" in info.value.hint
    # Survivors still run code of their own (e.g. to save a checkpoint), with a note that collectives fail.
    assert mesh.run("marker", ranks="0,1") == {0: 0, 1: 10}
    assert "process group is down (rank 2 died)" in capsys.readouterr().err

    mesh.restart()
    assert not wait_gone(list(before.values()))
    got = mesh.run("t = torch.ones(1); dist.all_reduce(t); (int(t.item()), globals().get('marker'))")
    assert got == dict.fromkeys(range(WORLD), (WORLD, None))


def test_restart_rank_refuses_when_other_ranks_are_dead(healthy: Mesh) -> None:
    mesh = healthy
    p = pids(mesh)
    for r in (1, 2):
        os.kill(p[r], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(mesh.status()[r]["state"] != "dead" for r in (1, 2)) and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(Exception, match=r"restart them together:  %mesh restart --rank 1,2"):
        mesh.restart(ranks=1)
    mesh.restart(ranks="1,2")
    assert_recovered(mesh, kept=[0])
    # Every rank dead: the answer is a fresh mesh, not a list of every rank.
    p = pids(mesh)
    for r in range(WORLD):
        os.kill(p[r], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(mesh.status()[r]["state"] != "dead" for r in range(WORLD)) and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(Exception, match=r"^ranks 0,2 are dead too, so every rank is: run  %mesh restart  "):
        mesh.restart(ranks=1)
    mesh.restart()
    assert_recovered(mesh, kept=[])


# ---------------------------------------------------------------------------------------------------- lost ranks


def test_rank_without_heartbeat_is_declared_lost(healthy: Mesh) -> None:
    mesh = healthy
    before = pids(mesh)
    saved = mesh.heartbeat_timeout
    mesh.heartbeat_timeout = 3.0  # the controller's window; ranks heartbeat every second
    listener = on_output(mesh, "zzz", lambda: os.kill(before[1], signal.SIGSTOP))
    try:
        with pytest.raises(MeshError) as info:
            mesh.run("import time\nprint('zzz', flush=True)\ntime.sleep(600)\n")
    finally:
        mesh.remove_listener(listener)
        mesh.heartbeat_timeout = saved
    lost = info.value.errors[1]
    assert isinstance(lost, RankDiedError) and lost.returncode is None
    assert "[rank1] lost (no heartbeat for 3 s" in str(lost)
    assert not wait_gone([before[1]])  # the controller killed the stopped process
    mesh.restart(ranks=1)
    assert_recovered(mesh, kept=[0, 2])


def test_ranks_exit_when_they_lose_the_controller(tmp_path) -> None:
    """A controller that stops answering (here: SIGSTOPped) loses its ranks after their heartbeat window."""
    script = textwrap.dedent("""\
        import json, sys, time
        from monarch_jupyter import Mesh
        m = Mesh(2, heartbeat_timeout=2.0, heartbeat_interval=0.25)
        print(json.dumps([s["pid"] for s in m.status().values()]), flush=True)
        time.sleep(600)
        """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line, "the controller process did not start its mesh"
        ranks = __import__("json").loads(line)
        assert all(alive(p) for p in ranks)
        os.kill(proc.pid, signal.SIGSTOP)  # the controller is silent from now on
        assert not wait_gone(ranks, timeout=15), "ranks kept running without their controller"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


# ---------------------------------------------------------------------------------------------------- hangs


def test_timeout_reports_grouped_stacks_and_releases_the_ranks_that_wait(healthy: Mesh) -> None:
    """Past its timeout the cell is interrupted: rank 2 stops, and ranks 0 and 1, waiting for it in a collective
    it will never issue, are released (a fresh process group), as after a rank that raised."""
    mesh = healthy
    code = "import time\nt = torch.ones(1)\nif rank == 2:\n    time.sleep(600)\nelse:\n    dist.all_reduce(t)\n"
    with pytest.raises(MeshTimeoutError) as info:
        mesh.run(code, timeout=1.0)
    e = info.value
    assert "ranks 0,1: all_reduce at cell line 6  [last collective: gloo:all_reduce" in e.stacks, e.stacks
    assert "rank 2: time.sleep at cell line 4" in e.stacks, e.stacks
    text = "\n".join(e._render_traceback_())
    assert "did not finish within 1 s" in text and "Where each rank was:" in text
    assert ("rank 2 was interrupted while ranks 0,1 waited for it in a collective: the process group was torn down "
            "to release them and a fresh one was made") in text, text
    assert "--force" not in text, text
    assert isinstance(e.errors[2], RemoteError) and "interrupted after 1 s at time.sleep" in e.errors[2].evalue
    assert_recovered(mesh, kept=[0, 1, 2])


def test_a_rank_that_dies_as_the_cell_times_out_is_named_as_the_failure(healthy: Mesh) -> None:
    """The timeout asks every rank where it is; a rank that died meanwhile never answers. The cell waited the whole
    5 s for it and said "did not finish ... on ranks 0-3" without the death (helper-61: a kill within ms of the
    timeout). Here rank 1 holds the GIL (its I/O thread cannot answer) until a shell kills it, after the timeout."""
    mesh = healthy
    code = ("import os, subprocess, time\nif rank == 1:\n"
            "    subprocess.Popen(['sh', '-c', f'sleep 2; kill -9 {os.getpid()}'])\n"
            "    sum(range(10**12))  # C code holding the GIL: the rank answers nothing until it is killed\n"
            "else:\n    time.sleep(60)\n")
    with pytest.raises(MeshTimeoutError) as info:
        mesh.run(code, timeout=1.0)
    e = info.value
    assert isinstance(e.errors[1], RankDiedError) and e.failed == [1] and 1 not in e.late, (e.failed, e.late)
    assert "first failure: [rank1] died (signal SIGKILL)" in str(e), str(e)


def test_stacks_and_interrupt_while_an_async_cell_runs(healthy: Mesh) -> None:
    mesh = healthy
    handle = mesh.run("import time\nfor i in range(600):\n    time.sleep(1)\n", block=False)
    deadline = time.monotonic() + 10
    text = ""
    while time.monotonic() < deadline:
        text = mesh.stacks().text
        if text.startswith("ranks 0-2: time.sleep at cell line 3"):
            break
        time.sleep(0.05)
    assert text.startswith("ranks 0-2: time.sleep at cell line 3  [last collective: gloo:all_reduce"), text
    assert "    cell line 3: time.sleep(1)" in text
    report = mesh.interrupt()
    assert report.interrupted == [0, 1, 2] and not report.stuck
    with pytest.raises(KeyboardInterrupt, match="time.sleep at cell line 3"):
        handle.result(timeout=10)
    assert_recovered(mesh, kept=[0, 1, 2])


def test_a_cell_queued_behind_an_async_cell_is_skipped_not_stuck(
        healthy: Mesh, tmp_path, capsys: pytest.CaptureFixture) -> None:
    """A cell sent while an earlier one (block=False) still runs waits behind it on the ranks. Timed out or
    interrupted there, it is not reported stuck (nothing to force): the ranks skip it, and later cells run."""
    mesh, go = healthy, tmp_path / "go"
    first = mesh.run(f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\n'first'",
                     block=False)
    with pytest.raises(MeshTimeoutError) as timed_out:
        mesh.run("'second'", timeout=2.0)
    assert capsys.readouterr().err == (  # after a second of waiting: why nothing happens
        "note: ranks 0-2 still run an earlier cell (sent with block=False or --async); the cell starts there when it "
        "ends (%mesh interrupt  stops that cell;  %mesh inspect  reads values now)\n")
    assert timed_out.value.stacks == ("ranks 0-2: not started; an earlier cell (sent with block=False or --async) "
                                      "still runs there, and they skip this one"), timed_out.value.stacks
    assert not timed_out.value.hint  # no  %mesh interrupt --force  advice
    fired = threading.Event()

    def interrupt_once_sent(kind: str, data: dict) -> None:
        if kind == "cell_started" and not fired.is_set():
            fired.set()
            interrupt_me()

    mesh.add_listener(interrupt_once_sent)
    try:
        with pytest.raises(KeyboardInterrupt) as interrupted:
            mesh.run("'third'")
    finally:
        mesh.remove_listener(interrupt_once_sent)
    assert str(interrupted.value) == ("interrupted; ranks 0-2 had not started it (they still run an earlier cell, "
                                      "sent with block=False or --async) and skip it")
    assert "did not stop" not in capsys.readouterr().err
    later = mesh.run("'fourth'", block=False)  # not refused: the ranks are not stuck
    go.touch()
    assert first.result(timeout=60) == dict.fromkeys(range(WORLD), "first")
    assert later.result(timeout=60) == dict.fromkeys(range(WORLD), "fourth")
    assert_recovered(mesh, kept=[0, 1, 2])


def test_the_notebooks_interrupt_keeps_the_results_of_ranks_that_had_finished(healthy: Mesh) -> None:
    mesh = healthy

    def poll() -> None:  # SIGINT once ranks 0 and 2 are done and rank 1 sleeps (at the deadline too)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
                "rank 1: time.sleep at cell line 3" in mesh.stacks().text
                and all(mesh.status()[r]["state"] == "idle" for r in (0, 2))):
            time.sleep(0.05)
        interrupt_me()

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    handle = mesh.run("import time\nif rank == 1:\n    time.sleep(600)\nrank * 10\n", block=False)
    with pytest.raises(KeyboardInterrupt) as info:
        handle.result()  # as mesh.run waits
    poller.join()
    assert str(info.value) == ("interrupted rank 1 (it keeps its state): rank 1: time.sleep at cell line 3; ranks 0,2 "
                               "had finished (their values: the exception's .results)"), str(info.value)
    assert info.value.results == {0: 0, 2: 20}
    with pytest.raises(KeyboardInterrupt) as again:  # the handle still has them
        handle.result(timeout=10)
    assert again.value.results == {0: 0, 2: 20}
    assert_recovered(mesh, kept=[0, 1, 2])


def test_interrupting_some_ranks_keeps_the_results_of_the_others(healthy: Mesh) -> None:
    mesh = healthy
    handle = mesh.run("import time\nif rank == 1:\n    time.sleep(600)\nrank * 10\n", block=False)
    deadline = time.monotonic() + 60
    while handle.snapshot().finished != {0, 2} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert handle.snapshot().finished == {0, 2}
    mesh.interrupt(ranks=1)
    with pytest.raises(KeyboardInterrupt, match=r"interrupted rank 1 .*ranks 0,2 had finished") as info:
        handle.result(timeout=60)
    assert info.value.results == {0: 0, 2: 20}
    assert_recovered(mesh, kept=[0, 1, 2])
