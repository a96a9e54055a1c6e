"""%mesh and %%mesh through IPython's InteractiveShell (the same code path as in a notebook)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import monarch_jupyter
from monarch_jupyter import Mesh, MeshError
from tests.conftest import wait_gone, worker_pids


@pytest.fixture(scope="module")
def shell() -> Iterator[InteractiveShell]:
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "monarch")
    yield ip
    ip.run_line_magic("unload_ext", "monarch")


@pytest.fixture(scope="module")
def started(shell: InteractiveShell) -> Iterator[Mesh]:
    m = shell.run_line_magic("mesh", "start -n 2")
    yield m
    if m.running:
        m.stop()


def cell(shell: InteractiveShell, line: str, body: str) -> object:
    return shell.run_cell_magic("mesh", line, textwrap.dedent(body))


def test_mesh_before_start_says_how(shell: InteractiveShell) -> None:
    with pytest.raises(UsageError, match="%mesh start"):
        cell(shell, "", "1")


def test_start_returns_mesh_and_current(started: Mesh) -> None:
    assert isinstance(started, Mesh)
    assert monarch_jupyter.current_mesh() is started
    assert started.world_size == 2


def test_cell_output_and_result(shell: InteractiveShell, started: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    out = cell(shell, "", """
        t = torch.ones(3) * rank
        dist.all_reduce(t)
        print(rank, t)
        t.sum().item()
    """)
    assert out == {0: 3.0, 1: 3.0}
    text = capsys.readouterr().out
    assert "[rank0]: 0 tensor([1., 1., 1.])" in text and "[rank1]: 1 tensor([1., 1., 1.])" in text


def test_out_and_ranks(shell: InteractiveShell, started: Mesh) -> None:
    assert cell(shell, "--ranks 1 --out res", "rank * 7") is None
    assert shell.user_ns["res"] == {1: 7}


def test_notebook_function_and_class_used_in_cell(shell: InteractiveShell, started: Mesh) -> None:
    shell.run_cell(textwrap.dedent("""
        def double(x):
            return 2 * x

        class Box:
            def __init__(self, v):
                self.v = v

            def fail(self):
                raise RuntimeError(f"box {self.v} failed")
    """))
    assert cell(shell, "", "Box(double(rank)).v") == {0: 0, 1: 2}
    with pytest.raises(MeshError) as info:
        cell(shell, "", "Box(rank).fail()")
    text = "\n".join(info.value._render_traceback_())
    assert 'raise RuntimeError(f"box {self.v} failed")' in text  # the notebook cell's own source line


def test_rank_defined_name_wins_over_notebook(shell: InteractiveShell, started: Mesh) -> None:
    shell.run_cell("def who():\n    return 'notebook'\n")
    assert cell(shell, "", "who()") == {0: "notebook", 1: "notebook"}
    cell(shell, "", "def who():\n    return 'rank'\n")
    assert cell(shell, "", "who()") == {0: "rank", 1: "rank"}


def test_usage_errors_are_messages_not_tracebacks(shell: InteractiveShell, started: Mesh) -> None:
    with pytest.raises(UsageError, match="--help"):
        cell(shell, "--bogus", "1")
    with pytest.raises(UsageError, match="subcommand"):
        shell.run_line_magic("mesh", "explode")
    with pytest.raises(UsageError, match="already running"):
        shell.run_line_magic("mesh", "start -n 2")
    with pytest.raises(UsageError, match="world size 2"):
        cell(shell, "--ranks 5", "1")
    with pytest.raises(UsageError, match="--out"):
        cell(shell, "--out 1x", "1")
    # Through run_cell the user sees a one-line UsageError, and the mesh still works.
    result = shell.run_cell("%%mesh --bogus\n1\n")
    assert isinstance(result.error_in_exec, UsageError)
    assert cell(shell, "", "rank") == {0: 0, 1: 1}


def test_status_stop_restart(shell: InteractiveShell, started: Mesh) -> None:
    status = shell.run_line_magic("mesh", "status")
    text = repr(status)
    assert "rank" in text and "idle" in text
    pids = {s["pid"] for s in started.status().values()}
    m = shell.run_line_magic("mesh", "restart")
    assert m is started and m.running
    assert not wait_gone(pids, timeout=5)
    shell.run_line_magic("mesh", "stop")
    assert not started.running
    with pytest.raises(UsageError, match="restart"):
        cell(shell, "", "1")
    shell.run_line_magic("mesh", "restart")
    assert cell(shell, "", "rank") == {0: 0, 1: 1}


def test_load_ext_monarch_jupyter_and_unload_stops(started: Mesh) -> None:
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "monarch_jupyter")  # the second name works too (idempotent)
    assert "mesh" in ip.magics_manager.magics["cell"]
    pids = {s["pid"] for s in started.status().values()}
    ip.run_line_magic("unload_ext", "monarch")
    assert "mesh" not in ip.magics_manager.magics["cell"]
    assert not started.running
    assert not wait_gone(pids, timeout=5)
    ip.run_line_magic("load_ext", "monarch")


def test_unload_then_load_under_the_other_name() -> None:
    ip = InteractiveShell.instance()
    ip.run_line_magic("unload_ext", "monarch")
    ip.run_line_magic("load_ext", "monarch_jupyter")
    assert "mesh" in ip.magics_manager.magics["cell"]
    ip.run_line_magic("unload_ext", "monarch_jupyter")
    ip.run_line_magic("load_ext", "monarch")
    assert "mesh" in ip.magics_manager.magics["cell"]


def running_mesh(shell: InteractiveShell) -> Mesh:
    """The mesh the magics use, started if an earlier test (unload_ext) stopped it."""
    try:
        m = monarch_jupyter.current_mesh()
        if m.running:
            return m
    except monarch_jupyter.MeshNotRunningError:
        pass
    return shell.run_line_magic("mesh", "start -n 2")


def test_more_usage_errors(shell: InteractiveShell, capsys: pytest.CaptureFixture[str]) -> None:
    running_mesh(shell)
    with pytest.raises(UsageError, match="needs a subcommand"):
        shell.run_line_magic("mesh", "")
    for bad in ("-1", "0", "inf", "nan"):
        with pytest.raises(UsageError, match="positive, finite number of seconds.*leave it out for no limit"):
            cell(shell, f"--timeout {bad}", "1")
    shell.run_line_magic("mesh", "stop")
    shell.run_line_magic("mesh", "stop")
    assert "already stopped" in capsys.readouterr().out
    shell.run_line_magic("mesh", "restart")
    assert cell(shell, "", "rank") == {0: 0, 1: 1}


def test_a_stop_or_restart_says_which_async_cells_it_ended(shell: InteractiveShell,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """helper-49: a restart ended a running --async cell without a word (only its handle said so, later)."""
    from monarch_jupyter import RankDiedError

    running_mesh(shell)
    for sub, said in (("restart", "restarted; it ended 1 cell still running"),
                      ("stop", "stopped 2 ranks; it ended 1 cell still running")):
        handle = cell(shell, "--async --no-widget", "import time; time.sleep(120)")
        capsys.readouterr()
        shell.run_line_magic("mesh", sub)
        assert said in capsys.readouterr().out
        with pytest.raises(MeshError) as info:
            handle.result(timeout=30)
        assert all(isinstance(e, RankDiedError) for e in info.value.errors.values())
        if sub == "restart":
            shell.run_line_magic("mesh", "stop")  # nothing was running: nothing more to say
            assert capsys.readouterr().out.strip() == "stopped 2 ranks"
            shell.run_line_magic("mesh", "restart")
    shell.run_line_magic("mesh", "restart")
    assert cell(shell, "", "rank") == {0: 0, 1: 1}


def test_clean_rendering_of_errors(shell: InteractiveShell) -> None:
    """Errors the user can act on show their message, not the controller's frames."""
    running_mesh(shell)
    from monarch_jupyter.errors import CellSyntaxError

    with pytest.raises(CellSyntaxError) as info:
        cell(shell, "", "x = (1,\n")
    text = "\n".join(info.value._render_traceback_())
    assert "SyntaxError" in text and "mesh.py" not in text and "<mesh In[" in text
    # What the user sees through run_cell: the error's own lines, none of the controller's frames.
    result = shell.run_cell("%%mesh\nx = = 3\n")
    assert isinstance(result.error_in_exec, CellSyntaxError)
    assert "magics" not in str(result.error_in_exec)  # the hint is for magics and shell commands only
    for line in ("%time x = 1", "  !nvidia-smi"):  # helper-49: a bare "invalid syntax" did not say why
        with pytest.raises(CellSyntaxError) as info:
            cell(shell, "", f"y = 2\n{line}\n")
        text = "\n".join(info.value._render_traceback_())
        assert "magics and ! shell commands do not run on the ranks" in text and "subprocess.run" in text, text
    with pytest.raises(MeshError) as err:
        cell(shell, "", "undefined_name")
    text = "\n".join(err.value._render_traceback_())
    assert "failed the same way" in text
    assert text.count("NameError: name 'undefined_name' is not defined") == 2  # header line + one traceback
    from monarch_jupyter import MeshStartError

    assert MeshStartError("x")._render_traceback_() == ["MeshStartError: x"]


INTERRUPTED_START = """
import os, signal, sys, threading, time
from IPython.core.interactiveshell import InteractiveShell
from monarch_jupyter.kernel.launch import local

os.environ["PYTHONPATH"] = sys.argv[1] + os.pathsep + os.environ.get("PYTHONPATH", "")  # the fork server sleeps
shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "monarch")

def waits_for_the_fork_server():
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None and frame.f_code.co_name != "wait_ready":
        frame = frame.f_back
    return frame is not None

def interrupt_once_start_waits():
    deadline = time.monotonic() + 60
    while not waits_for_the_fork_server() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=interrupt_once_start_waits, daemon=True).start()
result = shell.run_cell("%mesh start -n 2 --timeout 120")
print("ERROR TYPE:", type(result.error_in_exec).__name__)
local.shutdown()
"""


def test_an_interrupted_start_says_so_in_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    """The notebook's interrupt while ``%mesh start`` waits (here for a fork server that is slow to import): one
    line, not the start's frames, and no process left behind."""
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text("import time\ntime.sleep(120)\n")
    before = worker_pids()
    out = subprocess.run([sys.executable, "-c", INTERRUPTED_START, str(slow)], capture_output=True, text=True,
                         timeout=120).stdout
    assert "KeyboardInterrupt: %mesh start was interrupted; no rank is left running (%mesh start -n 2 --timeout 120 " \
           " starts again)" in out, out  # the command as given (helper-49: it dropped the launcher's options)
    assert "ERROR TYPE: KeyboardInterrupt" in out and "lifecycle.py" not in out, out
    assert not wait_gone(worker_pids() - before)


def _interrupt_once_it_waits_for_the_ranks() -> None:
    """SIGINT to this process once the main thread waits for the ranks (``wait_started``); at the 60 s deadline
    too: the test then fails on what it sees."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        frame, names = sys._current_frames().get(threading.main_thread().ident), set()
        while frame is not None:
            names.add(frame.f_code.co_name)
            frame = frame.f_back
        if "wait_started" in names:
            break
        time.sleep(0.005)
    os.kill(os.getpid(), signal.SIGINT)


def test_an_interrupted_restart_says_so_in_one_line(shell: InteractiveShell) -> None:
    running_mesh(shell)

    interrupter = threading.Thread(target=_interrupt_once_it_waits_for_the_ranks, daemon=True)
    interrupter.start()
    with pytest.raises(KeyboardInterrupt) as info:
        shell.run_line_magic("mesh", "restart")
    interrupter.join()
    assert info.value._render_traceback_() == [  # type: ignore[attr-defined]
        "KeyboardInterrupt: %mesh restart was interrupted; the mesh is stopped and no rank is left running "
        "(%mesh restart  starts it again)"]
    assert shell.run_line_magic("mesh", "restart").run("rank") == {0: 0, 1: 1}


def test_an_interrupted_scale_finishes_first_and_says_so_in_one_line(shell: InteractiveShell) -> None:
    """A scale interrupted while the ranks join their new process group finishes first (ranks half way into a new
    group would never join one), then says so in one line, not the controller's frames; the mesh is whole."""
    m = running_mesh(shell)

    interrupter = threading.Thread(target=_interrupt_once_it_waits_for_the_ranks, daemon=True)
    interrupter.start()
    with pytest.raises(KeyboardInterrupt) as info:
        shell.run_line_magic("mesh", "scale -n 3")
    interrupter.join()
    assert info.value._render_traceback_() == [  # type: ignore[attr-defined]
        "KeyboardInterrupt: interrupted while the ranks joined a fresh process group of 3; that completed first, "
        "so the mesh is whole (%mesh status shows it)"]
    assert m.run("world_size") == {0: 3, 1: 3, 2: 3}
    assert m.run("import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == {
        0: 3.0, 1: 3.0, 2: 3.0}
    shell.run_line_magic("mesh", "scale -n 2")
    assert m.run("rank") == {0: 0, 1: 1}


def test_more_ranks_than_the_host_carries_need_force(shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24, 6a: ``%mesh start -n N`` past this host's cores is refused before anything starts (no process,
    no mesh), saying what to expect; ``--force`` starts them anyway. The limit is lowered here to 1 rank per core
    so that the forced start stays small."""
    from monarch_jupyter.kernel.launch import capacity

    running_mesh(shell).stop()  # %mesh start needs none running
    cores = capacity.host_limits()[0]
    before = worker_pids()
    with pytest.raises(UsageError) as info:
        shell.run_line_magic("mesh", f"start -n {capacity.RANKS_PER_CORE * cores + 1}")
    assert "ranks on this host are more than it can carry" in str(info.value), str(info.value)
    assert "%mesh start --force" in str(info.value)
    assert worker_pids() - before == set()
    monkeypatch.setattr(capacity, "RANKS_PER_CORE", 1)
    with pytest.raises(UsageError, match=f"{cores + 1} ranks on {cores} CPU"):
        shell.run_line_magic("mesh", f"start -n {cores + 1}")
    m = shell.run_line_magic("mesh", f"start -n {cores + 1} --force")
    try:
        assert m.run("world_size") == dict.fromkeys(range(cores + 1), cores + 1)
    finally:
        m.stop()
