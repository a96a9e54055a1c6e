"""JupyterLab's visual debugger on local ranks (issue 28): a real DAP conversation with a real kernel through
jupyter_client, as JupyterLab has it (initialize, attach, dumpCell, setBreakpoints, a %%mesh cell, stopped events
from each rank, threads, stackTrace, scopes, variables, evaluate, next, continue, the cell's result)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from tests.conftest import wait_gone, worker_pids
from tests.integration.dapclient import DapKernel

pytestmark = [pytest.mark.kernel, pytest.mark.slow]

pytest.importorskip("debugpy")


@pytest.fixture(scope="module")
def k() -> Iterator[DapKernel]:
    kernel = DapKernel(os.getcwd())
    pids: set[int] = set()
    try:
        kernel.debugger_on()
        run = kernel.execute("%load_ext monarch\n%config MeshMagics.live_view = 'off'\nm = %mesh start -n 3\n"
                             "import json; print('PIDS', json.dumps([s['pid'] for s in m.status().values()]))")
        assert run.reply["status"] == "ok", (run.stdout, run.errors)
        pids = set(json.loads(run.stdout.split("PIDS ", 1)[1].splitlines()[0]))
        yield kernel
    finally:
        kernel.close()
    assert not wait_gone(pids & worker_pids(), timeout=30)


def _breakpoints(k: DapKernel, code: str, lines: list[int]) -> str:
    path = k.dap("dumpCell", code=code)["body"]["sourcePath"]
    rep = k.dap("setBreakpoints", source={"path": path}, breakpoints=[{"line": n} for n in lines],
                sourceModified=False)
    assert rep["success"], rep
    return path


def _stopped(k: DapKernel, n: int) -> dict[int, dict]:
    """The next ``n`` stopped events, by the rank named in their description."""
    out = {}
    for _ in range(n):
        ev = k.wait_event(lambda e: e.get("event") == "stopped", what="stopped event")
        rank = int(ev["body"]["description"].split(":")[0].split()[1])
        out[rank] = ev["body"]
    return out


def _locals(k: DapKernel, thread: int) -> tuple[dict, int, dict[str, str]]:
    frame = k.dap("stackTrace", threadId=thread)["body"]["stackFrames"][0]
    scopes = k.dap("scopes", frameId=frame["id"])["body"]["scopes"]
    names = k.dap("variables", variablesReference=scopes[0]["variablesReference"])["body"]["variables"]
    return frame, frame["id"], {v["name"]: v["value"] for v in names}


def test_gutter_breakpoint_stops_the_ranks_that_run_it(k: DapKernel) -> None:
    code = ("%%mesh\nx = rank * 10\nif rank != 2:\n    y = x + 1\n    z = y * 2\nelse:\n    print('rank 2 runs on')\n"
            "x + 5\n")
    path = _breakpoints(k, code, [4])
    run = k.submit(code)
    stops = _stopped(k, 2)
    assert sorted(stops) == [0, 1] and all(s["reason"] == "breakpoint" for s in stops.values())
    assert len(set(k.event_seqs)) == len(k.event_seqs), k.event_seqs  # DAP: each message of a side its own seq
    # The rank that did not stop ran on: its output is in the cell while the others wait.
    k.wait_output(run, "[rank2]: rank 2 runs on")
    names = [t["name"] for t in k.dap("threads")["body"]["threads"]]
    assert {"rank 0: MainThread", "rank 1: MainThread", "rank 2: MainThread", "MainThread"} <= set(names), names
    for rank, stop in stops.items():
        frame, frame_id, values = _locals(k, stop["threadId"])
        assert (frame["source"]["path"], frame["line"]) == (path, 4)  # the gutter's line, the %%mesh line counted
        assert frame["name"] == f"rank {rank}: <module>"  # the call stack says whose frame it is
        assert values["rank"] == str(rank) and values["x"] == str(rank * 10) and "y" not in values
        ev = k.dap("evaluate", expression="x + 1000", frameId=frame_id, context="repl")
        assert ev["success"] and ev["body"]["result"] == str(rank * 10 + 1000)
        rich = k.dap("richInspectVariables", variableName="x", frameId=frame_id)
        assert rich["success"] and rich["body"]["data"]["text/plain"] == str(rank * 10)
    # copyToGlobals: rank 1's value into the notebook.
    _, frame_id, _ = _locals(k, stops[1]["threadId"])
    rep = k.dap("copyToGlobals", srcVariableName="x", dstVariableName="x_of_rank1", srcFrameId=frame_id)
    assert rep["success"], rep
    # A step acts on the selected rank only.
    rep = k.dap("next", threadId=stops[1]["threadId"])
    assert rep["success"], rep
    step = _stopped(k, 1)
    assert list(step) == [1] and step[1]["reason"] == "step"
    frame, _, values = _locals(k, step[1]["threadId"])
    assert frame["line"] == 5 and values["y"] == "11"
    frame, _, values = _locals(k, stops[0]["threadId"])
    assert frame["line"] == 4 and "y" not in values  # rank 0 did not move
    # The rank picker: "%mesh select R" in the Evaluate dialog sends rank R's stopped event again (JupyterLab shows
    # the thread of the last one), from any rank's frame; a rank that is not stopped is refused with the ones that are.
    for rank in (0, 1):
        rep = k.dap("evaluate", expression=f"%mesh select {rank}", frameId=frame_id, context="repl")
        assert rep["success"] and rep["body"]["result"].startswith(f"rank {rank}:"), rep
        again = _stopped(k, 1)
        assert list(again) == [rank] and again[rank]["threadId"] == stops[rank]["threadId"]
    # Refused in the result (JupyterLab's Debug Console prints it; a failed evaluate shows only "Evaluation resulted
    # in an error"), and the rank shown stays: its stopped event again, as the reply blanked its variables.
    rep = k.dap("evaluate", expression="%mesh select 2", frameId=frame_id, context="repl")
    assert rep["success"] and "rank 2 is not stopped at a breakpoint (stopped now: ranks 0,1)" in rep["body"]["result"]
    assert list(_stopped(k, 1)) == [1]
    # continue resumes every stopped rank: the cell ends with every rank's value.
    rep = k.dap("continue", threadId=stops[0]["threadId"])
    assert rep["success"], rep
    k.wait(run)
    assert run.reply["status"] == "ok" and run.results == ["{0: 5, 1: 15, 2: 25}"], (run.stdout, run.errors)
    _breakpoints(k, code, [])
    run = k.execute(code)  # no breakpoint left: the same cell runs through
    assert run.results == ["{0: 5, 1: 15, 2: 25}"], (run.stdout, run.errors)
    assert k.execute("x_of_rank1 + 1").results == ["11"]


def test_breakpoint_call_goes_to_the_attached_debugger(k: DapKernel) -> None:
    run = k.submit("%%mesh --ranks 1\nw = 21\nbreakpoint()\nw * 2\n")
    stops = _stopped(k, 1)
    assert list(stops) == [1]
    frame, _, values = _locals(k, stops[1]["threadId"])
    assert values["w"] == "21" and frame["line"] == 4  # stopped in the cell (its %%mesh line counted), not in pdb
    assert not k.kc.stdin_channel.msg_ready()  # no (Pdb rank 1) prompt on stdin
    assert k.dap("continue", threadId=stops[1]["threadId"])["success"]
    k.wait(run)
    assert run.results == ["{1: 42}"], (run.stdout, run.errors)
    # JupyterLab's Continue names threadId 1 (a kernel thread) when it lost track of the rank's: the ranks go on.
    run = k.submit("%%mesh --ranks 1\nw = 22\nbreakpoint()\nw * 2\n")
    assert list(_stopped(k, 1)) == [1]
    assert k.dap("continue", threadId=1)["success"]
    k.wait(run)
    assert run.results == ["{1: 44}"], (run.stdout, run.errors)


def test_step_in_out_and_pause(k: DapKernel, tmp_path: object) -> None:
    code = "%%mesh --ranks 0\ndef f(a):\n    b = a * 2\n    return b\nc = f(rank + 4)\nc\n"
    _breakpoints(k, code, [5])
    run = k.submit(code)
    tid = _stopped(k, 1)[0]["threadId"]
    assert k.dap("stepIn", threadId=tid)["success"]
    frame, _, values = _locals(k, _stopped(k, 1)[0]["threadId"])
    assert (frame["name"], frame["line"], values["a"]) == ("rank 0: f", 3, "4")
    assert k.dap("stepOut", threadId=tid)["success"]
    frame, _, _ = _locals(k, _stopped(k, 1)[0]["threadId"])
    assert frame["name"] == "rank 0: <module>" and frame["line"] == 5
    assert k.dap("continue", threadId=tid)["success"]
    k.wait(run)
    assert run.results == ["{0: 8}"], (run.stdout, run.errors)
    _breakpoints(k, code, [])
    # pause: a rank that runs on stops where it is.
    stop = f"{tmp_path}/stop"
    run = k.submit(f"%%mesh --ranks 2\nimport os, time\nn = 0\nprint('looping', flush=True)\n"
                   f"while not os.path.exists({stop!r}):\n    n += 1\n    time.sleep(0.01)\nn > 0\n")
    k.wait_output(run, "[rank2]: looping")
    threads = [t for t in k.dap("threads")["body"]["threads"] if t["name"] == "rank 2: MainThread"]
    assert threads, k.dap("threads")
    assert k.dap("pause", threadId=threads[0]["id"])["success"]
    ev = _stopped(k, 1)[2]
    assert ev["reason"] == "pause"
    _, _, values = _locals(k, ev["threadId"])
    assert int(values["n"]) >= 0
    open(stop, "w").close()
    assert k.dap("continue", threadId=ev["threadId"])["success"]
    k.wait(run)
    assert run.results == ["{2: True}"], (run.stdout, run.errors)


def test_breakpoint_on_a_line_no_rank_runs(k: DapKernel) -> None:
    code = "%%mesh\nv = rank\nif v > 100:\n    v = -1\nv\n"
    _breakpoints(k, code, [4])
    run = k.execute(code)
    assert run.results == ["{0: 0, 1: 1, 2: 2}"], (run.stdout, run.errors)
    assert all(ev.get("event") != "stopped" for ev in list(k.events.queue))
    _breakpoints(k, code, [])


def test_disconnect_while_stopped_resumes_the_ranks(k: DapKernel) -> None:
    code = "%%mesh\nu = rank + 1\nu = u * 3\nu\n"
    _breakpoints(k, code, [3])
    run = k.submit(code)
    _stopped(k, 3)
    assert k.dap("disconnect", restart=False, terminateDebuggee=False)["success"]
    k.wait(run)
    assert run.results == ["{0: 3, 1: 6, 2: 9}"], (run.stdout, run.errors)
    # With no debugger attached, breakpoint() is the rank's pdb again (here its scripted form).
    run = k.execute('%%mesh --ranks 0 --pdb-commands "p 6 * 7; c"\nbreakpoint()\n7\n')
    assert run.results == ["{0: 7}"] and "(Pdb rank 0) p 6 * 7\n42\n" in run.stdout, (run.stdout, run.errors)
    k.debugger_on()  # and the debugger attaches again
    code = "%%mesh\nt = rank * 7\nt\n"
    _breakpoints(k, code, [3])
    run = k.submit(code)
    stops = _stopped(k, 3)
    _, _, values = _locals(k, stops[2]["threadId"])
    assert values["t"] == "14"
    k.dap("continue", threadId=stops[2]["threadId"])
    k.wait(run)
    assert run.results == ["{0: 0, 1: 7, 2: 14}"], (run.stdout, run.errors)
    _breakpoints(k, code, [])


def test_post_mortem_in_the_sidebar(k: DapKernel) -> None:
    code = "%%mesh\nv = rank * 3\nif rank == 1:\n    bad = v + 100\n    raise ValueError(f'rank {rank} fails')\nv\n"
    path = k.dap("dumpCell", code=code)["body"]["sourcePath"]
    run = k.execute(code)
    assert run.reply["status"] == "error" and "rank 1 fails" in str(run.errors), (run.stdout, run.errors)
    run = k.submit("%mesh debug --rank 1")  # the debugger is on: rank 1 stops in the sidebar, not at pdb
    stop = _stopped(k, 1)[1]
    frame, frame_id, values = _locals(k, stop["threadId"])
    assert (frame["source"]["path"], frame["line"], frame["name"]) == (path, 5, "rank 1: <module>"), frame
    assert values["bad"] == "103" and values["rank"] == "1", values
    ev = k.dap("evaluate", expression="bad * 2", frameId=frame_id, context="repl")
    assert ev["success"] and ev["body"]["result"] == "206", ev
    k.wait_output(run, "rank 1 is stopped at the failing frame of its last cell")
    assert not k.kc.stdin_channel.msg_ready()  # no (Pdb rank 1) prompt
    assert k.dap("continue", threadId=stop["threadId"])["success"]
    k.wait(run)
    assert run.reply["status"] == "ok", (run.stdout, run.errors)
    assert k.execute("%%mesh\nrank + 1\n").results == ["{0: 1, 1: 2, 2: 3}"]  # the mesh goes on
    # A rank not attached yet (restarted; its cell failed outside a %%mesh cell): it attaches, its traceback kept.
    assert k.execute("%mesh restart --rank 2").reply["status"] == "ok"
    assert k.execute("m.run('def f(n):\\n    return 10 // n\\nf(rank - 2)', ranks=[2])").reply["status"] == "error"
    run = k.submit("%mesh debug")
    stop = _stopped(k, 1)[2]
    frame, _, values = _locals(k, stop["threadId"])
    assert (frame["name"], frame["line"], values["n"]) == ("rank 2: f", 2, "0"), (frame, values)
    # The debugger switched off during a post-mortem: the rank goes on, the %mesh debug cell ends.
    assert k.dap("disconnect", restart=False, terminateDebuggee=False)["success"]
    k.wait(run)
    assert run.reply["status"] == "ok", (run.stdout, run.errors)
    k.debugger_on()
    # Nothing kept: the usual message, and pdb is not opened.
    run = k.execute("%mesh debug --rank 0")
    assert run.reply["status"] == "error" and "rank 0 keeps no traceback" in run.reply["evalue"], run.reply


def test_a_second_frontend_takes_the_debugger_over(k: DapKernel) -> None:
    code = "%%mesh --ranks 0\ng = 4\ng * 2\n"
    _breakpoints(k, code, [3])
    other = k.other_frontend()
    try:
        other.debugger_on()  # another tab (or this page reloaded) switches the debugger on: it drives it now
        run = k.submit(code)
        stop = _stopped(k, 1)[0]
        rep = k.dap("stackTrace", threadId=stop["threadId"])  # the first frontend is refused, and told why
        assert not rep["success"] and "switched on in another frontend" in rep["message"], rep
        rep = k.dap("evaluate", expression="%mesh select 0", context="repl")  # its Debug Console prints why
        assert rep["success"] and "switch the debugger off and on here" in rep["body"]["result"], rep
        assert k.dap("disconnect", restart=False, terminateDebuggee=False)["success"]  # ends its own view only
        frame = other.dap("stackTrace", threadId=stop["threadId"])["body"]["stackFrames"][0]
        assert (frame["name"], frame["line"]) == ("rank 0: <module>", 3), frame
        assert other.dap("continue", threadId=stop["threadId"])["success"]
        k.wait(run)
        assert run.results == ["{0: 8}"], (run.stdout, run.errors)
        k.debugger_on()  # and the first takes it back: the other one is refused now
        assert "switched on in another frontend" in other.dap("threads")["message"]
        assert k.dap("threads")["success"]
    finally:
        other.close()
    _breakpoints(k, code, [])


def test_a_rank_that_dies_while_stopped(k: DapKernel) -> None:
    code = "%%mesh --ranks 1\nimport os\nq = os.getpid()\nq\n"
    _breakpoints(k, code, [4])
    run = k.submit(code)
    stops = _stopped(k, 1)
    _, frame_id, values = _locals(k, stops[1]["threadId"])
    pid = int(values["q"])
    os.kill(pid, 9)
    # The frontend is told the rank's stopped thread is gone; the cell ends with the rank's death.
    ev = k.wait_event(lambda e: e.get("event") == "continued" and e["body"]["threadId"] == stops[1]["threadId"],
                      what="continued event of the dead rank")
    assert ev["body"]["allThreadsContinued"] is False
    k.wait(run)
    assert run.reply["status"] == "error", run
    rep = k.dap("variables", variablesReference=frame_id)
    assert not rep["success"] and "rank 1 is not attached" in rep["message"], rep
    _breakpoints(k, code, [])
    run = k.execute("%mesh restart")
    assert run.reply["status"] == "ok", (run.stdout, run.errors)


def test_attach_waits_for_a_busy_rank(k: DapKernel, tmp_path: object) -> None:
    run = k.execute("%mesh restart")  # fresh ranks, not attached yet
    assert run.reply["status"] == "ok", (run.stdout, run.errors)
    stop = f"{tmp_path}/stop"
    busy = f"import os, time\nwhile not os.path.exists({stop!r}):\n    time.sleep(0.01)\n'done'"
    run = k.execute(f"h = m.run({busy!r}, ranks=[1], block=False)")
    assert run.reply["status"] == "ok", (run.stdout, run.errors)
    code = "%%mesh --ranks 0,2\ne = rank\ne\n"
    _breakpoints(k, code, [3])
    run = k.submit("%%mesh --ranks 1\nrank")  # queued behind the busy cell: no attach, no interrupt of it
    k.wait_output(run, "the debugger attaches to rank 1 when idle")
    open(stop, "w").close()
    k.wait(run)
    assert run.results == ["{1: 1}"], (run.stdout, run.errors)
    assert k.execute("h.result()").results == ["{1: 'done'}"]
    run = k.submit(code)  # the idle ranks attach and stop as usual
    stops = _stopped(k, 2)
    assert sorted(stops) == [0, 2]
    k.dap("continue", threadId=stops[0]["threadId"])
    k.wait(run)
    assert run.results == ["{0: 0, 2: 2}"], (run.stdout, run.errors)
    _breakpoints(k, code, [])


def test_debugpy_missing_on_the_ranks(k: DapKernel) -> None:
    run = k.execute("%mesh restart")
    assert run.reply["status"] == "ok", (run.stdout, run.errors)
    # As if debugpy were not installed on the ranks (m.run: not a %%mesh cell, which would attach them first).
    run = k.execute("_ = m.run(\"import sys\\nsys.modules['debugpy'] = None\")")
    assert run.reply["status"] == "ok", (run.stdout, run.errors)
    code = "%%mesh\ns = rank\ns\n"
    _breakpoints(k, code, [3])
    run = k.execute(code)
    assert run.results == ["{0: 0, 1: 1, 2: 2}"], (run.stdout, run.errors)
    assert "the debugger cannot attach to the ranks" in run.stdout and "pip install 'monarch-jupyter[debug]'" \
        in run.stdout, run.stdout
    _breakpoints(k, code, [])
